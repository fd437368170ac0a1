"""MLA decode's kernel plan: the numbers templates/kernel/mla_decode.cu.j2 prints (fagen.mla
is the call)."""

from __future__ import annotations

from dataclasses import dataclass

from fagen.column_split import ColumnSplitPlan
from fagen.element_types import ELEMENT_TYPES
from fagen.plan import TMA_MAP

HEAD_DIM = 576  # a latent key: 512 latent columns (V) and 64 rotary ones
HEAD_DIM_V = 512
PAGE_SIZE = 64  # keys a page, and a KV tile: FlashMLA's page size
MLA_TYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class MlaPlan(ColumnSplitPlan):
    """The numbers templates/kernel/mla_decode.cu.j2 prints: tile, shared memory and roles.

    A block is 64 packed query rows of one sequence and one split of its pages
    (ColumnSplitPlan's three warpgroups): S = Q.K^T is m64n64, 36 k16 steps over 576; O's 512
    columns are 256 in each consumer warpgroup; the producer's page slot is both K and V."""

    page_size: int = PAGE_SIZE
    head_dim: int = HEAD_DIM
    head_dim_v: int = HEAD_DIM_V
    kv_stages: int = 2  # pages in flight: three do not fit beside Q (227 KB)

    @property
    def name(self) -> str:
        return f"mla_decode_{ELEMENT_TYPES[self.dtype].short}_d{self.head_dim}_v{self.head_dim_v}"

    @property
    def block_kv(self) -> int:  # keys a KV tile (S's n): a page
        return self.page_size

    @property
    def value_dim(self) -> int:  # V's (and O's) width: a latent key's first columns
        return self.head_dim_v

    @property
    def qk_atoms(self) -> int:
        return self.head_dim // self.atom_columns

    @property
    def tile_bytes(self) -> int:  # Q's tile, and a page of K: every atom of its rows
        return self.qk_atoms * self.atom_bytes

    @property
    def ring_at(self) -> int:
        return self.tile_bytes

    @property
    def p_at(self) -> int:
        return self.ring_at + self.kv_stages * self.tile_bytes

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
    def params(self) -> tuple[tuple[str, str], ...]:
        return MLA_PARAMS

    @property
    def merge_name(self) -> str:
        return f"mla_merge_{ELEMENT_TYPES[self.dtype].short}_v{self.head_dim_v}"


MLA_PARAMS: tuple[tuple[str, str], ...] = (
    (TMA_MAP, "kv_map"),
    ("const elem_t* __restrict__", "q"), ("long long", "q_sb"), ("long long", "q_sh"), ("long long", "q_sn"),
    ("const int* __restrict__", "page_table"), ("long long", "page_table_stride"), ("int", "max_pages"),
    ("const int* __restrict__", "cache_seqlens"),
    ("elem_t* __restrict__", "out"), ("long long", "o_sb"), ("long long", "o_sh"), ("long long", "o_sn"),
    ("float* __restrict__", "lse"), ("float* __restrict__", "o_parts"), ("float* __restrict__", "lse_parts"),
    ("int", "batch"), ("int", "heads"), ("int", "n_q"), ("int", "causal"), ("float", "scale_log2"),
)
