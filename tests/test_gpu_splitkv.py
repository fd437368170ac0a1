"""Split-KV partials and their merge on the GPU, against the oracle (marked `gpu`)."""

import numpy as np
import pytest

import fagen
from fagen import oracle, splitkv, variants
from fagen.check import OUT_TOLERANCE, random_inputs, relative_error, to_numpy
from fagen.load import SPECS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk, splits", [(1, 5000, None), (7, 3333, 5), (16, 2049, 16), (300, 700, 1), (129, 1000, 3)])
def test_split_kv_matches_the_oracle(dtype, causal, nq, nk, splits):
    q, k, v, _ = random_inputs("torch", dtype, 2, 8, 2, nq, nk, 128)
    out, lse = splitkv.attention(q, k, v, causal=causal, splits=splits, return_lse=True)
    ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, return_lse=True)
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE[dtype]
    assert relative_error(to_numpy(lse), ref_lse) < 1e-4


def test_partials_cover_disjoint_key_ranges():
    """Each split's LSE is the log-sum over its own keys only: merging them is exact."""
    q, k, v, _ = random_inputs("torch", "float16", 1, 2, 2, 33, 1000, 64)
    kernel = fagen.compile(variants.partial_variant(fagen.load_spec(SPECS / "attn_f16_d64.yaml")))
    o_parts, lse_parts = kernel(q, k, v, splits=4)
    qn, kn, vn = to_numpy(q), to_numpy(k), to_numpy(v)
    per_split = -(-16 // 4) * 64  # 16 tiles of 64 keys, 4 a split
    for s in range(o_parts.shape[0]):
        keys = slice(s * per_split, min(1000, (s + 1) * per_split))
        ref, ref_lse = oracle.attention(qn, kn[:, :, keys], vn[:, :, keys], scale=1 / 8, return_lse=True)
        assert relative_error(to_numpy(o_parts[s]), ref) < 2e-3
        assert relative_error(to_numpy(lse_parts[s]), ref_lse) < 1e-4


def test_merge_folds_sinks_in():
    rng = np.random.default_rng()
    q, k, v, _ = random_inputs("torch", "float16", 2, 4, 4, 5, 4000, 128)
    sinks = rng.uniform(-1, 4, 4).astype(np.float32)
    out, lse = splitkv.attention(q, k, v, causal=True, sinks=sinks, splits=7, return_lse=True)
    ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, sinks=sinks, return_lse=True)
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"]
    assert relative_error(to_numpy(lse), ref_lse) < 1e-4


def test_rows_no_split_saw_give_zero_and_minus_inf():
    q, k, v, _ = random_inputs("cupy", "float16", 1, 2, 2, 300, 100, 64)  # causal, Nq > Nk
    out, lse = splitkv.attention(q, k, v, causal=True, splits=2, return_lse=True)
    out, lse = to_numpy(out), to_numpy(lse)
    assert (out[:, :, :200] == 0).all() and np.isneginf(lse[:, :, :200]).all() and not np.isnan(out).any()


def test_splits_are_refused_on_a_plain_kernel():
    q, k, v, _ = random_inputs("cupy", "float16", 1, 2, 2, 64, 64, 64)
    with pytest.raises(ValueError, match="not a split-KV kernel"):
        fagen.compile(fagen.load_spec(SPECS / "attn_f16_d64.yaml"))(q, k, v, splits=2)
