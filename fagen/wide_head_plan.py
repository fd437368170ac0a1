"""The head_dim 512 forward's kernel plan: the numbers templates/sm90/wide_forward.cu.j2 prints
(fagen.wide_head is the call)."""

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
    ("float* __restrict__", "lse"),
    ("int", "heads"), ("int", "group"), ("int", "n_q"), ("int", "n_kv"), ("int", "causal"), ("float", "scale_log2"),
)
