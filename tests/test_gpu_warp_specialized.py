"""The warp-specialised sm_90a forward on the GPU (marked `gpu`; Hopper only): what the shipped
specs' suite (tests/test_gpu.py) does not reach. A prepared call re-pointed at other tensors
encodes their tensor maps anew; tensors TMA cannot describe are refused before launch; a
persistent kernel (one block an SM walking more tiles than there are SMs) matches the oracle on
every mask shape, tiles without keys and split-KV included; and compute-sanitizer's memcheck,
racecheck and synccheck find nothing in representative launches."""

import pytest

import fagen
from fagen import oracle, tune, variants
from fagen.check import OUT_TOLERANCE, check_against_oracle, random_inputs, relative_error, to_numpy
from fagen.load import parse_spec
from fagen.runtime import compile_kernel
from fagen.spec import Mask, ScoreMod

pytestmark = pytest.mark.gpu


def _hopper_default(causal: bool = False):
    spec = variants.shipped_spec("float16", 128, causal, gpu="h200")
    if not spec.warp_specialized:
        pytest.fail("the shipped H200 d128 default is expected to be warp-specialised")
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("sm_90a kernels need a Hopper GPU")
    return spec


def persistent(spec, **changes):
    """spec with a persistent tile scheduler (and other top-level fields changed)."""
    data = {**spec.model_dump(mode="json"), **changes}
    data["pipeline"]["warp_specialized"]["persistent"] = True
    data["name"] = spec.name + "_persistent"
    return parse_spec(data, data["name"])


# (dtype, head_dim, causal, mask, score_mod, B, Hq, Hkv, Nq, Nk): more tiles than an H200's 132
# SMs, so blocks walk several (under causal, of different lengths); Nq > Nk bottom-right leaves
# the first tiles without keys; sliding windows skip tiles at both ends.
PERSISTENT_CASES = [
    ("float16", 128, False, None, None, 1, 40, 40, 500, 777),
    ("float16", 128, True, None, None, 2, 24, 8, 1100, 1100),
    ("bfloat16", 64, True, None, None, 1, 8, 2, 3000, 900),
    ("float16", 256, False, Mask(kind="sliding_window", window_left=300, window_right=40), None, 1, 36, 12, 700, 700),
    ("bfloat16", 128, False, None, ScoreMod(softcap=30.0), 3, 50, 50, 333, 520),
    ("float16", 64, False, None, None, 1, 24, 8, 1000, 1300),  # three consumer warpgroups, 192-row tiles
]


@pytest.mark.parametrize("dtype,d,causal,mask,score_mod,b,hq,hkv,nq,nk", PERSISTENT_CASES)
def test_a_persistent_kernel_walks_every_tile(dtype, d, causal, mask, score_mod, b, hq, hkv, nq, nk):
    _hopper_default()
    base = variants.shipped_spec(dtype, d, causal, gpu="h200")
    spec = persistent(variants.variant(base, mask or base.mask, score_mod or base.score_mod))
    assert spec.warp_specialized and compile_kernel(spec).plan.persistent
    result = check_against_oracle(spec, b, hq, hkv, nq, nk, framework="torch")
    assert result.passed, result.summary()


@pytest.mark.parametrize("section", [1, 3, 7])
@pytest.mark.parametrize("causal,persistent_walk", [(False, True), (True, False), (True, True)])
def test_a_walk_in_sections_of_heads_covers_every_tile(monkeypatch, section, causal, persistent_walk):
    """Sections of 1, 3 and 7 heads (the last one narrower) over 2 x 9 heads, a block a tile and
    persistent: every tile computed once, whatever the walk's order."""
    base = _hopper_default(causal)
    monkeypatch.setattr(fagen.runtime, "l2_section", lambda *args: section)
    spec = tune.with_scheduler(base, persistent_walk)
    result = check_against_oracle(spec, 2, 9, 3, 700, 900, framework="torch")
    assert result.passed, result.summary()


@pytest.mark.parametrize("causal", [False, True])
def test_three_consumer_warpgroups_a_block_a_tile(causal):
    """The d64 default's three consumer warpgroups taking turns (ping-pong in a round), a block a
    tile: partial 192-row tiles at both lengths, GQA, and under causal tiles of different lengths.
    (Causal: the long class's; below 2048 keys d64 causal takes two warpgroups.)"""
    _hopper_default()
    spec = tune.with_scheduler(variants.shipped_spec("float16", 64, causal, gpu="h200", keys=variants.LONG_KEYS), False)
    assert spec.tiling.warps_q == 12 and spec.pipeline.pingpong
    result = check_against_oracle(spec, 2, 6, 2, 777, 901, framework="torch")
    assert result.passed, result.summary()


def test_a_persistent_split_kv_kernel_walks_its_splits():
    """Split-KV's splits are the tile grid's z: each partial still matches the oracle once merged."""
    _hopper_default()
    spec = persistent(variants.shipped_spec("float16", 128, True, gpu="h200"), outputs={"lse": True, "partial": True},
                      backward=None)
    result = check_against_oracle(spec, 1, 20, 4, 900, 2500, framework="torch")  # 3 splits
    assert result.passed, result.summary()


@pytest.mark.parametrize("dtype,d,dv,n", [("float16", 128, 128, 1100), ("bfloat16", 192, 128, 2100)])
def test_a_claimed_walk_zeroes_its_counters_for_the_next_launch(dtype, d, dv, n):
    """A persistent causal walk claims its tiles from a counter pair that its last block zeroes
    (no memset a call): one prepared launch run again and again, and replayed from a CUDA graph,
    covers every tile each time, out NaN-filled before each run. d128 below 2048 keys takes the
    persistent base class, 192/128 at 2100 its long class's persistent variant."""
    _hopper_default()
    import torch

    q, k, v, _ = random_inputs("torch", dtype, 2, 16, 4, n, n, d, d_v=dv)
    ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True)
    out = torch.empty(2, 16, n, dv, device="cuda", dtype=q.dtype)
    prepared = fagen.prepare(q, k, v, causal=True)
    walk = compile_kernel(prepared.spec).plan
    assert walk.persistent and walk.claimed_walk and prepared.kernel.held is not None  # more tiles than SMs
    for _ in range(3):
        out.fill_(float("nan"))
        prepared(q, k, v, out=out)
        assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE[dtype]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        prepared(q, k, v, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE[dtype]


def test_a_kept_claimed_walk_is_each_stream_s_own_and_not_a_graph_s():
    """A kernel's repeated calls keep their launch, whose causal walk over several waves claims
    from the counter pair it holds: calls on two streams each keep one of their own (queued behind
    a sleep on both, so that they overlap), and a graph recorded after eager calls packs its own,
    replayed on a side stream beside eager calls; every output covers every tile."""
    _hopper_default()
    import torch

    q, k, v, _ = random_inputs("torch", "float16", 2, 16, 4, 1100, 1100, 128)
    ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True)
    kernel = compile_kernel(variants.shipped_spec("float16", 128, True, gpu="h200"))
    assert kernel.plan.claimed_walk and kernel.repeated_calls.per_stream
    streams, outs = [torch.cuda.Stream() for _ in range(2)], []
    for _ in range(3):
        for stream in streams:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                torch.cuda._sleep(1_000_000)  # both streams' calls queue behind it: they run at once
        for _ in range(2):
            for stream in streams:
                with torch.cuda.stream(stream):
                    outs.append(kernel(q, k, v))
        torch.cuda.synchronize()
    assert sum(launch.claims for launch in kernel.repeated_calls._launches.values()) == 2  # one a stream
    for out in outs:
        assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"]
    graph, side, replay = torch.cuda.CUDAGraph(), torch.cuda.Stream(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=side):
        captured = kernel(q, k, v)
    for _ in range(3):
        captured.fill_(float("nan"))
        replay.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(replay):
            torch.cuda._sleep(1_000_000)
            graph.replay()
        eager = kernel(q, k, v)
        torch.cuda.synchronize()
        assert relative_error(to_numpy(captured), ref) < OUT_TOLERANCE["float16"]
        assert relative_error(to_numpy(eager), ref) < OUT_TOLERANCE["float16"]


def test_a_prepared_call_re_encodes_its_maps_for_new_tensors():
    _hopper_default()
    first = random_inputs("torch", "float16", 2, 4, 2, 333, 517, 128)
    prepared = fagen.prepare(*first[:3], causal=True)
    fresh = [random_inputs("torch", "float16", 2, 4, 2, 333, 517, 128) for _ in range(3)]
    # new tensors; then a new q beside the first k and v (a decode loop's cache: maps kept); the first again
    for q, k, v, out in (fresh[0], fresh[1], (fresh[2][0], first[1], first[2], fresh[2][3]), first):
        got, lse = prepared(q, k, v, out=out, return_lse=True)
        ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), mask=Mask(kind="causal"), return_lse=True)
        assert relative_error(to_numpy(got), ref) < OUT_TOLERANCE["float16"]
        assert relative_error(to_numpy(lse), ref_lse) < 1e-4


def test_variants_of_the_warp_specialized_default():
    """A mask with a modifier and sinks, on the TMA producer's kernel (fagen.attention's path)."""
    base = _hopper_default()
    spec = variants.variant(base, Mask(kind="sliding_window", window_left=200), ScoreMod(softcap=20.0, sinks=True))
    assert spec.warp_specialized
    q, k, v, out = random_inputs("torch", "float16", 1, 4, 1, 700, 700, 128)
    import torch

    sinks = torch.randn(4, device="cuda")
    got = compile_kernel(spec)(q, k, v, out=out, sinks=sinks)
    ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), mask=spec.mask, softcap=20.0,
                           sinks=sinks.cpu().numpy())
    assert relative_error(to_numpy(got), ref) < OUT_TOLERANCE["float16"]


# Variants on the tiles the register estimate first refused and ptxas showed they fit (sinks held
# through no loop; plan.CONSUMERS_MEASURED_FIT): (dtype, head_dim, causal, keys, mask, score_mod, tile)
TILES_MEASURED = [
    ("float16", 64, True, 4096, Mask(kind="causal"), ScoreMod(sinks=True), (192, 128)),  # main's: 128 x 128
    ("bfloat16", 64, False, None, Mask(), ScoreMod(sinks=True), (192, 128)),  # 192 x 96
    ("float16", 128, True, 4096, Mask(kind="causal"), ScoreMod(softcap=30.0, alibi="slopes", sinks=True), (192, 80)),
    ("bfloat16", 128, True, 4096, Mask(kind="causal"), ScoreMod(softcap=30.0), (192, 80)),  # 192 x 64
    ("float16", 256, False, None, Mask(kind="document", causal=True), ScoreMod(softcap=30.0, sinks=True), (128, 80)),
]


@pytest.mark.parametrize("dtype,d,causal,keys,mask,score_mod,tile", TILES_MEASURED)
def test_variants_on_the_tiles_ptxas_showed_they_fit(dtype, d, causal, keys, mask, score_mod, tile):
    """Each keeps the tile its register rule now allows (larger than main's fallback) and matches
    the oracle at awkward shapes, its side inputs random and its outputs NaN-poisoned."""
    _hopper_default()
    base = variants.shipped_spec(dtype, d, causal, gpu="h200", keys=keys)
    spec = variants.variant(base, mask, score_mod)
    assert spec.warp_specialized and (spec.tiling.block_q, spec.tiling.block_kv) == tile
    nk = 700 if causal or mask.kind == "document" else 900
    result = check_against_oracle(spec, 1, 4, 2, 700, nk, framework="torch")
    assert result.passed, result.summary()


def test_a_broadcast_tensor_is_refused_before_launch():
    import torch

    spec = _hopper_default()
    q, k, v, out = random_inputs("torch", "float16", 1, 4, 1, 128, 128, 128)
    k4 = k.expand(1, 4, 128, 128)  # head stride 0: TMA needs a positive multiple of 16 bytes
    out.fill_(7)
    with pytest.raises(ValueError, match="k: head stride 0"):
        compile_kernel(spec)(q, k4, v.expand(1, 4, 128, 128), out=out)
    torch.cuda.synchronize()
    assert bool((out == 7).all())  # nothing ran


SANITIZED = """
import torch, fagen
from fagen import tune, variants
from fagen.runtime import compile_kernel
from fagen.check import random_inputs
from fagen.spec import ScoreMod
# d64: three consumer warpgroups, 192-row tiles
for d, causal, nq in ((128, False, 500), (128, True, 500), (64, True, 700)):
    spec = variants.shipped_spec("float16", d, causal, gpu="h200")
    # a block a tile, then persistent over 144 tiles (some of the 132 blocks walk two)
    for persistent, shape in ((False, (1, 2, 1, 300, 421)), (True, (1, 36, 12, nq, 640))):
        q, k, v, out = random_inputs("torch", "float16", *shape, d)
        compile_kernel(tune.with_scheduler(spec, persistent))(q, k, v, out=out)
# a matrix bias under causal tiles that end at n_q (the first tile's rows before 0 read none)
biased = variants.variant(spec, spec.mask, ScoreMod(bias="matrix"))
q, k, v, out = random_inputs("torch", "float16", 1, 4, 4, 700, 700, 64)
compile_kernel(biased)(q, k, v, out=out, bias=torch.randn(1, 4, 700, 700, device="cuda"))
# a plain call repeated on new tensors: the first call's launch, re-pointed, its maps re-encoded
for seed in (1, 2):
    q, k, v, out = random_inputs("torch", "float16", 1, 4, 2, 700, 640, 64, seed=seed)
    compile_kernel(spec)(q, k, v, out=out)
torch.cuda.synchronize()
print("ran")
"""


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer_is_clean(tool):
    from conftest import assert_sanitizer_clean

    _hopper_default()
    assert_sanitizer_clean(tool, SANITIZED)
