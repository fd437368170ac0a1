"""Which kernel a call runs, chosen from its tensors' shapes and its options alone: the family
(the plain forward, the GQA-packed decode kernel, split-KV with the merge in the kernel or after
it), the spec (the shipped defaults by dtype, head_dim, GPU and shape class; the variants its
mask and modifiers derive; a batch's layouts) and the split count. A decode step's split count
reads its kernel's tiles and occupancy off the compiled kernel (compiled once a process; a
repeated call finds it by its spec): the occupancy is ptxas' register count's, which the plan's
register estimate (a spill bound) misses by 20 where no spill is near, enough to misjudge the
blocks an SM holds.

The public entry points (fagen.api) ask this module, then launch through fagen.runtime.
"""

from __future__ import annotations

import math
from functools import lru_cache

from fagen import device, side_inputs, variants
from fagen.device import DeviceTensor, as_device_tensor
from fagen.element_types import KERNEL_TYPES, fp8_element
from fagen.mask_kinds import fields_of
from fagen.runtime import Kernel, compile_kernel
from fagen.spec import FP8_KV_HEAD_DIMS, HEAD_DIMS, QK_HEAD_DIMS, AttentionSpec, Mask, ScoreMod, SpecError


def default_spec(dtype: str, head_dim: int, causal: bool, partial: bool = False, keys: int | None = None) -> AttentionSpec:
    """The shipped spec fagen.attention runs for these inputs on this GPU (fagen.variants), for
    `keys` keys a sequence where known (long sequences may have a spec of their own)."""
    return variants.shipped_spec(dtype, head_dim, causal, gpu=device.gpu_slug(), partial=partial, keys=keys)


def derive_spec(q, *, causal: bool = False, mask=None, softcap: float | None = None, block_mask=None, bias=None,
                alibi_slopes=None, sinks=None, doc_ids=None, keys: int | None = None, v=None,
                score_expression: tuple[str, str, int] | None = None, ranged: bool = False) -> AttentionSpec:
    """The spec fagen.attention runs for these arguments: the shipped spec for q's dtype (an FP8
    q against FP8 v: cache_query_dtype's) and head_dim on this GPU (and `keys`, k's length, where given), with the mask and score
    modifiers they ask for (fagen.variants), and V's width where `v` is given and differs.
    score_expression: (score_mod.expression, score_mod.expression_grad, score_mod.captured), a
    traced score_mod's (fagen.flex). ranged: the call has key ranges (cache_seqlens, cache_leftpad:
    an FP8 q's then the cache's kernels wherever they take its rows, fp8_on_cache_kernels)."""
    tq = as_device_tensor(q, "q")
    if len(tq.shape) != 4:
        raise ValueError(f"q: rank {len(tq.shape)}, shape {tq.shape}; expected [B, H, N, d]")
    v_shape = getattr(v, "shape", ())
    head_dim_v = int(v_shape[-1]) if len(v_shape) == 4 and v_shape[-1] != tq.shape[-1] else None
    dtype = tq.dtype
    if v is not None and fp8_element(dtype) is not None:  # an FP8 q: a decode step's on an FP8 cache, or refused
        dtype = _fp8_query_dtype(tq, as_device_tensor(v, "v"), causal=causal, mask=mask, softcap=softcap,
                                   block_mask=block_mask, bias=bias, alibi_slopes=alibi_slopes, sinks=sinks,
                                   doc_ids=doc_ids, ranged=ranged)
    return derive_spec_for(dtype, tq.shape[-1], causal=causal, mask=mask, softcap=softcap, block_mask=block_mask,
                           bias=bias, alibi_slopes=alibi_slopes, sinks=sinks, doc_ids=doc_ids, keys=keys,
                           head_dim_v=head_dim_v, score_expression=score_expression)


# The half type an FP8 KV cache's kernels are derived for where q is FP8 too (they widen it as it
# lands, spec.q_dtype): FlashAttention-3's FP8 calls write bfloat16
CACHE_QUERY_HALF_TYPE = "bfloat16"


def cache_query_dtype(q_dtype: str, kv_dtype: str) -> str:
    """The dtype a call on an FP8 KV cache derives its plain spec for: q's, or
    CACHE_QUERY_HALF_TYPE for an FP8 q of the cache's type (the cache's kernels then read q as it
    lies and widen it: packed_spec, batch_spec); an FP8 q of another FP8 type is refused by name."""
    q8, kv8 = fp8_element(q_dtype), fp8_element(kv_dtype)
    if q8 is None or kv8 is None:
        return q_dtype
    if q8 != kv8:
        raise ValueError(f"q: {q_dtype} against a {kv_dtype} cache; the cache's kernels widen an FP8 q of the "
                         f"cache's own type: pass q as {kv_dtype}, or in bfloat16 with its descale applied (and no "
                         f"q_descale)")
    return CACHE_QUERY_HALF_TYPE


def _fp8_query_dtype(tq: DeviceTensor, tv: DeviceTensor, **options) -> str:
    """The dtype derive_spec derives for an FP8 q beside v: CACHE_QUERY_HALF_TYPE where the FP8
    cache's kernels take the call (fp8_on_cache_kernels); q's own where v is not FP8
    (_derived_spec refuses it by name); else refused: FP8 q, k, v of other shapes are the FP8
    forward's, which fagen.attention runs and which is not prepared or packed here."""
    if fp8_element(tv.dtype) is None:
        return tq.dtype
    cache_query_dtype(tq.dtype, tv.dtype)  # (refuses an FP8 q of another type than the cache's)
    if fp8_on_cache_kernels(tuple(tq.shape), tuple(tv.shape), tuple(tv.shape), fp8_element(tv.dtype).name,
                            gpu=tq.device, **options):
        return CACHE_QUERY_HALF_TYPE
    raise ValueError(f"q: {tq.dtype} {tq.shape}: FP8 q, k and v run the FP8 forward (fagen.attention), but for a "
                     f"KV head's few query rows (a decode step's, up to "
                     f"{max(max(r) for r in variants.DECODE_HEAD_DIMS.values())}, or more where the forward would fill "
                     f"little of the GPU; no bias, documents or block mask), which run on the FP8 cache's kernels; this "
                     f"call is not one: call fagen.attention, which runs the FP8 forward unprepared")


def bias_kind(bias) -> str:
    """ScoreMod.bias for a bias array (or None): a [B|1, H|1, Nk] vector a row, else a matrix."""
    return "none" if bias is None else ("vector" if len(getattr(bias, "shape", ())) == 3 else "matrix")


def derive_spec_for(dtype: str, head_dim: int, *, causal: bool = False, mask=None, softcap: float | None = None,
                    block_mask=None, bias=None, alibi_slopes=None, sinks=None, doc_ids=None,
                    keys: int | None = None, head_dim_v: int | None = None,
                    score_expression: tuple[str, str, int] | None = None) -> AttentionSpec:
    """derive_spec for a dtype and head_dim (the arrays only say which side inputs are given)."""
    if isinstance(mask, str):
        mask = _named_mask(mask)
    elif mask is not None and not isinstance(mask, Mask):  # a Mask keys the cache as it is
        mask = _mask_of(mask)
    block_tiles = (block_mask.q_block, block_mask.kv_block) if hasattr(block_mask, "kv_block") else None
    return _derived_spec(dtype, head_dim, causal, mask, softcap, block_mask is not None, doc_ids is not None,
                         bias_kind(bias), alibi_slopes is not None, sinks is not None, keys, device.gpu_slug(), head_dim_v,
                         None if score_expression is None else tuple(score_expression), block_tiles)


@lru_cache(maxsize=64)
def _named_mask(kind: str) -> Mask:
    """mask='causal': validated once."""
    return _mask_of(kind)


def _mask_of(given) -> Mask:
    """A Mask from fagen.attention's mask=, refused as the oracle refuses it (naming the argument,
    mask=5 or a bad field), not with pydantic's report."""
    try:
        return Mask.model_validate({"kind": given} if isinstance(given, str) else given)
    except ValueError:
        fields_of(given)  # raises the shared rule's message
        raise


def call_mask(causal: bool, mask) -> Mask:
    """fagen.attention's causal= and mask= (a Mask, or its mapping) as one Mask."""
    if mask is None:
        return Mask(kind="causal" if causal else "none")
    mask = mask if isinstance(mask, Mask) else Mask.model_validate(mask)
    if causal and mask.kind != "causal":
        raise ValueError(f"causal=True and mask kind {mask.kind!r}: pick one (chunked, prefix_lm and "
                         f"document masks have their own causal structure)")
    return mask


def kernel_mask(causal: bool, mask: Mask | None, has_block_mask: bool, has_doc_ids: bool) -> Mask:
    """The mask a call's arguments ask for: mask= (with causal=), else a block_mask's or
    doc_ids' kind, else causal or none; refused where its kind's array is not given, before a
    variant is compiled for it."""
    if mask is not None:
        mask = call_mask(causal, mask)
    elif has_block_mask:
        if causal:
            raise ValueError("causal=True with a block_mask: build the causal structure into the mask "
                             "(fagen.masks.causal, or a predicate with kv_idx <= q_idx)")
        mask = Mask(kind="block_mask")
    elif has_doc_ids:
        mask = Mask(kind="document", causal=causal)
    else:
        mask = call_mask(causal, None)
    side_inputs.require_mask_inputs(mask.kind, has_block_mask=has_block_mask, has_doc_ids=has_doc_ids)
    return mask


@lru_cache(maxsize=512)  # a call's spec is a function of these: a repeated call derives and validates nothing
def _derived_spec(dtype: str, head_dim: int, causal: bool, mask, softcap: float | None, has_block_mask: bool,
                  has_doc_ids: bool, bias_kind: str, has_alibi_slopes: bool, has_sinks: bool, keys: int | None,
                  gpu: str, head_dim_v: int | None = None,
                  score_expression: tuple[str, str, int] | None = None,
                  block_tiles: tuple[int, int] | None = None) -> AttentionSpec:
    if dtype not in KERNEL_TYPES:
        raise ValueError(f"q: dtype {dtype}; fagen.attention takes {' or '.join(KERNEL_TYPES)}")
    if head_dim in QK_HEAD_DIMS and head_dim_v is None:
        raise ValueError(f"q: head_dim {head_dim} is a Q.K^T width that comes with a narrower v (DeepSeek's "
                         f"192/128); pass v of head_dim 128, or pad q, k and v to 256")
    mask = kernel_mask(causal, mask, has_block_mask, has_doc_ids)
    expression, expression_grad, captured = score_expression or (None, None, 0)
    score_mod = ScoreMod(softcap=softcap, alibi="slopes" if has_alibi_slopes else "none", bias=bias_kind,
                         sinks=has_sinks, captured=captured, expression=expression, expression_grad=expression_grad)
    # a Q.K^T width with no default of its own starts from the next wider head's
    shipped_dim = next((d for d in HEAD_DIMS if d >= head_dim), head_dim) if head_dim in QK_HEAD_DIMS else head_dim
    derived = variants.modified_spec(dtype, shipped_dim, mask.kind == "causal", mask, score_mod, gpu=gpu, keys=keys)
    if block_tiles is not None and head_dim_v is None:  # a block mask's blocks (q_block, kv_block)
        derived = variants.block_aligned(derived, mask, score_mod, block_tiles, gpu=gpu)
    if head_dim_v is None:
        return derived
    try:  # V and O of their own width (spec.head_dim_v): the forward over padded tensors
        return variants.value_head_variant(derived, head_dim_v, head_dim)
    except SpecError as refused:
        raise ValueError(f"v: head_dim {head_dim_v} beside q's and k's {head_dim}: {refused}") from None


def sequence_keys(k) -> int | None:
    """k's keys a sequence ([B, H, N, d]), for the shape class; None for anything else (the call
    refuses it with its own message)."""
    shape = getattr(k, "shape", ())
    return int(shape[2]) if len(shape) == 4 else None


def no_work(q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> bool:
    """Whether q [B, Hq, Nq, d] against k [B, Hkv, Nk, d] computes nothing: no query row, or no
    key for the rows to see. Such a call launches nothing (answer_without_work): a grid needs a
    block, and the decode planner a block and a tile to split."""
    return min(*q_shape[:3], k_shape[2]) == 0


def packed_spec(plain: AttentionSpec, q, k) -> AttentionSpec | None:
    """The decode kernel for the plain spec `plain` (derive_spec's) on these q and k, or None."""
    tq, tk = as_device_tensor(q, "q"), as_device_tensor(k, "k")
    if len(tk.shape) != 4 or tk.shape[1] == 0 or tq.shape[1] % tk.shape[1]:
        return None  # the kernel's own checks say what is wrong
    rows = tq.shape[2] * (tq.shape[1] // tk.shape[1])
    kv = fp8_element(tk.dtype)
    if kv is None or plain.element.is_fp8:
        return variants.decode_spec(plain.dtype, plain.head_dim, rows, plain.mask, plain.score_mod, plain.head_dim_v)
    if plain.dv != plain.head_dim:
        return None  # an FP8 cache's kernels widen one width (the caller refuses: fp8_kv_refusal)
    query = fp8_element(tq.dtype)
    return fp8_kv_spec(plain, rows, kv.name, None if query is None else query.name)


def fp8_kv_spec(plain: AttentionSpec, rows: int, kv_dtype: str, q_dtype: str | None = None) -> AttentionSpec | None:
    """The kernel a half-type q runs against an FP8 KV cache (the decode kernel widening its K
    and V, variants.fp8_kv_variant) for `rows` packed query rows a KV head, or None (a head width
    or mask they do not take: the caller refuses, fp8_kv_refusal). No other kernel reads an FP8 cache, so more rows
    than the largest decode kernel holds (a chunk of prefill) take its chunk variant over several
    row tiles (variants.fp8_kv_chunk_variant). q_dtype: an FP8 q the kernel widens as it lands
    (plain then CACHE_QUERY_HALF_TYPE's)."""
    return _fp8_kv_kernel(plain.dtype, plain.head_dim, plain.mask, plain.score_mod, rows, kv_dtype, q_dtype)


def _fp8_kv_kernel(dtype: str, head_dim: int, mask: Mask, score_mod: ScoreMod, rows: int, kv_dtype: str,
                   q_dtype: str | None = None) -> AttentionSpec | None:
    largest = max(variants.DECODE_HEAD_DIMS.get(head_dim, (rows,)))
    spec = variants.decode_spec(dtype, head_dim, min(rows, largest), mask, score_mod)
    if spec is None:
        return None
    try:
        if rows > largest:  # a chunk of prefill: prefill-shaped row tiles where they fit
            return variants.fp8_kv_chunk_variant(spec, kv_dtype, q_dtype)
        return variants.fp8_kv_variant(spec, kv_dtype, q_dtype=q_dtype)
    except SpecError:
        return None


def fp8_on_cache_kernels(q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...], kv_dtype: str, *,
                      causal: bool = False, mask=None, softcap: float | None = None, sinks=None, alibi_slopes=None,
                      bias=None, doc_ids=None, block_mask=None, ranged: bool = False, gpu: int | None = None) -> bool:
    """Whether FP8 q, k, v ([B, H, N, d]) run as an FP8 KV cache's: q against k and v in the
    kernels that pack a KV head's query rows (GQA) and split its keys, which widen q as it lands
    (spec.q_dtype), q_descale read beside k's. True where a decode kernel holds the call's rows
    and takes its options (key ranges too: `ranged`); and for more rows (a few dozen to a hundred
    queries a head: speculative decoding, a short chunk) where the cache's chunk kernels take them
    and the FP8 forward would fill little of GPU `gpu` (fp8_forward_fill; the current GPU where
    None; no GPU to read: the forward), without key ranges (the forward refuses those by name at
    every fill: the chunks have not been run with them and an FP8 q). Which kernel runs thus
    depends on the batch's size and the GPU: the results of one sequence may differ by FP8's
    rounding between batch sizes. Side inputs the cache's kernels lack
    (a bias, documents, a block mask) keep the FP8 forward. (Asked on every FP8 call: remembered.)"""
    if bias is not None or doc_ids is not None or block_mask is not None:
        return False
    if not (len(q_shape) == len(k_shape) == len(v_shape) == 4) or k_shape[1] == 0 or q_shape[1] % k_shape[1]:
        return False
    if softcap is not None and not isinstance(softcap, (int, float)):
        return False  # (the FP8 forward's checks refuse it by name)
    if isinstance(mask, str):
        mask = _named_mask(mask)
    elif mask is not None and not isinstance(mask, Mask):
        mask = _mask_of(mask)
    head_dim, rows = q_shape[-1], q_shape[2] * (q_shape[1] // k_shape[1])
    if rows > max(variants.DECODE_HEAD_DIMS.get(head_dim, (0,))):
        if ranged:
            return False  # (refused by the forward's checks, whatever the fill)
        sms = _sms(gpu)
        if sms is None or not _chunks_beat_the_forward(q_shape, kv_dtype, causal, mask, softcap, sinks is not None,
                                                       alibi_slopes is not None, sms):
            return False  # (no GPU to fill: the forward's checks speak)
    return _fp8_cache_kernels_take(q_shape[1:], k_shape[1], v_shape[-1], kv_dtype, causal, mask, softcap,
                              sinks is not None, alibi_slopes is not None)


def _sms(gpu: int | None) -> int | None:
    """GPU `gpu`'s SMs (the current GPU's where None), or None where no GPU can be read."""
    if device.cupy is None:
        return None
    try:
        return device.multiprocessors(device.current_device() if gpu is None else gpu)
    except Exception:  # noqa: BLE001 - CuPy without a driver or device: no GPU to fill
        return None


@lru_cache(maxsize=256)
def _fp8_cache_kernels_take(q_shape: tuple[int, ...], hkv: int, head_dim_v: int, kv_dtype: str, causal: bool,
                       mask: Mask | None, softcap: float | None, sinks: bool, alibi: bool) -> bool:
    """(No GPU read: a decode kernel's spec is the same on every GPU, and a call's refusals come first.)"""
    head_dim, rows = q_shape[-1], q_shape[1] * (q_shape[0] // hkv)
    if head_dim_v != head_dim or rows < 1:
        return False
    score_mod = ScoreMod(softcap=softcap, sinks=sinks, alibi="slopes" if alibi else "none")
    return _fp8_kv_kernel(CACHE_QUERY_HALF_TYPE, head_dim, kernel_mask(causal, mask, False, False), score_mod, rows,
                          kv_dtype, kv_dtype) is not None


# FP8 q, k, v with more query rows a KV head than a decode kernel holds: the FP8 forward tiles each
# head's rows alone (128 a tile) and splits no keys, so a few rows a head leave most of its tiles'
# rows and of the GPU's SMs idle; the cache's chunk kernels pack a KV group's rows into 128-row
# tiles and split the keys, on mma.sync at about a third of the forward's wgmma peak. H200, d128,
# Hq 32 / Hkv 8, causal, GPU time (notes/perf.md, 2026-12-01): the chunks 1.3-4.5x faster where the
# forward's fill (its tiles' rows used x the share of SMs its blocks occupy) is 0.24 or less, the
# forward 1.1-2.5x faster where it is 0.48 or more (BENCHMARKS.md's prefill rows: the chunks run
# 270-305 TFLOP/s, the forward 800-940). Head widths the forward lacks (64) take the chunks.
CHUNKS_BELOW_FORWARD_FILL = 0.35


def fp8_forward_fill(b: int, hq: int, nq: int, block_q: int, sms: int) -> float:
    """The share of the GPU the FP8 forward's grid fills: its tiles' rows that hold a query row,
    times the SMs its B x Hq x tiles blocks occupy (up to one wave)."""
    tiles = -(-nq // block_q)
    return nq / (tiles * block_q) * min(1.0, b * hq * tiles / sms)


@lru_cache(maxsize=256)
def _chunks_beat_the_forward(q_shape: tuple[int, ...], kv_dtype: str, causal: bool, mask: Mask | None,
                             softcap: float | None, sinks: bool, alibi: bool, sms: int) -> bool:
    """Whether FP8 q, k, v with more rows a KV head than a decode kernel holds take the FP8 cache's
    chunk kernels (CHUNKS_BELOW_FORWARD_FILL), where there are chunk kernels of their head width."""
    b, hq, nq, head_dim = q_shape
    if head_dim not in variants.FP8_KV_CHUNK_TILINGS:
        return False
    try:
        forward = fp8_forward_spec(kv_dtype, head_dim, causal, mask, softcap=softcap, sinks=True if sinks else None,
                                   alibi_slopes=True if alibi else None)
    except (SpecError, ValueError):  # a head width or mask the FP8 forward lacks: the chunks where they take it
        return True
    return fp8_forward_fill(b, hq, nq, forward.tiling.block_q, sms) < CHUNKS_BELOW_FORWARD_FILL


def fp8_kv_refusal(names: str, dtype: str, plain: AttentionSpec, rows: int) -> str:
    """Why a call on an FP8 KV cache has no kernel: the decode kernels read one (head_dim 64 or 128,
    V as wide, a mask they pack), and this call's head width or mask is not theirs."""
    return (f"{names}: {dtype} (an FP8 KV cache) is read by the decode kernels: head_dim "
            f"{' or '.join(map(str, FP8_KV_HEAD_DIMS))}, V as wide, and a "
            f"mask they pack; this call has head_dim {plain.head_dim}, head_dim_v {plain.dv} and {rows} packed query "
            f"rows ({plain.mask.kind} mask). Keep the cache in {plain.dtype} for it")


def decode_spec_for(q, k, *, causal: bool = False, mask=None, softcap=None, block_mask=None, bias=None,
                    alibi_slopes=None, sinks=None, doc_ids=None, v=None) -> AttentionSpec | None:
    """The decode kernel fagen.attention would run for these arguments, or None where the plain
    forward is the one (too many packed rows, another head_dim, an unpackable mask or modifier).
    v: where given, V's width (head_dim_v where it differs from q's)."""
    plain = derive_spec(q, causal=causal, mask=mask, softcap=softcap, block_mask=block_mask, bias=bias,
                        alibi_slopes=alibi_slopes, sinks=sinks, doc_ids=doc_ids, v=v)
    return packed_spec(plain, q, k)


def choose_splits(blocks: int, kv_tiles: int, slots: int) -> int:
    """Splits of the KV tiles so that blocks x splits fills the GPU's `slots` (SMs x blocks an SM
    holds) in one wave, none waiting for a second: a memory-bound launch wants every block it
    can keep loading at once, and equal shares end together. A split may be a single tile: with
    the merge in the kernel, B 1 at 4k keys ran 2-5% faster on 16 one-tile splits than on 8 of
    two (H200, notes/perf.md). 1 when the blocks alone fill the slots, and where there is
    nothing to split (no block or no tile: a call with no work launches nothing, no_work)."""
    if blocks < 1 or kv_tiles < 1:
        return 1
    return max(1, min(slots // blocks, kv_tiles))


def slots(kernel: Kernel) -> int:
    """Blocks of `kernel` the current GPU runs at once: its SMs x the occupancy CUDA reports."""
    return device.multiprocessors(device.current_device()) * kernel.blocks_per_sm


def default_splits(spec: AttentionSpec, b: int, hq: int, hkv: int, nq: int, nk: int) -> int:
    """choose_splits for `spec`'s grid on the current GPU."""
    kernel = compile_kernel(spec)
    blocks = math.prod(kernel.plan.tiles(b, hq, hkv, nq, 1))
    return choose_splits(blocks, math.ceil(nk / kernel.plan.block_kv), slots(kernel))


# The most a tile's partials may be for its last split to merge them (read back by one block):
# on the H200, 32 KB (Nq 1, GQA 4, d 128, 16 splits) merged 0.5 us faster than by the merge
# kernel, 128 KB (Nq 4) 4.6 us slower (notes/perf.md).
MERGE_IN_KERNEL_BYTES = 64 * 1024


def merges_in_kernel(tile_rows: int, head_dim: int, splits: int) -> bool:
    """Whether the last split of a tile merges the tile's float32 partials (one launch a step), or
    fagen.splitkv's merge kernel does, its blocks sharing the reads (two launches)."""
    return tile_rows * head_dim * splits * 4 <= MERGE_IN_KERNEL_BYTES


def step_spec(spec: AttentionSpec, b: int, hq: int, hkv: int, nq: int, nk: int, splits: int | None,
              sinks: bool) -> tuple[AttentionSpec, int]:
    """The kernel a decode step of `spec` (a GQA-packed partial spec) runs, and its split count
    (equal shares of the KV tiles): unsplit where the blocks alone fill the GPU; merging in its
    last split where a tile's partials are small (merges_in_kernel); else `spec` itself, whose
    partials the merge kernel combines."""
    merged = variants.merged_variant(spec, sinks)
    kernel = compile_kernel(merged)  # its tiles and occupancy set the split count: the steps' common case
    tiles = math.ceil(nk / kernel.plan.block_kv)
    blocks, gpu_slots = math.prod(kernel.plan.tiles(b, hq, hkv, nq, 1)), slots(kernel)
    if splits is None:
        splits = choose_splits(blocks, tiles, gpu_slots)
    if not 1 <= splits <= tiles:
        raise ValueError(f"splits = {splits}: must be 1..{tiles} (the KV tiles of Nk = {nk})")
    splits = math.ceil(tiles / math.ceil(tiles / splits))  # equal shares: some counts give the same split
    if splits == 1:  # more blocks than the GPU holds: half the ring each, so that they run in one wave
        return variants.unsplit_variant(spec, sinks, half_ring=blocks > gpu_slots), 1
    tile_rows = min(kernel.plan.block_q, nq * (hq // hkv))
    return (merged if merges_in_kernel(tile_rows, spec.dv, splits) else spec), splits  # (the partials are O's, V's width)


def batch_step(spec: AttentionSpec, varlen_q: bool, b: int, hq: int, hkv: int, nq: int, nk: int,
               splits: int | None, sinks: bool) -> tuple[AttentionSpec, int]:
    """The kernel a batch of `spec` (batch_spec's) runs, and its split count: a padded batch's
    decode step as step_spec chooses it; varlen queries' split kernel, whose partials the merge
    kernel combines over the batch's rows, or its unsplit form where the blocks alone fill the
    GPU; a plain kernel as it is."""
    if not spec.outputs.partial:
        return spec, 1
    if not varlen_q:
        return step_spec(spec, b, hq, hkv, nq, nk, splits, sinks)
    if splits is None:
        splits = default_splits(spec, b, hq, hkv, nq, nk)
    tiles = math.ceil(nk / compile_kernel(spec).plan.block_kv)
    splits = math.ceil(tiles / math.ceil(tiles / splits))  # equal shares
    return (variants.unsplit_variant(spec, sinks), 1) if splits == 1 else (spec, splits)


# Q.K^T head widths whose causal long class takes a varlen batch from LONG_KEYS average keys:
# those measured ahead of the base class there, walking the batch persistently (H200, the long
# class against the base one at average 2-4k keys: d64 1.07-1.12x, d256 1.00-1.06x, 192/128 on
# d256's; d128's 192-row tiles 0.94-0.98x at 2k, 1.03x at 4k, so its batches keep the base class;
# notes/perf.md)
VARLEN_LONG_CLASS_HEAD_DIMS = frozenset({64, 192, 256})


def class_keys(batch) -> int | None:
    """The keys that pick a varlen batch's shape class (fagen.variants.LONG_KEYS), as a padded
    call's keys do: its average sequence's (total_k / B, on the host without a sync); None (the
    base class) for other layouts and for head widths outside VARLEN_LONG_CLASS_HEAD_DIMS."""
    if batch.kv_layout != "varlen" or batch.seqused_k or batch.q.shape[-1] not in VARLEN_LONG_CLASS_HEAD_DIMS:
        return None
    return int(batch.arguments["total_k"]) // batch.q.shape[0]


def fp8_forward_spec(dtype: str, head_dim: int, causal: bool, mask, *, softcap=None, sinks=None, alibi_slopes=None,
                     bias=None, doc_ids=None, block_mask=None, out_dtype: str | None = None) -> AttentionSpec:
    """The FP8 forward (variants.fp8_spec) for a call's options: the mask they ask for
    (kernel_mask), the modifiers of the side inputs given (arrays or None), and o in out_dtype
    (None: the spec's bfloat16)."""
    spec = variants.fp8_spec(dtype, head_dim, kernel_mask(causal, mask, block_mask is not None, doc_ids is not None),
                             ScoreMod(softcap=softcap, sinks=sinks is not None, bias=bias_kind(bias),
                                      alibi="none" if alibi_slopes is None else "slopes"))
    return spec if out_dtype is None else variants.output_type_variant(spec, out_dtype)


def _fp8_batch_spec(batch, dtype: str, *, causal: bool, mask, softcap, alibi_slopes, sinks) -> AttentionSpec:
    """batch_spec for FP8 q, k, v: the FP8 forward (variants.fp8_spec) in the batch's layouts."""
    tq, tk, tv = batch.q, batch.k, batch.v
    if tk.dtype != tq.dtype or tv.dtype != tq.dtype:
        raise ValueError(f"q, k, v: dtypes {tq.dtype}, {tk.dtype}, {tv.dtype}; the FP8 forward takes all three of "
                         f"one FP8 type (an FP8 KV cache, a half-type q, is read paged)")
    if tv.shape[-1] != tq.shape[-1]:
        raise ValueError(f"head_dim: q {tq.shape[-1]}, v {tv.shape[-1]}; the FP8 forward has V as wide as Q and K")
    spec = fp8_forward_spec(dtype, tq.shape[-1], causal, mask, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    try:
        return variants.sequence_variant(spec, batch.q_layout, batch.kv_layout, batch.seqused_k)
    except SpecError as refused:
        raise ValueError(f"{batch.q_layout} q, {batch.kv_layout} K/V: {refused}") from None


def batch_spec(batch, *, causal: bool, mask, softcap, alibi_slopes, sinks) -> AttentionSpec:
    """The kernel for a batch (a fagen.sequences.Batch): the decode kernel where a KV head's packed rows (the longest
    sequence's queries x its group) fit one, else the plain forward of its shape class
    (class_keys), in the batch's layouts."""
    tq, tk = batch.q, batch.k
    if tk.shape[1] == 0 or tq.shape[1] % tk.shape[1]:
        raise ValueError(f"q has Hq = {tq.shape[1]} heads, k and v Hkv = {tk.shape[1]}: Hq must be a multiple of Hkv")
    q_fp8 = fp8_element(tq.dtype)
    if q_fp8 is not None and batch.kv_layout != "paged":  # FP8 q, k, v: the FP8 forward, in the batch's layouts
        return _fp8_batch_spec(batch, q_fp8.name, causal=causal, mask=mask, softcap=softcap,
                               alibi_slopes=alibi_slopes, sinks=sinks)
    kv = fp8_element(tk.dtype)
    dv = batch.v.shape[-1] if batch.v.shape[-1] != tq.shape[-1] else None  # two head widths (head_dim_v)
    dtype = cache_query_dtype(tq.dtype, tk.dtype)  # (an FP8 q of a paged FP8 cache: its kernels widen it)
    plain = derive_spec_for(dtype, tq.shape[-1], causal=causal, mask=mask, softcap=softcap,
                            alibi_slopes=alibi_slopes, sinks=sinks, head_dim_v=dv)
    keys = class_keys(batch)
    if keys is not None:
        long = derive_spec_for(dtype, tq.shape[-1], causal=causal, mask=mask, softcap=softcap,
                               alibi_slopes=alibi_slopes, sinks=sinks, keys=keys, head_dim_v=dv)
        ws = long.pipeline.warp_specialized
        if ws is not None and ws.persistent:
            plain = long
    rows = tq.shape[2] * (tq.shape[1] // tk.shape[1])
    packed = variants.decode_spec(plain.dtype, plain.head_dim, rows, plain.mask, plain.score_mod, plain.head_dim_v)
    if kv is not None:  # an FP8 KV cache: paged, through the decode kernel's FP8 variant
        if batch.kv_layout != "paged":
            raise ValueError(f"k, v: {tk.dtype} (an FP8 KV cache) is read paged (attention_with_kvcache with a "
                             f"page_table) or as [B, Hkv, N, d] rows (fagen.attention), with k_descale and v_descale; "
                             f"not {batch.kv_layout} yet")
        packed = fp8_kv_spec(plain, rows, kv.name, None if q_fp8 is None else q_fp8.name) if dv is None else None
        if packed is None:
            raise ValueError(fp8_kv_refusal("k_cache, v_cache", tk.dtype, plain, rows))
    try:
        return variants.sequence_variant(packed or plain, batch.q_layout, batch.kv_layout, batch.seqused_k)
    except SpecError as refused:
        raise ValueError(f"{batch.q_layout} q, {batch.kv_layout} K/V: {refused}") from None
