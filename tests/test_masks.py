"""fagen.masks on the CPU: block-mask builders against a dense evaluation of their predicate,
block-type classification, bit packing, re-blocking to kernel tiles, the ready-made builders
against their formulas, and the static-mask tile schedule against the dense mask."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fagen import mask_kinds, masks
from fagen.mask_kinds import KINDS, predicate
from fagen.spec import Mask

TYPES = {masks.MASKED, masks.FULL, masks.CAUSAL, masks.PARTIAL}


def dense_of(fn, b, h, nq, nk):
    """fn evaluated at every (b, h, q, k), written out here (not through fagen.masks)."""
    bi, hi = np.arange(b)[:, None, None, None], np.arange(h)[None, :, None, None]
    qi, ki = np.arange(nq)[None, None, :, None], np.arange(nk)[None, None, None, :]
    return np.broadcast_to(fn(bi, hi, qi, ki), (b, h, nq, nk)).astype(bool)


def random_typed_dense(rng, b, h, nq, nk, q_block, kv_block, causal_offset=0):
    """A dense mask whose blocks are at random MASKED, FULL, CAUSAL or random (PARTIAL)."""
    qi, ki = np.arange(nq)[:, None], np.arange(nk)[None, :]
    choice = rng.integers(0, 4, (b, h, -(-nq // q_block), -(-nk // kv_block)))
    sel = np.repeat(np.repeat(choice, q_block, 2), kv_block, 3)[:, :, :nq, :nk]
    noise = rng.random((b, h, nq, nk)) < 0.5
    return ((sel == 1) | ((sel == 2) & (ki <= qi + causal_offset)) | ((sel == 3) & noise))


def check_structure(bm: masks.BlockMask, dense: np.ndarray) -> set[int]:
    """Every block of `bm` has the type its pattern in `dense` calls for; returns the types seen."""
    b, h, nq, nk = dense.shape
    qb, kb = bm.q_block, bm.kv_block
    n_qb, n_kb = -(-nq // qb), -(-nk // kb)
    assert bm.kv_num_blocks.shape == (b, h, n_qb)
    assert bm.partial_masks.dtype == np.uint32
    assert bm.partial_masks.shape[1:] == (qb, -(-kb // 32))
    grid = bm.block_type_grid()
    seen = set()
    for bi, hi, r in itertools.product(range(b), range(h), range(n_qb)):
        expected_listed = []
        for c in range(n_kb):
            block = dense[bi, hi, r * qb:(r + 1) * qb, c * kb:(c + 1) * kb]
            qpos = r * qb + np.arange(block.shape[0])[:, None]
            kpos = c * kb + np.arange(block.shape[1])[None, :]
            if not block.any():
                want = masks.MASKED
            elif block.all():
                want = masks.FULL
            elif np.array_equal(block, kpos <= qpos + bm.causal_offset):
                want = masks.CAUSAL
            else:
                want = masks.PARTIAL
            assert grid[bi, hi, r, c] == want, (bi, hi, r, c)
            seen.add(want)
            if want != masks.MASKED:
                expected_listed.append(c)
        n = bm.kv_num_blocks[bi, hi, r]
        listed = list(bm.kv_indices[bi, hi, r, :n])
        assert n == len(expected_listed)  # exactly the non-masked blocks ...
        assert sorted(listed) == expected_listed  # ... each once, never a MASKED one
        for i in range(n):
            t, p = bm.block_types[bi, hi, r, i], bm.partial_index[bi, hi, r, i]
            assert t in (masks.FULL, masks.CAUSAL, masks.PARTIAL)
            if t == masks.PARTIAL:
                c = listed[i]
                assert 0 <= p < bm.partial_masks.shape[0]
                block = dense[bi, hi, r * qb:(r + 1) * qb, c * kb:(c + 1) * kb]
                pattern = masks.unpack_bits(bm.partial_masks[p], kb)
                assert pattern.shape == (qb, kb)
                np.testing.assert_array_equal(pattern[: block.shape[0], : block.shape[1]], block)
                assert not pattern[block.shape[0]:].any() and not pattern[:, block.shape[1]:].any()
            else:
                assert p == -1
    return seen


# ---- builders against a dense evaluation of their predicate ---------------------------------

def _random_predicates(rng):
    a, c, m = (int(x) for x in rng.integers(1, 13, 3))
    m += 1
    t = int(rng.integers(1, m))
    left, right = (int(x) for x in rng.integers(0, 40, 2))
    mb, mh = int(rng.integers(2, 6)), int(rng.integers(2, 6))
    return {
        "modular": lambda b, h, q, k: (q * a + k * c) % m < t,
        "band": lambda b, h, q, k: (k >= q - left) & (k <= q + right),
        "per_batch_head": lambda b, h, q, k: ((q * a + k * c + b * mb + h * mh) % m) < t,
        "head_window": lambda b, h, q, k: np.abs(q - k) <= 3 + 9 * h + 5 * b,
        "keys_only": lambda b, h, q, k: (k % m) < t,  # broadcasts over q
        "none": lambda b, h, q, k: np.zeros(np.broadcast_shapes(np.shape(q), np.shape(k)), bool),
    }


@pytest.mark.parametrize("q_block, kv_block", [(16, 16), (16, 32), (32, 16), (64, 32), (16, 64), (64, 64)])
@pytest.mark.parametrize("b, h", [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_from_predicate_equals_dense_predicate(q_block, kv_block, b, h):
    rng = np.random.default_rng()
    nq, nk = 77, 130
    for name, fn in _random_predicates(rng).items():
        bm = masks.from_predicate(fn, b, h, nq, nk, q_block, kv_block)
        dense = dense_of(fn, b, h, nq, nk)
        got = bm.to_dense()
        assert got.shape == (b, h, nq, nk), name
        np.testing.assert_array_equal(got, dense, err_msg=name)
        assert (bm.batch, bm.heads, bm.q_block, bm.kv_block) == (b, h, q_block, kv_block)
        check_structure(bm, dense)


def test_from_predicate_matches_dense_from_predicate():
    fn = lambda b, h, q, k: ((q * 3 + k * 5 + b + 2 * h) % 7) < 3  # noqa: E731
    np.testing.assert_array_equal(masks.dense_from_predicate(fn, 2, 3, 41, 59), dense_of(fn, 2, 3, 41, 59))
    np.testing.assert_array_equal(masks.from_predicate(fn, 2, 3, 41, 59, 16, 32).to_dense(),
                                  masks.dense_from_predicate(fn, 2, 3, 41, 59))


def test_a_block_mask_is_found_by_its_serial_while_it_lives():
    """torch.compile's constant functions take numbers: a mask passes as its serial, its own."""
    import copy
    import dataclasses
    import gc
    import pickle

    fn = lambda b, h, q, k: q >= k  # noqa: E731
    first, second = masks.from_predicate(fn, 1, 1, 40, 40, 16, 16), masks.from_predicate(fn, 1, 1, 40, 40, 16, 16)
    copies = [dataclasses.replace(first), copy.copy(first), copy.deepcopy(first), pickle.loads(pickle.dumps(first))]
    assert len({first.serial, second.serial, *(c.serial for c in copies)}) == 2 + len(copies)
    assert all(masks.live_block_mask(m.serial) is m for m in (first, second, *copies))
    assert all(np.array_equal(c.to_dense(), first.to_dense()) for c in copies)
    gone = second.serial
    del second
    gc.collect()
    with pytest.raises(KeyError):
        masks.live_block_mask(gone)


@pytest.mark.parametrize("q_block, kv_block", [(16, 16), (32, 64), (64, 16), (128, 128), (48, 80)])
def test_from_dense_round_trip(q_block, kv_block):
    rng = np.random.default_rng()
    for nq, nk in [(77, 130), (64, 64), (1, 33), (130, 5)]:
        for density in (0.0, 0.3, 0.97, 1.0):
            m = rng.random((2, 3, nq, nk)) < density
            bm = masks.from_dense(m, q_block, kv_block)
            np.testing.assert_array_equal(bm.to_dense(), m)
            check_structure(bm, m)


def test_from_dense_accepts_two_dims_and_refuses_three():
    m = np.random.default_rng().random((20, 30)) < 0.5
    np.testing.assert_array_equal(masks.from_dense(m, 16, 16).to_dense(), m[None, None])
    with pytest.raises(ValueError, match="shape"):
        masks.from_dense(m[None], 16, 16)


# ---- block types ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal_offset", [0, 5, -3, 12])
def test_block_types_in_one_crafted_mask(causal_offset):
    rng = np.random.default_rng()
    n, blk = 64, 16
    qi, ki = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    dense = np.zeros((n, n), bool)
    diag = ki <= qi + causal_offset

    def block(r, c):
        return (slice(r * blk, (r + 1) * blk), slice(c * blk, (c + 1) * blk))

    dense[block(1, 1)] = diag[block(1, 1)]  # CAUSAL
    dense[block(2, 0)] = True  # FULL
    dense[block(0, 3)] = False  # MASKED (and the rest of row 0 too)
    noise = rng.random((blk, blk)) < 0.5
    noise[0, 0], noise[0, 1] = True, False  # neither empty, full nor the diagonal
    dense[block(3, 2)] = noise  # PARTIAL
    dense[block(3, 3)] = ~diag[block(3, 3)] | (ki[block(3, 3)] % 2 == 0)  # PARTIAL

    bm = masks.from_dense(dense, blk, blk, causal_offset=causal_offset)
    grid = bm.block_type_grid()[0, 0]
    assert grid[1, 1] == masks.CAUSAL
    assert grid[2, 0] == masks.FULL
    assert grid[0, 3] == masks.MASKED and (grid[0] == masks.MASKED).all()
    assert grid[3, 2] == masks.PARTIAL and grid[3, 3] == masks.PARTIAL
    assert bm.kv_num_blocks[0, 0, 0] == 0
    assert set(np.unique(grid)) == TYPES
    assert check_structure(bm, dense[None, None]) == TYPES
    np.testing.assert_array_equal(bm.to_dense()[0, 0], dense)
    assert bm.causal_offset == causal_offset


@pytest.mark.parametrize("q_block, kv_block", [(16, 32), (32, 16), (64, 64), (48, 80)])
def test_random_masks_classify_every_block(q_block, kv_block):
    rng = np.random.default_rng()
    nq, nk = 150, 263
    offset = nk - nq
    dense = random_typed_dense(rng, 2, 3, nq, nk, q_block, kv_block, offset)
    bm = masks.from_dense(dense, q_block, kv_block, causal_offset=offset)
    seen = check_structure(bm, dense)
    assert {masks.MASKED, masks.FULL, masks.PARTIAL} <= seen
    np.testing.assert_array_equal(bm.to_dense(), dense)


def test_causal_blocks_with_truncated_edges():
    """The last query and key blocks are short: a diagonal there is still CAUSAL."""
    nq, nk = 40, 40
    bm = masks.causal(nq, nk, q_block=32, kv_block=32)
    grid = bm.block_type_grid()[0, 0]
    assert grid.tolist() == [[masks.CAUSAL, masks.MASKED], [masks.FULL, masks.CAUSAL]]
    np.testing.assert_array_equal(bm.to_dense()[0, 0], np.tril(np.ones((nq, nk), bool)))


# ---- bit packing ---------------------------------------------------------------------------

@pytest.mark.parametrize("kv_block", [48, 16, 32, 80, 96, 128])
def test_pack_unpack_round_trip(kv_block):
    rng = np.random.default_rng()
    for width in {kv_block, max(1, kv_block - 17)}:
        block = rng.random((24, width)) < 0.5
        words = masks.pack_bits(block, kv_block)
        assert words.dtype == np.uint32 and words.shape == (24, -(-kv_block // 32))
        back = masks.unpack_bits(words, kv_block)
        assert back.shape == (24, kv_block)
        np.testing.assert_array_equal(back[:, :width], block)
        assert not back[:, width:].any()


def test_pack_bits_layout():
    kv_block = 48
    block = np.zeros((2, kv_block), bool)
    block[0, [0, 5, 31]] = True
    block[1, [32, 47]] = True
    words = masks.pack_bits(block, kv_block)
    assert words.tolist() == [[1 | (1 << 5) | (1 << 31), 0], [0, 1 | (1 << 15)]]


@pytest.mark.parametrize("q_block, kv_block", [(128, 128), (64, 176), (128, 80), (192, 128), (16, 48)])
@pytest.mark.parametrize("transposed", [False, True])
def test_thread_words_hold_each_threads_columns(q_block, kv_block, transposed):
    """The kernels' element test: thread t of a quad finds column 8n + 2t + e of its row in bit
    p % 32 of word p // 32, p = 2n + e (the MMA accumulator's columns of that thread)."""
    rng = np.random.default_rng()
    dense = rng.random((3, q_block, kv_block)) < 0.5
    patterns = np.stack([masks.pack_bits(block, kv_block) for block in dense])
    words = masks.thread_words(patterns, kv_block, transposed)
    expected = dense.swapaxes(1, 2) if transposed else dense
    rows, cols = expected.shape[1:]
    assert words.shape == (3, rows, 4, -(-cols // 128)) and words.dtype == np.uint32
    for col in range(cols):
        thread, pair = col % 8 // 2, col // 8 * 2 + col % 2
        got = (words[:, :, thread, pair // 32] >> np.uint32(pair % 32)) & 1
        np.testing.assert_array_equal(got.astype(bool), expected[:, :, col], err_msg=f"column {col}")
    assert not any((words[..., w] >> np.uint32(j)).any() & 1 for w in range(words.shape[-1]) for j in range(32)
                   if 32 * w + j >= -(-cols // 8) * 2)  # bits past the last column stay clear


# ---- re-blocking to tiles ------------------------------------------------------------------

@pytest.mark.parametrize("mask_blocks, tile", [
    ((32, 32), (64, 64)), ((64, 64), (64, 64)), ((128, 128), (64, 32)), ((16, 128), (64, 64)),
    ((128, 16), (64, 64)), ((48, 80), (64, 64)), ((64, 64), (128, 128)),
])
def test_for_tiles_keeps_the_pattern(mask_blocks, tile):
    rng = np.random.default_rng()
    nq, nk = 201, 333
    offset = int(rng.integers(-20, 60))
    dense = random_typed_dense(rng, 2, 1, nq, nk, *mask_blocks, causal_offset=offset)
    bm = masks.from_dense(dense, *mask_blocks, causal_offset=offset)
    tiled = bm.for_tiles(*tile)
    assert (tiled.q_block, tiled.kv_block) == tile
    assert tiled.causal_offset == offset
    assert (tiled.n_q, tiled.n_kv, tiled.batch, tiled.heads) == (nq, nk, 2, 1)
    np.testing.assert_array_equal(tiled.to_dense(), bm.to_dense())
    np.testing.assert_array_equal(tiled.to_dense(), dense)
    check_structure(tiled, dense)
    assert bm.for_tiles(*tile) is tiled  # cached


@pytest.mark.parametrize("heads, group", [(4, 2), (1, 4), (4, 1), (4, 4)])
def test_key_major_lists_every_step_that_sees_a_kv_block(heads, group):
    """The dK/dV kernel's lists: per (batch, KV head, KV block), exactly the (query head of the
    group, query block) pairs with a kept pair, in order, with the query-major list's type and
    pattern index; a head-broadcast mask lists every head of the group."""
    rng = np.random.default_rng()
    nq, nk, qb, kb = 203, 300, 32, 64
    bm = masks.from_dense(random_typed_dense(rng, 2, heads, nq, nk, qb, kb, causal_offset=nk - nq), qb, kb,
                          causal_offset=nk - nq)
    lists, grid = bm.key_major(group), bm.block_type_grid()
    kv_heads = 1 if heads == 1 else heads // group
    assert lists.num.shape == (2, kv_heads, bm.n_kv_blocks)
    for b, hk, kv_block in itertools.product(range(2), range(kv_heads), range(bm.n_kv_blocks)):
        n = lists.num[b, hk, kv_block]
        steps = [divmod(int(e), bm.n_q_blocks) for e in lists.entries[b, hk, kv_block, :n]]
        heads_of = [0 if heads == 1 else hk * group + j for j, _ in steps]
        expected = [(j, q_block) for j in range(group) for q_block in range(bm.n_q_blocks)
                    if grid[b, 0 if heads == 1 else hk * group + j, q_block, kv_block] != masks.MASKED]
        assert steps == expected
        for i, ((_, q_block), h) in enumerate(zip(steps, heads_of)):
            listed = list(bm.kv_indices[b, h, q_block, :bm.kv_num_blocks[b, h, q_block]]).index(kv_block)
            assert lists.types[b, hk, kv_block, i] == bm.block_types[b, h, q_block, listed]
            assert lists.partial_index[b, hk, kv_block, i] == bm.partial_index[b, h, q_block, listed]
    assert bm.key_major(group) is lists  # cached


def test_key_major_refuses_heads_that_do_not_split_into_groups():
    bm = masks.from_dense(np.ones((1, 3, 10, 10), bool), 16, 16)
    with pytest.raises(ValueError, match="3 heads, not a multiple of the group of 2"):
        bm.key_major(2)


def test_for_tiles_of_causal_keeps_causal_blocks():
    bm = masks.causal(300, 500, q_block=32, kv_block=32)
    tiled = bm.for_tiles(64, 64)
    assert tiled.causal_offset == 200
    assert masks.CAUSAL in set(np.unique(tiled.block_type_grid()))
    np.testing.assert_array_equal(tiled.to_dense(), bm.to_dense())


# ---- ready-made builders -------------------------------------------------------------------

def _grid(nq, nk):
    return np.arange(nq)[:, None], np.arange(nk)[None, :]


@pytest.mark.parametrize("nq, nk", [(100, 100), (77, 130), (130, 77), (1, 64), (64, 1)])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_causal_builder(nq, nk, align):
    q, k = _grid(nq, nk)
    want = k <= q + (nk - nq if align == "bottom_right" else 0)
    bm = masks.causal(nq, nk, q_block=32, kv_block=16, align=align)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], want)
    assert bm.causal_offset == (nk - nq if align == "bottom_right" else 0)
    check_structure(bm, want[None, None])


def test_causal_builder_square_default():
    q, k = _grid(90, 90)
    np.testing.assert_array_equal(masks.causal(90, q_block=32, kv_block=32).to_dense()[0, 0], k <= q)


@pytest.mark.parametrize("left, right", [(0, 0), (10, 0), (7, 3), (0, 12), (200, 200)])
def test_sliding_window_builder(left, right):
    n = 130
    q, k = _grid(n, n)
    bm = masks.sliding_window(n, left, right, q_block=16, kv_block=32)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], (k >= q - left) & (k <= q + right))


@pytest.mark.parametrize("causal", [True, False])
def test_document_builder(causal):
    rng = np.random.default_rng()
    n = 97
    docs = np.stack([np.sort(rng.integers(0, 6, n)) for _ in range(3)]).astype(np.int32)
    bm = masks.document(docs, causal=causal, q_block=16, kv_block=32)
    assert (bm.batch, bm.heads) == (3, 1)
    got = bm.to_dense()
    q, k = _grid(n, n)
    for b in range(3):
        want = docs[b][:, None] == docs[b][None, :]
        if causal:
            want &= k <= q
        np.testing.assert_array_equal(got[b, 0], want)


def test_document_builder_one_dimensional_ids():
    docs = masks.documents_of_lengths([5, 20, 1, 14])[0]
    got = masks.document(docs, causal=False, q_block=16, kv_block=16).to_dense()
    np.testing.assert_array_equal(got[0, 0], docs[:, None] == docs[None, :])


@pytest.mark.parametrize("prefix_len", [1, 17, 64, 129])
def test_prefix_lm_builder(prefix_len):
    n = 120
    q, k = _grid(n, n)
    bm = masks.prefix_lm(n, prefix_len, q_block=32, kv_block=16)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], (k <= q) | (k < prefix_len))


@pytest.mark.parametrize("chunk", [1, 7, 32, 50, 500])
def test_chunked_builder(chunk):
    n = 130
    q, k = _grid(n, n)
    bm = masks.chunked(n, chunk, q_block=32, kv_block=32)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], (k <= q) & (k // chunk == q // chunk))


def test_documents_of_lengths():
    ids = masks.documents_of_lengths([3, 1, 4], batch=2)
    assert ids.shape == (2, 8) and ids.dtype == np.int32
    assert ids.tolist() == [[0, 0, 0, 1, 2, 2, 2, 2]] * 2
    ids[0, 0] = 9  # a real array, not a read-only broadcast view
    assert ids[1, 0] == 0
    assert masks.documents_of_lengths([2]).tolist() == [[0, 0]]


def test_sparsity_is_one_minus_density():
    rng = np.random.default_rng()
    for density in (0.0, 0.25, 0.8, 1.0):
        m = rng.random((2, 2, 77, 130)) < density
        bm = masks.from_dense(m, 32, 64)
        assert bm.sparsity() == pytest.approx(1.0 - m.mean(), abs=1e-12)
    bm = masks.causal(128, q_block=32, kv_block=32)
    assert bm.sparsity() == pytest.approx(1.0 - (128 * 129 / 2) / 128**2)


def test_describe_counts_types():
    bm = masks.causal(64, q_block=32, kv_block=32)
    text = bm.describe()
    assert "'CAUSAL': 2" in text and "'FULL': 1" in text and "'MASKED': 1" in text
    assert "sparsity" in text


def test_show_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng()
    bm = masks.from_dense(random_typed_dense(rng, 1, 2, 100, 140, 16, 16), 16, 16)
    path = tmp_path / "mask.png"
    summary = masks.show(bm, str(path), head=1)
    assert path.read_bytes().startswith(b"\x89PNG")
    assert isinstance(summary, str) and "sparsity" in summary


# ---- static masks: the kernel's tile schedule against the dense mask -------------------------

def _docs(rng, n, batch=1):
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(5, n - 1), replace=False)) if n > 1 else []
    ids = np.searchsorted(cuts, np.arange(n), side="right").astype(np.int32)
    return np.broadcast_to(ids, (batch, n)).copy()


STATIC_MASKS = [
    Mask(kind="none"),
    Mask(kind="causal"),
    Mask(kind="causal", align="top_left"),
    Mask(kind="sliding_window", window_left=37),
    Mask(kind="sliding_window", window_left=20, window_right=9),
    Mask(kind="sliding_window", window_left=0, window_right=0),
    Mask(kind="sliding_window", window_left=5, window_right=70, align="top_left"),
    Mask(kind="chunked", chunk_size=24),
    Mask(kind="chunked", chunk_size=64, align="top_left"),
    Mask(kind="chunked", chunk_size=7),
    Mask(kind="prefix_lm", prefix_len=50),
    Mask(kind="prefix_lm", prefix_len=63),
    Mask(kind="prefix_lm", prefix_len=65),
    Mask(kind="prefix_lm", prefix_len=3, align="top_left"),
    Mask(kind="document"),
    Mask(kind="document", causal=True),
    Mask(kind="causal", expression="(q_idx + kv_idx) % 3 != 0"),
]
SHAPES = [(77, 130), (130, 77), (128, 128), (200, 200), (1, 70), (70, 1), (45, 45)]
TILES = [(64, 64), (32, 128), (128, 32), (16, 16)]


def formula(mask: Mask, nq: int, nk: int, docs):
    """The dense mask of each static kind, written out independently of fagen.masks."""
    q, k = _grid(nq, nk)
    off = nk - nq if mask.align == "bottom_right" else 0
    d = q + off  # the diagonal key of each query
    if mask.kind == "none":
        return np.ones((nq, nk), bool)
    if mask.kind == "causal":
        return k <= d
    if mask.kind == "sliding_window":
        return (d - mask.window_left <= k) & (k <= d + (mask.window_right or 0))
    if mask.kind == "chunked":
        c = mask.chunk_size
        return (k <= d) & (k >= np.floor_divide(d, c) * c)
    if mask.kind == "prefix_lm":
        return (k <= d) | (k < mask.prefix_len)
    if mask.kind == "document":
        keep = docs[:, None] == docs[None, :]
        return keep & (k <= q) if mask.causal else keep
    raise AssertionError(mask.kind)


def check_schedule(mask, nq, nk, block_q, block_kv, doc_ids, dense):
    sched = mask_kinds.tile_schedule(mask, nq, nk, block_q, block_kv, doc_ids)
    n_qt, n_kt = -(-nq // block_q), -(-nk // block_kv)
    assert sorted(sched) == list(range(n_qt))
    for qt, (tiles, full) in sched.items():
        rows = dense[qt * block_q:(qt + 1) * block_q]  # rows < nq only
        kept_per_tile = np.array([rows[:, t * block_kv:(t + 1) * block_kv].sum() for t in range(n_kt)])
        assert 0 <= tiles.start and tiles.stop <= n_kt and tiles.step == 1
        visited = set(tiles)
        # (a) every kept pair lies in a visited tile of its query tile
        needed = {t for t in range(n_kt) if kept_per_tile[t]}
        assert needed <= visited, (str(mask), nq, nk, block_q, block_kv, qt, sorted(needed - visited))
        # (b) a full tile keeps every pair of every real row against every real key
        assert full <= visited
        for t in full:
            assert rows[:, t * block_kv:(t + 1) * block_kv].all(), (str(mask), nq, nk, block_q, block_kv, qt, t)
            assert t * block_kv + block_kv <= nk  # tiles crossing the sequence end take the element test
        # (c) nothing outside the range is kept
        outside = [t for t in range(n_kt) if t not in visited]
        assert not kept_per_tile[outside].any()
        if mask.expression is not None:
            assert not full


def _static_cases(mask):
    rng = np.random.default_rng()
    for nq, nk in SHAPES:
        if mask.kind == "document" and nq != nk:
            continue  # document masks need Nq == Nk
        doc_ids = _docs(rng, nk, batch=2) if mask.kind == "document" else None
        pred = mask_kinds.predicate(mask, nq, nk, doc_ids)
        dense = masks.dense_from_predicate(pred, 1, 1, nq, nk)[0, 0]
        expected = formula(mask, nq, nk, None if doc_ids is None else doc_ids[0])
        np.testing.assert_array_equal(dense, expected, err_msg=f"{mask} {nq}x{nk}")
        yield nq, nk, doc_ids, dense


@pytest.mark.parametrize("mask", STATIC_MASKS, ids=str)
def test_static_schedule_covers_the_dense_mask(mask):
    """(a) no kept pair skipped, (b) full tiles fully kept, (c) nothing kept outside the range,
    for every static kind, several shapes (Nq != Nk where the kind allows) and tile sizes."""
    for nq, nk, doc_ids, dense in _static_cases(mask):
        for block_q, block_kv in TILES:
            check_schedule(mask, nq, nk, block_q, block_kv, doc_ids, dense)


@pytest.mark.parametrize("mask", [m for m in STATIC_MASKS if m.expression is None], ids=str)
def test_static_schedule_of_a_validated_mask(mask):
    """Validated masks (unused fields None) schedule without tripping on other kinds' fields."""
    for nq, nk, doc_ids, dense in _static_cases(mask):
        for block_q, block_kv in TILES:
            check_schedule(mask, nq, nk, block_q, block_kv, doc_ids, dense)


def test_static_schedule_skips_tiles():
    """The schedule is not trivially 'everything': masks that allow it skip tiles and mark full ones."""
    nq = nk = 512

    def schedule(mask, doc_ids=None):
        return mask_kinds.tile_schedule(mask, nq, nk, 64, 64, doc_ids)

    causal = schedule(Mask(kind="causal"))
    assert causal[0][0] == range(0, 1) and causal[7][0] == range(0, 8)
    assert causal[7][1] == set(range(7))
    window = schedule(Mask(kind="sliding_window", window_left=64))
    assert window[7][0] == range(6, 8)
    docs = masks.documents_of_lengths([128, 256, 128])
    doc = schedule(Mask(kind="document"), docs)
    assert doc[0][0] == range(0, 2) and doc[0][1] == {0, 1}
    assert doc[3][0] == range(2, 6) and doc[3][1] == {2, 3, 4, 5}
    chunked = schedule(Mask(kind="chunked", chunk_size=128))
    assert chunked[3][0] == range(2, 4) and chunked[3][1] == {2}


@pytest.mark.parametrize("mask", [Mask(kind="document"), Mask(kind="document", causal=True)], ids=str)
def test_static_document_predicate_per_batch(mask):
    rng = np.random.default_rng()
    n = 60
    doc_ids = np.stack([_docs(rng, n)[0], _docs(rng, n)[0]])
    dense = masks.dense_from_predicate(mask_kinds.predicate(mask, n, n, doc_ids), 2, 3, n, n)
    for b in range(2):
        for h in range(3):
            np.testing.assert_array_equal(dense[b, h], formula(mask, n, n, doc_ids[b]))
    # a single row of ids broadcasts over the batch
    one = masks.dense_from_predicate(mask_kinds.predicate(mask, n, n, doc_ids[:1]), 2, 1, n, n)
    np.testing.assert_array_equal(one[1, 0], formula(mask, n, n, doc_ids[0]))


def test_static_document_needs_doc_ids():
    with pytest.raises(ValueError, match="doc_ids"):
        mask_kinds.predicate(Mask(kind="document"), 8, 8, None)


def test_static_block_mask_kind_is_all_true():
    pred = mask_kinds.predicate(Mask(kind="block_mask"), 9, 13)
    assert masks.dense_from_predicate(pred, 1, 1, 9, 13).all()


@pytest.mark.parametrize("build, kind", [
    (lambda: masks.causal(1000), {"kind": "causal"}),
    (lambda: masks.from_predicate(lambda b, h, q, k: q >= k, 2, 3, 300, 300, 64, 64), None),  # per batch and head
    (lambda: masks.from_predicate(lambda b, h, q, k: q >= k, 1, 1, 300, 300, 64, 64), {"kind": "causal"}),
    (lambda: masks.from_predicate(lambda b, h, q, k: q >= 0, 1, 1, 300, 300, 64, 64), {"kind": "none"}),
    (lambda: masks.sliding_window(1000, 100), {"kind": "sliding_window", "window_left": 100}),
    (lambda: masks.prefix_lm(1000, 300), {"kind": "prefix_lm", "prefix_len": 300}),
    (lambda: masks.causal(1000, q_block=64, kv_block=128), None),  # diagonal blocks not square: partial
    (lambda: masks.causal(300, 400), None),  # not square
    (lambda: masks.sliding_window(1000, 100, 3), None),  # sees past the diagonal
    (lambda: masks.chunked(1000, 256), None),
    (lambda: masks.document(masks.documents_of_lengths([300, 500, 200])), None),
    (lambda: masks.from_predicate(lambda b, h, q, k: (q >= k) & ((q - k) % 2 == 0), 1, 1, 300, 300, 64, 64), None),
])
def test_as_kind_names_a_mask_that_is_exactly_a_kind_s_pattern(build, kind):
    """fagen.flex runs such a block mask on that kind's own kernels (no list to read)."""
    mask = build()
    found = mask.as_kind()
    assert (None if found is None else {"kind": found.kind, **found.model_dump(exclude_defaults=True)}) == kind
    if found is not None:  # the kind's pattern is the mask's, pair for pair
        n = mask.n_q
        keep = predicate(found, n, n)(0, 0, np.arange(n)[:, None], np.arange(n)[None, :])
        assert (mask.to_dense()[0, 0] == keep).all()


def test_as_kind_leaves_a_mask_past_its_block_limit_a_block_mask(monkeypatch):
    """Comparing with a kind's mask builds that one on the host: past AS_KIND_MAX_BLOCKS a mask
    runs as the block mask it is (correct, a list read), never a minutes-long build."""
    monkeypatch.setattr(masks, "AS_KIND_MAX_BLOCKS", 8 * 8 - 1)
    assert masks.causal(1024).as_kind() is None  # 8 x 8 blocks of 128
    assert masks.causal(896).as_kind() is not None  # 7 x 7


def test_per_head_random_blocks_walk_as_even_tiles_and_causal_ones_do_not():
    """BlockMask.even_tiles: each head's query blocks visit about as many KV blocks (per-head
    random blocks at half density) or not (causal, whose last block visits twice the mean)."""
    import numpy as np

    from fagen import masks

    rng = np.random.default_rng(0)
    n, block = 4096, 128
    blocks = n // block
    kept = rng.random((4, blocks, blocks)) < 0.5
    random = masks.from_predicate(lambda b, h, q, k: kept[h, q // block, k // block] | (q // block == k // block),
                                  1, 4, n, n, block, block)
    causal = masks.from_predicate(lambda b, h, q, k: k <= q, 1, 1, n, n, block, block)
    assert random.even_tiles and not causal.even_tiles
