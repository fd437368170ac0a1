"""The backward's KV-major schedule: each mask kind's q_range and tile_schedule_keys against
the dense mask, over random shapes, parameters and diagonal offsets (both alignments,
Nq != Nk). Every static kind's range is exact at row granularity, hence at tile granularity:
a KV tile visits exactly the query tiles that keep some pair with it."""

from __future__ import annotations

import numpy as np
import pytest

from fagen import mask_kinds, masks
from fagen.mask_kinds import KINDS

EXACT = ["none", "causal", "sliding_window", "chunked", "prefix_lm", "document"]


def random_docs(rng, n):
    cuts = np.sort(rng.choice(np.arange(1, n), size=int(rng.integers(0, min(6, n - 1) + 1)), replace=False)) \
        if n > 1 else np.array([], int)
    return np.searchsorted(cuts, np.arange(n), side="right").astype(np.int32)


def random_mask(rng, kind):
    """A mask dict of `kind` with random parameters and alignment."""
    m = {"kind": kind, "align": str(rng.choice(["bottom_right", "top_left"]))}
    if kind == "sliding_window":
        m["window_left"] = int(rng.integers(0, 40))
        m["window_right"] = None if rng.random() < 0.3 else int(rng.integers(0, 40))
    elif kind == "chunked":
        m["chunk_size"] = int(rng.integers(1, 50))
    elif kind == "prefix_lm":
        m["prefix_len"] = int(rng.integers(1, 100))
    elif kind == "document":
        m["causal"] = bool(rng.random() < 0.5)
    return m


def random_case(rng, kind):
    """(mask, n_q, n_kv, doc_ids or None, dense [n_q, n_kv] of batch 0)."""
    mask = random_mask(rng, kind)
    n_q, n_kv = (int(x) for x in rng.integers(1, 90, 2))
    doc_ids = None
    if kind == "document":
        n_kv = n_q
        doc_ids = np.stack([random_docs(rng, n_q), random_docs(rng, n_q)])
    dense = masks.dense_from_predicate(mask_kinds.predicate(mask, n_q, n_kv, doc_ids), 1, 1, n_q, n_kv)[0, 0]
    return mask, n_q, n_kv, doc_ids, dense


# ---- q_range, row by row -------------------------------------------------------------------

@pytest.mark.parametrize("kind", EXACT)
def test_q_range_is_exact(kind):
    """For any keys [k0, k1] and any diagonal offset, [lo, hi) (clipped to [0, n_q)) is exactly
    the queries that keep some pair with those keys."""
    rng = np.random.default_rng()
    for _ in range(150):
        m = mask_kinds.fields_of(random_mask(rng, kind))
        n_q, n_kv = (int(x) for x in rng.integers(1, 90, 2))
        off = int(rng.integers(-100, 100))
        docs = None
        if kind == "document":
            n_kv, off = n_q, 0
            docs = random_docs(rng, n_q)
        qi, ki = np.arange(n_q)[:, None], np.arange(n_kv)[None, :]
        dense = np.broadcast_to(KINDS[kind].keep(m, qi, ki, off, lambda pos: docs[pos]),
                                (n_q, n_kv))
        for _ in range(6):
            k0, k1 = sorted(int(x) for x in rng.integers(0, n_kv, 2))
            lo, hi = KINDS[kind].q_range(m, k0, k1, off, n_q, docs)
            assert 0 <= lo and hi <= n_q, (m, n_q, n_kv, off, k0, k1, lo, hi)
            want = np.flatnonzero(dense[:, k0:k1 + 1].any(axis=1))
            assert list(want) == list(range(lo, hi)), (m, n_q, n_kv, off, k0, k1, lo, hi, want)


def test_block_mask_q_range_is_every_query():
    m = mask_kinds.fields_of("block_mask")
    assert KINDS["block_mask"].q_range(m, 3, 9, 5, 40, None) == (0, 40)


# ---- tile_schedule_keys against the dense mask -----------------------------------------------

def visited_blocks(sched):
    return {(qt, kt) for kt, tiles in sched.items() for qt in tiles}


def check_key_schedule(mask, n_q, n_kv, block_q, block_kv, doc_ids, dense, exact):
    sched = mask_kinds.tile_schedule_keys(mask, n_q, n_kv, block_q, block_kv, doc_ids)
    n_qt, n_kt = -(-n_q // block_q), -(-n_kv // block_kv)
    where = (mask, n_q, n_kv, block_q, block_kv)
    assert sorted(sched) == list(range(n_kt)), where
    for kt, tiles in sched.items():
        assert 0 <= tiles.start and tiles.stop <= n_qt and tiles.step == 1, (*where, kt, tiles)
        cols = dense[:, kt * block_kv:(kt + 1) * block_kv]
        needed = [qt for qt in range(n_qt) if cols[qt * block_q:(qt + 1) * block_q].any()]
        # every kept pair lies in a visited query tile of its KV tile ...
        assert set(needed) <= set(tiles), (*where, kt, tiles, needed)
        # ... and, for the kinds with exact ranges, every visited tile keeps a pair (in
        # particular the first and the last)
        if exact:
            assert list(tiles) == needed, (*where, kt, tiles, needed)
    # the backward visits no block the forward's schedule skips
    forward = {(qt, kt) for qt, (tiles, _) in
               mask_kinds.tile_schedule(mask, n_q, n_kv, block_q, block_kv, doc_ids).items() for kt in tiles}
    if exact:
        assert visited_blocks(sched) <= forward, where


@pytest.mark.parametrize("kind", EXACT)
def test_key_schedule_is_exact(kind):
    rng = np.random.default_rng()
    for _ in range(60):
        mask, n_q, n_kv, doc_ids, dense = random_case(rng, kind)
        block_q, block_kv = (int(x) for x in rng.choice([1, 3, 8, 16, 32, 64, 128], 2))
        check_key_schedule(mask, n_q, n_kv, block_q, block_kv, doc_ids, dense, exact=True)


@pytest.mark.parametrize("kind", EXACT)
def test_key_schedule_covers_an_expression(kind):
    """A mask expression keeps a subset of its kind's pairs: the kind's range still covers it."""
    rng = np.random.default_rng()
    for _ in range(20):
        mask, n_q, n_kv, doc_ids, dense = random_case(rng, kind)
        mask["expression"] = "(q_idx + kv_idx) % 3 != 0"
        qi, ki = np.arange(n_q)[:, None], np.arange(n_kv)[None, :]
        dense = dense & ((qi + ki) % 3 != 0)
        check_key_schedule(mask, n_q, n_kv, 16, 32, doc_ids, dense, exact=False)


def test_block_mask_kind_visits_every_tile():
    sched = mask_kinds.tile_schedule_keys("block_mask", 100, 70, 32, 16)
    assert sched == {kt: range(0, 4) for kt in range(5)}


def test_key_schedule_skips_tiles():
    """By hand, 512 x 512 in 64 x 64 tiles: the schedule is not trivially 'everything'."""
    nq = nk = 512

    def schedule(mask, doc_ids=None):
        return mask_kinds.tile_schedule_keys(mask, nq, nk, 64, 64, doc_ids)

    causal = schedule("causal")
    assert causal[0] == range(0, 8) and causal[7] == range(7, 8)
    window = schedule({"kind": "sliding_window", "window_left": 64})
    assert window[6] == range(6, 8) and window[7] == range(7, 8)
    chunked = schedule({"kind": "chunked", "chunk_size": 128})
    assert chunked[2] == range(2, 4) and chunked[3] == range(3, 4)
    prefix = schedule({"kind": "prefix_lm", "prefix_len": 100})
    assert prefix[1] == range(0, 8) and prefix[2] == range(2, 8)
    docs = masks.documents_of_lengths([128, 256, 128])
    assert schedule("document", docs)[3] == range(2, 6)
    assert schedule({"kind": "document", "causal": True}, docs)[3] == range(3, 6)
    top_left = mask_kinds.tile_schedule_keys({"kind": "causal", "align": "top_left"}, 128, 512, 64, 64)
    assert top_left[1] == range(1, 2) and top_left[2] == range(0)
