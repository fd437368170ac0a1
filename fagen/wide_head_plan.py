"""The head_dim 512 forward's kernel plan: the numbers templates/sm90/wide_forward.cu.j2 prints
(fagen.wide_head is the call)."""

from __future__ import annotations

from dataclasses import dataclass

from fagen.element_types import ELEMENT_TYPES
from fagen.plan import TMA_MAP

WIDE_HEAD_DIMS = (512,)  # Q's, K's and V's width: Gemma-4's global layers
WIDE_TYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class WideHeadPlan:
    """The numbers templates/sm90/wide_forward.cu.j2 prints: tiles, shared memory and roles.

    A block is one 64-row query tile of one head, three warpgroups: 0 computes S = Q.K^T
    (m64n32, 32 k16 steps over 512), the mask, the softmax and O[:, :256]; 1 computes O[:, 256:]
    from P in shared memory; 2 is the TMA producer. A 64 x 512 f32 O is 256 registers a thread;
    split by columns it is 128 in each consumer warpgroup (MLA decode's split). A KV tile is 32
    keys: Q's 64 KB and two stages of K and V (64 KB a stage) fill 192 of the 227 KB."""

    dtype: str
    head_dim: int = 512
    block_rows: int = 64  # query rows a block: one wgmma.m64
    block_kv: int = 32  # keys a KV tile: S's n
    kv_stages: int = 2
    atom_columns: int = 64  # a 128-byte swizzle atom's row of a half type: a TMA box's width
    mma_k: int = 16
    producer_registers: int = 24  # setmaxnreg: it only issues TMA loads ...
    consumer_registers: int = 240  # ... and hands its registers to S and O
    mbarrier_bytes: int = 8
    smem_align: int = 1024  # swizzle atoms start 1024-byte aligned
    warpgroup_threads: int = 128
    consumer_threads: int = 256  # warpgroups 0 and 1 ...
    producer_warpgroup: int = 2  # ... and the producer's
    threads: int = 384
    warp_specialized: bool = True  # (read by the shared sm90 includes: a TMA producer, no cp.async)

    @property
    def name(self) -> str:
        return f"wide_forward_{ELEMENT_TYPES[self.dtype].short}_d{self.head_dim}"

    @property
    def ptx(self) -> str:
        return ELEMENT_TYPES[self.dtype].ptx

    @property
    def element_bytes(self) -> int:
        return ELEMENT_TYPES[self.dtype].bytes

    @property
    def row_bytes(self) -> int:  # a tile row of one atom: 64 elements
        return self.atom_columns * self.element_bytes

    @property
    def chunks_per_atom_row(self) -> int:  # 16-byte pieces of an atom's row
        return self.row_bytes // 16

    @property
    def atoms(self) -> int:  # 64-column blocks of a row
        return self.head_dim // self.atom_columns

    @property
    def atom_bytes(self) -> int:  # one 64-column block of Q's 64-row tile (and of P)
        return self.block_rows * self.row_bytes

    @property
    def kv_atom_bytes(self) -> int:  # one 64-column block of a KV tile's 32 rows
        return self.block_kv * self.row_bytes

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
    def o_columns(self) -> int:  # a consumer warpgroup's columns of O: its wgmma's n
        return self.head_dim // 2

    @property
    def qk_k_steps(self) -> int:
        return self.head_dim // self.mma_k

    @property
    def k_steps_per_atom(self) -> int:
        return self.atom_columns // self.mma_k

    @property
    def k_step_bytes(self) -> int:
        return self.row_bytes // self.k_steps_per_atom

    @property
    def pv_k_steps(self) -> int:
        return self.block_kv // self.mma_k

    @property
    def row_group_bytes(self) -> int:  # 8 rows: wgmma's stride byte offset
        return 8 * self.row_bytes

    @property
    def v_step_bytes(self) -> int:  # a k16 step of P.V: 16 keys of V
        return self.mma_k * self.row_bytes

    @property
    def v_lead_bytes(self) -> int:  # V's next 64 columns: the next atom of its tile
        return self.kv_atom_bytes

    @property
    def v_half_bytes(self) -> int:  # where warpgroup 1's columns of V start
        return self.o_columns // self.atom_columns * self.kv_atom_bytes

    @property
    def s_n_frags(self) -> int:
        return self.block_kv // 8

    @property
    def o_n_frags(self) -> int:
        return self.o_columns // 8

    @property
    def p_bytes(self) -> int:  # P, 64 rows of block_kv keys in one 64-column atom (its first columns)
        return self.atom_bytes

    @property
    def ring_at(self) -> int:
        return self.q_bytes

    @property
    def p_at(self) -> int:
        return self.ring_at + self.kv_stages * self.stage_bytes

    @property
    def row_scale_at(self) -> int:  # 64 floats a vector: alpha, the final row sum, the final row max
        return self.p_at + self.p_bytes

    @property
    def row_sum_at(self) -> int:
        return self.row_scale_at + 4 * self.block_rows

    @property
    def row_max_at(self) -> int:
        return self.row_sum_at + 4 * self.block_rows

    @property
    def barriers_at(self) -> int:  # Q's barrier, then the ring's
        return self.row_max_at + 4 * self.block_rows

    @property
    def smem_bytes(self) -> int:
        return self.barriers_at + (1 + 2 * self.kv_stages) * self.mbarrier_bytes + self.smem_align

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        return WIDE_PARAMS


WIDE_PARAMS: tuple[tuple[str, str], ...] = (
    (TMA_MAP, "q_map"), (TMA_MAP, "k_map"), (TMA_MAP, "v_map"),
    ("elem_t* __restrict__", "out"), ("long long", "o_sb"), ("long long", "o_sh"), ("long long", "o_sn"),
    ("float* __restrict__", "lse"),
    ("int", "heads"), ("int", "group"), ("int", "n_q"), ("int", "n_kv"), ("int", "causal"), ("float", "scale_log2"),
)
