"""The shipped specs fagen.attention picks from, and the variants it derives from them: other
masks and score modifiers, split-KV partials. Pure: which GPU is a parameter, so CPU tests
derive (and compile) exactly what a GPU would run.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from contextlib import nullcontext
from functools import cache

from fagen import expression
from fagen.backward_plan import fixes_unsought
from fagen.element_types import ELEMENT_TYPES, element_type
from fagen.load import SPECS, load_spec, parse_spec
from fagen.mask_kinds import KINDS
from fagen.plan import has_sequence_tiles
from fagen.spec import (FP8_KV_ARCHS, FP8_KV_WARP_KEYS, MAX_STAGES, THREE_WARPGROUPS_WARPS, WARPGROUP_ROWS, WARPGROUP_WARPS, AttentionSpec,
                        Mask, ScoreMod, Sequences, SpecError)

# GPUs whose tuned specs stand in for one another where only one was tuned (same SM, same smem).
SAME_CHIP = {"h100": "h200", "h200": "h100"}


def default_spec_name(dtype: str, head_dim: int, causal: bool) -> str:
    return f"attn_{ELEMENT_TYPES[dtype].short}_d{head_dim}" + ("_causal" if causal else "")


# A shape class: from LONG_KEYS keys on, `<name>_long_<gpu>.yaml` (where shipped, from `fagen tune
# --long`) replaces the spec for all lengths: tiles that pay over a long KV loop but cost short
# ones (192-row tiles leave an eighth of their rows idle at N = 512 and 1k).
LONG_KEYS = 2048


def shipped_spec(dtype: str, head_dim: int, causal: bool, *, gpu: str | None, partial: bool = False,
                 keys: int | None = None) -> AttentionSpec:
    """The shipped spec for a dtype and head_dim; the one tuned for `gpu` (from `fagen tune`,
    e.g. gpu "h200") where it exists, and for `keys` (the sequence's keys, where known) its long
    class's where that exists. partial: the split-KV kernel (`<name>_partial_<gpu>.yaml` where
    shipped, else the untuned tiling made partial: tilings tuned for full outputs can spill as
    partials)."""
    return _shipped_spec(dtype, head_dim, causal, gpu, partial, keys is not None and keys >= LONG_KEYS)


def _tuned_path(name: str, gpu: str | None) -> Path | None:
    """specs/<name>_<gpu>.yaml, or the same chip's (H100 and H200: one sm_90 chip, different
    memory), or None."""
    for slug in (gpu, SAME_CHIP.get(gpu)):
        path = SPECS / f"{name}_{slug}.yaml"
        if slug is not None and path.exists():
            return path
    return None


@cache
def _shipped_spec(dtype: str, head_dim: int, causal: bool, gpu: str | None, partial: bool, long: bool) -> AttentionSpec:
    name = default_spec_name(dtype, head_dim, causal)
    if long and not partial:
        tuned = _tuned_path(f"{name}_long", gpu)
        if tuned is not None:
            return load_spec(tuned)
    tuned = _tuned_path(name + ("_partial" if partial else ""), gpu)
    if partial and tuned is None:
        return partial_variant(load_spec(SPECS / f"{name}.yaml"))
    path = tuned or SPECS / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"no shipped kernel for dtype {dtype}, head_dim {head_dim}: fagen.attention takes "
                         f"float16 or bfloat16 with head_dim 32, 64, 96, 128 or 256 (192 with a v of 128)")
    return load_spec(path)


@cache
def variant(base: AttentionSpec, mask: Mask, score_mod: ScoreMod) -> AttentionSpec:
    """`base` with another mask and score modifiers, named after them (deterministically) and
    validated like any spec. Masks and modifiers cost registers: where the plan predicts that
    base's tiling would spill with them, the first tiling it accepts is taken instead, in the
    order of fallback_tilings, and the name says which (`_kv<block_kv>[_sep2]`). base's
    backward: section is not carried over: it was sized for base's mask and modifiers, and
    `trainable` gives the variant its own."""
    if (mask, score_mod) == (base.mask, base.score_mod):
        return base
    tag = hashlib.sha256(repr((mask, score_mod)).encode()).hexdigest()[:10]
    data = {**base.model_dump(), "name": f"{base.name}_{mask.kind}_{tag}", "mask": mask.model_dump(),
            "score_mod": score_mod.model_dump(), "backward": None}
    block_kv = KINDS[mask.kind].kv_tile(base.tiling.block_kv)
    if block_kv != base.tiling.block_kv:  # the kind's own tile size (MaskKind.kv_tile)
        data["name"] += f"_kv{block_kv}"
        data["tiling"] = {**data["tiling"], "block_kv": block_kv}
    return parse_falling_back(data, base, f"variant of {base.name}")


def fp8_spec(dtype: str, head_dim: int, mask: Mask, score_mod: ScoreMod) -> AttentionSpec:
    """The FP8 forward (`specs/attn_<short>_d<head_dim>_sm90a.yaml`: bfloat16 out) with this mask
    and these modifiers (`variant`), or a ValueError naming the FP8 kernels there are."""
    short = ELEMENT_TYPES[dtype].short
    path = SPECS / f"attn_{short}_d{head_dim}_sm90a.yaml"
    if not path.exists():
        built = sorted(p.stem for p in SPECS.glob(f"attn_{short}_d*_sm90a.yaml"))
        raise ValueError(f"q: {dtype} with head_dim {head_dim}: the FP8 forward is built for {', '.join(built) or 'none'};"
                         f" pad q, k and v to one of their head dims, or use bfloat16")
    base = _fp8_base(path)
    try:
        return variant(base, mask, score_mod)
    except SpecError as refused:  # (the register rule's own fix, a smaller key tile, is not built in FP8)
        raise ValueError(f"mask {mask.kind!r}, score_mod {score_mod.model_dump(exclude_defaults=True) or 'none'}: "
                         f"the {dtype} forward at head_dim {head_dim} ({base.tiling.block_q} x "
                         f"{base.tiling.block_kv} tiles at {base.pipeline.warp_specialized.consumer_registers} "
                         f"registers a thread, the most there are; FP8 tiles of fewer keys are not built) has no "
                         f"room for them. Pass bfloat16 q, k and v for it, or drop the mask or modifier (head_dim "
                         f"128's FP8 forward takes them)") from refused


@cache
def _fp8_base(path: Path) -> AttentionSpec:
    return load_spec(path)


@cache
def output_type_variant(spec: AttentionSpec, out_dtype: str) -> AttentionSpec:
    """`spec` writing o in `out_dtype` (an FP8 forward's e4m3 output: FlashInfer's names, the o
    type last: `<name>_o<short>`), validated like any spec: the element type says what it may write."""
    out = element_type(out_dtype)  # (torch's names too: float8_e4m3fn)
    if out is spec.out_element:
        return spec
    return parse_spec({**spec.model_dump(), "name": f"{spec.name}_o{out.short}", "out_dtype": out.name},
                      f"{out.name} output of {spec.name}")


def modified_spec(dtype: str, head_dim: int, causal: bool, mask: Mask, score_mod: ScoreMod, *, gpu: str | None,
                  keys: int | None = None) -> AttentionSpec:
    """The shipped spec for these keys with this mask and these modifiers (`variant`). The long
    class's tiling (more query rows a tile, fewer registers a thread) keeps what it is tuned for
    where they leave its block_kv whole; where they shrink it, whichever of it and the regular
    class's keeps more keys a tile (H200, softcap f16 causal 4k: d128 192x64 -> 128x128 +7%, d64
    192x96 -> 128x128 +2%; d256 keeps its long 128x80, 14% over the regular 128x64)."""
    long = shipped_spec(dtype, head_dim, causal, gpu=gpu, keys=keys)
    derived = variant(long, mask, score_mod)
    regular = shipped_spec(dtype, head_dim, causal, gpu=gpu)
    if regular == long or derived.tiling.block_kv >= long.tiling.block_kv:
        return derived
    other = variant(regular, mask, score_mod)
    return other if other.tiling.block_kv > derived.tiling.block_kv else derived


def block_aligned(derived: AttentionSpec, mask: Mask, score_mod: ScoreMod, tiles: tuple[int, int], *,
                  gpu: str | None) -> AttentionSpec:
    """A block mask's kernel on its own blocks (tiles: q_block, kv_block) where a shipped spec of
    derived's dtype and head_dim tiles so with this mask and these modifiers, else `derived`. A
    mask of whole blocks then stays whole (each tile FULL or not visited), where tiles straddling
    its blocks would take the element test (d64: 192x96 tiles against FlexAttention's 128-blocks;
    per-head random blocks 0.81x Flex), and no re-blocking pass runs on the host."""
    if (derived.tiling.block_q, derived.tiling.block_kv) == tiles:
        return derived
    for causal, keys in itertools.product((False, True), (None, LONG_KEYS)):
        base = shipped_spec(derived.dtype, derived.head_dim, causal, gpu=gpu, keys=keys)
        if (base.tiling.block_q, base.tiling.block_kv) == tiles:
            aligned = variant(base, mask, score_mod)
            if (aligned.tiling.block_q, aligned.tiling.block_kv) == tiles:
                return aligned
    return derived


COPYING_WARPS_Q = 8  # the most query warps the copying sm_90a kernel (no producer warpgroup) takes


# Q.K^T widths with no default of their own (from a wider head's spec): keys a tile on the
# warp-specialised kernel. 192/128 at 128 x 112 (FlashAttention-3's tile for 192) against the head_dim
# 256 default's 128 x 80 dense and 128 x 64 causal: +3-9% (H200, bfloat16, N 4k and 16k; 128 keys
# do not fit shared memory).
WIDE_QK_KV_TILE = {192: 112}
# ... and a persistent walk that claims its tiles where a mask's tiles are uneven, whatever the
# wider head's long class does: 192/128 causal +9% at 4k, +1-3% at 16k (H200, bfloat16; notes/perf.md).
# Causal and dense take head_dim 128's long-class tile instead: 192 queries x 80 keys, three consumer
# warpgroups in ping-pong (S and O are head_dim 128's tiles; only Q.K^T is deeper). Against 128 x 112
# (H200, bfloat16, one process): causal +3% at 1k, +18% at 2k, +10% at 4k and 16k; dense +2-4% at 4k
# and 16k. A modifier whose registers it cannot hold keeps 128 x 112.
WIDE_QK_LONG_TILING = {192: {"block_q": 192, "warps_q": 12, "block_kv": 80}}
WIDE_QK_LONG_MASKS = ("causal", "none")  # the masks measured with it
WIDE_QK_LONG_CONSUMER_REGISTERS = 160  # three consumer warpgroups beside the producer's


@cache
def value_head_variant(spec: AttentionSpec, head_dim_v: int, head_dim: int | None = None) -> AttentionSpec:
    """`spec` with V and O head_dim_v wide (and Q and K head_dim wide, where given: a Q.K^T width
    with no default of its own, from a wider head's spec), as the spec's rules take two head
    widths (the forward: whole outputs, one warp along the keys): its own
    kernel, warp-specialised where it is, falling back as `variant` does where the plan refuses it
    (rows as wide as the wider head); a warp-specialised kernel refused at every tiling becomes
    the copying sm_90a kernel of its tiling."""
    head_dim = head_dim or spec.head_dim
    if (head_dim, head_dim_v) == (spec.head_dim, spec.dv):
        return spec
    data = spec.model_dump()
    tag = f"_d{head_dim}" if head_dim != spec.head_dim else ""
    tiling = {**data["tiling"], "pack_gqa": False, "warps_kv": 1}
    pipeline = data["pipeline"]
    if head_dim != spec.head_dim and spec.warp_specialized and head_dim in WIDE_QK_KV_TILE:
        tiling["block_kv"] = WIDE_QK_KV_TILE[head_dim]
        tag += f"_kv{tiling['block_kv']}"  # the name says the tile, not the wider head's
        if not KINDS[spec.mask.kind].even_tiles and not pipeline["warp_specialized"]["persistent"]:
            pipeline = {**pipeline, "warp_specialized": {**pipeline["warp_specialized"], "persistent": True}}
            tag += "_persistent"
    data.update(name=f"{spec.name}{tag}_v{head_dim_v}", head_dim=head_dim, head_dim_v=head_dim_v, backward=None,
                tiling=tiling, pipeline=pipeline,
                outputs={**data["outputs"], "partial": False, "accumulate": False, "merge_splits": False})
    long_tiling = WIDE_QK_LONG_TILING.get(head_dim) if (head_dim != spec.head_dim and spec.warp_specialized
                                                        and spec.mask.kind in WIDE_QK_LONG_MASKS) else None
    if long_tiling is not None:
        # (persistent above: a causal mask's tiles are uneven, so they are claimed)
        ws = {**pipeline["warp_specialized"], "consumer_registers": WIDE_QK_LONG_CONSUMER_REGISTERS}
        try:
            return parse_spec({**data, "name": f"{spec.name}_d{head_dim}_q{long_tiling['block_q']}_kv{long_tiling['block_kv']}"
                               f"_v{head_dim_v}", "tiling": {**tiling, **long_tiling},
                               "pipeline": {**pipeline, "pingpong": True, "warp_specialized": ws}},
                              f"value-head variant of {spec.name}")
        except SpecError:
            pass  # (a modifier's registers) the tile above
    try:
        return parse_falling_back(data, spec, f"value-head variant of {spec.name}")
    except SpecError:
        if not spec.warp_specialized:
            raise
    tiling = dict(data["tiling"])
    if tiling["warps_q"] > COPYING_WARPS_Q:  # three consumer warpgroups need a producer
        tiling.update(warps_q=COPYING_WARPS_Q, block_q=tiling["block_q"] * COPYING_WARPS_Q // tiling["warps_q"])
    data.update(name=f"{data['name']}_copying", tiling=tiling,
                pipeline={**data["pipeline"], "warp_specialized": None, "pingpong": False})
    return parse_falling_back(data, spec, f"value-head variant of {spec.name}")


def parse_falling_back(data: dict, base: AttentionSpec, source: str) -> AttentionSpec:
    """`data` validated; where the plan refuses it (registers, smem), the first of base's
    fallback_tilings it accepts, at no more keys a tile than data asks for; else the refusal."""
    try:
        return parse_spec(data, source)
    except SpecError as refused:
        for block_kv, pipeline, suffix in fallback_tilings(base):
            if block_kv > data["tiling"]["block_kv"]:
                continue
            try:
                return parse_spec({**data, "name": data["name"] + suffix, "tiling": {**data["tiling"], "block_kv": block_kv},
                                   "pipeline": {**data["pipeline"], **pipeline}}, source)
            except SpecError:
                pass
        raise refused


# A wgmma kernel's masked variants whose registers refuse its tile try three quarters of it
# before half: at d64, three consumer warpgroups, 96 keys against 64 measured 1.04-1.46x
# (H200: sliding window 4k 333 against 320 TFLOP/s, prefix-LM 445 / 407, random documents
# 181 / 124; notes/perf.md).
WGMMA_TILE_STEP = (3, 4)


def fallback_tilings(base: AttentionSpec) -> list[tuple[int, dict, str]]:
    """(block_kv, pipeline change, name suffix) to try, in order, where base's tiling is refused:
    base's block_kv, then the powers of two below it down to 16 (176 -> 128, 64, 32, 16) with
    (wgmma) three quarters of the largest of them after it (128 -> 96 -> 64; 176 -> 128 -> 96;
    80 -> 64 -> 48), each first with base's pipeline, then (mma.sync) with separate K and V
    buffers, 2 stages (fewer registers for slot addresses than one stage, by ptxas)."""
    out = []
    powers = [1 << p for p in range(8, 3, -1) if 1 << p <= base.tiling.block_kv]
    sizes = [base.tiling.block_kv] + [size for size in powers if size < base.tiling.block_kv]
    three_quarters = powers[0] * WGMMA_TILE_STEP[0] // WGMMA_TILE_STEP[1] if powers else None
    if base.wgmma and three_quarters and three_quarters % 16 == 0 and three_quarters not in sizes:
        sizes.insert(sizes.index(powers[0]) + 1, three_quarters)
    for block_kv in sizes:
        if block_kv != base.tiling.block_kv:
            out.append((block_kv, {}, f"_kv{block_kv}"))
        sep2 = {"kv_smem": "separate", "stages": 2}
        if not base.wgmma and (base.pipeline.kv_smem, base.pipeline.stages) != ("separate", 2):
            out.append((block_kv, sep2, f"_kv{block_kv}_sep2"))
    return out


# Decode (fagen.decode): GQA-packed split-KV kernels, by the packed rows (Nq x query heads a KV
# head) they take: one warp of 16 rows, or four warps of 16 (K and V read once for up to 64 rows).
# Head_dim 256 has the 16-row kernel only (specs/decode_*_d256.yaml): a warp's O is already 128
# registers a thread, so its four warps split a 64-key tile instead of taking more rows
DECODE_ROWS = (16, 64)
DECODE_HEAD_DIMS = {64: DECODE_ROWS, 128: DECODE_ROWS, 256: DECODE_ROWS[:1]}


def decode_spec_name(dtype: str, head_dim: int, rows: int, head_dim_v: int | None = None) -> str:
    return (f"decode_{ELEMENT_TYPES[dtype].short}_d{head_dim}" + ("" if head_dim_v in (None, head_dim) else f"_v{head_dim_v}")
            + ("" if rows == DECODE_ROWS[0] else f"_q{rows}"))


def decode_tiling_head_dim(head_dim: int, head_dim_v: int | None = None) -> int | None:
    """The head_dim whose decode kernels' tiling a decode of these widths takes: its own, or for two
    widths the narrowest decode width that holds the wider head (DeepSeek's 192/128: 256's), whose
    rows of shared memory and registers fit both; None where no decode width does."""
    widest = max(head_dim, head_dim_v or head_dim)
    return min((d for d in DECODE_HEAD_DIMS if d >= widest), default=None)


@cache
def decode_spec(dtype: str, head_dim: int, rows: int, mask: Mask = Mask(), score_mod: ScoreMod = ScoreMod(),
                head_dim_v: int | None = None) -> AttentionSpec | None:
    """The decode kernel for `rows` packed rows (Nq x group), with this mask and these modifiers;
    None where there is none: more rows than its head_dim's largest (DECODE_HEAD_DIMS), another
    head_dim, or a mask or modifier that packing cannot address (block masks, documents, a bias).
    head_dim_v: V's and O's width where it differs from head_dim (Q's and K's): the kernel of
    decode_tiling_head_dim's tiling with Q.K^T head_dim wide and V head_dim_v wide."""
    tiling_dim = head_dim if head_dim_v in (None, head_dim) else decode_tiling_head_dim(head_dim, head_dim_v)
    fits = [r for r in DECODE_HEAD_DIMS.get(tiling_dim, ()) if rows <= r]
    if not fits:
        return None
    base = load_spec(SPECS / f"{decode_spec_name(dtype, tiling_dim, fits[0])}.yaml")
    try:
        if (head_dim, head_dim_v or head_dim) != (base.head_dim, base.dv):
            base = parse_spec({**base.model_dump(exclude_none=True), "head_dim": head_dim, "head_dim_v": head_dim_v,
                               "name": decode_spec_name(dtype, head_dim, fits[0], head_dim_v)},
                              f"two-width decode kernel from {base.name}")
        # sinks join in the merge of the partials, not in the kernel
        return variant(base, mask, score_mod.model_copy(update={"sinks": False}))
    except SpecError:
        return None  # refused for packing (tiling.pack_gqa's rules), or registers


@cache
def fp8_kv_variant(spec: AttentionSpec, kv_dtype: str, tiling: tuple[tuple[str, int], ...] = (), tag: str = "",
                   q_dtype: str | None = None) -> AttentionSpec:
    """A decode kernel reading K and V from an FP8 cache (spec.fp8_kv: widened to float16 in
    registers, FlashAttention-3's k_descale and v_descale, and q_descale for an FP8 q),
    named <name>_kv_<type>: on sm_90, in
    swizzled rows (its FP8 tiles' only layout), its ring holding as many bytes in flight as the
    half-type kernel's (a memory-bound loop: half the bytes a key, so twice the keys): each warp's
    share of a tile at least 32 keys (four n8 fragments a widened K load; 16 at head_dim 256, whose
    O takes 128 registers a thread), then twice the stages (three at most: head_dim 64's 256-key
    tiles already run two). tiling: (field, value) pairs of spec's tiling to replace first (named
    <name><tag>_kv_<type>). q_dtype: an FP8 q the kernel widens as it lands (spec.q_dtype), named
    <name>..._kv_<type>_q_<type>."""
    element, t, pipeline = ELEMENT_TYPES[kv_dtype], spec.tiling.model_copy(update=dict(tiling)), spec.pipeline
    query = {} if q_dtype is None else {"q_dtype": q_dtype}
    warp_keys = FP8_KV_WARP_KEYS if spec.head_dim > 128 else 2 * FP8_KV_WARP_KEYS
    block_kv = max(t.block_kv, warp_keys * t.warps_kv)
    stages = min(MAX_STAGES, pipeline.stages * (2 if block_kv == t.block_kv else 1))
    name = f"{spec.name}{tag}_kv_{element.short}" + (f"_q_{ELEMENT_TYPES[q_dtype].short}" if q_dtype else "")
    return parse_spec({**spec.model_dump(exclude_none=True), "name": name, **query,
                       "kv_dtype": kv_dtype, "arch": FP8_KV_ARCHS[-1], "smem_layout": "swizzled",
                       "tiling": {**t.model_dump(exclude_none=True), "block_kv": block_kv},
                       "pipeline": {**pipeline.model_dump(exclude_none=True), "stages": stages}},
                      f"{kv_dtype} KV cache {spec.name}")


# A chunk of prefill against an FP8 cache (more packed rows than a decode kernel holds) runs over
# row tiles: 128 rows on eight warps, one key warp a row group (a decode kernel's two key warps
# merge O through shared memory every tile, which a long chunk need not pay), the widest key tile
# whose registers fit first. H200, d128, causal, 256-2048 queries against 4k-16k keys: 128 x 128
# +18-22% over the q64 decode kernel's tiles, 128 x 64 +6-8% (notes/perf.md). Head_dim 256 has
# none: its O alone is 128 registers a thread at 16 rows a warp.
FP8_KV_CHUNK_TILINGS = {64: ((128, 8, 128),), 128: ((128, 8, 128), (128, 8, 64))}  # (block_q, warps_q, block_kv)


@cache  # (a tiling that does not fit is refused by its validation: asked once)
def fp8_kv_chunk_variant(spec: AttentionSpec, kv_dtype: str, q_dtype: str | None = None) -> AttentionSpec:
    """fp8_kv_variant of the largest decode kernel `spec` (its mask and modifiers) for a chunk of
    prefill: on the first of FP8_KV_CHUNK_TILINGS that validates, named
    <name>_rows<block_q>x<block_kv>, else on the decode kernel's own tiles."""
    for block_q, warps_q, block_kv in FP8_KV_CHUNK_TILINGS.get(spec.head_dim, ()):
        tiling = (("block_q", block_q), ("warps_q", warps_q), ("warps_kv", 1), ("block_kv", block_kv))
        try:
            return fp8_kv_variant(spec, kv_dtype, tiling, f"_rows{block_q}x{block_kv}", q_dtype)
        except SpecError:  # (its registers: a mask's or modifier's temporaries beside a wider tile)
            continue
    return fp8_kv_variant(spec, kv_dtype, q_dtype=q_dtype)


SEQUENCE_TAGS = {"padded": "", "varlen": "varlen", "paged": "paged", "ranged": "ranged"}


@cache
def sequence_variant(spec: AttentionSpec, q: str = "padded", kv: str = "padded", seqused_k: bool = False
                     ) -> AttentionSpec:
    """`spec` reading its sequences as `q` and `kv` lay them out (spec.sequences: varlen,
    paged; with seqused_k, varlen K/V counted per sequence), named <name>_q<layout>_kv<layout>
    (_seqused) for the layouts that are not padded. The layouts
    are the forward's (serving): spec's backward: section is not carried over, nor, for a paged
    cache, a TMA producer (pipeline.warp_specialized). A persistent producer's kernel stays
    persistent where it walks a varlen batch's tile table (plan.has_sequence_tiles) under a mask
    whose tiles differ within a sequence (causal, windows): the table puts the longest sequences
    and their latest rows first, and blocks that claim their tiles in its order (plan.claimed_walk)
    beat the GPU's block scheduler by 5-27% and a static walk by 2-17% (H200, notes/perf.md).
    Elsewhere a block a tile: with even tiles a tile costs its sequence's length, and the block
    scheduler balanced a d64 batch of 1213-7032 keys 12% better than a static walk."""
    if (spec.sequences.q, spec.sequences.kv, spec.sequences.seqused_k) == (q, kv, seqused_k):
        return spec
    tags = [f"{side}{SEQUENCE_TAGS[layout]}" for side, layout in (("q", q), ("kv", kv)) if layout != "padded"]
    tags += ["seqused"] * seqused_k
    data = {**spec.model_dump(), "name": "_".join([spec.name, *tags]), "backward": None,
            "sequences": {"q": q, "kv": kv, "seqused_k": seqused_k}}
    if spec.warp_specialized and kv == "paged":  # TMA maps describe whole tensors: every thread copies instead
        data["pipeline"] = {**data["pipeline"], "warp_specialized": None}
        if spec.tiling.warps_q == THREE_WARPGROUPS_WARPS:  # copying warpgroups: two of them
            data["tiling"] = {**data["tiling"], "warps_q": 2 * WARPGROUP_WARPS, "block_q": 2 * WARPGROUP_ROWS}
    elif spec.warp_specialized and spec.pipeline.warp_specialized.persistent and (
            KINDS[spec.mask.kind].even_tiles
            or not has_sequence_tiles(spec.model_copy(update={"sequences": Sequences(q=q, kv=kv)}))):
        data["pipeline"] = {**data["pipeline"],
                            "warp_specialized": {**data["pipeline"]["warp_specialized"], "persistent": False}}
    return parse_falling_back(data, spec, f"{q} q, {kv} kv variant of {spec.name}")  # the layout's registers


# The least keys a warp of an unsplit decode kernel keeps when its tile is halved (halved_ring).
UNSPLIT_MIN_WARP_KEYS = 32


def halved_ring(spec: AttentionSpec) -> dict:
    """The tiling and pipeline fields that halve a decode spec's K/V ring: one stage where it has
    two, else half the keys a tile where each warp keeps UNSPLIT_MIN_WARP_KEYS or more; {} where
    neither applies."""
    tiling, pipeline = spec.tiling, spec.pipeline
    if pipeline.stages == 2:
        return {"pipeline": {**pipeline.model_dump(), "stages": 1}}
    if pipeline.stages == 1 and tiling.block_kv // 2 // tiling.warps_kv >= UNSPLIT_MIN_WARP_KEYS:
        return {"tiling": {**tiling.model_dump(), "block_kv": tiling.block_kv // 2}}
    return {}


@cache
def unsplit_variant(spec: AttentionSpec, sinks: bool = False, half_ring: bool = False) -> AttentionSpec:
    """A partial spec (a decode kernel) writing its output itself, named <name>_unsplit[_half][_sinks]:
    where its blocks fill the GPU without splitting the keys, one launch and no merge (the
    merge's 3 us were 2.5% of a B 32 decode step on the H200). sinks: they join in the kernel,
    as the merge would have added them. half_ring: more blocks than the GPU holds at once, each
    takes half the K/V ring where the plan accepts it (halved_ring; key-split blocks only,
    tiling.warps_kv > 1): the ring is sized for a block alone on its SM, and the batch then runs
    two blocks an SM in one wave where it took two (H200, B 32 at 4k: d128 123.2 against 124.5
    us, d64 63.4 against 64.8). With fewer blocks than SMs the whole ring stays: a block an SM
    (mixed-length paged B 16: 149.6 us whole, 170.5 halved; notes/perf.md)."""
    if not spec.outputs.partial:
        return spec
    data = {**spec.model_dump(), "name": f"{spec.name}_unsplit{'_sinks' if sinks else ''}",
            "outputs": {**spec.outputs.model_dump(), "partial": False, "lse": True},
            "score_mod": {**spec.score_mod.model_dump(), "sinks": sinks}}
    halved = halved_ring(spec) if half_ring and spec.tiling.warps_kv > 1 else {}
    if halved:
        try:
            return parse_spec({**data, **halved, "name": f"{spec.name}_unsplit_half{'_sinks' if sinks else ''}"},
                              f"unsplit {spec.name}")
        except SpecError:
            pass  # the halved ring is refused (too small for the key warps' merge): keep the whole one
    return parse_spec(data, f"unsplit {spec.name}")


@cache
def merged_variant(spec: AttentionSpec, sinks: bool = False) -> AttentionSpec:
    """A partial spec (a decode kernel) whose last split of each tile merges the tile's partials
    (outputs.merge_splits), named <name>_merged[_sinks]: a split decode step in one launch.
    sinks: they join that merge, as the merge kernel would have added them."""
    if not spec.outputs.partial or spec.outputs.merge_splits:
        return spec
    data = {**spec.model_dump(), "name": f"{spec.name}_merged{'_sinks' if sinks else ''}",
            "outputs": {**spec.outputs.model_dump(), "merge_splits": True},
            "score_mod": {**spec.score_mod.model_dump(), "sinks": sinks}}
    return parse_spec(data, f"merged {spec.name}")


@cache
def partial_variant(spec: AttentionSpec) -> AttentionSpec:
    """`spec` writing float32 partials (outputs.partial), named <name>_partial (forward only:
    its backward: section is not carried over)."""
    if spec.outputs.partial:
        return spec
    return parse_spec({**spec.model_dump(), "name": f"{spec.name}_partial", "backward": None,
                       "outputs": {**spec.outputs.model_dump(), "partial": True, "lse": True}}, f"partial of {spec.name}")


@cache  # a ring builds its kernels each call: validation once
def accumulate_variant(spec: AttentionSpec) -> AttentionSpec:
    """`spec`'s partial kernel folding into the running O and LSE (outputs.accumulate), named
    <partial's name>_accumulate: a step of ring attention. A block a tile, never persistent: the
    step runs beside the ring's transfer, whose few blocks a persistent grid would keep off
    every SM until its own last tile (H200, 4 GPUs, N = 32k: 2.54 ms a ring against 2.98)."""
    spec = partial_variant(spec)
    if spec.outputs.accumulate:
        return spec
    data = {**spec.model_dump(), "name": f"{spec.name}_accumulate",
            "outputs": {**spec.outputs.model_dump(), "accumulate": True}}
    # the fold's epilogue may need a smaller tile than the partial's (plan.accumulate_epilogue)
    return parse_falling_back(_a_block_a_tile(spec, data), spec, f"accumulating {spec.name}")


@cache
def ring_start_variant(spec: AttentionSpec) -> AttentionSpec:
    """`spec`'s partial kernel as a ring's first step runs it: it writes the running O and LSE
    that accumulate_variant's steps fold into (nothing to fill first), a block a tile as they
    are; named <partial's name>, with _tiles where the partial is persistent."""
    spec = partial_variant(spec)
    if not (spec.warp_specialized and spec.pipeline.warp_specialized.persistent):
        return spec
    data = _a_block_a_tile(spec, {**spec.model_dump(), "name": f"{spec.name}_tiles"})
    return parse_spec(data, f"tiles of {spec.name}")


def _a_block_a_tile(spec: AttentionSpec, data: dict) -> dict:
    """A spec's data with its warp-specialised grid a block a tile, not persistent."""
    if spec.warp_specialized and spec.pipeline.warp_specialized.persistent:
        data["pipeline"] = {**data["pipeline"],
                            "warp_specialized": {**data["pipeline"]["warp_specialized"], "persistent": False}}
    return data


# The backward's tiling by head_dim (fagen.backward_plan): dK and dV of block_kv keys live in
# registers, so head_dim 256 splits them across warp pairs, and its tiles shrink to fit smem.
BACKWARD_TILINGS = {
    32: {}, 64: {}, 96: {"block_q": 32}, 128: {"block_q": 32},
    # DeepSeek's 192/128 (dK and dV 80 registers a thread at head_split 2): 216 and 222 registers,
    # 0 spills (ptxas -v, sm_80 and sm_90, nvcc 13.0)
    192: {"head_split": 2, "block_kv": 64, "block_q": 32, "dq_block_kv": 32},
    256: {"head_split": 2, "block_kv": 64, "block_q": 32, "dq_block_kv": 32},
}
# ... and where a spec's modifiers or mask push the kernels over the registers: fewer queries a
# step (S^T, dP^T and the derivative shrink with it), fewer keys for dQ, then dK and dV split
# across warp pairs, and last the fewest of both (head_dim 256 under a sliding window with
# softcap, Gemma 2 and 3's shape: 242-248 registers, 0 spills, sm_80 and sm_90, every mask kind).
BACKWARD_FALLBACKS = ({"block_q": 32}, {"block_q": 32, "dq_block_kv": 32},
                      {"head_split": 2, "block_kv": 64, "block_q": 32, "dq_block_kv": 32},
                      {"head_split": 2, "block_kv": 64, "block_q": 16, "dq_block_kv": 32},
                      {"head_split": 2, "block_kv": 64, "block_q": 16, "dq_block_kv": 16})
# sm_90a up to head_dim 128 (the wgmma dK/dV kernel): two warpgroups of 64 keys, dQ by atomics
# (backward.deterministic false), 2 Q/dO stages (a third no longer fits beside dQ's staging for its
# bulk reduce); head_dim 64 takes 128 queries a step (S^T as m64n128 wgmmas: 15-40% faster than
# 64). Where a mask or modifiers push that over the registers: 64 queries, then the dQ kernel
# instead (deterministic), then fewer queries a step.
WGMMA_BACKWARD_TILINGS = {64: {"block_q": 128, "stages": 2}, 128: {"stages": 2}}
# ... and two head widths, by the wider (the dQ kernel, not atomic dQ; the dK/dV kernel's producer
# first at 128, where its consumers fit: +2-6%): 128/64 and 64/128 at 64
# queries a step (231-233 registers, 0 spills; 128 spill 76-80 bytes), DeepSeek's 192/128 at 32 (dK
# and dV 160 registers a thread: 250, 0 spills; 64 spill 156 bytes). ptxas -v, nvcc 13.0.
WGMMA_TWO_WIDTHS_TILINGS = {128: {"stages": 2}, 192: {"block_q": 32, "stages": 2}}
# The dK/dV kernel's TMA producer (backward.warp_specialized), measured on an H200 (same process,
# alternating arms): head_dim 128 +3-10% (dense, causal, masks); head_dim 64 +2-7% (dense and
# causal, 4k and 16k) since P^T is packed before dP^T lands: before, its 128-query steps spilled
# under the consumers' 240 registers and ran 2-5% slower.
PRODUCER_BACKWARD_HEAD_DIMS = (64, 128)
# ... and the dQ kernel's (backward.dq_warp_specialized, where it runs: deterministic): +2-4% at
# head_dim 128 (dense, causal, masks), -3-8% at 64. One consumer warpgroup a block, two blocks an
# SM (as the copying kernel runs): 2 x (232 + 24) x 128 registers, the SM's.
DQ_PRODUCER_HEAD_DIMS = (128,)
DQ_PRODUCER = {"consumer_registers": 232}
# ... and the dK/dV kernel persistent (backward.warp_specialized.persistent: one block an SM walking
# the KV blocks, the next one's K and V loading under this one) where every block has the same
# work, so a static walk stays even: sliding windows +1.5-2.3% (H200, N 4k and 16k, same process);
# prefix-LM and documents, whose blocks differ, -1-2%.
PERSISTENT_DKDV_MASKS = ("sliding_window",)
# (Atomic dQ comes first under every mask: since its adds leave each warp as one bulk reduce a step,
# the one kernel beat the two deterministic ones with both producers at head_dim 128: sliding
# windows -8% time, documents -4.5%, block masks -37%, chunked within noise; H200, notes/perf.md.)
WGMMA_BACKWARD_FALLBACKS = ({"block_q": 64}, {"deterministic": True, "block_q": 128}, {"deterministic": True},
                            {"deterministic": True, "block_q": 32}, {"deterministic": True, "block_q": 32, "dq_block_kv": 32},
                            {"deterministic": True, "block_q": 16, "dq_block_kv": 32})


def with_producers(tiling: dict, persistent: bool = False, dq_producer: bool = True) -> list[dict]:
    """A wgmma backward tiling with TMA producers, most first: both kernels' (the dQ kernel's where
    asked, and it runs only where deterministic), the dK/dV kernel's, the dQ kernel's, then none;
    the dK/dV kernel's producer persistent first where asked (PERSISTENT_DKDV_MASKS), then not
    (where a second K/V slot does not fit)."""
    dq = {"dq_warp_specialized": DQ_PRODUCER} if tiling.get("deterministic") and dq_producer else {}
    kinds = [{"persistent": True}, {}] if persistent else [{}]
    fed = [{**tiling, "warp_specialized": ws, **extra} for extra in (dq, {}) for ws in kinds]
    fed += [{**tiling, **dq}, tiling]
    return [t for i, t in enumerate(fed) if t not in fed[:i]]


@cache
def trainable(spec: AttentionSpec, deterministic: bool = False, bias_grad: bool = False,
              captured_grads: tuple[int, ...] = ()) -> AttentionSpec:
    """`spec` with a backward: section (its own, or the tiling BACKWARD_TILINGS gives its
    head_dim), named <name>_bwd: what fagen.attention runs when gradients are wanted.
    deterministic: no two blocks add into one output (on sm_90a the dQ kernel rather than
    atomics): <name>_bwd_det. bias_grad: the bias's gradient too (<name>_bwd[_det]_dbias).
    captured_grads: the gradient of those captured arrays too (<name>_bwd..._dcaptured0 ...)."""
    wgmma = spec.wgmma_trains and (spec.backward is None or spec.backward.mma is None)
    two_widths = spec.dv != spec.head_dim
    # deterministic changes a kernel only where blocks would add into one element: atomic dQ
    # (sm_90a, V as wide as Q and K) and a bias's gradient
    deterministic = deterministic and (wgmma and not two_widths or bias_grad)
    captured_suffix = "".join(f"_d{name}" for i, name in enumerate(expression.captured_names(spec.score_mod.captured))
                              if i in captured_grads)
    if spec.backward is not None:  # its tiling, with what is asked on top
        own = spec.backward
        # captured_grads exactly as asked: the kernel adds into the sums its caller passes, one an array
        if (deterministic <= own.deterministic) and (bias_grad <= own.bias_grad) and tuple(
                sorted(captured_grads)) == own.captured_grads:
            return spec
        suffix = ("_det" if deterministic > own.deterministic else "") + ("_dbias" if bias_grad > own.bias_grad else "")
        if tuple(sorted(captured_grads)) != own.captured_grads:
            suffix += captured_suffix or "_dcaptured_none"
        return parse_spec({**spec.model_dump(), "name": spec.name + suffix, "backward": {
            **own.model_dump(), "deterministic": own.deterministic or deterministic,
            "bias_grad": own.bias_grad or bias_grad,
            "captured_grads": sorted(captured_grads)}}, f"trainable {spec.name}")
    data = {**spec.model_dump(), "name": f"{spec.name}_bwd{'_det' if deterministic else ''}{'_dbias' if bias_grad else ''}"
                                         f"{captured_suffix}"}
    base = BACKWARD_TILINGS[spec.row_width]  # mma.sync's: changes to the (wider) head's tiling
    tilings = [base] + [{**base, **change} for change in BACKWARD_FALLBACKS]
    if wgmma:  # whole tilings, in order; at head_dim 128 each with TMA producers first, where they fit
        first = WGMMA_TWO_WIDTHS_TILINGS[spec.row_width] if two_widths else WGMMA_BACKWARD_TILINGS[spec.head_dim]
        wgmma_tilings = [t for t in (first, *WGMMA_BACKWARD_FALLBACKS) if t.get("deterministic") or not deterministic]
        if spec.row_width in PRODUCER_BACKWARD_HEAD_DIMS:  # two widths: the dK/dV kernel's producer alone
            dq_producer = spec.head_dim in DQ_PRODUCER_HEAD_DIMS and not two_widths
            wgmma_tilings = [fed for t in wgmma_tilings
                             for fed in with_producers(t, spec.mask.kind in PERSISTENT_DKDV_MASKS, dq_producer)]
        # two widths: the mma.sync loops where registers refuse every wgmma tiling (160 accumulator
        # registers a thread at 192/128 leave a bias's gradient no room)
        tilings = wgmma_tilings + ([{**t, "mma": "mma_sync"} for t in tilings] if two_widths else [])
    refused = None
    for i, tiling in enumerate(tilings):
        # only the last tiling's refusal is shown: the others' search no fix
        with nullcontext() if i == len(tilings) - 1 else fixes_unsought():
            try:
                return parse_spec({**data, "backward": {"deterministic": deterministic, **tiling, "bias_grad": bias_grad,
                                                        "captured_grads": sorted(captured_grads)}},
                                  f"trainable {spec.name}")
            except SpecError as error:
                refused = error
    raise refused  # the smallest tiling's refusal: its advice is what no tiling here took


@cache
def trainable_alike(spec: AttentionSpec, like: AttentionSpec) -> AttentionSpec:
    """`spec` trained on `like`'s backward tiling (`like` is trainable): blocks whose dQ adds into
    one sum (backward.QueryRows.add: a ring's full steps beside its causal own block) must lay
    their rows out alike, and each mask's own choice may differ (a causal mask's registers refuse
    the full mask's tiling at d64 bfloat16). `like`'s tiling fits `spec` where `spec`'s mask costs
    no more registers than `like`'s; where it does not, its refusal says so."""
    if spec.backward == like.backward:
        return spec
    return parse_spec({**spec.model_dump(), "name": f"{spec.name}_bwd_as_{like.name}",
                       "backward": like.backward.model_dump()}, f"trainable {spec.name} as {like.name}")
