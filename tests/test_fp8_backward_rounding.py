"""The FP8 backward's rounding model (fagen.fp8_backward_rounding) and the oracle's fp8_type, on
the CPU: the scales are the ones a kernel can take back out of its sums, and the oracle applies
each rounding to the operand that the kernel rounds."""

import numpy as np
import pytest

from fagen import fp8_backward_rounding as rounding
from fagen import oracle
from fagen.element_types import ELEMENT_TYPES

E4M3 = ELEMENT_TYPES["float8_e4m3"]


def _inputs(seed, b=1, hq=2, hkv=2, n=200, d=64):
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((b, hq, n, d)) for _ in range(2))
    k, v = (E4M3.round(rng.standard_normal((b, hkv, n, d))) for _ in range(2))
    return E4M3.round(q), k, v, dout


def test_dk_s_scale_is_a_power_of_two_a_key_and_step_that_uses_e4m3_s_top_binade():
    rng = np.random.default_rng(0)
    ds = rng.standard_normal((1, 1, 130, 40)) * np.exp(rng.uniform(-8, 2, (1, 1, 130, 40)))
    got = rounding.per_key_step(ds, E4M3)
    for step in range(0, 130, rounding.STEP_QUERIES):
        tile, out = ds[0, 0, step:step + 64], got[0, 0, step:step + 64]
        amax = np.abs(tile).max(axis=0)
        scale = 2.0 ** np.ceil(np.log2(amax / E4M3.max_finite))
        assert np.allclose(out, E4M3.round(tile / scale) * scale, rtol=0, atol=0)
        assert np.all((amax / scale <= E4M3.max_finite) & (amax / scale > E4M3.max_finite / 2))


def test_dq_s_scale_puts_each_tile_s_amax_on_e4m3_s_largest():
    rng = np.random.default_rng(1)
    ds = rng.standard_normal((1, 1, 100, 300)) * 1e-5
    got = rounding.round_ds_for_dq(ds, E4M3)
    for i in range(0, 100, 64):
        for j in range(0, 300, 128):
            tile, out = ds[0, 0, i:i + 64, j:j + 128], got[0, 0, i:i + 64, j:j + 128]
            assert np.isclose(np.abs(out).max(), np.abs(tile).max(), rtol=1e-12)


def test_the_oracle_rounds_each_operand_where_the_kernel_does():
    """fp8_type None is the plain backward; "float8_e4m3" is the computation with dO a head, P
    x 256, dS a key and step for dK and a tile for dQ, and D from the unrounded dO."""
    q, k, v, dout = _inputs(2)
    plain = oracle.attention_backward(q, k, v, dout, causal=True)
    assert all(np.array_equal(plain[n], oracle.attention_backward(q, k, v, dout, causal=True, fp8_type=None)[n])
               for n in ("dq", "dk", "dv"))
    got = oracle.attention_backward(q, k, v, dout, causal=True, fp8_type="float8_e4m3")
    scale = 1 / np.sqrt(q.shape[-1])
    out, lse = oracle.attention(q, k, v, causal=True, return_lse=True)
    s = np.where(oracle.causal_mask(200, 200), q @ k.swapaxes(-1, -2) * scale, -np.inf)
    p = np.exp(s - lse[..., None])
    do8 = rounding.per_head(dout, E4M3)
    ds = p * (do8 @ v.swapaxes(-1, -2) - (dout * out).sum(-1, keepdims=True))
    want = {"dq": scale * rounding.per_tile(ds, E4M3, 64, 128) @ k,
            "dk": scale * rounding.per_key_step(ds, E4M3).swapaxes(-1, -2) @ q,
            "dv": (E4M3.round(p * 256) / 256).swapaxes(-1, -2) @ do8}
    for name in ("dq", "dk", "dv"):
        assert np.allclose(got[name], want[name], rtol=1e-10, atol=1e-12), name
        error = np.linalg.norm(got[name] - plain[name]) / np.linalg.norm(plain[name])
        assert 5e-3 < error < 8e-2, (name, error)  # FP8's ~3 bits: a few percent, not bf16's 0.3%


def test_the_oracle_s_fp8_backward_sums_a_group_s_heads_and_refuses_a_half_type():
    q, k, v, dout = _inputs(3, hq=4, hkv=2, n=70)
    got = oracle.attention_backward(q, k, v, dout, fp8_type="float8_e4m3")
    assert got["dq"].shape == q.shape and got["dk"].shape == got["dv"].shape == k.shape
    with pytest.raises(ValueError, match="fp8_type = 'bfloat16': must be an FP8 element type"):
        oracle.attention_backward(q, k, v, dout, fp8_type="bfloat16")


def test_do_s_scale_is_one_a_kv_head_over_its_group_s_query_heads():
    """A GQA group's query heads add into one dV: one dO scale for all of them, set by the
    group's largest |dO| (head 1's small values round on head 0's coarse grid)."""
    rng = np.random.default_rng(3)
    dout = rng.standard_normal((2, 4, 30, 16)) * np.array([100.0, 1.0, 5.0, 0.5])[None, :, None, None]
    got = rounding.round_dout(dout, E4M3, heads_kv=2)
    for b in range(2):
        for g in range(2):
            group = dout[b, 2 * g:2 * g + 2]
            scale = np.abs(group).max() / E4M3.max_finite
            assert np.array_equal(got[b, 2 * g:2 * g + 2], E4M3.round(group / scale) * scale)
    assert np.array_equal(rounding.round_dout(dout, E4M3), rounding.per_head(dout, E4M3))  # MHA: a head each


def test_the_oracle_reads_d_and_p_from_a_forward_s_out_and_lse_where_given():
    """out moves D = rowsum(dO * O) only (dV does not read it); lse rescales each row's P by
    exp(lse_own - lse); the oracle's own out and lse give its own gradients back exactly."""
    q, k, v, dout = _inputs(4)
    own_out, own_lse = oracle.attention(q, k, v, causal=True, return_lse=True)
    base = oracle.attention_backward(q, k, v, dout, causal=True)
    same = oracle.attention_backward(q, k, v, dout, causal=True, out=own_out, lse=own_lse)
    for name in ("dq", "dk", "dv"):
        assert np.allclose(same[name], base[name], rtol=1e-12, atol=1e-12)
    moved = oracle.attention_backward(q, k, v, dout, causal=True, out=own_out * 1.01)
    assert np.array_equal(moved["dv"], base["dv"]) and not np.allclose(moved["dq"], base["dq"])
    shifted = oracle.attention_backward(q, k, v, dout, causal=True, lse=own_lse - np.log(2.0))
    assert np.allclose(shifted["dv"], 2 * base["dv"], rtol=1e-12, atol=1e-12)  # P twice over: dV = P^T dO
    with pytest.raises(ValueError, match=r"lse.shape = \(1, 2, 7\)"):
        oracle.attention_backward(q, k, v, dout, lse=own_lse[..., :7])
