"""The plan of the FP8 backward on sm_90a (e4m3 q, k, v; dO and O in the forward's output type):
the numbers templates/sm90/fp8_backward.cu.j2 prints (fagen.fp8_backward is the call;
notes/fp8_backward.md the design and its measurements).

FP8 wgmma reads both operands K-major from shared memory (8-bit types have no transpose bit), A
may come from registers. So the block runs keys as M throughout: 128 keys of one KV head, a
consumer warpgroup's 64 of them the rows of every product but dQ's, a step 64 queries of one
query head of the group:

    S^T  = K_w.Q^T     A: K's rows           B: Q's stage             (m64n64k32, d 128)
    dP^T = V_w.dO^T    A: V's rows           B: dO's stage (e4m3, quantised by the preprocess)
    dV  += P^T.dO      A: P^T in registers   B: dO^T, the stage transposed in shared memory
    dK  += dS^T.Q      A: dS^T in registers  B: Q^T, likewise
    dQ   = dS.K        A: dS, stored         B: K^T, the block's K transposed once (m64n64k32, keys 128)

The transposes are the producer warpgroup's three idle warps' (byte permutes between 4-byte
loads and stores), so the loads stay Q's and dO's FP8 rows: 16 KB a step, the bf16 kernel's
bytes a FLOP. A transposed tile keeps wgmma's 128-byte swizzled rows, a step's 64 queries in the
first 64 bytes of each."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from fagen.element_types import ELEMENT_TYPES
from fagen.mask_kinds import KINDS
from fagen.plan import DESCALE_PARAMS, TMA_MAP
from fagen.spec import Mask

FP8_BACKWARD_TYPES = ("float8_e4m3",)  # q, k and v
FP8_BACKWARD_OUT_TYPES = ("bfloat16", "float16")  # O, dO and the gradients
FP8_BACKWARD_HEAD_DIMS = (128,)  # one 128-byte swizzle row of FP8: Q's, K's and V's rows, one box wide
# The mask kinds whose test is a function of positions alone (no kernel parameter: a document's
# bounds or a block mask's lists are not read yet), walked key-major as the dK/dV kernels walk them
FP8_BACKWARD_MASKS = tuple(name for name, kind in KINDS.items() if not kind.params)


@dataclass(frozen=True)
class Fp8BackwardPlan:
    """Tiles, wgmma steps, shared memory and roles of one (q/k/v type, output type, head_dim)."""

    dtype: str = "float8_e4m3"
    out_dtype: str = "bfloat16"
    head_dim: int = 128  # Q's, K's and V's columns, and O's
    block_kv: int = 128  # keys a block ...
    group_keys: int = 64  # ... a consumer warpgroup's: the M of S^T, dP^T, dV and dK
    block_q: int = 64  # queries a step: S^T's N, the k of dV and dK, dQ's M
    q_stages: int = 2
    mma_k: int = 32  # an FP8 wgmma's k: 32 bytes along a K-major row
    row_bytes: int = 128  # a 128-byte swizzle row: every tile's
    producer_registers: int = 40  # the loader and the three transposing warps
    consumer_registers: int = 232
    mbarrier_bytes: int = 8
    smem_align: int = 1024
    warpgroup_threads: int = 128
    consumer_warpgroups: int = 2
    transposer_warps: int = 3  # the producer warpgroup's warps 1-3 (warp 0 issues the loads)
    row_vector_bytes: int = 256  # a step's 64 floats of LSE (log2 units) or of D
    warp_specialized: bool = True  # (read by the shared sm90 includes: a TMA producer, no cp.async)
    # dK's power-of-two row scales 2^e: e before a row's first nonzero step, its range (2^e stays a
    # normal float; dS past it is dust or overflow anyway), and how far it may fall in one step (the
    # row's accumulator rescaled up by at most 2^drop)
    exponent_none: int = -1000
    exponent_min: int = -100
    exponent_max: int = 100
    exponent_drop: int = 64
    # which (query, key) pairs count: the kind's partial (templates/masks/), walked key-major; its
    # diagonal's offset a launch parameter (mask_offset)
    mask: Mask = field(default_factory=Mask)
    # dQ's adds in key-block order, the last first (bitwise repeatable): a warp's add into a tile
    # waits for the key blocks after its own that visit the tile (dq_turns)
    deterministic: bool = False

    def __post_init__(self):
        assert self.dtype in FP8_BACKWARD_TYPES, self.dtype
        assert self.out_dtype in FP8_BACKWARD_OUT_TYPES, self.out_dtype
        assert self.head_dim in FP8_BACKWARD_HEAD_DIMS, "the tiling below is worked out for head_dim 128"
        assert self.consumer_warpgroups * self.group_keys == self.block_kv
        assert self.mask.kind in FP8_BACKWARD_MASKS and self.mask.expression is None, self.mask

    @property
    def name(self) -> str:
        """fp8_backward_e4m3_d128_bf16, and a mask's kind and the hash of its fields after it (as
        the forward's variants are named)."""
        masked = "" if self.mask.kind == "none" else \
            f"_{self.mask.kind}_{hashlib.sha256(repr(self.mask).encode()).hexdigest()[:10]}"
        return (f"fp8_backward_{ELEMENT_TYPES[self.dtype].short}_d{self.head_dim}_"
                f"{ELEMENT_TYPES[self.out_dtype].short}{masked}{'_deterministic' * self.deterministic}")

    @property
    def mask_params(self) -> tuple[tuple[str, str], ...]:  # (the mask partial's: none for these kinds)
        return KINDS[self.mask.kind].params

    @property
    def operand_ptx(self) -> str:  # the wgmma operands'
        return ELEMENT_TYPES[self.dtype].ptx

    @property
    def ptx(self) -> str:  # the gradients' (the shared wrappers' pack2)
        return ELEMENT_TYPES[self.out_dtype].ptx

    @property
    def max_finite(self) -> float:  # where a scaled operand's largest element lands
        return ELEMENT_TYPES[self.dtype].max_finite

    @property
    def p_log2_scale(self) -> int:  # P times 2^this before its rounding, as the forward's
        return ELEMENT_TYPES[self.dtype].p_log2_scale

    # tiles: rows of 128 bytes, 128-byte swizzled, each a multiple of 8 rows
    @property
    def kv_tile_bytes(self) -> int:  # K's, V's and K^T's (head_dim rows of the block's keys)
        return self.block_kv * self.row_bytes

    @property
    def q_tile_bytes(self) -> int:  # a step's Q or dO rows
        return self.block_q * self.row_bytes

    @property
    def qt_tile_bytes(self) -> int:  # Q^T or dO^T: head_dim rows, the step's queries in the first 64 bytes
        return self.head_dim * self.row_bytes

    @property
    def stage_bytes(self) -> int:  # Q, dO, Q^T, dO^T
        return 2 * self.q_tile_bytes + 2 * self.qt_tile_bytes

    @property
    def stage_tx(self) -> int:  # what a step's loads deliver: Q's and dO's rows and the two row vectors
        return 2 * self.q_tile_bytes + 2 * self.row_vector_bytes

    @property
    def kv_tx(self) -> int:  # K's and V's tiles, loaded once
        return 2 * self.kv_tile_bytes

    @property
    def row_group_bytes(self) -> int:  # 8 rows: wgmma's stride byte offset
        return 8 * self.row_bytes

    @property
    def k_steps(self) -> int:  # S^T's and dP^T's k32 steps over head_dim
        return self.head_dim // self.mma_k

    @property
    def q_k_steps(self) -> int:  # dV's and dK's over a step's queries
        return self.block_q // self.mma_k

    @property
    def kv_k_steps(self) -> int:  # dQ's over the block's keys
        return self.block_kv // self.mma_k

    @property
    def s_n_frags(self) -> int:  # n8 fragments of S^T and dP^T: the step's queries
        return self.block_q // 8

    @property
    def g_n_frags(self) -> int:  # of dV and dK: head_dim columns
        return self.head_dim // 8

    @property
    def dq_columns(self) -> int:  # a warpgroup's dQ columns
        return self.head_dim // self.consumer_warpgroups

    @property
    def dq_n_frags(self) -> int:
        return self.dq_columns // 8

    @property
    def dq_warp_bytes(self) -> int:  # a warp's 16 rows of its warpgroup's dQ columns: fragments x 32 lanes x 4 floats
        return self.dq_n_frags * 32 * 16

    @property
    def dq_tile_floats(self) -> int:  # a 64-row tile of dQ's accumulator
        return self.block_q * self.head_dim

    @property
    def warpgroup_warps(self) -> int:
        return self.warpgroup_threads // 32

    @property
    def consumer_threads(self) -> int:
        return self.consumer_warpgroups * self.warpgroup_threads

    @property
    def consumer_warps(self) -> int:
        return self.consumer_threads // 32

    @property
    def transposer_threads(self) -> int:
        return 32 * self.transposer_warps

    @property
    def producer_warpgroup(self) -> int:
        return self.consumer_warpgroups

    @property
    def threads(self) -> int:
        return self.consumer_threads + self.warpgroup_threads

    # shared memory, from the aligned base: K, V, K^T, the ring of (Q, dO, Q^T, dO^T) stages, its
    # row vectors, the dS tile, dQ's staging, the consumer warps' dS maxima, the barriers
    @property
    def k_at(self) -> int:
        return 0

    @property
    def v_at(self) -> int:
        return self.kv_tile_bytes

    @property
    def kt_at(self) -> int:
        return 2 * self.kv_tile_bytes

    @property
    def ring_at(self) -> int:
        return 3 * self.kv_tile_bytes

    @property
    def stage_do_at(self) -> int:  # within a stage
        return self.q_tile_bytes

    @property
    def stage_qt_at(self) -> int:
        return 2 * self.q_tile_bytes

    @property
    def stage_dot_at(self) -> int:
        return 2 * self.q_tile_bytes + self.qt_tile_bytes

    @property
    def rows_at(self) -> int:
        return self.ring_at + self.q_stages * self.stage_bytes

    @property
    def ds_at(self) -> int:
        return -(-(self.rows_at + self.q_stages * 2 * self.row_vector_bytes) // self.smem_align) * self.smem_align

    @property
    def dq_stage_at(self) -> int:
        return self.ds_at + self.q_tile_bytes

    @property
    def maxima_at(self) -> int:
        return self.dq_stage_at + self.consumer_warps * self.dq_warp_bytes

    @property
    def barriers_at(self) -> int:
        return self.maxima_at + 4 * self.consumer_warps

    @property
    def barriers(self) -> int:  # K and V landed, K^T written, the ring's two a stage, a stage's transposes written
        return 2 + 3 * self.q_stages

    @property
    def smem_bytes(self) -> int:
        return self.barriers_at + self.barriers * self.mbarrier_bytes + self.smem_align

    # the launch's numbers (fagen.fp8_backward)
    def grid(self, n_kv: int, heads_kv: int, batch: int) -> tuple[int, int, int]:  # a block a 128-key tile
        return -(-n_kv // self.block_kv), heads_kv, batch

    def box_rows(self, tensor: str) -> int:  # a step's rows of q and dO, the block's keys of k and v
        return self.block_kv if tensor in ("k", "v") else self.block_q

    def postprocess_blocks(self, padded_q: int) -> int:  # a block a warpgroup's columns of a 64-row tile
        return padded_q // self.block_q * self.consumer_warpgroups


PREPROCESS_ROWS = 4  # query rows a preprocess block: a warp each
POSTPROCESS_THREADS = 128  # a warpgroup's four warps' pieces of a tile

FP8_BACKWARD_PARAMS: tuple[tuple[str, str], ...] = (
    (TMA_MAP, "q_map"), (TMA_MAP, "k_map"), (TMA_MAP, "v_map"), (TMA_MAP, "do_map"),
    ("const float* __restrict__", "rows"), ("const float* __restrict__", "do_amax"), *DESCALE_PARAMS,
    ("float* __restrict__", "dq_accum"), ("unsigned* __restrict__", "dq_turns"),
    ("grad_t* __restrict__", "dk"), ("long long", "dk_sb"), ("long long", "dk_sh"), ("long long", "dk_sn"),
    ("grad_t* __restrict__", "dv"), ("long long", "dv_sb"), ("long long", "dv_sh"), ("long long", "dv_sn"),
    ("int", "heads"), ("int", "group"), ("int", "n_q"), ("int", "n_kv"), ("int", "padded_q"), ("int", "mask_offset"),
    ("float", "scale_log2"), ("float", "scale"),
)
# dO's largest magnitude a (batch, KV head): the first pass over dO
FP8_AMAX_PARAMS: tuple[tuple[str, str], ...] = (
    ("const grad_t* __restrict__", "dout"), ("long long", "do_sb"), ("long long", "do_sh"), ("long long", "do_sn"),
    ("float* __restrict__", "do_amax"), ("int", "heads"), ("int", "group"), ("int", "n_q"),
)
# D, the LSE in log2 units, dO in e4m3 and dQ's accumulator cleared: the second
FP8_PREPROCESS_PARAMS: tuple[tuple[str, str], ...] = (
    ("const grad_t* __restrict__", "out"), ("long long", "o_sb"), ("long long", "o_sh"), ("long long", "o_sn"),
    ("const grad_t* __restrict__", "dout"), ("long long", "do_sb"), ("long long", "do_sh"), ("long long", "do_sn"),
    ("const float* __restrict__", "lse"), ("const float* __restrict__", "do_amax"), *DESCALE_PARAMS[6:],
    ("unsigned char* __restrict__", "do8"), ("float* __restrict__", "rows"), ("float* __restrict__", "dq_accum"),
    ("unsigned* __restrict__", "dq_turns"), ("int", "heads"), ("int", "group"), ("int", "n_q"), ("int", "n_kv"),
    ("int", "padded_q"), ("int", "mask_offset"),
)
# dQ = the accumulator times scale * k_descale * v_descale / dO's scale
FP8_POSTPROCESS_PARAMS: tuple[tuple[str, str], ...] = (
    ("const float* __restrict__", "dq_accum"), ("const float* __restrict__", "do_amax"), *DESCALE_PARAMS[3:],
    ("grad_t* __restrict__", "dq"), ("long long", "dq_sb"), ("long long", "dq_sh"), ("long long", "dq_sn"),
    ("int", "heads"), ("int", "group"), ("int", "n_q"), ("int", "padded_q"), ("float", "scale"),
)
