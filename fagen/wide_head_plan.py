"""The head_dim 512 kernels' plans: the numbers templates/sm90/wide_forward.cu.j2 and
wide_backward.cu.j2 print (fagen.wide_head is the call)."""

from __future__ import annotations

from dataclasses import dataclass

from fagen.column_split import ColumnSplitPlan
from fagen.element_types import ELEMENT_TYPES
from fagen.plan import TMA_MAP

WIDE_HEAD_DIMS = (512,)  # Q's, K's and V's width: Gemma-4's global layers
WIDE_TYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class WideHeadPlan(ColumnSplitPlan):
    """The numbers templates/sm90/wide_forward.cu.j2 prints: tiles, shared memory and roles.

    A block is one 64-row query tile of one head (ColumnSplitPlan's three warpgroups): S =
    Q.K^T is m64n32, 32 k16 steps over 512; O's 512 columns are 256 in each consumer warpgroup.
    A KV tile is 32 keys: Q's 64 KB and two stages of K and V (64 KB a stage) fill 192 of the 227 KB."""

    head_dim: int = 512
    block_kv: int = 32  # keys a KV tile: S's n
    kv_stages: int = 2

    @property
    def name(self) -> str:
        return f"wide_forward_{ELEMENT_TYPES[self.dtype].short}_d{self.head_dim}"

    @property
    def value_dim(self) -> int:  # V's (and O's) width: Q's
        return self.head_dim

    @property
    def merge_name(self) -> str:  # the module's second kernel: split partials merged by LSE
        return f"wide_merge_{ELEMENT_TYPES[self.dtype].short}_d{self.head_dim}"

    @property
    def atoms(self) -> int:  # 64-column blocks of a row
        return self.head_dim // self.atom_columns

    @property
    def q_bytes(self) -> int:
        return self.atoms * self.atom_bytes

    @property
    def k_bytes(self) -> int:  # a KV tile of K (and of V)
        return self.atoms * self.kv_atom_bytes

    @property
    def stage_bytes(self) -> int:  # K's tile, then V's
        return 2 * self.k_bytes

    @property
    def ring_at(self) -> int:
        return self.q_bytes

    @property
    def p_at(self) -> int:
        return self.ring_at + self.kv_stages * self.stage_bytes

    @property
    def smem_bytes(self) -> int:  # Q's barrier and the ring's after the row vectors
        return self.barriers_at + (1 + 2 * self.kv_stages) * self.mbarrier_bytes + self.smem_align

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        return WIDE_PARAMS


WIDE_PARAMS: tuple[tuple[str, str], ...] = (
    (TMA_MAP, "q_map"), (TMA_MAP, "k_map"), (TMA_MAP, "v_map"),
    ("elem_t* __restrict__", "out"), ("long long", "o_sb"), ("long long", "o_sh"), ("long long", "o_sn"),
    ("float* __restrict__", "lse"), ("float* __restrict__", "o_parts"), ("float* __restrict__", "lse_parts"),
    ("int", "splits"), ("int", "heads"), ("int", "group"), ("int", "n_q"), ("int", "n_kv"), ("int", "causal"),
    ("float", "scale_log2"),
)


@dataclass(frozen=True)
class WideBackwardPlan(ColumnSplitPlan):
    """The numbers templates/sm90/wide_backward.cu.j2 prints: the head_dim 512 backward.

    dK and dV of 64 keys at 512 columns are 2 x 64 x 512 f32, the whole register file, so a key
    tile is a cluster of two blocks, each owning half the columns (`half_columns`) of K, V, Q, dO
    and of the gradients. Each computes the partial S^T = K.Q^T and dP^T = V.dO^T over its half
    (m64n64: keys are M, a step's queries N), sends it to its peer's shared memory (st.async)
    and adds the peer's: nothing is computed twice. Warpgroup 0 holds dV (64 x 256 f32: 128
    registers a thread), warpgroup 1 dK; dQ's half goes to a float32 accumulator by bulk
    reduce-adds, one a warp a 64-column chunk.

    Shared memory (bf16): K's and V's halves 32 KB each, two stages of Q's and dO's halves (64 KB
    a stage), the rows' LSE and D, and the two 16 KB exchange buffers: 225 KB of the 227."""

    head_dim: int = 512
    block_kv: int = 64  # keys a block: the M of S^T and dP^T; also the queries of a step (their n)
    q_stages: int = 2
    producer_registers: int = 24
    consumer_registers: int = 240
    row_vector_bytes: int = 256  # a step's 64 floats of LSE (log2 units) or of D
    # warps that free an exchange buffer: S's is free once warpgroup 1 has read P^T from it; dP's
    # once both warpgroups' dQ products have read dS^T from it
    s_readers: int = 4
    dp_readers: int = 8

    def __post_init__(self):
        assert self.block_kv == self.block_rows, "a step's queries are S^T's n: one m64 tile, as its keys"

    @property
    def name(self) -> str:
        return f"wide_backward_{ELEMENT_TYPES[self.dtype].short}_d{self.head_dim}"

    @property
    def value_dim(self) -> int:
        return self.head_dim

    @property
    def half_columns(self) -> int:  # a block's columns: its cluster rank's half (o_columns: dK's and dV's n)
        return self.o_columns

    @property
    def half_atoms(self) -> int:
        return self.half_columns // self.atom_columns

    @property
    def half_bytes(self) -> int:  # a 64-row tile's half: K's, V's, Q's or dO's
        return self.half_atoms * self.atom_bytes

    @property
    def qk_k_steps(self) -> int:  # k16 steps of S^T and dP^T: over a half's columns
        return self.half_columns // self.mma_k

    @property
    def dq_n_frags(self) -> int:  # a dQ chunk: one 64-column atom
        return self.atom_columns // 8

    @property
    def dq_chunks(self) -> int:  # dQ chunks a consumer warpgroup: half of a half's atoms
        return self.half_atoms // 2

    @property
    def atoms_per_row(self) -> int:  # dq_accum's chunks a 64-row tile
        return self.head_dim // self.atom_columns

    @property
    def warpgroup_warps(self) -> int:
        return self.warpgroup_threads // 32

    @property
    def dq_warp_bytes(self) -> int:  # a warp's 16 rows of a dQ chunk: its fragments x 32 lanes x 4 floats
        return self.dq_n_frags * 32 * 16

    @property
    def dq_chunk_bytes(self) -> int:  # a 64 x 64 f32 chunk, staged where its warpgroup's half tile was
        return self.warpgroup_warps * self.dq_warp_bytes

    @property
    def stage_bytes(self) -> int:  # Q's half, then dO's
        return 2 * self.half_bytes

    @property
    def stage_tx(self) -> int:  # what a step's loads deliver: the stage and its two row vectors
        return self.stage_bytes + 2 * self.row_vector_bytes

    @property
    def exchange_bytes(self) -> int:  # a 64 x 64 f32 partial
        return self.block_kv * self.block_rows * 4

    @property
    def k_at(self) -> int:
        return 0

    @property
    def v_at(self) -> int:
        return self.half_bytes

    @property
    def ring_at(self) -> int:
        return 2 * self.half_bytes

    @property
    def rows_at(self) -> int:
        return self.ring_at + self.q_stages * self.stage_bytes

    @property
    def s_exchange_at(self) -> int:  # 1024-aligned: dS^T's swizzled tile lands in dP's
        return -(-(self.rows_at + self.q_stages * 2 * self.row_vector_bytes) // self.smem_align) * self.smem_align

    @property
    def dp_exchange_at(self) -> int:
        return self.s_exchange_at + self.exchange_bytes

    @property
    def barriers_at(self) -> int:
        return self.dp_exchange_at + self.exchange_bytes

    @property
    def barriers(self) -> int:  # K and V landed, the ring's 2 a stage, S and dP full, S and dP free
        return 1 + 2 * self.q_stages + 4

    @property
    def smem_bytes(self) -> int:
        return self.barriers_at + self.barriers * self.mbarrier_bytes + self.smem_align

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        return WIDE_BACKWARD_PARAMS

    # the launch's numbers (fagen.accumulated_dq)
    @property
    def tile_rows(self) -> int:
        return self.block_rows

    def grid(self, n_kv: int, heads_kv: int, batch: int) -> tuple[int, int, int]:  # a cluster of two a 64-key tile
        return 2 * -(-n_kv // self.block_kv), heads_kv, batch

    def box_rows(self, tensor: str) -> int:  # 64 rows of every tensor
        return self.block_kv

    def postprocess_blocks(self, padded_q: int) -> int:  # a block a 64 x 64 chunk of dQ
        return padded_q // self.block_rows * self.atoms_per_row


WIDE_BACKWARD_PARAMS: tuple[tuple[str, str], ...] = (
    (TMA_MAP, "q_map"), (TMA_MAP, "k_map"), (TMA_MAP, "v_map"), (TMA_MAP, "do_map"),
    ("const float* __restrict__", "rows"), ("float* __restrict__", "dq_accum"),
    ("elem_t* __restrict__", "dk"), ("long long", "dk_sb"), ("long long", "dk_sh"), ("long long", "dk_sn"),
    ("elem_t* __restrict__", "dv"), ("long long", "dv_sb"), ("long long", "dv_sh"), ("long long", "dv_sn"),
    ("int", "heads"), ("int", "group"), ("int", "n_q"), ("int", "n_kv"), ("int", "padded_q"), ("int", "causal"),
    ("float", "scale_log2"), ("float", "scale"),
)
# the preprocess: D = rowsum(dO * O) and the LSE in log2 units, per query row, padded to whole
# tiles (a padded row's LSE +inf: P = 0), and dQ's accumulator cleared
WIDE_PREPROCESS_PARAMS: tuple[tuple[str, str], ...] = (
    ("const elem_t* __restrict__", "out"), ("long long", "o_sb"), ("long long", "o_sh"), ("long long", "o_sn"),
    ("const elem_t* __restrict__", "dout"), ("long long", "do_sb"), ("long long", "do_sh"), ("long long", "do_sn"),
    ("const float* __restrict__", "lse"), ("float* __restrict__", "rows"), ("float* __restrict__", "dq_accum"),
    ("int", "heads"), ("int", "n_q"), ("int", "padded_q"),
)
# the postprocess: dQ = scale * the accumulator, in the inputs' type
WIDE_POSTPROCESS_PARAMS: tuple[tuple[str, str], ...] = (
    ("const float* __restrict__", "dq_accum"), ("elem_t* __restrict__", "dq"), ("long long", "dq_sb"),
    ("long long", "dq_sh"), ("long long", "dq_sn"), ("int", "heads"), ("int", "n_q"), ("int", "padded_q"),
    ("float", "scale"),
)
