"""fagen.oracle.attention_backward against central finite differences of the forward: the
gradient of L = sum(attention(...) * dout) with respect to q, k, v, bias and sinks, for every
mask kind and every score modifier, on tiny float64 inputs (GQA, Nq != Nk both ways).

Tolerance: |analytic - numeric| <= TOL * max(|numeric|, 1) in the Frobenius norm; central
differences with EPS = 1e-6 are good to ~1e-9 here."""

from __future__ import annotations

import numpy as np
import pytest

from fagen import masks, oracle

EPS = 1e-6
TOL = 1e-6


def inputs(rng, batch=2, heads_q=4, heads_kv=2, n_q=5, n_kv=7, d=4):
    q = rng.standard_normal((batch, heads_q, n_q, d)) * 1.5
    k = rng.standard_normal((batch, heads_kv, n_kv, d))
    v = rng.standard_normal((batch, heads_kv, n_kv, d))
    return q, k, v


def numeric_grad(loss, x):
    """Central differences of loss at x, one element at a time."""
    x = np.array(x, np.float64)
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        saved = x[i]
        x[i] = saved + EPS
        up = loss(x)
        x[i] = saved - EPS
        down = loss(x)
        x[i] = saved
        grad[i] = (up - down) / (2 * EPS)
    return grad


def check(q, k, v, rng, *, bias=None, sinks=None, score_mod_grad=None, **kw):
    """attention_backward's every gradient against finite differences; returns them."""
    dout = rng.standard_normal(q.shape)
    got = oracle.attention_backward(q, k, v, dout, bias=bias, sinks=sinks, score_mod_grad=score_mod_grad, **kw)
    args = {"q": q, "k": k, "v": v, "bias": bias, "sinks": sinks}
    given = [name for name, x in args.items() if x is not None]
    assert sorted(got) == sorted("d" + name for name in given)
    for name in given:
        def loss(x, name=name):
            a = {**args, name: x}
            out = oracle.attention(a["q"], a["k"], a["v"], bias=a["bias"], sinks=a["sinks"], **kw)
            return float(np.sum(out * dout))

        want = numeric_grad(loss, args[name])
        assert got["d" + name].shape == np.shape(args[name]), name
        assert np.isfinite(got["d" + name]).all(), name
        err = np.linalg.norm(got["d" + name] - want) / max(np.linalg.norm(want), 1.0)
        assert err <= TOL, (name, err)
    return got


def _fresh():
    return np.random.default_rng()


# ---- masks ---------------------------------------------------------------------------------

SHAPES = [(5, 7), (7, 5)]
ALIGNS = ["bottom_right", "top_left"]
MASKS = {
    "none": {"kind": "none"},
    "causal": {"kind": "causal"},
    "sliding_window": {"kind": "sliding_window", "window_left": 2, "window_right": 1},
    "sliding_window_left_only": {"kind": "sliding_window", "window_left": 1},
    "chunked": {"kind": "chunked", "chunk_size": 3},
    "prefix_lm": {"kind": "prefix_lm", "prefix_len": 2},
}


@pytest.mark.parametrize("n_q, n_kv", SHAPES)
@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("name", MASKS)
def test_static_masks(name, align, n_q, n_kv):
    rng = _fresh()
    q, k, v = inputs(rng, n_q=n_q, n_kv=n_kv)
    check(q, k, v, rng, mask={**MASKS[name], "align": align})


@pytest.mark.parametrize("n_q, n_kv", SHAPES)
def test_causal_flag(n_q, n_kv):
    rng = _fresh()
    q, k, v = inputs(rng, batch=1, heads_q=2, heads_kv=1, n_q=n_q, n_kv=n_kv)
    check(q, k, v, rng, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_document(causal):
    rng = _fresh()
    q, k, v = inputs(rng, n_q=7, n_kv=7)
    doc_ids = np.array([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 3]], np.int32)
    check(q, k, v, rng, mask={"kind": "document", "causal": causal}, doc_ids=doc_ids)
    check(q, k, v, rng, doc_ids=doc_ids[:1], causal=causal)  # doc_ids alone: a document mask


@pytest.mark.parametrize("n_q, n_kv", SHAPES)
def test_block_mask(n_q, n_kv):
    rng = _fresh()
    q, k, v = inputs(rng, n_q=n_q, n_kv=n_kv)
    bm = masks.from_predicate(lambda b, h, qi, ki: (qi * 2 + ki + h) % 3 != 0, 1, 4, n_q, n_kv, 2, 4)
    check(q, k, v, rng, mask={"kind": "block_mask"}, block_mask=bm)


@pytest.mark.parametrize("n_q, n_kv", SHAPES)
def test_mask_mod(n_q, n_kv):
    rng = _fresh()
    q, k, v = inputs(rng, n_q=n_q, n_kv=n_kv)
    check(q, k, v, rng, mask_mod=lambda b, h, qi, ki: (qi * 3 + ki + b + h) % 4 != 0)


# ---- score modifiers -----------------------------------------------------------------------

@pytest.mark.parametrize("cap", [0.7, 5.0])
def test_softcap(cap):
    rng = _fresh()
    q, k, v = inputs(rng)
    check(q, k, v, rng, softcap=cap, scale=0.8)


def test_alibi():
    rng = _fresh()
    q, k, v = inputs(rng, n_q=7, n_kv=5)
    check(q, k, v, rng, alibi_slopes=rng.uniform(0.1, 1.0, 4), causal=True)


@pytest.mark.parametrize("shape", [(2, 4, 7), (2, 1, 7), (1, 1, 7), (2, 4, 5, 7), (1, 4, 5, 7), (2, 1, 5, 7)])
def test_bias(shape):
    rng = _fresh()
    q, k, v = inputs(rng)
    got = check(q, k, v, rng, bias=rng.standard_normal(shape), mask={"kind": "sliding_window", "window_left": 3})
    assert got["dbias"].shape == shape


def test_score_mod():
    rng = _fresh()
    q, k, v = inputs(rng)
    check(q, k, v, rng, score_mod=lambda s, b, h, qi, ki: s * 0.5 + np.sin(s),
          score_mod_grad=lambda s, b, h, qi, ki: 0.5 + np.cos(s), causal=True)


def test_score_mod_of_indices():
    """score_mod_grad may return an array that only broadcasts to the scores (here per head)."""
    rng = _fresh()
    q, k, v = inputs(rng)
    check(q, k, v, rng, score_mod=lambda s, b, h, qi, ki: s * (1 + 0.25 * h) + 0.1 * qi - 0.2 * ki * b,
          score_mod_grad=lambda s, b, h, qi, ki: 1 + 0.25 * h)


@pytest.mark.parametrize("n_q, n_kv", SHAPES)
def test_sinks(n_q, n_kv):
    rng = _fresh()
    q, k, v = inputs(rng, n_q=n_q, n_kv=n_kv)
    got = check(q, k, v, rng, sinks=rng.uniform(-1.0, 1.5, 4), causal=True)
    assert got["dsinks"].shape == (4,)


def test_every_modifier_at_once():
    rng = _fresh()
    q, k, v = inputs(rng)
    check(q, k, v, rng, softcap=2.0, alibi_slopes=rng.uniform(0.1, 1.0, 4), bias=rng.standard_normal((1, 4, 5, 7)),
          score_mod=lambda s, b, h, qi, ki: s * 0.5 + np.sin(s), score_mod_grad=lambda s, b, h, qi, ki: 0.5 + np.cos(s),
          sinks=rng.uniform(-1.0, 1.0, 4), mask={"kind": "chunked", "chunk_size": 3, "align": "top_left"},
          mask_mod=lambda b, h, qi, ki: (qi + ki + h) % 5 != 1)


# ---- empty rows and refusals ---------------------------------------------------------------

@pytest.mark.parametrize("with_sinks", [False, True])
def test_empty_rows_have_zero_gradient(with_sinks):
    """Bottom-right causal with Nq > Nk: queries 0 and 1 see no key; mask_mod also empties
    query 4. Their gradients are 0 (no NaN), with or without a sink to absorb the row."""
    rng = _fresh()
    q, k, v = inputs(rng, n_q=7, n_kv=5)
    sinks = rng.uniform(-1.0, 1.0, 4) if with_sinks else None
    got = check(q, k, v, rng, causal=True, sinks=sinks, bias=rng.standard_normal((2, 4, 7, 5)),
                mask_mod=lambda b, h, qi, ki: qi != 4)
    for row in (0, 1, 4):
        assert not got["dq"][:, :, row].any()
        assert not got["dbias"][:, :, row].any()


def test_fully_masked_input_gives_zero_gradients():
    rng = _fresh()
    q, k, v = inputs(rng)
    got = oracle.attention_backward(q, k, v, rng.standard_normal(q.shape), sinks=np.zeros(4),
                                    mask_mod=lambda b, h, qi, ki: qi < 0)
    for name, grad in got.items():
        assert np.array_equal(grad, np.zeros_like(grad)), name


def test_score_mod_without_its_grad_is_refused():
    rng = _fresh()
    q, k, v = inputs(rng)
    with pytest.raises(ValueError, match="score_mod_grad"):
        oracle.attention_backward(q, k, v, np.ones(q.shape), score_mod=lambda s, b, h, qi, ki: s * 0.5)


def test_dout_of_the_wrong_shape_is_refused():
    rng = _fresh()
    q, k, v = inputs(rng)
    with pytest.raises(ValueError, match="dout"):
        oracle.attention_backward(q, k, v, np.ones(q.shape[:-1]))
