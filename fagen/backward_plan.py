"""spec -> the backward kernels' plan: every number they derive, computed once, here (pure).

The backward of a spec is three kernels in one file (templates/kernel/backward.cu.j2):
  preprocess  D = rowsum(dO * O) and the forward's LSE in log2 units, per query row, padded
              to whole query tiles so the loops below read them without bounds checks
              (and, under a document mask, each position's document bounds);
  dkdv        KV-major: a block owns BLOCK_KV keys of one KV head and loops over the query
              tiles (of every query head of its group) that see them, recomputing
              P^T = exp2(S^T - LSE) and accumulating dV += P^T dO, dK += dS^T Q in registers;
  dq          Q-major, shaped like the forward (its plan is a forward plan): a block owns a
              query tile and loops over the KV tiles the mask visits, dQ += dS K in registers.
No block adds into another's output, so gradients are bitwise deterministic run to run; the
price is S and dP computed twice (7 MMAs of a tile pair where an atomic dQ takes 5). Both main
loops are mma.sync (mainloop "sm80"), or wgmma on sm_90a up to head_dim 128 ("sm90"). There,
unless backward.deterministic, the dK/dV kernel also adds each step's dQ tile dS.K into a
float32 accumulator with atomics (spec.atomic_dq), and in place of the dQ kernel
  postprocess  dQ = scale * accumulator, in the inputs' dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from fagen import expression
from fagen.plan import (CHUNK_BYTES, CHUNK_ELEMS, ELEM_PTR, FLOAT_PTR, KERNEL_SYMBOL_PREFIX, MAX_REGISTERS, MBARRIER_BYTES,
                        PAD_ELEMS, TMA_MAP,
                        SWIZZLE_ATOM_BYTES, WARPGROUP_WARPS, Fix, KernelPlan, combined, first_valid, fixes_unsought, plan,
                        score_params, searched_rule, wgmma_numbers)
from fagen.mask_kinds import KINDS
from fagen.spec import (LANE_COLUMNS, MMA_K, MMA_M, MMA_N, REMOVE, SMEM_PER_BLOCK, SWIZZLE_ATOM_ELEMS, WARPGROUP_ROWS, AttentionSpec, Backward, SpecError,
                        dq_producer_blocks_per_sm, rule)

OUT_PTR = "elem_t* __restrict__"
PREPROCESS_WARPS = 4
# Lanes side by side along a row of O and dO in the preprocess: 8 lanes' 16-byte chunks are a whole
# 128-byte line, so a warp's load reads 4 rows' lines (one row a thread read 32 half-used sectors
# a load, and ran at a third of the memory's bandwidth: notes/perf.md)
PREPROCESS_ROW_LANES = 8
# The register estimates of the two main loops: accumulators (dK and dV, or dQ), S and dP (and
# the modifiers' derivative where it varies per score) and what they hold beside them, priced
# per term below, fitted by linear programming to 301 ptxas -v runs (random backward specs, and every mask
# kind with and without modifiers at the tilings fagen.variants.trainable picks)
# (scripts/fit_backward_registers.py; sm_80 and sm_90, nvcc 13.0) so that every kernel that
# spilled is predicted over MAX_REGISTERS and every other at least at its count.
# Two head widths with a bias, its gradient or captured arrays' gradients: the dK/dV kernel's
# separate dK and dV accumulators beside the modifier's state; set by hand from 132 ptxas -v builds
# (192/128, 128/64, 64/128 x no mask, causal, sliding window, causal document x a matrix or vector
# bias with and without softcap, its gradient, ALiBi, learned tables; nvcc 13.0), where 17 spilled
# 8-60 bytes predicted 240-252 (wgmma and mma.sync alike).
TWO_WIDTHS_MODIFIED = 16.0
REGISTER_COSTS = {
    "dkdv": {"base": 61.12, "acc": 1.17, "s": 3.1, "s_nonlinear": 0.5, "chunk_copy": 11.88, "stages1": 0.0,
             "causal": 0.17, "sliding_window": 10.31, "chunked": 3.79, "document": 5.0, "document_causal": 5.0,
             "prefix_lm": 0.0, "block_mask": 10.31, "bias": 14.38, "alibi": 13.79,
             # a bias's gradient (by hand, 90 ptxas -v runs: head_dim 64, 128, 256 x masks x bias kinds);
             # a matrix bias's per S register (an address per score)
             "bias_grad_matrix": 0.25, "bias_grad_vector": 4.0, "two_widths_modified": TWO_WIDTHS_MODIFIED,
             # one stage of Q and dO at head_dim 128 or more, per S register: measured (ptxas -v,
             # nvcc 13.0, sm_80; a fuzz run's finding and its neighbours: head_dim 64 and 128 x
             # head_split 1 and 2 x block_q 32-128 x block_kv 32 and 64 x 4 and 8 warps x 1 and 2
             # stages) at 254-255 with 12-24 bytes of spills at head_dim 128, 64 queries a step (32
             # S registers), where 2 stages use 216 and head_dim 64 or 32 queries a step fit at 1 stage
             "stages1_wide": 1.25,
             # a mask expression, tested at every element of every step: measured (ptxas -v, nvcc
             # 13.0, sm_90; a fuzz run's finding and its neighbours: head_dim 64, block_kv 64 and 128,
             # no mask, causal and a top-left document x a matrix bias or none, sinks) 5-26 over the
             # same kernel without it, and at 255 with 4-12 bytes of spills under a document with a
             # matrix bias at 128 keys (predicted 254): the least that refuses it; the table's slack
             # covers the rest (every neighbour that fits is predicted within 1 of its count or
             # over it; the shipped custom_expressions spec, predicted 254, uses 229)
             "mask_expression": 3.0,
             # ... beside a bias (vector or matrix), per S register past 16: measured (ptxas -v,
             # nvcc 13.0, sm_89; a fuzz run's two findings, 32 bytes at 255 predicted 245 and 252,
             # and their 40 neighbours: head_dim 64, 96, 128 x block_kv 64 and 128 x head_split 1
             # and 2 x 32 and 64 queries a step x no bias, vector, matrix x no mask and prefix-LM)
             # 2-15 over the estimate at 16 S registers, none spilling, and 3-37 at 32, where
             # without a bias it is within 8: the least that refuses every one that spilled (one
             # that fit at 255, predicted 252, is refused too)
             "mask_expression_bias": 0.75,
             # softcap and a score expression whose derivative varies, both: two derivative chains
             # per S register, measured (ptxas -v, nvcc 13.0, a fuzz run's finding and its
             # neighbours) at 255 with 4 bytes of spills at head_dim 64, 64 queries and keys a step
             # (predicted 251), where either alone fits there
             "s_two_nonlinear": 0.16},
    # sm_90a's wgmma kernels (head_dim <= 128), fitted by hand to 192 ptxas -v runs (head_dim 64
    # and 128 x block_q 32, 64, 128 x every mask kind x softcap, ALiBi, a bias; nvcc 13.0): every
    # build that spilled is predicted over MAX_REGISTERS; a few that just fit are refused too
    "dkdv_wgmma": {"base": 84.0, "acc": 0.86, "s": 1.8, "s_nonlinear": 0.5, "chunk_copy": 0.0, "stages1": 0.0,
                   "causal": 0.0, "sliding_window": 1.0, "chunked": 1.0, "document": 3.0, "document_causal": 3.0,
                   "prefix_lm": 0.0, "block_mask": 6.0, "bias": 12.0, "alibi": 12.0,
                   # a bias's gradient (by hand, 95 ptxas -v runs): a matrix bias's per S register
                   # (an address per score of the step), a vector bias's a sum per key
                   "bias_grad_matrix": 1.15, "bias_grad_vector": 8.0,
                   # atomic dQ under a mask with per-thread row bounds: measured at 255 with 4-12
                   # bytes of spills (head_dim 64 at block_q 128, 128 with prefix_lm or documents)
                   "atomic_masked": 5.0,
                   # ... and under a causal mask, per f32 register of S^T: its diagonal's compares
                   # beside the step's f32 S^T and dP^T and atomic dQ's dS^T. Measured (ptxas -v, nvcc
                   # 13.0, top-left and bottom-right, float16 and bfloat16) at 255 with 4 bytes of
                   # spills at head_dim 64 and 128 queries a step (64 registers of S^T, the copying
                   # kernel: it packs no P^T early), where deterministic (254) and no mask (255) fit;
                   # at 32 registers (head_dim 128 or 64 at 64 queries) 255 and 236, 0 spills
                   "atomic_causal": 1 / 16,
                   # ... and under a chunked mask in the producer-fed kernel (its chunk bounds a row
                   # beside the consumers' 240): head_dim 64 float16 at 128 queries predicted 238,
                   # spilled 20 bytes, where every other mask kind fit at 236-240 (ptxas -v, nvcc 13.0)
                   "producer_atomic_chunked": 4.0,
                   # a third stage in the copying kernel (its addresses): measured (ptxas -v, nvcc 13.0;
                   # head_dim 64 and 128 x block_q 32 and 64 x no mask, causal, a top-left document x
                   # softcap or none x 2 and 3 stages, 8 warps, deterministic) where only head_dim 128 at
                   # 64 queries under a document spilled, 8 bytes at 255 with 3 stages (predicted 254;
                   # 2 stages fit), and no mask and causal at 251 fit with 3 (a fuzz run found it)
                   "copying_stages3": 2.0,
                   # one warpgroup (warps 4, block_kv 64) copying its tiles: each thread copies twice
                   # the chunks of K, V, Q and dO, and their addresses stay live; measured at 255 with
                   # 4 bytes of spills at block_q 64 (12 with 3 stages; head_dim 128, every mask, float16
                   # and bfloat16), where two warpgroups use 254 and spill nothing
                   "one_warpgroup": 8.0,
                   # two head widths under a document mask, per f32 register of S^T: measured (ptxas -v,
                   # nvcc 13.0, 84 builds: 192/128, 128/64, 64/128 x every mask kind x softcap or none,
                   # float16 and bfloat16) 242 at 128/64 with 64 queries a step, and 255 with 12 bytes of
                   # spills under softcap, where this table said 227 and 243; the other masks within 10
                   "two_widths_document": 0.41, "two_widths_modified": TWO_WIDTHS_MODIFIED,
                   # a mask expression, tested at every element of every step (not only the diagonal's):
                   # measured (ptxas -v, nvcc 13.0, the lowest of 168-240 by 8 with no spill; head_dim
                   # 128 x block_q 32 on one warpgroup and 64 on two, deterministic or not x causal and
                   # a top-left document x softcap or none x kv_idx < 64, q_idx % 2 == 0 || kv_idx < 64,
                   # h % 2 == 0 || kv_idx < 64): up to 3 over this table; reading the step's query head
                   # on one warpgroup, 11-23 over (a fuzz run's document with softcap and sinks spilled
                   # 8 bytes at 224, predicted 217); on two, within 5
                   "mask_expression": 3.0, "mask_expression_head_one_warpgroup": 13.0,
                   # softcap beside ALiBi or a bias in the producer-fed kernel on one warpgroup
                   # (warps 4): measured (ptxas -v, nvcc 13.0; a fuzz run's finding and its
                   # neighbours: head_dim 64, 64 queries and keys, a two-sided sliding window and
                   # causal x softcap, ALiBi, a vector bias x consumers at 208-240) 9-17 over this
                   # table where both are on (a window with all three spilled 4 bytes at 232,
                   # predicted 220); either modifier alone fits its estimate
                   "softcap_modified_one_warpgroup": 17.0,
                   # a mask expression in the persistent (producer-fed) kernel, beside its walk's
                   # state: measured (ptxas -v, nvcc 13.0; a fuzz run's finding and its 32
                   # neighbours: head_dim 128, 32 queries a step, deterministic x persistent or not x
                   # no mask, causal, a causal document, a sliding window x the expression or not x
                   # consumers at 224 and 232) 4-8 bytes of spills at 224 under every mask and at
                   # 232 under the document (predicted 209-212), where the kernel a block a tile and
                   # the persistent one without the expression spill nothing: the least that refuses
                   # every build that spilled and none that fit at 232
                   "persistent_mask_expression": 21.0,
                   # a mask expression reading the query head beside a block mask (its lists are
                   # indexed by the head too), on two warpgroups: measured (ptxas -v, nvcc 13.0; a
                   # fuzz run's finding and its 52 neighbours: head_dim 64 and 128 x float16 and
                   # bfloat16 x a block mask, causal, a causal document x no expression, kv_idx < 64,
                   # h < 3, h % 2 == 0 || kv_idx < 64 x sinks or none x consumers at 224-240) 8 bytes of
                   # spills at 240 (head_dim 128, 64 queries a step, predicted 238) for the compound
                   # expression under the block mask alone, where h < 3 fit at 238 and the causal and
                   # document masks with it fit at 234-240: the least that refuses it
                   "mask_expression_head_block_mask": 3.0,
                   # a mask expression reading the query's index beside a block mask, ALiBi and a
                   # bias, on one producer-fed warpgroup (warps 4): measured (ptxas -v, nvcc 13.0; a
                   # fuzz run's finding and its 126 neighbours: head_dim 64, float16 and bfloat16 x a
                   # block mask, causal, a causal document, a sliding window, no mask x expressions
                   # reading q_idx, kv_idx or h x softcap, ALiBi, a vector or matrix bias, sinks x one
                   # producer-fed, one copying and two producer-fed warpgroups) 4 bytes of spills at the
                   # consumers' 240 (predicted 207 without a softcap, 240 with) for
                   # (q_idx - kv_idx) % 4 != 3 and (q_idx + kv_idx) % 4 != 3 under the block mask
                   # with both modifiers, where either modifier alone, kv_idx < 64, the other masks, and
                   # the copying and two-warpgroup kernels fit; other q_idx expressions fit at the edge
                   # ((q_idx - kv_idx) % 3 != 2, q_idx >= kv_idx): refused with them, the least
                   # that refuses every build that spilled
                   "block_mask_query_expression_modified_one_warpgroup": 34.0},
    # mma.sync at head_dim 256 (head_split 2: dK and dV 128 registers a thread, as dQ's), where the
    # estimate above, fitted mostly on smaller accumulators, over-predicted by up to 80 (the dK/dV
    # kernel at 16 queries a step under a sliding window with softcap and ALiBi: 263 predicted,
    # 235-241 measured). Fitted by linear programming to 128 ptxas -v runs (every mask
    # kind x softcap, ALiBi, both x block_q and dq_block_kv 16 and 32, sm_80 and sm_90, bfloat16,
    # nvcc 13.0; scripts/fit_backward_registers.py sweep-d256, fit --d256): every kernel that spilled
    # is predicted over MAX_REGISTERS + 4, every other at least at its count. A bias's terms, set by
    # hand from 256 runs at block_q and dq_block_kv 16 (every mask kind x softcap, ALiBi, both, none
    # x vector and matrix bias, with and without its gradient, sm_80 and sm_90, float16): all fit
    # (0 spills, up to 254 registers), and these, the most that keep each under the limit, under-
    # predict a few by up to 8. At 32 queries or keys a bias spilled (48 of 128 runs) where the
    # base terms already refuse it.
    "dkdv_d256": {"base": 78.0, "acc": 1.0, "s": 3.25, "s_nonlinear": 0.88, "chunk_copy": 0.0, "stages1": 0.0,
                  "causal": 0.0, "sliding_window": 0.0, "chunked": 1.0, "document": 6.0, "document_causal": 6.0,
                  "prefix_lm": 0.0, "block_mask": 7.0, "bias": 4.0, "alibi": 2.0,
                  "bias_grad_matrix": 0.25, "bias_grad_vector": 2.0, "two_widths_modified": TWO_WIDTHS_MODIFIED},
    "dq_d256": {"base": 72.0, "acc": 1.0, "s": 3.25, "s_nonlinear": 0.5, "chunk_copy": 0.0, "stages1": 0.0,
                "causal": 0.0, "sliding_window": 4.0, "chunked": 9.0, "document": 7.0, "document_causal": 7.0,
                "prefix_lm": 0.0, "block_mask": 1.0, "bias": 6.0, "alibi": 2.0},
    "dq_wgmma": {"base": 60.0, "acc": 1.25, "s": 2.0, "s_nonlinear": 1.2, "chunk_copy": 0.0, "stages1": 0.0,
                 "causal": 0.0, "sliding_window": 0.0, "chunked": 0.0, "document": 4.0, "document_causal": 4.0,
                 "prefix_lm": 4.0, "block_mask": 10.0, "bias": 12.0, "alibi": 6.0},
    "dq": {"base": 56.0, "acc": 1.62, "s": 2.06, "s_nonlinear": 0.84, "chunk_copy": 20.0, "stages1": 0.0,
           "causal": 0.0, "sliding_window": 0.0, "chunked": 4.0, "document": 4.0, "document_causal": 2.0,
           "prefix_lm": 1.0, "block_mask": 4.0, "bias": 12.0, "alibi": 16.0,
           # a mask expression, tested at every element of every step: measured (ptxas -v, nvcc 13.0,
           # sm_89 and sm_90; a fuzz run's finding and its 64 neighbours: head_dim 64, dq_block_q 64
           # and 128 x dq_block_kv 32 and 64 x top-left causal or no mask x softcap x sinks) 0-22 over
           # the same kernel without it, and at 255 with 4 bytes of spills on sm_90 under a top-left
           # causal mask with softcap at 128 queries and 32 keys (predicted 252): the least that
           # refuses it; the table's slack covers the rest (the neighbours that fit and are predicted
           # under their count, by 1-16, fit at 141-189)
           "mask_expression": 4.0,
           # ... beside a bias (vector or matrix): measured (ptxas -v, nvcc 13.0, sm_86 and sm_90; a
           # later fuzz run's two findings at head_dim 96 and their 72 neighbours: head_dim 64, 96,
           # 128 x dq_block_kv 32 and 64 x causal and prefix-LM x no bias, vector, matrix) 16-41 over
           # the same kernel without the expression, where alone it costs 7-20: at 255 with 40 bytes
           # of spills at head_dim 96, 64 keys a step (predicted 235); the least that refuses it
           "mask_expression_bias": 21.0},
}


# The warp-specialised dK/dV kernel's consumers (setmaxnreg: 240) hold no copy state (addresses,
# strides, the thread's share of each tile), which the estimate above prices in its base; atomic
# dQ's addresses and its dQ tile then weigh more. Set by ptxas -v on 120 builds (head_dim 64 and
# 128 x block_q 32-128 x every mask kind x softcap, ALiBi, a bias x atomic or not; nvcc 13.0):
# every build that spilled is predicted over the consumers' registers, a few that fit are too.
WARP_SPECIALIZED_SAVING = 16  # (not with two head widths: 192/128's consumers spilled 88 bytes predicted 234)
# ... and atomic dQ there: its dQ tile and addresses in place of the copy state. Refitted once the
# epilogue's addresses stopped being hoisted across the walk and P^T was packed before dP^T lands,
# on 160 builds (ptxas -v, nvcc 13.0; head_dim 128 at block_q 64 and head_dim 64 at 64 and 128 x every
# mask kind x softcap, ALiBi, both biases, with and without the bias's gradient): without
# modifiers every mask kind fits the consumers' 240 at both head_dims (predicted 251-262 before
# this term); every build that spilled (softcap, biases) is predicted over 240, and ALiBi's,
# which fit, are refused too.
WARP_SPECIALIZED_ATOMIC_DQ = -6
# ... a saving fitted where the consumers had 240: with fewer they do not get it (a fuzz run's
# finding: head_dim 128, 128 keys, 64 queries a step, consumers at 232, causal and no mask alike
# spilled 16 bytes at a predicted 229-231, and fit at 240; ptxas -v, nvcc 13.0).
ATOMIC_DQ_FITTED_CONSUMERS = 240
# Two builds the estimate let through spilled since dQ's adds became a bulk reduce a warp (ptxas -v,
# nvcc 13.0, over the 56 atomic-dQ builds trainable picks under every mask with no modifier,
# softcap or ALiBi): float16 head_dim 64 chunked (producer-fed, 20 bytes) and bfloat16 head_dim 64
# causal (the copying kernel, 4 bytes). Both measured faster than what refusing them would give
# (H200, B4 H32 4k: 0.89 against 1.02 ms at 64 queries a step; 1.80 against 2.48), and than the
# reduction kernels they replace with 0 spills (0.95, 2.11 ms), and were kept. Both are refused now
# (REGISTER_COSTS' producer_atomic_chunked and atomic_causal: a spec that validates does not spill),
# and trainable takes the producer-fed kernel at 64 queries a step there.
# ... and bfloat16 where P^T is packed early (EARLY_P_PACK_S_REGS): head_dim 64's 128-query steps
# spilled 8-28 bytes under every mask but the sliding window and block mask, where float16's fit.
WARP_SPECIALIZED_BF16_EARLY_PACK = 12
# The producer-fed dQ kernel's consumers hold no copy state either: its estimate less this much.
DQ_PRODUCER_SAVING = 16
WARP_SPECIALIZED_BIAS_GRAD = 24  # head_dim 64, a matrix bias's gradient with atomic dQ: predicted 235, spilled 20 bytes


def register_terms(spec: AttentionSpec, kernel: str) -> dict[str, float]:
    """The amounts REGISTER_COSTS[kernel] prices, for this spec ("dkdv" or "dq")."""
    bwd, d, dv, mask, mod = spec.backward, spec.head_dim, spec.dv, spec.mask, spec.score_mod
    per_fragment = MMA_M * MMA_N // 32  # f32 accumulator registers a thread holds per m16n8 fragment
    if kernel == "dkdv":  # dK over head_dim, dV over head_dim_v
        warps, key_warps = bwd.warps, bwd.warps // bwd.head_split
        frags = bwd.block_kv // key_warps // MMA_M
        acc = frags * ((d + dv) // bwd.head_split // MMA_N) * per_fragment
        s = frags * (bwd.block_q // MMA_N) * per_fragment
    else:
        warps, frags = bwd.dq_warps, bwd.dq_block_q // bwd.dq_warps // MMA_M
        acc, s = frags * (d // MMA_N) * per_fragment, frags * (bwd.dq_block_kv // MMA_N) * per_fragment
    kind = "document_causal" if mask.kind == "document" and mask.causal else mask.kind
    # a captured array's element an S register, as a nonlinear modifier's derivative (ptxas: d64's
    # dK/dV kernel with a relative bias table spilled 52 bytes priced as a linear one)
    terms = {"base": 1.0, "acc": acc, "s": s, "s_nonlinear": s * (mod.nonlinear or mod.captured > 0),
             "chunk_copy": float(any(32 * warps % (width // CHUNK_ELEMS) for width in {d, dv})),
             "stages1": float(bwd.stages == 1),
             "bias": float(mod.bias != "none"), "alibi": float(mod.alibi != "none")}
    if kernel == "dkdv" and bwd.bias_grad:
        terms[f"bias_grad_{mod.bias}"] = s if mod.bias == "matrix" else 1.0
    if kind != "none":
        terms[kind] = 1.0
    if kernel == "dkdv" and spec.atomic_dq and mask.kind in ("sliding_window", "chunked", "prefix_lm", "document"):
        terms["atomic_masked"] = 1.0
    if kernel == "dkdv" and spec.wgmma_backward and spec.atomic_dq and mask.kind == "causal":
        terms["atomic_causal"] = s
    if kernel == "dkdv" and spec.wgmma_backward and spec.atomic_dq and mask.kind == "chunked" and bwd.warp_specialized:
        terms["producer_atomic_chunked"] = 1.0
    if kernel == "dkdv" and spec.dv != d and (mod.bias != "none" or bwd.bias_grad or bwd.captured_grads):
        terms["two_widths_modified"] = 1.0
    if kernel == "dkdv" and spec.wgmma_backward and spec.dv != d and mask.kind == "document":
        terms["two_widths_document"] = s
    if kernel == "dkdv" and spec.wgmma_backward and bwd.warps == WARPGROUP_WARPS and bwd.warp_specialized is None:
        terms["one_warpgroup"] = 1.0
    if kernel == "dkdv" and spec.wgmma_backward and bwd.stages >= 3 and bwd.warp_specialized is None:
        terms["copying_stages3"] = 1.0
    if kernel == "dkdv" and cost_table(spec, kernel) is REGISTER_COSTS["dkdv"] and bwd.stages == 1 and d >= 128:
        terms["stages1_wide"] = s
    if (kernel == "dkdv" and cost_table(spec, kernel) is REGISTER_COSTS["dkdv"] and mod.softcap is not None
            and mod.nonlinear_expression):
        terms["s_two_nonlinear"] = s
    if (kernel == "dkdv" and spec.wgmma_backward and bwd.warp_specialized and bwd.warps == WARPGROUP_WARPS
            and mod.softcap is not None and (mod.alibi != "none" or mod.bias != "none")):
        terms["softcap_modified_one_warpgroup"] = 1.0
    if kernel == "dq" and mask.expression and cost_table(spec, kernel) is REGISTER_COSTS["dq"]:
        terms["mask_expression"] = 1.0
        if mod.bias != "none":
            terms["mask_expression_bias"] = 1.0
    if kernel == "dkdv" and mask.expression and (spec.wgmma_backward or cost_table(spec, kernel) is REGISTER_COSTS["dkdv"]):
        terms["mask_expression"] = 1.0
        if not spec.wgmma_backward and mod.bias != "none":
            terms["mask_expression_bias"] = max(0.0, s - 16)
        if spec.wgmma_backward and bwd.warp_specialized and bwd.warp_specialized.persistent:
            terms["persistent_mask_expression"] = 1.0
        reads_head = "h" in expression.reads(expression.mask(mask.expression))
        if spec.wgmma_backward and reads_head and bwd.warps == WARPGROUP_WARPS:
            terms["mask_expression_head_one_warpgroup"] = 1.0
        if spec.wgmma_backward and reads_head and mask.kind == "block_mask" and bwd.warps > WARPGROUP_WARPS:
            terms["mask_expression_head_block_mask"] = 1.0
        if (spec.wgmma_backward and mask.kind == "block_mask" and bwd.warps == WARPGROUP_WARPS
                and bwd.warp_specialized and mod.alibi != "none" and mod.bias != "none"
                and "q_idx" in expression.reads(expression.mask(mask.expression))):
            terms["block_mask_query_expression_modified_one_warpgroup"] = 1.0
    return terms


def cost_table(spec: AttentionSpec, kernel: str) -> dict[str, float]:
    """REGISTER_COSTS' prices for this spec's `kernel` ("dkdv" or "dq"): wgmma's on sm_90a up to
    head_dim 128, mma.sync's at head_dim 256 (its own fit) and the dQ kernel's at 192 (dQ 96
    registers a thread, where the small heads' price over-predicted by 40: ptxas -v), else mma.sync's."""
    if spec.wgmma_backward:
        return REGISTER_COSTS[f"{kernel}_wgmma"]
    wide = spec.head_dim == 256 or kernel == "dq" and spec.head_dim == 192
    return REGISTER_COSTS[f"{kernel}_d256" if wide else kernel]


# Kernels the estimate refuses that ptxas -v was run on (sm_80 and sm_90, nvcc 13.0): they fit, at
# the registers given (the higher of the two archs). The tilings fagen.variants.trainable picks for
# head_dim 128 and 256, each mask kind, with softcap or no modifier (and a block mask at 256). tests/test_nvcc.py compiles
# each. Key: head_dim, backward tiling (block_kv, block_q, warps, head_split, stages, dq_block_q,
# dq_block_kv, dq_warps), mask kind ("document_causal" for a causal document), softcap?
_D128, _D256 = (128, 32, 8, 1, 2, 64, 64, 4), (64, 32, 8, 2, 2, 64, 32, 4)
MEASURED_FIT = {
    "dkdv": {
        **{(128, _D128, kind, False): regs for kind, regs in (
            ("none", 248), ("causal", 247), ("sliding_window", 248), ("chunked", 249), ("prefix_lm", 247),
            ("document", 249), ("document_causal", 249))},
        **{(128, _D128, kind, True): regs for kind, regs in (
            ("none", 255), ("causal", 252), ("sliding_window", 254), ("prefix_lm", 252))},
        (256, _D256, "none", False): 249, (256, _D256, "causal", False): 251, (256, _D256, "block_mask", False): 243,
    },
    "dq": {(256, _D256, "none", False): 244, (256, _D256, "causal", False): 243, (256, _D256, "block_mask", False): 243},
}


def measured_key(spec: AttentionSpec) -> tuple | None:
    """spec's key in MEASURED_FIT, or None where it is not a kernel of that kind."""
    bwd, mod = spec.backward, spec.score_mod
    if mod.alibi != "none" or mod.bias != "none" or mod.expression or spec.mask.expression or spec.dv != spec.head_dim:
        return None
    kind = "document_causal" if spec.mask.kind == "document" and spec.mask.causal else spec.mask.kind
    tiling = (bwd.block_kv, bwd.block_q, bwd.warps, bwd.head_split, bwd.stages, bwd.dq_block_q, bwd.dq_block_kv,
              bwd.dq_warps)
    return spec.head_dim, tiling, kind, mod.softcap is not None


def predict_registers(spec: AttentionSpec, kernel: str) -> int:
    if not spec.wgmma_backward:
        measured = MEASURED_FIT[kernel].get(measured_key(spec))
        if measured is not None:
            return measured
    costs = cost_table(spec, kernel)
    return int(sum(costs[name] * amount for name, amount in register_terms(spec, kernel).items()))


@dataclass(frozen=True)
class DkdvPlan:
    """The KV-major kernel. Its accumulator rows are keys: a warp owns warp_keys of them (m16
    fragments along the keys) and head_dim / head_split columns of dK and dV. On wgmma
    (mainloop "sm90") a warpgroup's four warps own 64 keys, 16 a warp: the same per-warp layout
    with one m16 fragment, so the mask, score and epilogue code is shared."""

    mainloop: str  # the templates' folder: "sm80" (mma.sync, ldmatrix) or "sm90" (wgmma from swizzled smem)

    block_q: int  # queries per step of the loop (a Q and a dO tile)
    block_kv: int  # keys a block owns
    threads: int
    warps: int
    head_split: int  # warps side by side along head_dim (each recomputes its keys' S^T)
    key_warps: int  # warps along the keys
    warp_keys: int  # keys a warp owns: the rows of its S^T
    k_frags: int  # m16 fragments of those keys
    s_n_frags: int  # n8 fragments of S^T (queries)
    d_n_frags: int  # n8 fragments of the warp's columns of dK (and of dV, as wide)
    d_cols: int  # head_dim / head_split: the warp's columns
    dv_n_frags: int  # ... of dV, head_dim_v wide (d_n_frags where V is as wide as K)
    dv_cols: int  # head_dim_v / head_split
    qk_k_steps: int  # k16 steps of S^T = K Q^T over head_dim
    v_k_steps: int  # k16 steps of dP^T = V dO^T over head_dim_v
    q_k_steps: int  # k16 steps of dV += P^T dO and dK += dS^T Q over the step's queries
    stages: int  # Q/dO tiles in flight
    # backward.warp_specialized.persistent: one block an SM walks the KV blocks (tiles), loading
    # the next tile's K and V into a second slot under this one's loop
    persistent: bool
    claimed_walk = False  # its blocks take every gridDim.x-th KV block (templates/sm90/tile_scheduler.cu.j2)
    kv_slots: int  # K/V tile pairs in smem: 1, or 2 persistent
    kv_slot_bytes: int  # a K tile and its V tile
    smem_row: int  # elements between smem rows (padded: 16 bytes past the wider head)
    chunks_per_row: int  # of a Q, K or dK row (head_dim)
    copy_rows_per_pass: int  # 0: a row's chunks do not divide the threads
    v_chunks_per_row: int  # of a V, dO or dV row (head_dim_v)
    v_copy_rows_per_pass: int  # ... as copy_rows_per_pass (0 where either width's chunks do not divide the threads)
    kv_tile_bytes: int  # the K tile, then the V tile
    q_tile_bytes: int  # a Q tile; a dO tile follows it in each stage
    kv_load_bytes: int  # what a tile's K and V loads deliver (each head's own width): a producer's expect_tx
    qdo_load_bytes: int  # ... a step's Q and dO
    stage_bytes: int  # Q, dO, then their rows' LSE and D (f32)
    row_floats_chunks: int  # 16-byte chunks of one tile's LSE (and of its D)
    row_bytes: int  # one tile's LSE (and its D): f32 a query row
    out_chunks: int  # 16-byte chunks of the block's dK
    v_out_chunks: int  # ... of its dV
    smem_bytes: int
    predicted_registers: int
    element_bytes: int
    smem_align: int  # bytes the dynamic smem base is aligned to
    mask_lane_words: int  # as the forward's, of S^T's rows (keys): query columns (masks.thread_words)
    mask_params: tuple[tuple[str, str], ...]  # as the forward's: the side inputs the partials read
    score_params: tuple[tuple[str, str], ...]
    # wgmma only (0 on mma.sync): the byte offsets within 128-byte-swizzled tiles, as the forward's
    warpgroup_warps: int  # warps of one wgmma.m64: 64 keys, 16 a warp
    atoms_per_row: int  # 128-byte swizzle atoms across a row (the wider head)
    atom_elems: int
    atom_bytes: int  # one 8-row swizzle atom (the dS^T buffers' row-group layout)
    row_group_bytes: int  # 8 rows of a tile: the stride byte offset
    # a tile's next 64 columns: one atom on in row groups; a tile's rows of 128 bytes on in column
    # blocks (the producer's boxes); as the leading byte offset of an MN-major B (dO and Q in dV
    # and dK, K in dQ), a K-major k step across atoms otherwise
    kv_atom_step_bytes: int  # of the K and V tiles
    q_atom_step_bytes: int  # of the Q and dO tiles
    d_atoms: int  # 64-column blocks of a head_dim row (K, Q) ...
    dv_atoms: int  # ... and of a head_dim_v row (V, dO): a producer's boxes a tile
    atom_columns: int  # a block's columns (a box's)
    atom_row_bytes: int  # ... of a row: in column blocks a block's rows are this far apart
    k_step_bytes: int  # a k16 step over head_dim within an atom ...
    k_steps_per_atom: int  # ... this many, then on to the next atom
    q_step_bytes: int  # a k16 step over the queries of dV and dK (16 rows: two row groups)
    warpgroup_keys_bytes: int  # bytes between the warpgroups' 64 keys of the K and V tiles
    mbarrier_bytes: int
    s_acc_regs: int  # f32 registers a thread holds of S^T (and of dP^T): block_q / 2
    # P^T packed to 16-bit pairs before dP^T lands, dS^T computed from them (EARLY_P_PACK_S_REGS)
    early_p_pack: bool
    d_acc_regs: int  # ... of dK: head_dim / 2
    dv_acc_regs: int  # ... of dV: head_dim_v / 2
    # atomic dQ only (0 otherwise): a step's dS^T goes to smem (two buffers, keys as rows, the
    # queries in 64-wide swizzle atoms), then warpgroup w adds the 64 x 64 tile w of dQ = dS.K
    atomic_dq: bool
    ds_offset: int  # bytes from the smem base to the first dS^T buffer (after the ring's barriers)
    ds_tile_bytes: int  # one dS^T buffer: block_kv x block_q
    ds_atoms_per_row: int  # swizzle atoms across a dS^T row (block_q / 64)
    ds_row_group_bytes: int  # 8 keys of dS^T: the stride byte offset of wgmma's MN-major A
    dq_tiles: int  # m64n64 tiles of a step's dQ (block_q x head_dim): warpgroup w adds tile w % dq_tiles ...
    dq_key_split: int  # ... over share w / dq_tiles of the block's keys (warpgroups = tiles x shares)
    dq_n_tiles: int  # the tiles across head_dim: tile i has rows 64 (i / this), columns 64 (i % this)
    dq_key_steps: int  # k16 steps of a warpgroup's dQ tile over its share of the keys
    dq_n_frags: int  # n8 fragments of a 64-column dQ tile
    ds_barrier_threads: int  # the threads that meet before reading dS^T: all, or a warpgroup's own
    ds_stored_first: bool  # dS^T stored before dV's issue, not under it (DS_STORED_FIRST_HEAD_DIMS)
    # a step's dQ leaves a warp as one bulk reduce-add (TMA) of its 16 x 64 fragments, staged in
    # smem in register order: dq_accum holds every query tile in that order (dq_accum_index)
    dq_stage_offset: int  # bytes from the smem base to warp 0's staging (after the dS^T buffers)
    dq_stage_bytes: int  # a warp's staging: its 16 rows x 64 columns of a tile, f32
    # the producer warpgroup's dQ writer issues the adds (DQ_WRITER_HEAD_DIMS): each consumer
    # warpgroup stages its part and writes its destination here, not issuing bulk reduces itself
    dq_writer: bool
    dq_rows_offset: int  # bytes from the smem base to the warpgroups' destinations (dq_writer)
    dq_barrier_threads: int  # a consumer warpgroup and the writer warp, at each of their barriers (dq_writer)
    # backward.bias_grad: each step's score gradient at the bias added into dbias; "" without
    bias_grad: str  # score_mod.bias: "matrix" (an add per score) or "vector" (a key's sum over the step's queries)
    bias_grad_params: tuple[tuple[str, str], ...]  # the buffer and its strides (stride 0 on broadcast axes)
    # backward.captured_grads: the arrays whose gradient each step adds (int64 fixed point), and
    # their sums and scales as kernel parameters
    captured_grads: tuple[str, ...]
    captured_grad_params: tuple[tuple[str, str], ...]
    # a gradient taken at the modified score, P^T (dP^T - D), before the modifiers' own factor
    # (softcap's, before a bias; the expression's, whose reads a captured gradient differentiates)
    ds_before_chain: bool
    # backward.warp_specialized: a producer warpgroup after the consumers' (threads) loads with
    # TMA; the block has block_threads, and setmaxnreg moves registers between the roles
    warp_specialized: bool
    # smem_offset's layout (cp.async's tiles; dK and dV staged over K and V): row groups. A
    # producer's tiles are column blocks (a TMA box each: kv_atom_step_bytes, q_atom_step_bytes)
    column_blocks: bool
    block_threads: int  # threads, plus the producer warpgroup's where warp-specialised
    producer_warpgroup: int  # its index: the one after the consumers' (0 without)
    producer_registers: int  # setmaxnreg targets (0: every thread copies with cp.async)
    consumer_registers: int


@dataclass(frozen=True)
class DqProducer:
    """backward.dq_warp_specialized: the dQ kernel's consumer warpgroups (its plan's threads)
    compute and a producer warpgroup after them loads with TMA: Q and dO once, on one more
    mbarrier pair after the KV ring's, then each step's K and V (row-group boxes, as the dK/dV
    kernel's producer loads). setmaxnreg splits the registers of blocks_per_sm blocks an SM."""

    block_threads: int  # the consumers' threads and the producer warpgroup's
    producer_warpgroup: int  # its index: the one after the consumers'
    producer_registers: int  # setmaxnreg targets
    consumer_registers: int
    blocks_per_sm: int  # __launch_bounds__' minimum: the register split is sized for this many


@dataclass(frozen=True)
class BackwardPlan:
    name: str
    preprocess_symbol: str
    dkdv_symbol: str
    dq_symbol: str
    postprocess_symbol: str
    head_dim: int
    row_pad: int  # LSE and D rows are padded to a multiple of this (whole tiles of both loops)
    preprocess_threads: int
    preprocess_lanes: int  # lanes a query row in the preprocess (a power of two up to 8), side by side along it
    preprocess_rows: int  # query rows a preprocess block covers: threads / lanes
    chunks_per_row: int  # the preprocess's: of an O and a dO row (head_dim_v)
    dkdv: DkdvPlan
    dq: KernelPlan  # the dQ kernel's forward-shaped numbers (see dq_spec), its "O" dQ: head_dim wide
    dq_v_k_steps: int  # k16 steps of its dP = dO V^T over head_dim_v
    dq_smem_bytes: int  # its plan's (Q tile, KV ring) and the dO tile after Q (and the producer's Q/dO mbarriers)
    dq_producer: DqProducer | None  # backward.dq_warp_specialized; None: every thread copies with cp.async
    dq_predicted_registers: int
    smem_align: int  # bytes: the dynamic smem both main loops share, at the stricter one's alignment
    # the dQ kernel launched beside the dK/dV kernel (a second stream), not after it
    # (CONCURRENT_DQ_MASKS): the two share inputs only, and dQ's blocks fill what dK/dV's last wave leaves
    concurrent_dq: bool
    mask_params: tuple[tuple[str, str], ...]  # the loops' (the mask kind's params)
    score_params: tuple[tuple[str, str], ...]
    preprocess_params: tuple[tuple[str, str], ...]
    dkdv_params: tuple[tuple[str, str], ...]
    dq_params: tuple[tuple[str, str], ...]
    postprocess_params: tuple[tuple[str, str], ...]

    @property
    def atomic_dq(self) -> bool:
        """dQ from the dK/dV kernel's atomics and the postprocess, not the dQ kernel."""
        return self.dkdv.atomic_dq

    @property
    def main_loops(self) -> tuple[str, ...]:
        """The main-loop folders of the file's kernels: the dK/dV kernel's, and the dQ kernel's
        where there is one (not with atomic dQ)."""
        return (self.dkdv.mainloop,) if self.atomic_dq else (self.dkdv.mainloop, self.dq.mainloop)

    @property
    def shared_ptx(self) -> tuple[str, ...]:
        """The PTX wrappers the file's kernels share, as template names, only those some kernel
        calls: cp.async groups where a loop copies without a producer or is mma.sync's (which
        tracks its copies by groups), ldmatrix and mma.sync where a loop is mma.sync's."""
        mma_sync = "sm80" in self.main_loops
        groups = mma_sync or not self.dkdv.warp_specialized
        return (*(("sm80/copy_groups.cu.j2",) if groups else ()), *(("sm80/mma_sync.cu.j2",) if mma_sync else ()))

    @property
    def copying_loops(self) -> bool:
        """Whether a loop's threads copy tiles with cp.async (no producer warpgroup feeds it): they
        wait for their copies before staging the output over the tiles (wait_all_copies)."""
        return not self.dkdv.warp_specialized or not self.atomic_dq and self.dq_producer is None

    def loads_bias(self, plan) -> bool:
        """Whether `plan`'s loop (the dK/dV or the dQ kernel's) loads a tile's bias into registers
        before the scores (load_bias_tile), as the mma.sync loops do, rather than reading each
        element where it applies it."""
        return plan.mainloop == "sm80" and any(name == "bias" for _, name in self.score_params)

    @property
    def dependent_roles(self) -> tuple[str, ...]:
        """The kernels launched as programmatic dependents of the one before them on the stream
        (fagen.dependent_launch): each waits for it (griddepcontrol.wait) before touching memory,
        so its launch and prologue overlap that kernel's last wave. The producer-fed dK/dV kernel
        after the preprocess, and atomic dQ's postprocess after it."""
        if not self.dkdv.warp_specialized:
            return ()
        return ("dkdv", "postprocess") if self.atomic_dq else ("dkdv",)

    def postprocess_blocks(self, n_q: int) -> int:
        """The postprocess's blocks a head: a thread per 16 floats (two rows' 8 columns) of the
        dq_accum query tiles that hold n_q rows."""
        floats = -(-n_q // self.dkdv.block_q) * self.dkdv.block_q * self.head_dim
        return -(-floats // 16 // self.preprocess_threads)


def kernel_symbols(bplan: BackwardPlan) -> dict[str, str]:
    """The kernels a backward file holds, by role: under atomic dQ a postprocess, not dq."""
    dq = {"postprocess": bplan.postprocess_symbol} if bplan.atomic_dq else {"dq": bplan.dq_symbol}
    return {"preprocess": bplan.preprocess_symbol, "dkdv": bplan.dkdv_symbol, **dq}


def dq_spec(spec: AttentionSpec) -> AttentionSpec:
    """The dQ kernel as a forward spec: it owns query tiles and walks the mask's KV tiles like the
    forward, with K and V both resident a tile (kv_smem separate): wgmma where the dK/dV kernel
    is (spec.wgmma_backward), else mma.sync (sm_90a's head_dim 256: built for sm_90)."""
    bwd, wgmma = spec.backward, spec.wgmma_backward
    return spec.model_copy(update={
        "name": spec.name + "_dq",
        "tiling": spec.tiling.model_copy(update={"block_q": bwd.dq_block_q, "block_kv": bwd.dq_block_kv,
                                                 "warps_q": bwd.dq_warps}),
        "pipeline": spec.pipeline.model_copy(update={"kv_smem": "separate", "stages": 2, "q_in_registers": False,
                                                     "pingpong": False, "warp_specialized": None}),
        "smem_layout": "swizzled" if wgmma else "padded", "arch": spec.arch if wgmma or not spec.wgmma else "sm_90",
        "backward": None,
    })


STRIDES = ("sb", "sh", "sn")
TMA_TENSORS = ("q", "k", "v", "dout")  # the producer-fed kernels' tensor maps (dK/dV: column blocks; dQ: row groups)


def _strides(*tensors: str) -> tuple[tuple[str, str], ...]:
    return tuple(("long long", f"{t}_{s}") for t in tensors for s in STRIDES)


SHAPE_PARAMS = (("int", "n_q"), ("int", "n_kv"), ("int", "mask_offset"), ("int", "heads_q"), ("int", "group"),
                ("int", "n_pad"))
ROW_PARAMS = ((FLOAT_PTR, "delta"), (FLOAT_PTR, "lse2"))  # D and LSE * log2(e), [B, Hq, n_pad]
DQ_ACCUM = ("float* __restrict__", "dq_accum")  # atomic dQ: [B, Hq, n_pad, head_dim] f32, zeroed by the preprocess
# backward.bias_grad: dbias f32, zeroed, of the bias's shape or one copy per batch and KV head
# (deterministic): element (b, h, q, k) at b sb + h sh + (h / group) skv + q sq + k
BIAS_GRAD_PARAMS = (("float* __restrict__", "dbias"), ("long long", "dbias_sb"), ("long long", "dbias_sh"),
                    ("long long", "dbias_skv"), ("long long", "dbias_sq"))


def captured_grad_params(arrays: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """backward.captured_grads: each array's sums (int64 fixed point, one an element, zeroed) and
    the scales that turn a float into it, a float64 an array (a power of two: fagen.captured_grads)."""
    if not arrays:
        return ()
    return (*(("long long* __restrict__", f"{name}_grad") for name in arrays),
            ("const double* __restrict__", "captured_grad_scales"))


# Where the dQ kernel runs beside the dK/dV kernel, measured (H200, d128, N 4k and 16k, same process,
# alternating, two runs; gradients bitwise equal): sliding windows +4-6%, documents +7%; prefix-LM
# -3%, dense and causal -2-5% (notes/perf.md).
CONCURRENT_DQ_MASKS = ("sliding_window", "document")


def backward_plan(spec: AttentionSpec) -> BackwardPlan:
    if spec.backward is None:
        raise searched_rule("backward", None, f"spec {spec.name} renders no backward kernels", backward_sections(spec),
                            "add a backward: section (an empty mapping takes the defaults) and tile it", trains, spec)
    bwd, d = spec.backward, spec.head_dim
    dq, dkdv, producer = dq_kernel_plan(spec), dkdv_plan(spec), dq_producer(spec)
    dq_smem = dq.smem_bytes + dq.q_tile_elems * spec.element.bytes + (2 * MBARRIER_BYTES if producer else 0)
    dq_registers = predict_registers(spec, "dq") - (DQ_PRODUCER_SAVING if producer else 0)
    dq_register_limit = producer.consumer_registers if producer else MAX_REGISTERS
    if dq_registers > dq_register_limit:
        raise searched_rule(
            "backward", f"dq_block_q {bwd.dq_block_q}, dq_block_kv {bwd.dq_block_kv}, dq_warps {bwd.dq_warps}",
            f"the dQ kernel predicts {dq_registers} registers a thread over the {dq_register_limit} limit"
            f"{' (dq_warp_specialized.consumer_registers)' if producer else ''}: it would spill", dq_fixes(spec),
            "use a smaller dq_block_kv, or fewer score modifiers", trains, spec)
    if dq_smem > SMEM_PER_BLOCK[spec.arch]:
        raise searched_rule(
            "backward", f"dq_block_q {bwd.dq_block_q}, dq_block_kv {bwd.dq_block_kv}",
            f"the dQ kernel needs {dq_smem} bytes of shared memory (Q and dO tiles, 2 stages of K and V tiles) "
            f"but {spec.arch} allows {SMEM_PER_BLOCK[spec.arch]} per block", dq_fixes(spec),
            "use a smaller dq_block_kv or dq_block_q", trains, spec)
    mod_params = score_params(spec)
    mask_params = KINDS[spec.mask.kind].params
    side = mask_params + mod_params
    chunks = spec.dv // CHUNK_ELEMS  # O and dO rows, in the preprocess
    return BackwardPlan(
        name=spec.name,
        preprocess_symbol=f"{KERNEL_SYMBOL_PREFIX}{spec.name}_bwd_preprocess",
        dkdv_symbol=f"{KERNEL_SYMBOL_PREFIX}{spec.name}_bwd_dkdv",
        dq_symbol=f"{KERNEL_SYMBOL_PREFIX}{spec.name}_bwd_dq",
        postprocess_symbol=f"{KERNEL_SYMBOL_PREFIX}{spec.name}_bwd_postprocess",
        head_dim=d,
        row_pad=math.lcm(bwd.block_q, bwd.dq_block_q),
        preprocess_threads=32 * PREPROCESS_WARPS,
        preprocess_lanes=(lanes := min(PREPROCESS_ROW_LANES, 1 << (chunks.bit_length() - 1))),
        preprocess_rows=32 * PREPROCESS_WARPS // lanes,
        chunks_per_row=chunks,
        dkdv=dkdv,
        # the dQ kernel's output is dQ, head_dim wide, where the forward's O is head_dim_v wide
        dq=replace(dq, mask_params=mask_params, head_dim_v=d, o_n_frags=d // MMA_N, o_acc_regs=dq.o_acc_regs * d // spec.dv,
                   out_chunks_per_warp=dq.warp_rows * d // CHUNK_ELEMS),
        dq_v_k_steps=spec.dv // MMA_K,
        dq_smem_bytes=dq_smem,
        dq_producer=producer,
        dq_predicted_registers=dq_registers,
        smem_align=max(dkdv.smem_align, dq.smem_align),
        concurrent_dq=not spec.atomic_dq and spec.mask.kind in CONCURRENT_DQ_MASKS,
        mask_params=mask_params,
        score_params=mod_params,
        preprocess_params=((ELEM_PTR, "o"), (ELEM_PTR, "dout"), (FLOAT_PTR, "lse"), ("float* __restrict__", "delta"),
                           ("float* __restrict__", "lse2"), ("int", "n_q"), ("int", "heads_q"), ("int", "n_pad"),
                           *_strides("o", "dout"), *((DQ_ACCUM,) if spec.atomic_dq else ())),
        dkdv_params=((ELEM_PTR, "q"), (ELEM_PTR, "k"), (ELEM_PTR, "v"), (ELEM_PTR, "dout"), *ROW_PARAMS,
                     (OUT_PTR, "dk"), (OUT_PTR, "dv"), *((DQ_ACCUM,) if spec.atomic_dq else ()), *SHAPE_PARAMS,
                     *_strides("q", "k", "v", "dout", "dk", "dv"), ("float", "scale"), ("float", "scale_log2"), *side,
                     *dkdv.bias_grad_params, *dkdv.captured_grad_params,
                     *(((TMA_MAP, f"{t}_map") for t in TMA_TENSORS) if dkdv.warp_specialized else ()),
                     # the tile grid's batch * KV heads, and how many of them a section walks
                     *((("int", "batch"), ("int", "heads_section")) if dkdv.warp_specialized else ())),
        dq_params=((ELEM_PTR, "q"), (ELEM_PTR, "k"), (ELEM_PTR, "v"), (ELEM_PTR, "dout"), *ROW_PARAMS,
                   (OUT_PTR, "dq"), *SHAPE_PARAMS, *_strides("q", "k", "v", "dout", "dq"),
                   ("float", "scale"), ("float", "scale_log2"), *side,
                   *(((TMA_MAP, f"{t}_map") for t in TMA_TENSORS) if producer else ())),
        postprocess_params=((FLOAT_PTR, "dq_accum"), (OUT_PTR, "dq"), ("int", "n_q"), ("int", "heads_q"), ("int", "n_pad"),
                            ("float", "scale"), *_strides("dq")),
    )


def dq_producer(spec: AttentionSpec) -> DqProducer | None:
    ws, bwd = spec.backward.dq_warp_specialized, spec.backward
    if ws is None:
        return None
    consumers = bwd.dq_warps // WARPGROUP_WARPS
    return DqProducer(block_threads=32 * bwd.dq_warps + 32 * WARPGROUP_WARPS, producer_warpgroup=consumers,
                      producer_registers=ws.producer_registers, consumer_registers=ws.consumer_registers,
                      blocks_per_sm=dq_producer_blocks_per_sm(consumers))


def dkdv_plan(spec: AttentionSpec) -> DkdvPlan:
    bwd, d, dv = spec.backward, spec.head_dim, spec.dv
    warps, key_warps = bwd.warps, bwd.warps // bwd.head_split
    threads, chunks, v_chunks = 32 * warps, d // CHUNK_ELEMS, dv // CHUNK_ELEMS
    warp_keys = bwd.block_kv // key_warps
    k_frags, s_n_frags, d_cols = warp_keys // MMA_M, bwd.block_q // MMA_N, d // bwd.head_split
    wgmma = spec.wgmma_backward
    # every tile one row layout, as wide as the wider head (V and dO leave columns unused where
    # narrower, as the forward's tiles do); wgmma: rows of swizzle atoms, unpadded
    smem_row = spec.row_width if wgmma else spec.row_width + PAD_ELEMS
    smem_align = SWIZZLE_ATOM_BYTES if wgmma else CHUNK_BYTES
    kv_tile_bytes = bwd.block_kv * smem_row * spec.element.bytes
    q_tile_bytes = bwd.block_q * smem_row * spec.element.bytes
    # a stage: Q, dO, their rows' LSE and D; every tile starts on a swizzle atom
    stage_bytes = -(-(2 * q_tile_bytes + 2 * bwd.block_q * 4) // smem_align) * smem_align
    ws = bwd.warp_specialized
    persistent = bool(ws and ws.persistent)
    kv_slots = 2 if persistent else 1  # a persistent block loads its next tile's K and V under this one
    smem_bytes = kv_slots * 2 * kv_tile_bytes + bwd.stages * stage_bytes
    if wgmma:  # a "landed" and a "freed" mbarrier per slot of the Q/dO ring (and of K and V's, under TMA)
        smem_bytes += 2 * (bwd.stages + (kv_slots if ws else 0)) * MBARRIER_BYTES
    barriers_end = smem_bytes
    ds_offset = -(-smem_bytes // smem_align) * smem_align
    if spec.atomic_dq:  # two dS^T buffers after the barriers, on a swizzle atom; then dQ's staging, a warp's each
        smem_bytes = ds_offset + 2 * bwd.block_kv * bwd.block_q * spec.element.bytes + warps * DQ_STAGE_BYTES
    # warp_specialized: each warpgroup's staged dQ's destination, for the producer's dQ writer, where
    # the barriers leave room before the dS^T buffers' alignment, else after the staging
    destinations = DQ_DESTINATION_BYTES * warps // WARPGROUP_WARPS
    dq_rows_offset = 0
    dq_writer = spec.atomic_dq and ws is not None and spec.head_dim in DQ_WRITER_HEAD_DIMS
    if dq_writer:
        if ds_offset - barriers_end >= destinations:
            dq_rows_offset = ds_offset - destinations
        else:
            dq_rows_offset, smem_bytes = smem_bytes, smem_bytes + destinations
    terms, mod = register_terms(spec, "dkdv"), spec.score_mod
    acc, s = int(terms["acc"]), int(terms["s"])  # dK and dV; S^T (then P^T), dP^T beside it
    registers = predict_registers(spec, "dkdv")
    tiles = dkdv_wgmma_numbers(spec) if wgmma else dict.fromkeys(DKDV_WGMMA_NUMBERS, 0)
    if ws:
        atomic_fit = spec.atomic_dq and ws.consumer_registers >= ATOMIC_DQ_FITTED_CONSUMERS
        registers += (WARP_SPECIALIZED_ATOMIC_DQ * atomic_fit + WARP_SPECIALIZED_BIAS_GRAD * bwd.bias_grad
                      + WARP_SPECIALIZED_BF16_EARLY_PACK * (tiles["early_p_pack"] and spec.dtype == "bfloat16")
                      - WARP_SPECIALIZED_SAVING * (spec.dv == spec.head_dim))
    register_limit = ws.consumer_registers if ws else MAX_REGISTERS
    limit = SMEM_PER_BLOCK[spec.arch]
    if smem_bytes > limit:
        raise searched_rule(
            "backward", f"block_kv {bwd.block_kv}, block_q {bwd.block_q}, stages {bwd.stages}",
            f"the dK/dV kernel needs {smem_bytes} bytes of shared memory ({kv_slots} pair(s) of K and V tiles of "
            f"{bwd.block_kv} rows, {bwd.stages} stages of Q and dO tiles of {bwd.block_q}) but {spec.arch} allows "
            f"{limit} per block", dkdv_smem_fixes(spec), "use fewer stages, a smaller block_q or a smaller block_kv"
            + (", or remove warp_specialized.persistent" if persistent else ""), trains, spec)
    if registers > register_limit:
        fix, change = dkdv_register_fix(spec)
        raise SpecError(rule(
            "backward", f"block_kv {bwd.block_kv}, block_q {bwd.block_q}, warps {warps}, head_split {bwd.head_split}",
            f"the dK/dV kernel predicts {registers} registers a thread ({acc} for dK and dV, {s} for each of S^T "
            f"and dP^T{', and as many for the score derivative' if mod.nonlinear else ''}) over the "
            f"{register_limit} limit{' (warp_specialized.consumer_registers)' if ws else ''}: it would spill",
            fix, change))
    captured = tuple(expression.captured_names(mod.captured)[i] for i in bwd.captured_grads)
    return DkdvPlan(
        mainloop="sm90" if wgmma else "sm80", block_q=bwd.block_q, block_kv=bwd.block_kv, threads=threads, warps=warps, head_split=bwd.head_split,
        key_warps=key_warps, warp_keys=warp_keys, k_frags=k_frags, s_n_frags=s_n_frags,
        d_n_frags=d_cols // MMA_N, d_cols=d_cols, dv_n_frags=dv // bwd.head_split // MMA_N, dv_cols=dv // bwd.head_split,
        qk_k_steps=d // MMA_K, v_k_steps=dv // MMA_K, q_k_steps=bwd.block_q // MMA_K,
        stages=bwd.stages, persistent=persistent, kv_slots=kv_slots, kv_slot_bytes=2 * kv_tile_bytes,
        smem_row=smem_row, chunks_per_row=chunks,
        copy_rows_per_pass=threads // chunks if threads % chunks == 0 else 0,
        # V and dO copy as K and Q do: by passes of whole rows where both widths divide the threads
        v_chunks_per_row=v_chunks, v_copy_rows_per_pass=threads // v_chunks if threads % v_chunks == 0
        and threads % chunks == 0 else 0,
        kv_tile_bytes=kv_tile_bytes, q_tile_bytes=q_tile_bytes, stage_bytes=stage_bytes,
        kv_load_bytes=bwd.block_kv * (d + dv) * spec.element.bytes, qdo_load_bytes=bwd.block_q * (d + dv) * spec.element.bytes,
        row_floats_chunks=bwd.block_q * 4 // 16, row_bytes=bwd.block_q * 4, out_chunks=bwd.block_kv * chunks,
        v_out_chunks=bwd.block_kv * v_chunks,
        smem_bytes=smem_bytes, predicted_registers=registers, element_bytes=spec.element.bytes, smem_align=smem_align,
        mask_lane_words=-(-bwd.block_q // LANE_COLUMNS), mask_params=KINDS[spec.mask.kind].params, score_params=score_params(spec),
        **tiles,
        **(atomic_dq_numbers(spec, ds_offset) if spec.atomic_dq else dict.fromkeys(ATOMIC_DQ_NUMBERS, 0)),
        dq_writer=dq_writer, dq_rows_offset=dq_rows_offset,
        dq_barrier_threads=32 * (WARPGROUP_WARPS + 1) if dq_writer else 0,
        bias_grad=mod.bias if bwd.bias_grad else "", bias_grad_params=BIAS_GRAD_PARAMS if bwd.bias_grad else (),
        captured_grads=captured, captured_grad_params=captured_grad_params(captured),
        ds_before_chain=(bwd.bias_grad and mod.softcap is not None) or (bool(captured) and mod.nonlinear),
        warp_specialized=ws is not None, column_blocks=False, block_threads=threads + (32 * WARPGROUP_WARPS if ws else 0),
        producer_warpgroup=warps // WARPGROUP_WARPS if ws else 0,
        producer_registers=ws.producer_registers if ws else 0, consumer_registers=ws.consumer_registers if ws else 0)


def trains(spec: AttentionSpec) -> None:
    """Refuses (SpecError) what fagen.load's parse_spec refuses beyond the spec's own rules: the
    forward's plan and the backward's (the check a backward fix is searched with)."""
    plan(spec)
    backward_plan(spec)


def backward_sections(spec: AttentionSpec) -> Iterable[Fix]:
    """A backward: section for a spec without one: the defaults, then the defaults changed as
    dkdv_register_fixes would change them, one at a time, then all so far (the defaults' dK/dV
    tile is head_dim 64's; head_dim 256 takes several)."""
    yield "add a backward: section (an empty mapping takes the defaults)", {"backward": {}}
    changes = [{field.removeprefix("backward."): value for field, value in change.items()}
               for _, change in dkdv_register_fixes(spec.model_copy(update={"backward": Backward()}))]
    for section in [*changes, *({k: v for change in changes[:i + 1] for k, v in change.items()}
                                for i in range(1, len(changes)))]:
        yield f"add backward: {{{', '.join(f'{k}: {v}' for k, v in section.items())}}}", {"backward": section}


def dq_kernel_plan(spec: AttentionSpec) -> KernelPlan:
    """The dQ kernel's forward plan; the forward's resource rules it breaks refused in the
    backward's fields (dq_block_q, dq_block_kv, dq_warps: the forward's advice names its own)."""
    bwd = spec.backward
    try:
        with fixes_unsought():
            return plan(dq_spec(spec))
    except SpecError as refused:
        broken = str(refused).rsplit("; ", 1)[0]  # "field = value: what it breaks", its advice dropped
        raise searched_rule(
            "backward", f"dq_block_q {bwd.dq_block_q}, dq_block_kv {bwd.dq_block_kv}, dq_warps {bwd.dq_warps}",
            f"the dQ kernel's tiling, a forward one, is refused ({broken})", dq_fixes(spec),
            "use a smaller dq_block_kv or dq_block_q", trains, spec) from None


def dq_fixes(spec: AttentionSpec) -> Iterable[Fix]:
    """What takes registers and shared memory from the dQ kernel, least first: fewer keys a tile,
    more warps (fewer rows each, only where each keeps two m16 fragments), fewer rows, no producer."""
    bwd = spec.backward
    for dq_block_kv in range(bwd.dq_block_kv - MMA_K, 0, -MMA_K):
        yield f"use dq_block_kv: {dq_block_kv}", {"backward.dq_block_kv": dq_block_kv}
    if bwd.dq_block_q > MMA_M * bwd.dq_warps and bwd.dq_warps < 8:
        yield f"use dq_warps: {2 * bwd.dq_warps}", {"backward.dq_warps": 2 * bwd.dq_warps}
    for dq_block_q in (q for q in (64, 32, 16) if q < bwd.dq_block_q):
        yield f"use dq_block_q: {dq_block_q}", {"backward.dq_block_q": dq_block_q}
    if bwd.dq_warp_specialized is not None:
        yield "remove backward.dq_warp_specialized", {"backward.dq_warp_specialized": REMOVE}


def dkdv_smem_fixes(spec: AttentionSpec) -> Iterable[Fix]:
    """What takes shared memory from the dK/dV kernel: the persistent block's second K/V slot
    (alone, then with each of the rest), fewer Q/dO stages, fewer queries a step, fewer keys a block."""
    bwd = spec.backward
    smaller = [*((f"use stages: {stages}", {"backward.stages": stages}) for stages in range(bwd.stages - 1, 0, -1)),
               *((f"use block_q: {q}", {"backward.block_q": q}) for q in (64, 32, 16) if q < bwd.block_q),
               *((f"use block_kv: {kv}", {"backward.block_kv": kv}) for kv in (128, 64, 32, 16) if kv < bwd.block_kv)]
    if bwd.warp_specialized is not None and bwd.warp_specialized.persistent:
        unpersist = ("remove backward.warp_specialized.persistent", {"backward.warp_specialized.persistent": REMOVE})
        yield unpersist
        yield from (combined(unpersist, fix) for fix in smaller)
    yield from smaller


def dkdv_register_fixes(spec: AttentionSpec) -> list[tuple[str, dict]]:
    """The changes that take registers from the dK/dV kernel, least first, as (text, fields):
    fewer queries a step (and keys a dQ tile), more warps and dK and dV split across warp pairs
    (mma.sync), no producer (its consumers' registers are capped), dQ out of the kernel (atomic dQ's
    tile and addresses; deterministic mode's Q-major kernel computes it)."""
    bwd, fixes = spec.backward, []
    for bq in (bq for bq in (64, 32, 16) if bq < bwd.block_q):  # with the dQ kernel's fewest keys too
        fixes.append((f"use block_q: {bq}", {"backward.block_q": bq}))
        if not spec.atomic_dq and bwd.dq_block_kv > MMA_K:
            fixes.append((f"use block_q: {bq} and dq_block_kv: {MMA_K}",
                          {"backward.block_q": bq, "backward.dq_block_kv": MMA_K}))
    if not spec.wgmma_backward:
        if bwd.warps < 8:
            fixes.append((f"use warps: {2 * bwd.warps}", {"backward.warps": 2 * bwd.warps}))
        if bwd.head_split == 1:
            fixes += [(f"use head_split: 2 with block_kv: {bkv}", {"backward.head_split": 2, "backward.block_kv": bkv})
                      for bkv in (bwd.block_kv, bwd.block_kv // 2)]
    if bwd.warp_specialized is not None:
        fixes.append(("remove backward.warp_specialized", {"backward.warp_specialized": REMOVE}))
    if spec.atomic_dq:  # dQ by a kernel of its own: no dQ tile here, and steps that need not divide the warpgroups
        fixes += [("use deterministic: true" if bq == bwd.block_q else f"use block_q: {bq}, deterministic: true",
                   {"backward.block_q": bq, "backward.deterministic": True})
                  for bq in dict.fromkeys((bwd.block_q, 64, 32, 16)) if bq <= bwd.block_q]
    return fixes


def dkdv_register_fix(spec: AttentionSpec) -> tuple[str, dict | None]:
    """The first of dkdv_register_fixes whose spec validates (text, fields), or a text alone."""
    return first_valid(spec, dkdv_register_fixes(spec), trains) or ("use a smaller block_q, or fewer score modifiers", None)


# From this many f32 registers of S^T a thread (128 queries a step), the producer-fed wgmma dK/dV
# kernel packs P^T to 16-bit pairs before dP^T lands and computes dS^T from them: S^T and dP^T in
# f32 no longer sit beside dK and dV at once, so head_dim 64's 128-query steps fit its consumers'
# 240 registers (0 spills in float16, +2-7% over the copying kernel, H200). At 64 queries a step
# the unpacking costs 3%; the copying kernel (255 registers) keeps the f32 tile.
EARLY_P_PACK_S_REGS = 64
DKDV_WGMMA_NUMBERS = ("warpgroup_warps", "atoms_per_row", "atom_elems", "atom_bytes", "row_group_bytes",
                      "kv_atom_step_bytes", "q_atom_step_bytes", "d_atoms", "dv_atoms", "atom_columns", "atom_row_bytes",
                      "k_step_bytes",
                      "k_steps_per_atom", "q_step_bytes", "warpgroup_keys_bytes", "mbarrier_bytes", "s_acc_regs", "d_acc_regs",
                      "dv_acc_regs", "early_p_pack")
ATOMIC_DQ_NUMBERS = ("atomic_dq", "ds_offset", "ds_tile_bytes", "ds_atoms_per_row", "ds_row_group_bytes", "dq_tiles",
                     "dq_key_split", "dq_n_tiles", "dq_key_steps", "dq_n_frags", "ds_barrier_threads",
                     "ds_stored_first", "dq_stage_offset", "dq_stage_bytes")
# Where a step's dS^T goes to shared memory before dV's MMAs are issued (FlashAttention-3's order at
# head_dim 64), not while they run. Measured on an H200 (fp16, same process, arms rotated): head_dim
# 64 +1.3% causal 1k, +4.9% dense 4k; head_dim 128 -0.3% causal 1k, -2.9% causal 4k, -0.6% dense 4k.
DS_STORED_FIRST_HEAD_DIMS = (64,)
# A warp's share of a 64 x 64 dQ tile: 16 rows x 64 columns of f32, its accumulator fragments.
DQ_STAGE_BYTES = MMA_M * SWIZZLE_ATOM_ELEMS * 4
DQ_DESTINATION_BYTES = 8  # a warpgroup's staged part: its address in dq_accum, for the producer's dQ writer
# Where a producer-fed dK/dV kernel's dQ adds are issued by one warp of the producer warpgroup
# (FlashAttention-3's dQ writer), not by each consumer warp. Measured on an H200 (fp16 unless said,
# same process, arms alternating): head_dim 128 +0.3% causal 1k, +1.9% causal 4k, +4.3% causal 16k,
# +2.5% dense 4k, +2.3% dense 16k, bf16 causal 4k +3.4%; head_dim 64 +0.8% causal 1k (persistent),
# -1.7% causal 4k, -1.4% dense 4k.
DQ_WRITER_HEAD_DIMS = (128,)


def atomic_dq_numbers(spec: AttentionSpec, ds_offset: int) -> dict[str, int]:
    """dS^T as wgmma's MN-major A of dQ = dS.K: keys are its k16 steps (rows of the buffer),
    queries its M (64-wide swizzle atoms side by side, as a tile's head_dim)."""
    bwd = spec.backward
    atoms, n_tiles = bwd.block_q // SWIZZLE_ATOM_ELEMS, spec.head_dim // SWIZZLE_ATOM_ELEMS
    tiles = atoms * n_tiles
    warpgroups = bwd.warps // WARPGROUP_WARPS
    key_split = warpgroups // tiles
    return {
        "atomic_dq": True,
        "ds_offset": ds_offset,
        "ds_tile_bytes": bwd.block_kv * bwd.block_q * spec.element.bytes,
        "ds_atoms_per_row": atoms,
        "ds_row_group_bytes": atoms * SWIZZLE_ATOM_BYTES,
        "dq_tiles": tiles,
        "dq_key_split": key_split,
        "dq_n_tiles": n_tiles,
        "dq_key_steps": bwd.block_kv // key_split // MMA_K,
        "dq_n_frags": SWIZZLE_ATOM_ELEMS // MMA_N,
        # a warpgroup that owns its share of the keys reads only the dS^T rows it wrote
        "ds_barrier_threads": 32 * (WARPGROUP_WARPS if key_split == warpgroups else bwd.warps),
        "ds_stored_first": spec.head_dim in DS_STORED_FIRST_HEAD_DIMS,
        "dq_stage_offset": ds_offset + 2 * bwd.block_kv * bwd.block_q * spec.element.bytes,
        "dq_stage_bytes": DQ_STAGE_BYTES,
    }


def dq_accum_index(row: int, col: int, cols: int, block_q: int) -> int:
    """Where atomic dQ's element (row, col) of a head's [rows, cols] lives in dq_accum (a float
    index from the head's start). The dK/dV kernel adds each step's fragments in register order,
    so a query tile of block_q rows is its m64n64 tiles one after another (tile i: rows 64 (i //
    tiles across cols), columns 64 (i % that)), each as its 4 warps' 16 rows, each n8 fragment by
    fragment, each lane's 4 floats (rows g, g + 8 by columns 2c, 2c + 1: lane 4g + c). The
    postprocess reads it back; this is its specification, for the tests."""
    r, c = row % block_q, col % SWIZZLE_ATOM_ELEMS
    tile = r // WARPGROUP_ROWS * (cols // SWIZZLE_ATOM_ELEMS) + col // SWIZZLE_ATOM_ELEMS
    warp, g, half = r % WARPGROUP_ROWS // MMA_M, r % 8, r % MMA_M // 8
    fragment, lane = c // MMA_N, 4 * g + c % MMA_N // 2
    warp_floats = DQ_STAGE_BYTES // 4
    return ((row - r) * cols + (tile * WARPGROUP_WARPS + warp) * warp_floats + (fragment * 32 + lane) * 4
            + 2 * half + c % 2)


def dkdv_wgmma_numbers(spec: AttentionSpec) -> dict[str, int]:
    """The wgmma dK/dV kernel's offsets: its tiles are laid out as the forward's (fagen.plan), with
    keys in the forward's query rows (K and V are wgmma's A) and queries in its key rows (Q and
    dO are the B of S^T and dP^T, then of dK and dV, transposed)."""
    bwd = spec.backward
    # a TMA producer writes column blocks, a box each; cp.async, row groups
    forward = wgmma_numbers(spec, 0, 0, column_blocks=bwd.warp_specialized is not None, rows=(bwd.block_kv, bwd.block_q))
    threads_per_warpgroup = 32 * WARPGROUP_WARPS
    s_acc_regs = WARPGROUP_ROWS * bwd.block_q // threads_per_warpgroup
    return {
        "warpgroup_warps": WARPGROUP_WARPS,
        "atoms_per_row": spec.row_width // SWIZZLE_ATOM_ELEMS,
        **{name: forward[name] for name in ("atom_elems", "atom_bytes", "row_group_bytes", "k_step_bytes",
                                            "k_steps_per_atom")},
        "kv_atom_step_bytes": forward["q_atom_step_bytes"],
        "q_atom_step_bytes": forward["k_atom_step_bytes"],
        "d_atoms": spec.head_dim // forward["atom_columns"],
        "dv_atoms": spec.dv // forward["atom_columns"],
        "atom_columns": forward["atom_columns"],
        "atom_row_bytes": forward["atom_row_bytes"],
        "q_step_bytes": forward["v_step_bytes"],
        "warpgroup_keys_bytes": forward["warpgroup_q_bytes"],
        "mbarrier_bytes": MBARRIER_BYTES,
        "s_acc_regs": s_acc_regs,
        "d_acc_regs": WARPGROUP_ROWS * spec.head_dim // threads_per_warpgroup,
        "dv_acc_regs": WARPGROUP_ROWS * spec.dv // threads_per_warpgroup,
        "early_p_pack": bwd.warp_specialized is not None and s_acc_regs >= EARLY_P_PACK_S_REGS,
    }


@dataclass(frozen=True)
class BiasGradLayout:
    """Where the dK/dV kernel adds a bias's gradient: a zeroed f32 buffer, the kernel's element
    strides into it (BIAS_GRAD_PARAMS, 0 on broadcast axes) and the axes summed afterwards."""

    buffer_shape: tuple[int, ...]
    strides: dict[str, int]  # dbias_sb, dbias_sh, dbias_skv, dbias_sq
    summed_axes: tuple[int, ...]  # of the buffer, kept as size 1: then it has the bias's shape


def bias_grad_layout(bias_shape: tuple[int, ...], batch: int, heads_kv: int, deterministic: bool) -> BiasGradLayout:
    """The bias's gradient buffer for a bias of bias_shape ([B|1, H|1, (Nq,) Nk]). A block owns
    one (batch, KV head) and adds each element from one thread in step order, so only blocks
    sharing an element race: a bias broadcast over the batch, or over the heads of more than one
    KV head. Deterministic then gives each (batch, KV head) a copy of its own, summed afterwards
    (in a fixed order; memory: that many copies of the bias); otherwise they add into one."""
    over_batch = bias_shape[0] == 1 and batch > 1 and deterministic
    over_heads = bias_shape[1] == 1 and heads_kv > 1 and deterministic
    shape = (batch if over_batch else bias_shape[0], heads_kv if over_heads else bias_shape[1], *bias_shape[2:])
    contiguous = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return BiasGradLayout(
        buffer_shape=shape,
        strides={"dbias_sb": contiguous[0] if shape[0] > 1 else 0,
                 "dbias_sh": contiguous[1] if shape[1] > 1 and not over_heads else 0,
                 "dbias_skv": contiguous[1] if over_heads else 0,
                 "dbias_sq": contiguous[2] if len(shape) == 4 else 0},
        summed_axes=tuple(axis for axis, on in ((0, over_batch), (1, over_heads)) if on))
