"""fagen.captured_grads: the expression's derivative by each captured read, and the expression
evaluated on torch tensors, each against what it stands in for (autograd through the same
evaluation; the NumPy evaluator the oracle uses)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fagen import captured_grads, derivatives, expression  # noqa: E402

# score_mod expressions over two captured arrays, each read once or more
EXPRESSIONS = [
    "score + captured0[h * 15 + q_idx - kv_idx + 7]",
    "score * captured0[h] + captured1[kv_idx % 5] * captured1[kv_idx % 5]",
    "tanhf(score / captured0[h]) * 3.0f",
    "expf(captured0[h] - 1.0f) + logf(fabsf(captured1[q_idx % 5]) + 0.5f) + sqrtf(captured1[1] + 4.0f)",
    "fminf(score, captured0[h]) - fmaxf(captured1[kv_idx % 5], 0.25f) + fabsf(captured0[0])",
    "q_idx >= kv_idx ? score - captured0[2] * (float)(q_idx - kv_idx) : -captured1[0] / (score * score + 1.0f)",
    "exp2f(captured0[h]) + log2f(captured1[2] * captured1[2] + 1.0f) + floorf(captured0[1]) * score",
    # ints as the kernel's: x / 0 and x % 0 as the evaluator, shifts in int32, a float cast saturating
    "captured0[(q_idx / (kv_idx - 3) + q_idx % (kv_idx - 2) + 40) % 45] + (float)((q_idx + 1) << 31 < 0) "
    "+ (float)(-9 >> kv_idx + 28) + (float)(int)(score * 1e30f)",
    "fminf(captured0[h], captured0[h]) + fmaxf(captured1[0], sqrtf(-1.0f - fabsf(score)))",  # a tie, beside a NaN
    # a division by a float literal (its constant folds to a NumPy float), inside an exponential
    "score + captured0[h] * (float)(q_idx - kv_idx) / 16.0f + expf(captured1[kv_idx % 5] / -4.0f)",
]
EXTENTS = dict(b=2, h=3, q_idx=7, kv_idx=8)


def _values(gen, requires_grad=False):
    b, h, q, k = (torch.arange(n).view(*[-1 if i == axis else 1 for i in range(4)])
                  for axis, n in enumerate(EXTENTS.values()))
    score = torch.randn(2, 3, 7, 8, generator=gen)
    tables = [torch.randn(45, generator=gen).requires_grad_(requires_grad),
              torch.randn(5, generator=gen).requires_grad_(requires_grad)]
    return {"b": b, "h": h, "q_idx": q, "kv_idx": k, "score": score, "captured0": tables[0], "captured1": tables[1]}


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_evaluate_torch_is_the_numpy_evaluator(text):
    tree = expression.score(text, 2)
    values = _values(torch.Generator().manual_seed(len(text)))
    got = captured_grads.evaluate_torch(tree, values)
    want = expression.evaluate(tree, {name: x.numpy() for name, x in values.items()})
    np.testing.assert_allclose(np.broadcast_to(got.numpy(), want.shape), want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_each_read_s_derivative_is_autograd_s(text):
    """sum over reads of (d expression / d read) scattered at the read's index, against autograd
    through evaluate_torch with the arrays requiring grad; a read the expression only rounds or
    compares has none."""
    tree = expression.score(text, 2)
    values = _values(torch.Generator().manual_seed(7 * len(text)), requires_grad=True)
    weights = torch.randn(2, 3, 7, 8, generator=torch.Generator().manual_seed(3))
    result = captured_grads.evaluate_torch(tree, values).expand(weights.shape)
    want = torch.autograd.grad((result * weights).sum(), [values["captured0"], values["captured1"]],
                               allow_unused=True)
    got = [torch.zeros(45), torch.zeros(5)]
    with torch.no_grad():
        for read in dict.fromkeys(expression.loads(tree)):
            grad = derivatives.load_derivative(tree, read)
            if grad is None:
                continue
            index = captured_grads.evaluate_torch(read.index, values).expand(weights.shape).reshape(-1)
            part = (weights * captured_grads.evaluate_torch(grad, values)).reshape(-1)
            got[int(read.array[-1])].index_add_(0, index, part.expand(index.shape))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w, rtol=1e-5, atol=1e-5)


def test_constants_live_on_the_values_device():
    """Every constant is made on the values' device (a CPU scalar beside CUDA tensors would be a
    host copy a use: no CUDA graph could hold the gradient): on the meta device nothing is on
    the CPU."""
    tree = expression.score(EXPRESSIONS[5], 2)
    values = {name: x.to("meta") for name, x in _values(torch.Generator().manual_seed(1)).items()}
    assert captured_grads.evaluate_torch(tree, values).device.type == "meta"
    for read in expression.loads(tree):
        assert captured_grads.evaluate_torch(derivatives.load_derivative(tree, read), values).device.type == "meta"


def test_the_scatter_is_exact_whatever_the_order():
    """_add_exactly: the same bits for any order of the terms (integer sums), within 2^-30 of the
    largest term of the float64 sum, and a zero slab adds nothing."""
    gen = torch.Generator().manual_seed(5)
    part = torch.randn(100_000, generator=gen) * torch.rand(100_000, generator=gen) ** 8 * 1e3
    index = torch.randint(0, 97, (100_000,), generator=gen)
    totals = []
    for order in (torch.arange(100_000), torch.randperm(100_000, generator=gen), torch.arange(100_000).flip(0)):
        total = torch.zeros(97, dtype=torch.float64)
        captured_grads._add_exactly(total, index[order], part[order])
        totals.append(total)
    assert all(torch.equal(totals[0], t) for t in totals[1:])
    want = torch.zeros(97, dtype=torch.float64).index_add_(0, index, part.double())
    assert float((totals[0] - want).abs().max()) <= float(part.abs().max()) * 2.0 ** -30
    captured_grads._add_exactly(totals[0], index, torch.zeros_like(part))
    assert torch.equal(totals[0], totals[1])


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_a_fused_read_s_derivative_stays_within_its_bound(text):
    """split_wanted gives the dK/dV kernel the arrays whose every read has a derivative free of the
    score with a bound (FixedPointSums' scale rests on it): that interval, computed on tensors
    from the arrays' least and largest elements as the kernel's caller computes it, holds the
    derivative at every point."""
    tree = expression.score(text, 2)
    fused, eager = captured_grads.split_wanted(tree, [True, True], EXTENTS)
    values = _values(torch.Generator().manual_seed(len(text)))
    ranges = {name: (values[name].amin().double(), values[name].amax().double()) for name in ("captured0", "captured1")}
    for i in fused:
        for read, grad in derivatives.read_derivatives(tree, {f"captured{i}"}):
            assert "score" not in expression.reads(grad)
            lo, hi = derivatives.interval(grad, ranges, EXTENTS, captured_grads.TensorOps)
            got = captured_grads.evaluate_torch(grad, values).double()
            slack = 1e-5 * torch.maximum(lo.abs(), hi.abs()) if torch.is_tensor(lo) else 1e-5 * max(abs(lo), abs(hi))
            # (the interval is exact arithmetic's; float32 rounds within the slack)
            assert bool((got >= lo - slack).all() and (got <= hi + slack).all()), (text, expression.source(grad))
    assert not any(i in fused and eager[i] for i in range(2))


def test_which_reads_the_kernel_sums():
    """Outside the kernel: a derivative that reads the score, one with no bound (a logarithm),
    one whose bound is past LOOSEST_BOUND (a float cast to int); inside: a decaying amplitude,
    whose bound the signs keep at 1 (an unsigned bound, exp(|x|), was 1e22 at N 1024: every
    term rounded to 0)."""
    extents = dict(b=1, h=2, q_idx=1024, kv_idx=1024)
    tree = expression.score("score * captured0[h] + captured1[kv_idx % 5] * captured1[kv_idx % 5]", 2)
    assert captured_grads.split_wanted(tree, [True, True], extents) == ((1,), [True, False])
    assert captured_grads.split_wanted(tree, [False, True], extents) == ((1,), [False, False])
    for text in ("score + logf(captured0[h])", "score + captured0[h] * (float)(int)(score * 1e6f)",
                 "score + captured0[h] * (float)(int)(captured0[0] * 1e9f)"):
        assert captured_grads.split_wanted(expression.score(text, 1), [True], extents) == ((), [True]), text
    decaying = expression.score("score + captured0[h] * expf(-(float)abs(q_idx - kv_idx) * 0.05f)", 1)
    assert captured_grads.split_wanted(decaying, [True], extents) == ((0,), [False])
    (_, grad), = derivatives.read_derivatives(decaying, {"captured0"})
    assert derivatives.magnitude(derivatives.interval(grad, {"captured0": (-1.0, 1.0)}, extents)) == 1.0


@pytest.mark.parametrize("text, grad, reference", [
    ("score + captured0[h * 15 + q_idx - kv_idx + 7] * captured1[h]", "1.0f",
     lambda s, h, qi, ki, t0, t1: s + t0.reshape(-1)[h * 15 + qi - ki + 7] * t1[h]),
    ("score * captured0[h] + captured1[kv_idx % 3]", "captured0[h]",
     lambda s, h, qi, ki, t0, t1: s * t0.reshape(-1)[h] + t1[ki % 3]),
])
def test_the_oracle_s_captured_gradients_are_autograd_s(text, grad, reference):
    """oracle.attention_backward's "dcaptured" (each read's derivative from fagen.derivatives, in
    float64) against PyTorch's autograd through the same function, GQA and a causal mask."""
    from fagen import oracle

    gen = torch.Generator().manual_seed(len(text))
    b, hq, hkv, n, d = 2, 3, 1, 8, 16
    q, k, v, dout = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    tables = [torch.randn(hq, 15, generator=gen, dtype=torch.float64), torch.randn(3, generator=gen,
                                                                                  dtype=torch.float64)]
    got = oracle.attention_backward(*(x.numpy() for x in (q, k, v, dout)), causal=True, captured=[t.numpy() for t in tables],
                                    score_mod={"expression": text, "expression_grad": grad, "captured": 2})["dcaptured"]
    leaves = [t.clone().requires_grad_() for t in tables]
    hi, qi, ki = torch.arange(hq).view(1, -1, 1, 1), torch.arange(n).view(1, 1, -1, 1), torch.arange(n).view(1, 1, 1, -1)
    s = reference(q @ k.repeat_interleave(hq // hkv, 1).transpose(-1, -2) * d ** -0.5, hi, qi, ki, *leaves)
    p = torch.softmax(torch.where(qi >= ki, s, -torch.inf), dim=-1)
    want = torch.autograd.grad(p @ v.repeat_interleave(hq // hkv, 1), leaves, dout)
    for g, w in zip(got, want):
        assert g.shape == tuple(w.shape) and np.allclose(g, w.numpy(), rtol=1e-10, atol=1e-12)
