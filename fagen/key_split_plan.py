"""The plan of the two-width backward on sm_90a (DeepSeek's Q.K over 192, V and O over 128): the
numbers templates/sm90/key_split_backward.cu.j2 prints (fagen.key_split is the call).

The square kernels hold dK and dV of a key tile in one warpgroup's registers, (192 + 128) / 2 =
160 a thread at 64 keys: too many beside S, so the copying kernel runs 32 queries a step. Here,
as FlashAttention-4 tiles it on sm90, a block owns 96 keys and its two consumer warpgroups split
them, 48 each, and hold the swapped gradients dK^T (192 x 48) and dV^T (128 x 48): 72 + 48 = 120
registers, leaving room for 64 queries a step. P and dS go through shared memory as P^T and
dS^T (stmatrix .trans): the B of dV^T = dO^T.P and dK^T = Q^T.dS, and (dS^T read MN-major) the A
of dQ = dS.K, which needs both warpgroups' keys; each warpgroup takes 96 of dQ's 192 columns (a
64-column atom of K and half of the third) and adds them to a float32 accumulator by one bulk
reduce a warp."""

from __future__ import annotations

from dataclasses import dataclass

from fagen.element_types import ELEMENT_TYPES
from fagen.plan import TMA_MAP

KEY_SPLIT_WIDTHS = ((192, 128),)  # (Q's and K's width, V's and O's): DeepSeek-V3's MLA prefill
KEY_SPLIT_TYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class KeySplitBackwardPlan:
    """Tiles, wgmma steps, shared memory and roles of one (dtype, head_dim, value_dim)."""

    dtype: str
    head_dim: int = 192  # Q's and K's columns (S's k, dK's and dQ's width)
    value_dim: int = 128  # V's, dO's and O's (dP's k, dV's width)
    block_kv: int = 96  # keys a block ...
    group_keys: int = 48  # ... a consumer warpgroup's: the n of S, dP, dV^T and dK^T
    block_q: int = 64  # queries a step: one wgmma m64 of S, dP and dQ
    q_stages: int = 2
    atom_columns: int = 64  # a 128-byte swizzle atom's row of a half type: a TMA box's width
    mma_k: int = 16
    producer_registers: int = 24
    consumer_registers: int = 240
    mbarrier_bytes: int = 8
    smem_align: int = 1024
    warpgroup_threads: int = 128
    consumer_warpgroups: int = 2
    row_vector_bytes: int = 256  # a step's 64 floats of LSE (log2 units) or of D
    dq_piece_columns: int = 32  # dQ's accumulator in 32-column pieces (the small product's n)
    warp_specialized: bool = True  # (read by the shared sm90 includes: a TMA producer, no cp.async)

    def __post_init__(self):
        assert (self.head_dim, self.value_dim) in KEY_SPLIT_WIDTHS, "the tiling below is worked out for these widths"
        assert self.consumer_warpgroups * self.group_keys == self.block_kv

    @property
    def name(self) -> str:
        return f"key_split_backward_{ELEMENT_TYPES[self.dtype].short}_d{self.head_dim}v{self.value_dim}"

    @property
    def ptx(self) -> str:
        return ELEMENT_TYPES[self.dtype].ptx

    @property
    def row_bytes(self) -> int:  # an atom's row: 64 elements
        return self.atom_columns * ELEMENT_TYPES[self.dtype].bytes

    @property
    def qk_atoms(self) -> int:
        return self.head_dim // self.atom_columns

    @property
    def v_atoms(self) -> int:
        return self.value_dim // self.atom_columns

    @property
    def q_atom_bytes(self) -> int:  # one atom of a step's 64 rows (Q's, dO's; the P^T and dS^T tiles' are block_kv rows)
        return self.block_q * self.row_bytes

    @property
    def kv_atom_bytes(self) -> int:  # one atom of the block's 96 keys
        return self.block_kv * self.row_bytes

    @property
    def q_bytes(self) -> int:
        return self.qk_atoms * self.q_atom_bytes

    @property
    def do_bytes(self) -> int:
        return self.v_atoms * self.q_atom_bytes

    @property
    def stage_bytes(self) -> int:  # Q's tile, then dO's
        return self.q_bytes + self.do_bytes

    @property
    def stage_tx(self) -> int:  # what a step's loads deliver: the stage and its two row vectors
        return self.stage_bytes + 2 * self.row_vector_bytes

    @property
    def kv_tx(self) -> int:  # K's and V's tiles, loaded once
        return (self.qk_atoms + self.v_atoms) * self.kv_atom_bytes

    @property
    def row_group_bytes(self) -> int:  # 8 rows: wgmma's stride byte offset
        return 8 * self.row_bytes

    @property
    def k_steps_per_atom(self) -> int:
        return self.atom_columns // self.mma_k

    @property
    def k_step_bytes(self) -> int:  # a k16 step along a K-major row
        return self.mma_k * ELEMENT_TYPES[self.dtype].bytes

    @property
    def row_step_bytes(self) -> int:  # a k16 step down an MN-major operand: 16 rows
        return self.mma_k * self.row_bytes

    @property
    def qk_k_steps(self) -> int:  # S's k16 steps over head_dim
        return self.head_dim // self.mma_k

    @property
    def v_k_steps(self) -> int:  # dP's over value_dim
        return self.value_dim // self.mma_k

    @property
    def q_k_steps(self) -> int:  # dV^T's and dK^T's over a step's queries
        return self.block_q // self.mma_k

    @property
    def kv_k_steps(self) -> int:  # dQ's over the block's keys
        return self.block_kv // self.mma_k

    @property
    def s_n_frags(self) -> int:  # n8 fragments of S and dP: a warpgroup's keys
        return self.group_keys // 8

    @property
    def dq_columns(self) -> int:  # a warpgroup's dQ columns: one atom and a piece of the last
        return self.head_dim // self.consumer_warpgroups

    @property
    def dq_wide_n_frags(self) -> int:  # the atom's product (m64n64)
        return self.atom_columns // 8

    @property
    def dq_narrow_n_frags(self) -> int:  # the last atom's piece (m64n32)
        return (self.dq_columns - self.atom_columns) // 8

    @property
    def dq_pieces(self) -> int:  # a warpgroup's 32-column pieces of dQ
        return self.dq_columns // self.dq_piece_columns

    @property
    def dq_piece_frags(self) -> int:
        return self.dq_piece_columns // 8

    @property
    def dq_piece_bytes(self) -> int:  # a warp's 16 rows of a piece: fragments x 32 lanes x 4 floats
        return self.dq_piece_frags * 32 * 16

    @property
    def dq_warp_bytes(self) -> int:  # a warp's pieces, side by side: one bulk reduce a step
        return self.dq_pieces * self.dq_piece_bytes

    @property
    def warpgroup_warps(self) -> int:
        return self.warpgroup_threads // 32

    @property
    def dq_tile_floats(self) -> int:  # a 64-row tile of dQ's accumulator
        return self.block_q * self.head_dim

    @property
    def consumer_threads(self) -> int:
        return self.consumer_warpgroups * self.warpgroup_threads

    @property
    def producer_warpgroup(self) -> int:
        return self.consumer_warpgroups

    @property
    def threads(self) -> int:
        return self.consumer_threads + self.warpgroup_threads

    # shared memory, from the aligned base: K, V, the ring of (Q, dO) stages, its row vectors,
    # the P^T and dS^T tiles (96 key rows of 64 queries), dQ's staging, the barriers
    @property
    def k_at(self) -> int:
        return 0

    @property
    def v_at(self) -> int:
        return self.qk_atoms * self.kv_atom_bytes

    @property
    def ring_at(self) -> int:
        return self.v_at + self.v_atoms * self.kv_atom_bytes

    @property
    def rows_at(self) -> int:
        return self.ring_at + self.q_stages * self.stage_bytes

    @property
    def pt_at(self) -> int:
        return -(-(self.rows_at + self.q_stages * 2 * self.row_vector_bytes) // self.smem_align) * self.smem_align

    @property
    def dst_at(self) -> int:
        return self.pt_at + self.kv_atom_bytes

    @property
    def dq_stage_at(self) -> int:
        return self.dst_at + self.kv_atom_bytes

    @property
    def barriers_at(self) -> int:
        return self.dq_stage_at + self.consumer_threads // 32 * self.dq_warp_bytes

    @property
    def barriers(self) -> int:  # K and V landed, the ring's two a stage
        return 1 + 2 * self.q_stages

    @property
    def smem_bytes(self) -> int:
        return self.barriers_at + self.barriers * self.mbarrier_bytes + self.smem_align

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        return KEY_SPLIT_PARAMS

    # the launch's numbers (fagen.accumulated_dq)
    @property
    def tile_rows(self) -> int:
        return self.block_q

    def grid(self, n_kv: int, heads_kv: int, batch: int) -> tuple[int, int, int]:  # a block a 96-key tile
        return -(-n_kv // self.block_kv), heads_kv, batch

    def box_rows(self, tensor: str) -> int:  # a step's rows of q and dout, the block's keys of k and v
        return self.block_kv if tensor in ("k", "v") else self.block_q

    def postprocess_blocks(self, padded_q: int) -> int:  # a block a 32-column piece of a 64-row tile
        return padded_q // self.block_q * self.consumer_warpgroups * self.dq_pieces


KEY_SPLIT_PARAMS: tuple[tuple[str, str], ...] = (
    (TMA_MAP, "q_map"), (TMA_MAP, "k_map"), (TMA_MAP, "v_map"), (TMA_MAP, "do_map"),
    ("const float* __restrict__", "rows"), ("float* __restrict__", "dq_accum"),
    ("elem_t* __restrict__", "dk"), ("long long", "dk_sb"), ("long long", "dk_sh"), ("long long", "dk_sn"),
    ("elem_t* __restrict__", "dv"), ("long long", "dv_sb"), ("long long", "dv_sh"), ("long long", "dv_sn"),
    ("int", "heads"), ("int", "group"), ("int", "n_q"), ("int", "n_kv"), ("int", "padded_q"), ("int", "causal"),
    ("float", "scale_log2"), ("float", "scale"),
)
# the preprocess and postprocess take the head_dim 512 backward's parameters (fagen.wide_head_plan)
