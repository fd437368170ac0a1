"""Decode (GQA-packed split-KV) on the GPU, against the float64 oracle (marked `gpu`)."""

import numpy as np
import pytest

import fagen
from fagen import decode, dispatch, hot_path, oracle, variants
from fagen.check import OUT_TOLERANCE, check_against_oracle, random_inputs, relative_error, to_numpy
from fagen.device import cupy
from fagen.load import SPECS, load_spec
from fagen.spec import Mask, ScoreMod

pytestmark = pytest.mark.gpu

# (B, Hq, Hkv, Nq, Nk): GQA 4 and 8, MQA, MHA; one query to the 64 packed rows of the wide kernel;
# key counts that end mid-tile
SHAPES = [(1, 32, 8, 1, 8191), (2, 8, 2, 3, 1000), (3, 4, 1, 16, 239), (1, 8, 8, 1, 5000), (2, 16, 4, 16, 2049),
          (1, 6, 2, 5, 113)]
MASKS = [Mask(), Mask(kind="causal"), Mask(kind="sliding_window", window_left=300),
         Mask(kind="sliding_window", window_left=100, window_right=7), Mask(kind="chunked", chunk_size=500),
         Mask(kind="prefix_lm", prefix_len=77), Mask(kind="causal", align="top_left")]
MODS = [ScoreMod(), ScoreMod(softcap=20.0), ScoreMod(alibi="slopes"), ScoreMod(sinks=True),
        ScoreMod(softcap=30.0, alibi="slopes", sinks=True)]


def _spec(dtype, d, hq, hkv, nq, mask=Mask(), mod=ScoreMod()):
    spec = variants.decode_spec(dtype, d, nq * hq // hkv, mask, mod)
    assert spec is not None and spec.tiling.pack_gqa
    return spec


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_kernels_match_the_oracle(dtype, d, shape):
    b, hq, hkv, nq, nk = shape
    result = check_against_oracle(_spec(dtype, d, hq, hkv, nq), b, hq, hkv, nq, nk, framework="torch")
    assert result.passed, result.summary()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", SHAPES)
def test_merging_decode_kernels_match_the_oracle(dtype, d, shape):
    """The one-launch decode kernel: 3 splits a tile (or as many as its tiles), the last to finish
    merging them into out and the LSE (NaN-poisoned)."""
    b, hq, hkv, nq, nk = shape
    spec = variants.merged_variant(_spec(dtype, d, hq, hkv, nq))
    assert spec.outputs.merge_splits
    result = check_against_oracle(spec, b, hq, hkv, nq, nk, framework="torch")
    assert result.passed, result.summary()


# head_dim 256 (Gemma-2/3): 16 packed rows at most; GQA 2 as Gemma's, MQA, MHA; the split kernel and
# the merging one; key counts that end mid-tile
D256_SHAPES = [(1, 8, 4, 1, 4097), (3, 16, 8, 2, 1000), (2, 4, 1, 3, 239), (1, 8, 8, 1, 20000)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("merged", [False, True], ids=["split", "merged"])
@pytest.mark.parametrize("shape", D256_SHAPES)
def test_head_dim_256_decode_kernels_match_the_oracle(dtype, merged, shape):
    b, hq, hkv, nq, nk = shape
    base = load_spec(SPECS / f"{variants.decode_spec_name(dtype, 256, 16)}.yaml")
    spec = variants.variant(base, Mask(kind="sliding_window", window_left=4095), ScoreMod(softcap=50.0))
    if merged:
        spec = variants.merged_variant(spec)
    result = check_against_oracle(spec, b, hq, hkv, nq, nk, framework="torch")
    assert result.passed, result.summary()


@pytest.mark.parametrize("mask", MASKS[:4], ids=str)
@pytest.mark.parametrize("mod", [m for m in MODS if m.sinks], ids=lambda m: m.model_dump_json(exclude_defaults=True))
def test_merging_decode_kernels_take_masks_and_sinks(mask, mod):
    """Sinks join the in-kernel merge as they join the merge kernel's."""
    b, hq, hkv, nq, nk = 2, 8, 2, 6, 1100
    spec = variants.merged_variant(_spec("float16", 128, hq, hkv, nq, mask, mod), sinks=True)
    result = check_against_oracle(spec, b, hq, hkv, nq, nk)
    assert result.passed, result.summary()


@pytest.mark.parametrize("splits", [2, 5, 32])
def test_a_prepared_split_step_is_one_launch_and_leaves_its_counts_zeroed(splits):
    """Steps of a prepared decode call (new queries each) merge in the kernel: every tile's
    arrival count goes back to 0, so the next step (or a graph replay) merges too."""
    import torch

    b, hq, hkv, nq, nk = 2, 32, 8, 1, 8192 + 77
    q, k, v, _ = random_inputs("torch", "float16", b, hq, hkv, nq, nk, 128)
    call = fagen.prepare(q, k, v, splits=splits)
    assert call.spec.outputs.merge_splits
    counts = call.split_counts
    for _ in range(3):
        q = random_inputs("torch", "float16", b, hq, hkv, nq, nk, 128)[0]
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, hq, nq), float("nan"), device="cuda")
        call(q, k, v, out=out, lse=lse)
        ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), return_lse=True)
        assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"]
        assert relative_error(to_numpy(lse), ref_lse) < 1e-4
        assert counts.shape == (b * hkv,) and int(counts.abs().sum()) == 0


@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("mod", MODS, ids=lambda m: m.model_dump_json(exclude_defaults=True))
def test_decode_masks_and_modifiers_match_the_oracle(mask, mod):
    b, hq, hkv, nq, nk = 2, 8, 2, 6, 1100  # 24 packed rows: the wide kernel, positions cross its tiles
    result = check_against_oracle(_spec("float16", 128, hq, hkv, nq, mask, mod), b, hq, hkv, nq, nk)
    assert result.passed, result.summary()


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_decode_reads_any_layout(layout):
    b, hq, hkv, nq, nk = 2, 16, 4, 2, 3000
    result = check_against_oracle(_spec("bfloat16", 128, hq, hkv, nq, Mask(kind="causal")), b, hq, hkv, nq, nk,
                                  framework="torch", layout=layout)
    assert result.passed, result.summary()


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_fagen_attention_takes_the_decode_path_for_few_rows(framework):
    q, k, v, _ = random_inputs(framework, "float16", 2, 32, 8, 1, 20000, 128)
    assert dispatch.decode_spec_for(q, k, causal=True) is not None
    out, lse = fagen.attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, return_lse=True)
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"]
    assert relative_error(to_numpy(lse), ref_lse) < 1e-4


def test_many_rows_and_unpackable_inputs_keep_the_plain_forward():
    q, k, _, _ = random_inputs("torch", "float16", 1, 32, 8, 64, 1000, 128)  # 256 packed rows
    assert dispatch.decode_spec_for(q, k) is None
    q1 = q[:, :, :1]
    assert dispatch.decode_spec_for(q1, k, bias=np.zeros((1, 32, 1000), np.float32)) is None
    assert dispatch.decode_spec_for(q1, k, doc_ids=np.zeros((1, 1000), np.int32)) is None


def test_decode_step_in_a_cuda_graph():
    """A decode step (the torch op on the decode path, sinks and softcap) captures and replays."""
    import torch

    q, k, v, _ = random_inputs("torch", "bfloat16", 4, 32, 8, 1, 9000, 128)
    sinks = torch.rand(32, device="cuda")
    step = lambda: fagen.attention(q, k, v, causal=True, softcap=30.0, sinks=sinks)  # noqa: E731
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(2):
            step()  # compile and check once, outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, softcap=30.0,
                           sinks=sinks.cpu().numpy())
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["bfloat16"]


@pytest.mark.parametrize("widths", [(64, 64), (192, 128)], ids=lambda w: f"d{w[0]}_v{w[1]}")
def test_decode_forward_trains_through_the_plain_backward(widths):
    """Gradients of a decode-path forward (few rows) come from the plain backward kernels (two
    head widths too: DeepSeek's)."""
    import torch

    d, dv = widths
    q, k, v, _ = random_inputs("torch", "float16", 1, 8, 2, 2, 700, d, d_v=dv)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fagen.attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = oracle.attention_backward(to_numpy(q), to_numpy(k), to_numpy(v), to_numpy(dout), mask=Mask(kind="causal"))
    for name, got in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert relative_error(to_numpy(got), ref[name]) < 1e-2, name


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("shape", [(2, 32, 8, 1, 9000), (1, 8, 8, 3, 700), (1, 4, 1, 64, 300)])
def test_a_prepared_call_matches_the_oracle_on_fresh_tensors(framework, shape):
    b, hq, hkv, nq, nk = shape  # decode, MHA decode, and 256 packed rows: the plain forward
    q, k, v, _ = random_inputs(framework, "float16", b, hq, hkv, nq, nk, 128)
    call = fagen.prepare(q, k, v, causal=True, softcap=30.0)
    for _ in range(2):  # new queries each step, as a decode loop has
        q = random_inputs(framework, "float16", b, hq, hkv, nq, nk, 128)[0]
        out, lse = call(q, k, v, return_lse=True)
        ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, softcap=30.0,
                                        return_lse=True)
        assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"]
        assert relative_error(to_numpy(lse), ref_lse) < 1e-4


@pytest.mark.parametrize("shape", [(1, 32, 8, 1, 8191), (1, 32, 8, 16, 20000), (1, 4, 1, 64, 300)],
                         ids=["merged-in-kernel", "merge-kernel", "plain-forward"])
def test_a_prepared_torch_call_runs_the_c_hot_path_as_the_python_path_does(shape):
    """A torch call takes fagen.hot_path's C path (the GPU machines have a C compiler): into a
    NaN-poisoned out it writes bitwise what the Python path writes, for a step whose last split
    merges, a split kernel with the merge kernel after it, and the plain forward (sm_90: tensor
    maps re-encoded for a new q)."""
    import torch

    b, hq, hkv, nq, nk = shape
    q, k, v, _ = random_inputs("torch", "float16", b, hq, hkv, nq, nk, 128)
    call = fagen.prepare(q, k, v, causal=True)
    assert call._hot is not None, hot_path.reason()
    assert (call.merge is not None) == (nq == 16)
    q = random_inputs("torch", "float16", b, hq, hkv, nq, nk, 128)[0]  # a new step's queries, a new address
    out = torch.full_like(q, float("nan"))
    assert call._hot.run(q, k, v, out) is out  # the C path itself, not a fallback
    hot = out.clone()
    call._hot = None  # the Python path
    out.fill_(float("nan"))
    assert call(q, k, v, out=out) is out
    assert torch.equal(out, hot)
    ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True)
    assert relative_error(to_numpy(hot), ref) < OUT_TOLERANCE["float16"]


def test_a_prepared_call_allocates_out_laid_out_as_q():
    """out is allocated with q's strides (as SDPA's and FlashAttention's): [B, Hq, Nq, d]
    contiguous for a contiguous q, a transposed [B, Nq, Hq, d] buffer for a q that is one (a
    model's heads, whose reshape back then copies nothing): the strides the launch was packed for."""
    for layout in ("bhnd", "bnhd"):
        q, k, v, _ = random_inputs("torch", "float16", 2, 8, 2, 3, 500, 64, layout=layout)
        call = fagen.prepare(q, k, v)
        out = call(q, k, v)
        assert out.shape == q.shape and out.stride() == q.stride(), layout
        ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v))
        assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"], layout


def test_a_prepared_call_takes_a_contiguous_q_whatever_its_stride_over_one_row():
    """A decode step's q from a model's [B, 1, Hq, d] transposed to [B, Hq, 1, d] is contiguous but
    for the stride over its one row (never stepped): a step prepared on a contiguous q takes it on
    the C path, on the Python path (return_lse), and as out, the bits of the contiguous call."""
    import torch

    q, k, v, _ = random_inputs("torch", "float16", 2, 8, 2, 1, 3000, 64)
    call = fagen.prepare(q, k, v)
    q_model = torch.empty((2, 1, 8, 64), dtype=q.dtype, device=q.device).transpose(1, 2).copy_(q)  # [B, 1, Hq, d] storage
    assert q_model.stride() != q.stride() and q_model.is_contiguous()
    want = call(q, k, v)
    assert call._hot is not None and call._hot.run(q_model, k, v, None) is not NotImplemented
    out = torch.full_like(q_model, float("nan"))
    assert call(q_model, k, v, out=out) is out and torch.equal(out, want)
    got, lse = call(q_model, k, v, return_lse=True)  # (the Python path: the C path returns no lse)
    assert torch.equal(got, want)
    ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v))
    assert relative_error(to_numpy(got), ref) < OUT_TOLERANCE["float16"]


def test_a_prepared_call_refuses_other_shapes():
    q, k, v, _ = random_inputs("torch", "float16", 1, 8, 2, 1, 1000, 64)
    call = fagen.prepare(q, k, v)
    with pytest.raises(ValueError, match="prepare again"):
        call(q, k[:, :, :999], v[:, :, :999])
    with pytest.raises(ValueError, match="prepare again"):
        call(q.bfloat16(), k, v)
    with pytest.raises(ValueError, match="as prepared"):
        call(q, k, v, out=q.new_empty(1, 8, 2, 64))
    with pytest.raises(ValueError, match="as prepared"):  # the prepared shape, other strides
        call(q, k, v, out=q.new_empty(1, 8, 1, 128)[..., :64])
    with pytest.raises(ValueError, match="as prepared"):
        call(q, k, v, out=q.new_empty(1, 8, 1, 64).bfloat16())
    with pytest.raises(ValueError, match="as prepared"):
        call(q, k, v, lse=q.new_empty(1, 8, 1))  # float16, not float32


def test_a_prepared_call_returns_the_lse_where_asked():
    import torch

    q, k, v, _ = random_inputs("torch", "float16", 1, 8, 2, 1, 3000, 64)
    call = fagen.prepare(q, k, v)
    ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), return_lse=True)
    out = call(q, k, v)
    assert isinstance(out, torch.Tensor)  # out alone, as fagen.attention without return_lse
    lse = torch.full((1, 8, 1), float("nan"), device="cuda")
    got, got_lse = call(q, k, v, lse=lse)  # a given lse is written and returned
    assert got_lse is lse
    assert relative_error(to_numpy(got), ref) < OUT_TOLERANCE["float16"]
    assert relative_error(to_numpy(lse), ref_lse) < 1e-4


def test_a_prepared_decode_step_in_a_cuda_graph():
    import torch

    q, k, v, _ = random_inputs("torch", "bfloat16", 2, 32, 8, 1, 5000, 64)
    sinks = torch.randn(32, device="cuda")
    call = fagen.prepare(q, k, v, causal=True, sinks=sinks)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(q, k, v)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, sinks=sinks.cpu().numpy())
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["bfloat16"]


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_a_graph_keeps_the_prepared_call_it_captured(framework):
    """A graph replays into the prepared call's workspace (partials, arrival counts): dropping the
    object must not free it. Junk in the memory the allocator hands out next would leave the
    counts off, the merge skipped and out unwritten (NaN here)."""
    import gc

    import torch

    q, k, v, _ = random_inputs(framework, "float16", 1, 32, 8, 1, 8192, 64)
    call = fagen.prepare(q, k, v)
    out = torch.full_like(q, float("nan")) if framework == "torch" else cupy.full(q.shape, np.nan, q.dtype)
    if framework == "torch":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(q, k, v, out=out)
        replay = graph.replay
    else:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            call(q, k, v, out=out)
            graph = stream.end_capture()
        replay = lambda: graph.launch(stream)  # noqa: E731
    assert call in decode.CAPTURED and call.spec.outputs.merge_splits
    del call
    gc.collect()
    # the allocators hand a freed block to the next request of its size: counts past 15 never reach
    # it again, so no split merges
    junk = [torch.full((8,), 1000, dtype=torch.int32, device="cuda") if framework == "torch"
            else cupy.full(8, 1000, np.int32) for _ in range(512)]
    out.fill(np.nan) if framework == "cupy" else out.fill_(float("nan"))
    replay()
    cupy.cuda.runtime.deviceSynchronize()
    ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v))
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"]
    del junk


@pytest.mark.parametrize("mask", [Mask(), Mask(kind="causal"), Mask(kind="sliding_window", window_left=300)], ids=str)
@pytest.mark.parametrize("mod", [ScoreMod(), ScoreMod(softcap=30.0, alibi="slopes", sinks=True)],
                         ids=lambda m: m.model_dump_json(exclude_defaults=True))
@pytest.mark.parametrize("b", [40, 16])  # 320 blocks: two an SM, half the ring each; 128 (132 SMs): one an SM
def test_one_split_is_one_launch_without_a_merge(mask, mod, b):
    """Where the blocks alone fill the GPU (splits 1) the kernel writes out and the LSE itself, sinks
    joining there, with half the K/V ring where the blocks outnumber what the GPU holds at once:
    decode.run and a prepared call both, against the oracle, outputs NaN-poisoned."""
    import math

    import torch

    hq, hkv, nq, nk = 32, 8, 3, 1500  # 12 packed rows: b x 8 blocks, no split
    q, k, v, _ = random_inputs("torch", "bfloat16", b, hq, hkv, nq, nk, 128)
    sinks = torch.randn(hq, device="cuda") if mod.sinks else None
    slopes = torch.rand(hq, device="cuda") if mod.alibi != "none" else None
    spec = _spec("bfloat16", 128, hq, hkv, nq, mask, mod)
    assert dispatch.default_splits(spec, b, hq, hkv, nq, nk) == 1
    ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), mask=mask, softcap=mod.softcap,
                                    alibi_slopes=None if slopes is None else slopes.cpu().numpy(),
                                    sinks=None if sinks is None else sinks.cpu().numpy(), return_lse=True)
    out, lse = decode.run(spec, q, k, v, return_lse=True, alibi_slopes=slopes, sinks=sinks)
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["bfloat16"]
    assert relative_error(to_numpy(lse), ref_lse) < 1e-4
    call = fagen.prepare(q, k, v, mask=mask, softcap=mod.softcap, alibi_slopes=slopes, sinks=sinks)
    assert not call.spec.outputs.partial  # one launch a step, no partials
    merged = fagen.compile(variants.merged_variant(spec, mod.sinks))  # its occupancy sets the step's kernel
    overfill = math.prod(merged.plan.tiles(b, hq, hkv, nq, 1)) > dispatch.slots(merged)
    assert call.spec.name.endswith("_unsplit_half" + ("_sinks" if mod.sinks else "")) is overfill
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq, nq), float("nan"), device="cuda")
    call(q, k, v, out=out, lse=lse)
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["bfloat16"]
    assert relative_error(to_numpy(lse), ref_lse) < 1e-4



@pytest.mark.parametrize("nq", [1, 4])
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(mask={"kind": "sliding_window", "window_left": 300}),
                                     dict(sinks=True, softcap=30.0)], ids=["plain", "causal", "window", "sinks_softcap"])
def test_fagen_attention_over_a_growing_cache_matches_the_oracle_and_packs_a_class_once(nq, options,
                                                                                         python_launches):
    """A generation loop's calls (decode.ShapeClasses): keys one longer each call, the cache
    re-allocated (new strides, as transformers' dynamic cache) or sliced from a longer buffer
    (strides kept); lengths across the 1024 class boundary, and late in a class, where the
    class's splits (chosen for its shortest length) leave shares past the keys empty. Every
    output and LSE matches the oracle; each class is packed once."""
    import torch

    b, hq, hkv, d = 2, 8, 2, 128
    rng = torch.Generator(device="cuda").manual_seed(nq)
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.float16, generator=rng)
    buffer_k, buffer_v = (torch.randn(b, hkv, 2048, d, device="cuda", dtype=torch.float16, generator=rng)
                          for _ in range(2))
    sinks = torch.randn(hq, device="cuda", generator=rng) if options.get("sinks") else None
    kwargs = {**options, "sinks": sinks}
    before = len(decode.SHAPE_CLASSES._growing)
    for n in [1021, 1022, 1023, 1024, 1025, 1026, 1500, 2040, 2047]:
        for k, v in ((buffer_k[:, :, :n], buffer_v[:, :, :n]),
                     (buffer_k[:, :, :n].contiguous(), buffer_v[:, :, :n].contiguous())):
            out, lse = fagen.attention(q, k, v, return_lse=True, **kwargs)
            ref, ref_lse = oracle.attention(*(to_numpy(x) for x in (q, k, v)), return_lse=True,
                                            **{**kwargs, "sinks": None if sinks is None else to_numpy(sinks)})
            assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"], (n, k.stride())
            assert relative_error(to_numpy(lse), ref_lse) < 1e-4, (n, k.stride())
            out = fagen.attention(q, k, v, **kwargs)  # without the LSE: the C path's (hot_path.c, growing)
            assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"], (n, k.stride())
    # [512, 1024) and [1024, 2048), with the LSE and without (return_lse is in the key)
    assert len(decode.SHAPE_CLASSES._growing) - before == 4
    _took_the_c_path(list(decode.SHAPE_CLASSES._growing.values())[before:], python_launches)


def test_a_growing_class_s_bits_do_not_depend_on_the_length_that_made_it(monkeypatch):
    """A growing class's split count is chosen and evened for its shortest length: a class made by a
    call at 4097 keys and one made at 4096 answer a call at 4096 (or 4100) bit for bit alike. (Evened
    for the length that made it, 17 tiles of 256 keys took 6 splits where 16 take 8.)"""
    import torch

    b, hq, hkv, d = 2, 32, 8, 128
    rng = torch.Generator(device="cuda").manual_seed(4097)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=rng)
    k, v = (torch.randn(b, hkv, 4100, d, device="cuda", dtype=torch.bfloat16, generator=rng) for _ in range(2))
    answers, splits = [], []
    for first in (4097, 4096):
        monkeypatch.setattr(decode, "SHAPE_CLASSES", decode.ShapeClasses())  # no class yet
        with torch.no_grad():
            fagen.attention(q, k[:, :, :first], v[:, :, :first])
            answers.append([fagen.attention(q, k[:, :, :n], v[:, :, :n]) for n in (4096, 4100)])
        (growing,) = decode.SHAPE_CLASSES._growing.values()
        assert growing.lo == 4096
        splits.append(growing._splits)
    assert splits[0] == splits[1]
    for made_at_4097, made_at_4096 in zip(*answers):
        assert torch.equal(made_at_4097, made_at_4096)
    ref = oracle.attention(*(to_numpy(x[:, :, :4096]) for x in (q, k, v)))
    assert relative_error(to_numpy(answers[0][0]), ref) < OUT_TOLERANCE["bfloat16"]


@pytest.fixture
def python_launches(monkeypatch):
    """return_lse of each launch a growing class makes from Python (GrowingKeys._launch_torch)."""
    made, original = [], decode.GrowingKeys._launch_torch

    def recording(self, q, addresses, out, lse, return_lse):
        made.append(return_lse)
        return original(self, q, addresses, out, lse, return_lse)
    monkeypatch.setattr(decode.GrowingKeys, "_launch_torch", recording)
    return made


def _took_the_c_path(classes, python_launches):
    """Where the C hot path builds (a C compiler and Python.h on the host), every call without
    the LSE went through it: the Python path launched only the calls with the LSE."""
    from fagen import hot_path

    if hot_path.module() is not None:
        assert all(c._hot is not None for c in classes) and python_launches and all(python_launches)


def test_a_prepared_call_refuses_a_view_that_starts_inside_a_row():
    """A view of the prepared shape and strides whose address is not 16-byte aligned (its last
    axis starting mid-row) is refused by name, by the C path and the Python path alike; the
    growing-cache class hands it to the general path, which refuses it too."""
    import torch

    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    buffer = torch.randn(1, 8, 1024, 136, device="cuda", dtype=torch.float16)
    k, shifted = buffer[..., :128], buffer[..., 1:129]
    assert k.stride() == shifted.stride() and shifted.data_ptr() % 16
    step = fagen.prepare(q, k, k)
    with pytest.raises(ValueError, match="k, v: address not a multiple of 16 bytes"):
        step(q, shifted, shifted)
    fagen.attention(q, k, k)  # the class, packed
    with pytest.raises(ValueError, match="multiples of 8 elements / 16 bytes"):
        fagen.attention(q, shifted, shifted)
    # v shorter than k, with k's strides (a slice of the same buffer): refused, never read past its end
    with pytest.raises(ValueError, match=r"must have the same \[B, Hkv, Nk\]"):
        fagen.attention(q, k, buffer[:, :, :1000, :128])


@pytest.mark.parametrize("options", [dict(causal=True), dict(mask={"kind": "sliding_window", "window_left": 300}),
                                     dict(sinks=True, softcap=30.0)], ids=["causal", "window", "sinks_softcap"])
def test_key_ranges_over_a_growing_cache_match_the_oracle_and_pack_a_class_once(options, python_launches):
    """A left-padded batch's generation loop (fagen.transformers' decode steps): each row's keys
    from its pads to the cache's end, the cache a token longer each call; rows of other pads, one
    of them starting past a whole split's worth of keys; the pads hold NaN, never read. Every
    output and LSE matches the oracle's per-sequence attention; each class is packed once."""
    import torch

    b, hq, hkv, d = 3, 8, 2, 128
    rng = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=rng)
    buffer_k, buffer_v = (torch.randn(b, hkv, 2048, d, device="cuda", dtype=torch.bfloat16, generator=rng)
                          for _ in range(2))
    pads = [0, 17, 900]
    for row, pad in enumerate(pads):
        buffer_k[row, :, :pad], buffer_v[row, :, :pad] = float("nan"), float("nan")
    leftpad = torch.tensor(pads, dtype=torch.int32, device="cuda")
    sinks = torch.randn(hq, device="cuda", generator=rng) if options.get("sinks") else None
    kwargs = {**options, "sinks": sinks}
    before = len(decode.SHAPE_CLASSES._growing)
    for n in [1022, 1023, 1024, 1025, 1800, 2047]:
        k, v = buffer_k[:, :, :n].contiguous(), buffer_v[:, :, :n].contiguous()
        seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        out, lse = fagen.attention(q, k, v, return_lse=True, cache_seqlens=seqlens, cache_leftpad=leftpad, **kwargs)
        keys = [np.nan_to_num(to_numpy(x)).transpose(0, 2, 1, 3) for x in (k, v)]
        ref, ref_lse = oracle.attention_cache(to_numpy(q), *keys, [n] * b, pads, return_lse=True,
                                              **{**kwargs, "sinks": None if sinks is None else to_numpy(sinks)})
        assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["bfloat16"], n
        assert relative_error(to_numpy(lse), ref_lse) < 1e-4, n
        out = fagen.attention(q, k, v, cache_seqlens=seqlens, cache_leftpad=leftpad, **kwargs)  # the C path's
        assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["bfloat16"], n
    # [512, 1024) and [1024, 2048), with the LSE and without (return_lse is in the key)
    assert len(decode.SHAPE_CLASSES._growing) - before == 4
    _took_the_c_path(list(decode.SHAPE_CLASSES._growing.values())[before:], python_launches)


def test_a_static_cache_step_with_key_ranges_replays_in_a_cuda_graph():
    """A static cache's decode step (every slot allocated, each row's tokens a range of them) in
    a CUDA graph: between replays the ranges' tensors are written in place, and each replay reads
    the new ones (a generation loop under torch.compile(mode="reduce-overhead"))."""
    import torch

    b, hq, hkv, d, slots = 4, 16, 4, 128, 4096
    rng = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16, generator=rng)
    k, v = (torch.randn(b, hkv, slots, d, device="cuda", dtype=torch.float16, generator=rng) for _ in range(2))
    leftpad = torch.tensor([0, 100, 7, 1000], dtype=torch.int32, device="cuda")
    seqlens = torch.full((b,), 1200, dtype=torch.int32, device="cuda")
    fagen.attention(q, k, v, causal=True, cache_seqlens=seqlens, cache_leftpad=leftpad)  # the class, packed
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fagen.attention(q, k, v, causal=True, cache_seqlens=seqlens, cache_leftpad=leftpad)
        with torch.cuda.graph(graph, stream=stream):
            out = fagen.attention(q, k, v, causal=True, cache_seqlens=seqlens, cache_leftpad=leftpad)
    torch.cuda.current_stream().wait_stream(stream)
    for seen in (1201, 2500, 4096):
        seqlens.fill_(seen)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = oracle.attention_cache(to_numpy(q), *(to_numpy(x).transpose(0, 2, 1, 3) for x in (k, v)), [seen] * b,
                                     leftpad.tolist(), causal=True)
        assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"], seen


# Two head widths (DeepSeek's 192/128; V narrower or wider): the decode kernels at the tiling of the
# narrowest decode width that holds the wider head. GQA, MQA and MHA; one query and a few; key
# counts that end mid-tile
WIDTHS = [(192, 128), (128, 64), (64, 128)]
WIDTH_SHAPES = [(1, 16, 16, 1, 8191), (2, 8, 2, 2, 1000), (3, 4, 1, 3, 239)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: f"d{w[0]}_v{w[1]}")
@pytest.mark.parametrize("merged", [False, True], ids=["split", "merged"])
@pytest.mark.parametrize("shape", WIDTH_SHAPES)
def test_two_width_decode_kernels_match_the_oracle(dtype, widths, merged, shape):
    d, dv = widths
    b, hq, hkv, nq, nk = shape
    spec = variants.decode_spec(dtype, d, nq * hq // hkv, Mask(kind="causal"), ScoreMod(), dv)
    assert spec is not None and (spec.head_dim, spec.dv) == (d, dv) and spec.tiling.pack_gqa
    if merged:
        spec = variants.merged_variant(spec)
    result = check_against_oracle(spec, b, hq, hkv, nq, nk, framework="torch")
    assert result.passed, result.summary()


@pytest.mark.parametrize("mask", MASKS[:4], ids=str)
@pytest.mark.parametrize("mod", [MODS[1], MODS[4]], ids=lambda m: m.model_dump_json(exclude_defaults=True))
def test_two_width_decode_masks_and_modifiers_match_the_oracle(mask, mod):
    """DeepSeek's widths with GQA 4, two queries a head: windows, softcap, ALiBi, and sinks in the
    in-kernel merge."""
    b, hq, hkv, nq, nk = 2, 16, 4, 2, 1100
    spec = variants.merged_variant(variants.decode_spec("bfloat16", 192, nq * hq // hkv, mask, mod, 128),
                                   sinks=mod.sinks)
    result = check_against_oracle(spec, b, hq, hkv, nq, nk, framework="torch")
    assert result.passed, result.summary()


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_fagen_attention_runs_a_two_width_decode_step_on_the_decode_kernels(framework):
    """fagen.attention and fagen.prepare at 192/128: the decode kernel (not the plain forward's
    192-row tiles), as the oracle; a prepared call writes into a NaN-filled out; key ranges too."""
    b, hq, hkv, nq, nk = 2, 16, 4, 1, 5000
    dtype = "bfloat16" if framework == "torch" else "float16"  # (CuPy has no bfloat16)
    q, k, v, out = random_inputs(framework, dtype, b, hq, hkv, nq, nk, 192, d_v=128)
    spec = dispatch.decode_spec_for(q, k, v=v, causal=True, softcap=30.0)
    assert spec is not None and spec.tiling.pack_gqa and spec.dv == 128
    ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, softcap=30.0, return_lse=True)
    got, lse = fagen.attention(q, k, v, causal=True, softcap=30.0, return_lse=True)
    assert got.shape == (b, hq, nq, 128)
    assert relative_error(to_numpy(got), ref) < OUT_TOLERANCE[dtype]
    assert relative_error(to_numpy(lse), ref_lse) < 1e-4
    call = fagen.prepare(q, k, v, causal=True, softcap=30.0)
    for _ in range(2):
        q = random_inputs(framework, dtype, b, hq, hkv, nq, nk, 192, d_v=128)[0]
        out[...] = float("nan")
        call(q, k, v, out=out)
        ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, softcap=30.0)
        assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE[dtype]
    if framework == "torch":  # each row's keys a range of the cache's slots
        import torch

        leftpad = torch.tensor([0, 700], dtype=torch.int32, device="cuda")
        seqlens = torch.tensor([4000, 5000], dtype=torch.int32, device="cuda")
        for q in (q, random_inputs(framework, dtype, b, hq, hkv, 64, nk, 192, d_v=128)[0]):  # and a chunk: the forward's
            got = fagen.attention(q, k, v, causal=True, cache_seqlens=seqlens, cache_leftpad=leftpad)
            ref = oracle.attention_cache(to_numpy(q), *(to_numpy(x).transpose(0, 2, 1, 3) for x in (k, v)),
                                         seqlens.tolist(), leftpad.tolist(), causal=True)
            assert relative_error(to_numpy(got), ref) < OUT_TOLERANCE["bfloat16"], q.shape


def test_a_two_width_decode_loop_keeps_its_shape_class():
    """A generation loop at 192/128 (keys growing a call) takes one shape class a power of two of
    keys."""
    b, hq, hkv = 1, 8, 8
    q, k, v, _ = random_inputs("torch", "float16", b, hq, hkv, 1, 1030, 192, d_v=128)
    before = len(decode.SHAPE_CLASSES._growing)
    for n in (1030, 1031, 1500):
        kn, vn = k[:, :, :n].contiguous(), v[:, :, :n].contiguous()
        out = fagen.attention(q, kn, vn, causal=True)
        ref = oracle.attention(to_numpy(q), to_numpy(kn), to_numpy(vn), causal=True)
        assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"], n
    assert len(decode.SHAPE_CLASSES._growing) - before == 1
