"""Serving layouts: batches of sequences of different lengths (varlen) and paged KV caches, in
FlashAttention's conventions.

- varlen: q [total_q, Hq, d], k, v [total_k, Hkv, d], token-major; sequence b is rows
  cu_seqlens_q[b] .. cu_seqlens_q[b + 1] (int32 [B + 1], prefix sums from 0) and likewise for
  the keys. max_seqlen_q and max_seqlen_k are host ints: they size the grid. LSE is [Hq, total_q].
- paged: k_cache, v_cache [num_pages, page_size, Hkv, d] (page_size a multiple of 16; v_cache's d
  is V's width, head_dim_v, where it differs from q's and k's);
  page_table [B, max_pages] int32 lists sequence b's pages in order, cache_seqlens [B] int32 its
  keys. q is padded [B, Hq, Nq, d] (fagen.attention's layout) or varlen with cu_seqlens_q.

The kernels are the forward's, rendered with spec.sequences set: each block reads its own
sequence's lengths on the device, so masks hold per sequence (causal is bottom right in each).
A few query rows a KV head (decode) take the GQA-packed split-KV kernels, as fagen.attention
does. Nothing is copied: the tensors are read in place through views of their strides.

Bad input is refused before launch: shapes, dtypes and, with validate=True (the default), the
values of cu_seqlens, cache_seqlens and the page table (that reads them back: one host sync).
Inside a CUDA graph or a hot loop pass validate=False: the paged kernels and the append still
never touch a page outside the cache (a page id outside it loads zeros, or is not written, and
sets a flag in `status`; a sequence longer than its table row is cut to it), while varlen trusts
cu_seqlens and max_seqlen_*.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from fagen.decode import PreparedAttention, attention as decode_attention
from fagen.device import (DeviceTensor, as_device_tensor, cupy, empty_like, is_torch, multiprocessors, stream_for,
                          torch_stream_handle, zeros_like)
from fagen.plan import PAGE_OUT_OF_RANGE, PAGE_ROWS, SEQLEN_OVER_TABLE, query_tile_slots
from fagen.dispatch import batch_spec, batch_step, no_work
from fagen import fp8_inputs, variants
from fagen.element_types import KERNEL_TYPES, element_type, fp8_element
from fagen.rendering import (APPEND_KV_THREADS, SEQUENCE_TILES, SEQUENCE_TILES_COUNTS, SEQUENCE_TILES_PARAMS,
                          SEQUENCE_TILES_THREADS, append_kv_name)
from fagen.runtime import (Launch, Packed, _aux_array, _check_layout, compile_kernel, descale_parameters,
                           shared_function)
from fagen.side_inputs import (check_cached_lengths, check_cu_seqlens, check_cu_seqlens_pair,  # the oracle's too
                                check_key_ranges, check_page_size, check_pages, check_scale, check_seqused_k)
from fagen.spec import AttentionSpec

TABLE_ROW_BYTES = 8  # a query tile table's row: (sequence, first row), two int32s


@dataclass(frozen=True)
class Batch:
    """Where a batch's sequences are: the kernel's views of q, k, v (as [B, H, N, d] with the
    strides the kernel reads) and the sequence arguments it takes (plan.sequence_params)."""
    q: DeviceTensor
    k: DeviceTensor
    v: DeviceTensor
    q_layout: str  # "padded" or "varlen"
    kv_layout: str  # "padded", "varlen" or "paged"
    arguments: dict
    held: tuple  # device arrays behind the arguments' pointers

    @property
    def seqused_k(self) -> bool:
        """Varlen K/V counted per sequence (Sequences.seqused_k)."""
        return "seqused_k" in self.arguments


def _view(t: DeviceTensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> DeviceTensor:
    return DeviceTensor(t.obj, t.kind, t.ptr, shape, strides, t.dtype, t.device)


def _tokens(x, what: str, heads_name: str) -> DeviceTensor:
    t = as_device_tensor(x, what)
    if len(t.shape) != 3:
        raise ValueError(f"{what}: rank {len(t.shape)}, shape {t.shape}; varlen takes [total, {heads_name}, d] "
                         f"(token-major, sequences back to back)")
    _check_layout(t, what)
    return t


def _index_array(x, what: str, device: int, shape: tuple[str, ...]):
    """A small int32 device array (cu_seqlens, cache_seqlens, page_table), C-contiguous."""
    arr = _aux_array(x, what, "int32", device)
    if arr.ndim != len(shape):
        raise ValueError(f"{what}: shape {tuple(arr.shape)}; expected [{', '.join(shape)}] int32")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: not contiguous; pass {what}.contiguous()")
    return arr


def _host(arr) -> np.ndarray:
    return cupy.asnumpy(arr)  # one host sync: only where validate=True asks for it


def varlen_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                 seqused_k=None, validate: bool = True) -> Batch:
    """Check a varlen batch (FlashAttention's flash_attn_varlen_func arguments, seqused_k
    included) and view it."""
    tq, tk, tv = _tokens(q, "q", "Hq"), _tokens(k, "k", "Hkv"), _tokens(v, "v", "Hkv")
    if tk.shape[:2] != tv.shape[:2]:
        raise ValueError(f"k {tk.shape} and v {tv.shape} must have the same [total_k, Hkv] (v's width may differ: "
                         f"head_dim_v)")
    cu_q = _index_array(cu_seqlens_q, "cu_seqlens_q", tq.device, ("B + 1",))
    cu_k = _index_array(cu_seqlens_k, "cu_seqlens_k", tq.device, ("B + 1",))
    check_cu_seqlens_pair(cu_q.shape[0], cu_k.shape[0])  # the oracle's rule and message
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} = {n!r}: a host int >= 1 (the longest sequence; it sizes the grid)")
    used = None if seqused_k is None else _index_array(seqused_k, "seqused_k", tq.device, ("B",))
    if used is not None and used.shape[0] != cu_q.shape[0] - 1:
        raise ValueError(f"seqused_k {tuple(used.shape)}: [B] with B = {cu_q.shape[0] - 1} (cu_seqlens_q's)")
    if validate:
        check_cu_seqlens(_host(cu_q), tq.shape[0], int(max_seqlen_q), "q")
        if used is None:
            check_cu_seqlens(_host(cu_k), tk.shape[0], int(max_seqlen_k), "k")
        else:  # sequences may share rows: cu_seqlens_k only says where each one's keys start
            check_cu_seqlens(_host(cu_k), tk.shape[0], tk.shape[0], "k")
            check_seqused_k(_host(used), _host(cu_k), tk.shape[0], int(max_seqlen_k))
    b = cu_q.shape[0] - 1
    arguments = dict(cu_seqlens_q=np.uint64(cu_q.data.ptr), total_q=np.int32(tq.shape[0]),
                     cu_seqlens_k=np.uint64(cu_k.data.ptr), total_k=np.int32(tk.shape[0]))
    if used is not None:
        arguments["seqused_k"] = np.uint64(used.data.ptr)
    return Batch(_view(tq, (b, tq.shape[1], int(max_seqlen_q), tq.shape[2]), (0, tq.strides[1], tq.strides[0], 1)),
                 *(_view(t, (b, t.shape[1], int(max_seqlen_k), t.shape[2]), (0, t.strides[1], t.strides[0], 1))
                   for t in (tk, tv)),
                 "varlen", "varlen", arguments, (cu_q, cu_k) + ((used,) if used is not None else ()))


def paged_batch(q, k_cache, v_cache, page_table, cache_seqlens, *, cu_seqlens_q=None, max_seqlen_q: int | None = None,
                status=None, validate: bool = True) -> Batch:
    """Check a paged KV cache (and q: padded [B, Hq, Nq, d], or varlen with cu_seqlens_q) and view it."""
    tk, tv = as_device_tensor(k_cache, "k_cache"), as_device_tensor(v_cache, "v_cache")
    for t, name in ((tk, "k_cache"), (tv, "v_cache")):
        if len(t.shape) != 4:
            raise ValueError(f"{name}: shape {t.shape}; expected [num_pages, page_size, Hkv, d]")
        _check_layout(t, name)
    if tk.shape[:3] != tv.shape[:3]:
        raise ValueError(f"k_cache {tk.shape} and v_cache {tv.shape} must have the same [num_pages, page_size, Hkv]")
    num_pages, page_size, hkv, _ = tk.shape
    if page_size % PAGE_ROWS or page_size == 0:
        raise ValueError(f"page_size {page_size} (k_cache.shape[1]): must be a positive multiple of {PAGE_ROWS}")
    if cu_seqlens_q is None:
        tq = as_device_tensor(q, "q")
        if len(tq.shape) != 4:
            raise ValueError(f"q: shape {tq.shape}; expected [B, Hq, Nq, d], or [total_q, Hq, d] with cu_seqlens_q")
        _check_layout(tq, "q")
        q_layout, args, held, b = "padded", {}, (), tq.shape[0]
    else:
        tq = _tokens(q, "q", "Hq")
        cu_q = _index_array(cu_seqlens_q, "cu_seqlens_q", tq.device, ("B + 1",))
        if not isinstance(max_seqlen_q, (int, np.integer)) or max_seqlen_q < 1:
            raise ValueError(f"max_seqlen_q = {max_seqlen_q!r}: a host int >= 1 with cu_seqlens_q")
        if validate:
            check_cu_seqlens(_host(cu_q), tq.shape[0], int(max_seqlen_q), "q")
        b = cu_q.shape[0] - 1
        q_layout, held = "varlen", (cu_q,)
        args = dict(cu_seqlens_q=np.uint64(cu_q.data.ptr), total_q=np.int32(tq.shape[0]))
        tq = _view(tq, (b, tq.shape[1], int(max_seqlen_q), tq.shape[2]), (0, tq.strides[1], tq.strides[0], 1))
    table = _index_array(page_table, "page_table", tq.device, ("B", "max_pages"))
    seqlens = _index_array(cache_seqlens, "cache_seqlens", tq.device, ("B",))
    if table.shape[0] != b or seqlens.shape[0] != b:
        raise ValueError(f"page_table {tuple(table.shape)} and cache_seqlens {tuple(seqlens.shape)}: both need B = {b} "
                         f"rows, one a sequence of q")
    if table.shape[1] < 1:
        raise ValueError("page_table: no columns; it needs max_pages >= 1")
    if validate:
        check_pages(_host(table), _host(seqlens), num_pages, page_size)
    if status is None:
        status = zeros_like(tq, (1,), "int32")
    st = _index_array(status, "status", tq.device, ("1",))
    args.update(page_table=np.uint64(table.data.ptr), page_table_stride=np.int32(table.shape[1]),
                max_pages=np.int32(table.shape[1]), page_size=np.int32(page_size), num_pages=np.int32(num_pages),
                cache_seqlens=np.uint64(seqlens.data.ptr), status=np.uint64(st.data.ptr))
    capacity = table.shape[1] * page_size  # the keys of the longest sequence, at most
    kv = [_view(t, (b, hkv, capacity, t.shape[3]), (t.strides[0], t.strides[2], t.strides[1], 1)) for t in (tk, tv)]
    return Batch(tq, *kv, q_layout, "paged", args, (*held, table, seqlens, st, status))


def cache_rows(q, k_cache, v_cache, cache_seqlens, cache_leftpad=None, *, validate: bool = True):
    """An unpaged KV cache (k_cache, v_cache [B, slots, Hkv, d], FlashAttention's layout; q padded
    [B, Hq, Nq, d]) as fagen.attention's k and v [B, Hkv, slots, d] (views), its ranges checked
    first where validate=True (a host sync): 0 <= cache_leftpad[b] <= cache_seqlens[b] <= slots.
    Unchecked, the kernel clamps them to the slots."""
    tq, tk, tv = (as_device_tensor(x, n) for x, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")))
    if len(tq.shape) != 4:
        raise ValueError(f"q: shape {tq.shape}; expected [B, Hq, Nq, d] with an unpaged cache")
    for t, name in ((tk, "k_cache"), (tv, "v_cache")):
        if len(t.shape) != 4 or t.shape[0] != tq.shape[0]:
            raise ValueError(f"{name}: shape {t.shape}; expected [B, slots, Hkv, d] with q's B = {tq.shape[0]}")
    if tk.shape[:3] != tv.shape[:3]:
        raise ValueError(f"k_cache {tk.shape} and v_cache {tv.shape} must have the same [B, slots, Hkv]")
    for x, name in ((cache_seqlens, "cache_seqlens"), (cache_leftpad, "cache_leftpad")):
        t = None if x is None else as_device_tensor(x, name)
        if t is not None and (t.dtype != "int32" or t.kind != tq.kind or t.device != tq.device):
            raise ValueError(f"{name}: a {t.kind} {t.dtype} tensor on cuda:{t.device}; the kernel reads it in place: "
                             f"pass an int32 {tq.kind} tensor on q's cuda:{tq.device}")
    if validate:
        ends = _index_array(cache_seqlens, "cache_seqlens", tq.device, ("B",))
        starts = None if cache_leftpad is None else _index_array(cache_leftpad, "cache_leftpad", tq.device, ("B",))
        if ends.shape[0] != tq.shape[0] or starts is not None and starts.shape[0] != tq.shape[0]:
            raise ValueError(f"cache_seqlens {tuple(ends.shape)}, cache_leftpad "
                             f"{None if starts is None else tuple(starts.shape)}: [B] with q's B = {tq.shape[0]}")
        check_key_ranges(_host(ends), None if starts is None else _host(starts), tk.shape[1])
    return tuple(x.transpose(1, 2) if tk.kind == "torch" else x.transpose(0, 2, 1, 3) for x in (k_cache, v_cache))


def tile_table(cu_seqlens_q: int, batch: int, block_q: int, total_q: int, like: DeviceTensor):
    """A varlen batch's query tile table (plan.sequence_tiles) and the launch that fills it from
    cu_seqlens_q (a device address, batch + 1 int32s; the launch's one slot, which a prepared
    call re-points): int32 [query_tile_slots + 1, 2] from like's allocator (a CUDA graph may
    capture it). Row t < query_tile_slots is tile t's (sequence, first row) or (-1, 0): the
    longest sequences first, each one's latest rows first (templates/kernel/sequence_tiles.cu.j2).
    The last row's first word is the count a claimed walk's blocks take tiles from
    (plan.claimed_walk), zeroed: claimed_counter's address. The table follows cu_seqlens_q's
    values, so the launch runs before each call's kernel."""
    slots = query_tile_slots(total_q, batch, block_q)
    table = empty_like(like, (slots + 1, 2), "int32")
    ptr = as_device_tensor(table, "q_tiles").ptr
    values = dict(cu_seqlens=cu_seqlens_q, batch=batch, block_q=block_q, slots=slots, tiles=ptr,
                  claimed=claimed_counter(ptr, slots))
    return table, Launch(shared_function(SEQUENCE_TILES, like.device), (1, 1, 1), SEQUENCE_TILES_THREADS, 0,
                         SEQUENCE_TILES_PARAMS, values, slots=("cu_seqlens",))


def query_tiles(cu_seqlens_q: int, batch: int, block_q: int, total_q: int, like: DeviceTensor):
    """tile_table's table, filled by one launch on the current stream."""
    table, launch = tile_table(cu_seqlens_q, batch, block_q, total_q, like)
    launch(None)
    return table


def one_wave(tiles: tuple[int, int, int], device_index: int) -> bool:
    """Whether a varlen launch's tiles (query heads x table entries x splits) run at once, a block
    an SM: then no order among them pays for the tile table's launch (a driver call, 4 us of host
    time on an H200 host), and the kernel numbers them itself (templates/common/numbered_tiles)."""
    return tiles[0] * tiles[1] * tiles[2] <= multiprocessors(device_index)


def claimed_counter(table_ptr: int, slots: int) -> int:
    """The address of a query tile table's claim count: the first word after its slots' rows."""
    return table_ptr + slots * TABLE_ROW_BYTES


def query_tiles_numpy(cu_seqlens_q: np.ndarray, block_q: int, slots: int, counts: int = SEQUENCE_TILES_COUNTS
                      ) -> np.ndarray:
    """query_tiles' table on the host (the GPU tests' reference): each sequence's entries
    together, latest rows first; the sequences by tile count (counts - 1 at most) from the
    longest, then in order. The kernel orders sequences of equal count as its atomics come."""
    tile_counts = [max(0, -(-int(n) // block_q)) for n in np.diff(np.asarray(cu_seqlens_q, np.int64))]
    order = sorted(range(len(tile_counts)), key=lambda b: (-min(tile_counts[b], counts - 1), b))
    rows = [(b, j * block_q) for b in order for j in reversed(range(tile_counts[b]))][:slots]
    return np.array(rows + [(-1, 0)] * (slots - len(rows)), np.int32).reshape(slots, 2)


def pack(batch: Batch, spec: AttentionSpec, *, scale: float | None = None, sinks=None, alibi_slopes=None,
         splits: int | None = None, out=None, indices: tuple[str, ...] = (), q_descale=None, k_descale=None,
         v_descale=None, scale_o=None, amax_o=None) -> Packed:
    """The launches of `spec` (dispatch.batch_spec's) on a checked batch (`run` launches them; a prepared
    call keeps them): out like q ([B, Hq, Nq, d] or [total_q, Hq, d]; given, it is written in
    place), lse [B, Hq, Nq] or [Hq, total_q]. `indices`: the batch's index parameters a prepared
    call re-points (the kernel's slots after q, k, v). scale_o, amax_o: an FP8 output's (amax_o
    zeroed here, so for launches made once: `run`'s)."""
    tq, tk, tv = batch.q, batch.k, batch.v
    b, hq, nq, d = tq.shape
    hkv, nk = tk.shape[1], tk.shape[2]
    kv_types = (spec.kv_element.name, spec.kv_element.torch_name)
    if tq.dtype not in (spec.q_element.name, spec.q_element.torch_name) or tk.dtype not in kv_types or tv.dtype not in kv_types:
        raise ValueError(f"q, k, v: dtypes {tq.dtype}, {tk.dtype}, {tv.dtype}; all float16 or all bfloat16, all "
                         f"of one FP8 type (varlen), or a float16 or bfloat16 q against k and v of one FP8 type (an "
                         f"FP8 KV cache)")
    if tk.shape[-1] != d:
        raise ValueError(f"head_dim: q has {d}, k has {tk.shape[-1]}")
    if len({tq.device, tk.device, tv.device}) != 1:
        raise ValueError(f"q, k, v are on cuda:{tq.device}, cuda:{tk.device}, cuda:{tv.device}: put them on one GPU")
    scale = check_scale(scale, d)
    varlen_q = batch.q_layout == "varlen"
    total_q = int(batch.arguments["total_q"]) if varlen_q else 0
    dv = tv.shape[-1]  # O's width: V's (head_dim_v)
    out_shape, lse_shape = ((total_q, hq, dv), (hq, total_q)) if varlen_q else ((b, hq, nq, dv), (b, hq, nq))
    with cupy.cuda.Device(tq.device), stream_for(tq):
        if 0 in out_shape:  # no query row: nothing to launch (nor to split: dispatch.no_work)
            return Packed(spec, _outputs(out, out_shape, tq, spec.out_element.name), empty_like(tq, lse_shape, "float32"), None, None, [])
        spec, splits = batch_step(spec, varlen_q, b, hq, hkv, nq, nk, splits, sinks is not None)
        kernel = compile_kernel(spec)
        given = dict(block_mask=None, bias=None, doc_ids=None, alibi_slopes=alibi_slopes,
                     sinks=sinks if kernel.takes_sinks else None)
        extras, held = kernel.extra_arguments(tq, tk, given)
        extras.update(batch.arguments)
        # (FP8 inputs; a descale among the re-pointed `indices` is each call's own: held by none)
        descaled = kernel.descale_arguments(tq, tk, q_descale, k_descale, v_descale, moving=indices)
        if descaled is not None:
            extras.update(descaled[0])
            held = [*held, descaled[1]]
        if spec.out_element.is_fp8:
            scaled, kept = kernel.output_scale_arguments(tq, scale_o, amax_o)
            extras.update(scaled)
            held = [*held, kept]
        tiles = tile_grid = None
        if kernel.plan.sequence_tiles:  # the grid walks the batch's tiles
            extras["batch"] = b
            tile_grid = kernel.plan.tiles(b, hq, hkv, nq, splits or 1, total_q)
            if one_wave(tile_grid, tq.device):
                extras["q_tiles"] = np.uint64(0)  # the kernel numbers them: one launch, not two
                if kernel.plan.claimed_walk:
                    extras["tiles_claimed"] = np.uint64(0)
            else:  # the table orders them for the waves (the longest sequences first)
                table, tiles = tile_table(int(batch.arguments["cu_seqlens_q"]), b, kernel.plan.block_q, total_q, tq)
                ptr = as_device_tensor(table, "q_tiles").ptr
                extras["q_tiles"] = np.uint64(ptr)
                if kernel.plan.claimed_walk:
                    extras["tiles_claimed"] = np.uint64(claimed_counter(ptr, table.shape[0] - 1))
                held = [*held, table]
        out = _outputs(out, out_shape, tq, spec.out_element.name)
        _check_layout(as_device_tensor(out, "out"), "out")
        lse = empty_like(tq, lse_shape, "float32")
        # the kernel's views of out and lse: [B, Hq, Nq, d] strides, varlen rows token-major; the
        # merge's: a varlen batch is one sequence of total_q rows
        to = _bhsd(as_device_tensor(out, "out"), varlen_q)
        merged_views = (_as_one_sequence(out), lse[None]) if varlen_q else None
        packed = kernel.pack(tq, tk, tv, out, lse, to, as_device_tensor(lse, "lse"), scale=scale, mask_offset=0,
                             splits=splits or 1, extras=extras, held=[*held, *batch.held], indices=indices,
                             sinks=sinks, merged_views=merged_views)
        if kernel.plan.claimed_walk and tiles is None and math.prod(packed.kernel.grid) < math.prod(tile_grid):
            # (a walk without a counter takes a block a tile)
            raise RuntimeError(f"kernel {spec.name}: a walk of one wave launched {packed.kernel.grid} blocks, fewer "
                               f"than its tiles")
        return replace(packed, first=tiles)


def _outputs(out, shape: tuple[int, ...], tq: DeviceTensor, dtype: str):
    """out as given (checked: `shape`, `dtype` (the kernel's out type), q's framework and device) or allocated."""
    if out is None:
        return empty_like(tq, shape, dtype)
    to = as_device_tensor(out, "out")
    named = element_type(dtype)  # (torch spells FP8 types its own way: float8_e4m3fn)
    if to.shape != shape or to.dtype not in (named.name, named.torch_name) or to.kind != tq.kind or to.device != tq.device:
        raise ValueError(f"out: {to.kind} {to.dtype} {to.shape} on cuda:{to.device}; expected a {tq.kind} "
                         f"{named.torch_name if tq.kind == 'torch' else named.name} tensor {shape} on cuda:{tq.device}")
    return out


def run(batch: Batch, spec: AttentionSpec, *, scale: float | None = None, sinks=None, alibi_slopes=None,
        splits: int | None = None, out=None, q_descale=None, k_descale=None, v_descale=None, scale_o=None,
        amax_o=None):
    """(out, lse) of `spec` (dispatch.batch_spec's) on a checked batch, launched on the inputs' stream."""
    packed = pack(batch, spec, scale=scale, sinks=sinks, alibi_slopes=alibi_slopes, splits=splits, out=out,
                  q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, scale_o=scale_o, amax_o=amax_o)
    with cupy.cuda.Device(batch.q.device), stream_for(batch.q):
        packed()
    return packed.out, packed.lse


def _bhsd(t: DeviceTensor, varlen: bool) -> DeviceTensor:
    """out as the kernel indexes it: [B, Hq, Nq, d] strides (varlen: [total_q, Hq, d] rows, B unused)."""
    if not varlen:
        return t
    return _view(t, (1, t.shape[1], t.shape[0], t.shape[2]), (0, t.strides[1], t.strides[0], 1))


def _as_one_sequence(out):
    """[total_q, Hq, d] as a [1, Hq, total_q, d] view: the merge's rows."""
    return out.transpose(1, 0, 2)[None] if not hasattr(out, "permute") else out.permute(1, 0, 2).unsqueeze(0)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, mask=None, softcap: float | None = None, scale: float | None = None,
                     alibi_slopes=None, sinks=None, return_lse: bool = False, validate: bool = True, out=None,
                     seqused_k=None, q_descale=None, k_descale=None, v_descale=None, scale_o=None,
                     return_amax: bool = False):
    """Attention over a varlen batch (FlashAttention's flash_attn_varlen_func): q [total_q, Hq, d],
    k, v [total_k, Hkv, d], sequence b being rows cu_seqlens_*[b] .. cu_seqlens_*[b + 1]; with
    seqused_k (int32 [B]), sequence b's keys are rows cu_seqlens_k[b] .. cu_seqlens_k[b] +
    seqused_k[b], which may overlap another's. Every mask holds per sequence (causal: bottom
    right in each). Returns out [total_q, Hq, d] (and lse [Hq, total_q]). q, k, v of one FP8
    type: the FP8 forward (out bfloat16), FlashAttention-3's q_descale, k_descale, v_descale
    (float32, one number or [B, Hkv], B the sequences; None is 1); not with seqused_k. scale_o
    (FP8 q, k, v): out in float8_e4m3, e4m3(O * scale_o) saturated, and with return_amax max |O|
    (float32 [1]) returned last, as fagen.attention's."""
    if (not validate and alibi_slopes is None and q_descale is None and k_descale is None and v_descale is None
            and scale_o is None and not return_amax):
        # a loop's call: its layout's kept class
        done = KEPT_VARLEN_CALLS(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, out,
                                 return_lse, (causal, mask, softcap, scale, sinks))
        if done is not NotImplemented:
            return done
    batch = varlen_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
                         validate=validate)
    spec = batch_spec(batch, causal=causal, mask=mask, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    amax = None
    if fp8_inputs.check_output_request(scale_o, return_amax, spec.element.is_fp8,
                                       f"q, k, v are {batch.q.dtype}, {batch.k.dtype}, {batch.v.dtype}"):
        spec = variants.output_type_variant(spec, fp8_inputs.OUTPUT_TYPE)
        amax = zeros_like(batch.q, (1,), "float32") if return_amax else None  # (0 where no row is written)
    out, lse = run(batch, spec, scale=scale, sinks=sinks, alibi_slopes=alibi_slopes, out=out, q_descale=q_descale,
                   k_descale=k_descale, v_descale=v_descale, scale_o=scale_o, amax_o=amax)
    asked = ((lse,) if return_lse else ()) + ((amax,) if return_amax else ())
    return (out, *asked) if asked else out


# an array's dtype -> whether it is an FP8 type: a kept call's test is a dictionary lookup
_FP8_DTYPES: dict = {}


def _fp8(x, name: str = "q") -> bool:
    """Whether an array is of an FP8 type (its dtype object remembered: a serving loop's call)."""
    dtype = getattr(x, "dtype", None)
    fp8 = _FP8_DTYPES.get(dtype)
    if fp8 is None:
        fp8 = fp8_element(str(dtype).removeprefix("torch.") if is_torch(x) else as_device_tensor(x, name).dtype) is not None
        if dtype is not None:
            _FP8_DTYPES[dtype] = fp8
    return fp8


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table=None, *, cache_leftpad=None, k=None, v=None,
                           cu_seqlens_q=None, max_seqlen_q: int | None = None, causal: bool = False, mask=None,
                           softcap: float | None = None, scale: float | None = None, alibi_slopes=None, sinks=None,
                           return_lse: bool = False, status=None, validate: bool = True, out=None, q_descale=None,
                           k_descale=None, v_descale=None):
    """Attention against a KV cache (FlashAttention's flash_attn_with_kvcache). Paged: k_cache,
    v_cache [num_pages, page_size, Hkv, d], page_table [B, max_pages], cache_seqlens [B] keys
    each. Unpaged (page_table None): k_cache, v_cache [B, slots, Hkv, d], sequence b's keys being
    slots cache_leftpad[b] .. cache_seqlens[b] (cache_rows; a left-padded batch, a static
    cache), q padded; masks align bottom right in each sequence. v_cache (and v) may be of another
    head width than k_cache (DeepSeek's 192/128: out is v's width). k, v (new tokens, shaped like q with Hkv heads) are first
    written into the cache after each sequence's cache_seqlens keys (chunked prefill), and the
    queries attend to the cache plus them; the caller advances cache_seqlens, as with
    FlashAttention. q: [B, Hq, Nq, d], or [total_q, Hq, d] with cu_seqlens_q and max_seqlen_q.
    status: an int32 [1] device array the append and the kernel OR PAGE_OUT_OF_RANGE and
    SEQLEN_OVER_TABLE into (validate=False: what they skip, neither reading nor writing it).
    An FP8 cache (k_cache, v_cache float8_e4m3fn or float8_e5m2, q float16 or bfloat16; paged):
    read by the decode kernels with FlashAttention-3's k_descale and v_descale (float32, one number
    or [B, Hkv]; None is 1); new tokens k, v (float16 or bfloat16) go into it quantized with the
    same descales first (append_kv). q may be FP8 too (a torch tensor of the cache's type, with
    q_descale, as FlashAttention-3's FP8 calls): the kernels widen it exactly as it lands and read
    its descale beside k's, out bfloat16. New tokens of the cache's FP8 type are in its units
    already and go in as they are."""
    fp8_cache = _fp8(k_cache, "k_cache")  # (a dictionary lookup: the kept paged calls below are a few microseconds)
    kept = not validate and page_table is not None and k is None and v is None and cu_seqlens_q is None \
        and alibi_slopes is None and cache_leftpad is None \
        and (fp8_cache or q_descale is None and k_descale is None and v_descale is None)  # (else refused below)
    if kept:  # a loop's call: the last call's class first, which was made after the checks below
        options, descales = (causal, mask, softcap, scale, sinks), (q_descale, k_descale, v_descale) if fp8_cache else ()
        done = KEPT_PAGED_CALLS.again(q, k_cache, v_cache, cache_seqlens, page_table, status, out, return_lse, options,
                                      descales)
        if done is not NotImplemented:
            return done
    if fp8_cache and page_table is None:
        raise ValueError("k_cache, v_cache: an FP8 cache is read paged (page_table) yet: pass it as pages "
                         "[num_pages, page_size, Hkv, d] with a page_table")
    if not fp8_cache and (q_descale is not None or k_descale is not None or v_descale is not None):
        raise ValueError("q_descale, k_descale, v_descale: for an FP8 cache (float8_e4m3fn or float8_e5m2 k_cache "
                         "and v_cache); this one is a half type: drop them")
    fp8_query = fp8_cache and _fp8(q)  # (a half-type cache refuses an FP8 q by its dtype checks, off the hot path)
    if q_descale is not None and not fp8_query:
        raise ValueError(f"q_descale: q is {q.dtype}, which has no descale; pass k_descale and v_descale for the "
                         f"FP8 cache only")
    if (k is None) != (v is None):
        raise ValueError("k and v: pass both new tokens' keys and values, or neither")
    if page_table is None:
        if status is not None:
            raise ValueError("status: it flags a paged cache's bad page ids and over-long sequences; an unpaged cache "
                             "(page_table None) has neither: drop status")
        if k is not None or cu_seqlens_q is not None:
            raise ValueError("an unpaged cache (page_table None) takes neither new tokens k, v nor varlen q "
                             "(cu_seqlens_q) yet: write the new keys into the cache first, and pass q padded")
        keys, values = cache_rows(q, k_cache, v_cache, cache_seqlens, cache_leftpad, validate=validate)
        options = dict(causal=causal, mask=mask, softcap=softcap, scale=scale, alibi_slopes=alibi_slopes, sinks=sinks,
                       cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad)
        if no_work(tuple(q.shape), tuple(keys.shape)):
            return decode_attention(q, keys, values, return_lse=return_lse, **options)
        prepared = PreparedAttention(q, keys, values, **options)
        return prepared.once(q, keys, values, *prepared.ranges, out=out, return_lse=return_lse)
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad with a page_table: a paged sequence's keys start at its first page's slot 0; "
                         "pass cache_leftpad for an unpaged cache only")
    if kept and is_torch(q):
        done = KEPT_PAGED_CALLS(q, k_cache, v_cache, cache_seqlens, page_table, status, out, return_lse, options,
                                descales, tried=True)
        if done is not NotImplemented:
            return done
    append = None
    if k is not None:
        if status is None:  # the append's flags and the kernel's in one word
            status = zeros_like(as_device_tensor(q, "q"), (1,), "int32")
        append = _append(k_cache, v_cache, page_table, cache_seqlens, k, v, cu_seqlens_q, validate, status,
                         k_descale if fp8_cache else None, v_descale if fp8_cache else None)
        cache_seqlens = append.new_lengths
    # the whole call is checked before the append writes: the batch against the lengths after it
    # (the page table once), the kernel's spec
    batch = paged_batch(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q=cu_seqlens_q,
                        max_seqlen_q=max_seqlen_q, status=status, validate=validate)
    spec = batch_spec(batch, causal=causal, mask=mask, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    if append is not None:
        append.launch()
    out, lse = run(batch, spec, scale=scale, sinks=sinks, alibi_slopes=alibi_slopes, out=out, q_descale=q_descale,
                   k_descale=k_descale, v_descale=v_descale)
    return (out, lse) if return_lse else out


# A prepared paged call's index tensors, in its argument order after q, k_cache, v_cache: the
# kernel parameters a call re-points (flash_attn_with_kvcache's cache_seqlens and block_table)
PAGED_INDICES = ("cache_seqlens", "page_table")


def _read_in_place(tq: DeviceTensor, **indices) -> None:
    """A prepared call re-points its kernel at the index tensors a call passes: refuse ones of
    another framework than q's (packing would read a copy)."""
    for name, x in indices.items():
        kind = as_device_tensor(x, name).kind
        if kind != tq.kind:
            raise ValueError(f"{name}: a {kind} array with {tq.kind} q; a prepared call reads its index tensors "
                             f"in place: pass them as {tq.kind} tensors on q's device")


class PreparedKVCache(PreparedAttention):
    """attention_with_kvcache packed once for a decode loop over a paged cache: a call
    `step(q, k_cache, v_cache, cache_seqlens, page_table, out=None)` takes tensors of the
    prepared shapes, strides and dtypes (another layer's cache, a page table and lengths the
    engine rewrites in place each step) and launches with a few microseconds of host work, no
    host sync, capturable in a CUDA graph. The page table's values are checked here, once; a
    call trusts them as attention_with_kvcache(validate=False) does: the kernel loads zeros for
    a page id outside the cache and ORs a flag into `status`, and cuts a sequence longer than
    its table row to it. q is padded [B, Hq, Nq, d]; new tokens go into the cache before the
    call (append_kv). An FP8 cache's k_descale and v_descale are read at prepare time (a copy:
    prepare again for others), and q_descale where q is FP8 (of the cache's type: the kernel widens
    it as it lands); those `moving_descales` names (fagen's kept calls: float32 tensors on q's
    GPU) are read where they lie instead, and a call passes its own after the page table."""

    def __init__(self, q, k_cache, v_cache, cache_seqlens, page_table, *, causal: bool = False, mask=None,
                 softcap: float | None = None, scale: float | None = None, alibi_slopes=None, sinks=None,
                 status=None, splits: int | None = None, validate: bool = True, q_descale=None, k_descale=None,
                 v_descale=None, moving_descales: tuple[str, ...] = ()):
        tq = as_device_tensor(q, "q")
        if len(tq.shape) != 4:
            raise ValueError(f"q: shape {tq.shape}; a prepared paged call takes padded q [B, Hq, Nq, d] (varlen q: "
                             f"attention_with_kvcache with cu_seqlens_q, whose tile table follows its values each call)")
        _read_in_place(tq, cache_seqlens=cache_seqlens, page_table=page_table)
        self.status = zeros_like(tq, (1,), "int32") if status is None else status
        batch = paged_batch(q, k_cache, v_cache, page_table, cache_seqlens, status=self.status, validate=validate)
        spec = batch_spec(batch, causal=causal, mask=mask, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
        if 0 in tq.shape[:3]:  # (the cache's keys are the device's to count)
            raise ValueError(f"q: shape {tq.shape}, no query row to prepare (B, Hq and Nq must be >= 1); call "
                             f"attention_with_kvcache, which answers a call without query rows with no launch")
        descales, moved = fp8_inputs.prepared((q_descale, k_descale, v_descale), moving_descales)
        packed = pack(batch, spec, scale=scale, sinks=sinks, alibi_slopes=alibi_slopes, splits=splits,
                      indices=(*PAGED_INDICES, *moving_descales), **descales)
        self._arm(packed.spec, (q, k_cache, v_cache, cache_seqlens, page_table, *moved), packed.out, packed.lse,
                  packed.kernel, packed.merge, packed.held)


# A kept call's options, in the order the API functions pass them (a tuple: a loop's call builds no
# dictionary); the prepared call takes them by name
KEPT_OPTIONS = ("causal", "mask", "softcap", "scale", "sinks")


class KeptCalls:
    """Unvalidated calls of one API function (validate=False: a serving or training loop's form),
    PyTorch tensors: a prepared call kept a layout, so that a call that comes again launches
    through it (its C path: a few microseconds of host time where checking and packing take
    hundreds). The key is everything the packing read but the addresses (and the index tensors'
    values, which the kernels read): the tensors' shapes, strides, dtypes and devices, the
    `fixed` tensors' addresses and layouts (ones the launch holds, not re-pointed: a status word),
    the host `values` (max_seqlen_q, ...), the options (KEPT_OPTIONS' values), the sinks' address
    and version, the stream and the thread (a class's workspace is one call's at a time). At most
    LIMIT; then they start over. A subclass says how to prepare (`_make`)."""

    LIMIT = 64

    def __init__(self):
        self._kept: dict[tuple, PreparedAttention] = {}
        self._stream = self._capturing = None
        # the last call's options and fixed tensors (by identity), values, stream, thread and GPU,
        # and its class: a loop calls with them again, so the class's C path, which checks the
        # tensors' layouts itself, is tried before the whole key is built (~4 us of the call). One
        # tuple, set by one store: another thread's call never pairs its class with this one's options
        self._last: tuple | None = None  # (options, values, fixed, ..., thread), the class

    def _make(self, tensors: tuple, fixed: tuple, values: tuple, options: dict) -> PreparedAttention:
        raise NotImplementedError

    def last(self, tensors: tuple, fixed: tuple, values: tuple, out, return_lse: bool, options: tuple):
        """out of the call through the last call's class where its options, fixed tensors and
        values are this call's (that class's C path checks the tensors); else NotImplemented."""
        memo = self._last  # (set by `call` on torch tensors: a CuPy caller imports no torch here)
        hot = None if memo is None or out is not None or return_lse else memo[1]._hot
        if hot is not None:
            sinks = options[4]
            device = cupy.cuda.runtime.getDevice()
            last = memo[0]
            kept = last[0]
            # (a graph being captured: the C path keeps the class for its replays)
            if (kept[0] is options[0] and kept[1] is options[1] and kept[2] is options[2] and kept[3] is options[3]
                    and kept[4] is sinks and last[1] == values
                    and len(last[2]) == len(fixed) and all(map(operator.is_, last[2], fixed))
                    and (sinks is None or last[3] == sinks._version) and last[4] == device
                    and last[5] == self._stream(device) and last[6] == threading.get_ident()):
                return hot.run(*tensors, None)
        return NotImplemented

    def call(self, tensors: tuple, fixed: tuple, values: tuple, out, return_lse: bool, options: tuple,
             tried: bool = False, more: dict | None = None):
        """out (and lse) of the call, or NotImplemented where the general path must take it (or
        refuse it by name). tried: `last` has been tried with these arguments. more: options
        beyond KEPT_OPTIONS that the packing takes (what the key holds of them is in `values`)."""
        if not tried:
            done = self.last(tensors, fixed, values, out, return_lse, options)
            if done is not NotImplemented:
                return done
        mask, sinks = options[1], options[4]
        if out is not None:  # (a given out of another layout is the general path's to take)
            return NotImplemented
        if self._stream is None:  # (torch tensors here: the callers asked is_torch)
            import torch

            self._stream = torch_stream_handle()
            self._capturing = torch._C._cuda_isCurrentStreamCapturing
        try:
            device = tensors[0].get_device()
            # q's GPU the current one (the general path switches to it; a kept call refuses
            # another), contiguous GPU sinks (their address and version say which values), and
            # no graph being captured (a class made now would hold the capture's memory)
            if device < 0 or device != cupy.cuda.runtime.getDevice() or sinks is not None and not (
                    is_torch(sinks) and sinks.is_cuda and sinks.is_contiguous()) or self._capturing():
                return NotImplemented
            key = (tuple((t.shape, t.stride(), t.dtype, t.get_device()) for t in tensors), options[0],
                   mask if mask is None or isinstance(mask, str) else tuple(sorted(mask.items())),
                   options[2], options[3],
                   None if sinks is None else (sinks.data_ptr(), sinks._version, sinks.dtype, sinks.shape),
                   tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device())
                         for t in fixed), values, self._stream(device), threading.get_ident())
            prepared = self._kept.get(key)
        except (AttributeError, TypeError):  # not torch tensors, or a mask with unhashable parts
            return NotImplemented
        if prepared is None:
            try:
                prepared = self._make(tensors, fixed, values, {**dict(zip(KEPT_OPTIONS, options)), **(more or {})})
            except ValueError:  # the general path refuses it by name
                return NotImplemented
            if len(self._kept) >= self.LIMIT:
                self._kept.clear()
            self._kept[key] = prepared
        # (a mask given as a mapping may change in place: only None and names are remembered)
        self._last = ((options, values, fixed, None if sinks is None else sinks._version, device, key[-2], key[-1]),
                      prepared) if mask is None or isinstance(mask, str) else None
        return prepared(*tensors, return_lse=return_lse)


class KeptPagedCalls(KeptCalls):
    """attention_with_kvcache's paged calls with validate=False (padded q, no new tokens): a
    PreparedKVCache a layout, its status word fixed. An FP8 cache's moving descales
    (fp8_inputs.kept_form: float32 tensors on q's GPU) are re-pointed each call, after the page
    table; the others are in the key as values: a number as itself, a tensor by its address,
    layout and version (the prepared call keeps a copy of its values; a write to the tensor makes
    a new version, and a new class)."""

    def again(self, q, k_cache, v_cache, cache_seqlens, page_table, status, out, return_lse: bool, options: tuple,
              descales: tuple = ()):
        """The call through the last call's class (`last`), or NotImplemented. An FP8 cache's
        descale tensors are re-pointed (that class's C path checks them), its numbers compared."""
        values, tensors = fp8_inputs.re_pointed(descales, type(q))
        if values is None:  # a descale the class may hold a copy of: the key says
            return NotImplemented
        return self.last((q, k_cache, v_cache, cache_seqlens, page_table, *tensors), (status,), values, out,
                         return_lse, options)

    def __call__(self, q, k_cache, v_cache, cache_seqlens, page_table, status, out, return_lse: bool, options: tuple,
                 descales: tuple = (), tried: bool = False):
        """The call through its layout's class (made where new), or NotImplemented where the
        general path must take it. tried: `again` has been tried with these arguments."""
        if not tried:
            done = self.again(q, k_cache, v_cache, cache_seqlens, page_table, status, out, return_lse, options,
                              descales)
            if done is not NotImplemented:
                return done
        if not descales:  # (a half-type cache's calls: nothing more to key)
            return self.call((q, k_cache, v_cache, cache_seqlens, page_table), (status,), (), out, return_lse,
                             options, tried=True)
        values, tensors = fp8_inputs.re_pointed(descales, type(q))
        if any(x is not None and not np.isscalar(x) and not is_torch(x) for x in descales):
            return NotImplemented  # (a kept call's descales are numbers or torch tensors)
        try:
            moves, moved, key = fp8_inputs.kept_form(descales, q.get_device())
        except AttributeError:  # not a tensor: the general path says why
            return NotImplemented
        if values is None or len(moved) != len(tensors):  # a descale copied: keyed by its address and version
            values = key
        more = {**dict(zip(fp8_inputs.DESCALE_NAMES, descales)), "moving_descales": moves}
        return self.call((q, k_cache, v_cache, cache_seqlens, page_table, *moved), (status,), values, out,
                         return_lse, options, tried=True, more=more)

    def _make(self, tensors: tuple, fixed: tuple, values: tuple, options: dict) -> PreparedAttention:
        prepared = PreparedKVCache(*tensors[:5], status=fixed[0], validate=False, **options)
        # the copied descales' addresses are in the key: held, so that no other tensor takes them
        prepared._held.extend(options.get(name) for name in fp8_inputs.DESCALE_NAMES
                              if name not in options.get("moving_descales", ()))
        return prepared


KEPT_PAGED_CALLS = KeptPagedCalls()


# A prepared varlen call's index tensors, in its argument order after q, k, v (seqused_k where given)
VARLEN_INDICES = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k")


class PreparedVarlen(PreparedAttention):
    """attention_varlen packed once for a batch layout that comes again (a training loop's packed
    documents of a fixed token count, a server's repeated batch): a call `step(q, k, v,
    cu_seqlens_q, cu_seqlens_k[, seqused_k], out=None)` takes tensors of the prepared shapes
    (total_q, total_k and B as prepared), strides and dtypes, with any lengths that fit the
    prepared max_seqlen_q and max_seqlen_k, and launches with a few microseconds of host work, no
    host sync, capturable in a CUDA graph: the kernel's launch, which numbers the batch's tiles
    itself where they fit one wave (one_wave), else the query tile table's launch first (it
    follows cu_seqlens_q's values). validate=True checks the prepared cu_seqlens once;
    a call trusts its own as attention_varlen(validate=False) does."""

    def __init__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                 seqused_k=None, causal: bool = False, mask=None, softcap: float | None = None,
                 scale: float | None = None, alibi_slopes=None, sinks=None, validate: bool = True):
        if _fp8(q):  # (its launch reads V^T, made from each call's v)
            raise ValueError(f"q: {q.dtype}; a prepared varlen call takes float16 or bfloat16 tensors: call "
                             f"attention_varlen for FP8 q, k, v")
        batch = varlen_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
                             validate=validate)
        indices = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        if seqused_k is not None:
            indices["seqused_k"] = seqused_k
        _read_in_place(as_device_tensor(q, "q"), **indices)
        spec = batch_spec(batch, causal=causal, mask=mask, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
        if int(batch.arguments["total_q"]) == 0:
            raise ValueError("q: no query row to prepare (total_q 0); call attention_varlen, which answers a call "
                             "without query rows with no launch")
        packed = pack(batch, spec, scale=scale, sinks=sinks, alibi_slopes=alibi_slopes, indices=tuple(indices))
        self._arm(packed.spec, (q, k, v, *indices.values()), packed.out, packed.lse, packed.kernel, packed.merge,
                  packed.held, first=None if packed.first is None else (packed.first, (3,)))  # reads cu_seqlens_q


class KeptVarlenCalls(KeptCalls):
    """attention_varlen's calls with validate=False: a PreparedVarlen a layout and max_seqlen pair."""

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q: int, max_seqlen_k: int, out,
                 return_lse: bool, options: tuple):
        tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k) if seqused_k is None else \
            (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)
        values = (max_seqlen_q, max_seqlen_k)
        done = self.last(tensors, (), values, out, return_lse, options)  # (its C path refuses what is not torch's)
        if done is not NotImplemented or not is_torch(q) or _fp8(q):  # (FP8 q, k, v: the FP8 forward's, V^T made)
            return done
        return self.call(tensors, (), values, out, return_lse, options, tried=True)

    def _make(self, tensors: tuple, fixed: tuple, values: tuple, options: dict) -> PreparedAttention:
        return PreparedVarlen(*tensors[:5], *values, seqused_k=tensors[5] if len(tensors) > 5 else None,
                              validate=False, **options)


KEPT_VARLEN_CALLS = KeptVarlenCalls()


def prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                   **kwargs) -> PreparedVarlen:
    """attention_varlen's launches for these tensors' shapes, packed once (PreparedVarlen)."""
    return PreparedVarlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


def prepare_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, **kwargs) -> PreparedKVCache:
    """attention_with_kvcache's launches for these tensors' shapes, packed once (PreparedKVCache)."""
    return PreparedKVCache(q, k_cache, v_cache, cache_seqlens, page_table, **kwargs)


def append_kv(k_cache, v_cache, page_table, cache_seqlens, k, v, *, cu_seqlens_q=None, validate: bool = True,
              status=None, k_descale=None, v_descale=None):
    """Write new tokens' k, v ([B, Hkv, N, d], or [total, Hkv, d] with cu_seqlens_q; v's d is
    v_cache's, which may differ from k's: head_dim_v) into the paged
    cache after each sequence's cache_seqlens keys, by one launch on the cache's stream; returns the
    new lengths (cache_seqlens + N). validate=True checks the values first (a host sync): the
    lengths (>= 0 before, within the table after), cu_seqlens_q against k's rows, and the pages the
    new lengths use; a refused call writes nothing. Unchecked, a token is still only written to the
    page its own table entry names, and only where that is a page of the cache: a token past its
    table row, or whose page id is outside the cache, is dropped, and flagged in `status` (int32
    [1]) as the attention kernels flag what they skip (SEQLEN_OVER_TABLE, PAGE_OUT_OF_RANGE): the
    other pages hold other sequences' keys. An FP8 cache (float8_e4m3fn or float8_e5m2) takes
    float16 or bfloat16 k and v, quantized on the way in: k / k_descale and v / v_descale rounded to
    nearest even and saturated (FlashAttention-3's descales, float32, one number or [B, Hkv]: the
    cache's own, which its readers pass too); new tokens of the cache's own FP8 type are in its units
    already and go in as they are."""
    append = _append(k_cache, v_cache, page_table, cache_seqlens, k, v, cu_seqlens_q, validate, status, k_descale,
                     v_descale)
    if validate:
        check_pages(_host(append.table), _host(append.new_lengths), append.num_pages, append.page_size)
    append.launch()
    return append.new_lengths if not hasattr(cache_seqlens, "to") else _torch_like(append.new_lengths, cache_seqlens)


@dataclass(frozen=True)
class Append:
    """A checked append, not launched yet: the lengths after it (a device array, computed on the
    cache's stream), the table and cache geometry check_pages reads, and the launch."""
    new_lengths: object
    table: object
    num_pages: int
    page_size: int
    launch: Callable[[], None]


def _append(k_cache, v_cache, page_table, cache_seqlens, k, v, cu_seqlens_q, validate: bool, status, k_descale=None,
            v_descale=None) -> Append:
    """append_kv's checks of everything but the pages (the caller's to check against the new
    lengths, once: append_kv, or attention_with_kvcache's paged_batch) and its launch, unlaunched."""
    if _fp8(k) or _fp8(v):  # FP8 tokens are in the cache's units already: in exactly (bfloat16 over a descale of 1)
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
            raise ValueError(f"k, v: {k.dtype} and {v.dtype} new tokens into a {k_cache.dtype} cache; FP8 new "
                             f"tokens are of the cache's type (in its units), or float16 / bfloat16 (quantized "
                             f"with k_descale and v_descale on the way in): pass k.to({k_cache.dtype})")
        k, v, k_descale, v_descale = fp8_inputs.widened(k), fp8_inputs.widened(v), 1.0, 1.0
    tk, tv = as_device_tensor(k, "k"), as_device_tensor(v, "v")
    tkc, tvc = as_device_tensor(k_cache, "k_cache"), as_device_tensor(v_cache, "v_cache")
    if tv.shape[:-1] != tk.shape[:-1]:
        raise ValueError(f"k {tk.shape} and v {tv.shape}: new keys and values need one shape but the head width")
    for t, name in ((tkc, "k_cache"), (tvc, "v_cache")):
        if len(t.shape) != 4:
            raise ValueError(f"{name}: shape {t.shape}; expected [num_pages, page_size, Hkv, d]")
        _check_layout(t, name)
    if tkc.shape[:3] != tvc.shape[:3] or tkc.dtype != tvc.dtype:
        raise ValueError(f"k_cache {tkc.dtype} {tkc.shape} and v_cache {tvc.dtype} {tvc.shape} must have the same "
                         f"dtype and [num_pages, page_size, Hkv]")
    num_pages, page_size, hkv, d = tkc.shape
    d_v = tvc.shape[3]  # V's head width (head_dim_v where it differs from K's)
    check_page_size(page_size)
    device = tkc.device
    table = _index_array(page_table, "page_table", device, ("B", "max_pages"))
    seqlens = _index_array(cache_seqlens, "cache_seqlens", device, ("B",))
    b = table.shape[0]
    if seqlens.shape[0] != b or table.shape[1] < 1:
        raise ValueError(f"page_table {tuple(table.shape)} and cache_seqlens {tuple(seqlens.shape)}: [B, max_pages >= 1] "
                         f"and [B], one row a sequence")
    varlen = cu_seqlens_q is not None
    layout = "[total, Hkv, d] with cu_seqlens_q" if varlen else f"[B = {b}, Hkv, N, d]"
    if len(tk.shape) != (3 if varlen else 4) or (not varlen and tk.shape[0] != b) or tk.shape[1] != hkv \
            or tk.shape[-1] != d:
        raise ValueError(f"k: shape {tk.shape}; expected {layout} with the cache's Hkv = {hkv} and d = {d}"
                         + ("" if varlen else " (or token-major [total, Hkv, d] with cu_seqlens_q)"))
    if tv.shape[-1] != d_v:
        raise ValueError(f"v: shape {tv.shape}; its rows are v_cache's, {d_v} wide")
    fp8 = fp8_element(tkc.dtype)
    for t, name in ((tk, "k"), (tv, "v")):
        if t.device != device:
            raise ValueError(f"{name} is on cuda:{t.device}, but the cache on cuda:{device}: move it there")
        if fp8 is None and t.dtype != tkc.dtype:
            raise ValueError(f"{name}: {t.dtype}, but the cache holds {tkc.dtype}; cast it ({name}.to(k_cache.dtype) / "
                             f".astype)")
        if fp8 is not None and t.dtype not in KERNEL_TYPES:
            raise ValueError(f"{name}: {t.dtype} into a {tkc.dtype} cache; pass float16 or bfloat16 new tokens: the "
                             f"append quantizes them ({name} / {name}_descale)")
    if fp8 is not None and tk.dtype != tv.dtype:
        raise ValueError(f"k: {tk.dtype}, v: {tv.dtype}; new keys and values are quantized by one kernel: pass both in "
                         f"one type (v.to(k.dtype))")
    if fp8 is not None and d_v != d:  # (nothing would read it: the FP8 cache's kernels widen one width)
        raise ValueError(f"v_cache: head width {d_v} beside k_cache's {d} in a {tkc.dtype} cache; an FP8 cache holds "
                         f"K and V of one width: keep a cache of two widths in {tk.dtype}")
    if fp8 is None and (k_descale is not None or v_descale is not None):
        raise ValueError(f"k_descale, v_descale: for an FP8 cache (float8_e4m3fn or float8_e5m2); this one holds "
                         f"{tkc.dtype}: drop them")
    if fp8 is not None and (k_descale is None or v_descale is None):
        raise ValueError(f"k_descale, v_descale: a {tkc.dtype} cache stores k / k_descale and v / v_descale; pass the "
                         f"cache's descales (float32, one number or [B, Hkv]) so that new tokens share its scale")
    if fp8 is not None and int(cupy.cuda.Device(device).compute_capability) < 89:
        raise ValueError(f"k_cache: {tkc.dtype} on sm_{cupy.cuda.Device(device).compute_capability}: rounding to FP8 "
                         f"(cvt ... e4m3x2) needs sm_89 or later")
    item, cache_item = _item_bytes(tk), _item_bytes(tkc)  # a new row's element bytes, a cache row's
    for width, name in ((d, "k_cache"), (d_v, "v_cache")):
        if width * item % 16 or width * cache_item % 8:
            raise ValueError(f"{name}: head_dim {width} of {tkc.dtype}: rows are copied 16 bytes at a time; use a "
                             f"head_dim that is a multiple of {16 // min(item, 2 * cache_item)}")
    with cupy.cuda.Device(device), stream_for(tkc):
        if varlen:
            cu = _index_array(cu_seqlens_q, "cu_seqlens_q", device, ("B + 1",))
            if cu.shape[0] != b + 1:
                raise ValueError(f"cu_seqlens_q {tuple(cu.shape)}: [B + 1] with B = {b} (page_table's rows)")
            if validate:  # the rows the new tokens are read from
                check_cu_seqlens(_host(cu), tk.shape[0], None, "q", tensor="k")
            new_lengths = seqlens + (cu[1:] - cu[:-1])
            tokens, per_sequence = tk.shape[0], 0
        else:
            cu, new_lengths = None, seqlens + tk.shape[2]
            tokens, per_sequence = b * tk.shape[2], tk.shape[2]
        new_lengths = new_lengths.astype(cupy.int32, copy=False)
        if validate:  # where the new tokens go (the pages they land in: the caller's check_pages); this
            check_cached_lengths(_host(seqlens))  # read waits on the cache's stream: new_lengths are there
        st = None if status is None else _index_array(status, "status", device, ("1",))
        descales = None
        if fp8 is not None:  # k's and v's, each read where it lies (fp8_inputs.descale_views)
            descales = fp8_inputs.descale_views(None, k_descale, v_descale, b, hkv, tk.obj,
                                                names=("k_descale", "v_descale"))

    def launch() -> None:
        if not tokens:
            return
        with cupy.cuda.Device(device), stream_for(tkc):
            new = [_aligned(x, t, item) for x, t in ((k, tk), (v, tv))]
            strides = []
            for t in new:  # the new rows' byte strides: between sequences (varlen: none), tokens, heads
                sb, sn, sh = (0, t.strides[0], t.strides[1]) if varlen else (t.strides[0], t.strides[2], t.strides[1])
                strides += [sb * item, sn * item, sh * item]
            for t in (tkc, tvc):  # the cache's: between pages, slots, heads
                strides += [s * cache_item for s in t.strides[:3]]
            quantized = ()
            name = append_kv_name()
            if descales is not None:  # k's, then v's: address and (sequence, head) strides, the kernel's order
                quantized = tuple(descale_parameters(descales).values())
                name = append_kv_name(tk.dtype, fp8.name)
            shared_function(name, device)((tokens,), (APPEND_KV_THREADS,), (
                *(np.uint64(t.ptr) for t in (*new, tkc, tvc)), *(np.int64(s) for s in strides),
                np.uint64(0 if cu is None else cu.data.ptr), np.int32(b), np.int32(per_sequence),
                np.uint64(seqlens.data.ptr), np.uint64(table.data.ptr), np.int64(table.shape[1]),
                np.int32(table.shape[1]), np.int32(page_size), np.int32(num_pages), np.int32(hkv),
                np.int32(d * item // 16), np.int32(d_v * item // 16), np.uint64(0 if st is None else st.data.ptr),
                *quantized))
            del new  # a copy made for alignment is freed only after the launch is enqueued

    return Append(new_lengths, table, num_pages, page_size, launch)


def _item_bytes(t: DeviceTensor) -> int:
    return t.obj.element_size() if t.kind == "torch" else t.obj.dtype.itemsize


def _rows_aligned(t: DeviceTensor, item: int) -> bool:
    """Every row of `t` starts on a 16-byte boundary, its last dim contiguous: the append kernel's
    16-byte loads."""
    return t.strides[-1] == 1 and t.ptr % 16 == 0 and all(s * item % 16 == 0 for s in t.strides[:-1])


def _aligned(x, t: DeviceTensor, item: int) -> DeviceTensor:
    """New rows as the append kernel reads them: `t` itself where its rows are aligned, else a
    copy in a fresh allocation (256-byte aligned). Not x.contiguous(): that is x itself when x is
    contiguous, at whatever address."""
    if _rows_aligned(t, item):
        return t
    if t.kind == "torch":
        import torch

        copy = x.clone(memory_format=torch.contiguous_format)
    else:
        copy = cupy.array(x, copy=True, order="C")
    aligned = as_device_tensor(copy, "k")
    assert _rows_aligned(aligned, item), f"a fresh allocation at {aligned.ptr:#x}, strides {aligned.strides}"
    return aligned


def _torch_like(x, like):
    import torch

    return torch.as_tensor(x, device=like.device).to(torch.int32)


def from_flashinfer(kv_indptr, kv_indices, kv_last_page_len, page_size: int, max_pages: int | None = None):
    """FlashInfer's CSR page layout as (page_table [B, max_pages], cache_seqlens [B]), int32 on
    the same device: sequence b's pages are kv_indices[kv_indptr[b] : kv_indptr[b + 1]], its last
    page holding kv_last_page_len[b] keys. Reads the indptr back to size the table (a host sync)."""
    indptr, indices, last = (cupy.asarray(x) for x in (kv_indptr, kv_indices, kv_last_page_len))
    host_ptr = cupy.asnumpy(indptr)
    counts = np.diff(host_ptr)
    if (counts < 0).any() or host_ptr[0] != 0:
        raise ValueError("kv_indptr must start at 0 and be non-decreasing (FlashInfer's CSR form)")
    width = int(counts.max(initial=1)) if max_pages is None else max_pages
    if counts.size and counts.max() > width:
        raise ValueError(f"max_pages = {width}: sequence {int(np.argmax(counts))} has {counts.max()} pages")
    b = counts.size
    table = cupy.zeros((b, max(width, 1)), cupy.int32)
    seq = np.repeat(np.arange(b), counts)
    col = np.arange(host_ptr[-1]) - host_ptr[:-1][seq]
    table[cupy.asarray(seq), cupy.asarray(col)] = indices[:host_ptr[-1]].astype(cupy.int32)
    seqlens = cupy.where(cupy.asarray(counts) > 0, (cupy.asarray(counts) - 1) * page_size + last, 0).astype(cupy.int32)
    return table, seqlens


__all__ = ["PAGE_OUT_OF_RANGE", "SEQLEN_OVER_TABLE", "Batch", "append_kv", "attention_varlen", "attention_with_kvcache", "check_cu_seqlens",
           "check_pages", "from_flashinfer", "paged_batch", "run", "varlen_batch"]
