"""The plan of a kernel whose O is split by columns over two consumer warpgroups (MLA decode's
and the head_dim 512 forward's, templates/sm90/split_columns.cu.j2): what their tiles, wgmma
steps and shared memory have in common. A subclass says its widths (`head_dim`, the value width
`value_dim`), its KV tile (`block_kv`) and where P lies (`p_at`)."""

from __future__ import annotations

from dataclasses import dataclass

from fagen.element_types import ELEMENT_TYPES


@dataclass(frozen=True)
class ColumnSplitPlan:
    """64 query rows a block, three warpgroups: 0 computes S = Q.K^T, the softmax and O[:, :n];
    1 computes O[:, n:] from P in shared memory; 2 is the TMA producer. A 64 x 512 f32 O is 256
    registers a thread: split by columns it is 128 in each consumer warpgroup."""

    dtype: str
    block_rows: int = 64  # query rows a block: one wgmma.m64
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
    def ptx(self) -> str:
        return ELEMENT_TYPES[self.dtype].ptx

    @property
    def row_bytes(self) -> int:  # a tile row of one atom: 64 elements
        return self.atom_columns * ELEMENT_TYPES[self.dtype].bytes

    @property
    def chunks_per_atom_row(self) -> int:  # 16-byte pieces of an atom's row
        return self.row_bytes // 16

    @property
    def atom_bytes(self) -> int:  # one 64-column block of Q's 64-row tile (and of P)
        return self.block_rows * self.row_bytes

    @property
    def kv_atom_bytes(self) -> int:  # one 64-column block of a KV tile
        return self.block_kv * self.row_bytes

    @property
    def o_columns(self) -> int:  # a consumer warpgroup's columns of O: its wgmma's n
        return self.value_dim // 2

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
    def pv_k_steps(self) -> int:  # k16 steps of P.V: a KV tile's keys
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
    def p_bytes(self) -> int:  # P: 64 rows of block_kv keys in one 64-column atom (its first columns)
        return self.atom_bytes

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

    # The merge of split partials (templates/sm90/split_merge_kernel.cu.j2, its own kernel in the
    # module; a subclass names it `merge_name`): a block merges MERGE_COLUMNS columns of one row,
    # `merge_split_lanes` threads a 4-column piece, each taking every lanes-th split, MERGE_BATCH
    # of them loaded before it folds any: one round trip to L2 a thread. A step of one sequence
    # has 16 rows and up to 132 splits (4 MB of partials): 16 lanes; 16 sequences 8 splits: one.
    merge_columns: int = 128
    merge_max_split_lanes: int = 16
    merge_batch: int = 8

    def merge_split_lanes(self, splits: int) -> int:
        return min(self.merge_max_split_lanes, -(-splits // self.merge_batch))

    @property
    def merge_quads(self) -> int:
        return self.merge_columns // 4

    def merge_threads(self, splits: int) -> int:
        return self.merge_quads * self.merge_split_lanes(splits)

    @property
    def merge_params(self) -> tuple[tuple[str, str], ...]:
        return MERGE_PARAMS


# o_parts [splits, B, heads * n_q, value_dim] and lse_parts [splits, B, heads * n_q] into out and
# lse ([B, heads, n_q], contiguous)
MERGE_PARAMS: tuple[tuple[str, str], ...] = (
    ("const float* __restrict__", "o_parts"), ("const float* __restrict__", "lse_parts"),
    ("elem_t* __restrict__", "out"), ("long long", "o_sb"), ("long long", "o_sh"), ("long long", "o_sn"),
    ("float* __restrict__", "lse"), ("int", "splits"), ("int", "batch"), ("int", "heads"), ("int", "n_q"),
)
