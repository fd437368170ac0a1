"""The FP8 backward (fagen.fp8_backward) on the GPU (marked `gpu`; Hopper only): e4m3 q, k, v with
per-(batch, KV head) descales, dO in bfloat16 or float16, every buffer the backward allocates
NaN-filled (dO's e4m3 copy with 0xff bytes: e4m3's NaN), against the float64 oracle.

Two references: the oracle that rounds dO, P and dS where and at the scales the kernel does
(`fp8_type`), D from the forward's out and P from its LSE as the kernel reads them, which the kernel must track far
closer than the model is to exact (what is left: the FP8 MMA's accumulation, about 13 bits, in
S and so in P, the MUFU's exp2, and the elements whose rounding these move to
a neighbouring e4m3 value); and exact gradients of the FP8 inputs, against which the FP8
roundings themselves cost ~4e-2 (notes/fp8_backward.md), so the kernel's error there must be the
model's."""

import numpy as np
import pytest

from fagen import fp8_backward_rounding, oracle
from fagen.check import relative_error, to_numpy
from fagen.element_types import ELEMENT_TYPES
from fagen.spec import Mask, ScoreMod

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
D = 128
E4M3 = ELEMENT_TYPES["float8_e4m3"]
# against the rounding model: at most this share of the model's own error (see above; measured up to
# 0.36). Not for dK and dV of fewer queries than a step: their rows sum a few products, so one
# rounding that the MMA's accumulation moves to its neighbour is a large share (1 query against
# 1000 keys: the model's own dV moves 3.4e-2 when its LSE moves 1e-3)
MODEL_FRACTION = 0.5
EXACT_SLACK = 1.1  # against exact gradients: at most 10% over the model's own error


def _quantized(rng, shape, hkv, scale=1.0):
    """(e4m3 tensor, its [B, Hkv] float32 descale): a float32 activation at amax / 448 a (batch,
    KV head), times a random factor so descales differ by head."""
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).cuda()
    b, h = shape[:2]
    amax = x.abs().amax(dim=(2, 3)).reshape(b, hkv, -1).amax(-1)
    descale = amax / E4M3.max_finite * torch.from_numpy(rng.uniform(1.0, 2.0, amax.shape).astype(np.float32)).cuda()
    per_head = descale.repeat_interleave(h // hkv, dim=1)[:, :, None, None]
    return (x / per_head).to(torch.float8_e4m3fn), descale


def _true(x8, descale):
    """The float64 tensor an e4m3 one and its [B, Hkv] descale stand for."""
    x = to_numpy(x8.float()).astype(np.float64)
    d = to_numpy(descale).astype(np.float64)
    return x * np.repeat(d, x.shape[1] // d.shape[1], axis=1)[:, :, None, None]


def _forward(q8, k8, v8, descales, mask: Mask):
    """The FP8 forward's bfloat16 out and its LSE."""
    from fagen import runtime, variants

    spec = variants.fp8_spec("float8_e4m3", D, mask, ScoreMod())
    return runtime.compile_kernel(spec)(q8, k8, v8, return_lse=True, **descales)


# (B, Hq, Hkv, Nq, Nk): ragged both ways (a partial 128-key block, a partial 64-query step), GQA,
# more keys than queries (causal bottom right), more queries than keys (causal: the first rows see
# none, whole key blocks see no step), one query, whole blocks
SHAPES = [(2, 4, 2, 300, 300), (1, 4, 1, 77, 513), (1, 2, 2, 200, 100), (3, 2, 1, 1, 1000), (1, 2, 1, 1152, 1152)]


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_fp8_backward_tracks_its_rounding_model(out_dtype, causal, shape):
    _check_against_the_model(shape, out_dtype, Mask(kind="causal") if causal else Mask())


# The other kinds it walks (FP8_BACKWARD_MASKS), a diagonal each way: key blocks a window leaves
# without a step, chunks across block and step edges, a prefix wider than a step, more queries
# than keys top left (the last keys seen by no query)
MASK_CASES = [
    (Mask(kind="sliding_window", window_left=200, window_right=30), (1, 4, 2, 700, 900), "bfloat16"),
    (Mask(kind="sliding_window", window_left=64, align="top_left"), (2, 2, 1, 300, 500), "float16"),
    (Mask(kind="chunked", chunk_size=192), (1, 4, 1, 500, 600), "bfloat16"),
    (Mask(kind="prefix_lm", prefix_len=100, align="top_left"), (1, 2, 2, 400, 333), "bfloat16"),
    (Mask(kind="causal", align="top_left"), (2, 2, 1, 300, 450), "float16"),
]


@pytest.mark.parametrize("mask,shape,out_dtype", MASK_CASES, ids=lambda x: getattr(x, "kind", None))
def test_the_fp8_backward_tracks_its_rounding_model_under_every_mask_it_takes(mask, shape, out_dtype):
    _check_against_the_model(shape, out_dtype, mask)


# deterministic: dQ added in key-block order (a tile's turn count), bitwise repeatable; many key
# blocks a query tile, GQA, ragged ends, and the masked walks whose first visitor is not block 0
DETERMINISTIC_CASES = [(Mask(), (2, 4, 2, 1000, 1500)), (Mask(kind="causal"), (1, 4, 1, 700, 1300)),
                       (Mask(kind="sliding_window", window_left=300, window_right=20), (1, 2, 2, 900, 900)),
                       (Mask(kind="chunked", chunk_size=192, align="top_left"), (1, 2, 1, 600, 500))]


@pytest.mark.parametrize("mask,shape", DETERMINISTIC_CASES, ids=lambda x: getattr(x, "kind", None))
def test_the_deterministic_fp8_backward_is_bitwise_repeatable_and_tracks_the_model(mask, shape):
    again = _check_against_the_model(shape, "bfloat16", mask, deterministic=True)
    first = again()
    for _ in range(3):
        for name, x, y in zip(("dq", "dk", "dv"), first, again()):
            assert torch.equal(x.view(torch.int16), y.view(torch.int16)), name


@pytest.mark.parametrize("mask", [Mask(), Mask(kind="causal")], ids=["full", "causal"])
def test_the_deterministic_fp8_backward_takes_turns_across_waves_of_blocks(mask):
    """Many more blocks than SMs (B 4, 8 KV heads, 2048 keys: 512 blocks): a block waits only for
    blocks launched before it, so the turns cannot deadlock; dK and dV are the default's bit for
    bit (their sums are a block's own), dQ the same sums in another order."""
    import cupy

    from fagen import fp8_backward

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the FP8 backward needs a Hopper GPU")
    rng = np.random.default_rng(7)
    b, hq, hkv, n = 4, 16, 8, 2048
    q8, qd = _quantized(rng, (b, hq, n, D), hkv, scale=1.5)
    k8, kd = _quantized(rng, (b, hkv, n, D), hkv, scale=1.5)
    v8, vd = _quantized(rng, (b, hkv, n, D), hkv)
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    out, lse = _forward(q8, k8, v8, descales, mask)
    dout = torch.from_numpy(rng.standard_normal((b, hq, n, D)).astype(np.float32)).to("cuda", out.dtype)
    grads = [fp8_backward.backward(dout, q8, k8, v8, out, lse, mask=mask, deterministic=d, **descales)
             for d in (True, True, False)]
    for name, first, second, default in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(first.view(torch.int16), second.view(torch.int16)), name
        if name == "dq":
            assert relative_error(to_numpy(first.float()), to_numpy(default.float())) < 1e-2
        else:
            assert torch.equal(first.view(torch.int16), default.view(torch.int16)), name


def _check_against_the_model(shape, out_dtype: str, mask: Mask, deterministic: bool = False):
    """The backward of random e4m3 inputs against the rounding model and exact gradients; returns
    a call of it again on the same inputs."""
    import cupy

    from fagen import fp8_backward
    from fagen.bench_backward import nan_filled_empties

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the FP8 backward needs a Hopper GPU")
    b, hq, hkv, nq, nk = shape
    rng = np.random.default_rng([b, hq, hkv, nq, nk, len(mask.kind), len(mask.align), len(out_dtype)])
    q8, qd = _quantized(rng, (b, hq, nq, D), hkv, scale=1.5)
    k8, kd = _quantized(rng, (b, hkv, nk, D), hkv, scale=1.5)
    v8, vd = _quantized(rng, (b, hkv, nk, D), hkv)
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    out, lse = _forward(q8, k8, v8, descales, mask)
    dt = getattr(torch, out_dtype)
    out = out.to(dt)
    dout = torch.from_numpy(rng.standard_normal((b, hq, nq, D)).astype(np.float32)).to("cuda", dt)
    def again():
        return fp8_backward.backward(dout, q8, k8, v8, out, lse, mask=mask, deterministic=deterministic, **descales)
    with nan_filled_empties() as filled:
        dq, dk, dv = again()
    assert filled
    q, k, v = _true(q8, qd), _true(k8, kd), _true(v8, vd)
    dout64 = to_numpy(dout.float()).astype(np.float64)
    keywords = dict(mask=mask)
    model = oracle.attention_backward(q, k, v, dout64, fp8_type="float8_e4m3", out=to_numpy(out.float()),
                                      lse=to_numpy(lse), **keywords)
    exact = oracle.attention_backward(q, k, v, dout64, **keywords)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert got.dtype == dt and tuple(got.shape) == model[name].shape
        g = to_numpy(got.float()).astype(np.float64)
        to_model, to_exact, model_error = (relative_error(g, model[name]), relative_error(g, exact[name]),
                                           relative_error(model[name], exact[name]))
        print(name, f"model {to_model:.2e} exact {to_exact:.2e} (model's own {model_error:.2e})")
        assert np.isfinite(g).all(), name
        if name == "dq" or nq >= fp8_backward_rounding.STEP_QUERIES:
            assert to_model <= MODEL_FRACTION * model_error, (name, to_model, model_error)
        assert to_exact <= EXACT_SLACK * model_error + 1e-3, (name, to_exact, model_error)
    return again


def test_the_fp8_backward_refuses_what_it_cannot_read():
    from fagen import fp8_backward

    q8 = torch.zeros((1, 2, 64, D), dtype=torch.float8_e4m3fn, device="cuda")
    out = torch.zeros((1, 2, 64, D), dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros((1, 2, 64), dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match=r"q: a torch bfloat16 tensor; the FP8 backward reads"):
        fp8_backward.backward(out, out, q8, q8, out, lse)
    with pytest.raises(ValueError, match=r"head_dim: q 64"):
        fp8_backward.backward(out[..., :64], q8[..., :64], q8[..., :64], q8[..., :64], out[..., :64], lse)
    with pytest.raises(ValueError, match=r"dout: dtype float32"):
        fp8_backward.backward(out.float(), q8, q8, q8, out, lse)
    with pytest.raises(ValueError, match=r"lse: torch float32 \(1, 2, 63\)"):
        fp8_backward.backward(out, q8, q8, q8, out, lse[..., :63])
    with pytest.raises(ValueError, match=r"mask: kind 'document'; the FP8 backward takes the kinds none, causal"):
        fp8_backward.backward(out, q8, q8, q8, out, lse, mask={"kind": "document"})
    with pytest.raises(ValueError, match=r"mask: an expression; the FP8 backward takes"):
        fp8_backward.backward(out, q8, q8, q8, out, lse, mask={"kind": "causal", "expression": "kv_idx % 2 == 0"})
    with pytest.raises(ValueError, match=r"q_descale: shape \(3,\)"):
        fp8_backward.backward(out, q8, q8, q8, out, lse, q_descale=torch.ones(3, device="cuda"))


@pytest.mark.parametrize("mask", [Mask(), Mask(kind="causal")], ids=["full", "causal"])
def test_fagen_attention_fp8_trains_bfloat16_tensors_through_the_fp8_kernels(mask):
    """fagen.attention(q, k, v, fp8=True) on bfloat16 leaves: out and the gradients are the FP8
    forward's and backward's on q, k, v quantized a (batch, KV head) at a time, bit for bit (the
    same kernels called by hand, deterministic: the default adds dQ in no fixed order), in
    bfloat16 and near the bfloat16 attention's (FP8's own error); deterministic=True repeats bit
    for bit."""
    import cupy

    import fagen
    from fagen import fp8_backward, fp8_inputs

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the FP8 kernels need a Hopper GPU")
    gen = torch.Generator(device="cuda").manual_seed(4)
    b, hq, hkv, n = 2, 4, 2, 300
    q, k, v = (torch.randn(b, h, n, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, n, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = fagen.attention(q, k, v, mask=mask, fp8=True, deterministic=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    (q8, qd), (k8, kd), (v8, vd) = (fp8_inputs.quantized(x, hkv) for x in (q, k, v))
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    want_out, want_lse = _forward(q8, k8, v8, descales, mask)
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16))
    by_hand = fp8_backward.backward(dout, q8, k8, v8, want_out, want_lse, mask=mask, deterministic=True, **descales)
    for got, want in zip(grads, by_hand):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # near the bfloat16 attention's: e4m3 keeps 3 mantissa bits (a rounding's relative error ~3.6%
    # RMS), and q, k, v and P are rounded, dO and dS too (out measured 5.4e-2 without a mask, the
    # backward's gradients 3.8-4.2e-2 from exact ones in the bench)
    bf16_out = fagen.attention(q, k, v, mask=mask)
    assert relative_error(to_numpy(out.float()), to_numpy(bf16_out.float())) < 1e-1
    default = torch.autograd.grad(fagen.attention(q, k, v, mask=mask, fp8=True), (q, k, v), dout)
    for got, want in zip(default, torch.autograd.grad(bf16_out, (q, k, v), dout)):
        assert relative_error(to_numpy(got.float()), to_numpy(want.float())) < 1.5e-1
    again = [torch.autograd.grad(fagen.attention(q, k, v, mask=mask, fp8=True, deterministic=True), (q, k, v), dout)
             for _ in range(2)]
    for x, y in zip(*again):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("mask", [Mask(), Mask(kind="causal")], ids=["full", "causal"])
def test_incoherent_fp8_halves_the_error_where_channels_are_outliers(mask):
    """fp8=True, incoherent=True on activations with four channels of q and k at 100x (the FP8
    bench's outliers): q and k rotated before they are quantized, so out's error against exact
    attention of the unquantized inputs falls to well under the plain FP8 call's (the CPU model,
    tests/test_incoherent.py: 0.50-0.58x), and the gradients, rotated back, are no worse than the
    plain call's against the bfloat16 attention's."""
    import cupy

    import fagen

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the FP8 kernels need a Hopper GPU")
    gen = torch.Generator(device="cuda").manual_seed(11)
    b, h, n = 1, 4, 512
    q, k, v = (torch.randn(b, h, n, D, device="cuda", generator=gen) for _ in range(3))
    spread = ((D - 4 + 4 * 100.0 ** 4) / D) ** 0.25  # scores of unit variance, as the bench's
    for x in (q, k):
        x[..., :4] *= 100.0
        x /= spread
    q, k, v = (x.bfloat16().requires_grad_() for x in (q, k, v))
    dout = torch.randn(b, h, n, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    exact = torch.from_numpy(oracle.attention(*(to_numpy(x.detach().double()) for x in (q, k, v)),
                                              causal=mask.kind == "causal"))
    errors, grads = {}, {}
    for incoherent in (False, True):
        out = fagen.attention(q, k, v, mask=mask, fp8=True, incoherent=incoherent)
        assert not torch.isnan(out).any()
        errors[incoherent] = relative_error(to_numpy(out.float()), exact.numpy())
        grads[incoherent] = torch.autograd.grad(out, (q, k, v), dout)
    assert errors[True] < 0.65 * errors[False], errors
    reference = torch.autograd.grad(fagen.attention(q, k, v, mask=mask), (q, k, v), dout)
    for name, plain, rotated, want in zip("qkv", grads[False], grads[True], reference):
        plain_error = relative_error(to_numpy(plain.float()), to_numpy(want.float()))
        rotated_error = relative_error(to_numpy(rotated.float()), to_numpy(want.float()))
        assert rotated_error < min(1.5e-1, 1.1 * plain_error), (name, plain_error, rotated_error)


def test_fagen_attention_fp8_refuses_what_it_does_not_quantize_by_name():
    import fagen

    x = torch.zeros((1, 2, 64, D), device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q: torch.float16 \(1, 2, 64, 128\); fp8=True quantizes bfloat16"):
        fagen.attention(x.half(), x, x, fp8=True)
    with pytest.raises(ValueError, match=r"softcap: not with fp8=True"):
        fagen.attention(x, x, x, fp8=True, softcap=30.0)
    with pytest.raises(ValueError, match=r"incoherent=True: only with fp8=True"):
        fagen.attention(x, x, x, incoherent=True)
    with pytest.raises(ValueError, match=r"head_dim: q 64, k 64, v 64; fp8=True takes 128"):
        fagen.attention(x[..., :64], x[..., :64], x[..., :64], fp8=True)
    with pytest.raises(ValueError, match=r"mask: kind 'document'; fp8=True takes"):
        fagen.attention(x, x, x, fp8=True, mask={"kind": "document"})
    with pytest.raises(ValueError, match=r"Hq a multiple of Hkv"):
        fagen.attention(x, x[:, :1].expand(1, 3, 64, D)[:, :3], x[:, :1].expand(1, 3, 64, D), fp8=True)
