"""Kernels with spec expressions against the oracle reading the same expressions (marked `gpu`):
no NumPy twin is passed by hand, so the oracle judges what the spec says. The shipped
custom_expressions spec and a mask expression derived through fagen.attention, forward and
gradients, at awkward lengths, fp16, outputs NaN-poisoned; each also shown to differ from plain
causal attention, so a kernel that dropped its expression would fail.
Run with: pytest -m gpu tests/test_gpu_expressions.py
"""

import numpy as np
import pytest

import fagen
from fagen import oracle
from fagen.backward import compile_backward
from fagen.check import (OUT_TOLERANCE, check_against_oracle, check_backward_against_oracle, random_inputs,
                         relative_error, to_numpy)
from fagen.load import SPECS
from fagen.runtime import compile_kernel

pytestmark = pytest.mark.gpu

CUSTOM = SPECS / "custom_expressions_f16_d64.yaml"
LENGTHS = [(1, 239), (113, 203), (203, 113), (1023, 1024)]  # (Nq, Nk)
HEADS_KV = (4, 2, 1)  # Hq = 4: MHA, GQA, MQA
GRAD_TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2}  # as tests/test_gpu_torch.py's


@pytest.mark.parametrize("nq, nk", LENGTHS)
def test_custom_expressions_forward_against_the_oracle(nq, nk):
    """fagen check's path: check_against_oracle hands the oracle spec.mask and spec.score_mod."""
    spec = fagen.load_spec(CUSTOM)
    for i, hkv in enumerate(HEADS_KV):
        result = check_against_oracle(spec, 2, 4, hkv, nq, nk, layout=("bhnd", "bnhd")[i % 2])
        print(result.summary())
        assert result.passed, result.summary()


@pytest.mark.parametrize("nq, nk", LENGTHS)
def test_custom_expressions_backward_against_the_oracle(nq, nk):
    spec = fagen.load_spec(CUSTOM)
    for i, hkv in enumerate(HEADS_KV):
        result = check_backward_against_oracle(spec, 2, 4, hkv, nq, nk, layout=("bhnd", "bnhd")[i % 2])
        print(result.summary())
        assert result.passed, result.summary()


@pytest.mark.parametrize("nq, nk", [(113, 203), (1, 239)])
def test_the_expressions_change_the_result(nq, nk):
    """The kernel matches the oracle with the spec's expressions and is far from plain causal
    attention: forward (out, lse) and gradients."""
    spec = fagen.load_spec(CUSTOM)
    q, k, v, out = random_inputs("cupy", "float16", 2, 4, 2, nq, nk, 64)  # out: NaN-filled
    out, lse = compile_kernel(spec)(q, k, v, out=out, return_lse=True)
    qn, kn, vn = (to_numpy(x) for x in (q, k, v))
    ref, ref_lse = oracle.attention(qn, kn, vn, mask=spec.mask, score_mod=spec.score_mod, return_lse=True)
    plain = oracle.attention(qn, kn, vn, causal=True)
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"]
    assert relative_error(to_numpy(lse), ref_lse) < 1e-4
    assert relative_error(to_numpy(out), plain) > 10 * OUT_TOLERANCE["float16"]

    dout, _, _, dq = random_inputs("cupy", "float16", 2, 4, 2, nq, nk, 64)  # dq: NaN-filled
    dk, dv = (random_inputs("cupy", "float16", 2, 2, 2, nk, nk, 64)[3] for _ in range(2))
    backward = compile_backward(spec)
    fwd_out, fwd_lse = backward.forward(q, k, v, return_lse=True)
    grads = backward(dout, q, k, v, fwd_out, fwd_lse, dq=dq, dk=dk, dv=dv)
    ref = oracle.attention_backward(qn, kn, vn, to_numpy(dout), mask=spec.mask, score_mod=spec.score_mod)
    plain = oracle.attention_backward(qn, kn, vn, to_numpy(dout), causal=True)
    for name in ("dq", "dk", "dv"):
        got = to_numpy(getattr(grads, name))
        assert relative_error(got, ref[name]) < GRAD_TOLERANCE["float16"], name
        assert relative_error(got, plain[name]) > 10 * GRAD_TOLERANCE["float16"], name


MASKS = [  # masks with expressions fagen.attention derives a kernel for, as dicts (the oracle reads them too)
    {"kind": "sliding_window", "window_left": 100, "expression": "((q_idx ^ kv_idx) & 3) != 1"},
    {"kind": "causal", "expression": "(kv_idx + h) % 7 != 3"},  # head 3 of 239x239: row 0 sees no key
]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m["kind"])
@pytest.mark.parametrize("nq, nk", [(113, 203), (1, 239), (239, 239)])
def test_a_derived_mask_expression_trains_against_the_oracle(mask, nq, nk):
    """fagen.attention with a mask expression: out, lse and autograd's dq, dk, dv against the
    oracle given the same mask dict, and against the mask's kind alone (which must differ)."""
    torch = pytest.importorskip("torch")
    import fagen.torch_op  # noqa: F401  (registers torch.ops.fagen)

    q, k, v, _ = random_inputs("torch", "float16", 2, 4, 2, nq, nk, 64)
    dout = random_inputs("torch", "float16", 2, 4, 2, nq, nk, 64)[0]
    leaves = [x.requires_grad_() for x in (q, k, v)]
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # torch.empty fills with NaN: unwritten = inf error
    try:
        out, lse = fagen.attention(q, k, v, mask=mask, return_lse=True)
        grads = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout)))
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    qn, kn, vn, dn = (to_numpy(x) for x in (q, k, v, dout))
    ref, ref_lse = oracle.attention(qn, kn, vn, mask=mask, return_lse=True)
    kind_only = {f: x for f, x in mask.items() if f != "expression"}
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"]
    assert relative_error(to_numpy(lse), ref_lse) < 1e-4
    assert relative_error(to_numpy(out), oracle.attention(qn, kn, vn, mask=kind_only)) > 10 * OUT_TOLERANCE["float16"]
    ref_grads = oracle.attention_backward(qn, kn, vn, dn, mask=mask)
    kind_grads = oracle.attention_backward(qn, kn, vn, dn, mask=kind_only)
    for name, got in grads.items():
        assert relative_error(to_numpy(got), ref_grads[name]) < GRAD_TOLERANCE["float16"], name
        assert relative_error(to_numpy(got), kind_grads[name]) > 10 * GRAD_TOLERANCE["float16"], name
    assert not np.isnan(to_numpy(out)).any()
