"""Every shape the forward runs also trains, on the GPU (marked `gpu`): the backward tilings
fagen.variants.trainable falls back to at head_dim 256 (16 queries a dK/dV step, 16 keys a dQ
tile: what fits a mask with score modifiers) against the float64 oracle's gradients, at awkward
lengths, fp16 and bf16, through fagen.attention with requires_grad torch tensors and through the
compiled backward (fagen.check.check_backward_against_oracle: fresh random inputs, dq, dk, dv and
dsinks NaN-poisoned before the launch, relative errors under the per-dtype tolerance).
Run with: pytest -m gpu tests/test_gpu_trainable.py
"""

import numpy as np
import pytest

import fagen
from fagen import oracle, variants
from fagen.check import LSE_TOLERANCE, OUT_TOLERANCE, check_backward_against_oracle, random_inputs, relative_error, to_numpy
from fagen.runtime import default_spec
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
