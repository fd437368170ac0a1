"""spec -> plan: every number the kernel derives from its spec, computed once, here.

Templates never compute: they print these numbers as `constexpr` and use the names. This
module is pure (no CuPy, no Jinja) and unit-tested.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fagen.mask_kinds import KINDS
from fagen.spec import (MMA_K, MMA_M, MMA_N, SMEM_PER_BLOCK, SWIZZLE_ATOM_ELEMS, AttentionSpec, SpecError,
                        rule)

ELEMENT_BYTES = 2  # float16 and bfloat16
CHUNK_ELEMS = 8  # one 16-byte cp.async / ldmatrix row = 8 half-precision elements
PAD_ELEMS = 8  # padded rows shift by 16 bytes: ldmatrix's 8 row addresses hit 8 distinct bank groups
MAX_REGISTERS = 255
# Registers a thread needs beside its accumulators and fragments (addresses, loop state,
# softmax temporaries): a base plus a share of the fragments, fitted to ptxas -v on the
# shipped specs and the 32-rows-a-warp d=128 tiles that just fit.
REGISTER_BASE = 64
REGISTER_SLACK = 0.15
# wgmma kernels hold no ldmatrix fragments or copy addresses per MMA: a smaller base, fitted
# to ptxas -v on the shipped sm_90a specs.
WGMMA_REGISTER_BASE = 40
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
    head_dim: int
    m_frags: int  # m16 fragments per warp along the queries
    s_n_frags: int  # n8 fragments of a warp's S tile (keys)
    o_n_frags: int  # n8 fragments of a warp's O tile (head_dim)
    qk_k_steps: int  # k16 steps of Q.K^T (over head_dim)
    pv_k_steps: int  # k16 steps of P.V (over the keys of a tile)
    smem_row: int  # elements between consecutive rows of a smem tile (wgmma: of a swizzle atom)
    atoms_per_row: int  # wgmma: 128-byte swizzle atoms across head_dim (an 8-row group's stride)
    chunks_per_row: int  # 16-byte chunks in one head_dim row
    q_tile_elems: int
    kv_tile_elems: int
    kv_slots: int  # smem KV tiles in the ring (see kv_pipeline in templates)
    kv_stages: int  # wgmma: K tiles (and V tiles) in flight or resident
    warpgroups: int  # wgmma: warpgroups of 64 query rows
    pingpong: bool  # wgmma: the two warpgroups take turns on the tensor cores
    mask_words: int  # 32-bit words per row of a block mask's PARTIAL pattern
    smem_bytes: int
    smem_limit: int
    seed_budget_bytes: int  # seed 002: (2 Bc d + Br d + Br Bc) elements
    predicted_registers: int
    blocks_per_sm_by_smem: int
    mask_params: tuple[tuple[str, str], ...]  # (C type, name) kernel parameters the mask reads
    score_params: tuple[tuple[str, str], ...]  # ... that the score modifiers read
    sink_params: tuple[tuple[str, str], ...]  # (partials leave sinks to the merge)
    split_params: tuple[tuple[str, str], ...]  # split-KV partials: tiles a split, output strides

    @property
    def extra_params(self) -> tuple[tuple[str, str], ...]:
        """Kernel parameters after the fixed ones, in signature order (the runtime packs these)."""
        return self.mask_params + self.score_params + self.sink_params + self.split_params

    def as_dict(self) -> dict:
        return asdict(self)


def kv_slots(spec: AttentionSpec) -> int:
    """Tiles in the KV ring. Loads stream K0, V0, K1, V1, ... through it, each issued as soon as
    its slot is free. One slot is the seed's shared-KV (K, then V into the same buffer);
    `separate` gives K and V their own buffers, `stages` each: interleaved in one ring that is
    2 * stages slots, so K always lands in even slots and V in odd ones."""
    return spec.pipeline.stages * (2 if spec.pipeline.kv_smem == "separate" else 1)


FLOAT_PTR = "const float* __restrict__"


def score_params(spec: AttentionSpec) -> tuple[tuple[str, str], ...]:
    mod = spec.score_mod
    params: tuple[tuple[str, str], ...] = ()
    if mod.alibi != "none":
        params += ((FLOAT_PTR, "alibi_slopes"),)
    if mod.bias != "none":
        params += ((FLOAT_PTR, "bias"), ("long long", "bias_sb"), ("long long", "bias_sh"), ("long long", "bias_sq"))
    return params


def plan(spec: AttentionSpec) -> KernelPlan:
    t, d = spec.tiling, spec.head_dim
    warps = t.warps_q * t.warps_kv
    m_frags = t.block_q // (t.warps_q * MMA_M)
    if spec.wgmma:  # rows live in 128-byte swizzle atoms, head_dim / 64 of them side by side
        smem_row = SWIZZLE_ATOM_ELEMS
    else:
        smem_row = d + (PAD_ELEMS if spec.smem_layout == "padded" else 0)
    q_tile = t.block_q * (d if spec.wgmma else smem_row)
    kv_tile = t.block_kv * (d if spec.wgmma else smem_row)
    slots = kv_slots(spec)
    smem_bytes = (q_tile + slots * kv_tile) * ELEMENT_BYTES
    if spec.wgmma:  # a "landed" and a "freed" mbarrier per stage of the KV ring
        smem_bytes += 2 * spec.pipeline.stages * MBARRIER_BYTES
    limit = SMEM_PER_BLOCK[spec.arch]
    seed_budget = (2 * t.block_kv * d + t.block_q * d + t.block_q * t.block_kv) * ELEMENT_BYTES

    per_thread = MMA_M * MMA_N // 32  # f32 accumulator registers a thread holds per m16n8 fragment
    o_regs = m_frags * (d // MMA_N) * per_thread
    s_regs = m_frags * (t.block_kv // MMA_N) * per_thread
    q_regs = m_frags * (d // MMA_K) * 4 if spec.pipeline.q_in_registers else 0
    # wgmma: P.V of tile j - 1 is in flight while tile j's scores are live, its P packed in pairs
    p_regs = s_regs // 2 if spec.wgmma else 0
    fragments = o_regs + s_regs + q_regs + p_regs
    base = WGMMA_REGISTER_BASE if spec.wgmma else REGISTER_BASE
    registers = fragments + base + int(REGISTER_SLACK * fragments)

    if smem_bytes > limit:
        raise SpecError(rule(
            "pipeline", f"{spec.pipeline.kv_smem}, stages {spec.pipeline.stages}",
            f"needs {smem_bytes} bytes of shared memory (Q tile + {slots} KV tiles of "
            f"{t.block_kv}x{kv_tile // t.block_kv}) but {spec.arch} allows {limit} per block",
            "use fewer stages or a smaller block_kv" + ("" if spec.wgmma else ", or kv_smem: shared")))
    if seed_budget > limit:
        raise SpecError(rule(
            "tiling", f"block_q {t.block_q}, block_kv {t.block_kv}",
            f"breaks the FlashAttention block-size rule 2*Bc*d + Br*d + Br*Bc < M: "
            f"{seed_budget} bytes over {spec.arch}'s {limit}",
            "use a smaller block_q or block_kv"))
    if registers > MAX_REGISTERS:
        raise SpecError(rule(
            "tiling", f"block_q {t.block_q}, block_kv {t.block_kv}, warps_q {t.warps_q}",
            f"predicts {registers} registers a thread ({o_regs} for O, {s_regs} for S, {q_regs} for Q, "
            f"{p_regs} for P, the rest addresses and temporaries) over the {MAX_REGISTERS} limit: it would spill",
            "use more warps_q, a smaller block_kv, or q_in_registers: false"))

    return KernelPlan(
        name=spec.name,
        symbol=KERNEL_SYMBOL_PREFIX + spec.name,
        mma="wgmma" if spec.wgmma else "mma_sync",
        threads=32 * warps,
        warps=warps,
        block_q=t.block_q,
        block_kv=t.block_kv,
        head_dim=d,
        m_frags=m_frags,
        s_n_frags=t.block_kv // MMA_N,
        o_n_frags=d // MMA_N,
        qk_k_steps=d // MMA_K,
        pv_k_steps=t.block_kv // MMA_K,
        smem_row=smem_row,
        atoms_per_row=d // SWIZZLE_ATOM_ELEMS if spec.wgmma else 0,
        chunks_per_row=d // CHUNK_ELEMS,
        q_tile_elems=q_tile,
        kv_tile_elems=kv_tile,
        kv_slots=slots,
        kv_stages=spec.pipeline.stages,
        warpgroups=warps // 4 if spec.wgmma else 0,
        pingpong=spec.pipeline.pingpong,
        mask_words=-(-t.block_kv // 32),
        smem_bytes=smem_bytes,
        smem_limit=limit,
        seed_budget_bytes=seed_budget,
        predicted_registers=registers,
        blocks_per_sm_by_smem=max(1, limit // smem_bytes),
        mask_params=KINDS[spec.mask.kind].params,
        score_params=score_params(spec),
        sink_params=((FLOAT_PTR, "sinks"),) if spec.score_mod.sinks and not spec.outputs.partial else (),
        split_params=(("int", "kv_tiles_per_split"), ("long long", "o_split_stride"),
                      ("long long", "lse_split_stride")) if spec.outputs.partial else (),
    )
