"""Block masks, static masks and score modifiers on the GPU, against the oracle (marked `gpu`).

Includes one test per BUG_MAYBE of seed 000's OmniAttention loop: each would fail if the
generated code had that bug.
"""

import numpy as np
import pytest

import fagen
from fagen import masks, oracle
from fagen.check import OUT_TOLERANCE, check_against_oracle, random_block_mask, random_inputs, relative_error, to_numpy
from fagen.load import SPECS

pytestmark = pytest.mark.gpu

OMNI = ["omni_shared_f16_d128", "omni_prefetch_f16_d128", "omni_prefetch_bf16_d64_sinks"]


def _spec(name):
    return fagen.load_spec(SPECS / f"{name}.yaml")


def _check(name, b, hq, hkv, nq, nk, block_mask):
    spec = _spec(name)
    extras = {"block_mask": block_mask}
    if spec.score_mod.sinks:
        extras["sinks"] = np.random.default_rng().uniform(-1, 3, hq).astype(np.float32)
    result = check_against_oracle(spec, b, hq, hkv, nq, nk, extras=extras)
    assert result.passed, result.summary()
    return result


@pytest.mark.parametrize("name", OMNI)
@pytest.mark.parametrize("q_block, kv_block", [(16, 32), (64, 64), (128, 128), (32, 128), (128, 16)])
def test_random_block_masks_every_type_and_block_size(name, q_block, kv_block):
    """Mask blocks smaller than, equal to and larger than the 64x64 tile; every type present."""
    rng = np.random.default_rng()
    b, hq, nq, nk = 2, 4, 333, 517
    bm = random_block_mask(rng, b, hq, nq, nk, q_block, kv_block)
    types = set(np.unique(bm.block_type_grid()))
    assert types == {masks.MASKED, masks.FULL, masks.CAUSAL, masks.PARTIAL}, types
    _check(name, b, hq, 2, nq, nk, bm)


@pytest.mark.parametrize("name", OMNI)
def test_fully_masked_rows_and_query_blocks(name):
    b, hq, nq, nk = 1, 2, 200, 300
    dense = np.random.default_rng().random((1, hq, nq, nk)) < 0.3
    dense[:, :, 64:128] = False  # a whole query tile with nothing to attend to
    dense[:, 0, 5] = False  # and single rows
    dense[:, 1, 150:153] = False
    bm = masks.from_dense(dense, 32, 64)
    assert bm.kv_num_blocks[0, 0, 2:4].sum() == 0
    _check(name, b, hq, hq, nq, nk, bm)


def test_broadcast_batch_and_head():
    nq = nk = 300
    bm = masks.sliding_window(nq, 50, 10, q_block=32, kv_block=32)  # [1, 1, ...]
    assert (bm.batch, bm.heads) == (1, 1)
    _check("omni_prefetch_f16_d128", 3, 4, 1, nq, nk, bm)


# ---- seed 000's four BUG_MAYBE -------------------------------------------------------------

def test_bug_maybe_partial_index_stride():
    """partial_block_mask_indices must be read with its own [b, h, q, i] strides: masks that
    differ per batch and head, with many PARTIAL blocks each pointing to a distinct pattern."""
    rng = np.random.default_rng()
    dense = rng.random((3, 5, 256, 256)) < 0.5
    bm = masks.from_dense(dense, 64, 64)
    assert (bm.block_types == masks.PARTIAL).sum() == 3 * 5 * 16 and bm.partial_masks.shape[0] == 240
    _check("omni_prefetch_f16_d128", 3, 5, 5, 256, 256, bm)


def test_bug_maybe_true_length_at_block_end():
    """A FULL last block must stop at the true Nk (not the padded block end), and rows past Nq
    must never be written: Nk = 1000 in 128-key blocks, every block FULL."""
    bm = masks.from_predicate(lambda b, h, q, k: np.ones(np.broadcast_shapes(q.shape, k.shape), bool),
                              1, 1, 999, 1000, 128, 128)
    assert (bm.block_types[..., : bm.kv_num_blocks.max()] == masks.FULL).all()
    _check("omni_shared_f16_d128", 2, 2, 2, 999, 1000, bm)


def test_bug_maybe_causal_arithmetic_inside_a_block():
    """CAUSAL blocks use absolute positions (and the diagonal offset when Nq != Nk), not
    block-local ones: non-square blocks, off-diagonal position, Nq != Nk."""
    bm = masks.causal(300, 700, q_block=32, kv_block=96)
    assert (bm.block_types == masks.CAUSAL).any() and bm.causal_offset == 400
    _check("omni_prefetch_f16_d128", 1, 3, 3, 300, 700, bm)


def test_bug_maybe_local_indices_of_partial_masks():
    """A PARTIAL pattern is indexed by (q - block's first query, k - block's first key): an
    asymmetric pattern in blocks that are not tile-sized and not at the origin."""
    qi, ki = np.arange(400)[:, None], np.arange(400)[None, :]
    dense = ((qi % 48) * 7 + (ki % 80) * 3) % 11 < 4  # differs under any shift of q or k
    bm = masks.from_dense(dense, 48, 80)
    assert (bm.block_types == masks.PARTIAL).all()
    _check("omni_shared_f16_d128", 1, 2, 2, 400, 400, bm)


# ---- document bounds, resolved once a call ----------------------------------------------------

@pytest.mark.parametrize("lengths, rows", [([100, 57, 100], 1), ([1, 300, 2, 2, 512, 7], 3), ([4096], 1)])
def test_document_bounds_are_each_positions_document(lengths, rows):
    """fagen.runtime.document_bounds: position p's [start, end) is its run of equal ids, for each
    doc_ids row (the rows here differ: each is the first's shifted by its index)."""
    import cupy

    from fagen.device import as_device_tensor
    from fagen.runtime import document_bounds

    ids = masks.documents_of_lengths(lengths, batch=1)[0]
    docs = np.stack([ids + r for r in range(rows)]).astype(np.int32)
    like = as_device_tensor(cupy.zeros((1, 1, 1, 64), cupy.float16), "q")
    got = cupy.asnumpy(document_bounds(as_device_tensor(cupy.asarray(docs), "doc_ids"), like))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    expected = np.repeat(np.stack([starts, starts + lengths], 1), lengths, axis=0)
    assert got.shape == (rows, sum(lengths), 2)
    for r in range(rows):
        np.testing.assert_array_equal(got[r], expected)


# ---- the API's keywords ----------------------------------------------------------------------

def test_attention_api_masks_and_modifiers():
    rng = np.random.default_rng()
    q, k, v, _ = random_inputs("torch", "float16", 2, 4, 2, 257, 257, 64)
    qn, kn, vn = to_numpy(q), to_numpy(k), to_numpy(v)
    sinks = rng.uniform(-1, 2, 4).astype(np.float32)
    bias = rng.standard_normal((2, 1, 257)).astype(np.float32)
    slopes = rng.uniform(0.01, 0.2, 4).astype(np.float32)
    docs = masks.documents_of_lengths([100, 57, 100], batch=2)
    cases = [
        (dict(mask={"kind": "sliding_window", "window_left": 40}), {}),
        (dict(mask={"kind": "prefix_lm", "prefix_len": 30}, softcap=20.0), {}),
        (dict(causal=True, sinks=sinks), {}),
        (dict(bias=bias, alibi_slopes=slopes), {}),
        (dict(doc_ids=docs, causal=True), {}),
        (dict(block_mask=masks.chunked(257, 64, 32, 32)), {}),
    ]
    for kwargs, _ in cases:
        out, lse = fagen.attention(q, k, v, return_lse=True, **kwargs)
        ref_kwargs = dict(kwargs)
        ref, ref_lse = oracle.attention(qn, kn, vn, return_lse=True, **ref_kwargs)
        assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"], kwargs
        assert relative_error(to_numpy(lse), ref_lse) < 1e-4, kwargs


def test_arguments_the_spec_does_not_take_are_refused():
    q, k, v, _ = random_inputs("cupy", "float16", 1, 2, 2, 64, 64, 64)
    kernel = fagen.compile(_spec("attn_f16_d64"))
    with pytest.raises(ValueError, match="does not take"):
        kernel(q, k, v, sinks=np.zeros(2, np.float32))
    kernel = fagen.compile(_spec("bias_matrix_f16_d64"))
    with pytest.raises(ValueError, match="bias is required"):
        kernel(q, k, v)
    with pytest.raises(ValueError, match=r"bias\.shape = \[1, 2, 64\]: must be \[B\|1, H\|1, Nq, Nk\]"):
        kernel(q, k, v, bias=np.zeros((1, 2, 64), np.float32))
    with pytest.raises(ValueError, match="dtype float64"):
        kernel(q, k, v, bias=np.zeros((1, 2, 64, 64)))
