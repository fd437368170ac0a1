"""Every shape the forward runs also trains, on the GPU (marked `gpu`): the backward tilings
fagen.variants.trainable falls back to at head_dim 256 (16 queries a dK/dV step, 16 keys a dQ
tile: what fits a mask with score modifiers, or a bias) against the float64 oracle's gradients, at awkward
lengths, fp16 and bf16, through fagen.attention with requires_grad torch tensors and through the
compiled backward (fagen.check.check_backward_against_oracle: fresh random inputs, dq, dk, dv and
dsinks NaN-poisoned before the launch, relative errors under the per-dtype tolerance); a bias's
gradient (dbias) too.
Run with: pytest -m gpu tests/test_gpu_trainable.py
"""

import numpy as np
import pytest

import fagen
from fagen import oracle, variants
from fagen.check import (LSE_TOLERANCE, OUT_TOLERANCE, check_backward_against_oracle, random_extras, random_inputs,
                         relative_error, to_numpy)
from fagen.dispatch import default_spec
from fagen.spec import Mask, ScoreMod

pytestmark = pytest.mark.gpu

# (Nq, Nk): a single query, lengths that are no tile's multiple, Nq < Nk and Nq > Nk
LENGTHS = [(113, 203), (1, 239), (203, 113), (1023, 1024)]
GEMMA_WINDOW = Mask(kind="sliding_window", window_left=300)
# ||grad - ref|| / ||ref|| against float64 (as tests/test_gpu_torch.py's)
GRAD_TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2}


def _fallback(spec):
    """The tiling under test: the smallest of trainable's (not the head_dim's first)."""
    bwd = spec.backward
    return (bwd.head_split, bwd.block_q, bwd.dq_block_kv) in ((2, 16, 16), (2, 16, 32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("nq, nk", LENGTHS)
def test_gemma_shape_trains_through_fagen_attention(dtype, deterministic, nq, nk):
    """head_dim 256, a sliding window of 300, softcap 30 (Gemma 2 and 3), GQA: autograd's dq, dk,
    dv against the oracle's. Gradients come from torch.empty outputs that deterministic mode fills
    with NaN, so an element no kernel writes fails."""
    torch = pytest.importorskip("torch")
    import fagen.torch_op  # noqa: F401  (registers torch.ops.fagen)

    spec = variants.trainable(variants.variant(default_spec(dtype, 256, False), GEMMA_WINDOW, ScoreMod(softcap=30.0)),
                              deterministic)
    assert _fallback(spec), spec.backward
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # torch.empty fills with NaN
    try:
        seed = nq * 7 + nk + deterministic
        q, k, v, _ = random_inputs("torch", dtype, 2, 4, 2, nq, nk, 256, "bhnd", seed=seed)
        dout = random_inputs("torch", dtype, 2, 4, 2, nq, nk, 256, "bhnd", seed=seed + 1)[0]
        leaves = [x.requires_grad_() for x in (q, k, v)]
        mask = {"kind": "sliding_window", "window_left": 300}
        out, lse = fagen.attention(q, k, v, mask=mask, softcap=30.0, return_lse=True, deterministic=deterministic)
        grads = torch.autograd.grad(out, leaves, dout)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    qn, kn, vn = (to_numpy(x) for x in (q, k, v))
    ref_out, ref_lse = oracle.attention(qn, kn, vn, mask=GEMMA_WINDOW, softcap=30.0, return_lse=True)
    ref = oracle.attention_backward(qn, kn, vn, to_numpy(dout), mask=GEMMA_WINDOW, softcap=30.0)
    errors = {"out": relative_error(to_numpy(out), ref_out), "lse": relative_error(to_numpy(lse), ref_lse)}
    errors.update({name: relative_error(to_numpy(g), ref[name]) for name, g in zip(("dq", "dk", "dv"), grads)})
    tolerance = dict.fromkeys(("dq", "dk", "dv"), GRAD_TOLERANCE[dtype]) | {"out": OUT_TOLERANCE[dtype],
                                                                           "lse": LSE_TOLERANCE}
    print(spec.name, errors)
    assert all(np.isfinite(e) and e <= tolerance[name] for name, e in errors.items()), (errors, tolerance)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mask", [GEMMA_WINDOW, Mask(kind="causal"), Mask(kind="chunked", chunk_size=192),
                                  Mask(kind="prefix_lm", prefix_len=150), Mask(kind="document", causal=True),
                                  Mask(kind="block_mask")], ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_head_dim_256_fallback_tiling_against_oracle(dtype, mask, deterministic):
    """The compiled backward of each mask kind with every modifier head_dim 256 trains (softcap,
    ALiBi, sinks: dsinks too), MHA, GQA and MQA, both layouts."""
    forward = variants.variant(default_spec(dtype, 256, mask.kind == "causal"), mask,
                               ScoreMod(softcap=30.0, alibi="slopes", sinks=True))
    spec = variants.trainable(forward, deterministic)
    assert _fallback(spec), spec.backward
    for i, (nq, nk) in enumerate(LENGTHS[:3]):
        nk = nq if mask.kind == "document" else nk  # packed self-attention
        result = check_backward_against_oracle(spec, 2, 4, (4, 2, 1)[i], nq, nk, layout=("bhnd", "bnhd")[i % 2],
                                               seed=101 * i + deterministic)
        print(result.summary())
        assert result.passed, result.summary()


# A bias at head_dim 256 [B|1, Hq|1, ...] by what it broadcasts (B = 2, Hq = 4): per head (one
# batch row), shared, per batch row
BIAS_HEADS_256 = [(1, 4), (1, 1), (2, 1)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["vector", "matrix"])
@pytest.mark.parametrize("modifiers", [{}, {"softcap": 30.0, "alibi": "slopes", "sinks": True}], ids=["bias", "every"])
@pytest.mark.parametrize("bias_grad, deterministic", [(False, False), (True, False), (True, True)])
def test_head_dim_256_with_a_bias_against_oracle(dtype, kind, modifiers, bias_grad, deterministic):
    """head_dim 256 with a vector or matrix bias (alone, or with softcap, ALiBi and sinks), its
    gradient or not (deterministic: a copy each for blocks sharing an element): the compiled
    backward's dq, dk, dv (and dbias, dsinks) against the oracle's, under no mask, Gemma's window
    and causal documents, MHA, GQA and MQA, both layouts, each bias broadcast."""
    masks = [Mask(), GEMMA_WINDOW, Mask(kind="document", causal=True)]
    for i, (nq, nk) in enumerate(LENGTHS[:3]):
        mask = masks[i]
        nk = nq if mask.kind == "document" else nk  # packed self-attention
        forward = variants.variant(default_spec(dtype, 256, False), mask, ScoreMod(bias=kind, **modifiers))
        spec = variants.trainable(forward, deterministic, bias_grad)
        assert _fallback(spec) and spec.backward.bias_grad == bias_grad, spec.backward
        rng = np.random.default_rng(7 * i + 2 * bias_grad + deterministic)
        shape = BIAS_HEADS_256[i]
        bias = rng.standard_normal((*shape, nq, nk) if kind == "matrix" else (*shape, nk)).astype(np.float32)
        extras = {**random_extras(spec, 2, 4, nq, nk, seed=11 * i), "bias": bias}
        result = check_backward_against_oracle(spec, 2, 4, (4, 2, 1)[i], nq, nk, layout=("bhnd", "bnhd")[i % 2],
                                               seed=101 * i + deterministic, extras=extras)
        print(result.summary())
        assert result.passed, result.summary()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["vector", "matrix"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_head_dim_256_learned_bias_trains_through_fagen_attention(dtype, kind, deterministic):
    """Gemma's shape with a bias that requires grad, through fagen.attention and autograd at
    113 x 203: dq, dk, dv and dbias (summed over what the bias broadcasts) against the oracle's.
    Gradients come from torch.empty outputs that deterministic mode fills with NaN."""
    torch = pytest.importorskip("torch")
    import fagen.torch_op  # noqa: F401  (registers torch.ops.fagen)

    nq, nk = LENGTHS[0]
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # torch.empty fills with NaN
    try:
        q, k, v, _ = random_inputs("torch", dtype, 2, 4, 2, nq, nk, 256, "bhnd", seed=61 + deterministic)
        dout = random_inputs("torch", dtype, 2, 4, 2, nq, nk, 256, "bhnd", seed=62 + deterministic)[0]
        gen = torch.Generator(device="cuda").manual_seed(63)
        shape = (1, 4, nq, nk) if kind == "matrix" else (2, 1, nk)
        bias = torch.randn(shape, generator=gen, device="cuda")
        leaves = [x.requires_grad_() for x in (q, k, v, bias)]
        mask = {"kind": "sliding_window", "window_left": 300}
        out = fagen.attention(q, k, v, mask=mask, softcap=30.0, bias=bias, deterministic=deterministic)
        grads = torch.autograd.grad(out, leaves, dout)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    qn, kn, vn, bn = (to_numpy(x) for x in (q, k, v, bias))
    ref_out = oracle.attention(qn, kn, vn, mask=GEMMA_WINDOW, softcap=30.0, bias=bn)
    ref = oracle.attention_backward(qn, kn, vn, to_numpy(dout), mask=GEMMA_WINDOW, softcap=30.0, bias=bn)
    errors = {"out": relative_error(to_numpy(out), ref_out)}
    errors.update({name: relative_error(to_numpy(g), ref[name]) for name, g in zip(("dq", "dk", "dv", "dbias"), grads)})
    tolerance = dict.fromkeys(("dq", "dk", "dv", "dbias"), GRAD_TOLERANCE[dtype]) | {"out": OUT_TOLERANCE[dtype]}
    print(errors)
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
    assert all(np.isfinite(e) and e <= tolerance[name] for name, e in errors.items()), (errors, tolerance)
