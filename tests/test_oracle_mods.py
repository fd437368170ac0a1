"""fagen.oracle's masks and score modifiers against attention written out row by row, one
(b, h, i) at a time, with Python loops and math (float64), on small fresh random inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fagen import masks, oracle
from fagen.spec import Mask


def reference(q, k, v, *, scale=None, softcap=None, slopes=None, bias=None, score=None, keep=None, sinks=None):
    """O and LSE row by row. score(s, b, h, i, j) and keep(b, h, i, j) act on one pair.

    Order: s = scale q.k, softcap, ALiBi, bias, score; pairs that keep() refuses drop out.
    A sink is one more logit per head in the max and the denominator, with no value."""
    batch, heads_q, n_q, d = q.shape
    heads_kv, n_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((batch, heads_q, n_q, d))
    lse = np.zeros((batch, heads_q, n_q))
    for b in range(batch):
        for h in range(heads_q):
            hk = h // group
            for i in range(n_q):
                js, scores = [], []
                for j in range(n_kv):
                    if keep is not None and not keep(b, h, i, j):
                        continue
                    s = scale * sum(float(q[b, h, i, c]) * float(k[b, hk, j, c]) for c in range(d))
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= float(slopes[h]) * abs(i + n_kv - n_q - j)
                    if bias is not None:
                        bb, bh = min(b, bias.shape[0] - 1), min(h, bias.shape[1] - 1)
                        s += float(bias[bb, bh, j] if bias.ndim == 3 else bias[bb, bh, i, j])
                    if score is not None:
                        s = score(s, b, h, i, j)
                    js.append(j)
                    scores.append(s)
                sink = None if sinks is None else float(sinks[h])
                if not js and sink is None:
                    lse[b, h, i] = -math.inf  # O stays exactly 0
                    continue
                top = max(scores + ([sink] if sink is not None else []))
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights) + (math.exp(sink - top) if sink is not None else 0.0)
                for c in range(d):
                    out[b, h, i, c] = sum(w * float(v[b, hk, j, c]) for w, j in zip(weights, js)) / total
                lse[b, h, i] = top + math.log(total)
    return out, lse


def inputs(batch=2, heads_q=4, heads_kv=2, n_q=7, n_kv=10, d=8, rng=None):
    rng = rng or np.random.default_rng()
    q = rng.standard_normal((batch, heads_q, n_q, d)) * 1.5
    k = rng.standard_normal((batch, heads_kv, n_kv, d))
    v = rng.standard_normal((batch, heads_kv, n_kv, d))
    return q, k, v


def compare(got, want):
    out, lse = got
    ref_out, ref_lse = want
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-10, atol=1e-12)


SHAPES = [(7, 10), (10, 7), (6, 6), (1, 9)]


# ---- score modifiers -----------------------------------------------------------------------

@pytest.mark.parametrize("n_q, n_kv", SHAPES)
@pytest.mark.parametrize("cap", [0.5, 2.0, 30.0])
def test_softcap(n_q, n_kv, cap):
    q, k, v = inputs(n_q=n_q, n_kv=n_kv)
    compare(oracle.attention(q, k, v, softcap=cap, return_lse=True), reference(q, k, v, softcap=cap))


def test_softcap_bounds_scores():
    """A tiny cap squeezes every score into (-cap, cap): LSE lies in log(Nk) +- cap."""
    q, k, v = inputs(n_q=5, n_kv=9)
    q *= 50
    _, lse = oracle.attention(q, k, v, softcap=0.1, return_lse=True)
    assert np.all(np.abs(lse - math.log(9)) <= 0.1 + 1e-12)


@pytest.mark.parametrize("n_q, n_kv", SHAPES)
def test_alibi(n_q, n_kv):
    rng = np.random.default_rng()
    q, k, v = inputs(n_q=n_q, n_kv=n_kv, rng=rng)
    slopes = rng.uniform(0.05, 1.5, 4)
    compare(oracle.attention(q, k, v, alibi_slopes=slopes, return_lse=True), reference(q, k, v, slopes=slopes))


def test_alibi_with_causal_and_scale():
    rng = np.random.default_rng()
    q, k, v = inputs(n_q=6, n_kv=11, rng=rng)
    slopes = rng.uniform(0.05, 1.5, 4)
    got = oracle.attention(q, k, v, alibi_slopes=slopes, causal=True, scale=0.3, return_lse=True)
    compare(got, reference(q, k, v, slopes=slopes, scale=0.3, keep=lambda b, h, i, j: j <= i + 11 - 6))


@pytest.mark.parametrize("shape", [(2, 4, 10), (1, 4, 10), (2, 1, 10), (1, 1, 10)])
def test_vector_bias_broadcasts(shape):
    rng = np.random.default_rng()
    q, k, v = inputs(n_q=7, n_kv=10, rng=rng)
    bias = rng.standard_normal(shape) * 2
    compare(oracle.attention(q, k, v, bias=bias, return_lse=True), reference(q, k, v, bias=bias))


@pytest.mark.parametrize("shape", [(2, 4, 7, 10), (1, 4, 7, 10), (2, 1, 7, 10), (1, 1, 7, 10)])
def test_matrix_bias_broadcasts(shape):
    rng = np.random.default_rng()
    q, k, v = inputs(n_q=7, n_kv=10, rng=rng)
    bias = rng.standard_normal(shape) * 2
    compare(oracle.attention(q, k, v, bias=bias, return_lse=True), reference(q, k, v, bias=bias))


@pytest.mark.parametrize("shape", [(3, 4, 10), (2, 3, 10), (2, 4, 9), (2, 4, 10, 7), (2, 4, 7, 10, 1), (10,)])
def test_bias_of_the_wrong_shape_is_refused(shape):
    q, k, v = inputs(n_q=7, n_kv=10)
    with pytest.raises(ValueError, match="bias"):
        oracle.attention(q, k, v, bias=np.zeros(shape))


def test_score_mod_callable():
    q, k, v = inputs(n_q=7, n_kv=10)

    def score_vec(s, b, h, qi, ki):
        return s * 0.5 + 0.25 * (h % 2) - 0.1 * b + 0.05 * np.cos(qi - 2 * ki)

    def score_one(s, b, h, i, j):
        return s * 0.5 + 0.25 * (h % 2) - 0.1 * b + 0.05 * math.cos(i - 2 * j)

    compare(oracle.attention(q, k, v, score_mod=score_vec, return_lse=True), reference(q, k, v, score=score_one))


def test_score_mod_sees_absolute_indices():
    """score_mod gets broadcastable index arrays that cover every (b, h, q, k)."""
    q, k, v = inputs(batch=2, heads_q=4, heads_kv=2, n_q=7, n_kv=10)
    seen = {}

    def spy(s, b, h, qi, ki):
        seen["shape"] = np.broadcast_shapes(b.shape, h.shape, qi.shape, ki.shape)
        seen["max"] = (b.max(), h.max(), qi.max(), ki.max())
        assert s.shape == (2, 4, 7, 10)
        return s

    oracle.attention(q, k, v, score_mod=spy)
    assert seen == {"shape": (2, 4, 7, 10), "max": (1, 3, 6, 9)}


# ---- masks ---------------------------------------------------------------------------------

def test_mask_mod_callable():
    q, k, v = inputs(n_q=7, n_kv=10)
    got = oracle.attention(q, k, v, mask_mod=lambda b, h, qi, ki: (qi * 3 + ki + b + h) % 4 != 0, return_lse=True)
    compare(got, reference(q, k, v, keep=lambda b, h, i, j: (i * 3 + j + b + h) % 4 != 0))


def _keep_of(kind, n_q, n_kv, **f):
    off = n_kv - n_q if f.get("align", "bottom_right") == "bottom_right" else 0
    if kind == "causal":
        return lambda b, h, i, j: j <= i + off
    if kind == "sliding_window":
        return lambda b, h, i, j: i + off - f["window_left"] <= j <= i + off + f.get("window_right", 0)
    if kind == "chunked":
        c = f["chunk_size"]
        return lambda b, h, i, j: j <= i + off and j >= ((i + off) // c) * c
    if kind == "prefix_lm":
        return lambda b, h, i, j: j <= i + off or j < f["prefix_len"]
    if kind == "none":
        return lambda b, h, i, j: True
    raise AssertionError(kind)


MASKS = [
    {"kind": "causal"},
    {"kind": "causal", "align": "top_left"},
    {"kind": "sliding_window", "window_left": 2},
    {"kind": "sliding_window", "window_left": 1, "window_right": 2},
    {"kind": "sliding_window", "window_left": 0, "window_right": 3, "align": "top_left"},
    {"kind": "chunked", "chunk_size": 3},
    {"kind": "chunked", "chunk_size": 4, "align": "top_left"},
    {"kind": "prefix_lm", "prefix_len": 4},
    {"kind": "prefix_lm", "prefix_len": 2, "align": "top_left"},
    {"kind": "none"},
]


@pytest.mark.parametrize("fields", MASKS, ids=lambda f: "-".join(str(x) for x in f.values()))
@pytest.mark.parametrize("n_q, n_kv", SHAPES)
@pytest.mark.parametrize("form", ["Mask", "dict"])
def test_static_mask_as_mask_or_dict(fields, n_q, n_kv, form):
    q, k, v = inputs(n_q=n_q, n_kv=n_kv)
    mask = Mask(**fields) if form == "Mask" else dict(fields)
    want = reference(q, k, v, keep=_keep_of(n_q=n_q, n_kv=n_kv, **fields))
    compare(oracle.attention(q, k, v, mask=mask, return_lse=True), want)


@pytest.mark.parametrize("kind", ["causal", "none"])  # block_mask needs its array (test_builders_hardening)
@pytest.mark.parametrize("n_q, n_kv", SHAPES)
def test_mask_as_kind_string(kind, n_q, n_kv):
    q, k, v = inputs(n_q=n_q, n_kv=n_kv)
    keep = _keep_of("causal" if kind == "causal" else "none", n_q, n_kv)
    compare(oracle.attention(q, k, v, mask=kind, return_lse=True), reference(q, k, v, keep=keep))


def test_causal_flag_is_bottom_right():
    q, k, v = inputs(n_q=4, n_kv=9)
    compare(oracle.attention(q, k, v, causal=True, return_lse=True),
            reference(q, k, v, keep=lambda b, h, i, j: j <= i + 5))


def test_invalid_mask_dict_is_refused():
    q, k, v = inputs()
    with pytest.raises(ValueError):
        oracle.attention(q, k, v, mask={"kind": "sliding_window"})  # window_left missing


@pytest.mark.parametrize("n_q, n_kv", SHAPES)
def test_block_mask(n_q, n_kv):
    rng = np.random.default_rng()
    q, k, v = inputs(n_q=n_q, n_kv=n_kv, rng=rng)
    dense = rng.random((2, 4, n_q, n_kv)) < 0.6
    bm = masks.from_dense(dense, 4, 4)
    compare(oracle.attention(q, k, v, block_mask=bm, return_lse=True),
            reference(q, k, v, keep=lambda b, h, i, j: dense[b, h, i, j]))


def test_block_mask_broadcast_and_causal_type():
    """A [1, 1] causal block mask (CAUSAL blocks with an offset) applies to every (b, h)."""
    q, k, v = inputs(n_q=6, n_kv=13)
    bm = masks.causal(6, 13, q_block=4, kv_block=4)
    assert masks.CAUSAL in set(np.unique(bm.block_type_grid()))
    compare(oracle.attention(q, k, v, block_mask=bm, return_lse=True),
            reference(q, k, v, keep=lambda b, h, i, j: j <= i + 7))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch_ids", [2, 1])
def test_document_mask(causal, batch_ids):
    rng = np.random.default_rng()
    n = 11
    q, k, v = inputs(n_q=n, n_kv=n, rng=rng)
    docs = np.stack([np.sort(rng.integers(0, 4, n)) for _ in range(batch_ids)]).astype(np.int32)

    def keep(b, h, i, j):
        row = docs[min(b, batch_ids - 1)]
        return row[i] == row[j] and (not causal or j <= i)

    for mask in (Mask(kind="document", causal=causal), {"kind": "document", "causal": causal}):
        compare(oracle.attention(q, k, v, mask=mask, doc_ids=docs, return_lse=True), reference(q, k, v, keep=keep))


def test_masks_and_together():
    """causal, mask, block_mask and mask_mod all apply at once."""
    rng = np.random.default_rng()
    q, k, v = inputs(n_q=9, n_kv=12, rng=rng)
    dense = rng.random((1, 4, 9, 12)) < 0.8
    bm = masks.from_dense(dense, 4, 8)

    def keep(b, h, i, j):
        return j <= i + 3 and j >= i + 3 - 5 and dense[0, h, i, j] and (i + j) % 5 != 1

    got = oracle.attention(q, k, v, causal=True, mask={"kind": "sliding_window", "window_left": 5},
                           block_mask=bm, mask_mod=lambda b, h, qi, ki: (qi + ki) % 5 != 1, return_lse=True)
    compare(got, reference(q, k, v, keep=keep))


# ---- sinks and empty rows ------------------------------------------------------------------

@pytest.mark.parametrize("n_q, n_kv", SHAPES)
def test_sinks(n_q, n_kv):
    rng = np.random.default_rng()
    q, k, v = inputs(n_q=n_q, n_kv=n_kv, rng=rng)
    sinks = rng.uniform(-2, 4, 4)
    compare(oracle.attention(q, k, v, sinks=sinks, return_lse=True), reference(q, k, v, sinks=sinks))


def test_sinks_formula():
    """O = sum p_j v_j / (sum p_j + exp(sink - m)), LSE = log(sum exp(s_j) + exp(sink))."""
    rng = np.random.default_rng()
    q, k, v = inputs(batch=1, heads_q=2, heads_kv=1, n_q=3, n_kv=5, rng=rng)
    sinks = np.array([0.7, 6.0])  # the second dominates its rows' max
    out, lse = oracle.attention(q, k, v, sinks=sinks, return_lse=True)
    d = q.shape[-1]
    for h in range(2):
        for i in range(3):
            s = [float(q[0, h, i] @ k[0, 0, j]) / math.sqrt(d) for j in range(5)]
            m = max(s + [sinks[h]])
            p = [math.exp(x - m) for x in s]
            den = sum(p) + math.exp(sinks[h] - m)
            assert out[0, h, i] == pytest.approx(sum(pj * v[0, 0, j] for j, pj in enumerate(p)) / den, rel=1e-12)
            assert lse[0, h, i] == pytest.approx(math.log(sum(math.exp(x) for x in s) + math.exp(sinks[h])), rel=1e-12)


def test_fully_masked_rows_without_sinks():
    q, k, v = inputs(n_q=6, n_kv=8)
    dead = {1, 4}

    def mod(b, h, qi, ki):
        return ~np.isin(qi, list(dead)) & (ki >= 0)

    out, lse = oracle.attention(q, k, v, mask_mod=mod, return_lse=True)
    for i in dead:
        assert np.all(out[:, :, i] == 0.0)
        assert np.all(np.isneginf(lse[:, :, i]))
    assert np.isfinite(lse[:, :, [0, 2, 3, 5]]).all()
    compare((out, lse), reference(q, k, v, keep=lambda b, h, i, j: i not in dead))
    # causal with Nq > Nk: the first Nq - Nk rows see no key
    q, k, v = inputs(n_q=9, n_kv=4)
    out, lse = oracle.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(out[:, :, :5] == 0.0) and np.all(np.isneginf(lse[:, :, :5]))
    assert np.isfinite(lse[:, :, 5:]).all()


def test_fully_masked_rows_with_sinks():
    rng = np.random.default_rng()
    q, k, v = inputs(n_q=9, n_kv=4, rng=rng)
    sinks = rng.uniform(-2, 4, 4)
    out, lse = oracle.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert np.all(out[:, :, :5] == 0.0)
    np.testing.assert_allclose(lse[:, :, :5], np.broadcast_to(sinks[None, :, None], (2, 4, 5)), rtol=0, atol=1e-12)
    compare((out, lse), reference(q, k, v, sinks=sinks, keep=lambda b, h, i, j: j <= i - 5))


def test_out_without_lse_matches():
    q, k, v = inputs()
    sinks = np.linspace(-1, 1, 4)
    out = oracle.attention(q, k, v, sinks=sinks, softcap=3.0)
    np.testing.assert_allclose(out, reference(q, k, v, sinks=sinks, softcap=3.0)[0], rtol=1e-10, atol=1e-12)


# ---- everything at once --------------------------------------------------------------------

@pytest.mark.parametrize("n_q, n_kv", SHAPES)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_composition_in_documented_order(n_q, n_kv, with_sinks):
    """softcap, then ALiBi, then bias, then score_mod, then the mask: each step sees the
    previous one's output (softcap bounds s before ALiBi and bias move it; score_mod is
    non-linear, so any other order gives other numbers)."""
    rng = np.random.default_rng()
    q, k, v = inputs(n_q=n_q, n_kv=n_kv, rng=rng)
    q *= 3
    cap = 1.5
    slopes = rng.uniform(0.1, 0.8, 4)
    bias = rng.standard_normal((2, 1, n_q, n_kv))
    sinks = rng.uniform(-1, 2, 4) if with_sinks else None
    dense = rng.random((2, 1, n_q, n_kv)) < 0.85
    bm = masks.from_dense(dense, 4, 4)

    def score_vec(s, b, h, qi, ki):
        return s * np.abs(s) * 0.3 + 0.1 * h

    def score_one(s, b, h, i, j):
        return s * abs(s) * 0.3 + 0.1 * h

    def keep(b, h, i, j):
        return j <= i + n_kv - n_q + 1 and dense[b, 0, i, j] and (i * j) % 7 != 3

    got = oracle.attention(q, k, v, softcap=cap, alibi_slopes=slopes, bias=bias, score_mod=score_vec,
                           mask={"kind": "sliding_window", "window_left": 100, "window_right": 1},
                           block_mask=bm, mask_mod=lambda b, h, qi, ki: (qi * ki) % 7 != 3,
                           sinks=sinks, return_lse=True)
    want = reference(q, k, v, softcap=cap, slopes=slopes, bias=bias, score=score_one, keep=keep, sinks=sinks)
    compare(got, want)
    # the order matters: ALiBi before softcap would give other numbers
    swapped = reference(q, k, v, slopes=slopes, bias=bias, keep=keep, sinks=sinks,
                        score=lambda s, b, h, i, j: score_one(cap * math.tanh(s / cap), b, h, i, j))
    assert not np.allclose(got[0], swapped[0])
