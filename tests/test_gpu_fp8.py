"""The FP8 forward on the GPU (marked `gpu`; Hopper only): e4m3 q, k and v with FlashAttention-3's
descales, bfloat16 or float16 out, against the float64 oracle on the same FP8 values.

The bar is FlashAttention-3's: the kernel's error against exact attention of the FP8 values is at
most twice the error of the oracle that rounds P to e4m3 as the kernel does (P's rounding is the
format's own error, ~2e-2: notes/fp8.md), so what the kernel adds beyond it (accumulation order,
the MUFU's exp2, P rounded at each tile's running max rather than the row's final one) is bounded.
The LSE takes P's sum before rounding, so only the scores' own error reaches it: Hopper's FP8
MMA keeps about 13 bits of its f32 accumulator (DeepSeek-V3 reports ~14), so the bound is the
scores' largest possible magnitude (scale |q| |k|, Cauchy-Schwarz) times 2^-11."""

import zlib

import numpy as np
import pytest

from fagen import oracle
from fagen.check import in_a_cuda_graph, random_extras, relative_error, to_numpy
from fagen.element_types import ELEMENT_TYPES
from fagen.load import load_spec, parse_spec
from fagen.runtime import compile_kernel
from fagen.spec import Mask, ScoreMod
from fagen.variants import variant


pytestmark = pytest.mark.gpu

SPEC = "specs/attn_e4m3_d128_sm90a.yaml"
LSE_BITS = 11  # of a score's magnitude bound that the LSE keeps (the FP8 MMA's accumulator: ~13)


def fp8_spec(head_dim: int = 128, out_dtype: str = "bfloat16", dtype: str = "float8_e4m3", mask=None, score_mod=None,
             **changes):
    """The shipped FP8 spec of this head_dim with these changes, then the mask and modifiers as
    fagen.attention derives them (variants.variant: a tiling their registers fit)."""
    data = load_spec(SPEC.replace("d128", f"d{head_dim}")).model_dump(mode="json", exclude_none=True)
    data.update(head_dim=head_dim, out_dtype=out_dtype, dtype=dtype, **changes)
    data["name"] = (f"fp8_test_{ELEMENT_TYPES[dtype].short}_d{head_dim}_{out_dtype}_"
                    f"{zlib.crc32(repr(sorted(changes.items())).encode()):08x}")
    base = parse_spec(data, data["name"])
    return variant(base, Mask(**mask) if mask else base.mask, ScoreMod(**score_mod) if score_mod else base.score_mod)


def quantized(rng, shape, hkv_axis_shape, torch, scale: float = 1.0, dtype: str = "float8_e4m3"):
    """A float32 activation, its per-(batch, KV head) descale at amax / the type's largest finite
    value (times a random factor, so descales differ by head) and its FP8 tensor: true = FP8 *
    descale."""
    element = ELEMENT_TYPES[dtype]
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).cuda()
    b, h = shape[:2]
    amax = x.abs().amax(dim=(2, 3)).reshape(b, hkv_axis_shape, -1).amax(-1)  # [B, Hkv]
    descale = amax / element.max_finite * torch.from_numpy(rng.uniform(1.0, 2.0, amax.shape).astype(np.float32)).cuda()
    per_head = descale.repeat_interleave(h // hkv_axis_shape, dim=1)[:, :, None, None]
    return (x / per_head).to(getattr(torch, element.torch_name)), descale


CASES = [  # (head_dim, mask, score_mod, out_dtype, B, Hq, Hkv, Nq, Nk)
    (128, None, None, "bfloat16", 2, 4, 2, 384, 384),
    (128, None, None, "float16", 1, 2, 2, 200, 333),  # keys past the last whole tile, rows past the last
    (128, {"kind": "causal"}, None, "bfloat16", 1, 8, 2, 1024, 1024),
    (128, {"kind": "causal", "align": "bottom_right"}, None, "bfloat16", 2, 2, 1, 300, 700),
    (128, {"kind": "sliding_window", "window_left": 200, "window_right": 30}, None, "bfloat16", 1, 4, 4, 900, 900),
    (128, None, {"softcap": 30.0}, "bfloat16", 1, 4, 2, 512, 640),
    (128, {"kind": "causal"}, {"sinks": True}, "bfloat16", 1, 4, 2, 600, 600),  # gpt-oss's sinks (P's 2^8 scale)
    (128, None, {"alibi": "slopes"}, "bfloat16", 1, 4, 2, 512, 700),  # ALiBi and biases: added to the descaled scores
    (128, {"kind": "causal"}, {"bias": "vector"}, "bfloat16", 2, 4, 2, 400, 400),
    (128, None, {"bias": "matrix"}, "float16", 1, 2, 1, 300, 333),
    # masks read from arrays: documents (128-key tiles, the register model's fit) and block masks,
    # re-blocked to the kernel's 128 x 192 tiles (blocks of 16-128 straddle them)
    (128, {"kind": "document"}, None, "bfloat16", 2, 4, 2, 500, 500),
    (128, {"kind": "document", "causal": True}, {"sinks": True}, "bfloat16", 1, 4, 1, 700, 700),
    (128, {"kind": "block_mask"}, None, "bfloat16", 2, 4, 2, 384, 640),
    (128, {"kind": "block_mask"}, {"softcap": 20.0}, "float16", 1, 2, 2, 300, 333),
    (256, None, None, "bfloat16", 1, 4, 2, 512, 512),
    (256, {"kind": "causal"}, None, "float16", 2, 2, 2, 700, 700),
    (256, None, {"sinks": True}, "bfloat16", 1, 4, 2, 300, 500),  # sinks: no register held through the loop
    (256, {"kind": "causal"}, {"sinks": True}, "bfloat16", 1, 4, 1, 700, 700),
]
TYPED_CASES = [("float8_e4m3", *case) for case in CASES] + [  # e5m2: its own P rounding, the same kernel
    ("float8_e5m2", 128, None, None, "bfloat16", 2, 4, 2, 384, 384),
    ("float8_e5m2", 128, {"kind": "causal"}, None, "float16", 1, 4, 1, 700, 700),
]


# Key tiles other than the shipped 192 (two V^T boxes, the second's tail never read): one box
# (128), and other tails: keys past the last whole tile, causal diagonals at every alignment, a
# window, sinks
TILE_CASES = [  # (..., block_kv)
    ("float8_e4m3", 128, None, None, "bfloat16", 1, 2, 2, 333, 1000, 128),
    ("float8_e4m3", 128, {"kind": "causal"}, None, "bfloat16", 1, 4, 2, 700, 700, 128),
    ("float8_e4m3", 128, {"kind": "causal", "align": "bottom_right"}, None, "float16", 2, 2, 1, 300, 900, 224),
    ("float8_e4m3", 128, {"kind": "sliding_window", "window_left": 200, "window_right": 30}, None, "bfloat16",
     1, 2, 2, 900, 900, 160),
    ("float8_e4m3", 128, {"kind": "causal"}, {"sinks": True}, "bfloat16", 1, 4, 2, 600, 600, 224),
]


@pytest.mark.parametrize("dtype,d,mask,score_mod,out_dtype,b,hq,hkv,nq,nk,block_kv",
                         [(*case, None) for case in TYPED_CASES] + TILE_CASES)
def test_an_fp8_forward_is_within_twice_p_rounding_s_error(dtype, d, mask, score_mod, out_dtype, b, hq, hkv, nq, nk,
                                                           block_kv):
    torch = pytest.importorskip("torch")
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the FP8 kernel needs a Hopper GPU")
    changes = {}
    if block_kv:
        changes["tiling"] = {**load_spec(SPEC).tiling.model_dump(mode="json", exclude_none=True), "block_kv": block_kv}
    if mask:
        changes["mask"] = mask
    if score_mod:
        changes["score_mod"] = score_mod
    spec = fp8_spec(d, out_dtype, dtype, **changes)
    kernel = compile_kernel(spec)
    rng = np.random.default_rng([d, b, hq, hkv, nq, nk, len(CASES)])
    q8, q_descale = quantized(rng, (b, hq, nq, d), hkv, torch, scale=1.5, dtype=dtype)
    k8, k_descale = quantized(rng, (b, hkv, nk, d), hkv, torch, scale=1.5, dtype=dtype)
    v8, v_descale = quantized(rng, (b, hkv, nk, d), hkv, torch, dtype=dtype)
    out = torch.full((b, hq, nq, d), float("nan"), dtype=getattr(torch, out_dtype), device="cuda")
    # sinks from below to above the rows' largest scores: some rows' sums are mostly the sink's
    sinks = rng.uniform(-2.0, 12.0, hq).astype(np.float32) if spec.score_mod.sinks else None
    extras = {name: x for name, x in random_extras(spec, b, hq, nq, nk, seed=nq * nk).items()
              if name in ("bias", "alibi_slopes", "doc_ids", "block_mask")}
    got, lse = kernel(q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out=out,
                      return_lse=True, sinks=None if sinks is None else torch.from_numpy(sinks).cuda(), **extras)
    assert got.data_ptr() == out.data_ptr()

    qn, kn, vn = (to_numpy(x.float()) for x in (q8, k8, v8))
    descales = dict(q_descale=to_numpy(q_descale), k_descale=to_numpy(k_descale), v_descale=to_numpy(v_descale))
    keywords = dict(return_lse=True, mask=spec.mask, score_mod=spec.score_mod, sinks=sinks, **descales, **extras)
    exact, exact_lse = oracle.attention(qn, kn, vn, **keywords)
    rounded, _ = oracle.attention(qn, kn, vn, p_type=spec.dtype, p_scale=2.0 ** spec.element.p_log2_scale, **keywords)
    error, p_error = relative_error(to_numpy(got.float()), exact), relative_error(rounded, exact)
    assert error <= 2 * p_error, f"out: {error:.2e} against exact attention; P's rounding alone {p_error:.2e}"
    true = [x * np.repeat(scale, x.shape[1] // scale.shape[1], axis=1)[:, :, None, None]
            for x, scale in ((qn, descales["q_descale"]), (kn, descales["k_descale"]))]
    score_bound = np.linalg.norm(true[0], axis=-1).max() * np.linalg.norm(true[1], axis=-1).max() / np.sqrt(d)
    got_lse = to_numpy(lse)
    np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(exact_lse))  # no NaN, -inf where no key
    finite = np.isfinite(exact_lse)
    lse_error = np.abs(got_lse[finite] - exact_lse[finite]).max()
    assert lse_error <= score_bound * 2.0 ** -LSE_BITS, f"lse: {lse_error:.2e}, scores up to {score_bound:.1f}"


def test_an_fp8_kernel_refuses_what_it_cannot_read():
    torch = pytest.importorskip("torch")
    kernel = compile_kernel(fp8_spec())
    q = torch.zeros((1, 2, 64, 128), dtype=torch.float8_e4m3fn, device="cuda")
    with pytest.raises(ValueError, match="q_descale: shape"):
        kernel(q, q, q, q_descale=torch.ones(3, device="cuda"))
    with pytest.raises(ValueError, match="dtype bfloat16"):
        kernel(q.to(torch.bfloat16), q, q)


# rows 136 bytes apart: not 16-byte aligned, so V is copied before the kernel reads it
@pytest.mark.parametrize("b,h,n,d,row_stride", [(2, 3, 200, 128, 128), (1, 2, 4096, 128, 384), (1, 1, 1, 64, 64),
                                                (2, 2, 77, 128, 136)])
def test_the_v_transpose_kernel_matches_its_twin(b, h, n, d, row_stride):
    """V^T from the kernel, byte for byte as fp8_inputs.transposed_v (keys in the P registers'
    order, zeros past N), also from V rows that are a slice of wider ones (a packed QKV)."""
    torch = pytest.importorskip("torch")
    from fagen.device import as_device_tensor
    from fagen.fp8_inputs import transposed_v
    from fagen.runtime import v_transposed

    wide = torch.randint(0, 256, (b, h, n, row_stride), dtype=torch.uint8, device="cuda")
    v = wide[..., :d].view(torch.float8_e4m3fn)
    got = v_transposed(as_device_tensor(v, "v"))
    assert got.dtype == torch.float8_e4m3fn and got.is_contiguous()
    np.testing.assert_array_equal(to_numpy(got.view(torch.uint8)), transposed_v(to_numpy(v.view(torch.uint8))))


def test_fagen_attention_takes_float8_tensors_and_descales():
    """fagen.attention on float8_e4m3fn tensors runs the FP8 forward (bfloat16 out) with its mask
    and softcap, as the compiled spec does."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(7)
    b, hq, hkv, n, d = 2, 4, 2, 300, 128
    q8, q_descale = quantized(rng, (b, hq, n, d), hkv, torch)
    k8, k_descale = quantized(rng, (b, hkv, n, d), hkv, torch)
    v8, v_descale = quantized(rng, (b, hkv, n, d), hkv, torch)
    got = fagen.attention(q8, k8, v8, causal=True, softcap=20.0, q_descale=q_descale, k_descale=k_descale,
                          v_descale=v_descale)
    assert got.dtype == torch.bfloat16 and got.shape == (b, hq, n, d)
    spec = fp8_spec(mask={"kind": "causal"}, score_mod={"softcap": 20.0})
    descales = dict(q_descale=to_numpy(q_descale), k_descale=to_numpy(k_descale), v_descale=to_numpy(v_descale))
    qn, kn, vn = (to_numpy(x.float()) for x in (q8, k8, v8))
    exact = oracle.attention(qn, kn, vn, mask=spec.mask, score_mod=spec.score_mod, **descales)
    rounded = oracle.attention(qn, kn, vn, mask=spec.mask, score_mod=spec.score_mod, p_type=spec.dtype,
                               p_scale=2.0 ** spec.element.p_log2_scale, **descales)
    assert relative_error(to_numpy(got.float()), exact) <= 2 * relative_error(rounded, exact)
    # sinks (gpt-oss's, float32 [Hq]) join as with half types; an FP8 KV cache does not take them yet
    sinks = rng.uniform(0.0, 8.0, hq).astype(np.float32)
    got = fagen.attention(q8, k8, v8, causal=True, sinks=torch.from_numpy(sinks).cuda(), q_descale=q_descale,
                          k_descale=k_descale, v_descale=v_descale)
    spec = fp8_spec(mask={"kind": "causal"}, score_mod={"sinks": True})
    exact = oracle.attention(qn, kn, vn, mask=spec.mask, score_mod=spec.score_mod, sinks=sinks, **descales)
    rounded = oracle.attention(qn, kn, vn, mask=spec.mask, score_mod=spec.score_mod, sinks=sinks, p_type=spec.dtype,
                               p_scale=2.0 ** spec.element.p_log2_scale, **descales)
    assert relative_error(to_numpy(got.float()), exact) <= 2 * relative_error(rounded, exact)
    with pytest.raises(ValueError, match=r"doc_ids: not with q torch.bfloat16 against an FP8 KV cache"):
        fagen.attention(torch.zeros(b, hq, 1, d, dtype=torch.bfloat16, device="cuda"), k8, v8,
                        doc_ids=torch.zeros(b, n, dtype=torch.int32, device="cuda"), k_descale=k_descale,
                        v_descale=v_descale)
    # ALiBi slopes and a bias (a batch's [B, 1, Nk] vector, broadcast over heads) on the FP8 scores
    slopes = rng.uniform(0.01, 0.5, hq).astype(np.float32)
    bias = rng.standard_normal((b, 1, n)).astype(np.float32)
    got = fagen.attention(q8, k8, v8, causal=True, alibi_slopes=torch.from_numpy(slopes).cuda(),
                          bias=torch.from_numpy(bias).cuda(), q_descale=q_descale, k_descale=k_descale,
                          v_descale=v_descale)
    spec = fp8_spec(mask={"kind": "causal"}, score_mod={"alibi": "slopes", "bias": "vector"})
    extras = dict(alibi_slopes=slopes, bias=bias)
    exact = oracle.attention(qn, kn, vn, mask=spec.mask, score_mod=spec.score_mod, **extras, **descales)
    rounded = oracle.attention(qn, kn, vn, mask=spec.mask, score_mod=spec.score_mod, p_type=spec.dtype,
                               p_scale=2.0 ** spec.element.p_log2_scale, **extras, **descales)
    assert relative_error(to_numpy(got.float()), exact) <= 2 * relative_error(rounded, exact)
    with pytest.raises(ValueError, match=r"bias: not with q torch.bfloat16 against an FP8 KV cache"):
        fagen.attention(torch.zeros(b, hq, 1, d, dtype=torch.bfloat16, device="cuda"), k8, v8,
                        bias=torch.from_numpy(bias).cuda(), k_descale=k_descale, v_descale=v_descale)


def test_a_compiled_fp8_layer_replays_in_a_cuda_graph():
    """A layer calling fagen.attention on float8 tensors compiles with fullgraph=True (through
    fagen::fp8_attention_forward), and its call captured in a CUDA graph (V^T, the descales'
    table and the kernel) replays the eager result bit for bit on new values of the same tensors."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(11)
    q8, qd = quantized(rng, (2, 4, 256, 128), 2, torch)
    k8, kd = quantized(rng, (2, 2, 256, 128), 2, torch)
    v8, vd = quantized(rng, (2, 2, 256, 128), 2, torch)

    def layer(q, k, v):
        return fagen.attention(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

    compiled = torch.compile(layer, fullgraph=True)
    eager = layer(q8, k8, v8)
    assert torch.equal(compiled(q8, k8, v8), eager)
    graph, replayed = in_a_cuda_graph(lambda: compiled(q8, k8, v8))
    fresh = [quantized(rng, x.shape, 2, torch)[0] for x in (q8, k8, v8)]
    for x, new in zip((q8, k8, v8), fresh):
        x.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, layer(q8, k8, v8))


def test_fagen_attention_takes_documents_and_block_masks_on_float8_tensors():
    """doc_ids and a block_mask beside FP8 q, k, v run the FP8 forward's document and block-mask
    variants (fagen.attention derives them as for half types); a compiled layer passes doc_ids
    through fagen::fp8_attention_forward, and a block_mask, which no op can carry, is refused
    there by name."""
    torch = pytest.importorskip("torch")
    import fagen
    from fagen import masks

    rng = np.random.default_rng(13)
    b, hq, hkv, n, d = 2, 4, 2, 600, 128
    q8, q_descale = quantized(rng, (b, hq, n, d), hkv, torch)
    k8, k_descale = quantized(rng, (b, hkv, n, d), hkv, torch)
    v8, v_descale = quantized(rng, (b, hkv, n, d), hkv, torch)
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    numpy_descales = {name: to_numpy(x) for name, x in descales.items()}
    qn, kn, vn = (to_numpy(x.float()) for x in (q8, k8, v8))
    doc_ids = masks.documents_of_lengths([100, 250, 250], batch=b)
    block_mask = masks.sliding_window(n, 100, 20, q_block=64, kv_block=64)

    def checked(got, spec, **extras):
        exact = oracle.attention(qn, kn, vn, mask=spec.mask, score_mod=spec.score_mod, **extras, **numpy_descales)
        rounded = oracle.attention(qn, kn, vn, mask=spec.mask, score_mod=spec.score_mod, p_type=spec.dtype,
                                   p_scale=2.0 ** spec.element.p_log2_scale, **extras, **numpy_descales)
        assert got.dtype == torch.bfloat16 and got.shape == (b, hq, n, d)
        assert relative_error(to_numpy(got.float()), exact) <= 2 * relative_error(rounded, exact)

    ids = torch.from_numpy(np.asarray(doc_ids)).cuda()
    for causal in (False, True):
        got = fagen.attention(q8, k8, v8, causal=causal, doc_ids=ids, **descales)
        checked(got, fp8_spec(mask={"kind": "document", "causal": causal}), doc_ids=np.asarray(doc_ids))
    got = fagen.attention(q8, k8, v8, block_mask=block_mask, **descales)
    checked(got, fp8_spec(mask={"kind": "block_mask"}), block_mask=block_mask)

    def layer(q, k, v, ids):
        return fagen.attention(q, k, v, causal=True, doc_ids=ids, **descales)

    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(q8, k8, v8, ids), layer(q8, k8, v8, ids))
    with pytest.raises(Exception, match="block_mask with FP8 q, k, v: eager calls only"):
        torch.compile(lambda q, k, v: fagen.attention(q, k, v, block_mask=block_mask, **descales),
                      fullgraph=True)(q8, k8, v8)


VARLEN_CASES = [  # (head_dim, mask, Hq, Hkv, query lengths, key lengths)
    (128, None, 4, 2, [300, 1, 700, 129], [300, 1, 700, 129]),
    (128, {"kind": "causal"}, 4, 1, [200, 640, 1000], [500, 640, 1300]),  # bottom right in each sequence
    (128, {"kind": "sliding_window", "window_left": 100, "window_right": 20}, 2, 2, [450, 77], [450, 900]),
    (256, {"kind": "causal"}, 4, 2, [300, 129], [300, 700]),
]


@pytest.mark.parametrize("d,mask,hq,hkv,q_lengths,k_lengths", VARLEN_CASES)
def test_a_varlen_fp8_batch_matches_each_sequence_s_oracle(d, mask, hq, hkv, q_lengths, k_lengths):
    """fagen.attention_varlen on FP8 q, k, v (FlashAttention-3's varlen FP8 forward): descales a
    sequence and KV head, V^T a sequence's own (keys padded to whole boxes apart), out bfloat16
    written over NaN; each sequence within twice P's rounding error of the float64 oracle of its
    FP8 values, its LSE finite where it sees a key."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng([d, hq, hkv, *q_lengths, *k_lengths])
    b = len(q_lengths)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (q_lengths, k_lengths))

    def quantized_tokens(cu, heads, scale):
        x = rng.standard_normal((int(cu[-1]), heads, d)).astype(np.float32) * scale
        descale = np.stack([np.abs(x[cu[i]:cu[i + 1]]).reshape(-1, hkv, heads // hkv, d).max(axis=(0, 2, 3))
                            if cu[i + 1] > cu[i] else np.ones(hkv, np.float32) for i in range(b)])
        descale = (descale / ELEMENT_TYPES["float8_e4m3"].max_finite * rng.uniform(1.0, 2.0, descale.shape)).astype(np.float32)
        per_row = np.repeat(descale, heads // hkv, axis=1)[np.repeat(np.arange(b), np.diff(cu))]  # [total, heads]
        return torch.from_numpy(x / per_row[..., None]).cuda().to(torch.float8_e4m3fn), descale

    q8, qd = quantized_tokens(cu_q, hq, 1.5)
    k8, kd = quantized_tokens(cu_k, hkv, 1.5)
    v8, vd = quantized_tokens(cu_k, hkv, 1.0)
    out = torch.full((int(cu_q[-1]), hq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    got, lse = fagen.attention_varlen(q8, k8, v8, torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda(),
                                      max(q_lengths), max(k_lengths), mask=mask, out=out, return_lse=True,
                                      q_descale=torch.from_numpy(qd).cuda(), k_descale=torch.from_numpy(kd).cuda(),
                                      v_descale=torch.from_numpy(vd).cuda())
    assert got.data_ptr() == out.data_ptr() and lse.shape == (hq, int(cu_q[-1]))
    spec = fp8_spec(d, mask=mask)
    qn, kn, vn = (to_numpy(x.float()) for x in (q8, k8, v8))
    got_n, lse_n = to_numpy(got.float()), to_numpy(lse)
    for i in range(b):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        one = [x[s].transpose(1, 0, 2)[None] for x, s in ((qn, rows), (kn, keys), (vn, keys))]
        descales = dict(q_descale=qd[i:i + 1], k_descale=kd[i:i + 1], v_descale=vd[i:i + 1])
        exact, exact_lse = oracle.attention(*one, mask=spec.mask, return_lse=True, **descales)
        rounded = oracle.attention(*one, mask=spec.mask, p_type=spec.dtype, p_scale=2.0 ** spec.element.p_log2_scale,
                                   **descales)
        mine = got_n[rows].transpose(1, 0, 2)[None]
        # (plus out's own bfloat16 rounding: a sequence of one key has P = 1 exactly, no P error)
        assert relative_error(mine, exact) <= 2 * relative_error(rounded, exact) + 2.0 ** -8, f"sequence {i}"
        np.testing.assert_array_equal(np.isfinite(lse_n[:, rows]), np.isfinite(exact_lse[0]))


def test_the_v_transpose_kernel_takes_a_varlen_batch():
    """V^T of a varlen batch: sequence b's keys (rows cu_seqlens[b] .. cu_seqlens[b + 1] of [total,
    Hkv, d]) as the padded batch [B, Hkv, max_seqlen, d] of the same keys would be transposed."""
    torch = pytest.importorskip("torch")
    from fagen.device import as_device_tensor
    from fagen.fp8_inputs import transposed_v
    from fagen.runtime import v_transposed
    from fagen.sequences import varlen_batch

    rng = np.random.default_rng(5)
    lengths, hkv, d = [130, 1, 300], 2, 128
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    raw = rng.integers(0, 120, (int(cu[-1]), hkv, d), dtype=np.uint8)  # finite e4m3 bytes
    v = torch.from_numpy(raw).cuda().view(torch.float8_e4m3fn)
    cu_d = torch.from_numpy(cu).cuda()
    batch = varlen_batch(v, v, v, cu_d, cu_d, max(lengths), max(lengths))
    got = v_transposed(batch.v, int(batch.arguments["cu_seqlens_k"]))
    padded = np.zeros((len(lengths), hkv, max(lengths), d), np.uint8)
    for i, n in enumerate(lengths):
        padded[i, :, :n] = raw[cu[i]:cu[i + 1]].transpose(1, 0, 2)
    np.testing.assert_array_equal(to_numpy(got.view(torch.uint8)), transposed_v(padded))
    assert as_device_tensor(got, "v^T").shape == (len(lengths), hkv, d, 384)
