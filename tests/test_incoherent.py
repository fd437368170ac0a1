"""Incoherent processing (fagen.incoherent): the rotation itself, and what it does to FP8 attention's
error where a few channels of q and k are 100 times the rest, on the oracle's model of the FP8
forward (inputs and P rounded as the kernel rounds them). The GPU's side is in
tests/test_gpu_fp8_backward.py."""

import numpy as np
import pytest

from fagen import oracle
from fagen.check import relative_error
from fagen.element_types import ELEMENT_TYPES
from fagen.incoherent import rotate, rotation

E4M3 = ELEMENT_TYPES["float8_e4m3"]
P_SCALE = 256.0  # the FP8 forward's P scale (2^8): P rounded in [0, 256]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_rotation_is_orthogonal_and_leaves_the_scores(d):
    m = rotation(d)
    assert np.allclose(m @ m.T, np.eye(d), atol=1e-12)
    rng = np.random.default_rng(d)
    q, k = rng.standard_normal((2, 5, d))
    assert np.allclose(rotate(q) @ rotate(k).T, q @ k.T, atol=1e-10)
    assert np.array_equal(rotation(d), m)  # one fixed rotation: a call's backward undoes the same M
    # one large channel becomes every channel at 1 / sqrt(d) of it
    spike = np.zeros(d)
    spike[3] = 100.0
    assert np.allclose(np.abs(rotate(spike)), 100.0 / np.sqrt(d))


@pytest.mark.parametrize("d", [0, 96, 192])
def test_a_head_dim_that_is_no_power_of_two_is_refused_by_name(d):
    with pytest.raises(ValueError, match=rf"head_dim = {d}: a Hadamard rotation needs a power of two"):
        rotation(d)


def _fp8_error(q, k, v, exact) -> float:
    """The oracle's FP8 forward (q, k, v rounded to e4m3 at amax / 448 each, P at 2^8) against `exact`."""
    rounded, descales = [], []
    for x in (q, k, v):
        descale = np.abs(x).max() / E4M3.max_finite
        rounded.append(E4M3.round(x / descale))
        descales.append(descale)
    got = oracle.attention(*rounded, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                           p_type="float8_e4m3", p_scale=P_SCALE)
    return relative_error(got, exact)


@pytest.mark.parametrize("outliers", [True, False], ids=["outliers", "gaussian"])
def test_rotating_q_and_k_lowers_fp8_error_where_channels_are_outliers(outliers):
    """Four channels of q and k at 100x (the FP8 bench's "outliers"): the scale spends e4m3's range
    on them and the rest round to a few values; rotated, the error against exact attention falls to
    about half (7.7e-2 -> 3.9e-2 here, three seeds 0.50-0.58x). On Gaussian inputs the rotation
    changes little either way (5.2e-2 both)."""
    rng = np.random.default_rng(55)
    d, n = 128, 256
    q, k, v = rng.standard_normal((3, 1, 1, n, d))
    if outliers:
        for x in (q, k):
            x[..., :4] *= 100.0
        spread = ((d - 4 + 4 * 100.0 ** 4) / d) ** 0.25  # scores of unit variance, as the bench's
        q, k = q / spread, k / spread
    exact = oracle.attention(q, k, v)
    plain = _fp8_error(q, k, v, exact)
    rotated = _fp8_error(rotate(q), rotate(k), v, exact)
    if outliers:
        assert rotated < 0.65 * plain, (plain, rotated)
    else:
        assert 0.7 * plain < rotated < 1.3 * plain, (plain, rotated)
