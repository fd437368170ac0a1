"""fagen.flex: FlexAttention's score_mod and mask_mod traced into fagen's expression language,
judged by what PyTorch computes from the same Python functions (and autograd for the score's
derivative), over grids of b, h, q_idx, kv_idx that cross zero differences both ways."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fagen import expression  # noqa: E402
from fagen import mod_tracing as flex  # noqa: E402
from fagen.load import SPECS, load_spec, parse_spec  # noqa: E402
from fagen.rendering import render, render_backward  # noqa: E402

W, PREFIX, DILATION, CHUNK, IMAGE_W, RADIUS, HEADS = 9, 5, 3, 8, 6, 1, 4

# attention-gym's masks that need no captured tensor, and a few of fagen's own edge cases
MASK_MODS = {
    "causal": lambda b, h, q, k: q >= k,
    "sliding_window": lambda b, h, q, k: (q >= k) & (q - k <= W),
    "prefix_lm": lambda b, h, q, k: (k <= PREFIX) | (q >= k),
    "dilated_sliding_window": lambda b, h, q, k: (q >= k) & (q - k <= W) & ((q - k) % DILATION == 0),
    "chunked": lambda b, h, q, k: q // CHUNK == k // CHUNK,
    "neighbourhood_2d": lambda b, h, q, k: ((q % IMAGE_W - k % IMAGE_W).abs() <= RADIUS)
    & (torch.abs(q // IMAGE_W - k // IMAGE_W) <= RADIUS),
    "per_head": lambda b, h, q, k: torch.where(h % 2 == 0, q >= k, q <= k),
    "floor_of_negative": lambda b, h, q, k: ((q - k) // 4) % 2 == 0,
    "remainder_of_negative": lambda b, h, q, k: (k - q) % 5 < 2,
    "not_and_xor": lambda b, h, q, k: ~(q < k) ^ (b == 1),
    "batch_and_clamp": lambda b, h, q, k: torch.clamp(q - k, min=-2, max=3) + b != 1,
}

SCORE_MODS = {
    "softcap": lambda s, b, h, q, k: 30.0 * torch.tanh(s / 30.0),
    "alibi": lambda s, b, h, q, k: s - torch.exp2(-8.0 * (h + 1) / HEADS) * (q - k).abs(),
    "relative_position": lambda s, b, h, q, k: s + 0.01 * (q - k),
    "where": lambda s, b, h, q, k: torch.where(q >= k, s, s * 0.5 - 1.0),
    "silu": lambda s, b, h, q, k: s * torch.sigmoid(s),
    "clamp": lambda s, b, h, q, k: s.clamp(min=-3.0, max=4.0),
    "softplus": lambda s, b, h, q, k: torch.log(torch.exp(s) + 1.0),
    "square_and_divide": lambda s, b, h, q, k: s ** 2 / (1.0 + (q - k) ** 2) + s / (h + 1),
    "maximum": lambda s, b, h, q, k: torch.maximum(s, torch.minimum(s * 2.0, (q - k) * 0.25)),
    "int_score": lambda s, b, h, q, k: q - k + s * 0,
}


def _grid():
    b, h, q, k = np.meshgrid(np.arange(2), np.arange(HEADS), np.arange(37), np.arange(37), indexing="ij")
    score = np.random.default_rng(0).standard_normal(b.shape).astype(np.float32) * 4
    return score, b.astype(np.int32), h.astype(np.int32), q.astype(np.int32), k.astype(np.int32)


def _torch(*arrays):
    return [torch.from_numpy(a.astype(np.int64)) if a.dtype != np.float32 else torch.from_numpy(a) for a in arrays]


@pytest.mark.parametrize("name", list(MASK_MODS))
def test_a_traced_mask_mod_sees_the_keys_pytorch_computes(name):
    _, b, h, q, k = _grid()
    text = flex.trace_mask_mod(MASK_MODS[name])
    got = expression.evaluate(expression.mask(text), dict(b=b, h=h, q_idx=q, kv_idx=k))
    want = MASK_MODS[name](*_torch(b, h, q, k)).numpy()
    assert got.dtype == bool and np.array_equal(got, want), text
    assert 0 < want.sum() < want.size  # the mask sees some keys and hides others


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_a_traced_score_mod_and_its_derivative_are_pytorch_s(name):
    score, b, h, q, k = _grid()
    traced = flex.trace_score_mod(SCORE_MODS[name])
    values = dict(score=score, b=b, h=h, q_idx=q, kv_idx=k)
    got = expression.evaluate(expression.score(traced.expression), values)
    grad = np.broadcast_to(expression.evaluate(expression.score(traced.expression_grad), values), score.shape)
    s, *indices = _torch(score, b, h, q, k)
    s = s.double().requires_grad_(True)  # (torch's float32 tanh on the CPU is off by up to ~5e-5 at times)
    want = SCORE_MODS[name](s, *indices).double()
    (want_grad,) = torch.autograd.grad(want.sum(), s, allow_unused=True)
    want_grad = torch.zeros_like(s) if want_grad is None else want_grad
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=2e-5, atol=2e-5, err_msg=traced.expression)
    np.testing.assert_allclose(grad, want_grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=traced.expression_grad)


@pytest.mark.parametrize("divisor, reciprocal", [(30.0, "0.03333333507180214f"), (-4, "-0.25f"), (0.5, "2.0f")])
def test_division_by_a_constant_is_a_product_with_its_float32_reciprocal(divisor, reciprocal):
    """C's `/` is IEEE division (a dozen instructions an element); by a constant the traced mod
    multiplies by the reciprocal rounded to float32, as Triton's `/` is within ulps."""
    traced = flex.trace_score_mod(lambda score, b, h, q_idx, kv_idx: score / divisor)
    assert "/" not in traced.expression and reciprocal in traced.expression.replace("- ", "-")
    by_tensor = flex.trace_score_mod(lambda score, b, h, q_idx, kv_idx: score / (q_idx - kv_idx + 1))
    assert "/ (float)(q_idx - kv_idx + 1)" in by_tensor.expression  # not a constant: IEEE division


@pytest.mark.parametrize("name, per_element", [("alibi", False), ("relative_position", False), ("softcap", True)])
def test_a_score_mod_with_unit_slope_trains_as_a_linear_modifier(name, per_element):
    """d score_mod / d score = 1 (a bias of positions: ALiBi, a relative bias) leaves dS as the
    plain softmax's: the backward keeps no derivative per S register (ScoreMod.nonlinear)."""
    traced = flex.trace_score_mod(SCORE_MODS[name])
    base = load_spec(SPECS / "custom_expressions_f16_d64.yaml").model_dump()
    spec = parse_spec({**base, "name": "traced_f16_d64", "mask": {"kind": "none"},
                       "score_mod": {**base["score_mod"], "softcap": None, "expression": traced.expression,
                                     "expression_grad": traced.expression_grad}})
    assert spec.score_mod.nonlinear == per_element
    assert ("dsdx" in render_backward(spec)) == per_element


def test_traced_mods_make_specs_that_render_forward_and_backward():
    """A traced score_mod and mask_mod are a spec's expression fields: the spec validates and its
    forward and backward render, the expressions pasted as the kernel's text."""
    traced = flex.trace_score_mod(SCORE_MODS["softcap"])
    mask = flex.trace_mask_mod(MASK_MODS["dilated_sliding_window"])
    base = load_spec(SPECS / "custom_expressions_f16_d64.yaml").model_dump()
    spec = parse_spec({**base, "name": "traced_f16_d64",
                       "mask": {"kind": "none", "expression": mask},
                       "score_mod": {**base["score_mod"], "softcap": None, "expression": traced.expression,
                                     "expression_grad": traced.expression_grad}})
    forward, backward = render(spec), render_backward(spec)
    text = "tanhf(score * 0.03333333507180214f)"  # a constant divisor: its float32 reciprocal
    assert text in forward and text in backward
    assert "% 3" in forward


def _branches(b, h, q, k):
    if q > k:
        return True
    return False


def _indexes_a_table_by_a_float(score, b, h, q, k):
    table = torch.zeros(HEADS, 64)
    return score + table[h, score]


@pytest.mark.parametrize("function, kind, says", [
    (_branches, "mask", r"line \d+: if q > k:.*Python branch.*torch.where"),
    (_indexes_a_table_by_a_float, "score", r"line \d+: return score \+ table\[h, score\].*a float index"),
    (lambda s, b, h, q, k: torch.where(q >= k, s, -float("inf")), "score", "mask keys with a mask_mod"),
    (lambda s, b, h, q, k: torch.sin(s), "score", "torch.sin is not among"),
    (lambda s, b, h, q, k: q >= k, "score", "returns a bool"),
    (lambda b, h, q, k: q - k, "mask", "returns a int, not a bool"),
    (lambda b, h, q: q, "mask", r"cannot take FlexAttention's 4 arguments \(b, h, q_idx, kv_idx\)"),
    (lambda s, b, h, q, k: s * 2.5 // 2, "score", "integer // .* only"),
    (lambda s, b, h, q, k: s ** 3.5, "score", r"whole exponents 0..8"),
    (lambda s, b, h, q, k: s + 2**40, "score", "outside int32"),
    (lambda s, b, h, q, k: s + torch.ones(3), "score", r"captured tensor of shape \(3,\)"),
])
def test_what_cannot_be_traced_is_refused_naming_it(function, kind, says):
    trace = flex.trace_score_mod if kind == "score" else flex.trace_mask_mod
    with pytest.raises(flex.TraceError, match=says):
        trace(function)


def test_a_traced_expression_past_the_language_s_length_is_refused_by_the_language():
    def long(score, b, h, q, k):
        for i in range(60):
            score = score + (q - k) * (i + 1)
        return score

    with pytest.raises(flex.TraceError, match="characters, over the limit"):
        flex.trace_score_mod(long)


def test_a_function_is_traced_again_only_when_what_it_reads_changes(monkeypatch):
    """The trace is kept for a function, its closure, defaults and the globals its code names:
    the same values cost a lookup; a closure value, a default or a global changed re-trace."""
    traces = []
    real = flex._trace_score_mod
    monkeypatch.setattr(flex, "_trace_score_mod", lambda fn: traces.append(fn) or real(fn))

    def softcap_of(cap):
        return lambda s, b, h, q, k: cap * torch.tanh(s / cap)

    mod = softcap_of(20.0)
    assert flex.trace_score_mod(mod) is flex.trace_score_mod(mod) and len(traces) == 1
    assert "30.0f" in flex.trace_score_mod(softcap_of(30.0)).expression and len(traces) == 2
    assert flex.trace_score_mod(softcap_of(20.0)).expression == flex.trace_score_mod(mod).expression

    def shifted(s, b, h, q, k, by=1.5):
        return s + by * WIDTH_FOR_CACHE_TEST

    first = flex.trace_score_mod(shifted).expression
    monkeypatch.setattr(shifted, "__defaults__", (2.5,))
    second = flex.trace_score_mod(shifted).expression
    monkeypatch.setitem(globals(), "WIDTH_FOR_CACHE_TEST", 7)
    third = flex.trace_score_mod(shifted).expression
    assert (first, second, third) == ("score + 4.5f", "score + 7.5f", "score + 17.5f")  # Python folds them


WIDTH_FOR_CACHE_TEST = 3


def test_what_may_change_in_place_is_traced_anew_every_call():
    """A closure holding a list or a tensor, or a bound method (whose self is not in its closure),
    is traced again each call: a kept trace would serve values that changed since."""
    def window_of(width):
        holder = [width]
        return lambda b, h, q, k: q - k <= holder[0]

    class Windowed:
        def __init__(self, width):
            self.width = width

        def mask(self, b, h, q, k):
            return q - k <= self.width

    assert [flex.trace_mask_mod(window_of(w)) for w in range(4)] == [f"q_idx - kv_idx <= {w}" for w in range(4)]
    assert [flex.trace_mask_mod(Windowed(w).mask) for w in (4, 100)] == ["q_idx - kv_idx <= 4", "q_idx - kv_idx <= 100"]
    cap = torch.tensor(3.0)
    mod = lambda s, b, h, q, k: s * cap  # noqa: E731
    first = flex.trace_score_mod(mod).expression
    cap.fill_(5.0)
    assert (first, flex.trace_score_mod(mod).expression) == ("score * 3.0f", "score * 5.0f")


@pytest.mark.parametrize("function, at, value, derivative", [
    (lambda s, b, h, q, k: torch.sigmoid(s), -100.0, 0.0, 0.0),  # no 0 * inf / inf
    (lambda s, b, h, q, k: s.abs(), 0.0, 0.0, 0.0),  # sign(0) = 0, as torch's
    (lambda s, b, h, q, k: torch.minimum(s, s * 0 + 1.0), 1.0, 1.0, 0.5),  # a tie: half each, as torch's
    (lambda s, b, h, q, k: torch.clamp(s, min=1.0), 1.0, 1.0, 1.0),  # clamp's ends pass, as torch's
    (lambda s, b, h, q, k: s.where(q >= k, s * 0.5), 2.0, 1.0, 0.5),  # q_idx 1 < kv_idx 2: the other
    (lambda s, b, h, q, k: torch.logical_and(q, k) * s, 3.0, 3.0, 1.0),  # ints' truth, not their bits
])
def test_edge_values_match_pytorch(function, at, value, derivative):
    traced = flex.trace_score_mod(function)
    values = dict(score=np.float32(at), b=0, h=0, q_idx=1, kv_idx=2)
    got = float(expression.evaluate(expression.score(traced.expression), values))
    grad = float(expression.evaluate(expression.score(traced.expression_grad), values))
    s = torch.tensor(at, dtype=torch.float64, requires_grad=True)
    want = function(s, torch.tensor(0), torch.tensor(0), torch.tensor(1), torch.tensor(2))
    (want_grad,) = torch.autograd.grad(want, s)
    assert (got, grad) == pytest.approx((float(want.detach()), float(want_grad)), abs=1e-6) == (value, derivative)


def test_constants_at_the_edges_of_their_types():
    assert flex.trace_mask_mod(lambda b, h, q, k: q - k > -2**31) == "q_idx - kv_idx > -2147483647 - 1"
    with pytest.raises(flex.TraceError, match="finite in float32"):
        flex.trace_score_mod(lambda s, b, h, q, k: s + 1e39)
    with pytest.raises(flex.TraceError, match="a traced exponent"):
        flex.trace_score_mod(lambda s, b, h, q, k: 2 ** s)


def test_a_captured_array_is_read_clamped_in_the_kernel():
    """Rows and keys past a tile's end reach the expression (masked after): the kernel's text
    clamps every index into the array, the language's text (and the oracle) reads it as written."""
    tree = expression.score("score + captured0[q_idx - kv_idx + 3]", 1)
    assert expression.source(tree) == "score + captured0[q_idx - kv_idx + 3]"
    assert "captured0[min(max(q_idx - kv_idx + 3, 0), captured0_size - 1)]" in expression.cuda(tree)


def test_a_trace_that_captures_tensors_is_not_kept():
    """A table reached through a module's attribute may be replaced between calls: each call
    traces afresh and reads the table it finds."""
    import types

    tables = types.ModuleType("tables")
    tables.T = torch.zeros(4, 8)
    score_mod = lambda s, b, h, q, k: s + tables.T[h, k]  # noqa: E731
    first = flex.trace_score_mod(score_mod)
    tables.T = torch.ones(4, 16)
    second = flex.trace_score_mod(score_mod)
    assert first.captured[0] is not second.captured[0] and second.captured[0].shape == (4, 16)
    assert "h * 16" in second.expression


def test_a_captured_table_in_a_closure_is_traced_once():
    """The kernel reads a captured table's values each call, so a trace keyed by the table's
    identity and shape is kept; a table rebound in the closure (a new tensor) is traced anew."""
    def relative_bias(table):
        return lambda s, b, h, q, k: s + table[h, q - k + 7]

    table = torch.zeros(4, 15)
    score_mod = relative_bias(table)
    first = flex.trace_score_mod(score_mod)
    table.add_(1.0)  # values: the kernel's to read
    assert flex.trace_score_mod(score_mod) is first
    other = flex.trace_score_mod(relative_bias(torch.zeros(4, 15)))
    assert other is not first and other.captured[0] is not table


def test_a_bucketed_index_is_proven_in_range():
    """Division by a positive constant bounds an index by the dividend's bounds over it (C
    truncates toward zero), so a bucketed table index, (q - k) // 2 + 15, is proven within 31
    entries at 31 positions (a bound that ignored the divisor refused it)."""
    table = torch.zeros(31)
    traced = flex.trace_score_mod(lambda s, b, h, q, k: s + table[(q - k) // 2 + 15])
    flex.check_captured(traced, dict(b=1, h=1, q_idx=31, kv_idx=31))
    with pytest.raises(flex.TraceError, match="may be -1"):
        flex.check_captured(traced, dict(b=1, h=1, q_idx=33, kv_idx=33))
    for text in ("(q_idx - kv_idx) / 2 + 15", "(kv_idx - q_idx - 3) / 4", "q_idx / 7 - kv_idx / 3"):
        tree = expression.parse(text, expression.MASK_VARIABLES)
        q, k = np.meshgrid(np.arange(31), np.arange(29), indexing="ij")
        values = expression.evaluate(tree, dict(b=0, h=0, q_idx=q, kv_idx=k))
        lo, hi = expression.int_bounds(tree, dict(b=1, h=1, q_idx=31, kv_idx=29))
        assert lo <= values.min() and values.max() <= hi, text


def test_a_branch_is_bounded_by_the_comparison_that_chooses_it():
    """`x < c ? x : y` bounds x below c in its branch (T5's buckets: the exact distances below
    half the table, a clamped log bucket above), and the bounds stay sound against the values."""
    extents = dict(b=1, h=1, q_idx=300, kv_idx=300)
    q, k = np.meshgrid(np.arange(300), np.arange(300), indexing="ij")
    for text, want in (("q_idx < 16 ? q_idx : 20", (0, 20)), ("q_idx >= 16 ? 3 : q_idx", (0, 15)),
                       ("q_idx - kv_idx > 5 ? q_idx - kv_idx : 0", (0, 299)),
                       ("q_idx <= 7 ? q_idx : min(q_idx, 9)", (0, 9)),
                       ("q_idx < kv_idx ? q_idx : 0", (0, 299))):  # not against a number: not narrowed
        tree = expression.parse(text, expression.MASK_VARIABLES)
        assert expression.int_bounds(tree, extents) == want, text
        values = expression.evaluate(tree, dict(b=0, h=0, q_idx=q, kv_idx=k))
        assert want[0] <= values.min() and values.max() <= want[1], text
    table = torch.zeros(2, 32)

    def bucketed(s, b, h, q, k):
        distance = (q - k).clamp(min=0)
        return s + table[h, torch.where(distance < 16, distance, 31)]
    t5 = flex.trace_score_mod(bucketed)
    flex.check_captured(t5, dict(b=1, h=2, q_idx=4096, kv_idx=4096))
