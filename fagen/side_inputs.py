"""Rules for attention's side inputs (block_mask, doc_ids, alibi_slopes, sinks, bias): which a
mask kind needs, the shapes they must have, finite sinks. Written once for the float64 oracle
and the CUDA runtime, so both refuse the same arguments with the same message; plain shape
arithmetic on tuples and host values (standard library only), so it is tested on the CPU.

Messages follow fagen.spec.rule: `name = value: rule (why); fix`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from functools import cache

Shape = tuple[int, ...]


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


def check_finite(name: str, values: Iterable[float]) -> None:
    """Host values (sinks) that must be finite numbers."""
    values = list(values)
    bad = [i for i, x in enumerate(values) if not math.isfinite(x)]
    if bad:
        raise ValueError(f"{name} = {values}: must be finite (each is one more logit in the softmax of every "
                         f"row of its head: nan or inf there gives nan rows); fix the entries at index "
                         f"{', '.join(map(str, bad))} (a sink of -1e4 takes no weight)")


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
