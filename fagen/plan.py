"""spec -> plan: every number the kernel derives from its spec, computed once, here.

Templates never compute: they print these numbers as `constexpr` and use the names. This
module is pure (no CuPy, no Jinja) and unit-tested.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import lru_cache

from fagen import expression
from fagen.mask_kinds import KINDS
from fagen.spec import (LANE_COLUMNS, HEAD_DIMS, MMA_K, MMA_M, MMA_N, SMEM_PER_BLOCK, WARPGROUP_THREADS,
                        AttentionSpec, Outputs, ScoreMod, Sequences, SpecError, most_consumer_registers, rule, with_fix)

CHUNK_ELEMS = 8  # one 16-byte cp.async / ldmatrix row = 8 half-precision elements (every KERNEL_TYPES entry)
PAD_ELEMS = 8  # padded rows shift by 16 bytes: ldmatrix's 8 row addresses hit 8 distinct bank groups
MAX_REGISTERS = 255
# The register estimate: the accumulators (O, S; Q's fragments when q_in_registers; wgmma: P of
# the previous tile) and what a kernel holds beside them -- addresses, loop and pipeline state,
# the mask's and the score modifiers' per-element temporaries -- as costs per term below,
# fitted by linear programming to 32,204 ptxas -v runs (scripts/register_sweep.py: random specs
# across the spec space, every tuner candidate of every shipped spec, the tilings variants fall
# back to; scripts/compile_matrix.py: every variant fagen.attention derives; sm_80, sm_86, sm_89,
# sm_90, sm_90a) so that every kernel that spilled, on any of those archs, is predicted at least
# REGISTER_MARGIN over MAX_REGISTERS and every shipped spec at most MAX_REGISTERS - 1. Close to
# the limit ptxas' allocation is not a function of these numbers (a d=256 tile spills with a
# bias and fits with bias and softcap), so the estimate refuses some kernels that would just
# fit: derived variants fall back to a smaller block_kv (fagen.variants.variant). notes/perf.md
# has the data and the fit.
REGISTER_MARGIN = {"mma_sync": 8, "wgmma": 4}  # the fit's; a record, not read
REGISTER_COSTS = {
    "mma_sync": {
        # base, by KV pipeline (kv_smem and stages): addresses, loop and pipeline state
        "shared1": 78.72, "shared2": 30.64, "separate1": 30.64, "separate2": 14.07, "separate3": 20.81,
        "s_expression": 0.3,  # measured, not fitted: see register_terms
        # each accumulator or fragment register, with its share of the rest
        "o": 1.52, "s": 1.77, "q": 1.06,
        # copy loops and hoisted swizzled offsets
        "few_threads": 25, "swizzle_q": 1.57, "swizzle_copy": 11.25, "chunk_copy": 2.36,
        # the mask's and the modifiers' state, held through the loop
        "sliding_window": 9.32, "chunked": 10.4, "prefix_lm": 11.64, "document": 9.32, "block_mask": 2.49,
        "bias": 10.31, "rows_document_causal": 0.99,
        # per S register: their per-element temporaries
        "s_causal": 0.11, "s_sliding_window": 0.29, "s_chunked": 0.16, "s_document": 0.29,
        "s_block_mask": 0.32, "s_softcap": 0.02, "s_alibi": 0.39, "s_bias": 0.48,
        "paged": 16,  # measured, not fitted: see register_terms
        "partial_d96": 2, "varlen_kv_d96": 9,  # measured, not fitted: see register_terms
        "one_warp": 22, "bias_shared_kv": 14, "rows32_d96": 18,  # measured, not fitted: see register_terms
        "fp8_kv_d256": -46, "varlen_q_rows32_d128": 5,  # measured, not fitted: see register_terms
    },
    "wgmma": {  # s covers P too (half of S, packed)
        # base, and per stage of the KV ring: addresses, loop and pipeline state
        "base": 34.33, "stages": 1.85,
        "s_expression": 1.0, "pattern_words": 1.0,  # measured, not fitted: see register_terms
        # each accumulator or fragment register, with its share of the rest
        "o": 1.04, "s": 1.77,
        # the mask's and the modifiers' state, held through the loop
        "causal": 0.15, "sliding_window": 1.78, "chunked": 5.15, "document": 9.73, "document_causal": 6.65,
        "block_mask": 8.65, "softcap": 8.99, "alibi": 4.74, "bias": 5.44, "sinks": 1.01,
        "paged": 40,  # measured, not fitted: see register_terms
        # per S register: their per-element temporaries
        "s_prefix_lm": 0.03, "s_block_mask": 0.02, "s_softcap": 0.01, "s_alibi": 0.04, "s_bias": 0.31,
    },
}
# A warp-specialised kernel's consumers (pipeline.warp_specialized) need their accumulators (O, S,
# and P of the previous tile, S / 2 packed) and this many more: the fewest consumer_registers at
# which ptxas -v reports no spill, found by bisection (sm_90a, f16, no mask, d64/128/256, block_kv
# 64-192; d64 with three consumer warpgroups at 160: 128 keys spill 32 bytes at 152, none at 160),
# was that sum plus 28 to 32; the mask's and modifiers' terms are the wgmma fit's, and a score
# modifier's kernels need a few more (d256 with 80 keys and a bias: 8 bytes spilled at 32).
WARP_SPECIALIZED_REST, WARP_SPECIALIZED_MODIFIER_REST = 32, 4
# ... and softcap's tanh on every score: measured, not fitted. Bisecting consumer_registers (sm_90a,
# f16 and bf16; d64 with 128-208 keys, d128 with 96-160, d256 with 48-80; two and three consumer
# warpgroups; no mask, causal, causal documents, sliding windows), softcap consumers with more
# than 40 S registers needed up to 12 registers over the fit's estimate, more with more S (d64 with
# 192 keys: 80 bytes at 232, none at 224 or 240), and not monotonically in the budget: a budget can
# spill where a smaller one fits. A quarter register per S register past 40 puts every budget that
# spilled below the estimate; up to 40 the estimate already had 4 to spare. (A branch-free tanh,
# ex2 and rcp, moved those spills rather than removing them.)
WARP_SPECIALIZED_SOFTCAP_S_FREE, WARP_SPECIALIZED_SOFTCAP_PER_S = 40, 0.25
# ... and, with a mask (its element test), never fewer than this: measured, not fitted. d64
# consumers (two or three warpgroups) with 48 or 64 keys and a sliding window, chunked, prefix-LM
# or causal mask spilled 4 to 112 bytes at 104 and 112 registers, which the estimate allowed, and
# fit at 120; with this floor no budget that spilled in those sweeps (d64 and d128, 32 to 96 keys,
# those masks and documents) is within the estimate.
WARP_SPECIALIZED_MASKED_FLOOR = 120
# ... and an accumulating consumer (outputs.accumulate: ring attention's running O) under a mask
# with ALiBi and a bias, which its main loop holds beside the fold's state: measured, not fitted (a
# fuzz run's finding: f16 d128, 128 x 112, two consumer warpgroups at 224, causal bottom-right,
# geometric ALiBi and a matrix bias, 4 bytes spilled at a predicted 213; its 95 neighbours, ptxas
# -v, nvcc 13.0: float16 and bfloat16 x accumulate, partial alone, plain x causal both aligns, no
# mask x ALiBi (slopes, geometric), a vector or matrix bias, both: only accumulate with a causal
# mask and both modifiers spilled, at 224 and 232, and fit at 240). Other masks priced alike.
ACCUMULATE_MASKED_MODIFIED = 20
# Kernels the estimate refuses that ptxas -v was run on (sm_80, sm_86, sm_89 and sm_90, f16 and
# bf16, nvcc 13.0): they fit, at the registers given (the most over those archs). The 32-rows-a-warp
# d=128 tiles (notes/perf.md: the fastest mma.sync tiles at d=128), no modifiers, full outputs
# (as split-KV partials they spill). tests/test_nvcc.py compiles each. Key: head_dim, block_q,
# block_kv, warps_q, kv_smem, stages, smem_layout, q_in_registers, mask kind.
MEASURED_FIT = {
    (128, 128, 32, 4, kv_smem, stages, "padded", False, kind): registers
    for kind, fits in (("none", {("separate", 1): 255, ("separate", 2): 253, ("separate", 3): 253, ("shared", 2): 255}),
                       ("causal", {("separate", 1): 255, ("separate", 2): 255, ("separate", 3): 255, ("shared", 2): 255}))
    for (kv_smem, stages), registers in fits.items()
}
# Warp-specialised consumers the estimate refuses that ptxas -v was run on (sm_90a, nvcc 13.0, f16
# and bf16 at two and three stages): they fit at the registers given. Head_dim 128's causal long
# class (192 x 80, three consumer warpgroups, ping-pong, persistent) fits at 152 with a softcap
# (1e-3 to 1e6), ALiBi (given or geometric slopes), both, and sinks beside them, as without them
# (144 spills with or without): the fit's modifier terms, from
# kernels that hold their state through longer loops, price it at 169-175. On the H200 it runs
# causal softcap 7-11% faster than the 128 x 128 tile it fell back to (notes/perf.md, 2026-12-01).
# Key: head_dim, block_q, block_kv, stages, mask kind, softcap, ALiBi (consumer_measured_key).
CONSUMERS_MEASURED_FIT = {
    (128, 192, 80, stages, "causal", softcap, alibi): 152
    for stages in (2, 3) for softcap, alibi in ((True, False), (False, True), (True, True))
}
MBARRIER_BYTES = 8
# The kernel's extern "C" symbol is the spec's name behind this prefix, so no name a spec can
# take (printf, min, uint4, a template's own elem_t ...) collides with C, CUDA or the kernel.
KERNEL_SYMBOL_PREFIX = "fagen_"


@dataclass(frozen=True)
class KernelPlan:
    name: str
    symbol: str  # the kernel's extern "C" name
    mma: str  # "mma_sync" (warp-wide m16n8k16) or "wgmma" (warpgroup-wide m64nNk16, sm_90a)
    threads: int
    warps: int
    block_q: int
    block_kv: int
    head_dim: int  # Q's and K's width
    head_dim_v: int  # V's and O's width (head_dim unless the spec's head_dim_v differs)
    m_frags: int  # m16 fragments per warp along the queries
    s_n_frags: int  # n8 fragments of a warp's S tile (its keys)
    o_n_frags: int  # n8 fragments of a warp's O tile (head_dim_v)
    mma_k: int  # an MMA's k: the element type's for the instruction (16 for half types; FP8's wgmma 32)
    qk_k_steps: int  # k steps of Q.K^T (over head_dim)
    pv_k_steps: int  # k steps of P.V (over a warp's keys of a tile)
    smem_row: int  # elements between consecutive rows of a smem tile (wgmma: of a swizzle atom)
    atoms_per_row: int  # wgmma: 128-byte swizzle atoms across a tile's row (an 8-row group's stride)
    chunks_per_row: int  # 16-byte chunks in one row of Q or K (head_dim)
    v_chunks_per_row: int  # ... of V or O (head_dim_v)
    q_tile_elems: int
    kv_tile_elems: int
    kv_slots: int  # smem KV tiles in the ring (see kv_pipeline in templates)
    kv_stages: int  # wgmma: K tiles (and V tiles) in flight or resident
    warpgroups: int  # wgmma: warpgroups of 64 query rows
    pingpong: bool  # wgmma: the two warpgroups take turns on the tensor cores
    mask_lane_words: int  # 32-bit words of a row of a block mask's PARTIAL pattern a thread reads (masks.thread_words)
    mask_prepares_tiles: bool  # the loops call Mask::prepare_tile before a tile's S MMAs (MaskKind.prepares_tiles)
    kv_tiles_listed: bool  # Mask::kv_tile reads a list in global memory (MaskKind.lists_tiles)
    smem_bytes: int
    smem_limit: int
    seed_budget_bytes: int  # seed 002: (2 Bc d + Br d + Br Bc) elements
    predicted_registers: int
    blocks_per_sm_by_smem: int
    mask_params: tuple[tuple[str, str], ...]  # (C type, name) kernel parameters the mask reads
    score_params: tuple[tuple[str, str], ...]  # ... that the score modifiers read
    sink_params: tuple[tuple[str, str], ...]  # (partials leave sinks to the merge)
    split_params: tuple[tuple[str, str], ...]  # split-KV partials: tiles a split, output strides
    # outputs.merge_splits: the merged out and LSE, the tiles' arrival counts (and sinks, which join there)
    merge_params: tuple[tuple[str, str], ...]
    row_quads: int  # outputs.merge_splits: 4-float pieces of a row of O (the merge's loads)
    split_merge_floats: int  # ... a thread's share of a row's merge, in the idle KV ring
    split_merge_batch: int  # ... splits whose loads a thread issues before it folds them
    # outputs.accumulate: rows of a fragment (2, or 1 where the registers are short) whose running O
    # and LSE load before any is written back
    fold_rows: int
    sequence_params: tuple[tuple[str, str], ...]  # varlen and paged: where each sequence's rows are
    sequence_offset: bool  # varlen and paged, aligned bottom right: each block moves the diagonal to its sequence's
    # varlen q, unpacked: the grid's y walks the batch's query tiles, read from a table built once a
    # call (fagen.sequences.query_tiles), not B x the longest sequence's tiles
    sequence_tiles: bool
    pack_gqa: bool  # a KV head's query heads share a tile's rows (tiling.pack_gqa)
    # decode kernels (GQA-packed): launched to overlap the previous kernel's end (fagen.dependent_launch)
    dependent_launch: bool
    # What the templates print beside the numbers above (0 where a main loop has no use for it).
    mainloop: str  # the templates' main-loop folder: "sm80" (mma.sync) or "sm90" (wgmma)
    smem_align: int  # bytes the dynamic smem base is aligned to
    warp_rows: int  # query rows a warp owns
    warps_q: int  # warps along the query rows
    warps_kv: int  # warps along the keys: each takes warp_keys keys of every tile
    warp_keys: int
    key_merge_floats: int  # warps_kv > 1: the floats a lane hands the first warp (its O, a max and sum a row half)
    element_bytes: int
    p_log2_scale: float  # P's scale before its rounding to an FP8 A operand, log2 (element type's; 0 otherwise)
    exp2_poly_every: int  # every this many n8 fragments of S, exp2 runs as a polynomial on the FMA pipe (0: never)
    uniform_warp_index: bool  # the forward's warp index shuffled from lane 0 (UNIFORM_WARP_INDEX_FROM_HEAD_DIM)
    kv_tile_bytes: int  # one KV tile in smem: the stride between ring slots
    v_tile_bytes: int  # ... of V's own ring (warp-specialised: V's width; else kv_tile_bytes)
    q_tile_bytes: int  # wgmma: the bytes of Q a tile loads (head_dim wide: a producer's expect_tx)
    k_load_bytes: int  # wgmma: ... of K (head_dim wide)
    v_load_bytes: int  # wgmma: ... of V (head_dim_v wide)
    qk_atoms: int  # wgmma: 64-column boxes (swizzle atoms) across a Q or K row ...
    v_atoms: int  # ... and across a V row
    v_key_boxes: int  # FP8: V^T's boxes a tile (one swizzle atom's row of keys each; the last one's tail unread)
    v_key_box_bytes: int  # FP8: ... and the bytes of one (head_dim_v rows)
    copy_rows_per_pass: int  # tile rows all threads copy in one pass; 0: a row's chunks do not divide the threads
    v_copy_rows_per_pass: int  # ... of V
    kv_chunk_elems: int  # K's and V's elements in a 16-byte chunk (16 for an FP8 KV cache, else 8)
    kv_chunks_per_row: int  # ... and chunks in a row of them
    kv_copy_rows_per_pass: int  # their copy's rows a pass (copy_rows_per_pass of K's and V's rows)
    q_chunk_elems: int  # q's elements in a 16-byte chunk (16 for an FP8 q widened as it lands, else 8)
    q_chunks_per_row: int  # ... and chunks in a row of it
    out_chunks_per_warp: int  # 16-byte chunks of a warp's rows of O (the epilogue's stores)
    s_acc_regs: int  # f32 accumulator registers a thread holds for S
    o_acc_regs: int  # ... and for O
    warpgroup_warps: int  # wgmma: warps of one warpgroup (64 query rows, 16 a warp)
    atom_elems: int  # wgmma: elements of one 128-byte swizzle atom (8 rows x 64)
    atom_bytes: int  # wgmma: bytes of one atom: V's leading byte offset
    row_group_bytes: int  # wgmma: 8 rows of a tile (atoms_per_row atoms): the stride byte offset
    k_step_bytes: int  # wgmma: bytes a k16 step of Q.K^T moves along an atom's rows
    k_steps_per_atom: int  # wgmma: k16 steps within one atom, before the next atom
    v_step_bytes: int  # wgmma: bytes between the k16 steps of P.V (16 keys: two row groups)
    warpgroup_q_bytes: int  # wgmma: bytes between the warpgroups' rows of the Q tile
    kv_ring_bytes: int  # wgmma: K's ring of kv_stages tiles (V's ring follows it, then the mbarriers)
    v_ring_bytes: int  # wgmma: V's ring (kv_stages tiles of v_tile_bytes)
    mbarrier_bytes: int  # wgmma: one mbarrier
    q_atom_step_bytes: int  # wgmma: from one 64-column block of Q's head_dim to the next
    k_atom_step_bytes: int  # wgmma: ... of K's (Q.K^T's k steps move along both)
    v_lead_bytes: int  # wgmma: V's leading byte offset, between its 64-column blocks
    atom_columns: int  # wgmma: columns of a swizzle atom (a TMA box's width)
    atom_row_bytes: int  # wgmma: bytes of one of its rows
    column_blocks: bool  # wgmma: tiles laid out as TMA boxes of 64 columns write them (wgmma_numbers)
    # warp specialisation (pipeline.warp_specialized): consumer warpgroups compute, a producer
    # warpgroup after them loads through TMA; otherwise every thread is a consumer and copies
    warp_specialized: bool
    # a ranged cache's TMA loads (sequences.kv ranged): a sequence's last tile runs past its keys
    # into slots it does not own, whose V rows the consumers zero before P.V reads them
    clears_rows_past_keys: bool
    # a consumer warpgroup runs S, the softmax and P.V only for the KV steps its own rows see
    # (MaskKind.ends_by_row): the tile's later steps, the lower rows' diagonal, keep just their
    # turns and stages for it, and the tensor cores go to the warpgroups that need them
    trims_warpgroup_steps: bool
    clear_barrier: int  # ... its named barriers' first id, one a consumer warpgroup
    consumer_threads: int
    producer_registers: int  # setmaxnreg targets (0: not warp-specialised)
    consumer_registers: int
    tma_params: tuple[tuple[str, str], ...]  # the tensor maps of q, k and v
    # the tile scheduler (warp-specialised kernels): a block walks tiles of the launch's tile grid
    # (scheduler_params), one per block or, persistent, one block per SM over all of them
    scheduler_params: tuple[tuple[str, str], ...]
    persistent: bool
    # persistent over tiles of different costs (has_claimed_walk): past its first tile a block
    # claims the next from a counter, so each walks until the tiles run out
    claimed_walk: bool
    # causal tiles end at n_q (end_aligned_tiles): a partial tile is the lightest, not the heaviest
    end_aligned_tiles: bool
    # O goes through the Q tile to 16-byte row stores; not where the Q tile is refilled for the
    # next tile (persistent), nor for f32 partials, nor where O's rows are wider than Q's (FP8 q,
    # bfloat16 o): those store straight from registers
    output_staged: bool
    input_params: tuple[tuple[str, str], ...]  # q, k, v (unless TMA maps stand in), o, lse, shape, strides, scale

    @property
    def extra_params(self) -> tuple[tuple[str, str], ...]:
        """Kernel parameters after the fixed ones, in signature order (the runtime packs these)."""
        return (self.mask_params + self.score_params + self.sink_params + self.split_params + self.merge_params
                + self.sequence_params + self.scheduler_params + self.tma_params)

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        """(C type, name) of every kernel parameter in signature order: the inputs it reads
        (input_params), then extra_params. The template prints the signature from it; the
        runtime packs a launch by these names; no parameter is one the kernel does not read."""
        return self.input_params + self.extra_params

    def tiles(self, b: int, hq: int, hkv: int, nq: int, splits: int, total_q: int | None = None
              ) -> tuple[int, int, int]:
        """A launch's tiles: x a block per (batch, query head), or per (batch, KV head) where the
        group's heads are packed into the tile rows; y: tiles of those rows; z: KV splits. The
        grid, where a block computes one tile. A varlen batch's tile table (sequence_tiles):
        x a query head, y the table's entries (total_q rows in b sequences)."""
        if self.sequence_tiles:
            if total_q is None:
                raise ValueError(f"kernel {self.name} reads a varlen batch's tile table: its tiles need total_q")
            return hq, query_tile_slots(total_q, b, self.block_q), splits
        if self.pack_gqa:
            return b * hkv, math.ceil(nq * (hq // hkv) / self.block_q), splits
        return b * hq, math.ceil(nq / self.block_q), splits

    def as_dict(self) -> dict:
        return asdict(self)


def merge_params(spec: AttentionSpec) -> tuple[tuple[str, str], ...]:
    """outputs.merge_splits: where the merging split writes (out like q, any strides; the LSE
    [B, Hq, Nq]), the arrival count of each tile (zeros before a launch; the merging split
    resets its own), and the sinks, which join the merge as they would the merge kernel."""
    if not spec.outputs.merge_splits:
        return ()
    return ((("elem_t* __restrict__", "merged_o"), ("long long", "merged_sb"), ("long long", "merged_sh"),
             ("long long", "merged_sn"), ("float* __restrict__", "merged_lse"), ("int* __restrict__", "split_counts"))
            + (((FLOAT_PTR, "sinks"),) if spec.score_mod.sinks else ()))


def fold_rows(o_regs: int, head_dim: int, register_limit: int) -> int:
    """An accumulating kernel's epilogue: a fragment's two rows' running O (f32 pairs) loaded at
    once where O, they and twice WARP_SPECIALIZED_REST fit the registers, else one row at a time
    (a store to one row holds back the next row's loads: a DRAM round trip each). With the rest
    counted once, the d128 long class's consumers (160 registers) took two rows and spilled 180
    bytes."""
    both = 2 * (head_dim // MMA_N) * 2
    return 2 if o_regs + both + 2 * WARP_SPECIALIZED_REST <= register_limit else 1


def kv_slots(spec: AttentionSpec) -> int:
    """Tiles in the KV ring. Loads stream K0, V0, K1, V1, ... through it, each issued as soon as
    its slot is free. One slot is the seed's shared-KV (K, then V into the same buffer);
    `separate` gives K and V their own buffers, `stages` each: interleaved in one ring that is
    2 * stages slots, so K always lands in even slots and V in odd ones."""
    return spec.pipeline.stages * (2 if spec.pipeline.kv_smem == "separate" else 1)


FLOAT_PTR = "const float* __restrict__"
# Paged KV: page sizes are multiples of PAGE_ROWS keys, so a tile's 16-key groups never straddle pages
PAGE_ROWS = 16
# Flags a paged kernel ORs into its status word (templates/common/kv_rows.cu.j2; fagen.sequences)
PAGE_OUT_OF_RANGE = 1  # a page id outside [0, num_pages): its rows loaded as zeros
SEQLEN_OVER_TABLE = 2  # cache_seqlens past its table row (max_pages * page_size): cut to it
INT_PTR = "const int* __restrict__"
# Named barriers: 0 is __syncthreads, 1 .. 3 the ping-pong turns (TURN_BARRIER + warpgroup); the
# consumers' clearing of a ranged sequence's last V rows takes CLEAR_BARRIER + warpgroup
CLEAR_BARRIER = 8
INT2_PTR = "const int2* __restrict__"
# A TMA tensor map (CUtensorMap, 128 opaque bytes the host encodes) passed by value: TMA reads it
# from the kernel's parameter space, where __grid_constant__ keeps it
TMA_MAP = "const __grid_constant__ TmaMap"
# The tile grid a warp-specialised kernel's blocks walk (templates/sm90/tile_scheduler.cu.j2):
# x batch * heads, y query tiles, z KV splits, as the grid of a block-a-tile launch; walked a
# section of tiles_section x's at a time (l2_section)
SCHEDULER_PARAMS = (("int", "tiles_x"), ("int", "tiles_y"), ("int", "tiles_z"), ("int", "tiles_section"))
# A claimed walk's producer holds the claim beside the mask's state across its loop: at 24
# registers ptxas spills 4-20 bytes of it for block masks, windows, documents and d64's softcap
# variant (nvcc 13.0), at 32 none; an accumulating kernel's producer, which also prefetches the
# running O and LSE, spilled 24 bytes at 32 and none at 40, and so did a split-KV partial's over
# KV tiles of a width that is no power of two (its split bounds divide by it: 8-24 bytes at 96, 160
# and 192 keys, head_dim 64 and 128, with and without ALiBi; none at 32, 64, 128; a fuzz run found
# it), and so did a split-KV partial's under a block mask at head_dim 64 (its tile list read a step
# ahead beside the split's bounds: 12-16 bytes at 32-128 keys, with and without ALiBi, none at 40;
# head_dim 128 none at 32; a fuzz run found it). The consumers give up what that takes.
CLAIMING_PRODUCER_REGISTERS = 32
CLAIMING_WIDE_PRODUCER_REGISTERS = 40
# A claimed walk's counters: tiles claimed past the first wave, then blocks done claiming (both
# zero before the launch and after it; null where the walk is one wave)
CLAIMED_WALK_PARAMS = (("unsigned* __restrict__", "tiles_claimed"),)
# The share of L2 a section's K and V may take: the rest holds Q, O and the TMA's other traffic
L2_SECTION_SHARE = 0.5
# Uneven tiles (a mask's) are walked in sections only up to this many query tiles a head: walked
# a section at a time, longer heads' heaviest tiles start late and end the launch unevenly
# (H200 A/B, causal at 4k-16k: -2 to -19%; at 512-1k keys, 4-8 tiles a head: up to +23%)
UNEVEN_SECTION_TILES_Y = 8


def l2_section(tiles_x: int, tiles_y: int, kv_bytes_per_x: int, l2_bytes: int, even_tiles: bool) -> int:
    """How many x's (heads) the tile walk takes at a time, y fastest within them. Walked x fastest
    over every head, the blocks in flight read every head's K and V at once and mostly miss L2
    (ncu, d128 N = 4k: 36% hits against 77% in sections; DRAM traffic 3.8x).
    - Even tiles: one head at a time (FlashAttention-2's order): its query tiles run side by side
      and read its K and V once from DRAM (H200, d256 N = 512: +9% over sections of 120 heads).
    - Uneven tiles up to UNEVEN_SECTION_TILES_Y a head: as many heads as keep their K and V within
      L2_SECTION_SHARE of L2, so that a section's heaviest tiles, from all its heads, go first
      (one head at a time: causal N = 1k -28%).
    - Longer uneven tiles: one section, x fastest, every head's heaviest tiles first."""
    if even_tiles:
        return 1
    if tiles_y > UNEVEN_SECTION_TILES_Y:
        return tiles_x
    return l2_heads(tiles_x, kv_bytes_per_x, l2_bytes)


def l2_heads(heads: int, bytes_per_head: int, l2_bytes: int) -> int:
    """How many heads' bytes_per_head fit in L2_SECTION_SHARE of L2: at least 1, at most `heads`."""
    return max(1, min(heads, int(l2_bytes * L2_SECTION_SHARE) // max(1, bytes_per_head)))


def has_sequence_tiles(spec: AttentionSpec) -> bool:
    """Whether the kernel walks a varlen batch's tiles (grid y: the tile table's entries; q_tiles:
    entry y is tile y's (sequence, first row), the longest sequences first, (-1, 0) past the
    batch's tiles; q_tiles null where they fit one wave, the kernel numbering them itself):
    varlen q, a query head a tile. A grid of B x the longest sequence's tiles spends a block on
    each tile past a shorter sequence's end (10.8% of a causal prefill with 6 of 14 tiles a head
    empty), and a persistent walk over it is uneven; over the table it is not (causal varlen
    +5-27%, H200, notes/perf.md). GQA-packed decode tiles keep their grid: a few rows a sequence."""
    return spec.sequences.q == "varlen" and not spec.tiling.pack_gqa


def has_claimed_walk(spec: AttentionSpec) -> bool:
    """Whether a persistent kernel's blocks claim their tiles past the first from a counter
    (tiles_claimed) rather than take every gridDim.x-th: where the tiles' costs differ, a varlen
    batch's tile table (a sawtooth: each sequence's latest rows first, the sequences by length) or
    a mask's uneven tiles (causal: every head's heaviest first). Claiming in walk order is list
    scheduling, heaviest first: the busiest SM within 1% of the mean where a static share left it
    7-17% over for 16 causal sequences of 300-1900 rows and ~6% over for padded causal grids of
    16-128 tiles a head (simulations of the walk). Measured (H200, causal, notes/perf.md): 16
    mixed sequences of ~1024 rows 5-11% faster at d128, 12% at d64, 17% at d256. The counter
    comes zeroed to the launch, which leaves it so (tile_scheduler's release).
    A claim costs the producer registers (claiming_producer_registers): where the consumers then
    keep fewer than they are predicted to hold (the FP8 forward's 128 x 128 tiles at d256: 240,
    against 232 beside a 32-register producer), the blocks walk statically (every gridDim.x-th
    tile), the split the spec's."""
    ws = spec.pipeline.warp_specialized
    if not (ws and ws.persistent and (has_sequence_tiles(spec) or not KINDS[spec.mask.kind].even_tiles)):
        return False
    producer = claiming_producer_registers(spec)
    return ws.producer_registers >= producer or _predicted(spec) <= _consumers_beside(spec, producer)


def claiming_producer_registers(spec: AttentionSpec) -> int:
    """The fewest registers a claimed walk's producer thread takes (CLAIMING_PRODUCER_REGISTERS'
    note)."""
    block_kv = spec.tiling.block_kv
    dividing = spec.outputs.partial and block_kv & (block_kv - 1)  # split bounds over a width no power of two
    listed = spec.outputs.partial and spec.mask.kind == "block_mask"  # ... or beside a block mask's tile list
    wide = spec.outputs.accumulate or dividing or listed
    return CLAIMING_WIDE_PRODUCER_REGISTERS if wide else CLAIMING_PRODUCER_REGISTERS


def _consumers_beside(spec: AttentionSpec, producer: int) -> int:
    """The consumers' setmaxnreg beside a producer at `producer` registers: the spec's, at most
    what then remains (240 -> 232 beside two warpgroups and 32; 160 stays beside three, 152 beside
    40)."""
    return min(spec.pipeline.warp_specialized.consumer_registers,
               most_consumer_registers(spec.tiling.warps_q // 4, producer))


def register_split(spec: AttentionSpec) -> tuple[int, int]:
    """setmaxnreg's (producer, consumer) registers a thread: the spec's, but a claimed walk's
    producer at claiming_producer_registers at least, the consumers under what then remains;
    (0, 0) where the kernel is not warp-specialised."""
    ws = spec.pipeline.warp_specialized
    if not ws:
        return 0, 0
    producer = claiming_producer_registers(spec) if has_claimed_walk(spec) else 0
    if ws.producer_registers >= producer:
        return ws.producer_registers, ws.consumer_registers
    return producer, _consumers_beside(spec, producer)


# A varlen call of one wave numbers its tiles in the kernel (templates/common/numbered_tiles),
# each role's walk reading cu_seqlens_q this many entries at a time: the most the d64 consumers'
# registers hold beside the tile without spilling (4 spilled 8 bytes, ptxas -v, nvcc 13.0).
NUMBERED_LOADS = 2


def query_tile_slots(total_q: int, batch: int, block_q: int) -> int:
    """Entries of a varlen batch's tile table: at least its tiles, sum_b ceil(n_b / block_q),
    which is at most (total_q + batch (block_q - 1)) / block_q."""
    return max(1, (total_q + batch * (block_q - 1)) // block_q)


def sequence_params(spec: AttentionSpec) -> tuple[tuple[str, str], ...]:
    """The kernel parameters that locate each sequence's rows (spec.sequences), after the fixed
    ones. varlen q: cu_seqlens_q, and total_q for LSE's [Hq, total_q]; varlen K/V: cu_seqlens_k
    (with seqused_k: each sequence's key count, and total_k);
    paged K/V: the page table (max_pages entries a sequence, page_table_stride apart), the page
    size and count, cache_seqlens, and a status word the kernel flags bad page ids in; ranged
    K/V: cache_seqlens and cache_leftpad, each sequence's last key + 1 and first key."""
    seq, params = spec.sequences, ()
    if seq.q == "varlen":
        params += ((INT_PTR, "cu_seqlens_q"), ("int", "total_q"))
    if has_sequence_tiles(spec):  # the tile table, or null: the kernel numbers the batch's tiles
        params += ((INT2_PTR, "q_tiles"), ("int", "batch"))
    if seq.kv == "varlen":
        params += ((INT_PTR, "cu_seqlens_k"),)
    if seq.seqused_k:  # each sequence's keys, clamped to k's rows: unchecked counts never read past them
        params += ((INT_PTR, "seqused_k"), ("int", "total_k"))
    elif seq.kv == "paged":
        params += ((INT_PTR, "page_table"), ("int", "page_table_stride"), ("int", "max_pages"), ("int", "page_size"),
                   ("int", "num_pages"), (INT_PTR, "cache_seqlens"), ("int* __restrict__", "status"))
    elif seq.kv == "ranged":
        params += ((INT_PTR, "cache_seqlens"), (INT_PTR, "cache_leftpad"))
    return params


def score_params(spec: AttentionSpec) -> tuple[tuple[str, str], ...]:
    mod = spec.score_mod
    params: tuple[tuple[str, str], ...] = ()
    if mod.alibi != "none":
        params += ((FLOAT_PTR, "alibi_slopes"),)
    if mod.bias != "none":
        params += ((FLOAT_PTR, "bias"), ("long long", "bias_sb"), ("long long", "bias_sh"), ("long long", "bias_sq"))
    for name in expression.captured_names(mod.captured):
        params += ((FLOAT_PTR, name), ("int", f"{name}_size"))
    return params


def register_terms(spec: AttentionSpec, o_regs: int, s_regs: int, q_regs: int, threads: int) -> dict[str, float]:
    """The amounts REGISTER_COSTS prices, for this spec (see there)."""
    t, d, mask, mod = spec.tiling, spec.head_dim, spec.mask, spec.score_mod
    kind = "document_causal" if mask.kind == "document" and mask.causal else mask.kind
    state = {kind: 1.0} if kind != "none" else {}
    state.update({name: 1.0 for name, on in (("softcap", mod.softcap is not None), ("alibi", mod.alibi != "none"),
                                             ("bias", mod.bias != "none"),
                                             ("sinks", mod.sinks and not spec.outputs.partial)) if on})
    terms = {"o": o_regs, "s": s_regs, "q": q_regs, **state,
             **{f"s_{name}": s_regs for name in state if name not in ("sinks", "document_causal")}}
    # An expression is user code run on every pair of every tile, beside the kind's own test: not
    # in the fitted data, so priced from ptxas -v on the shipped defaults with and without one
    # (sm_90a d128: 208 -> 255 registers and a spill; mma.sync: +3 to +6), with room to spare.
    terms["s_expression"] = s_regs * ((mask.expression is not None) + (mod.expression is not None))
    # A paged cache's rows (the page table's state, a tile's group addresses): not in the fitted data;
    # priced from ptxas -v, paged against varlen variants of the shipped specs (sm_90a d64 and d128:
    # +37, +38; mma.sync: +7 to +14), with room to spare.
    terms["paged"] = float(spec.sequences.kv == "paged")
    # A split-KV partial's outputs and a varlen cache's rows at head_dim 96 on mma.sync (its 12
    # n8 fragments a row): measured (ptxas -v, nvcc 13.0, sm_89; a fuzz run's finding and 74
    # neighbours: head_dim 64, 96, 128 x block_q 64-160 x block_kv 32-64 x partial or not x padded
    # or varlen keys): at 128-160 queries and 48 keys, predicted 254, either or both spilled 16-44
    # bytes where the padded whole-output kernel fit at 251-253. At 64 and 128 they cost 0-8
    # registers below the limit, and a shipped partial (d128, 128 x 128) fits at its predicted 255.
    # A varlen cache at 48 keys, swept again after a second finding (seed 30110: 224 queries,
    # causal, sinks, seqused_k; 44 bytes at 255, predicted 254): 128-224 queries, causal or no
    # mask, sinks or not, with or without seqused_k spilled 40-44 bytes at a predicted 249-254 on
    # sm_80, where the padded kernel fit: 9 registers, the least that refuses them all.
    terms["partial_d96"] = float(spec.outputs.partial and d == 96)
    terms["varlen_kv_d96"] = float(spec.sequences.kv == "varlen" and d == 96)
    # A block mask's PARTIAL pattern: a thread loads a word of 32 keys for each of its rows (2 an
    # m16 fragment) and each 32 keys of the tile, all held through the element test. Measured, not
    # fitted (the fitted data held few block masks beside a modifier): on wgmma (sm_90a d128, 64 x
    # 128) a block mask takes 16 registers over none where the fit gives 10, and with a vector
    # bias spilled 12 bytes at a predicted 253; mma.sync's per-S cost already covers it.
    terms["pattern_words"] = (2 * (2 * o_regs // spec.dv) * -(-t.block_kv // 32)) if kind == "block_mask" else 0
    if kind == "document_causal":  # both document masks test elements alike; the causal one keeps
        terms["s_document"] = s_regs  # a row start per accumulator row (2 an m16 fragment)
        terms["rows_document_causal"] = 2 * o_regs // (spec.dv // 2)
    if spec.wgmma:
        return {**terms, "base": 1.0, "stages": spec.pipeline.stages}
    chunks = d // CHUNK_ELEMS
    swizzled = spec.smem_layout == "swizzled"
    copy_offsets = 0
    if swizzled and threads % chunks == 0:  # rows_per_pass rows a pass; row % 8 repeats every 8 / gcd
        rows_per_pass = threads // chunks
        copy_offsets = min(-(-t.block_kv // rows_per_pass), 8 // math.gcd(rows_per_pass, 8))
    # A block of one warp copies each tile alone (a 128-key d64 K tile: 32 chunks a thread) and
    # holds more of it than the fit (two warps and up) saw: measured, not fitted (ptxas -v, nvcc
    # 13.0, sm_86; a fuzz run's finding and 72 neighbours: 16 or 32 queries x 80-128 keys x no
    # mask, causal or chunked x softcap or not x partial or not): one warp ran 2-22 registers over
    # the estimate and spilled 4-76 bytes at a predicted 246-254; two warps stayed 3-49 under it.
    # A score bias beside K and V sharing their ring slots (kv_smem shared): measured, not fitted
    # (ptxas -v, nvcc 13.0, sm_89; a fuzz run's finding, a block mask with a matrix bias at head_dim
    # 128, 128 x 64, 24 bytes at 255, predicted 246, and 23 neighbours: 48 and 64 keys x shared or
    # separate x block mask, causal or none x bias or not): beside shared slots a bias ran 11-20
    # registers over the estimate, beside separate ones 11-49 under it.
    terms["bias_shared_kv"] = float(mod.bias != "none" and spec.pipeline.kv_smem == "shared")
    # Head_dim 96 at 32 rows a warp (two m16 fragments of 12 n8 fragments of O each): measured, not
    # fitted (ptxas -v, nvcc 13.0, sm_89 and sm_90; a fuzz run's finding, seed 8675309: 96 x 32, a
    # paged cache, split-KV merged in the kernel, causal: 4 bytes at 255 on sm_90, predicted 238;
    # and 269 neighbours: 64-128 queries x 32-64 keys x 16 or 32 rows a warp x padded, varlen or
    # paged keys x whole, partial or merged outputs x causal or none). At 32 rows a warp sm_90's
    # builds ran up to 17 registers over the estimate, and 7 kernels predicted at or under 255
    # spilled 4-32 bytes; at 16 rows a warp none came near the limit. 18 refuses all 7.
    terms["rows32_d96"] = float(d == 96 and 2 * o_regs // spec.dv == 2)
    # An FP8 KV cache's decode kernel at head_dim 256, 16 rows and 16 keys a warp (its only tiling:
    # O's 128 registers leave no room for more keys): measured, not fitted (ptxas -v, nvcc 13.0,
    # sm_90; 156 builds: none, causal either way, window, chunked, prefix-LM x none, softcap, ALiBi,
    # both x split, merged, unsplit, half ring, paged, varlen-paged x bfloat16 / e4m3 and float16 /
    # e5m2): every one at 255 with no spill, where the fit (swizzled rows, two stages) says 270-301.
    terms["fp8_kv_d256"] = float(spec.fp8_kv and d == 256 and s_regs <= 8 and 2 * o_regs // spec.dv == 1)
    # Varlen queries at head_dim 128 and 32 rows a warp: measured, not fitted (ptxas -v, nvcc 13.0,
    # sm_90; a fuzz run's finding, seed 90909: 256 x 32, shared slots, three stages, causal, 8
    # bytes at 255, predicted 254; and 63 neighbours: 4 or 8 warps x 32 or 64 keys x shared or
    # separate x 2 or 3 stages x varlen or padded q x causal or none). Five varlen kernels
    # predicted 251-255 spilled 8-32 bytes where their padded twins fit; 5 refuses them all (and,
    # on the conservative side, four varlen ones at 251-255 that fit). No shipped d128 tiling runs
    # 32 rows a warp.
    terms["varlen_q_rows32_d128"] = float(spec.sequences.q == "varlen" and d == 128 and 2 * o_regs // spec.dv == 2)
    return {**terms, f"{spec.pipeline.kv_smem}{spec.pipeline.stages}": 1.0,
            "few_threads": float(threads <= 64), "one_warp": float(threads == 32),
            "swizzle_q": (d // MMA_K) if swizzled and not spec.pipeline.q_in_registers else 0,
            "swizzle_copy": copy_offsets, "chunk_copy": float(threads % chunks != 0)}


def measured_key(spec: AttentionSpec) -> tuple | None:
    """spec's key in MEASURED_FIT, or None where it is not a kernel of that kind."""
    t, p, m = spec.tiling, spec.pipeline, spec.mask
    if (spec.wgmma or spec.score_mod != ScoreMod() or spec.outputs != Outputs() or m.expression
            or m.align != "bottom_right" or spec.dv != spec.head_dim):
        return None
    return (spec.head_dim, t.block_q, t.block_kv, t.warps_q, p.kv_smem, p.stages, spec.smem_layout, p.q_in_registers, m.kind)


def consumer_measured_key(spec: AttentionSpec) -> tuple | None:
    """spec's key in CONSUMERS_MEASURED_FIT, or None where it is not a kernel of the kind measured:
    a half-type, ping-pong, persistent wgmma forward over padded tensors writing whole outputs,
    with no bias, expression or captured array (sinks cost its loop nothing)."""
    t, p, m, mod = spec.tiling, spec.pipeline, spec.mask, spec.score_mod
    if (not spec.warp_specialized or not p.pingpong or not p.warp_specialized.persistent or spec.element.is_fp8
            or spec.kv_element.is_fp8 or spec.outputs != Outputs() or spec.sequences != Sequences()
            or m.expression or m.align != "bottom_right" or mod.bias != "none" or mod.expression or mod.captured
            or spec.dv != spec.head_dim or t.warps_kv != 1):
        return None
    return (spec.head_dim, t.block_q, t.block_kv, p.stages, m.kind, mod.softcap is not None, mod.alibi != "none")


def predict_registers(spec: AttentionSpec, o_regs: int, s_regs: int, q_regs: int, threads: int) -> int:
    measured = MEASURED_FIT.get(measured_key(spec), CONSUMERS_MEASURED_FIT.get(consumer_measured_key(spec)))
    if measured is not None:
        return measured
    costs = REGISTER_COSTS["wgmma" if spec.wgmma else "mma_sync"]
    terms = register_terms(spec, o_regs, s_regs, q_regs, threads)
    if spec.warp_specialized:  # the consumers hold no copy state: their accumulators and a fixed rest
        # (a block mask's pattern words too: d64 with 192 keys fits at 208, under the fit's terms alone)
        # Sinks join the row sum in the epilogue, after S and P are dead: nothing held through the loop
        # (ptxas -v, nvcc 13.0: d64's long class, 192 x 128 at 160, 0 spills with them as without).
        kept = {name: amount for name, amount in terms.items()
                if name not in ("base", "stages", "o", "s", "pattern_words", "sinks")}
        mod = spec.score_mod
        masked = spec.mask.kind != "none" or spec.mask.expression is not None
        main_loop = (o_regs + s_regs + p_registers(spec, s_regs) + WARP_SPECIALIZED_REST
                     + WARP_SPECIALIZED_MODIFIER_REST * mod.changes_scores
                     + WARP_SPECIALIZED_SOFTCAP_PER_S * max(0, s_regs - WARP_SPECIALIZED_SOFTCAP_S_FREE)
                     * (mod.softcap is not None)
                     + ACCUMULATE_MASKED_MODIFIED * (spec.outputs.accumulate and masked and mod.alibi != "none"
                                                     and mod.bias != "none")
                     + sum(costs.get(name, 0.0) * amount for name, amount in kept.items()))
        return int(max(main_loop, accumulate_epilogue(spec, o_regs, s_regs), WARP_SPECIALIZED_MASKED_FLOOR * masked))
    return int(sum(costs.get(name, 0.0) * amount for name, amount in terms.items()))


def p_registers(spec: AttentionSpec, s_regs: int) -> int:
    """wgmma: P of the previous tile, packed as P.V's A operand while S is live: two half-type
    values a register, four FP8 ones (d256 FP8 at 128 x 128: 16, where pairs would have predicted
    256 registers; nvcc: 0 spills at 240)."""
    return s_regs * spec.element.bytes // 4


def accumulate_epilogue(spec: AttentionSpec, o_regs: int, s_regs: int) -> int:
    """A warp-specialised accumulating consumer's epilogue (outputs.accumulate): the running O of
    fold_rows rows loads while the last tile's P.V is in flight, so O, P, those rows (f32 pairs)
    and the rest are live at once; S is not. Found by bisecting consumer_registers (sm_90a, f16):
    d256 with 64 keys fits at 240 and spills 12 bytes at 232, 80 keys spills 24 at 240 (O 128,
    one row 64, P 16 / 20); d128 with 80 keys and 3 consumer warpgroups (one row 32) fits at 160
    and spills 4 bytes at 152 (nvcc 13; ACCUMULATE_ODD_PV_STEPS prices it); with two rows, d128 and d64 need no more than their main loop. 0 where
    the kernel does not accumulate."""
    if not spec.outputs.accumulate:
        return 0
    ws = spec.pipeline.warp_specialized
    limit = ws.consumer_registers if ws else MAX_REGISTERS
    rows = fold_rows(o_regs, spec.dv, limit)
    pv_steps = spec.tiling.block_kv // MMA_K
    odd_steps = ACCUMULATE_ODD_PV_STEPS * (pv_steps > 1 and pv_steps % 2 == 1)
    listed = ACCUMULATE_BLOCK_MASK * (spec.mask.kind == "block_mask")
    return (o_regs + rows * (spec.dv // MMA_N) * 2 + p_registers(spec, s_regs) + WARP_SPECIALIZED_REST + odd_steps
            + listed)


# ... and where the last P.V takes an odd count of k16 steps past one (48 or 80 keys), this many
# more: measured, not fitted (ptxas -v, sm_90a, bf16, chunked/none masks, persistent or not; no
# local array or call in the PTX, plain pressure). d256 with 48 keys spilled 20 bytes at 240 where
# 32 keys fit at 232 and 64 at 240 (the estimate's 236 allowed it); d128 with three consumer
# warpgroups needed 152 with 48 keys (144 with 32 or 64) and spilled at 152 with 80: each at
# least 5 over the estimate, and no even count was.
ACCUMULATE_ODD_PV_STEPS = 8
# ... and under a block mask, its tile list's state through the fold: measured, not fitted (a fuzz
# run's finding: d256, 128 x 32, three stages, top-left block mask, sinks, a claimed walk's 232
# consumers: 4 bytes spilled at a predicted 232, where the causal twin fits at the same 232; with
# fewer consumer registers beside a wider producer, 16 bytes; at 16 keys, predicted 228, 4 bytes
# again). 8 refuses both; their fix, 240 consumers and a static walk, compiles clean.
ACCUMULATE_BLOCK_MASK = 8


# A fix being checked: its own refusals offer none (no search within the search). Per thread: a
# search on one thread must not silence another thread's refusals.
_searching = threading.local()


def _advising() -> int:
    return getattr(_searching, "depth", 0)


@contextmanager
def fixes_unsought():
    """Within, a refusal offers no searched fix (its general advice instead): for a fix being
    checked, and for a caller that tries specs in turn and shows only the last one's refusal
    (each search validates several specs)."""
    _searching.depth = _advising() + 1
    try:
        yield
    finally:
        _searching.depth -= 1


Fix = tuple[str, dict]  # the advice's text, and the fields it sets (Advice.fix)


def first_valid(spec: AttentionSpec, fixes: Iterable[Fix], check: Callable[[AttentionSpec], object]) -> Fix | None:
    """The first of `fixes` (lazily: the search stops at the first) with which `spec` validates,
    as fagen.load's parse_spec checks it: the spec's rules, then `check` (the plans). None where
    none does, or within a search (fixes_unsought)."""
    if _advising():
        return None
    data = spec.model_dump(mode="json")
    with fixes_unsought():
        for text, change in fixes:
            try:
                check(AttentionSpec.model_validate(with_fix(data, change)))
            except (SpecError, ValueError):
                continue
            return text, change
    return None


def searched_rule(field: str, value: object, broken: str, fixes: Iterable[Fix], general: str,
                  check: Callable[[AttentionSpec], object], spec: AttentionSpec) -> SpecError:
    """A resource rule's refusal, its fix the first of `fixes` that validates (the values in the
    text and in SpecError.fix), else the `general` advice alone."""
    text, change = first_valid(spec, fixes, check) or (general, None)
    return SpecError(rule(field, value, broken, text, change))


def combined(first: Fix, then: Fix) -> Fix:
    """Two fixes at once: "use a, b", "remove a and use b"."""
    text = f"{first[0]}, {then[0].removeprefix('use ')}" if first[0].startswith("use ") else f"{first[0]} and {then[0]}"
    return text, {**first[1], **then[1]}


def _smaller_block_kv(spec: AttentionSpec) -> Iterable[Fix]:
    """block_kv, a k16 step smaller at a time, at whole k16 steps for each key warp."""
    t = spec.tiling
    for block_kv in range(t.block_kv - MMA_K, 0, -MMA_K):
        if not (block_kv % t.warps_kv or (block_kv // t.warps_kv) % MMA_K):
            yield f"use block_kv: {block_kv}", {"tiling.block_kv": block_kv}


def _smaller_block_q(spec: AttentionSpec) -> Iterable[Fix]:
    """block_q, a row of m16 fragments (one per warp) smaller at a time."""
    step = spec.tiling.warps_q * MMA_M
    for block_q in range(spec.tiling.block_q - step, 0, -step):
        yield f"use block_q: {block_q}", {"tiling.block_q": block_q}


def smem_fixes(spec: AttentionSpec) -> Iterable[Fix]:
    """What takes shared memory from the forward: fewer stages, K and V sharing a buffer
    (mma.sync), fewer keys a tile, fewer rows."""
    p = spec.pipeline
    for stages in range(p.stages - 1, 0, -1):
        yield f"use stages: {stages}", {"pipeline.stages": stages}
    if not spec.wgmma and p.kv_smem == "separate":
        yield "use kv_smem: shared", {"pipeline.kv_smem": "shared"}
        yield "use kv_smem: shared and stages: 1", {"pipeline.kv_smem": "shared", "pipeline.stages": 1}
    yield from _smaller_block_kv(spec)
    yield from _smaller_block_q(spec)


def merge_fixes(spec: AttentionSpec) -> Iterable[Fix]:
    """What fits the key warps' merge in the KV ring: fewer key warps, a larger ring."""
    t, p = spec.tiling, spec.pipeline
    warps_kv = t.warps_kv // 2
    while warps_kv >= 1:
        yield f"use warps_kv: {warps_kv}", {"tiling.warps_kv": warps_kv}
        warps_kv //= 2
    for stages in range(p.stages + 1, 4):
        yield f"use stages: {stages}", {"pipeline.stages": stages}
    if p.kv_smem == "shared":
        yield "use kv_smem: separate", {"pipeline.kv_smem": "separate"}


SEPARATE_TWO: Fix = ("use kv_smem: separate and stages: 2", {"pipeline.kv_smem": "separate", "pipeline.stages": 2})


def seed_budget_fixes(spec: AttentionSpec) -> Iterable[Fix]:
    """Fewer keys a tile, or fewer rows; then (mma.sync) each with separate K and V buffers, 2
    stages, where the smaller tile's registers need that pipeline (fewer addresses in flight)."""
    smaller = [*_smaller_block_kv(spec), *_smaller_block_q(spec)]
    yield from smaller
    if not spec.wgmma and (spec.pipeline.kv_smem, spec.pipeline.stages) != ("separate", 2):
        yield from (combined(fix, SEPARATE_TWO) for fix in smaller)


def register_fixes(spec: AttentionSpec, limit: int) -> Iterable[Fix]:
    """What takes registers from a tiling over its limit: the largest smaller block_kv predicted
    within it (P, S and the mask's and modifiers' per-key terms shrink with it); warp-specialised,
    more consumer_registers where setmaxnreg has more to give; then Q out of registers, more warps
    along the rows, and (mma.sync) separate K and V buffers, 2 stages (fewer addresses in flight)."""
    t, p = spec.tiling, spec.pipeline
    for text, change in _smaller_block_kv(spec):
        smaller = spec.model_copy(update={"tiling": t.model_copy(update={"block_kv": change["tiling.block_kv"]})})
        if _predicted(smaller) <= limit:  # the estimate first: validating costs more
            yield text, change
            break
    ws = p.warp_specialized
    if ws:
        most = most_consumer_registers(t.warps_q // 4, register_split(spec)[0])
        if most > ws.consumer_registers:
            yield (f"set warp_specialized.consumer_registers: {most}",
                   {"pipeline.warp_specialized.consumer_registers": most})
    if p.q_in_registers:
        yield "use q_in_registers: false", {"pipeline.q_in_registers": False}
    if not spec.wgmma and t.block_q >= 2 * MMA_M * t.warps_q and t.warps_q * t.warps_kv < 8:
        yield f"use warps_q: {2 * t.warps_q}", {"tiling.warps_q": 2 * t.warps_q}
    if not spec.wgmma and (p.kv_smem, p.stages) != ("separate", 2):
        yield SEPARATE_TWO
    yield from _smaller_block_q(spec)


def register_fix(spec: AttentionSpec, limit: int) -> Fix | tuple[str, None]:
    """The fix for a tiling over its register limit (register_fixes'), as (text, fields): the
    first that validates, and, warp-specialised, the consumers' registers beside a smaller
    block_kv where both do (the user picks); otherwise the general advice, no fields."""
    fixes = []
    for fix in register_fixes(spec, limit):
        if first_valid(spec, [fix], plan) is None:
            continue
        fixes.append(fix)
        if len(fixes) == 2 or not (fix[0].startswith("use block_kv") and spec.pipeline.warp_specialized):
            break
    if not fixes:
        return "use more warps_q, a smaller block_kv, or q_in_registers: false", None
    return ", or ".join(text for text, _ in fixes), fixes[0][1]


def _predicted(spec: AttentionSpec) -> int:
    """predict_registers for `spec`'s tiling (plan's accumulator counts)."""
    t, d = spec.tiling, spec.head_dim
    m_frags = t.block_q // (t.warps_q * MMA_M)
    per_thread = MMA_M * MMA_N // 32
    q_regs = m_frags * (d // MMA_K) * 4 if spec.pipeline.q_in_registers else 0
    return predict_registers(spec, m_frags * (spec.dv // MMA_N) * per_thread,
                             m_frags * (t.block_kv // t.warps_kv // MMA_N) * per_thread, q_regs, 32 * t.warps_q * t.warps_kv)


def end_aligned_tiles(spec: AttentionSpec) -> bool:
    """Do a causal kernel's query tiles end at n_q? Numbered from the start, a partial last
    tile (192-row tiles at N = 512 hold 128 real rows in their last) is the heaviest under a
    causal mask: its idle rows see every key. Ending at n_q moves the partial tile to the start,
    where its rows see one KV tile (N = 512, 192 x 128 tiles: 9 KV steps a head become 8; 1k: 32
    become 27). Warp-specialised kernels (TMA fills rows before 0 with zeros) over padded,
    unpacked rows with full outputs."""
    o = spec.outputs
    return (spec.warp_specialized and spec.mask.kind == "causal" and spec.sequences.padded
            and not spec.tiling.pack_gqa and not (o.partial or o.accumulate or o.merge_splits))


@lru_cache(maxsize=1024)  # specs are frozen: a spec's plan is computed once
def plan(spec: AttentionSpec) -> KernelPlan:
    t, d, dv, width = spec.tiling, spec.head_dim, spec.dv, spec.row_width
    warps = t.warps_q * t.warps_kv
    m_frags = t.block_q // (t.warps_q * MMA_M)
    # Q, K, V and the staged O share one row layout, as wide as the wider head
    atom_columns = swizzle_atom_columns(spec)
    mma_k = spec.element.mma_k["wgmma" if spec.wgmma else "mma.sync"]
    if spec.wgmma:  # rows live in 128-byte swizzle atoms, side by side across the row
        smem_row = atom_columns
    else:
        smem_row = width + (PAD_ELEMS if spec.smem_layout == "padded" else 0)
    q_tile = t.block_q * (width if spec.wgmma else smem_row)
    # FP8 reads V^T in boxes of one swizzle atom's row of keys: a tile that is no whole number of
    # them lands in whole boxes (the last box's keys past the tile unread), its ring slot as long
    kv_tile = v_tile_keys(spec) * (width if spec.wgmma else smem_row)
    # a warp-specialised kernel's V tiles (TMA's 64-column blocks) are V's own width: where K's
    # rows are wider (DeepSeek's 192 beside 128), V's ring is the narrower
    v_tile = v_tile_keys(spec) * dv if spec.warp_specialized else kv_tile
    slots = kv_slots(spec)
    kv_bytes = spec.kv_element.bytes  # an FP8 KV cache's tiles hold its bytes: half a half type's
    ring_bytes = (spec.pipeline.stages * (kv_tile + v_tile) if spec.pipeline.kv_smem == "separate"
                  else slots * kv_tile) * kv_bytes
    smem_bytes = q_tile * spec.element.bytes + ring_bytes
    if spec.wgmma:  # a "landed" and a "freed" mbarrier per stage of the KV ring (and for Q, with a producer)
        smem_bytes += 2 * (spec.pipeline.stages + spec.warp_specialized) * MBARRIER_BYTES
        smem_bytes += MBARRIER_BYTES * has_claimed_walk(spec)  # the tile the producer claimed, for the consumers
    limit = SMEM_PER_BLOCK[spec.arch]
    seed_budget = t.block_kv * (d + dv) * kv_bytes + (t.block_q * d + t.block_q * t.block_kv) * spec.element.bytes

    per_thread = MMA_M * MMA_N // 32  # f32 accumulator registers a thread holds per m16n8 fragment
    o_regs = m_frags * (dv // MMA_N) * per_thread
    s_regs = m_frags * (t.block_kv // t.warps_kv // MMA_N) * per_thread
    q_regs = m_frags * (d // MMA_K) * 4 if spec.pipeline.q_in_registers else 0
    # wgmma: P.V of tile j - 1 is in flight while tile j's scores are live, its P packed in pairs
    p_regs = p_registers(spec, s_regs) if spec.wgmma else 0
    registers = predict_registers(spec, o_regs, s_regs, q_regs, 32 * warps)
    ws = spec.pipeline.warp_specialized
    producer_registers, consumer_registers = register_split(spec)
    register_limit = consumer_registers if ws else MAX_REGISTERS  # the consumers' setmaxnreg

    if smem_bytes > limit:
        raise searched_rule(
            "pipeline", f"{spec.pipeline.kv_smem}, stages {spec.pipeline.stages}",
            f"needs {smem_bytes} bytes of shared memory (Q tile + "
            + (f"{slots} KV tiles of {kv_tile * kv_bytes}" if v_tile == kv_tile else
               f"{spec.pipeline.stages} K tiles of {kv_tile * kv_bytes} and {spec.pipeline.stages} V tiles of "
               f"{v_tile * kv_bytes}")
            + f" bytes, {t.block_kv} keys) but {spec.arch} allows {limit} per block", smem_fixes(spec),
            "use fewer stages or a smaller block_kv" + ("" if spec.wgmma else ", or kv_smem: shared"), plan, spec)
    # warps along the keys merge through the (then idle) KV ring: a lane's O, max and sum, for each
    # warp but the first of its rows
    combine_bytes = (t.warps_kv - 1) * t.warps_q * 32 * (o_regs + 4 * m_frags) * 4
    if combine_bytes > ring_bytes:
        raise searched_rule("tiling.warps_kv", t.warps_kv, f"merges {combine_bytes} bytes of O through the KV ring "
                            f"({ring_bytes} bytes)", merge_fixes(spec),
                            "use fewer warps_kv, or more stages", plan, spec)
    if seed_budget > limit:
        raise searched_rule(
            "tiling", f"block_q {t.block_q}, block_kv {t.block_kv}",
            f"breaks the FlashAttention block-size rule 2*Bc*d + Br*d + Br*Bc < M: "
            f"{seed_budget} bytes over {spec.arch}'s {limit}", seed_budget_fixes(spec),
            "use a smaller block_q or block_kv", plan, spec)
    if registers > register_limit:
        raise SpecError(rule(
            "tiling", f"block_q {t.block_q}, block_kv {t.block_kv}, warps_q {t.warps_q}",
            f"predicts {registers} registers a thread ({o_regs} for O, {s_regs} for S, {q_regs} for Q, "
            f"{p_regs} for P, the rest addresses, pipeline state and the mask's and score modifiers' "
            f"temporaries) over the {register_limit} limit{' (consumer_registers)' if ws else ''}: it would spill",
            *register_fix(spec, register_limit)))

    return KernelPlan(
        name=spec.name,
        symbol=KERNEL_SYMBOL_PREFIX + spec.name,
        mma="wgmma" if spec.wgmma else "mma_sync",
        threads=32 * warps + (WARPGROUP_THREADS if ws else 0),
        warps=warps,
        block_q=t.block_q,
        block_kv=t.block_kv,
        head_dim=d,
        head_dim_v=dv,
        m_frags=m_frags,
        s_n_frags=t.block_kv // t.warps_kv // MMA_N,
        o_n_frags=dv // MMA_N,
        mma_k=mma_k,
        qk_k_steps=d // mma_k,
        pv_k_steps=t.block_kv // t.warps_kv // mma_k,
        smem_row=smem_row,
        atoms_per_row=width // atom_columns if spec.wgmma else 0,
        chunks_per_row=d // CHUNK_ELEMS,
        v_chunks_per_row=dv // CHUNK_ELEMS,
        q_tile_elems=q_tile,
        kv_tile_elems=kv_tile,
        kv_slots=slots,
        kv_stages=spec.pipeline.stages,
        warpgroups=warps // 4 if spec.wgmma else 0,
        pingpong=spec.pipeline.pingpong,
        mask_lane_words=-(-t.block_kv // LANE_COLUMNS),
        mask_prepares_tiles=KINDS[spec.mask.kind].prepares_tiles,
        kv_tiles_listed=KINDS[spec.mask.kind].lists_tiles,
        smem_bytes=smem_bytes,
        smem_limit=limit,
        seed_budget_bytes=seed_budget,
        predicted_registers=registers,
        blocks_per_sm_by_smem=max(1, limit // smem_bytes),
        mask_params=KINDS[spec.mask.kind].params,
        score_params=score_params(spec),
        sink_params=((FLOAT_PTR, "sinks"),) if spec.score_mod.sinks and not spec.outputs.partial else (),
        split_params=((("int", "kv_tiles_per_split"), ("long long", "o_split_stride"),
                       ("long long", "lse_split_stride")) if spec.outputs.partial else ())
        # a running LSE may be a slice of a longer one (a ring step's rows): its (batch, head) rows' stride
        + ((("long long", "lse_head_stride"),) if spec.outputs.accumulate else ()),
        merge_params=merge_params(spec),
        row_quads=dv // 4 if spec.outputs.merge_splits else 0,
        split_merge_floats=SPLIT_MERGE_FLOATS if spec.outputs.merge_splits else 0,
        split_merge_batch=SPLIT_MERGE_BATCH if spec.outputs.merge_splits else 0,
        fold_rows=fold_rows(o_regs, dv, register_limit) if spec.outputs.accumulate else 0,
        sequence_params=sequence_params(spec),
        sequence_offset=not spec.sequences.padded and spec.mask.align == "bottom_right" and KINDS[spec.mask.kind].uses_align,
        sequence_tiles=has_sequence_tiles(spec),
        pack_gqa=t.pack_gqa,
        dependent_launch=t.pack_gqa,
        column_blocks=ws is not None,
        warp_specialized=ws is not None,
        clears_rows_past_keys=ws is not None and spec.sequences.kv == "ranged",
        clear_barrier=CLEAR_BARRIER,
        consumer_threads=32 * warps,
        producer_registers=producer_registers,
        consumer_registers=consumer_registers,
        tma_params=tuple((TMA_MAP, f"{t}_map") for t in "qkv") if ws else (),
        input_params=input_params(spec),
        scheduler_params=(SCHEDULER_PARAMS + CLAIMED_WALK_PARAMS * has_claimed_walk(spec)) if ws else (),
        persistent=bool(ws and ws.persistent),
        claimed_walk=has_claimed_walk(spec),
        end_aligned_tiles=end_aligned_tiles(spec),
        output_staged=(not spec.outputs.partial and not (ws and ws.persistent) and not spec.element.is_fp8
                       and spec.out_element.bytes == spec.element.bytes),
        **template_numbers(spec, m_frags, kv_tile, v_tile),
    )


# ---- template-side tables: the kernel signature, the wgmma numbers, the merge kernel ----------
CHUNK_BYTES = 16  # cp.async and ldmatrix move 16-byte chunks
WARPGROUP_WARPS = 4  # a warpgroup: 4 consecutive warps, 64 rows of one wgmma.m64
SWIZZLE_ATOM_ROWS = 8  # a 128-byte swizzle atom: 8 rows of 128 bytes
SWIZZLE_ROW_BYTES = 128
SWIZZLE_ATOM_BYTES = SWIZZLE_ATOM_ROWS * SWIZZLE_ROW_BYTES


def v_tile_keys(spec: AttentionSpec) -> int:
    """The keys of V a tile loads (and its ring slot holds): the tile's, but for the FP8 forward,
    which reads V^T in whole boxes of one swizzle atom's row (128 keys): the tile's keys rounded up."""
    if not (spec.element.is_fp8 and spec.wgmma):
        return spec.tiling.block_kv
    columns = swizzle_atom_columns(spec)
    return -(-spec.tiling.block_kv // columns) * columns


def swizzle_atom_columns(spec: AttentionSpec) -> int:
    """Elements across a 128-byte swizzle atom's row: 64 of a half type, 128 of FP8."""
    return SWIZZLE_ROW_BYTES // spec.element.bytes
ELEM_PTR, OUT_PTR = "const elem_t* __restrict__", "out_t* __restrict__"
KV_PTR = "const kv_elem_t* __restrict__"  # an FP8 KV cache's k and v (spec.fp8_kv)
Q_PTR = "const q_elem_t* __restrict__"  # an FP8 q that kernel widens as it lands (spec.widens_query)
# The kernel's parameters before extra_params, in signature order (elem_t and out_t are the
# kernel's typedefs: the storage dtype, and f32 for split-KV partials).
def input_params(spec: AttentionSpec) -> tuple[tuple[str, str], ...]:
    """The forward kernel's first parameters, those it reads: q, k and v by pointer and strides
    (where a producer loads them, its tensor maps stand in: plan.tma_params), o and lse, the
    shape, and the scale as the scores take it (natural units for the score modifiers, log2
    units straight into the softmax otherwise)."""
    kv_ptr = KV_PTR if spec.fp8_kv else ELEM_PTR
    loaded = () if spec.warp_specialized else (
        (Q_PTR if spec.widens_query else ELEM_PTR, "q"), (kv_ptr, "k"), (kv_ptr, "v"))
    strides = () if spec.warp_specialized else (
        ("long long", "q_sb"), ("long long", "q_sh"), ("long long", "q_sn"),
        ("long long", "k_sb"), ("long long", "k_sh"), ("long long", "k_sn"),
        ("long long", "v_sb"), ("long long", "v_sh"), ("long long", "v_sn"))
    scale = ("float", "scale") if spec.score_mod.changes_scores else ("float", "scale_log2")
    return (*loaded, (OUT_PTR, "o"), ("float* __restrict__", "lse"),
            ("int", "n_q"), ("int", "n_kv"), ("int", "mask_offset"), ("int", "heads_q"), ("int", "group"),
            *strides, ("long long", "o_sb"), ("long long", "o_sh"), ("long long", "o_sn"), scale,
            *(DESCALE_PARAMS if spec.element.is_fp8 or spec.fp8_kv else ()),
            *(FP8_OUT_PARAMS if spec.out_element.is_fp8 else ()))


# FP8 at d128: wgmma consumes S elements as fast as the MUFU exponentiates them (16 a clock an
# SM), so a warp's softmax is bound by its SM sub-partition's MUFU; a fraction of the exponentials
# run instead as a degree-3 polynomial on the FMA pipe (FlashAttention-4's move), exact far past
# e4m3's rounding of P. One n8 fragment in EXP2_POLY_EVERY (H200, d128 dense 16k, the kernel
# alone: none 867 TFLOP/s, one in 8 897, in 4 895, in 2 793: the FMA pipe's share then costs more
# issue slots than the MUFU it frees).
EXP2_POLY_EVERY = 8
# The forward's warp index shuffled from lane 0, so that ptxas proves it warp-uniform and keeps a
# consumer warpgroup's Q descriptors in uniform registers (without it, 26 R2UR / IMAD / IADD3
# instructions a warp a KV step rebuild them per thread: ncu, f16 d128 causal 4k, against
# FlashAttention-4's kernel with the same tile, 11% more instructions). Measured on an H200 in one
# process (2026-12-01): the causal half-type wgmma forwards from head_dim 128 gain (d128 +2.5-3.3%,
# d256 16k +1.5-2%, 192/128 +2.0-2.2%, 128/64 +1.2-1.8%); the same change lost or held elsewhere
# (dense: d128 f16 -1.3-1.9%, bf16 within 1%, 128/64 -3%; d64 -1%; FP8 d128 -1.5 to -5%), ptxas
# scheduling those kernels' loops worse: kept where it won. From head_dim 64 since 2026-12-01's
# trimmed warpgroup steps (plan.trims_warpgroup_steps), which need it: d64 causal with both +0.9%
# at 1k, +2.9-3.6% at 2k-4k, +2% at 8k (float16; bfloat16 +3.2% at 4k, +1.7% at 16k).
UNIFORM_WARP_INDEX_FROM_HEAD_DIM = 64
# ... beside a bias, from head_dim 128: the d64 long class's bias variants (192 x 96) spill 4 bytes
# with the trimmed steps (ptxas, nvcc 13.0), and without them the index alone measured -1% at d64
UNIFORM_WARP_INDEX_WITH_BIAS_FROM_HEAD_DIM = 128
# FP8: FlashAttention-3's descales, float32 [B, Hkv] (or one number: strides 0), each read where it
# lies: its address and (sequence, KV head) strides. An FP8 KV cache's kernels take q's too: 1 for
# a half-type q, an FP8 q's own (spec.widens_query)
DESCALE_PARAMS = tuple(param for name in ("q_descale", "k_descale", "v_descale")
                       for param in ((FLOAT_PTR, name), ("long long", f"{name}_sb"), ("long long", f"{name}_sh")))
# FP8 out (cuDNN's): o = e4m3(O * scale_o), saturated, scale_o float32 [1] read where it lies;
# amax_o float32 [1], zeroed by the launch, takes max |O| over the real rows (atomically, a warp a
# tile), or null where the call does not ask for it
FP8_OUT_PARAMS = ((FLOAT_PTR, "scale_o"), ("float* __restrict__", "amax_o"))
WGMMA_NUMBERS = ("warpgroup_warps", "atom_elems", "atom_bytes", "row_group_bytes", "k_step_bytes",
                 "k_steps_per_atom", "v_step_bytes", "warpgroup_q_bytes", "kv_ring_bytes", "v_ring_bytes", "mbarrier_bytes",
                 "q_atom_step_bytes", "k_atom_step_bytes", "v_lead_bytes", "atom_columns", "atom_row_bytes")


def uniform_warp_index(spec: AttentionSpec) -> bool:
    """Whether the forward shuffles its warp index from lane 0 (UNIFORM_WARP_INDEX_FROM_HEAD_DIM;
    beside a bias, UNIFORM_WARP_INDEX_WITH_BIAS_FROM_HEAD_DIM)."""
    least = UNIFORM_WARP_INDEX_WITH_BIAS_FROM_HEAD_DIM if spec.score_mod.bias != "none" else UNIFORM_WARP_INDEX_FROM_HEAD_DIM
    return (spec.wgmma and spec.mask.kind == "causal" and not spec.element.is_fp8 and not spec.kv_element.is_fp8
            and spec.head_dim >= least)


def template_numbers(spec: AttentionSpec, m_frags: int, kv_tile_elems: int, v_tile_elems: int) -> dict:
    """The KernelPlan fields from `mainloop` on: what the templates print beside the tiling."""
    t, d, dv = spec.tiling, spec.head_dim, spec.dv
    warps = t.warps_q * t.warps_kv
    threads, warp_rows = 32 * warps, t.block_q // t.warps_q
    chunks_per_row, v_chunks_per_row = d // CHUNK_ELEMS, dv // CHUNK_ELEMS
    uniform = uniform_warp_index(spec)
    kv_chunks_per_row = d * spec.kv_element.bytes // CHUNK_BYTES
    acc_per_fragment = MMA_M * MMA_N // 32  # f32 accumulators a thread holds per m16n8 fragment
    return {
        "mainloop": "sm90" if spec.wgmma else "sm80",
        "smem_align": SWIZZLE_ATOM_BYTES if spec.wgmma else CHUNK_BYTES,
        "warp_rows": warp_rows,
        "warps_q": t.warps_q,
        "warps_kv": t.warps_kv,
        "warp_keys": t.block_kv // t.warps_kv,
        "key_merge_floats": m_frags * (dv // MMA_N) * acc_per_fragment + 4 * m_frags,
        "element_bytes": spec.element.bytes,
        "p_log2_scale": float(spec.element.p_log2_scale),
        "exp2_poly_every": EXP2_POLY_EVERY if spec.element.is_fp8 and spec.wgmma else 0,
        "uniform_warp_index": uniform,
        # (the steps a warpgroup's own: warp-uniform only where the warp index is, else its MMAs
        # sit on a path ptxas must serialise)
        "trims_warpgroup_steps": (uniform and bool(spec.warp_specialized) and warps // 4 > 1
                                  and KINDS[spec.mask.kind].ends_by_row and not t.pack_gqa and spec.sequences.kv != "ranged"),
        "kv_tile_bytes": kv_tile_elems * spec.kv_element.bytes,
        "v_tile_bytes": v_tile_elems * spec.kv_element.bytes,
        # an FP8 KV cache's rows: twice a half type's elements in a 16-byte chunk, half the chunks a row
        "kv_chunk_elems": CHUNK_BYTES // spec.kv_element.bytes,
        "kv_chunks_per_row": kv_chunks_per_row,
        "kv_copy_rows_per_pass": threads // kv_chunks_per_row if threads % kv_chunks_per_row == 0 else 0,
        "q_chunk_elems": CHUNK_BYTES // spec.q_element.bytes,
        "q_chunks_per_row": d * spec.q_element.bytes // CHUNK_BYTES,
        "q_tile_bytes": t.block_q * d * spec.element.bytes if spec.wgmma else 0,
        "k_load_bytes": t.block_kv * d * spec.kv_element.bytes if spec.wgmma else 0,
        "v_load_bytes": v_tile_keys(spec) * dv * spec.kv_element.bytes if spec.wgmma else 0,
        "qk_atoms": d // swizzle_atom_columns(spec) if spec.wgmma else 0,
        "v_atoms": dv // swizzle_atom_columns(spec) if spec.wgmma else 0,
        "v_key_boxes": v_tile_keys(spec) // swizzle_atom_columns(spec) if spec.element.is_fp8 and spec.wgmma else 0,
        "v_key_box_bytes": dv * SWIZZLE_ROW_BYTES if spec.element.is_fp8 and spec.wgmma else 0,
        "copy_rows_per_pass": threads // chunks_per_row if threads % chunks_per_row == 0 else 0,
        # V copies as K does: by passes of whole rows where both divide the threads, else chunk by chunk
        "v_copy_rows_per_pass": threads // v_chunks_per_row if threads % v_chunks_per_row == 0
        and threads % chunks_per_row == 0 else 0,
        "out_chunks_per_warp": warp_rows * v_chunks_per_row,
        "s_acc_regs": m_frags * (t.block_kv // t.warps_kv // MMA_N) * acc_per_fragment,
        "o_acc_regs": m_frags * (dv // MMA_N) * acc_per_fragment,
        **(wgmma_numbers(spec, kv_tile_elems, v_tile_elems, column_blocks=spec.warp_specialized) if spec.wgmma
           else dict.fromkeys(WGMMA_NUMBERS, 0)),
    }


def wgmma_numbers(spec: AttentionSpec, kv_tile_elems: int, v_tile_elems: int, column_blocks: bool = False,
                  rows: tuple[int, int] | None = None) -> dict[str, int]:
    """The sm_90a kernel's byte offsets within its 128-byte-swizzled tiles. Two layouts of the
    same atoms: row groups (cp.async: 8-row groups one after the other, each row_width / 64 atoms
    wide) or, where TMA fills the tiles (column_blocks: a warp-specialised kernel's), column
    blocks (a tile's 64-column block of every row, one after the other: what one TMA box of 64
    columns writes). rows: the rows of wgmma's A tile (the forward's Q) and of its B tile (K),
    where not the forward's tiling's (the backward's dK/dV kernel: K, then Q)."""
    rows_per_warpgroup = WARPGROUP_WARPS * MMA_M
    columns, mma_k = swizzle_atom_columns(spec), spec.element.mma_k["wgmma"]
    if column_blocks:  # 8 rows of one column block; the blocks a tile's rows * 128 bytes apart
        row_group = SWIZZLE_ATOM_BYTES
        a_rows, b_rows = rows or (spec.tiling.block_q, spec.tiling.block_kv)
        column_step = {"q": a_rows * SWIZZLE_ROW_BYTES, "k": b_rows * SWIZZLE_ROW_BYTES}
    else:  # 8 rows: the row's atoms side by side
        row_group = spec.row_width // columns * SWIZZLE_ATOM_BYTES
        column_step = {"q": SWIZZLE_ATOM_BYTES, "k": SWIZZLE_ATOM_BYTES}
    return {
        "warpgroup_warps": WARPGROUP_WARPS,
        "atom_elems": SWIZZLE_ATOM_ROWS * columns,
        "atom_bytes": SWIZZLE_ATOM_BYTES,
        "row_group_bytes": row_group,
        "k_step_bytes": mma_k * spec.element.bytes,
        "k_steps_per_atom": columns // mma_k,
        "v_step_bytes": mma_k // SWIZZLE_ATOM_ROWS * row_group,
        "warpgroup_q_bytes": rows_per_warpgroup // SWIZZLE_ATOM_ROWS * row_group,
        "kv_ring_bytes": spec.pipeline.stages * kv_tile_elems * spec.element.bytes,
        "v_ring_bytes": spec.pipeline.stages * v_tile_elems * spec.element.bytes,
        "mbarrier_bytes": MBARRIER_BYTES,
        "q_atom_step_bytes": column_step["q"],
        "k_atom_step_bytes": column_step["k"],
        "v_lead_bytes": column_step["k"],
        "atom_columns": columns,
        "atom_row_bytes": SWIZZLE_ROW_BYTES,
    }


@dataclass(frozen=True)
class MergePlan:
    """The split-KV merge kernel (templates/kernel/merge.cu.j2): a block merges one row of O, its
    warps sharing the row's splits."""
    out_dtype: str  # what it writes: float16, bfloat16, or float32 (a partial again)
    max_warps: int  # a block's warps at most: a launch takes one a split up to this (merge_warps)
    splits_in_flight: int  # a warp's splits whose columns it loads at once
    params: tuple[tuple[str, str], ...]  # (C type, name) in signature order; out_t is its typedef
    columns_per_lane: int  # head_dim columns a lane sums (the largest head_dim / 32)


# A decode step's merge (B 1, 16 splits of 128 columns) was one warp a row walking the splits four
# at a time: 8.5 us of latency for 256 KB. Eight warps, four splits each in flight: one round trip.
MERGE_WARPS = 8
SPLIT_MERGE_FLOATS = 6  # outputs.merge_splits: a thread's share of a row's merge (max, sum, 4 columns)
SPLIT_MERGE_BATCH = 16  # ... all of a d128 tile's 16 splits in one round trip (the main loop, not this, sets the registers)
MERGE_SPLITS_IN_FLIGHT = 4


def merge_warps(splits: int) -> int:
    """A merge launch's warps a block: one a split, at most MERGE_WARPS."""
    return max(1, min(MERGE_WARPS, splits))


MERGE_PARAMS: tuple[tuple[str, str], ...] = (
    (FLOAT_PTR, "o_parts"), (FLOAT_PTR, "lse_parts"), (FLOAT_PTR, "sinks"), (OUT_PTR, "out"),
    ("float* __restrict__", "lse"), ("int", "splits"), ("int", "rows"), ("int", "head_dim"), ("int", "heads"),
    ("int", "n_q"), ("long long", "part_stride"), ("long long", "lse_part_stride"),
    ("long long", "o_sb"), ("long long", "o_sh"), ("long long", "o_sn"),
)


def merge_plan(out_dtype: str) -> MergePlan:
    return MergePlan(out_dtype=out_dtype, max_warps=MERGE_WARPS, splits_in_flight=MERGE_SPLITS_IN_FLIGHT,
                     params=MERGE_PARAMS, columns_per_lane=max(HEAD_DIMS) // 32)
