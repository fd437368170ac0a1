"""An FP8 KV cache on the GPU (marked `gpu`; sm_90): a bfloat16 or float16 q against e4m3 or e5m2 k
and v with FlashAttention-3's k_descale and v_descale, through the decode kernels, against the
float64 oracle on the same FP8 values.

The kernel widens K and V to float16 exactly and rounds nothing but P (to float16, as the half-type
kernels round it to their own type), Q (a bfloat16 q rescaled by a power of two into float16:
exact) and O to q's type, so it meets q's type's own tolerance against exact attention of the FP8
values (element_types.ElementType.tolerance)."""

import zlib

import numpy as np
import pytest

from fagen import oracle, variants
from fagen.check import in_a_cuda_graph, relative_error, to_numpy
from fagen.element_types import ELEMENT_TYPES
from fagen.runtime import compile_kernel


pytestmark = pytest.mark.gpu

CASES = [  # (q dtype, kv dtype, B, Hq, Hkv, Nq, Nk, causal, |q| scale)
    ("bfloat16", "float8_e4m3", 2, 32, 8, 1, 4097, False, 1.0),  # keys past the last whole tile
    ("bfloat16", "float8_e4m3", 1, 8, 1, 2, 1000, True, 1.0),  # MQA, two query rows, bottom-right causal
    ("float16", "float8_e4m3", 3, 16, 4, 1, 300, False, 1.0),
    ("bfloat16", "float8_e5m2", 2, 8, 2, 1, 2048, False, 1.0),
    ("bfloat16", "float8_e4m3", 1, 32, 8, 1, 3000, False, 3e5),  # |q| past float16's range: rescaled
    ("bfloat16", "float8_e4m3", 1, 32, 8, 1, 3000, False, 1e-6),  # ... and far under its normals
    ("bfloat16", "float8_e4m3", 64, 32, 8, 1, 512, False, 1.0),  # blocks enough unsplit
    ("bfloat16", "float8_e4m3", 2, 32, 2, 4, 1500, True, 1.0),  # 64 packed rows: the q64 kernel
]


def cache(rng, shape, dtype: str, torch):
    """An FP8 tensor of a Gaussian activation and its per-(batch, KV head) descale (amax over the
    type's largest finite value, times a random factor in [1, 2): heads differ): true = FP8 * descale."""
    element = ELEMENT_TYPES[dtype]
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).cuda()
    descale = x.abs().amax(dim=(2, 3)) / element.max_finite
    descale = descale * torch.from_numpy(rng.uniform(1.0, 2.0, descale.shape).astype(np.float32)).cuda()
    return (x / descale[:, :, None, None]).to(getattr(torch, element.torch_name)), descale


def inputs(rng, dtype, kv_dtype, b, hq, hkv, nq, nk, q_scale, torch, d: int = 128):
    q = torch.from_numpy(rng.standard_normal((b, hq, nq, d)).astype(np.float32) * q_scale).cuda()
    q = q.to(getattr(torch, dtype))
    (k8, kd), (v8, vd) = (cache(rng, (b, hkv, nk, d), kv_dtype, torch) for _ in range(2))
    return q, k8, v8, kd, vd


def shuffled_table(rng, need: list[int], spare: int = 2) -> tuple[np.ndarray, int]:
    """A page table [B, max(need)] (int32) over a cache of sum(need) + spare pages in shuffled
    order: sequence b's first need[b] entries are its own pages, the rest 0 (never read)."""
    order = rng.permutation(sum(need) + spare)
    table = np.zeros((len(need), max(need)), np.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = order[used:used + n]
        used += n
    return table, len(order)


def exact(q, k8, v8, kd, vd, causal: bool):
    """Attention of the FP8 values times their descales, float64 (the oracle's FP8 steps, P unrounded)."""
    return oracle.attention(*(to_numpy(x.float()) for x in (q, k8, v8)), causal=causal,
                            k_descale=to_numpy(kd), v_descale=to_numpy(vd))


@pytest.mark.parametrize("dtype,kv_dtype,b,hq,hkv,nq,nk,causal,q_scale", CASES)
def test_fagen_attention_reads_an_fp8_kv_cache(dtype, kv_dtype, b, hq, hkv, nq, nk, causal, q_scale):
    """fagen.attention with a half-type q and FP8 k and v takes the decode kernels' FP8 variant and
    meets q's type's tolerance against exact attention of the FP8 values."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(zlib.crc32(repr((dtype, kv_dtype, b, hq, nq, nk, q_scale)).encode()))
    q, k8, v8, kd, vd = inputs(rng, dtype, kv_dtype, b, hq, hkv, nq, nk, q_scale, torch)
    with torch.no_grad():
        got = fagen.attention(q, k8, v8, causal=causal, k_descale=kd, v_descale=vd)
    assert got.dtype == q.dtype and got.shape == q.shape
    error = relative_error(to_numpy(got.float()), exact(q, k8, v8, kd, vd, causal))
    assert error <= ELEMENT_TYPES[dtype].tolerance, error


@pytest.mark.parametrize("d,dtype,kv_dtype,b,hq,hkv,nq,nk,causal", [
    (64, "bfloat16", "float8_e4m3", 2, 32, 8, 1, 4097, False),  # Llama-3.2-1B's heads: 32 / 8 of 64
    (64, "float16", "float8_e5m2", 1, 8, 2, 3, 1000, True),
    (64, "bfloat16", "float8_e4m3", 64, 32, 8, 1, 512, False),  # blocks enough unsplit
    (64, "bfloat16", "float8_e4m3", 2, 16, 4, 100, 900, True),  # a chunk: 400 rows over the chunk kernel's 128-row tiles
    (256, "bfloat16", "float8_e4m3", 2, 8, 4, 1, 3001, False),  # Gemma-2's heads: 8 / 4 of 256
    (256, "float16", "float8_e5m2", 1, 16, 2, 2, 1000, True),
    (256, "bfloat16", "float8_e4m3", 64, 8, 4, 1, 512, False),
    (256, "bfloat16", "float8_e4m3", 1, 8, 4, 30, 700, True),  # a chunk: 60 rows over the q16 kernel's tiles
])
def test_an_fp8_kv_cache_at_head_dim_64_and_256_matches_the_oracle(d, dtype, kv_dtype, b, hq, hkv, nq, nk, causal):
    """head_dim 64 against an FP8 cache (rows of four 16-byte chunks, swizzled by (row / 2) % 4) and
    256 (16 keys a key warp: K read two n8 fragments at a time): q's type's tolerance against
    exact attention of the FP8 values, out written over NaN."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(zlib.crc32(repr((dtype, kv_dtype, b, hq, nq, nk, d)).encode()))
    q, k8, v8, kd, vd = inputs(rng, dtype, kv_dtype, b, hq, hkv, nq, nk, 1.0, torch, d=d)
    with torch.no_grad():
        got = fagen.attention(q, k8, v8, causal=causal, k_descale=kd, v_descale=vd)
    assert got.dtype == q.dtype and got.shape == q.shape and not torch.isnan(got).any()
    error = relative_error(to_numpy(got.float()), exact(q, k8, v8, kd, vd, causal))
    assert error <= ELEMENT_TYPES[dtype].tolerance, error


@pytest.mark.parametrize("b,nk,causal", [(2, 3000, False), (64, 512, True)])  # split (sinks in the merge), unsplit
def test_an_fp8_kv_cache_takes_sinks_and_alibi_slopes(b, nk, causal):
    """gpt-oss's sinks and ALiBi slopes beside an FP8 cache: the sinks join in the split kernels'
    merge (or the unsplit kernel's epilogue), the slopes on the descaled scores; bfloat16's
    tolerance against exact attention of the FP8 values, out written over NaN."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng([b, nk])
    hq, hkv = 32, 8
    q, k8, v8, kd, vd = inputs(rng, "bfloat16", "float8_e4m3", b, hq, hkv, 1, nk, 1.0, torch)
    sinks = rng.uniform(-1.0, 4.0, hq).astype(np.float32)
    slopes = rng.uniform(0.001, 0.05, hq).astype(np.float32)
    with torch.no_grad():
        got = fagen.attention(q, k8, v8, causal=causal, sinks=torch.from_numpy(sinks).cuda(),
                              alibi_slopes=torch.from_numpy(slopes).cuda(), k_descale=kd, v_descale=vd)
    want = oracle.attention(*(to_numpy(x.float()) for x in (q, k8, v8)), causal=causal, sinks=sinks,
                            alibi_slopes=slopes, k_descale=to_numpy(kd), v_descale=to_numpy(vd))
    assert not torch.isnan(got).any()
    assert relative_error(to_numpy(got.float()), want) <= ELEMENT_TYPES["bfloat16"].tolerance


@pytest.mark.parametrize("d,causal", [(128, True), (64, False), (256, True)])
def test_an_fp8_kv_cache_takes_key_ranges(d, causal):
    """cache_seqlens and cache_leftpad (a left-padded batch, a static cache) beside an FP8 cache:
    sequence b's keys are rows cache_leftpad[b] .. cache_seqlens[b], masks bottom right in each;
    each sequence within bfloat16's tolerance of exact attention of its FP8 rows, out over NaN."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng([d, causal])
    b, hq, hkv, nq, slots = 4, 16, 4, 2, 1500
    q, k8, v8, kd, vd = inputs(rng, "bfloat16", "float8_e4m3", b, hq, hkv, nq, slots, 1.0, torch, d=d)
    ends = np.array([1500, 700, 2, 1100], np.int32)
    starts = np.array([0, 300, 0, 1099], np.int32)
    with torch.no_grad():
        got = fagen.attention(q, k8, v8, causal=causal, k_descale=kd, v_descale=vd,
                              cache_seqlens=torch.from_numpy(ends).cuda(), cache_leftpad=torch.from_numpy(starts).cuda())
    assert not torch.isnan(got).any()
    qn, kn, vn = (to_numpy(x.float()) for x in (q, k8, v8))
    for i in range(b):
        keys = slice(starts[i], ends[i])
        want = oracle.attention(qn[i:i + 1], kn[i:i + 1, :, keys], vn[i:i + 1, :, keys], causal=causal,
                                k_descale=to_numpy(kd)[i:i + 1], v_descale=to_numpy(vd)[i:i + 1])
        error = relative_error(to_numpy(got[i:i + 1].float()), want)
        assert error <= ELEMENT_TYPES["bfloat16"].tolerance, (i, error)


@pytest.mark.parametrize("form", ["split", "merged", "unsplit"])
def test_each_fp8_kv_kernel_writes_every_output(form):
    """The FP8 variant of the d128 decode kernel as the merge kernel's split, merging its own
    splits, and unsplit, each into NaN-poisoned outputs: O and the LSE against the oracle's."""
    torch = pytest.importorskip("torch")
    from fagen.splitkv import merge

    rng = np.random.default_rng(5)
    b, hq, hkv, nq, nk = 2, 16, 4, 1, 2500
    q, k8, v8, kd, vd = inputs(rng, "bfloat16", "float8_e4m3", b, hq, hkv, nq, nk, 1.0, torch)
    base = variants.fp8_kv_variant(variants.decode_spec("bfloat16", 128, nq * hq // hkv), "float8_e4m3")
    spec = {"split": base, "merged": variants.merged_variant(base), "unsplit": variants.unsplit_variant(base)}[form]
    kernel = compile_kernel(spec)
    nan = float("nan")
    if form == "split":
        parts = torch.full((4, b, hq, nq, 128), nan, device="cuda"), torch.full((4, b, hq, nq), nan, device="cuda")
        o_parts, lse_parts = kernel(q, k8, v8, splits=4, out=parts[0], lse=parts[1], k_descale=kd, v_descale=vd)
        out, lse = merge(o_parts, lse_parts, out_dtype="bfloat16")
    else:
        out = torch.full_like(q, nan)
        out, lse = kernel(q, k8, v8, out=out, return_lse=True, k_descale=kd, v_descale=vd,
                          **({"splits": 4} if form == "merged" else {}))
    want, want_lse = oracle.attention(*(to_numpy(x.float()) for x in (q, k8, v8)), return_lse=True,
                                      k_descale=to_numpy(kd), v_descale=to_numpy(vd))
    assert relative_error(to_numpy(out.float()), want) <= ELEMENT_TYPES["bfloat16"].tolerance
    np.testing.assert_allclose(to_numpy(lse), want_lse, rtol=0, atol=1e-3)


@pytest.mark.parametrize("hq,hkv,nq,nk,causal", [
    (8, 1, 256, 512, True),  # 2048 packed rows: 32 row tiles of the q64 kernel
    (32, 8, 100, 1200, True),  # 400 rows, the last tile part-filled, bottom-right causal
    (16, 4, 40, 700, False),
])
def test_a_chunk_of_queries_reads_an_fp8_kv_cache(hq, hkv, nq, nk, causal):
    """More packed query rows than a decode kernel holds (chunked prefill against the cache): the
    largest decode kernel's FP8 variant over several row tiles, into NaN-poisoned out, within
    bfloat16's tolerance of exact attention of the FP8 values; q_descale (a half-type q has
    none) is still refused."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng([hq, hkv, nq, nk])
    q, k8, v8, kd, vd = inputs(rng, "bfloat16", "float8_e4m3", 2, hq, hkv, nq, nk, 1.0, torch)
    with torch.no_grad():
        got = fagen.attention(q, k8, v8, causal=causal, k_descale=kd, v_descale=vd)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert relative_error(to_numpy(got.float()), exact(q, k8, v8, kd, vd, causal)) <= ELEMENT_TYPES["bfloat16"].tolerance
    with pytest.raises(ValueError, match="q_descale"):
        fagen.attention(q[:, :, :1], k8, v8, q_descale=kd, k_descale=kd, v_descale=vd)


@pytest.mark.parametrize("d", [128, 64])
def test_a_chunk_beside_a_window_softcap_and_alibi_reads_an_fp8_kv_cache(d):
    """The chunk kernel's narrower key tile (d128: 64 keys where a window, softcap and ALiBi take
    the registers of 128) within bfloat16's tolerance of exact attention of the FP8 values."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng([d, 3])
    hq, hkv, nq, nk = 16, 4, 90, 1300
    q, k8, v8, kd, vd = inputs(rng, "bfloat16", "float8_e4m3", 2, hq, hkv, nq, nk, 1.0, torch, d=d)
    slopes = rng.uniform(0.001, 0.05, hq).astype(np.float32)
    mask = {"kind": "sliding_window", "window_left": 300, "window_right": 0}
    with torch.no_grad():
        got = fagen.attention(q, k8, v8, mask=mask, softcap=20.0, alibi_slopes=torch.from_numpy(slopes).cuda(),
                              k_descale=kd, v_descale=vd)
    want = oracle.attention(*(to_numpy(x.float()) for x in (q, k8, v8)), mask=mask, softcap=20.0,
                            alibi_slopes=slopes, k_descale=to_numpy(kd), v_descale=to_numpy(vd))
    assert not torch.isnan(got).any()
    assert relative_error(to_numpy(got.float()), want) <= ELEMENT_TYPES["bfloat16"].tolerance


def test_a_chunk_of_queries_reads_a_paged_fp8_cache():
    """attention_with_kvcache with 48 new queries a sequence (GQA 4: 192 packed rows, three tiles)
    against a shuffled e4m3 paged cache, causal bottom right in each sequence, into NaN out."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(17)
    lens, page_size, hq, hkv, d, nq = [900, 48, 2000], 64, 16, 4, 128, 48
    b = len(lens)
    table, num_pages = shuffled_table(rng, [-(-n // page_size) for n in lens])
    (k8, _), (v8, _) = (cache(rng, (num_pages, page_size, hkv, d), "float8_e4m3", torch) for _ in range(2))
    kd, vd = (torch.from_numpy(rng.uniform(0.5, 2.0, (b, hkv)).astype(np.float32)).cuda() for _ in range(2))
    q = torch.from_numpy(rng.standard_normal((b, hq, nq, d)).astype(np.float32)).cuda().to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    fagen.attention_with_kvcache(q, k8, v8, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                 torch.from_numpy(table).cuda(), causal=True, out=out, k_descale=kd, v_descale=vd)
    want = oracle.attention_paged(*(to_numpy(x.float()) for x in (q, k8, v8)), table, lens, causal=True,
                                  k_descale=to_numpy(kd), v_descale=to_numpy(vd))
    assert relative_error(to_numpy(out.float()), want) <= ELEMENT_TYPES["bfloat16"].tolerance


@pytest.mark.parametrize("page_size,d", [(16, 128), (64, 128), (256, 128), (16, 64), (64, 256)])
def test_a_paged_fp8_cache_matches_the_oracle(page_size, d):
    """attention_with_kvcache over an e4m3 paged cache (pages shuffled, spare pages of garbage,
    ragged lengths with an empty one), per-(sequence, KV head) descales, into NaN-poisoned out."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng([page_size, d])
    lens = [int(x) for x in rng.integers(1, 3000, 5)] + [0]
    b, hq, hkv = len(lens), 32, 8
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + 3
    order = rng.permutation(num_pages)
    table = np.full((b, max(need) + 1), -7, np.int32)  # unused entries: never read
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = order[used:used + n]
        used += n
    (k8, kd), (v8, vd) = (cache(rng, (num_pages, page_size, hkv, d), "float8_e4m3", torch) for _ in range(2))
    # cache()'s descales are per page; a sequence's are per (sequence, KV head): one of its own
    kd, vd = (torch.from_numpy(rng.uniform(0.5, 2.0, (b, hkv)).astype(np.float32)).cuda() for _ in range(2))
    q = torch.from_numpy(rng.standard_normal((b, hq, 1, d)).astype(np.float32)).cuda().to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    fagen.attention_with_kvcache(q, k8, v8, seqlens, torch.from_numpy(table).cuda(), out=out, status=status,
                                 k_descale=kd, v_descale=vd)
    want = oracle.attention_paged(*(to_numpy(x.float()) for x in (q, k8, v8)), np.maximum(table, 0), lens,
                                  k_descale=to_numpy(kd), v_descale=to_numpy(vd))
    assert relative_error(to_numpy(out.float()), want) <= ELEMENT_TYPES["bfloat16"].tolerance
    assert int(status.item()) == 0


def test_a_compiled_layer_reading_an_fp8_cache_replays_in_a_cuda_graph():
    """fagen.attention on a bfloat16 q and an e4m3 cache compiles with fullgraph=True (through
    fagen::fp8_attention_forward) and replays in a CUDA graph the result of the path the op runs
    (decode.attention), bit for bit, on new values of the same tensors. (The eager call's kept
    class may split the keys otherwise: it was made at another length of its class, maybe by an
    earlier test, so it is held to the tolerance, not to the bits.)"""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(13)
    q, k8, v8, kd, vd = inputs(rng, "bfloat16", "float8_e4m3", 2, 32, 8, 1, 4096, 1.0, torch)

    def layer(q, k, v):
        return fagen.attention(q, k, v, k_descale=kd, v_descale=vd)

    def general(q, k, v):
        return fagen.decode.attention(q, k, v, k_descale=kd, v_descale=vd)

    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        eager = layer(q, k8, v8)
        assert torch.equal(compiled(q, k8, v8), general(q, k8, v8))
        assert relative_error(to_numpy(eager.float()), exact(q, k8, v8, kd, vd, False)) \
            <= ELEMENT_TYPES["bfloat16"].tolerance
        graph, replayed = in_a_cuda_graph(lambda: compiled(q, k8, v8))
        new = inputs(rng, "bfloat16", "float8_e4m3", 2, 32, 8, 1, 4096, 1.0, torch)
        for x, fresh in zip((q, k8, v8), new[:3]):
            x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, general(q, k8, v8))


def test_descales_are_read_through_their_own_strides_and_kept_by_a_prepared_call():
    """Each descale is read where it lies: a transposed [B, Hkv] view, a 0-d tensor and a number
    give the oracle's result (as contiguous copies do); a prepared call keeps its values at prepare
    time, later writes to the caller's tensors notwithstanding."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(23)
    q, k8, v8, kd, vd = inputs(rng, "bfloat16", "float8_e4m3", 3, 32, 8, 1, 1500, 1.0, torch)
    kd_view = kd.t().contiguous().t()  # strides (1, 3): the values of kd, not contiguous
    assert not kd_view.is_contiguous()
    v_scalar = vd[1, 2].clone()  # a 0-d tensor: every (sequence, head) reads it
    with torch.no_grad():
        step = fagen.prepare(q, k8, v8, k_descale=kd_view, v_descale=v_scalar)
        for kd_given, vd_given in ((kd_view, v_scalar), (kd_view, float(v_scalar))):
            got = fagen.attention(q, k8, v8, k_descale=kd_given, v_descale=vd_given)
            want = exact(q, k8, v8, kd, torch.full_like(vd, float(v_scalar)), False)
            assert relative_error(to_numpy(got.float()), want) <= ELEMENT_TYPES["bfloat16"].tolerance
        before = fagen.attention(q, k8, v8, k_descale=kd_view, v_descale=v_scalar)
        kd_view.mul_(2.0)
        v_scalar.mul_(3.0)
        assert torch.equal(step(q, k8, v8), before)  # the prepared call's descales: as at prepare time


def test_a_descale_left_out_under_capture_reads_one_outside_the_graph():
    """The kept 1.0 that a descale left out reads is made outside stream capture only: where a
    device's first FP8 call is captured, eager calls are right before any replay, and so is the
    replay."""
    torch = pytest.importorskip("torch")
    import fagen
    from fagen import fp8_inputs

    rng = np.random.default_rng(29)
    q, k8, v8, kd, _ = inputs(rng, "bfloat16", "float8_e4m3", 2, 32, 8, 1, 700, 1.0, torch)
    with torch.no_grad():
        want = fagen.attention(q, k8, v8, k_descale=kd)  # (compiles outside the capture)
        fp8_inputs._ONES.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fagen.attention(q, k8, v8, k_descale=kd)
        assert not fp8_inputs._ONES  # nothing kept from the capture
        assert torch.equal(fagen.attention(q, k8, v8, k_descale=kd), want)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, want)


def test_a_class_first_met_under_capture_is_not_kept(monkeypatch):
    """A call whose class is first made during stream capture (its split counts zeroed, the 1.0 a
    left-out descale reads, filled by nodes of the graph) runs once, unkept: the eager call after
    the capture, before any replay, makes its own class and is right, and so is the replay."""
    torch = pytest.importorskip("torch")
    import fagen
    from fagen import decode, fp8_inputs

    rng = np.random.default_rng(31)
    q, k8, v8, kd, _ = inputs(rng, "bfloat16", "float8_e4m3", 2, 32, 8, 1, 900, 1.0, torch)
    with torch.no_grad():
        want = fagen.decode.attention(q, k8, v8, k_descale=kd)  # (compiles outside the capture)
        monkeypatch.setattr(decode, "SHAPE_CLASSES", decode.ShapeClasses())
        fp8_inputs._ONES.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fagen.attention(q, k8, v8, k_descale=kd)
        assert not decode.SHAPE_CLASSES._growing and not decode.SHAPE_CLASSES._exact
        eager = fagen.attention(q, k8, v8, k_descale=kd)
        assert relative_error(to_numpy(eager.float()), to_numpy(want.float())) < 1e-2
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(to_numpy(captured.float()), to_numpy(want.float())) < 1e-2


def test_prepared_calls_read_an_fp8_cache_as_the_eager_ones():
    """fagen.prepare and fagen.prepare_with_kvcache on e4m3 caches, descales given at prepare:
    each call equals the eager call bit for bit, on new values of the same tensors."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(17)
    q, k8, v8, kd, vd = inputs(rng, "bfloat16", "float8_e4m3", 4, 32, 8, 1, 3000, 1.0, torch)
    with torch.no_grad():
        step = fagen.prepare(q, k8, v8, k_descale=kd, v_descale=vd)
        for _ in range(2):
            assert torch.equal(step(q, k8, v8), fagen.attention(q, k8, v8, k_descale=kd, v_descale=vd))
            q.copy_(torch.randn_like(q))
        page_size, n = 16, 2992  # the cache's first n keys as pages of 16, sequence b's in table row b
        kc, vc = (x[:, :, :n].permute(0, 2, 1, 3).reshape(4 * n // page_size, page_size, 8, 128).contiguous()
                  for x in (k8, v8))
        table = torch.arange(4 * n // page_size, dtype=torch.int32, device="cuda").reshape(4, -1)
        lens = torch.tensor([n, 1000, 17, n], dtype=torch.int32, device="cuda")
        paged = fagen.prepare_with_kvcache(q, kc, vc, lens, table, k_descale=kd, v_descale=vd)
        want = fagen.attention_with_kvcache(q, kc, vc, lens, table, k_descale=kd, v_descale=vd)
        assert torch.equal(paged(q, kc, vc, lens, table), want)


def _quantized(x, descale, kv_dtype):
    """`x` [..., Hkv, d] / descale (broadcast over its heads) as the append rounds it: the float32
    quotient, saturated to the type's largest finite value, then rounded to nearest even."""
    element = ELEMENT_TYPES[kv_dtype]
    quotient = (x.astype(np.float32) / descale.astype(np.float32)).astype(np.float64)
    return element.round(np.clip(quotient, -element.max_finite, element.max_finite))


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3", "float8_e5m2"])
@pytest.mark.parametrize("per_head", [False, True], ids=["one_descale", "per_head_descales"])
@pytest.mark.parametrize("source", ["bfloat16", "float16"])
def test_append_quantizes_new_tokens_into_an_fp8_cache(kv_dtype, per_head, source):
    """append_kv of half-type tokens into an FP8 paged cache: each lands in its sequence's slot as
    new / descale, saturated and rounded to nearest even (some values past the type's range);
    every other slot keeps its bytes. Then attention_with_kvcache appends and attends in one call,
    against the oracle over the dequantized cache."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(zlib.crc32(repr((kv_dtype, per_head, source)).encode()))
    page_size, b, hkv, d, n_new = 16, 3, 2, 128, 7
    lens = [5, 0, 17]
    num_pages = 12
    table = rng.permutation(num_pages)[:b * 4].reshape(b, 4).astype(np.int32)  # distinct pages a sequence
    k8 = torch.from_numpy(rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)).cuda()
    k8, v8 = (x.to(getattr(torch, ELEMENT_TYPES[kv_dtype].torch_name)) for x in (k8, k8.flip(0)))
    # descales whose reciprocals round (0.3, 0.6, 1.2, 2.4: a multiply by 1 / descale misrounds ~1% of e5m2)
    kd = (torch.tensor([[0.3, 0.6], [1.2, 2.4], [0.6, 0.3]], device="cuda") if per_head
          else torch.tensor(0.6, device="cuda"))
    vd = kd * 2
    k, v = (torch.from_numpy(rng.standard_normal((b, hkv, n_new, d)).astype(np.float32) * 100).cuda()
            .to(getattr(torch, source)) for _ in range(2))
    before_k, before_v = k8.clone(), v8.clone()
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    pages = torch.from_numpy(table).cuda()
    new_lens = fagen.sequences.append_kv(k8, v8, pages, seqlens, k, v, k_descale=kd, v_descale=vd)
    assert new_lens.tolist() == [n + n_new for n in lens]
    written = np.zeros((num_pages, page_size), bool)
    descales = {name: np.broadcast_to(to_numpy(x).reshape(-1 if per_head else 1), (b * hkv,)).reshape(b, hkv)
                for name, x in (("k", kd), ("v", vd))}
    for i, n in enumerate(lens):
        for j in range(n_new):
            page, slot = table[i, (n + j) // page_size], (n + j) % page_size
            written[page, slot] = True
            for name, new, got in (("k", k, k8), ("v", v, v8)):
                want = _quantized(to_numpy(new[i, :, j].float()).astype(np.float64), descales[name][i][:, None],
                                  kv_dtype)
                assert np.array_equal(to_numpy(got[page, slot].float()), want), (name, i, j)
    assert torch.equal(k8.view(torch.uint8)[~torch.from_numpy(written).cuda()],
                       before_k.view(torch.uint8)[~torch.from_numpy(written).cuda()])
    assert torch.equal(v8.view(torch.uint8)[~torch.from_numpy(written).cuda()],
                       before_v.view(torch.uint8)[~torch.from_numpy(written).cuda()])

    # append and attend in one call: the queries see the cache with the new tokens quantized in
    q = torch.from_numpy(rng.standard_normal((b, 8, n_new, d)).astype(np.float32)).cuda().to(getattr(torch, source))
    out = torch.full_like(q, float("nan"))
    fagen.attention_with_kvcache(q, k8, v8, new_lens, pages, k=k, v=v, causal=True, k_descale=kd, v_descale=vd,
                                 out=out)
    final = [n + 2 * n_new for n in lens]
    want = oracle.attention_paged(*(to_numpy(x.float()) for x in (q, k8, v8)), table, final, causal=True,
                                  k_descale=descales["k"], v_descale=descales["v"])
    assert relative_error(to_numpy(out.float()), want) <= ELEMENT_TYPES[source].tolerance


def test_an_fp8_append_without_the_cache_descales_is_refused():
    torch = pytest.importorskip("torch")
    import fagen

    k8 = torch.zeros(4, 16, 2, 128, device="cuda").to(torch.float8_e4m3fn)
    k = torch.zeros(1, 2, 3, 128, device="cuda", dtype=torch.bfloat16)
    pages, lens = torch.zeros(1, 2, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"k_descale, v_descale: a float8_e4m3fn cache stores k / k_descale"):
        fagen.sequences.append_kv(k8, k8.clone(), pages, lens, k, k)
    with pytest.raises(ValueError, match=r"k: torch.float32|k: float32 into a float8_e4m3fn cache"):
        fagen.sequences.append_kv(k8, k8.clone(), pages, lens, k.float(), k.float(), k_descale=1.0, v_descale=1.0)
    with pytest.raises(ValueError, match=r"k: bfloat16, v: float16; new keys and values are quantized by one kernel"):
        fagen.sequences.append_kv(k8, k8.clone(), pages, lens, k, k.half(), k_descale=1.0, v_descale=1.0)


def _fp8_queries(rng, kv_dtype, b, hq, hkv, nq, d, per_head, torch):
    """An FP8 q [B, Hq, Nq, d] and its descale, FlashAttention-3's: a number, or [B, Hkv] (each
    KV head's group of query heads shares one, amax over the type's largest finite value)."""
    element = ELEMENT_TYPES[kv_dtype]
    x = torch.from_numpy(rng.standard_normal((b, hq, nq, d)).astype(np.float32)).cuda()
    if per_head:
        descale = x.view(b, hkv, hq // hkv, nq, d).abs().amax(dim=(2, 3, 4)) / element.max_finite
        per_row = descale.repeat_interleave(hq // hkv, dim=1)[:, :, None, None]
    else:
        descale = float(x.abs().max()) / element.max_finite
        per_row = descale
    return (x / per_row).to(getattr(torch, element.torch_name)), descale


@pytest.mark.parametrize("d,kv_dtype,b,hq,hkv,nq,nk,causal,per_head", [
    (128, "float8_e4m3", 2, 32, 8, 1, 4097, False, True),  # the keys split, merged in the kernel
    (128, "float8_e5m2", 1, 8, 1, 2, 1000, True, False),  # MQA, two rows, bottom-right causal
    (128, "float8_e4m3", 64, 32, 8, 1, 512, False, True),  # blocks enough unsplit
    (128, "float8_e4m3", 2, 32, 8, 16, 1500, True, True),  # 64 packed rows: the q64 kernel
    (64, "float8_e4m3", 2, 32, 8, 1, 3000, False, False),  # (the FP8 forward has no head_dim 64)
    (256, "float8_e4m3", 2, 8, 4, 2, 3001, True, True),
    # more rows than a decode kernel holds, where the FP8 forward would fill little of the GPU: chunks
    (128, "float8_e4m3", 1, 32, 8, 32, 3001, True, True),  # 128 packed rows (the forward: 32 blocks of 32 rows)
    (64, "float8_e5m2", 2, 16, 4, 50, 2000, False, True),  # 200 rows at d64 (no FP8 forward there)
])
def test_fp8_q_k_v_of_a_decode_step_run_as_an_fp8_kv_cache(d, kv_dtype, b, hq, hkv, nq, nk, causal, per_head):
    """fagen.attention on FP8 q, k, v with FlashAttention-3's three descales, a decode step's few
    rows a KV head (or more, where the FP8 forward would fill little of the GPU: the chunk
    kernels): the FP8 cache's decode kernel (GQA packed, keys split), which widens q as it
    lands, q_descale read beside k_descale: bit for bit the call on q widened to bfloat16 beforehand, with the descales
    multiplied (each through a kept class), within bfloat16's tolerance of exact attention of the
    FP8 values times their descales; the compiled call bit for bit the general path's."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(zlib.crc32(repr((d, kv_dtype, b, hq, nq, nk, per_head)).encode()))
    q8, qd = _fp8_queries(rng, kv_dtype, b, hq, hkv, nq, d, per_head, torch)
    (k8, kd), (v8, vd) = (cache(rng, (b, hkv, nk, d), kv_dtype, torch) for _ in range(2))
    with torch.no_grad():
        got = fagen.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
        as_cache = fagen.attention(q8.to(torch.bfloat16), k8, v8, causal=causal, k_descale=kd * qd, v_descale=vd)
        general = fagen.decode.attention(q8.to(torch.bfloat16), k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                         v_descale=vd)
    assert got.dtype == torch.bfloat16 and got.shape == q8.shape and not torch.isnan(got).any()
    assert torch.equal(got, as_cache)
    want = oracle.attention(*(to_numpy(x.float()) for x in (q8, k8, v8)), causal=causal,
                            q_descale=to_numpy(qd) if per_head else np.full((b, hkv), qd, np.float32),
                            k_descale=to_numpy(kd), v_descale=to_numpy(vd))
    error = relative_error(to_numpy(got.float()), want)
    assert error <= ELEMENT_TYPES["bfloat16"].tolerance, error
    if d == 128 and nk == 4097:
        compiled = torch.compile(lambda q, k, v: fagen.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd),
                                 fullgraph=True)
        with torch.no_grad():
            assert torch.equal(compiled(q8, k8, v8), general)


@pytest.mark.parametrize("b, nq, nk, causal, with_sinks, ranged", [
    (1, 200, 100, True, False, False),  # more rows than keys, causal bottom right: the first rows see none
    (1, 200, 3000, False, True, False),  # sinks, joined in the chunks' merge
])
def test_fp8_q_k_v_of_many_rows_run_on_the_cache_s_chunks(b, nq, nk, causal, with_sinks, ranged):
    """FP8 q, k, v of more rows a KV head than a decode kernel holds, where the cache's chunk kernels
    take them (dispatch.fp8_on_cache_kernels: a low fill of the FP8 forward): each sequence within
    bfloat16's tolerance of exact attention of its FP8 values times the descales, out free of NaN.
    (Key ranges with such rows are the forward's to refuse: `ranged` stays False until the chunks
    have run with them.)"""
    torch = pytest.importorskip("torch")
    import fagen
    from fagen import dispatch

    rng = np.random.default_rng([b, nq, nk, int(with_sinks), int(ranged)])
    hq, hkv, d = 8, 2, 128
    assert dispatch.fp8_on_cache_kernels((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d), "float8_e4m3",
                                         causal=causal, sinks=1 if with_sinks else None, ranged=ranged)
    q8, qd = _fp8_queries(rng, "float8_e4m3", b, hq, hkv, nq, d, True, torch)
    (k8, kd), (v8, vd) = (cache(rng, (b, hkv, nk, d), "float8_e4m3", torch) for _ in range(2))
    sinks = rng.uniform(-1.0, 4.0, hq).astype(np.float32) if with_sinks else None
    ends = np.array([nk - 37 * i for i in range(b)], np.int32)
    starts = np.array([5 * i for i in range(b)], np.int32)
    ranges = dict(cache_seqlens=torch.from_numpy(ends).cuda(), cache_leftpad=torch.from_numpy(starts).cuda()) \
        if ranged else {}
    with torch.no_grad():
        got = fagen.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                              sinks=None if sinks is None else torch.from_numpy(sinks).cuda(), **ranges)
    assert got.dtype == torch.bfloat16 and not torch.isnan(got).any()
    qn, kn, vn = (to_numpy(x.float()) for x in (q8, k8, v8))
    for i in range(b):
        keys = slice(starts[i], ends[i]) if ranged else slice(0, nk)
        want = oracle.attention(qn[i:i + 1], kn[i:i + 1, :, keys], vn[i:i + 1, :, keys], causal=causal, sinks=sinks,
                                q_descale=to_numpy(qd)[i:i + 1], k_descale=to_numpy(kd)[i:i + 1],
                                v_descale=to_numpy(vd)[i:i + 1])
        error = relative_error(to_numpy(got[i:i + 1].float()), want)
        assert error <= ELEMENT_TYPES["bfloat16"].tolerance, (i, error)


def test_fp8_q_quantised_afresh_each_decode_step_keeps_its_class():
    """A decode loop quantises q each step (a fresh q_descale tensor, [B, Hkv] float32): the steps
    after the first launch through the class the first made (the C path re-points the descales),
    each within bfloat16's tolerance of exact attention of its own FP8 values."""
    torch = pytest.importorskip("torch")
    import fagen
    from fagen.decode import SHAPE_CLASSES

    rng = np.random.default_rng(73)
    b, hq, hkv, d, nk = 2, 32, 8, 128, 3000
    (k8, kd), (v8, vd) = (cache(rng, (b, hkv, nk, d), "float8_e4m3", torch) for _ in range(2))
    classes = None
    for step in range(4):
        q8, qd = _fp8_queries(rng, "float8_e4m3", b, hq, hkv, 1, d, True, torch)
        with torch.no_grad():
            got = fagen.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
        if step == 0:
            classes = len(SHAPE_CLASSES._growing) + len(SHAPE_CLASSES._exact)
        want = oracle.attention(*(to_numpy(x.float()) for x in (q8, k8, v8)), q_descale=to_numpy(qd),
                                k_descale=to_numpy(kd), v_descale=to_numpy(vd))
        assert relative_error(to_numpy(got.float()), want) <= ELEMENT_TYPES["bfloat16"].tolerance, step
    assert len(SHAPE_CLASSES._growing) + len(SHAPE_CLASSES._exact) == classes


def test_a_decode_class_of_an_fp8_cache_hands_back_rows_off_16_bytes():
    """A growing decode class over an e4m3 cache takes any key length of its range and K/V strides
    of whole 16-byte copies (16 values); a view whose rows start 8 bytes off 16 (row stride 136) is
    handed back, and the general path refuses it by name, before any launch."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(79)
    b, hq, hkv, d, nk = 1, 32, 8, 128, 1500
    q = torch.from_numpy(rng.standard_normal((b, hq, 1, d)).astype(np.float32)).cuda().to(torch.bfloat16)
    (k8, kd), (v8, vd) = (cache(rng, (b, hkv, nk, d), "float8_e4m3", torch) for _ in range(2))
    with torch.no_grad():
        fagen.attention(q, k8, v8, k_descale=kd, v_descale=vd)  # the class
        wide = torch.zeros(b, hkv, nk, d + 8, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        wide[..., :d] = k8
        off = wide[..., :d]  # rows of 136 bytes
        assert off.stride()[2] == 136
        with pytest.raises(ValueError, match=r"k: strides .* multiples of 16 elements"):
            fagen.attention(q, off, v8, k_descale=kd, v_descale=vd)


def test_fp8_q_against_a_paged_fp8_cache_appends_fp8_tokens_as_they_are():
    """attention_with_kvcache with FP8 q (q_descale [B, Hkv]) and FP8 new tokens k, v of the cache's
    type: the tokens land in their slots byte for byte (in the cache's units already), every other
    slot keeps its bytes, and the queries (causal, bottom right) attend to the cache with them
    within bfloat16's tolerance of exact attention, into NaN-poisoned out; a half-type q with
    q_descale, and FP8 tokens of another type, are refused by name."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(29)
    page_size, hq, hkv, d, n_new = 16, 16, 4, 128, 3
    lens = [40, 0, 300]
    b = len(lens)
    table, num_pages = shuffled_table(rng, [-(-(n + n_new) // page_size) for n in lens])
    (k8, _), (v8, _) = (cache(rng, (num_pages, page_size, hkv, d), "float8_e4m3", torch) for _ in range(2))
    kd, vd = (torch.from_numpy(rng.uniform(0.5, 2.0, (b, hkv)).astype(np.float32)).cuda() for _ in range(2))
    q8, qd = _fp8_queries(rng, "float8_e4m3", b, hq, hkv, n_new, d, True, torch)
    (k_new, _), (v_new, _) = (cache(rng, (b, hkv, n_new, d), "float8_e4m3", torch) for _ in range(2))
    before_k, before_v = k8.clone(), v8.clone()
    seqlens, pages = torch.tensor(lens, dtype=torch.int32, device="cuda"), torch.from_numpy(table).cuda()
    out = torch.full((b, hq, n_new, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    fagen.attention_with_kvcache(q8, k8, v8, seqlens, pages, k=k_new, v=v_new, causal=True, out=out,
                                 q_descale=qd, k_descale=kd, v_descale=vd)
    written = np.zeros(k8.shape[:2], bool)
    for i, n in enumerate(lens):
        for j in range(n_new):
            page, slot = table[i, (n + j) // page_size], (n + j) % page_size
            written[page, slot] = True
            assert torch.equal(k8[page, slot].view(torch.uint8), k_new[i, :, j].view(torch.uint8)), (i, j)
            assert torch.equal(v8[page, slot].view(torch.uint8), v_new[i, :, j].view(torch.uint8)), (i, j)
    kept = ~torch.from_numpy(written).cuda()
    assert torch.equal(k8.view(torch.uint8)[kept], before_k.view(torch.uint8)[kept])
    assert torch.equal(v8.view(torch.uint8)[kept], before_v.view(torch.uint8)[kept])
    want = oracle.attention_paged(*(to_numpy(x.float()) for x in (q8, k8, v8)), table, [n + n_new for n in lens],
                                  causal=True, q_descale=to_numpy(qd), k_descale=to_numpy(kd),
                                  v_descale=to_numpy(vd))
    assert relative_error(to_numpy(out.float()), want) <= ELEMENT_TYPES["bfloat16"].tolerance
    with pytest.raises(ValueError, match="q_descale: q is torch.bfloat16, which has no descale"):
        fagen.attention_with_kvcache(q8.to(torch.bfloat16), k8, v8, seqlens, pages, q_descale=qd, k_descale=kd,
                                     v_descale=vd)
    with pytest.raises(ValueError, match=r"k, v: torch.float8_e5m2 and torch.float8_e5m2 new tokens into a "
                                         r"torch.float8_e4m3fn cache"):
        fagen.attention_with_kvcache(q8, k8, v8, seqlens, pages, k=k_new.to(torch.float8_e5m2),
                                     v=v_new.to(torch.float8_e5m2), q_descale=qd, k_descale=kd, v_descale=vd)


@pytest.mark.parametrize("nq", [1, 3])
def test_a_prepared_paged_call_takes_an_fp8_q_as_it_lies(nq):
    """prepare_with_kvcache on an FP8 q of the cache's type: the kernel widens q as it lands, so a
    call equals the one on q widened to bfloat16 beforehand, bit for bit (both widenings and the
    bfloat16 q's power-of-two rescale are exact; q's descale folded into k's), and is as close to
    the oracle; an FP8 q of another type than the cache's is refused by name, with a fix."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(47 + nq)
    b, hq, hkv, d, page, lens = 3, 32, 8, 128, 64, [700, 1, 2048]
    need = [-(-n // page) for n in lens]
    (k8, _), (v8, _) = (cache(rng, (sum(need), page, hkv, d), "float8_e4m3", torch) for _ in range(2))
    pages = np.zeros((b, max(need)), np.int32)  # sequence s's pages in order; entries past them read none
    for s, start in enumerate(np.cumsum([0, *need[:-1]])):
        pages[s, :need[s]] = start + np.arange(need[s])
    table, seqlens = torch.from_numpy(pages).cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
    q8 = (torch.from_numpy(rng.standard_normal((b, hq, nq, d)).astype(np.float32)).cuda() * 40).to(torch.float8_e4m3fn)
    fp8 = fagen.prepare_with_kvcache(q8, k8, v8, seqlens, table, causal=True, q_descale=0.25, k_descale=0.5,
                                     v_descale=1.5)
    widened = q8.to(torch.bfloat16)
    half = fagen.prepare_with_kvcache(widened, k8, v8, seqlens, table, causal=True, k_descale=0.125, v_descale=1.5)
    out = fp8(q8, k8, v8, seqlens, table)
    assert out.dtype == torch.bfloat16 and torch.equal(out, half(widened, k8, v8, seqlens, table))
    want = oracle.attention_paged(to_numpy(q8.float()) * 0.25, to_numpy(k8.float()), to_numpy(v8.float()), pages,
                                  lens, causal=True, k_descale=np.full((b, hkv), 0.5), v_descale=np.full((b, hkv), 1.5))
    assert relative_error(to_numpy(out.float()), want) <= ELEMENT_TYPES["bfloat16"].tolerance
    with pytest.raises(ValueError, match=r"q: float8_e5m2 against a float8_e4m3fn cache.*pass q as float8_e4m3fn"):
        fagen.prepare_with_kvcache(q8.to(torch.float8_e5m2), k8, v8, seqlens, table, k_descale=0.5, v_descale=1.5)


def test_prepare_takes_an_fp8_decode_step_and_refuses_the_fp8_forward_s_shapes():
    """fagen.prepare on FP8 q, k, v: a decode step's rows run on the FP8 cache's kernels, as
    fagen.attention runs them (both within bfloat16's tolerance of exact attention of the FP8
    values: a kept class may split the keys otherwise, so not bit for bit); a prefill's shapes
    are the FP8 forward's, which fagen.attention runs unprepared: refused by name, not packed on
    another kernel."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(83)
    (k8, kd), (v8, vd) = (cache(rng, (1, 8, 300, 128), "float8_e4m3", torch) for _ in range(2))
    q8, qd = _fp8_queries(rng, "float8_e4m3", 1, 32, 8, 1, 128, True, torch)
    with torch.no_grad():
        step = fagen.prepare(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
        want = oracle.attention(*(to_numpy(x.float()) for x in (q8, k8, v8)), causal=True, q_descale=to_numpy(qd),
                                k_descale=to_numpy(kd), v_descale=to_numpy(vd))
        for got in (step(q8, k8, v8), fagen.attention(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd,
                                                      v_descale=vd)):
            assert got.dtype == torch.bfloat16
            assert relative_error(to_numpy(got.float()), want) <= ELEMENT_TYPES["bfloat16"].tolerance
        # a prefill that fills the GPU with the forward's tiles (4 x 32 heads x 4 tiles of 128 rows)
        prefill = q8[:, :, :1].expand(1, 32, 512, 128).repeat(4, 1, 1, 1)
        keys, values = (x.repeat(4, 1, 1, 1) for x in (k8, v8))
        with pytest.raises(ValueError, match=r"FP8 q, k and v run the FP8 forward.*call fagen.attention"):
            fagen.prepare(prefill, keys, values, causal=True, q_descale=qd.repeat(4, 1), k_descale=kd.repeat(4, 1),
                          v_descale=vd.repeat(4, 1))


def test_unvalidated_paged_calls_on_an_fp8_cache_are_kept_and_follow_their_descales():
    """attention_with_kvcache(validate=False) on an FP8 cache goes through a kept prepared call
    (float32 descale tensors re-pointed each call, a number keyed by value): calls equal the
    validated call bit for bit, a write into k_descale reaches the next call and fresh descale
    tensors each call (a dynamic scale) keep the class, a number descale takes its own class, and
    an FP8 q (widened; a fresh 0-d q_descale tensor each call) keeps one."""
    torch = pytest.importorskip("torch")
    import fagen
    from fagen.sequences import KEPT_PAGED_CALLS

    rng = np.random.default_rng(31)
    b, hq, hkv, d, page = 4, 32, 8, 128, 64
    lens = [900, 64, 3000, 1]
    need = [-(-n // page) for n in lens]
    (k8, _), (v8, _) = (cache(rng, (sum(need) + 1, page, hkv, d), "float8_e4m3", torch) for _ in range(2))
    table = torch.from_numpy(np.concatenate([[0], np.cumsum(need)])[:-1, None] + np.arange(max(need))[None]).to(
        torch.int32).cuda()
    table = torch.minimum(table, torch.tensor(sum(need), device="cuda", dtype=torch.int32))
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kd, vd = (torch.from_numpy(rng.uniform(0.5, 2.0, (b, hkv)).astype(np.float32)).cuda() for _ in range(2))
    q = torch.from_numpy(rng.standard_normal((b, hq, 1, d)).astype(np.float32)).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for _ in range(2):
            kept = fagen.attention_with_kvcache(q, k8, v8, seqlens, table, validate=False, k_descale=kd, v_descale=vd)
            assert torch.equal(kept, fagen.attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=kd,
                                                                  v_descale=vd))
        classes = len(KEPT_PAGED_CALLS._kept)
        kd.mul_(1.5)
        moved = fagen.attention_with_kvcache(q, k8, v8, seqlens, table, validate=False, k_descale=kd, v_descale=vd)
        assert torch.equal(moved, fagen.attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=kd, v_descale=vd))
        assert not torch.equal(moved, kept) and len(KEPT_PAGED_CALLS._kept) == classes
        for scale in (0.5, 2.0):  # a fresh tensor each call
            fresh = fagen.attention_with_kvcache(q, k8, v8, seqlens, table, validate=False, k_descale=kd * scale,
                                                 v_descale=vd.clone())
            assert torch.equal(fresh, fagen.attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=kd * scale,
                                                                   v_descale=vd))
        assert len(KEPT_PAGED_CALLS._kept) == classes
        as_number = fagen.attention_with_kvcache(q, k8, v8, seqlens, table, validate=False, k_descale=0.75,
                                                 v_descale=vd)
        assert torch.equal(as_number, fagen.attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=0.75,
                                                                   v_descale=vd))
        q8 = (q.float() * 8).to(torch.float8_e4m3fn)  # an FP8 q, widened each call, its descale read by the kernel
        for _ in range(2):
            fp8_q = fagen.attention_with_kvcache(q8, k8, v8, seqlens, table, validate=False, q_descale=0.125,
                                                 k_descale=kd, v_descale=vd)
            assert torch.equal(fp8_q, fagen.attention_with_kvcache(q8, k8, v8, seqlens, table, q_descale=0.125,
                                                                   k_descale=kd, v_descale=vd))
        classes = len(KEPT_PAGED_CALLS._kept)
        for scale in (0.125, 0.25, 0.125):  # q's dynamic scale: a fresh 0-d tensor each call
            q_descale = torch.tensor(scale, device="cuda")
            fresh = fagen.attention_with_kvcache(q8, k8, v8, seqlens, table, validate=False, q_descale=q_descale,
                                                 k_descale=kd, v_descale=vd)
            assert torch.equal(fresh, fagen.attention_with_kvcache(q8, k8, v8, seqlens, table, q_descale=scale,
                                                                   k_descale=kd, v_descale=vd))
        assert len(KEPT_PAGED_CALLS._kept) == classes + 1
    want = oracle.attention_paged(*(to_numpy(x.float()) for x in (q, k8, v8)), table.cpu().numpy(), lens,
                                  k_descale=to_numpy(kd), v_descale=to_numpy(vd))
    assert relative_error(to_numpy(moved.float()), want) <= ELEMENT_TYPES["bfloat16"].tolerance


def test_fagen_attention_on_an_fp8_cache_keeps_its_class_and_follows_its_descales():
    """fagen.attention on a bfloat16 q and an e4m3 cache (no autograd) goes through a kept shape
    class (ShapeClasses: float32 descale tensors re-pointed each call): a growing cache's steps and
    repeated calls equal a fresh prepared call's result bit for bit, and a write into v_descale or
    a fresh descale tensor each call reaches the call without a new class."""
    torch = pytest.importorskip("torch")
    import fagen
    from fagen.decode import SHAPE_CLASSES

    rng = np.random.default_rng(37)
    q, k8, v8, kd, vd = inputs(rng, "bfloat16", "float8_e4m3", 2, 32, 8, 1, 2500, 1.0, torch)
    with torch.no_grad():
        for nk in (2300, 2301, 2302, 2302):  # a generation loop's growing cache, then a repeated call
            got = fagen.attention(q, k8[:, :, :nk], v8[:, :, :nk], k_descale=kd, v_descale=vd)
            want = fagen.prepare(q, k8[:, :, :nk], v8[:, :, :nk], k_descale=kd, v_descale=vd)(
                q, k8[:, :, :nk], v8[:, :, :nk])
            assert torch.equal(got, want), nk
        classes = len(SHAPE_CLASSES._growing) + len(SHAPE_CLASSES._exact)
        vd.mul_(0.5)
        moved = fagen.attention(q, k8, v8, k_descale=kd, v_descale=vd)
        assert torch.allclose(moved.float(), 0.5 * fagen.attention(q, k8, v8, k_descale=kd, v_descale=vd * 2).float(),
                              rtol=1e-2, atol=1e-3)
        fresh = {}
        for scale in (0.5, 2.0):  # a fresh tensor each call: each call's values, no stale copy
            fresh[scale] = fagen.attention(q, k8, v8, k_descale=kd * scale, v_descale=vd.clone())
            assert relative_error(to_numpy(fresh[scale].float()), exact(q, k8, v8, kd * scale, vd, False)) \
                <= ELEMENT_TYPES["bfloat16"].tolerance
        assert not torch.equal(fresh[0.5], fresh[2.0])
        assert len(SHAPE_CLASSES._growing) + len(SHAPE_CLASSES._exact) == classes
    assert relative_error(to_numpy(moved.float()), exact(q, k8, v8, kd, vd, False)) <= ELEMENT_TYPES["bfloat16"].tolerance
