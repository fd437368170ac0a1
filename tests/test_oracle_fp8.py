"""The oracle's FP8 forward (q_descale, k_descale, v_descale, p_type, p_scale): each step as the
kernel takes it, against the same steps written out, and its refusals."""

import numpy as np
import pytest

from fagen import oracle
from fagen.element_types import FLOAT8_E4M3

B, HQ, HKV, NQ, NK, D = 2, 4, 2, 37, 53, 16


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    q, k, v = (FLOAT8_E4M3.round(rng.standard_normal((B, h, n, D)) * 3) for h, n in ((HQ, NQ), (HKV, NK), (HKV, NK)))
    descales = [rng.uniform(0.01, 2.0, (B, HKV)) for _ in range(3)]
    return q, k, v, descales


def test_descales_are_the_real_values_scaling():
    """Descales per (batch row, KV head) equal attention over the descaled tensors themselves, a
    group's query heads sharing their KV head's; one number scales the whole tensor."""
    q, k, v, (qd, kd, vd) = _inputs(1)
    got = oracle.attention(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    group = HQ // HKV
    real = (q * np.repeat(qd, group, 1)[:, :, None, None], k * kd[:, :, None, None], v * vd[:, :, None, None])
    np.testing.assert_allclose(got, oracle.attention(*real, causal=True), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(oracle.attention(q, k, v, k_descale=0.5), oracle.attention(q, k * 0.5, v), rtol=1e-12)


@pytest.mark.parametrize("p_scale", [1.0, 448.0])
def test_p_is_rounded_unnormalised_and_its_row_sum_is_not(p_scale):
    """O = round(P * p_scale) / p_scale . V * v_descale / l, l the exact row sum: written out here
    from the exact probabilities; the rounding moves O by about e4m3's relative step (2^-4) of P.V
    at most, and a larger p_scale keeps more of the small probabilities."""
    q, k, v, (qd, kd, vd) = _inputs(2)
    got, lse = oracle.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, p_type="float8_e4m3",
                                p_scale=p_scale, return_lse=True)
    exact, exact_lse = oracle.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    np.testing.assert_array_equal(lse, exact_lse)  # the LSE is the exact softmax's
    group = HQ // HKV
    s = q @ np.repeat(k, group, 1).swapaxes(-1, -2) * D ** -0.5 * np.repeat(qd * kd, group, 1)[:, :, None, None]
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (FLOAT8_E4M3.round(p * p_scale) / p_scale) @ np.repeat(v, group, 1) \
        * np.repeat(vd, group, 1)[:, :, None, None] / p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 2.0 ** -4


def test_fp8_arguments_are_refused_by_name():
    q, k, v, (qd, _, _) = _inputs(3)
    with pytest.raises(ValueError, match=r"q_descale.shape = \[3\]: must be \[\] .* or \[B, Hkv\] = \[2, 2\]"):
        oracle.attention(q, k, v, q_descale=np.ones(3))
    with pytest.raises(ValueError, match="v_descale = .*finite number > 0"):
        oracle.attention(q, k, v, v_descale=np.full((B, HKV), -1.0))
    with pytest.raises(ValueError, match=r"p_scale = 1000.0: must be a finite number in \(0, 448\]"):
        oracle.attention(q, k, v, p_type="float8_e4m3", p_scale=1000.0)
    with pytest.raises(ValueError, match="p_scale = 2.0 without p_type"):
        oracle.attention(q, k, v, p_scale=2.0)
    with pytest.raises(ValueError, match="dtype 'float7'"):
        oracle.attention(q, k, v, p_type="float7")
    # each fix the messages give is accepted
    oracle.attention(q, k, v, q_descale=np.ones((B, HKV)), v_descale=1.0, p_type="float8_e4m3", p_scale=448.0)


def test_a_paged_cache_takes_each_sequences_descales():
    """oracle.attention_paged with [B, Hkv] descales: sequence b is attention of its own keys with
    its own row of descales (the sequences run one at a time)."""
    from fagen import oracle

    rng = np.random.default_rng(2)
    b, hq, hkv, d, page = 3, 4, 2, 16, 16
    lens = [5, 0, 33]
    k_cache, v_cache = (rng.standard_normal((6, page, hkv, d)) for _ in range(2))
    table = np.array([[0, 5, 1], [2, 2, 2], [3, 4, 1]], np.int32)
    q = rng.standard_normal((b, hq, 1, d))
    kd, vd = (rng.uniform(0.5, 2.0, (b, hkv)) for _ in range(2))
    got = oracle.attention_paged(q, k_cache, v_cache, table, lens, k_descale=kd, v_descale=vd)
    for i, n in enumerate(lens):
        keys = [k_cache[table[i, j // page], j % page] for j in range(n)]
        values = [v_cache[table[i, j // page], j % page] for j in range(n)]
        if not n:
            assert np.all(got[i] == 0)
            continue
        k, v = (np.stack(x).transpose(1, 0, 2)[None] for x in (keys, values))
        want = oracle.attention(q[i:i + 1], k, v, k_descale=kd[i:i + 1], v_descale=vd[i:i + 1])
        np.testing.assert_allclose(got[i:i + 1], want, rtol=1e-12, atol=1e-12)
