"""fagen.oracle.attention against attention written out row by row with Python loops."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fagen import oracle


def reference(q, k, v, *, causal=False, scale=None):
    """O and LSE one (b, h, i) row at a time, with math.exp and math.log."""
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
                keys = [j for j in range(n_kv) if not causal or j <= i + n_kv - n_q]
                if not keys:
                    lse[b, h, i] = -math.inf  # out stays exactly 0
                    continue
                scores = [scale * sum(float(q[b, h, i, c]) * float(k[b, hk, j, c]) for c in range(d))
                          for j in keys]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for c in range(d):
                    out[b, h, i, c] = sum(w * float(v[b, hk, j, c]) for w, j in zip(weights, keys)) / total
                lse[b, h, i] = top + math.log(total)
    return out, lse


def inputs(batch, heads_q, heads_kv, n_q, n_kv, d, rng=None):
    rng = rng or np.random.default_rng()
    q = rng.standard_normal((batch, heads_q, n_q, d))
    k = rng.standard_normal((batch, heads_kv, n_kv, d))
    v = rng.standard_normal((batch, heads_kv, n_kv, d))
    return q, k, v


SIZES = [1, 5, 17]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_kv", [4, 2, 1])
@pytest.mark.parametrize("n_q", SIZES)
@pytest.mark.parametrize("n_kv", SIZES)
def test_matches_the_loop_reference(n_kv, n_q, heads_kv, causal):
    d = 8 if (n_q + n_kv) % 2 else 16
    q, k, v = inputs(2, 4, heads_kv, n_q, n_kv, d)
    out, lse = oracle.attention(q, k, v, causal=causal, return_lse=True)
    want_out, want_lse = reference(q, k, v, causal=causal)
    assert out.shape == (2, 4, n_q, d) and lse.shape == (2, 4, n_q)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_without_return_lse_returns_only_o():
    q, k, v = inputs(2, 4, 2, 5, 17, 16)
    out = oracle.attention(q, k, v)
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, reference(q, k, v)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale", [0.05, 0.7, 3.0])
def test_custom_scale(scale):
    q, k, v = inputs(2, 4, 2, 5, 17, 8)
    out, lse = oracle.attention(q, k, v, scale=scale, causal=True, return_lse=True)
    want_out, want_lse = reference(q, k, v, scale=scale, causal=True)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    # and it really is used: the default scale gives something else
    assert not np.allclose(lse, oracle.attention(q, k, v, causal=True, return_lse=True)[1])


@pytest.mark.parametrize("d", [8, 16])
def test_default_scale_is_inverse_sqrt_d(d):
    q, k, v = inputs(2, 4, 4, 5, 5, d)
    default = oracle.attention(q, k, v, return_lse=True)
    explicit = oracle.attention(q, k, v, scale=1 / math.sqrt(d), return_lse=True)
    np.testing.assert_array_equal(default[0], explicit[0])
    np.testing.assert_array_equal(default[1], explicit[1])


@pytest.mark.parametrize("n_q, n_kv", [(17, 5), (5, 1), (17, 1)])
def test_causal_rows_that_see_no_key(n_q, n_kv):
    q, k, v = inputs(2, 4, 2, n_q, n_kv, 8)
    out, lse = oracle.attention(q, k, v, causal=True, return_lse=True)
    blind = n_q - n_kv  # bottom-right alignment: row i sees keys j <= i - blind
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert (out[:, :, :blind] == 0.0).all()
    assert np.isneginf(lse[:, :, :blind]).all()
    assert np.isfinite(lse[:, :, blind:]).all()
    assert (np.abs(out[:, :, blind:]).sum(axis=-1) > 0).all()
    # the first row that sees a key sees exactly one: O is that key's V row, LSE its score
    np.testing.assert_allclose(out[:, :, blind], np.repeat(v, 2, axis=1)[:, :, 0], rtol=1e-12, atol=1e-12)
    score = np.einsum("bhd,bhd->bh", q[:, :, blind], np.repeat(k, 2, axis=1)[:, :, 0]) / math.sqrt(8)
    np.testing.assert_allclose(lse[:, :, blind], score, rtol=1e-12, atol=1e-12)


def test_causal_mask_is_bottom_right_aligned():
    assert oracle.causal_mask(3, 5).tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]
    assert oracle.causal_mask(3, 1).tolist() == [[False], [False], [True]]
    assert (oracle.causal_mask(4, 4) == np.tril(np.ones((4, 4), bool))).all()


def test_causal_square_last_row_equals_full_attention():
    q, k, v = inputs(2, 4, 1, 17, 17, 16)
    causal = oracle.attention(q, k, v, causal=True, return_lse=True)
    full = oracle.attention(q, k, v, causal=False, return_lse=True)
    np.testing.assert_allclose(causal[0][:, :, -1], full[0][:, :, -1], rtol=1e-12, atol=1e-12)
    assert not np.allclose(causal[0][:, :, 0], full[0][:, :, 0])


def test_gqa_reads_kv_head_h_over_group():
    q, k, v = inputs(2, 4, 2, 5, 17, 8)
    out = oracle.attention(q, k, v)
    for h in range(4):
        single = oracle.attention(q[:, h:h + 1], k[:, h // 2:h // 2 + 1], v[:, h // 2:h // 2 + 1])
        np.testing.assert_allclose(out[:, h:h + 1], single, rtol=1e-12, atol=1e-12)
    # not the interleaved h % Hkv mapping
    wrong = oracle.attention(q[:, 1:2], k[:, 1:2], v[:, 1:2])
    assert not np.allclose(out[:, 1:2], wrong)


def test_large_scores_do_not_overflow():
    q, k, v = inputs(2, 4, 2, 5, 17, 8)
    out, lse = oracle.attention(q * 100, k * 100, v, return_lse=True)
    want_out, want_lse = reference(q * 100, k * 100, v)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_accepts_half_precision_inputs_and_computes_in_float64():
    q, k, v = (x.astype(np.float16) for x in inputs(2, 4, 4, 5, 5, 8))
    out = oracle.attention(q, k, v)
    assert out.dtype == np.float64
    want = reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))[0]
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("heads_q, heads_kv", [(4, 3), (3, 2), (2, 4)])
def test_rejects_hq_not_a_multiple_of_hkv(heads_q, heads_kv):
    q, k, v = inputs(2, heads_q, heads_kv, 5, 5, 8)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        oracle.attention(q, k, v)


def test_rejects_mismatched_k_and_v():
    q, k, v = inputs(2, 4, 2, 5, 5, 8)
    with pytest.raises(ValueError, match="expected q"):
        oracle.attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="expected q"):
        oracle.attention(q[0], k[0], v[0])
