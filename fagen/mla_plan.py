"""MLA decode's kernel plan: the numbers templates/kernel/mla_decode.cu.j2 prints (fagen.mla
is the call)."""

from __future__ import annotations

from dataclasses import dataclass

from fagen.element_types import ELEMENT_TYPES
from fagen.plan import TMA_MAP

HEAD_DIM = 576  # a latent key: 512 latent columns (V) and 64 rotary ones
HEAD_DIM_V = 512
PAGE_SIZE = 64  # keys a page, and a KV tile: FlashMLA's page size
MLA_TYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class MlaPlan:
    """The numbers templates/kernel/mla_decode.cu.j2 prints: tile, shared memory and roles.

    A block is 64 packed query rows of one sequence and one split of its pages, three
    warpgroups: 0 computes S = Q.K^T (m64n64, 36 k16 steps over 576), the softmax and
    O[:, :256]; 1 computes O[:, 256:] from P in shared memory; 2 is the TMA producer. A 64 x 512
    f32 O is 256 registers a thread; split by columns it is 128 in each consumer warpgroup."""

    dtype: str
    block_rows: int = 64  # packed query rows a block: one wgmma.m64
    page_size: int = PAGE_SIZE
    head_dim: int = HEAD_DIM
    head_dim_v: int = HEAD_DIM_V
    kv_stages: int = 2  # pages in flight: three do not fit beside Q (227 KB)
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
        return f"mla_decode_{ELEMENT_TYPES[self.dtype].short}_d{self.head_dim}_v{self.head_dim_v}"

    @property
    def block_kv(self) -> int:  # keys a KV tile (S's n): a page
        return self.page_size

    @property
    def ptx(self) -> str:
        return ELEMENT_TYPES[self.dtype].ptx

    @property
    def row_bytes(self) -> int:  # a tile row of one atom: 64 elements
        return self.atom_columns * ELEMENT_TYPES[self.dtype].bytes

    @property
    def atom_bytes(self) -> int:  # one 64-column block of a 64-row tile (Q) or of a page (K)
        return self.block_rows * self.row_bytes

    @property
    def qk_atoms(self) -> int:
        return self.head_dim // self.atom_columns

    @property
    def tile_bytes(self) -> int:  # Q's tile, and a page of K: every atom of its rows
        return self.qk_atoms * self.atom_bytes

    @property
    def v_atoms_per_warpgroup(self) -> int:  # O's columns split across the two consumer warpgroups
        return self.head_dim_v // 2 // self.atom_columns

    @property
    def o_columns(self) -> int:  # a consumer warpgroup's columns of O: its wgmma's n
        return self.head_dim_v // 2

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
        return self.page_size // self.mma_k

    @property
    def row_group_bytes(self) -> int:  # 8 rows: wgmma's stride byte offset
        return 8 * self.row_bytes

    @property
    def v_step_bytes(self) -> int:  # a k16 step of P.V: 16 keys of V
        return self.mma_k * self.row_bytes

    @property
    def s_n_frags(self) -> int:
        return self.page_size // 8

    @property
    def o_n_frags(self) -> int:
        return self.o_columns // 8

    @property
    def p_bytes(self) -> int:  # P, 64 rows x 64 keys: one atom
        return self.block_rows * self.page_size * ELEMENT_TYPES[self.dtype].bytes

    @property
    def ring_at(self) -> int:
        return self.tile_bytes

    @property
    def p_at(self) -> int:
        return self.ring_at + self.kv_stages * self.tile_bytes

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
    def barriers_at(self) -> int:
        return self.row_max_at + 4 * self.block_rows

    @property
    def v_lead_bytes(self) -> int:  # V's next 64 columns: the next atom of the page
        return self.atom_bytes

    @property
    def v_half_bytes(self) -> int:  # where warpgroup 1's columns of V start
        return self.v_atoms_per_warpgroup * self.atom_bytes

    @property
    def smem_bytes(self) -> int:
        return self.barriers_at + 2 * self.kv_stages * self.mbarrier_bytes + self.smem_align

    @property
    def q_chunks(self) -> int:  # 16-byte pieces of Q's tile, loaded by the consumers
        return self.block_rows * self.head_dim * ELEMENT_TYPES[self.dtype].bytes // 16

    @property
    def row_chunks(self) -> int:
        return self.head_dim * ELEMENT_TYPES[self.dtype].bytes // 16

    @property
    def chunks_per_atom_row(self) -> int:
        return self.row_bytes // 16

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        return MLA_PARAMS

    # The merge of split partials (its own kernel in the module): a block merges MERGE_COLUMNS
    # columns of one row, `merge_split_lanes` threads a 4-column piece, each taking every lanes-th
    # split, MERGE_BATCH of them loaded before it folds any: one round trip to L2 a thread. A step
    # of one sequence has 16 rows and up to 132 splits (4 MB of partials): 16 lanes; 16 sequences
    # 8 splits: one.
    merge_columns: int = 128
    merge_max_split_lanes: int = 16
    merge_batch: int = 8

    def merge_split_lanes(self, splits: int) -> int:
        return min(self.merge_max_split_lanes, -(-splits // self.merge_batch))

    @property
    def merge_name(self) -> str:
        return f"mla_merge_{ELEMENT_TYPES[self.dtype].short}_v{self.head_dim_v}"

    @property
    def merge_quads(self) -> int:
        return self.merge_columns // 4

    def merge_threads(self, splits: int) -> int:
        return self.merge_quads * self.merge_split_lanes(splits)

    @property
    def merge_params(self) -> tuple[tuple[str, str], ...]:
        return MLA_MERGE_PARAMS


MLA_PARAMS: tuple[tuple[str, str], ...] = (
    (TMA_MAP, "kv_map"),
    ("const elem_t* __restrict__", "q"), ("long long", "q_sb"), ("long long", "q_sh"), ("long long", "q_sn"),
    ("const int* __restrict__", "page_table"), ("long long", "page_table_stride"), ("int", "max_pages"),
    ("const int* __restrict__", "cache_seqlens"),
    ("elem_t* __restrict__", "out"), ("long long", "o_sb"), ("long long", "o_sh"), ("long long", "o_sn"),
    ("float* __restrict__", "lse"), ("float* __restrict__", "o_parts"), ("float* __restrict__", "lse_parts"),
    ("int", "batch"), ("int", "heads"), ("int", "n_q"), ("int", "causal"), ("float", "scale_log2"),
)
MLA_MERGE_PARAMS: tuple[tuple[str, str], ...] = (
    ("const float* __restrict__", "o_parts"), ("const float* __restrict__", "lse_parts"),
    ("elem_t* __restrict__", "out"), ("long long", "o_sb"), ("long long", "o_sh"), ("long long", "o_sn"),
    ("float* __restrict__", "lse"), ("int", "splits"), ("int", "batch"), ("int", "heads"), ("int", "n_q"),
)
