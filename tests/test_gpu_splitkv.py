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


# ---- accumulating partials (a ring step's kernel) --------------------------------------------

def _accumulating_cases():
    """(partial spec, accumulating spec) of the shipped defaults: mma.sync, and the H200's
    warp-specialised wgmma kernels (both schedulers)."""
    cases = []
    for gpu in (None, "h200"):
        for dtype in ("float16", "bfloat16"):
            for d in (64, 128):
                base = variants.shipped_spec(dtype, d, False, gpu=gpu)
                cases.append(pytest.param(variants.partial_variant(variants.shipped_spec(dtype, d, True, gpu=gpu)),
                                          variants.accumulate_variant(base), id=f"{gpu or 'any'}-{dtype}-d{d}"))
    return cases


@pytest.mark.parametrize("first, fold", _accumulating_cases())
def test_accumulating_kernel_folds_key_blocks_into_the_running_output(first, fold):
    """Causal attention of 600 queries over 1500 keys as ring steps compute it: the diagonal
    block's partial written by a causal launch into NaN-poisoned running O and LSE, then the
    other blocks folded in place, the last one in two row slices (as a ring step folds the
    second query chunk alone)."""
    import torch

    if first.wgmma and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("a wgmma kernel needs sm_90a")
    dtype, d, nq, nk = first.dtype, first.head_dim, 600, 1500
    q, k, v, _ = random_inputs("torch", dtype, 2, 4, 2, nq, nk, d)
    o = torch.full((2, 4, nq, d), float("nan"), device="cuda")
    l = torch.full((2, 4, nq), float("nan"), device="cuda")
    s, e = 900, 1500
    fagen.compile(first)(q, k[:, :, s:e], v[:, :, s:e], out=o[None], lse=l[None], mask_offset=(nk - nq) - s)
    got = fagen.compile(fold)(q, k[:, :, :500], v[:, :, :500], out=o, lse=l)
    assert got[0] is o and got[1] is l
    for rows in (slice(0, 300), slice(300, nq)):
        fagen.compile(fold)(q[:, :, rows], k[:, :, 500:900], v[:, :, 500:900], out=o[:, :, rows], lse=l[:, :, rows])
    ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, return_lse=True)
    assert relative_error(to_numpy(o), ref) < OUT_TOLERANCE[dtype]
    assert relative_error(to_numpy(l), ref_lse) < 1e-4


def test_accumulating_kernel_keeps_rows_that_see_nothing_and_passes_nan_on():
    """A fold whose keys a row cannot see (no key, or -inf everywhere) leaves the row as it was;
    a NaN in the new block reaches O and LSE."""
    import torch

    fold = fagen.compile(variants.accumulate_variant(fagen.load_spec(SPECS / "attn_f16_d64_causal.yaml")))
    q, k, v, _ = random_inputs("torch", "float16", 1, 2, 2, 64, 64, 64)
    o = torch.randn(1, 2, 64, 64, device="cuda")
    l = torch.randn(1, 2, 64, device="cuda")
    o[:, :, :10], l[:, :, :10] = 0, float("-inf")  # rows nothing reached yet
    before_o, before_l = o.clone(), l.clone()
    fold(q, k, v, out=o, lse=l, mask_offset=-100)  # the diagonal 100 keys before the first: no row sees a key
    assert torch.equal(o, before_o) and torch.equal(l, before_l)
    k[0, 1, 3, 0] = float("nan")
    fold(q, k, v, out=o, lse=l, mask_offset=0)
    assert o[0, 1, 3:].isnan().all() and l[0, 1, 3:].isnan().all()  # every row that sees key 3
    assert not o[0, 0].isnan().any() and not o[0, 1, :3].isnan().any()


def test_accumulating_kernel_refuses_what_it_cannot_fold_into():
    import torch

    fold = fagen.compile(variants.accumulate_variant(fagen.load_spec(SPECS / "attn_f16_d64.yaml")))
    q, k, v, _ = random_inputs("torch", "float16", 1, 2, 2, 64, 64, 64)
    o, l = torch.zeros(1, 2, 64, 64, device="cuda"), torch.zeros(1, 2, 64, device="cuda")
    with pytest.raises(ValueError, match="pass the running"):
        fold(q, k, v)
    with pytest.raises(ValueError, match="splits=2"):
        fold(q, k, v, out=o, lse=l, splits=2)
    with pytest.raises(ValueError, match="float32"):
        fold(q, k, v, out=o.half(), lse=l)
    with pytest.raises(ValueError, match="heads must lie evenly"):
        fold(q, k, v, out=o, lse=torch.zeros(2, 1, 64, device="cuda").transpose(0, 1))
    wide = torch.zeros(1, 2, 64, 66, device="cuda")  # rows 66 floats apart: off 16 bytes
    with pytest.raises(ValueError, match="multiples of 4 elements / 16 bytes"):
        fold(q, k, v, out=wide[..., :64], lse=l)
    with pytest.raises(ValueError, match="multiples of 4 elements / 16 bytes"):
        fold(q, k, v, out=torch.zeros(1 + 2 * 64 * 64, device="cuda")[1:].view(1, 2, 64, 64), lse=l)
