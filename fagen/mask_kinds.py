"""Each mask kind as one object: the spec fields it reads, the kernel parameters and the side
input it takes, and its arithmetic in NumPy (which pairs count; which KV tiles a query tile
visits and which of them need no per-element test), written to mirror the kind's CUDA
partial, templates/masks/<name>.cu.j2; and, for the backward's KV-major loop, which
query tiles a KV tile visits. The spec's rules, the plan's kernel ABI, the oracle, the
block-mask builders and the tile-schedule tests all read these objects, so a new kind is this
file's one class and one template partial.

Positions are absolute; `off` is the key index of query 0's diagonal (n_kv - n_q aligned
bottom right, 0 top left). NumPy and the standard library only: the oracle depends on it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

INT_PTR = "const int* __restrict__"
INT2_PTR = "const int2* __restrict__"
Predicate = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]
FIELD_DEFAULTS = {"kind": "none", "align": "bottom_right", "window_left": None, "window_right": None,
                  "chunk_size": None, "prefix_len": None, "causal": False, "expression": None}
SPAN_FIELDS = ("window_left", "window_right", "chunk_size", "prefix_len")  # positions, int32 in the kernel
MAX_MASK_SPAN = 1 << 28  # positions: a window of 2^28 is unbounded in practice and int32-safe
ALIGNS = ("bottom_right", "top_left")


class MaskKind:
    name = ""
    fields: tuple[str, ...] = ()  # spec fields it reads, beside kind, align and expression
    required: str | None = None  # the one of them a spec must set
    params: tuple[tuple[str, str], ...] = ()  # (C type, name) kernel parameters it reads
    side_input: str | None = None  # the fagen.attention argument that carries its pattern
    shiftable = False  # a function of q - k alone: shards may move its diagonal (mask_offset)
    uses_align = True  # where the diagonal sits matters
    # a function of positions alone (no array indexed by query tile or row): GQA packing, whose
    # tile rows are (position, head) pairs, may test it per row
    packable = True
    # every query tile visits the same keys: no order of the tile walk balances anything
    even_tiles = False
    # its tile test reads memory (Mask::prepare_tile), which the loops issue before a tile's S MMAs
    prepares_tiles = False
    # its tiles' numbers are a list in global memory (Mask::kv_tile): the forward's producer reads
    # each a step ahead of the wait for its slot (others compute it, with no latency to hide; the
    # read-ahead's registers spilled the 24-register producer of varlen d64 kernels)
    lists_tiles = False
    # the keys a row sees end at a bound that rises with the row (Mask::count_through): the upper
    # warpgroups of a wgmma tile stop their MMAs before the tile's last steps, the lower rows' diagonal
    ends_by_row = False

    def keep(self, m, q: np.ndarray, k: np.ndarray, off: int, doc: Callable | None) -> np.ndarray:
        """Which (q, k) pairs count, broadcasting (element_active); doc(position) -> its
        document id, for kinds that read doc_ids."""
        return np.ones(np.broadcast_shapes(np.shape(q), np.shape(k)), bool)

    def kv_range(self, m, q0: int, q1: int, off: int, n_kv: int, docs) -> tuple[int, int]:
        """Keys [lo, hi) some row of rows [q0, q1] may see (Mask::begin)."""
        return 0, n_kv

    def q_range(self, m, k0: int, k1: int, off: int, n_q: int, docs) -> tuple[int, int]:
        """Queries [lo, hi) that may see some key of keys [k0, k1] (the backward's KV-major
        tile loop); 0 <= lo, hi <= n_q, and hi <= lo means none."""
        return 0, n_q

    def tile_full(self, m, k0: int, k1: int, q0: int, q1: int, off: int, docs) -> bool:
        """Does every pair of rows [q0, q1] x keys [k0, k1] count? (needs_element_test)"""
        return True

    def kv_tile(self, block_kv: int) -> int:
        """The keys a KV tile of its variants holds, given the default's: a tile straddling one of
        the kind's boundaries is computed whole and masked pair by pair."""
        return block_kv

    def __repr__(self) -> str:
        return f"MaskKind({self.name})"


class PowerOfTwoSpans(MaskKind):
    """A kind whose boundaries users place at multiples of a power of two (windows and chunks of
    1024 or 4096 keys): a variant's KV tile over 128 keys comes down to the largest power of two
    in it, so that those boundaries fall between tiles. H200, N 4k-16k, against the default's
    width: d128's 176 -> 128 on windows of 1024 keys +6-11%, chunks of 1024 +31-64%; e4m3 d128's
    192 -> 128 windows +5-6%, chunks +13%. Narrower tiles stay: d256's 80 -> 64 measured
    0.91-0.97x on windows (more tiles a row cost more than the straddling saves). (Block masks
    take their own blocks' tiles where a shipped spec has them: variants.block_aligned.)"""

    def kv_tile(self, block_kv: int) -> int:
        return block_kv if block_kv <= 128 else 1 << (block_kv.bit_length() - 1)


class NoMask(MaskKind):
    name = "none"
    shiftable = True
    uses_align = False
    even_tiles = True


class Causal(MaskKind):
    name = "causal"
    shiftable = True
    ends_by_row = True

    def keep(self, m, q, k, off, docs):
        return k <= q + off

    def kv_range(self, m, q0, q1, off, n_kv, docs):
        return 0, min(n_kv, q1 + off + 1)

    def q_range(self, m, k0, k1, off, n_q, docs):
        return max(0, k0 - off), n_q

    def tile_full(self, m, k0, k1, q0, q1, off, docs):
        return k1 <= q0 + off


class SlidingWindow(PowerOfTwoSpans):
    name = "sliding_window"
    fields = ("window_left", "window_right")
    required = "window_left"
    shiftable = True

    def keep(self, m, q, k, off, docs):
        return (k >= q + off - m.window_left) & (k <= q + off + (m.window_right or 0))

    def kv_range(self, m, q0, q1, off, n_kv, docs):
        return max(0, q0 + off - m.window_left), min(n_kv, q1 + off + (m.window_right or 0) + 1)

    def q_range(self, m, k0, k1, off, n_q, docs):
        return max(0, k0 - off - (m.window_right or 0)), min(n_q, k1 - off + m.window_left + 1)

    def tile_full(self, m, k0, k1, q0, q1, off, docs):
        return k0 >= q1 + off - m.window_left and k1 <= q0 + off + (m.window_right or 0)


class Chunked(PowerOfTwoSpans):
    name = "chunked"
    fields = ("chunk_size",)
    required = "chunk_size"

    def keep(self, m, q, k, off, docs):
        return (k <= q + off) & (k >= ((q + off) // m.chunk_size) * m.chunk_size)

    def kv_range(self, m, q0, q1, off, n_kv, docs):
        return max(0, ((q0 + off) // m.chunk_size) * m.chunk_size), min(n_kv, q1 + off + 1)

    def q_range(self, m, k0, k1, off, n_q, docs):
        # key k is seen from diagonal k up to the end of k's chunk (k >= 0: // is plain floor)
        return max(0, k0 - off), min(n_q, (k1 // m.chunk_size + 1) * m.chunk_size - off)

    def tile_full(self, m, k0, k1, q0, q1, off, docs):
        return k1 <= q0 + off and k0 >= ((q1 + off) // m.chunk_size) * m.chunk_size


class PrefixLM(MaskKind):
    name = "prefix_lm"
    fields = ("prefix_len",)
    required = "prefix_len"

    def keep(self, m, q, k, off, docs):
        return (k <= q + off) | (k < m.prefix_len)

    def kv_range(self, m, q0, q1, off, n_kv, docs):
        return 0, min(n_kv, max(q1 + off + 1, m.prefix_len))

    def q_range(self, m, k0, k1, off, n_q, docs):
        return (0 if k0 < m.prefix_len else max(0, k0 - off)), n_q

    def tile_full(self, m, k0, k1, q0, q1, off, docs):
        return k1 < m.prefix_len or k1 <= q0 + off


class Document(MaskKind):
    """Packed sequences: a query sees the keys of its own document (causally, if asked).
    Self-attention: positions index both the queries and the keys, so `off` plays no part."""

    name = "document"
    fields = ("causal",)
    # Each position's document [start, end), resolved from the caller's doc_ids once a call
    # (fagen.runtime.document_bounds): the loops' blocks read their rows' bounds (one load) instead
    # of binary-searching doc_ids (a dozen dependent loads at every tile's start). Rows of doc_sb
    # int2s, as doc_ids'.
    params = ((INT2_PTR, "doc_bounds"), ("long long", "doc_sb"))
    side_input = "doc_ids"
    packable = False
    uses_align = False

    # Documents start anywhere: 128 keys (FlexAttention's block) divide the usual lengths, where
    # the 192-key tiles of the d64 defaults computed half again the kept pairs of 512-key documents
    def kv_tile(self, block_kv: int) -> int:
        return min(block_kv, 128)

    def keep(self, m, q, k, off, doc):
        keep = doc(q) == doc(k)
        return keep & (k <= q) if m.causal else keep

    def kv_range(self, m, q0, q1, off, n_kv, docs):
        lo = int(np.searchsorted(docs, docs[q0], side="left"))
        hi = int(np.searchsorted(docs, docs[q1], side="right"))
        return lo, min(hi, q1 + 1) if m.causal else hi

    def q_range(self, m, k0, k1, off, n_q, docs):
        # causal: key k0 is first seen by query k0, inside k0's document
        lo = k0 if m.causal else int(np.searchsorted(docs, docs[k0], side="left"))
        return lo, int(np.searchsorted(docs, docs[k1], side="right"))

    def tile_full(self, m, k0, k1, q0, q1, off, docs):
        return bool(docs[q0] == docs[q1] == docs[k0] == docs[k1]) and (not m.causal or k1 <= q0)


class BlockMaskKind(MaskKind):
    """The pattern is a runtime fagen.masks.BlockMask: its lists say which tiles to visit and
    how to test them, so its NumPy twin lives with the builders there."""

    name = "block_mask"
    params = ((INT_PTR, "bm_num"), (INT_PTR, "bm_idx"), (INT_PTR, "bm_type"), (INT_PTR, "bm_partial"),
              ("const unsigned* __restrict__", "bm_bits"), ("int", "bm_sb"), ("int", "bm_sh"),
              ("int", "bm_max"), ("int", "bm_causal_offset"))
    side_input = "block_mask"
    packable = False
    uses_align = False
    prepares_tiles = True  # a tile's type and its PARTIAL pattern's words
    lists_tiles = True


KINDS: dict[str, MaskKind] = {k.name: k for k in (NoMask(), Causal(), SlidingWindow(), Chunked(), PrefixLM(),
                                                   Document(), BlockMaskKind())}


class FieldRefusal(NamedTuple):
    """A mask field its kind's rules refuse: `field = value: rule; fix` (fagen.spec.rule's form),
    with the fields the fix sets and removes, for the spec's Advice."""

    field: str
    value: object
    rule: str
    fix: str
    sets: dict
    removes: tuple = ()

    def __str__(self) -> str:
        return f"{self.field} = {self.value!r}: {self.rule}; {self.fix}"


def refused_field(m) -> FieldRefusal | None:
    """The first of a mask's fields (a fagen.spec.Mask, or fields_of's namespace) that its kind
    refuses: a field of another kind, a span that is not an integer in range, causal outside
    'document', the kind's required field unset. The spec's Mask and the oracle's mask= (through
    fields_of) both apply these rules, so both refuse one value with one message."""
    kind = KINDS[m.kind]
    for field in SPAN_FIELDS:
        value = getattr(m, field)
        if value is None:
            continue
        if field not in kind.fields:
            return FieldRefusal(f"mask.{field}", value, f"does not apply to mask kind {m.kind!r}",
                                "remove it, or use the kind it belongs to", {}, (f"mask.{field}",))
        low = 0 if field.startswith("window") else 1  # a window may be empty on one side
        whole = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
        if not whole or not low <= value <= MAX_MASK_SPAN:
            kind_of = "" if whole else "an integer "
            return FieldRefusal(f"mask.{field}", value, f"must be {kind_of}in {low}..{MAX_MASK_SPAN} (the kernel does "
                                "int32 position arithmetic)", "use e.g. 1024", {f"mask.{field}": 1024})
    if m.causal and "causal" not in kind.fields:
        return FieldRefusal("mask.causal", True, "only refines kind 'document'",
                            "use kind: causal (without causal: true) for plain causal attention",
                            {"mask.kind": "causal"}, ("mask.causal",))
    if kind.required and getattr(m, kind.required) is None:
        return FieldRefusal(f"mask.{kind.required}", None, f"is required by mask kind {m.kind!r}",
                            f"set mask.{kind.required}, e.g. 1024", {f"mask.{kind.required}": 1024})
    return None


def fields_of(mask) -> SimpleNamespace:
    """A mask's fields from a fagen.spec.Mask, a dict of its fields or a kind name, defaults
    filled, refused by the spec's rules (refused_field) where they break one."""
    if isinstance(mask, str):
        given = {"kind": mask}
    elif isinstance(mask, dict):
        given = dict(mask)
    elif all(hasattr(mask, f) for f in FIELD_DEFAULTS):
        given = {f: getattr(mask, f) for f in FIELD_DEFAULTS}
    else:
        raise ValueError(f"mask = {mask!r}: must be a fagen.spec.Mask, a dict of its fields or a kind name; pass "
                         f"e.g. mask='causal' or mask={{'kind': 'sliding_window', 'window_left': 1024}}")
    unknown = set(given) - set(FIELD_DEFAULTS)
    if unknown:
        raise ValueError(f"mask: unknown field(s) {sorted(unknown)}; a mask has {list(FIELD_DEFAULTS)}")
    m = SimpleNamespace(**{**FIELD_DEFAULTS, **given})
    if not isinstance(m.kind, str) or m.kind not in KINDS:
        raise ValueError(f"mask.kind = {m.kind!r}: must be one of {list(KINDS)}; use e.g. 'causal'")
    if m.align not in ALIGNS:
        raise ValueError(f"mask.align = {m.align!r}: must be one of {list(ALIGNS)} (where query 0's diagonal meets "
                         f"the keys: key Nk - Nq or key 0); use 'bottom_right', FlashAttention-2's")
    if not isinstance(m.causal, (bool, np.bool_)):
        raise ValueError(f"mask.causal = {m.causal!r}: must be True or False (document: also causal within a "
                         f"document); pass a bool")
    refused = refused_field(m)
    if refused is not None:
        raise ValueError(str(refused))
    return m


def as_keep(result, what: str) -> np.ndarray:
    """A mask predicate's result as bool (True: the pair counts), as FlexAttention's mask_mod
    returns it. Integers 0 and 1 read as False and True (np.where(c, 1, 0), .astype(int));
    other numbers are refused rather than read as "nonzero keeps": a 2 is arithmetic gone
    wrong, and a float likely an additive mask, whose 0 means keep and -inf drop."""
    keep = np.asarray(result)
    if keep.dtype == bool:
        return keep
    if keep.dtype.kind in "iu" and ((keep == 0) | (keep == 1)).all():
        return keep.astype(bool)
    flat = keep.ravel()
    odd = flat[(flat != 0) & (flat != 1)] if keep.dtype.kind in "iufc" else flat
    sample = (odd if odd.size else flat)[:1].tolist()
    holding = f" holding {sample[0]!r}" if sample else ""
    raise ValueError(f"{what} = {keep.dtype} array{holding}: must be bool, True = keep (or integers 0 "
                     f"and 1), as FlexAttention's mask_mod returns; return a comparison such as "
                     f"(k <= q) & (q - k < 1024), or x != 0 where nonzero means keep")


def diagonal_offset(align: str, n_q: int, n_kv: int) -> int:
    """Key index of query 0's diagonal: n_kv - n_q when aligned bottom-right (FlashAttention-2)."""
    return n_kv - n_q if align == "bottom_right" else 0


def predicate(mask, n_q: int, n_kv: int, doc_ids: np.ndarray | None = None) -> Predicate:
    """fn(b, h, q_idx, kv_idx) -> bool for a static mask (block_mask: every pair; its pattern
    is applied from the BlockMask): the kind's pattern alone. A mask.expression is ANDed by
    fagen.oracle, which evaluates it (fagen.expression)."""
    m = fields_of(mask)
    kind, off = KINDS[m.kind], diagonal_offset(m.align, n_q, n_kv)
    if kind.side_input != "doc_ids":
        return lambda b, h, q, k: kind.keep(m, q, k, off, None)
    if doc_ids is None:
        raise ValueError("mask kind 'document' needs doc_ids [B|1, N] (int32, non-decreasing)")
    docs = np.atleast_2d(np.asarray(doc_ids))
    return lambda b, h, q, k: kind.keep(m, q, k, off, lambda pos: docs[np.minimum(b, docs.shape[0] - 1), pos])


def tile_schedule(mask, n_q: int, n_kv: int, block_q: int, block_kv: int,
                  doc_ids: np.ndarray | None = None) -> dict[int, tuple[range, set[int]]]:
    """What a static-mask kernel visits, per query tile (batch 0): the KV tile range and the
    tiles it treats as full (no element test), by the kind's own arithmetic, so tests prove
    the kernel's tile logic against the dense mask. A tile crossing n_kv, and every tile of a
    mask with an expression, takes the element test."""
    m = fields_of(mask)
    kind, off = KINDS[m.kind], diagonal_offset(m.align, n_q, n_kv)
    docs = None if doc_ids is None else np.atleast_2d(np.asarray(doc_ids))[0]
    n_tiles = -(-n_kv // block_kv)
    out = {}
    for qt in range(-(-n_q // block_q)):
        q0, q1 = qt * block_q, min(qt * block_q + block_q, n_q) - 1  # first and last row
        lo, hi = kind.kv_range(m, q0, q1, off, n_kv, docs)
        tiles = range(lo // block_kv, -(-hi // block_kv)) if hi > lo else range(0)
        full = {t for t in tiles
                if t * block_kv + block_kv - 1 < n_kv and m.expression is None
                and kind.tile_full(m, t * block_kv, t * block_kv + block_kv - 1, q0, q1, off, docs)}
        out[qt] = (range(max(0, tiles.start), min(n_tiles, tiles.stop)), full)
    return out


def tile_schedule_keys(mask, n_q: int, n_kv: int, block_q: int, block_kv: int,
                       doc_ids: np.ndarray | None = None) -> dict[int, range]:
    """tile_schedule's transpose, for the backward's KV-major loop: per KV tile (batch 0), the
    query tiles it visits, by the kind's q_range."""
    m = fields_of(mask)
    kind, off = KINDS[m.kind], diagonal_offset(m.align, n_q, n_kv)
    docs = None if doc_ids is None else np.atleast_2d(np.asarray(doc_ids))[0]
    out = {}
    for kt in range(-(-n_kv // block_kv)):
        k0, k1 = kt * block_kv, min(kt * block_kv + block_kv, n_kv) - 1  # first and last key
        lo, hi = kind.q_range(m, k0, k1, off, n_q, docs)
        out[kt] = range(lo // block_q, -(-hi // block_q)) if hi > lo else range(0)
    return out
