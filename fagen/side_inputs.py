"""Rules for attention's arguments beside q, k and v: the side inputs (block_mask, doc_ids,
alibi_slopes, sinks, bias), which a mask kind needs and the shapes they must have, finite sinks;
the scale and the softcap; and the values of a varlen batch's cu_seqlens and a paged cache's
page table. Written once for the float64 oracle, the spec (the softcap) and the CUDA runtime,
so all refuse the same arguments with the same message; plain arithmetic on shapes and host
values (NumPy for the page table, checked whole), so it is tested on the CPU.

Messages follow fagen.spec.rule: `name = value: rule (why); fix`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from functools import cache

import numpy as np

Shape = tuple[int, ...]
# softcap * tanh(s / softcap) with softcap a float32 constant of the kernel
SOFTCAP_RANGE, SOFTCAP_EXAMPLE = (1e-3, 1e6), 30.0


def _is_real(value) -> bool:
    """A real number, Python's or a NumPy scalar (a bool, a string, a complex or an array is not)."""
    if isinstance(value, (int, float)):
        return not isinstance(value, bool)
    if getattr(value, "shape", None) != ():
        return False
    dtype = getattr(value, "dtype", None)
    if hasattr(dtype, "kind"):  # NumPy and CuPy
        return dtype.kind in ("i", "u", "f")
    # a 0-d torch tensor: its dtype has no kind, but is_floating_point / is_complex and its name say it
    return str(dtype).startswith("torch.") and not (dtype.is_complex or str(dtype) == "torch.bool")


def _shown(value) -> str:
    """A value as a message shows it: an array by its type and shape, not its elements."""
    if getattr(value, "shape", ()) != () and hasattr(value, "dtype"):
        return f"{type(value).__name__} {_dims(tuple(value.shape))} of {value.dtype}"
    return repr(value)


def _values(array) -> list:
    """A host array's values as Python numbers (nested lists for a table)."""
    return array.tolist() if hasattr(array, "tolist") else list(array)


def softcap_refusal(value) -> tuple[str, str] | None:
    """(rule, fix) where `value` is not a softcap fagen takes, None where it is: the spec's
    score_mod.softcap and the oracle's and fagen.attention's softcap= read this one rule."""
    low, high = SOFTCAP_RANGE
    if _is_real(value) and low <= value <= high:
        return None
    return ("must be a finite number in [1e-3, 1e6] (it is a float32 constant in the kernel)",
            f"use e.g. {SOFTCAP_EXAMPLE} (Gemma 2), or remove it")


def check_softcap(name: str, value) -> float:
    """`value` as a float, or refused (softcap_refusal) under `name`."""
    refused = softcap_refusal(value)
    if refused is not None:
        raise ValueError(f"{name} = {_shown(value)}: {refused[0]}; {refused[1]}")
    return float(value)


def check_scale(scale, head_dim: int) -> float:
    """The scores' scale as a float: a finite number > 0, 1 / sqrt(head_dim) where None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    value = float(scale) if _is_real(scale) else math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale = {_shown(scale)}: must be a finite number > 0 (s = q.k * scale); leave it out for "
                         f"1 / sqrt(head_dim) = {1.0 / math.sqrt(head_dim):.6g}, or pass one number, e.g. 0.125")
    return value


def check_descale(name: str, value, batch: int, heads_kv: int) -> np.ndarray:
    """An FP8 input's descale (FlashAttention-3's q_descale, k_descale, v_descale): one number
    for the tensor, or one per (batch row, KV head), [B, Hkv], each finite and > 0; as float64
    [B, Hkv]."""
    shape = tuple(np.shape(value))
    if shape not in ((), (batch, heads_kv)):
        raise ValueError(f"{name}.shape = {_dims(shape)}: must be [] (the tensor's) or [B, Hkv] = "
                         f"{_dims((batch, heads_kv))} (one a batch row and KV head, as FlashAttention-3's); "
                         f"pass torch.full(({batch}, {heads_kv}), x) or one number")
    array = np.asarray(value, np.float64) if np.isrealobj(np.asarray(value)) else np.array(np.nan)
    if not (np.all(np.isfinite(array)) and np.all(array > 0)):
        raise ValueError(f"{name} = {_shown(value)}: every entry must be a finite number > 0 (the FP8 tensor's "
                         f"values times it are the real ones); fix the entries that are not, e.g. 1.0")
    return np.broadcast_to(array, (batch, heads_kv))


def require_mask_inputs(kind: str, *, has_block_mask: bool, has_doc_ids: bool) -> None:
    """A mask kind that reads its pattern from an array, named without the array."""
    if kind == "block_mask" and not has_block_mask:
        raise ValueError("block_mask = None: is required by mask kind 'block_mask' (the pattern is in that "
                         "array); build one with fagen.masks.from_predicate(lambda b, h, q, k: k <= q, 1, 1, "
                         "Nq, Nk) or fagen.masks' causal, sliding_window, document, prefix_lm, chunked, "
                         "from_dense, and pass it as block_mask=")
    if kind == "document" and not has_doc_ids:
        raise ValueError("doc_ids = None: is required by mask kind 'document' (a query sees the keys of its "
                         "own document); pass doc_ids=, [B|1, N] int32 ids, non-decreasing: "
                         "fagen.masks.documents_of_lengths([512, 1024, 512], batch=B) packs documents of "
                         "those lengths")


def _dims(shape: Shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _refuse(name: str, shape: Shape, expected: str, why: str, fix: str) -> ValueError:
    return ValueError(f"{name}.shape = {_dims(shape)}: must be {expected} ({why}); {fix}")


def _fits(shape: Shape, b: int, h: int, tail: Shape) -> bool:
    """[b|1, h|1, *tail]: batch and head axes may be 1 (broadcast)."""
    return len(shape) == 2 + len(tail) and shape[0] in (1, b) and shape[1] in (1, h) and tuple(shape[2:]) == tail


def check_shapes(b: int, hq: int, nq: int, nk: int, *, doc_ids: Shape | None = None,
                 alibi_slopes: Shape | None = None, sinks: Shape | None = None, bias: Shape | None = None,
                 bias_kind: str | None = None) -> None:
    """Refuse the first side input, given by its shape, that does not fit q [b, hq, nq, d] and
    k, v [b, hkv, nk, d]. bias_kind: the kernel's ('vector' or 'matrix'); None takes either,
    by rank (the oracle)."""
    if doc_ids is not None:
        if nq != nk:
            raise ValueError(f"doc_ids with Nq = {nq}, Nk = {nk}: document masks are self-attention over packed "
                             f"sequences (Nq == Nk == N); pass q, k, v of one length N, or build a block mask "
                             f"(fagen.masks.from_predicate) for other shapes")
        if len(doc_ids) != 2 or doc_ids[0] not in (1, b) or doc_ids[1] != nk:
            raise _refuse("doc_ids", doc_ids, f"[B|1, N] = [{b}|1, {nk}]",
                          "one document id per position, per batch row or shared by all",
                          f"e.g. fagen.masks.documents_of_lengths(lengths, batch={b})")
    for name, shape, what in (("alibi_slopes", alibi_slopes, "slope"), ("sinks", sinks, "logit")):
        if shape is not None and tuple(shape) != (hq,):
            raise _refuse(name, shape, f"[Hq] = [{hq}]", f"one float32 {what} per query head, also under GQA",
                          f"pass {hq} values, one per head of q")
    if bias is not None:
        vector, matrix = (nk,), (nq, nk)
        kinds = {"vector": [vector], "matrix": [matrix], None: [vector, matrix]}[bias_kind]
        if not any(_fits(bias, b, hq, tail) for tail in kinds):
            named = {vector: f"[B|1, H|1, Nk] = [{b}|1, {hq}|1, {nk}]",
                     matrix: f"[B|1, H|1, Nq, Nk] = [{b}|1, {hq}|1, {nq}, {nk}]"}
            raise _refuse("bias", bias, " or ".join(named[t] for t in kinds),
                          "a float32 score added per key (vector) or per pair (matrix); batch and head axes "
                          "may be 1", "reshape it, keeping size-1 axes for what it shares")


def check_block_mask(block_mask, b: int, hq: int, nq: int, nk: int) -> None:
    """A fagen.masks.BlockMask (read by its attributes: this layer is below fagen.masks) built for
    Nq x Nk, its batch and head axes 1 (broadcast) or q's."""
    if not all(hasattr(block_mask, a) for a in ("n_q", "n_kv", "batch", "heads", "to_dense")):
        raise ValueError(f"block_mask = {_shown(block_mask)}: must be a fagen.masks.BlockMask (lists of the blocks "
                         f"to visit, not a dense mask); build one with fagen.masks.from_dense(mask) from a bool "
                         f"[Nq, Nk] or [B|1, H|1, Nq, Nk] array, or pass the bool array as mask_mod")
    shape = (block_mask.batch, block_mask.heads, block_mask.n_q, block_mask.n_kv)
    if shape[2:] != (nq, nk) or shape[0] not in (1, b) or shape[1] not in (1, hq):
        raise _refuse("block_mask", shape, f"[B|1, H|1, Nq, Nk] = [{b}|1, {hq}|1, {nq}, {nk}]",
                      "one pattern per batch row and head, or shared by all", f"build it for Nq = {nq}, Nk = {nk}")


def check_finite(name: str, values: Iterable[float]) -> None:
    """Host values (sinks) that must be finite numbers."""
    values = list(values)
    bad = [i for i, x in enumerate(values) if not math.isfinite(x)]
    if bad:
        raise ValueError(f"{name} = {values}: must be finite (each is one more logit in the softmax of every "
                         f"row of its head: nan or inf there gives nan rows); fix the entries at index "
                         f"{', '.join(map(str, bad))} (a sink of -1e4 takes no weight)")


# ---- a varlen batch's and a paged cache's index values -----------------------------------------

def check_cu_seqlens_pair(entries_q: int, entries_k: int) -> None:
    """cu_seqlens_q and cu_seqlens_k (their lengths): 0, then one prefix sum per sequence, for the
    same B >= 1 sequences."""
    if entries_q < 2:
        raise ValueError(f"cu_seqlens_q = [{entries_q} entries]: must be [B + 1] with B >= 1 (the prefix sums of the "
                         f"sequence lengths, from 0); pass e.g. numpy.cumsum([0, *lengths])")
    if entries_k != entries_q:
        raise ValueError(f"cu_seqlens_k = [{entries_k} entries]: must have cu_seqlens_q's length, B + 1 = {entries_q} "
                         f"(0, then one prefix sum per sequence); pass the keys' prefix sums of the same {entries_q - 1} "
                         f"sequences")


def check_cu_seqlens(cu, total: int, max_seqlen: int | None, what: str, tensor: str | None = None) -> None:
    """cu_seqlens' values (a host array [B + 1]): from 0, non-decreasing, ending at the tensor's
    total rows, no sequence longer than max_seqlen (the grid covers that many; None: no bound,
    the oracle's). `tensor`: the rows' tensor where it is not `what` (the append's k, whose rows
    cu_seqlens_q counts too)."""
    cu = _values(cu)
    name, rows = f"cu_seqlens_{what}", tensor or what
    prefix_sums = "pass the prefix sums of the sequence lengths from 0, e.g. numpy.cumsum([0, *lengths])"
    if cu[0] != 0:
        raise ValueError(f"{name}[0] = {cu[0]}: must be 0 (prefix sums of the sequence lengths); {prefix_sums}")
    steps = [after - before for before, after in zip(cu, cu[1:])]
    if any(n < 0 for n in steps):
        i = next(i for i, n in enumerate(steps) if n < 0)
        raise ValueError(f"{name}[{i + 1}] = {cu[i + 1]}: {name} must be non-decreasing: {name}[{i + 1}] = {cu[i + 1]} "
                         f"< {name}[{i}] = {cu[i]} (sequence {i} would have {steps[i]} rows); {prefix_sums}")
    if cu[-1] != total:
        raise ValueError(f"{name}[-1] = {cu[-1]}, but {rows} has {total} rows: the last prefix sum is the total (every "
                         f"row is some sequence's); {prefix_sums}, or pass {rows}'s first {cu[-1]} rows"
                         if cu[-1] < total else
                         f"{name}[-1] = {cu[-1]}, but {rows} has {total} rows: the last prefix sum is the total (a "
                         f"sequence would run past {rows}'s last row); {prefix_sums}")
    if max_seqlen is not None and steps and max(steps) > max_seqlen:
        raise ValueError(f"max_seqlen_{what} = {max_seqlen}, but sequence {steps.index(max(steps))} has {max(steps)} "
                         f"rows: it sizes the grid; pass the longest sequence's length (or more)")


def check_seqused_k(used, cu_k, total_k: int, max_seqlen_k: int) -> None:
    """seqused_k's values: sequence b's keys, rows cu_seqlens_k[b] .. cu_seqlens_k[b] + seqused_k[b],
    lie within k and number at most max_seqlen_k."""
    used, cu_k = _values(used), _values(cu_k)
    for bad, rule, fix in (
            (lambda b: used[b] < 0, "must be >= 0", "pass each sequence's count of keys"),
            (lambda b: cu_k[b] + used[b] > total_k,
             f"must end within k's {total_k} rows (cu_seqlens_k[b] + seqused_k[b] <= total_k)",
             "pass at most the rows k holds from the sequence's first"),
            (lambda b: used[b] > max_seqlen_k, f"must be <= max_seqlen_k = {max_seqlen_k} (it sizes the grid)",
             "pass max_seqlen_k = max(seqused_k)")):
        b = next(filter(bad, range(len(used))), None)
        if b is not None:
            raise ValueError(f"seqused_k[{b}] = {used[b]} (from row cu_seqlens_k[{b}] = {cu_k[b]}): {rule}; {fix}")


def check_key_ranges(cache_seqlens, cache_leftpad, slots: int) -> None:
    """An unpaged cache's key ranges: sequence b's keys are slots cache_leftpad[b] ..
    cache_seqlens[b] of its [slots] (FlashAttention's flash_attn_with_kvcache), so 0 <=
    cache_leftpad[b] <= cache_seqlens[b] <= slots."""
    ends = _values(cache_seqlens)
    starts = [0] * len(ends) if cache_leftpad is None else _values(cache_leftpad)
    for bad, name, value, rule, fix in (
            (lambda b: not 0 <= ends[b] <= slots, "cache_seqlens", ends, f"must be in 0..{slots} (the cache's slots "
             "a sequence, k_cache.shape[1])", "pass each sequence's keys, ending within its slots"),
            (lambda b: not 0 <= starts[b] <= ends[b], "cache_leftpad", starts, "must be in 0..cache_seqlens[b] (the "
             "sequence's first key, before its last)", "pass each sequence's padding before its first key")):
        b = next(filter(bad, range(len(ends))), None)
        if b is not None:
            raise ValueError(f"{name}[{b}] = {value[b]}: {rule}; {fix}")


def check_page_size(page_size: int) -> None:
    """A paged cache's slots a page (k_cache.shape[1]): at least one."""
    if page_size < 1:
        raise ValueError(f"page_size = {page_size} (k_cache.shape[1]): must be >= 1 (the keys a page holds; "
                         f"a sequence of n keys reads ceil(n / page_size) pages); allocate the caches as "
                         f"[num_pages, page_size, Hkv, d] with page_size a multiple of 16, e.g. 16")


def check_pages(page_table, cache_seqlens, num_pages: int, page_size: int) -> None:
    """The page table's values (host arrays [B, max_pages] and [B]): every sequence fits its row,
    and every page it uses is a page of the cache (entries past a sequence's keys are never read:
    they may hold anything). Vectorised: a decode step checks a table of B x thousands of pages."""
    check_page_size(page_size)
    table, lengths = np.asarray(page_table, np.int64), np.asarray(cache_seqlens, np.int64)
    width = table.shape[1] if table.ndim == 2 else 0
    capacity = width * page_size
    too_long = (lengths < 0) | (lengths > capacity)
    pages = -(-lengths // page_size)  # the pages each sequence's keys lie in: the first ones of its row
    bad_pages = (np.arange(width) < pages[:, None]) & ((table < 0) | (table >= num_pages))
    refused = np.flatnonzero(too_long | bad_pages.any(axis=1))
    if not refused.size:
        return
    b = int(refused[0])  # the first refused sequence; its length before its pages
    n = int(lengths[b])
    if too_long[b]:
        raise ValueError(f"cache_seqlens[{b}] = {n}: must be in 0..{capacity} (page_table's {width} "
                         f"pages of {page_size}); widen page_table or shorten the sequence")
    i = int(np.argmax(bad_pages[b]))
    raise ValueError(f"page_table[{b}, {i}] = {int(table[b, i])}: not a page of the cache (0..{num_pages - 1}); "
                     f"sequence {b} reads it for keys {i * page_size}..{min(n, (i + 1) * page_size) - 1}, so "
                     f"point it at one of the cache's pages, 0..{num_pages - 1}")


def check_cached_lengths(cache_seqlens) -> None:
    """cache_seqlens before an append (a host array [B]): the keys each sequence holds, new tokens
    going after them; a negative count would drop the first new tokens and shift the rest."""
    lengths = np.asarray(cache_seqlens)
    negative = np.flatnonzero(lengths < 0)
    if negative.size:
        b = int(negative[0])
        raise ValueError(f"cache_seqlens[{b}] = {int(lengths[b])}: must be >= 0 (the keys sequence {b} holds; the "
                         f"new tokens go after them); pass each sequence's count of cached keys, 0 for a new one")


_CHECKED: dict[tuple[str, int], weakref.ref] = {}


def once_per_object(what: str, obj: object, check: Callable[[], None]) -> None:
    """check() the first time `obj` is seen for `what`, then not while it lives: for checks that
    read device values, a host sync a hot loop should not pay every call. A failed check is
    not remembered; an object without weak references is checked every time."""
    key = (what, id(obj))
    ref = _CHECKED.get(key)
    if ref is not None and ref() is obj:
        return
    check()
    try:
        _CHECKED[key] = weakref.ref(obj, lambda _, key=key: _CHECKED.pop(key, None))
    except TypeError:
        pass


@cache
def geometric_alibi_slopes(heads: int) -> tuple[float, ...]:
    """ALiBi's standard slopes (Press et al.): 2^(-8 i / n) for n a power of two; otherwise the
    slopes of the nearest lower power of two, then every other slope of the next one."""
    def powers(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]
    p = 2 ** int(math.floor(math.log2(heads)))
    slopes = powers(p)
    if p < heads:
        slopes += powers(2 * p)[0::2][: heads - p]
    return tuple(slopes)
