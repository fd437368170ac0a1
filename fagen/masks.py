"""Attention masks: the static kinds of a spec as NumPy predicates, and runtime block masks.

A block mask (seed 000, "OmniAttention") describes, per (batch, head, query block), the KV
blocks to visit and a type for each:

    MASKED   no pair counts: never listed, never loaded
    FULL     every pair counts: no per-element test (only the sequence end)
    CAUSAL   pair (q, k) counts iff k <= q + causal_offset (absolute positions)
    PARTIAL  an arbitrary pattern, bit-packed in `partial_masks[partial_index]`

Batch and head dimensions of a mask may be 1 (broadcast). The mask's block sizes are the
user's; `for_tiles` re-blocks it to a kernel's (block_q, block_kv) so the kernel only ever
walks its own tiles, whatever sizes the mask was built with.
"""

from __future__ import annotations

import itertools
import math
import numbers
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fagen.mask_kinds import Predicate, as_keep, diagonal_offset, predicate
from fagen.spec import LANE_COLUMNS, Mask, rule

MASKED, FULL, CAUSAL, PARTIAL = 0, 1, 2, 3
TYPE_NAMES = {MASKED: "MASKED", FULL: "FULL", CAUSAL: "CAUSAL", PARTIAL: "PARTIAL"}
BITS = 32  # partial masks pack 32 keys per uint32 word, key 0 in bit 0
# A mask is built on the host: its predicate evaluated in NumPy a block row at a time, then each
# block classified in a Python loop (~20 s at either cap). Past them it would run for minutes or
# hours, so the builders refuse such sizes before any work (`fagen mask show` has caps of its own).
MAX_BLOCKS = 1 << 20  # blocks classified: 1024 x 1024
MAX_PAIRS = 1 << 34  # (query, key) pairs evaluated: a 131072 x 131072 mask
# BlockMask.as_kind compares a mask with a kind's, built on the host, up to this many blocks (a
# 32k x 32k mask of 128-blocks, ~2 s once a mask); a larger one runs as the block mask it is
AS_KIND_MAX_BLOCKS = 1 << 16

def _check_int(name: str, value, meaning: str, low: int | None = None, example: int = 1024) -> None:
    """Refuse a builder's argument that is not an integer >= low, naming it (fagen.spec.rule)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(rule(name, value, f"must be an integer ({meaning})", f"use e.g. {example}"))
    if low is not None and value < low:
        raise ValueError(rule(name, int(value), f"must be >= {low} ({meaning})", f"use e.g. {example}"))


def _check_length(name: str, value) -> None:
    _check_int(name, value, "positions in the sequence", 1, 4096)


def _check_size(names: tuple[str, str], n_q: int, n_kv: int, q_block: int, kv_block: int, b: int = 1,
                h: int = 1) -> None:
    """Refuse a mask the host would take minutes to build (MAX_PAIRS, MAX_BLOCKS), naming the
    lengths (`names`: the caller's arguments for n_q and n_kv, one name for a square mask) or the
    block sizes, with a size that fits."""
    rows = f" (batch {b}, heads {h})" if b * h > 1 else ""
    if b * h * n_q * n_kv > MAX_PAIRS:
        why = (f"(query, key) pairs{rows}, over the {MAX_PAIRS:,} a mask built on the host may hold (its predicate "
               f"is evaluated in NumPy: it would run for minutes)")
        if names[0] == names[1] and n_q == n_kv:
            most = math.isqrt(MAX_PAIRS // (b * h))
            raise ValueError(rule(names[0], n_q, f"makes {n_q:,} x {n_kv:,} {why}",
                                  f"use {names[0]} <= {most}, or a spec's static mask kind, which the kernel computes "
                                  f"itself (fagen.attention(..., mask=...))"))
        raise ValueError(rule(f"{names[0]}, {names[1]}", (n_q, n_kv), f"make {n_q * n_kv:,} {why}",
                              f"use {names[0]} * {names[1]} <= {MAX_PAIRS // (b * h):,}, or a spec's static mask "
                              f"kind, which the kernel computes itself"))
    n_qb, n_kb = -(-n_q // q_block), -(-n_kv // kv_block)
    if b * h * n_qb * n_kb > MAX_BLOCKS:
        size = max(q_block, kv_block, math.isqrt(b * h * n_q * n_kv // MAX_BLOCKS))
        while b * h * -(-n_q // size) * -(-n_kv // size) > MAX_BLOCKS:
            size += 1
        raise ValueError(rule("q_block, kv_block", (q_block, kv_block), f"make {n_qb:,} x {n_kb:,} blocks{rows} of "
                              f"{names[0]} x {names[1]} = {n_q} x {n_kv}, over the {MAX_BLOCKS:,} a mask built on the "
                              f"host may have (each is classified in Python)", f"use q_block and kv_block >= {size}"))


def _check_square(n, q_block, kv_block) -> None:
    """The arguments of a builder of an n x n mask, size included."""
    _check_length("n", n)
    _check_blocks(q_block, kv_block, 0)
    _check_size(("n", "n"), n, n, q_block, kv_block)


def _check_blocks(q_block, kv_block, causal_offset) -> None:
    """The arguments from_dense and from_predicate share (the ready-made builders pass theirs)."""
    _check_int("q_block", q_block, "query rows per mask block", 1, 128)
    _check_int("kv_block", kv_block, "keys per mask block", 1, 128)
    _check_int("causal_offset", causal_offset, "CAUSAL blocks keep k <= q + causal_offset", example=0)


def dense_from_predicate(fn: Predicate, b: int, h: int, n_q: int, n_kv: int) -> np.ndarray:
    """[b, h, n_q, n_kv] bool; b or h of 1 broadcast."""
    bi, hi = np.arange(b)[:, None, None, None], np.arange(h)[None, :, None, None]
    qi, ki = np.arange(n_q)[None, None, :, None], np.arange(n_kv)[None, None, None, :]
    return np.broadcast_to(as_keep(fn(bi, hi, qi, ki), "fn(b, h, q_idx, kv_idx)"), (b, h, n_q, n_kv))


# ---- runtime block masks -----------------------------------------------------------------

@dataclass(frozen=True)
class KeyMajorLists:
    """A block mask transposed for the backward's dK/dV kernel (BlockMask.key_major): per
    (batch, KV head, KV block), the query blocks of each query head of the group that see it."""

    num: np.ndarray  # [Bm, Hkv|1, n_kv_blocks] int32: steps
    entries: np.ndarray  # [..., max_steps] int32: head in group * n_q_blocks + query block
    types: np.ndarray  # [..., max_steps] int32: FULL, CAUSAL or PARTIAL
    partial_index: np.ndarray  # [..., max_steps] int32: into BlockMask.partial_masks, -1 unless PARTIAL


# a head's busiest query block over its mean that still walks as even (BlockMask.even_tiles):
# per-head random blocks at half density spread 1.2-1.4 (4k-16k keys), causal 2
EVEN_TILE_SPREAD = 1.5
_SERIALS = itertools.count()
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # serial -> the BlockMask, while it lives


def _next_serial() -> str:
    """A new mask's name, a string: torch.compile makes an int attribute that differs between two
    traces a symbolic int (automatic dynamic shapes), which a constant function cannot take."""
    return f"block_mask_{next(_SERIALS)}"


def live_block_mask(serial: str) -> BlockMask:
    """The block mask of this serial (BlockMask.serial), while it lives."""
    return _LIVE[serial]


@dataclass
class BlockMask:
    """Per (batch, head, query block): the KV blocks to visit, their types, and bit patterns."""

    n_q: int
    n_kv: int
    q_block: int
    kv_block: int
    kv_num_blocks: np.ndarray  # [Bm, Hm, n_q_blocks] int32
    kv_indices: np.ndarray  # [Bm, Hm, n_q_blocks, max_blocks] int32, valid first kv_num_blocks
    block_types: np.ndarray  # [Bm, Hm, n_q_blocks, max_blocks] int32 (FULL, CAUSAL, PARTIAL)
    partial_index: np.ndarray  # [Bm, Hm, n_q_blocks, max_blocks] int32, -1 unless PARTIAL
    partial_masks: np.ndarray  # [n_partial, q_block, ceil(kv_block / 32)] uint32
    causal_offset: int = 0  # CAUSAL blocks keep k <= q + causal_offset
    _cache: dict = field(default_factory=dict, repr=False, compare=False)
    # names the mask to code that may pass only numbers (torch.compile's constant functions)
    serial: str = field(default_factory=_next_serial, init=False, repr=False, compare=False)

    def __post_init__(self):
        _LIVE[self.serial] = self

    @property
    def even_tiles(self) -> bool:
        """Whether each head's query blocks visit about as many KV blocks (the busiest at most
        EVEN_TILE_SPREAD times the mean): walked a head at a time, their blocks in flight then
        share that head's K and V in L2 (plan.l2_section). A causal pattern's spread is 2."""
        counts = self.kv_num_blocks.reshape(-1, self.kv_num_blocks.shape[-1]).astype(np.float64)
        mean = counts.mean(axis=1)
        return bool(np.all(counts.max(axis=1) <= EVEN_TILE_SPREAD * np.maximum(mean, 1e-9)))

    def __setstate__(self, state: dict):
        """A copy or an unpickled mask takes a serial of its own (copy, deepcopy and pickle set
        the state without __init__): never one that names another mask in this process."""
        self.__dict__.update(state, serial=_next_serial())
        _LIVE[self.serial] = self

    @property
    def batch(self) -> int:
        return self.kv_num_blocks.shape[0]

    @property
    def heads(self) -> int:
        return self.kv_num_blocks.shape[1]

    @property
    def n_q_blocks(self) -> int:
        return self.kv_num_blocks.shape[2]

    @property
    def n_kv_blocks(self) -> int:
        return -(-self.n_kv // self.kv_block)

    def block_type_grid(self) -> np.ndarray:
        """[Bm, Hm, n_q_blocks, n_kv_blocks] of MASKED / FULL / CAUSAL / PARTIAL."""
        return self.grids()[0]

    def to_dense(self) -> np.ndarray:
        """[Bm, Hm, n_q, n_kv] bool: the pairs this mask keeps."""
        return np.stack([np.stack([self.dense_rows(b, h, 0, self.n_q) for h in range(self.heads)])
                         for b in range(self.batch)])

    def dense_rows(self, b: int, h: int, r0: int, r1: int) -> np.ndarray:
        """[r1 - r0, n_kv] bool: the pairs query rows r0 .. r1 - 1 of batch row b and head h
        keep (re-blocking reads a slab at a time, never the whole N x N of every head)."""
        qb, kb = self.q_block, self.kv_block
        first, last = r0 // qb, -(-r1 // qb)
        dense = np.zeros(((last - first) * qb, self.n_kv_blocks * kb), bool)
        qi = np.arange(qb)[:, None]
        ki = np.arange(kb)[None, :]
        for r in range(first, last):
            for i in range(self.kv_num_blocks[b, h, r]):
                c, t = self.kv_indices[b, h, r, i], self.block_types[b, h, r, i]
                rows, cols = slice((r - first) * qb, (r - first + 1) * qb), slice(c * kb, c * kb + kb)
                if t == FULL:
                    dense[rows, cols] = True
                elif t == CAUSAL:
                    dense[rows, cols] = (c * kb + ki) <= (r * qb + qi) + self.causal_offset
                elif t == PARTIAL:
                    dense[rows, cols] = unpack_bits(self.partial_masks[self.partial_index[b, h, r, i]], kb)
        return dense[r0 - first * qb: r1 - first * qb, : self.n_kv]

    def as_kind(self) -> Mask | None:
        """The mask kind whose pattern this mask is exactly, where fagen's own kernels run it
        without reading a list: square, the same for every batch row and head, at offset 0, and
        none (every block FULL), causal, a causal sliding window or a prefix-LM mask. Else None.
        Cached on the mask: a call reads it."""
        return self.cached("as_kind", lambda: None if (fields := self._as_kind()) is None else Mask(**fields))

    def _as_kind(self) -> dict | None:
        if (self.n_q != self.n_kv or self.q_block != self.kv_block or self.causal_offset != 0 or self.batch != 1
                or self.heads != 1 or self.n_q_blocks * self.n_kv_blocks > AS_KIND_MAX_BLOCKS):
            return None
        types = self.block_type_grid()
        if (types == FULL).all():
            return {"kind": "none"}
        last, first = self.row_keys(self.n_q - 1), self.row_keys(0)
        if not last.any() or not last[-1] or last[self.n_q:].any():  # the last query sees itself
            return None
        window = self.n_q - 1 - int(np.argmax(last))
        candidates = [{"kind": "causal"}, {"kind": "prefix_lm", "prefix_len": int(first.sum())}]
        if window < self.n_q - 1:
            candidates.insert(1, {"kind": "sliding_window", "window_left": window})
        for fields in candidates:
            # a few rows first (each query tile's first and last), the whole pattern only then
            if fields.get("prefix_len", 1) >= 1 and self._rows_match(fields) and \
                    self._same_blocks(_builder(fields)(self.n_q, self.q_block)):
                return fields
        return None

    def _rows_match(self, fields: dict) -> bool:
        keep = predicate(fields, self.n_q, self.n_kv)
        keys = np.arange(self.n_kv)
        rows = sorted({r for qb in range(self.n_q_blocks)
                       for r in (qb * self.q_block, min(self.n_q, (qb + 1) * self.q_block) - 1)})
        return all(np.array_equal(self.row_keys(r), np.broadcast_to(keep(0, 0, r, keys), (self.n_kv,))) for r in rows)

    def row_keys(self, row: int) -> np.ndarray:
        """bool [n_kv]: the keys query `row` sees (batch row 0, head 0)."""
        qb, kb, keep = row // self.q_block, self.kv_block, np.zeros(self.n_kv_blocks * self.kv_block, bool)
        for i in range(self.kv_num_blocks[0, 0, qb]):
            c, t = self.kv_indices[0, 0, qb, i], self.block_types[0, 0, qb, i]
            keys = np.arange(c * kb, (c + 1) * kb)
            if t == FULL:
                keep[keys] = True
            elif t == CAUSAL:
                keep[keys] = keys <= row + self.causal_offset
            elif t == PARTIAL:
                keep[keys] = unpack_bits(self.partial_masks[self.partial_index[0, 0, qb, i]][row - qb * self.q_block], kb)
        return keep[:self.n_kv]

    def _same_blocks(self, other: BlockMask) -> bool:
        """The same pattern, block for block (types, and PARTIAL blocks' bits)."""
        (types, partials), (their_types, their_partials) = self.grids(), other.grids()
        if types.shape != their_types.shape or not np.array_equal(types, their_types):
            return False
        mine, theirs = partials[types == PARTIAL], their_partials[types == PARTIAL]
        return np.array_equal(self.partial_masks[mine], other.partial_masks[theirs])

    def sparsity(self) -> float:
        """Fraction of (q, k) pairs masked out."""
        return 1.0 - float(self.to_dense().mean())

    def for_tiles(self, block_q: int, block_kv: int) -> BlockMask:
        """This mask re-blocked to a kernel's tile sizes (cached). Blocks larger or smaller than
        the tiles both work: types are recomputed from the exact pattern of each tile."""
        if (self.q_block, self.kv_block) == (block_q, block_kv):
            return self
        return self.cached(("tiles", block_q, block_kv), lambda: self._reblocked(block_q, block_kv))

    def _reblocked(self, block_q: int, block_kv: int) -> BlockMask:
        _check_blocks(block_q, block_kv, self.causal_offset)
        slab: dict = {}  # the query tile's rows, dense, while its blocks are classified

        def block_of(b: int, h: int, qb: int, kb: int) -> np.ndarray:
            if slab.get("at") != (b, h, qb):
                slab.update(at=(b, h, qb), rows=self.dense_rows(b, h, qb * block_q, min(self.n_q, (qb + 1) * block_q)))
            return slab["rows"][:, kb * block_kv:(kb + 1) * block_kv]
        return from_blocks(self.n_q, self.n_kv, block_q, block_kv, self.batch, self.heads, block_of, self.causal_offset)

    def key_major(self, group: int) -> KeyMajorLists:
        """The backward's dK/dV view of this mask, blocked as it is (for_tiles first): per
        (batch, KV head, KV block) the steps of its loop, each a (query head of the group, query
        block) that sees the block, in order, as entries head * n_q_blocks + query block, with
        their types and indices into the same partial_masks (patterns stay query-row-major).
        Heads: 1 where the mask broadcasts over heads, else one per KV head (cached)."""
        _check_int("group", group, "query heads per KV head, Hq // Hkv", 1, 1)
        return self.cached(("key_major", group), lambda: self._key_major(group))

    def _key_major(self, group: int) -> KeyMajorLists:
        types, partials = self.grids()
        b, h, n_qb, n_kb = types.shape
        if h > 1 and h % group:
            raise ValueError(f"block_mask has {h} heads, not a multiple of the group of {group} query heads per "
                             "KV head; build it with 1 head or one per query head")
        if h == 1:  # every query head of a group sees the same blocks
            types, partials = (np.broadcast_to(a, (b, group, n_qb, n_kb)) for a in (types, partials))
        kv_heads = max(1, h // group)
        # [B, Hkv, group * n_qb, n_kb] -> [B, Hkv, n_kb, group * n_qb]: entries head * n_qb + qb
        types, partials = (np.ascontiguousarray(a.reshape(b, kv_heads, group * n_qb, n_kb).swapaxes(2, 3))
                           for a in (types, partials))
        visit = types != MASKED
        num = visit.sum(-1).astype(np.int32)
        steps = max(1, int(num.max()))
        order = np.argsort(~visit, axis=-1, kind="stable")[..., :steps].astype(np.int32)  # visited first, in order
        listed = np.arange(steps) < num[..., None]
        return KeyMajorLists(
            num, np.where(listed, order, 0).astype(np.int32),
            np.where(listed, np.take_along_axis(types, order, -1), MASKED).astype(np.int32),
            np.where(listed, np.take_along_axis(partials, order, -1), -1).astype(np.int32))

    def cached(self, key, build: Callable[[], object]):
        """build() kept on the mask under `key`: what it, or a caller, derives from it once (its
        kind, its re-blockings, a device's copy of its lists)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def grids(self) -> tuple[np.ndarray, np.ndarray]:
        """[Bm, Hm, n_q_blocks, n_kv_blocks] block types and partial indices (-1 unless PARTIAL)."""
        types = np.full((self.batch, self.heads, self.n_q_blocks, self.n_kv_blocks), MASKED, np.int32)
        partials = np.full_like(types, -1)
        for b in range(self.batch):
            for h in range(self.heads):
                for qb in range(self.n_q_blocks):
                    n = self.kv_num_blocks[b, h, qb]
                    types[b, h, qb, self.kv_indices[b, h, qb, :n]] = self.block_types[b, h, qb, :n]
                    partials[b, h, qb, self.kv_indices[b, h, qb, :n]] = self.partial_index[b, h, qb, :n]
        return types, partials

    def describe(self) -> str:
        grid = self.block_type_grid()
        counts = {TYPE_NAMES[t]: int((grid == t).sum()) for t in TYPE_NAMES}
        return (f"BlockMask {self.batch}x{self.heads}, {self.n_q}x{self.n_kv} in {self.q_block}x{self.kv_block} "
                f"blocks: {counts}; sparsity {self.sparsity():.1%}")


def pack_bits(block: np.ndarray, kv_block: int) -> np.ndarray:
    """[rows, <=kv_block] bool -> [rows, ceil(kv_block / 32)] uint32, key k in bit k % 32."""
    rows = block.shape[0]
    words = -(-kv_block // BITS)
    padded = np.zeros((rows, words * BITS), bool)
    padded[:, : block.shape[1]] = block
    weights = (1 << np.arange(BITS, dtype=np.uint64)).astype(np.uint64)
    return (padded.reshape(rows, words, BITS).astype(np.uint64) * weights).sum(-1).astype(np.uint32)


def unpack_bits(words: np.ndarray, kv_block: int) -> np.ndarray:
    bits = (words[..., None] >> np.arange(BITS, dtype=np.uint32)) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :kv_block].astype(bool)


def thread_words(patterns: np.ndarray, kv_block: int, transposed: bool = False) -> np.ndarray:
    """PARTIAL patterns [P, q_block, ceil(kv_block / 32)] (bit-packed, key k in bit k % 32) as the
    kernels' threads read them: [P, rows, 4, W] uint32, W = ceil(columns / LANE_COLUMNS), where
    word w of thread t of a quad holds, in bit j of pair p = 32 w + j, column 8 (p // 2) + 2 t +
    p % 2 of the row: its columns in the MMA accumulator's layout, so that the element test reads
    registers loaded once a tile. Rows are queries and columns keys, or transposed, keys and
    queries (the dK/dV kernel's S^T)."""
    dense = unpack_bits(patterns, kv_block)
    if transposed:
        dense = dense.swapaxes(1, 2)
    n_patterns, rows, n_cols = dense.shape
    words = -(-n_cols // LANE_COLUMNS)
    cols = np.zeros((n_patterns, rows, words * LANE_COLUMNS), bool)
    cols[..., :n_cols] = dense
    # [P, rows, n8 fragment, quad thread, its 2 columns] -> [P, rows, quad thread, (fragment, column)]
    by_thread = cols.reshape(n_patterns, rows, -1, 4, 2).swapaxes(2, 3).reshape(n_patterns * rows * 4, -1)
    return pack_bits(by_thread, words * BITS).reshape(n_patterns, rows, 4, words)


def _classify(keep: np.ndarray, q0: int, k0: int, causal_offset: int) -> int:
    """Type of one block given its kept pairs (rows/keys past the sequence are ignored)."""
    if not keep.any():
        return MASKED
    if keep.all():
        return FULL
    qi = q0 + np.arange(keep.shape[0])[:, None]
    ki = k0 + np.arange(keep.shape[1])[None, :]
    if np.array_equal(keep, ki <= qi + causal_offset):
        return CAUSAL
    return PARTIAL


def from_blocks(n_q: int, n_kv: int, q_block: int, kv_block: int, batch: int, heads: int,
                block_of: Callable[[int, int, int, int], np.ndarray], causal_offset: int = 0) -> BlockMask:
    """Assemble a BlockMask from `block_of(b, h, qb, kb) -> bool[rows, keys]` (true extents)."""
    n_qb, n_kb = -(-n_q // q_block), -(-n_kv // kv_block)
    num = np.zeros((batch, heads, n_qb), np.int32)
    idx = np.zeros((batch, heads, n_qb, n_kb), np.int32)
    types = np.zeros((batch, heads, n_qb, n_kb), np.int32)
    pidx = np.full((batch, heads, n_qb, n_kb), -1, np.int32)
    partials: list[np.ndarray] = []
    for b in range(batch):
        for h in range(heads):
            for qb in range(n_qb):
                for kb in range(n_kb):
                    keep = block_of(b, h, qb, kb)
                    t = _classify(keep, qb * q_block, kb * kv_block, causal_offset)
                    if t == MASKED:
                        continue
                    i = num[b, h, qb]
                    idx[b, h, qb, i], types[b, h, qb, i] = kb, t
                    if t == PARTIAL:
                        full = np.zeros((q_block, keep.shape[1]), bool)
                        full[: keep.shape[0]] = keep
                        pidx[b, h, qb, i] = len(partials)
                        partials.append(pack_bits(full, kv_block))
                    num[b, h, qb] += 1
    max_blocks = max(1, int(num.max()) if num.size else 1)
    words = -(-kv_block // BITS)
    masks = np.stack(partials) if partials else np.zeros((1, q_block, words), np.uint32)
    return BlockMask(n_q, n_kv, q_block, kv_block, num, np.ascontiguousarray(idx[..., :max_blocks]),
                     np.ascontiguousarray(types[..., :max_blocks]), np.ascontiguousarray(pidx[..., :max_blocks]),
                     masks, causal_offset)


def from_types(n_q: int, n_kv: int, q_block: int, kv_block: int, types: np.ndarray, patterns: np.ndarray,
               causal_offset: int = 0) -> BlockMask:
    """A BlockMask from every block's type [B, H, n_q_blocks, n_kv_blocks] (MASKED ... PARTIAL)
    and the PARTIAL blocks' bit patterns [partials, q_block, words], in the grid's row-major
    order (from_blocks' order): a builder that classified the blocks itself (fagen.flex's, on
    the device)."""
    visited = types != MASKED
    num = visited.sum(-1).astype(np.int32)
    order = np.argsort(~visited, axis=-1, kind="stable").astype(np.int32)  # visited blocks first, ascending
    max_blocks = max(1, int(num.max()) if num.size else 1)
    listed = np.arange(max_blocks) < num[..., None]
    kinds = np.take_along_axis(types, order[..., :max_blocks], -1)
    idx = np.ascontiguousarray(np.where(listed, order[..., :max_blocks], 0), dtype=np.int32)
    partial = listed & (kinds == PARTIAL)
    pidx = np.where(partial, np.cumsum(partial.ravel()).reshape(partial.shape) - 1, -1).astype(np.int32)
    if int(partial.sum()) != len(patterns):
        raise ValueError(f"from_types: {int(partial.sum())} PARTIAL blocks but {len(patterns)} bit patterns")
    words = -(-kv_block // BITS)
    partial_masks = patterns if len(patterns) else np.zeros((1, q_block, words), np.uint32)
    return BlockMask(n_q, n_kv, q_block, kv_block, num, idx, np.where(listed, kinds, 0).astype(np.int32),
                     np.ascontiguousarray(pidx), np.ascontiguousarray(partial_masks, dtype=np.uint32), causal_offset)


def check_builder(names: tuple[str, str], n_q: int, n_kv: int, q_block: int, kv_block: int, b: int = 1,
                  h: int = 1) -> None:
    """A device builder's arguments, refused by name as from_predicate refuses them (but the host's
    size limits: it evaluates on the GPU)."""
    _check_int("b", b, "batch rows of the mask; 1 broadcasts", 1, 1)
    _check_int("h", h, "heads of the mask; 1 broadcasts", 1, 1)
    _check_length(names[0], n_q)
    _check_length(names[1], n_kv)
    _check_blocks(q_block, kv_block, 0)


# ---- builders ------------------------------------------------------------------------------

def from_dense(mask: np.ndarray, q_block: int = 128, kv_block: int = 128, causal_offset: int = 0) -> BlockMask:
    """From a bool array [Bm, Hm, Nq, Nk] (or [Nq, Nk]); integers 0 and 1 read as bools, other
    numbers are refused (see as_keep: an additive 0 / -inf mask would read inverted)."""
    mask = as_keep(mask, "from_dense: mask")
    _check_blocks(q_block, kv_block, causal_offset)
    if 0 in mask.shape:
        raise ValueError(rule("mask.shape", list(mask.shape), "every dimension must be >= 1 (a mask of no "
                              "positions has no blocks)", "pass [Nq, Nk] or [B|1, H|1, Nq, Nk] with Nq, Nk >= 1"))
    if mask.ndim == 2:
        mask = mask[None, None]
    if mask.ndim != 4:
        raise ValueError(f"from_dense: mask shape {mask.shape}; expected [Nq, Nk] or [B|1, H|1, Nq, Nk]")
    b, h, n_q, n_kv = mask.shape
    _check_size(("mask.shape[-2]", "mask.shape[-1]"), n_q, n_kv, q_block, kv_block, b, h)
    return from_blocks(n_q, n_kv, q_block, kv_block, b, h,
                       lambda bi, hi, qb, kb: mask[bi, hi, qb * q_block:(qb + 1) * q_block, kb * kv_block:(kb + 1) * kv_block],
                       causal_offset)


def from_predicate(fn: Predicate, b: int, h: int, n_q: int, n_kv: int, q_block: int = 128,
                   kv_block: int = 128, causal_offset: int = 0) -> BlockMask:
    """From a vectorised predicate fn(b, h, q_idx, kv_idx) -> bool, evaluated one query block
    at a time (q_block x n_kv), never the whole Nq x Nk matrix. b or h of 1 broadcasts.
    fn returns bools like FlexAttention's mask_mod; integers 0 and 1 read as bools, other
    numbers are refused (see as_keep)."""
    _check_int("b", b, "batch rows of the mask; 1 broadcasts", 1, 1)
    _check_int("h", h, "heads of the mask; 1 broadcasts", 1, 1)
    _check_length("n_q", n_q)
    _check_length("n_kv", n_kv)
    _check_blocks(q_block, kv_block, causal_offset)
    _check_size(("n_q", "n_kv"), n_q, n_kv, q_block, kv_block, b, h)
    rows_cache: dict[tuple[int, int, int], np.ndarray] = {}

    def block_of(bi, hi, qb, kb):
        key = (bi, hi, qb)
        if key not in rows_cache:
            rows_cache.clear()
            q = np.arange(qb * q_block, min((qb + 1) * q_block, n_q))[:, None]
            k = np.arange(n_kv)[None, :]
            keep = as_keep(fn(np.array(bi), np.array(hi), q, k), "from_predicate: fn(b, h, q_idx, kv_idx)")
            rows_cache[key] = np.broadcast_to(keep, (q.shape[0], n_kv))
        return rows_cache[key][:, kb * kv_block:(kb + 1) * kv_block]

    return from_blocks(n_q, n_kv, q_block, kv_block, b, h, block_of, causal_offset)


def causal(n_q: int, n_kv: int | None = None, q_block: int = 128, kv_block: int = 128,
           align: str = "bottom_right") -> BlockMask:
    _check_length("n_q", n_q)
    n_kv = n_q if n_kv is None else n_kv
    _check_length("n_kv", n_kv)
    if align not in ("bottom_right", "top_left"):
        raise ValueError(rule("align", align, "must be 'bottom_right' or 'top_left' (where query 0's diagonal "
                              "meets the keys: key Nk - Nq or key 0)", "use 'bottom_right', FlashAttention-2's"))
    off = diagonal_offset(align, n_q, n_kv)
    return from_predicate(lambda b, h, q, k: k <= q + off, 1, 1, n_q, n_kv, q_block, kv_block, causal_offset=off)


def sliding_window(n: int, left: int, right: int = 0, q_block: int = 128, kv_block: int = 128) -> BlockMask:
    """Query q sees keys q - left .. q + right."""
    _check_square(n, q_block, kv_block)
    _check_int("left", left, "keys before the diagonal a query sees", 0)
    _check_int("right", right, "keys after the diagonal a query sees", 0, 0)
    return from_predicate(lambda b, h, q, k: (k >= q - left) & (k <= q + right), 1, 1, n, n, q_block, kv_block)


def _builder(fields: dict):
    """(n, block) -> the BlockMask of a square mask kind's fields (BlockMask.as_kind's candidates)."""
    return {"causal": lambda n, block: causal(n, q_block=block, kv_block=block),
            "sliding_window": lambda n, block: sliding_window(n, fields.get("window_left", 0), 0, block, block),
            "prefix_lm": lambda n, block: prefix_lm(n, fields.get("prefix_len", 1), block, block)}[fields["kind"]]


def document(doc_ids: np.ndarray, causal: bool = True, q_block: int = 128, kv_block: int = 128) -> BlockMask:
    """Packed sequences: doc_ids [B, N] (or [N]); a query sees keys of its own document."""
    if doc_ids is None or np.asarray(doc_ids).dtype.kind not in "iu":
        raise ValueError(rule("doc_ids" if doc_ids is None else "doc_ids.dtype",
                              None if doc_ids is None else np.asarray(doc_ids).dtype,
                              "must be integer document ids, [N] or [B, N] (one a position)",
                              "build them with fagen.masks.documents_of_lengths([512, 1024])"))
    docs = np.atleast_2d(np.asarray(doc_ids))
    if docs.ndim != 2 or 0 in docs.shape:
        raise ValueError(rule("doc_ids.shape", list(np.shape(doc_ids)),
                              "must be [N] or [B, N] with B, N >= 1 (one document id per position)",
                              "build them with fagen.masks.documents_of_lengths([512, 1024])"))
    n = docs.shape[1]
    _check_blocks(q_block, kv_block, 0)
    _check_size(("doc_ids.shape[-1]", "doc_ids.shape[-1]"), n, n, q_block, kv_block, docs.shape[0])

    def fn(b, h, q, k):
        keep = docs[b, q] == docs[b, k]
        return keep & (k <= q) if causal else keep
    return from_predicate(fn, docs.shape[0], 1, n, n, q_block, kv_block)


def prefix_lm(n: int, prefix_len: int, q_block: int = 128, kv_block: int = 128) -> BlockMask:
    """Every query sees the first prefix_len keys, and is causal after them."""
    _check_square(n, q_block, kv_block)
    _check_int("prefix_len", prefix_len, "keys every query sees", 0)
    return from_predicate(lambda b, h, q, k: (k <= q) | (k < prefix_len), 1, 1, n, n, q_block, kv_block)


def chunked(n: int, chunk_size: int, q_block: int = 128, kv_block: int = 128) -> BlockMask:
    """Causal within chunks of chunk_size positions (Llama 4's chunked local attention)."""
    _check_square(n, q_block, kv_block)
    _check_int("chunk_size", chunk_size, "positions are grouped into chunks of this many", 1)
    return from_predicate(lambda b, h, q, k: (k <= q) & (k // chunk_size == q // chunk_size),
                          1, 1, n, n, q_block, kv_block)


def documents_of_lengths(lengths: list[int], batch: int = 1) -> np.ndarray:
    """doc_ids [batch, sum(lengths)] for packed documents of the given lengths."""
    if not isinstance(lengths, (list, tuple, np.ndarray)) or np.ndim(lengths) != 1:
        raise ValueError(rule("lengths", lengths, "must be a list of document lengths (the positions of each "
                              "packed document, in order)", "use e.g. [512, 1024, 512]"
                              + (f", or [{lengths}] for one document" if isinstance(lengths, numbers.Integral) else "")))
    for i, length in enumerate(lengths):
        _check_int(f"lengths[{i}]", length, f"positions of document {i}", 0, 512)
    _check_int("sum(lengths)", sum(lengths), "positions in the packed sequence", 1, 4096)
    _check_int("batch", batch, "rows of doc_ids, each the same packing", 1, 1)
    ids = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    return np.broadcast_to(ids, (batch, ids.size)).copy()


# ---- picture -------------------------------------------------------------------------------

def show(mask: BlockMask, path: str, batch: int = 0, head: int = 0) -> str:
    """Write a PNG of the block structure (FULL / CAUSAL / PARTIAL / MASKED) of one head;
    return a one-line summary with the sparsity. `path` names the file, in an existing folder;
    a folder is refused rather than written into under a name of our choosing, as `fagen mask
    show -o` refuses one: the caller knows where the picture went."""
    given = os.fspath(path)
    path = Path(given)
    if path.is_dir():
        raise ValueError(rule("path", given, "is a folder (show writes one PNG file)",
                              f"name a file in it, e.g. {path / 'mask.png'}"))
    if path.suffix.lower() != ".png":
        raise ValueError(rule("path", given, "must end in .png (the picture is a PNG)",
                              f"use e.g. {path.with_suffix('.png')}"))
    if not path.parent.is_dir():
        raise ValueError(rule("path", given, f"is in {path.parent}, which is not a folder",
                              f"create it (mkdir -p {path.parent}) or write elsewhere"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    grid = mask.block_type_grid()[min(batch, mask.batch - 1), min(head, mask.heads - 1)]
    colors = ["#f2f2f2", "#1f77b4", "#2ca02c", "#ff7f0e"]  # MASKED, FULL, CAUSAL, PARTIAL
    fig, ax = plt.subplots(figsize=(6, 6 * grid.shape[0] / max(grid.shape[1], 1) + 0.8))
    ax.imshow(grid, cmap=ListedColormap(colors), vmin=0, vmax=3, interpolation="nearest")
    ax.set_xlabel(f"KV block ({mask.kv_block} keys)")
    ax.set_ylabel(f"query block ({mask.q_block} rows)")
    summary = mask.describe()
    ax.set_title(f"{mask.n_q}x{mask.n_kv}, sparsity {mask.sparsity():.1%}", fontsize=10)
    ax.legend(handles=[Patch(color=c, label=TYPE_NAMES[t]) for t, c in enumerate(colors)],
              loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return summary
