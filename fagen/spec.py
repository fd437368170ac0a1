"""The kernel spec: a pydantic model one-to-one with the YAML a kernel engineer writes.

Structural rules live here (field by field, then across fields). Rules that need derived
numbers (shared-memory bytes, register pressure) live in `fagen.plan`; `fagen.load` applies
both, and every path to a rendered kernel goes through it, so no invalid spec ever reaches a
template.

Every error names the field, the value, the rule and a valid alternative.
"""

from __future__ import annotations

import copy
import difflib

from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from fagen import expression, mask_kinds, side_inputs
from fagen.derivatives import interval, read_derivatives
from fagen.element_types import ELEMENT_TYPES, FP8_KERNEL_TYPES, INPUT_TYPES, KERNEL_TYPES, ElementType
from fagen.mask_kinds import KINDS

HEAD_DIMS = (32, 64, 96, 128, 256)
# Q.K^T widths that only come with a narrower V (head_dim_v): DeepSeek's 192 (128 + 64 rotary)
# over V and O of 128. As a square head (or V's width) it is not built yet.
QK_HEAD_DIMS = (192,)
# Largest dynamic shared memory one block may opt into, in bytes, per target.
# an FP8 KV cache widens K and V with cvt.f16x2.e4m3x2 / e5m2x2: sm_89 and after, on mma.sync
FP8_KV_ARCHS = ("sm_89", "sm_90")
MAX_STAGES = 3  # pipeline.stages: KV tiles in flight per buffer
FP8_KV_HEAD_DIMS = (64, 128, 256)  # an FP8 KV cache's decode kernels: rows of 4, 8 or 16 16-byte chunks
FP8_KV_WARP_KEYS = 16  # a warp's keys of a tile, at least: a widened K load is two n8 fragments (or four)
# The FP8 forward's key tiles: whole k32 steps of P.V (a V^T key group), from one V^T box (a
# 128-byte swizzle row of keys) to wgmma's widest n of S
FP8_KEY_STEP, FP8_MIN_KEYS, FP8_MAX_KEYS = 32, 128, 256
SMEM_PER_BLOCK = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448, "sm_90a": 232448}
MMA_M, MMA_N, MMA_K = 16, 8, 16  # mma.sync.m16n8k16
# A thread of a quad holds columns 2t, 2t + 1 of each n8 fragment of its rows (mma.sync's and
# wgmma's accumulators): one 32-bit word of a block mask's pattern covers its share of this many
# columns (fagen.masks.thread_words)
LANE_COLUMNS = 32 // 2 * MMA_N
# sm_90a (Hopper only) selects warpgroup MMAs: wgmma.m64nNk16, K and V (and Q) read straight from
# 128-byte-swizzled shared memory. A warpgroup is 4 warps owning 64 query rows.
WARPGROUP_WARPS, WARPGROUP_ROWS, WARPGROUP_THREADS = 4, 64, 128
THREE_WARPGROUPS_WARPS = 3 * WARPGROUP_WARPS
SWIZZLE_ATOM_ELEMS = 64  # one 128-byte swizzle row of half-precision elements
# The sm_90a dK/dV kernel: a warpgroup owns 64 keys and holds their dK and dV rows (head_dim f32
# registers a thread together), so head_dim 256 keeps the mma.sync kernel's head_split instead.
WGMMA_BACKWARD_MAX_HEAD_DIM = 128
# ... and two head widths (the dQ kernel's, not atomic dQ): up to DeepSeek's 192/128, whose dK and dV
# hold 160 accumulator registers a thread at 64 keys a warpgroup
WGMMA_BACKWARD_MAX_ROW_WIDTH = 192
MAX_NAME_LENGTH = 100  # a file name with room for a suffix and a tuned variant's tags


REMOVE = type("Remove", (), {"__repr__": lambda self: "REMOVE"})()  # a fix that deletes the field


def with_fix(data: dict, fix: dict[str, object]) -> dict:
    """`data` with a fix applied: each dotted field set to its value (REMOVE: deleted)."""
    data = copy.deepcopy(data)
    for dotted, value in fix.items():
        *parents, leaf = dotted.split(".")
        node = data
        for key in parents:
            child = node.get(key)
            if isinstance(child, str) and key == "mask":  # the shorthand, as a mapping
                child = {"kind": child}
            if not isinstance(child, dict):
                child = {}
            node[key] = child
            node = child
        if value is REMOVE:
            node.pop(leaf, None)
        else:
            node[leaf] = copy.deepcopy(value)
    return data


class Advice(str):
    """A rule's message, carrying its fix as data: `fix` maps dotted fields ("tiling.block_q") to
    the values the message tells the user to write (REMOVE: delete the field), so what a message
    advises can be applied, and checked to validate (tests/test_advice.py). Validators raise
    ValueError(Advice) for pydantic to carry; fagen.load hands the fix on in SpecError.fix."""

    fix: dict[str, object] | None = None


class SpecError(ValueError):
    """A spec that fagen refuses; the message says which field, why, and what to use. `fix`: the
    fields to change, and their values, where the advice is a change of fields (see Advice)."""

    def __init__(self, message: str, fix: dict[str, object] | None = None):
        super().__init__(message)
        self.fix = fix if fix is not None else getattr(message, "fix", None)


def rule(field: str, value: object, broken: str, fix: str, change: dict[str, object] | None = None) -> Advice:
    """"field = value: broken; fix". `change`: the fields the fix text tells the user to set (each
    of its values written in the text), for Advice.fix. A rule of a model that may sit at several
    places of a spec (WarpSpecialized) names fields relative to it; fagen.load prefixes them."""
    advice = Advice(f"{field} = {value!r}: {broken}; {fix}")
    advice.fix = change
    return advice


def valid_name(name: str) -> bool:
    """A spec name: a lowercase C identifier (the kernel symbol is fagen_<name>, and C++ reserves
    a leading '_' and any '__'), short enough to name files."""
    return (name.isidentifier() and name.isascii() and name == name.lower() and not name.startswith("_")
            and "__" not in name and len(name) <= MAX_NAME_LENGTH)


def name_like(text: str) -> str:
    """A valid name close to `text`: lowercase ASCII letters, digits and single underscores."""
    name = "".join(c if c.isascii() and c.isalnum() else "_" for c in str(text).lower())
    while "__" in name:
        name = name.replace("__", "_")
    name = name.strip("_")[:MAX_NAME_LENGTH].rstrip("_")
    if name[:1].isdigit():
        name = "k_" + name[:MAX_NAME_LENGTH - 2].rstrip("_")
    return name or "flash_f16_d128"


class _Frozen(BaseModel):
    # strict: YAML's `head_dim: "128"` or `stages: true` is a mistake, not something to coerce
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Tiling(_Frozen):
    """Br x Bc tile of the score matrix owned by one thread block, and its warps."""

    block_q: int  # Br: query rows per block
    block_kv: int  # Bc: keys per KV tile
    warps_q: int = 4  # warps stacked along the query rows; each owns block_q / warps_q rows
    warps_kv: int = 1  # warps along the keys of a tile
    # GQA packing (decode): the query heads of a KV group share a tile's rows, row p being position
    # p / group of the group's head p % group, so a block reads its K and V once for the group
    pack_gqa: bool = False

    @field_validator("warps_q")
    @classmethod
    def _warps_q(cls, v: int) -> int:
        # 12: three consumer warpgroups beside a TMA producer (sm_90a, AttentionSpec._wgmma_shapes)
        if not (1 <= v <= 8 or v == THREE_WARPGROUPS_WARPS):
            raise ValueError(rule("tiling.warps_q", v, "must be 1..8 (at most 256 threads a block), or 12 "
                                  "(three consumer warpgroups of a warp-specialised sm_90a kernel)", "use 4",
                                  {"tiling.warps_q": 4}))
        return v

    @field_validator("warps_kv")
    @classmethod
    def _warps_kv(cls, v: int) -> int:
        if v not in (1, 2, 4, 8):
            raise ValueError(rule(
                "tiling.warps_kv", v,
                "must be 1, 2, 4 or 8: warps side by side along the keys, each taking block_kv / warps_kv keys "
                "of every tile with its own running max and sum, merged once at the end",
                "use 1, or 2 or 4 for few query rows (decode)", {"tiling.warps_kv": 1}))
        return v

    @field_validator("block_kv")
    @classmethod
    def _block_kv(cls, v: int) -> int:
        if v % MMA_K or not MMA_K <= v <= 256:
            raise ValueError(rule(
                "tiling.block_kv", v,
                "must be a multiple of 16 in 16..256 (P.V consumes keys 16 at a time, the MMA's k)",
                "use 32, 64 or 128", {"tiling.block_kv": 64}))
        return v


REGISTERS_PER_SM = 65536
MAX_THREAD_REGISTERS = 256  # what a thread's allocation rounds up to at the most (255 usable)


def launch_registers(consumers: int, blocks: int) -> int:
    """Registers a thread is launched with: `blocks` blocks an SM of a producer warpgroup and
    `consumers` consumer warpgroups share the register file evenly, a multiple of 8 a thread."""
    threads = WARPGROUP_THREADS * (1 + consumers)
    return min(MAX_THREAD_REGISTERS, REGISTERS_PER_SM // (blocks * threads) // SETMAXNREG_STEP * SETMAXNREG_STEP)


def most_consumer_registers(consumers: int, producer_registers: int, blocks: int = 1) -> int:
    """The most registers setmaxnreg may give each of `consumers` consumer warpgroups beside a
    producer warpgroup at `producer_registers`, `blocks` blocks an SM (register_split_rules)."""
    at_launch = launch_registers(consumers, blocks)
    most = min(SETMAXNREG_RANGE[1], ((1 + consumers) * at_launch - producer_registers) // consumers)
    return most - most % SETMAXNREG_STEP


def register_split_rules(field: str, ws: WarpSpecialized, consumers: int, blocks: int) -> None:
    """setmaxnreg moves registers within what a block was launched with: `blocks` blocks an SM,
    each a producer warpgroup and `consumers` consumer warpgroups of 128 threads, share the
    register file evenly at launch (a multiple of 8 a thread), and a block's split must fit its
    share (more, and the consumers' setmaxnreg waits for ever); the producer, which only issues
    loads, takes fewer than a consumer."""
    threads, at_launch = WARPGROUP_THREADS * (1 + consumers), launch_registers(consumers, blocks)
    used = WARPGROUP_THREADS * (ws.producer_registers + consumers * ws.consumer_registers)
    if used > threads * at_launch:
        raise ValueError(rule(
            field, f"producer_registers {ws.producer_registers}, consumer_registers {ws.consumer_registers}",
            f"a producer warpgroup and {consumers} consumer warpgroup(s) of 128 threads would hold {used} registers, "
            f"over the {threads * at_launch} a block is launched with ({at_launch} a thread, {blocks} block(s) an SM)",
            *_fitting_split(field, ws, consumers, blocks)))
    if ws.producer_registers >= ws.consumer_registers:
        raise ValueError(rule(f"{field}.producer_registers", ws.producer_registers,
                              f"must be below consumer_registers ({ws.consumer_registers}): the producer "
                              "only issues loads", "use 24", {f"{field}.producer_registers": 24}))


def _fitting_split(field: str, ws: WarpSpecialized, consumers: int, blocks: int) -> tuple[str, dict[str, object]]:
    """The fix of a register split over a block's share: the most the consumers may take beside
    this producer, or, where that is no more than the producer's own (the consumers must hold
    more), beside a producer at 24."""
    most = most_consumer_registers(consumers, ws.producer_registers, blocks)
    if most > ws.producer_registers:
        return f"use consumer_registers <= {most}", {f"{field}.consumer_registers": most}
    low = SETMAXNREG_RANGE[0]
    most = most_consumer_registers(consumers, low, blocks)
    return (f"use producer_registers: {low} and consumer_registers <= {most}",
            {f"{field}.producer_registers": low, f"{field}.consumer_registers": most})


def dq_producer_blocks_per_sm(consumer_warpgroups: int) -> int:
    """Blocks of the producer-fed dQ kernel an SM runs: two with one consumer warpgroup (as the
    copying kernel's 128-thread blocks: one's MMAs run under the other's softmax), else one."""
    return 2 if consumer_warpgroups == 1 else 1
SETMAXNREG_STEP, SETMAXNREG_RANGE = 8, (24, 256)  # setmaxnreg takes multiples of 8 in 24..256


class WarpSpecialized(_Frozen):
    """sm_90a warp specialisation: a producer warpgroup (one warp of it issuing TMA loads into the
    KV ring) and consumer warpgroups that only compute. setmaxnreg moves registers from the
    producer, which needs few, to the consumers, whose S, P and O tiles need many."""

    producer_registers: int = 24
    consumer_registers: int = 240
    # One block an SM walks the launch's tiles (heaviest first), the producer loading the next
    # tile's inputs (the forward's Q and K, the dK/dV kernel's K and V) while the consumers
    # finish this one; unset, a block a tile
    persistent: bool = False

    @field_validator("producer_registers", "consumer_registers")
    @classmethod
    def _setmaxnreg(cls, v: int, info) -> int:
        low, high = SETMAXNREG_RANGE
        if v % SETMAXNREG_STEP or not low <= v <= high:
            default = cls.model_fields[info.field_name].default
            raise ValueError(rule(info.field_name, v, f"must be a multiple of {SETMAXNREG_STEP} in {low}..{high} "
                                  "(setmaxnreg's operand)", f"use {default} (24 for the producer, 240 for the "
                                  "consumers)", {info.field_name: default}))
        return v


class Pipeline(_Frozen):
    """How K and V tiles travel from global to shared memory."""

    kv_smem: Literal["shared", "separate"] = "shared"
    # K tiles, and V tiles, the pipeline holds: `separate` gives each `stages` slots (sm_80 interleaves
    # them in one ring of 2 * stages, sm_90a keeps a ring each); `shared` K and V take turns in one
    # ring of `stages` slots. An int, then a range: Literal[1, 2, 3] would take `true` and `2.0`.
    stages: int = 1
    q_in_registers: bool = False
    # sm_90a, two warpgroups: they take turns on the tensor cores, one's softmax running under
    # the other's MMAs (loads for a stage are issued a step later: use stages 3)
    pingpong: bool = False
    # sm_90a: a producer warp loads Q, K and V with TMA (tensor maps built on the host) while the
    # consumer warpgroups compute; unset, every thread copies its share with cp.async
    warp_specialized: WarpSpecialized | None = None

    @field_validator("stages")
    @classmethod
    def _stages(cls, v: int) -> int:
        if not 1 <= v <= MAX_STAGES:
            raise ValueError(rule("pipeline.stages", v, "must be 1, 2 or 3 (KV tiles in flight per buffer)",
                                  "use 2", {"pipeline.stages": 2}))
        return v


MaskKindName = Literal["none", "causal", "sliding_window", "chunked", "prefix_lm", "document", "block_mask"]


def _check_expression(field: str, text: str, variables: dict[str, str], example: str, result: str | None = None) -> str:
    """Parsed against fagen.expression's allow-list: the kernel prints its syntax tree."""
    try:
        expression.check(text, variables, result)
    except expression.ExpressionError as err:
        raise ValueError(rule(field, text, f"must be one expression over {', '.join(variables)} in fagen's "
                              f"expression language ({err})", f"e.g. {example}", {field: example})) from None
    return text


class Mask(_Frozen):
    """Which (query, key) pairs count. Rendered into the kernel: tile ranges and full/partial
    status are computed in the kernel from these numbers (block_mask: read from arrays)."""

    kind: MaskKindName = "none"
    align: Literal["bottom_right", "top_left"] = "bottom_right"  # where the diagonal sits when Nq != Nk
    window_left: int | None = None  # sliding_window: keys before the diagonal a query sees
    window_right: int | None = None  # sliding_window: keys after it (default 0)
    chunk_size: int | None = None  # chunked: causal within chunks of this many positions
    prefix_len: int | None = None  # prefix_lm: keys every query sees, causal after
    causal: bool = False  # document: also causal within a document
    expression: str | None = None  # extra CUDA bool over b, h, q_idx, kv_idx, ANDed with the kind

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        return {"kind": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _fields_of_kind(self) -> Mask:
        # the kind's rules, which the oracle's mask= reads too (fagen.mask_kinds.refused_field)
        refused = mask_kinds.refused_field(self)
        if refused is not None:
            raise ValueError(rule(refused.field, refused.value, refused.rule, refused.fix,
                                  {**refused.sets, **dict.fromkeys(refused.removes, REMOVE)}))
        return self

    @field_validator("expression")
    @classmethod
    def _expression(cls, v: str | None) -> str | None:
        return v if v is None else _check_expression("mask.expression", v, expression.MASK_VARIABLES,
                                                     "(q_idx - kv_idx) % 2 == 0", expression.BOOL)


    def __str__(self) -> str:
        args = [f"{f}={getattr(self, f)}" for f in KINDS[self.kind].fields if getattr(self, f) not in (None, False)]
        if self.align != "bottom_right" and KINDS[self.kind].uses_align:
            args.append(self.align)
        text = f"{self.kind}({', '.join(args)})" if args else self.kind
        return text + (" & expr" if self.expression else "")


class ScoreMod(_Frozen):
    """Changes to the scaled score s = q.k * scale before the mask and the softmax, in this order."""

    softcap: float | None = None  # s -> softcap * tanh(s / softcap)
    alibi: Literal["none", "slopes", "geometric"] = "none"  # s -> s - slope_h * |q + offset - k|
    bias: Literal["none", "vector", "matrix"] = "none"  # s -> s + bias[b, h, (q,) k], float32
    # float32 arrays (kernel inputs, a call's `captured`) the expression reads as captured0[i] ...:
    # a traced score_mod's captured tensors, flattened
    captured: int = 0
    expression: str | None = None  # s -> a CUDA float expression over score, b, h, q_idx, kv_idx
    # d expression / d score, over the same variables: the backward's chain rule through it
    expression_grad: str | None = None
    sinks: bool = False  # one learned logit per head joins every row's softmax denominator

    @field_validator("softcap")
    @classmethod
    def _softcap(cls, v: float | None) -> float | None:
        refused = None if v is None else side_inputs.softcap_refusal(v)  # the oracle's rule too
        if refused is not None:
            raise ValueError(rule("score_mod.softcap", v, *refused, {"score_mod.softcap": side_inputs.SOFTCAP_EXAMPLE}))
        return v

    @field_validator("captured")
    @classmethod
    def _captured(cls, v: int) -> int:
        if not 0 <= v <= expression.MAX_CAPTURED:
            raise ValueError(rule("score_mod.captured", v, f"counts the float32 arrays score_mod.expression reads "
                                  f"(captured0[i] ...), 0 to {expression.MAX_CAPTURED}",
                                  f"use at most {expression.MAX_CAPTURED}",
                                  {"score_mod.captured": expression.MAX_CAPTURED}))
        return v

    @field_validator("expression")
    @classmethod
    def _expression(cls, v: str | None, info: ValidationInfo) -> str | None:
        return v if v is None else _check_expression("score_mod.expression", v,
                                                     expression.score_variables(info.data.get("captured", 0)),
                                                     "score * 0.5f")

    @field_validator("expression_grad")
    @classmethod
    def _expression_grad(cls, v: str | None, info: ValidationInfo) -> str | None:
        return v if v is None else _check_expression("score_mod.expression_grad", v,
                                                     expression.score_variables(info.data.get("captured", 0)), "0.5f")

    @model_validator(mode="after")
    def _captured_needs_expression(self) -> ScoreMod:
        if self.captured and self.expression is None:
            raise ValueError(rule("score_mod.captured", self.captured, "counts arrays score_mod.expression reads, "
                                  "which is not set", "set expression, or remove captured",
                                  {"score_mod.captured": REMOVE}))
        return self

    @model_validator(mode="after")
    def _grad_needs_expression(self) -> ScoreMod:
        if self.expression_grad is not None and self.expression is None:
            raise ValueError(rule("score_mod.expression_grad", self.expression_grad, "is the derivative of "
                                  "score_mod.expression, which is not set", "set expression, or remove expression_grad",
                                  {"score_mod.expression_grad": REMOVE}))
        return self

    @property
    def changes_scores(self) -> bool:
        return self.softcap is not None or self.alibi != "none" or self.bias != "none" or self.expression is not None

    @property
    def unbounded(self) -> bool:
        """Scores may reach any float: a bias, an expression or given ALiBi slopes carry a user's
        values (-1e9 to mask a key), where q.k, softcap and geometric slopes stay within a few
        thousand. The backward then holds P = exp2(S - LSE) at its bound, 1 (ptx.cu.j2's
        exp2_shifted)."""
        return self.bias != "none" or self.expression is not None or self.alibi == "slopes"

    @property
    def nonlinear(self) -> bool:
        """The score's derivative varies per element (softcap, an expression): the backward keeps
        it per S register; the linear modifiers' derivative is the scale alone, and so is an
        expression's whose derivative is the constant 1 (a score plus a bias of positions or a
        table's: traced ALiBi, a relative bias)."""
        return self.softcap is not None or self.nonlinear_expression

    @property
    def nonlinear_expression(self) -> bool:
        """An expression whose derivative varies per element (not the constant 1)."""
        return self.expression is not None and not self._unit_slope

    @property
    def _unit_slope(self) -> bool:
        return self.expression_grad is not None and \
            expression.constant(expression.score(self.expression_grad, self.captured)) == 1


class Outputs(_Frozen):
    lse: bool = True
    # split-KV: each block attends to a share of the KV tiles and writes a float32 partial O
    # (normalised over its keys) and its LSE; fagen.splitkv merges partials by LSE
    partial: bool = False
    # a ring step: the kernel folds its partial into the float32 O and the LSE already in its
    # outputs (weighted by the two LSEs) instead of overwriting them, so each step of ring
    # attention adds its KV block's share in place, with no merge launch
    accumulate: bool = False
    # decode in one launch: the last split of each tile to finish reads its tile's partials back
    # and writes out and the LSE itself (sinks join there), where fagen.splitkv's merge kernel
    # would have done it one launch later
    merge_splits: bool = False

    @model_validator(mode="after")
    def _partial_needs_lse(self) -> Outputs:
        if self.partial and not self.lse:
            raise ValueError(rule("outputs.lse", False, "partials are merged by their LSE", "set lse: true",
                                  {"outputs.lse": True}))
        if self.accumulate and not self.partial:
            raise ValueError(rule("outputs.accumulate", True, "folds a float32 partial into the running one, so it "
                                  "needs outputs.partial", "set partial: true (and lse: true)",
                                  {"outputs.partial": True, "outputs.lse": True}))
        if self.merge_splits and (not self.partial or self.accumulate):
            raise ValueError(rule("outputs.merge_splits", True, "merges split-KV partials, so it needs outputs.partial "
                                  "and no accumulate", "set partial: true and accumulate: false",
                                  {"outputs.partial": True, "outputs.accumulate": False}))
        return self


class Sequences(_Frozen):
    """Where a batch's sequences lie in memory (serving). padded: [B, H, N, d], every sequence N
    long. varlen (FlashAttention's convention): token-major [total, H, d], sequence b being rows
    cu_seqlens[b] .. cu_seqlens[b + 1], so a batch of mixed lengths carries no padding. paged
    (K and V only): a cache [num_pages, page_size, H, d] whose pages a page table lists per
    sequence, cache_seqlens[b] keys long (vLLM's and FlashAttention's KV cache). ranged (K and V
    only): padded [B, H, N, d], sequence b's keys being rows cache_leftpad[b] .. cache_seqlens[b]
    of its own (FlashAttention's unpaged KV cache with cache_leftpad): a left-padded batch, a
    static cache's slots past the tokens seen, read as nothing rather than masked. Each block
    reads its sequence's lengths on the device, so every mask holds per sequence."""

    q: Literal["padded", "varlen"] = "padded"
    kv: Literal["padded", "varlen", "paged", "ranged"] = "padded"
    # varlen K/V: sequence b uses seqused_k[b] keys from row cu_seqlens_k[b] on (FlashAttention's
    # seqused_k), so sequences may share rows: a rank's two zigzag query chunks, one K/V
    seqused_k: bool = False

    @model_validator(mode="after")
    def _seqused_k_rules(self) -> Sequences:
        if self.seqused_k and self.kv != "varlen":
            raise ValueError(rule("sequences.seqused_k", True, f"with kv {self.kv!r}: it counts each sequence's keys "
                                  "from its cu_seqlens_k row", "use kv: varlen, or remove seqused_k",
                                  {"sequences.seqused_k": REMOVE}))
        return self

    @property
    def padded(self) -> bool:
        return self.q == "padded" and self.kv == "padded"

    def __str__(self) -> str:
        return "padded" if self.padded else f"q {self.q}, kv {self.kv}" + (" (seqused_k)" if self.seqused_k else "")


class Backward(_Frozen):
    """The backward kernels (training), rendered beside the forward: a KV-major kernel owning
    block_kv keys of one KV head accumulates dK and dV in registers over the query tiles (of every
    query head of its group) that see them. dQ: with deterministic, a Q-major kernel accumulates
    it over the KV tiles, as the forward does, and no block adds into another's output (bitwise
    identical gradients, at the price of S and dP computed twice); without, on sm_90a's wgmma
    loop, the KV-major kernel adds each step's dS.K into a float32 dQ with atomics (5 products a
    tile pair, not 7; the order of the adds varies run to run)."""

    block_kv: int = 128  # dK/dV kernel: keys a block owns, the rows of its S^T
    block_q: int = 64  # ... queries per step of its loop
    warps: int = 8
    # ... warps side by side along head_dim for dK and dV (each recomputes its keys' S^T): 2 lets
    # head_dim 256 keep its accumulators in registers
    head_split: int = 1
    stages: int = 2  # ... Q and dO tiles in flight
    dq_block_q: int = 64  # dQ kernel: query rows a block owns
    dq_block_kv: int = 64  # ... keys per KV tile
    dq_warps: int = 4
    # false: atomic dQ where the kernels have it (sm_90a up to head_dim 128), else the dQ kernel
    deterministic: bool = False
    # the dK/dV kernel also adds d loss / d bias (score_mod.bias) into a float32 buffer of the
    # bias's shape: the score gradient at the bias, summed over what the bias broadcasts
    bias_grad: bool = False
    # the dK/dV kernel also sums d loss / d these captured arrays (score_mod.captured's indices:
    # a learned table): each score's gradient times its read's derivative, added as int64 fixed
    # point (exact, so the sums are bitwise the same run to run)
    captured_grads: tuple[int, ...] = ()
    # sm_90a's wgmma dK/dV kernel: a producer warp loads K, V and each step's Q, dO, LSE and D
    # with TMA, and the consumer warpgroups only compute; unset, every thread copies with cp.async
    warp_specialized: WarpSpecialized | None = None
    # ... and the wgmma dQ kernel's (deterministic): a producer warp loads Q and dO, then each
    # step's K and V, with TMA; with one consumer warpgroup (dq_warps 4) two blocks share an SM,
    # so the two warpgroups' registers must fit half of it (consumer_registers <= 232)
    dq_warp_specialized: WarpSpecialized | None = None
    # the main loops' instructions: unset, wgmma where the spec allows it (AttentionSpec.wgmma_trains);
    # mma_sync: the mma.sync loops anyway (an sm_90a spec's built for sm_90), where registers refuse
    # every wgmma tiling (two head widths with a bias's gradient, say)
    mma: Literal["mma_sync"] | None = None

    @field_validator("captured_grads", mode="before")
    @classmethod
    def _captured_grads_list(cls, v):
        return tuple(v) if isinstance(v, list) else v  # YAML's list, held as a tuple (a spec is hashed)

    @field_validator("warps", "dq_warps")
    @classmethod
    def _warps(cls, v: int, info) -> int:
        if v not in (1, 2, 4, 8):
            default = cls.model_fields[info.field_name].default
            raise ValueError(rule(f"backward.{info.field_name}", v, "must be 1, 2, 4 or 8", f"use 4 or 8 (by default "
                                  f"{default})", {f"backward.{info.field_name}": default}))
        return v

    @field_validator("head_split")
    @classmethod
    def _head_split(cls, v: int) -> int:
        if v not in (1, 2):
            raise ValueError(rule("backward.head_split", v, "must be 1 or 2", "use 2 for head_dim 256, else 1",
                                  {"backward.head_split": 1}))
        return v

    @field_validator("stages")
    @classmethod
    def _stages(cls, v: int) -> int:
        if v not in (1, 2, 3):
            raise ValueError(rule("backward.stages", v, "must be 1, 2 or 3 (Q and dO tiles in flight)", "use 2",
                                  {"backward.stages": 2}))
        return v

    @field_validator("block_q", "dq_block_kv")
    @classmethod
    def _k_steps(cls, v: int, info) -> int:
        if v % MMA_K or not MMA_K <= v <= 128:
            raise ValueError(rule(f"backward.{info.field_name}", v, "must be a multiple of 16 in 16..128 (the "
                                  "MMAs consume it 16 at a time)", "use 64",
                                  {f"backward.{info.field_name}": 64}))
        return v

    @model_validator(mode="after")
    def _rows_per_warp(self) -> Backward:
        key_warps = self.warps // self.head_split
        if self.warps % self.head_split:
            raise ValueError(rule("backward.head_split", self.head_split, f"must divide warps ({self.warps})",
                                  "use head_split 1, or more warps", {"backward.head_split": 1}))
        for field, rows, warps in (("block_kv", self.block_kv, key_warps), ("dq_block_q", self.dq_block_q, self.dq_warps)):
            if rows % (MMA_M * warps) or not 1 <= rows // (MMA_M * warps) <= 2:
                good = [MMA_M * warps * m for m in (1, 2)]
                closest = min(good, key=lambda g: abs(g - rows))
                raise ValueError(rule(f"backward.{field}", rows, f"must give each of its {warps} warps 16 or 32 "
                                      "whole rows (m16 MMA fragments)", f"use one of {good}", {f"backward.{field}": closest}))
        return self


class AttentionSpec(_Frozen):
    name: str
    dtype: str  # q's element type, and k's, v's and o's where q_dtype, kv_dtype and out_dtype are not given
    # q's where it is not dtype: an FP8 q that an FP8 KV cache's kernel widens as it lands (exactly,
    # to the float16 its MMAs read), dtype then the half type the kernel is otherwise built for
    q_dtype: str | None = None
    kv_dtype: str | None = None
    out_dtype: str | None = None
    head_dim: int  # Q's and K's width (Q.K^T's reduction)
    head_dim_v: int | None = None  # V's and O's width, where it differs from head_dim (DeepSeek's 192/128)
    tiling: Tiling
    pipeline: Pipeline = Pipeline()
    smem_layout: Literal["padded", "swizzled"] = "padded"
    mask: Mask = Mask()
    score_mod: ScoreMod = ScoreMod()
    outputs: Outputs = Outputs()
    arch: Literal["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"] = "sm_80"
    sequences: Sequences = Sequences()
    backward: Backward | None = None  # set: the backward kernels render too (<name>_backward.cu)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        # The kernel symbol is fagen_<name> (plan.KERNEL_SYMBOL_PREFIX): any identifier is safe there
        # except those C++ reserves for the implementation (a double underscore).
        if not valid_name(v):
            like = name_like(v)
            raise ValueError(rule(
                "name", v, f"must be a lowercase C identifier of at most {MAX_NAME_LENGTH} characters, not "
                "starting with '_' or holding '__' (it names the kernel's symbol and file)",
                f"use letters, digits and single underscores, e.g. {like}", {"name": like}))
        return v

    @field_validator("dtype", "q_dtype", "kv_dtype", "out_dtype")
    @classmethod
    def _known_type(cls, v: str | None, info) -> str | None:
        if v is not None and v not in INPUT_TYPES:
            near = difflib.get_close_matches(str(v), KERNEL_TYPES, n=1, cutoff=0.0)[0]
            names = ", ".join(map(repr, INPUT_TYPES[:-1])) + f" or {INPUT_TYPES[-1]!r}"
            raise ValueError(rule(info.field_name, v, f"must be one of {names}",
                                  f"did you mean {near!r}? use {info.field_name}: {near}", {info.field_name: near}))
        return v

    @model_validator(mode="after")
    def _element_types(self) -> AttentionSpec:
        """The kernels take q, k, v and o of one type, of those with kernels (KERNEL_TYPES), or
        FP8 q, k and v with a half-type or e4m3 o (FP8_KERNEL_TYPES); other combinations are spellable,
        and refused here by what exists."""
        exist = (f"the kernels take q, k, v and o all of one type ({' or '.join(KERNEL_TYPES)}), or q, k and v "
                 f"{' or '.join(FP8_KERNEL_TYPES)} with o {' or '.join(ELEMENT_TYPES[FP8_KERNEL_TYPES[0]].out_types)}")
        if self.q_dtype is not None and self.q_dtype != self.dtype:
            self._widened_query()
        if self.kv_dtype is not None and self.kv_dtype != self.dtype:
            if self.dtype in KERNEL_TYPES and self.kv_dtype in FP8_KERNEL_TYPES:
                return self._fp8_kv_cache()
            raise ValueError(rule("kv_dtype", self.kv_dtype, f"no kernel takes q {self.dtype} with k and v "
                                  f"{self.kv_dtype} yet; {exist}, or q {' or '.join(KERNEL_TYPES)} with k and v "
                                  f"{' or '.join(FP8_KERNEL_TYPES)} (an FP8 KV cache)",
                                  f"remove kv_dtype (k and v then {self.dtype})", {"kv_dtype": REMOVE}))
        if self.dtype in FP8_KERNEL_TYPES:
            return self._fp8_forward()
        if self.out_dtype is not None and self.out_dtype != self.dtype:
            raise ValueError(rule("out_dtype", self.out_dtype, f"no kernel takes q {self.dtype} with o "
                                  f"{self.out_dtype} yet; {exist}", f"remove out_dtype (o then {self.dtype})",
                                  {"out_dtype": REMOVE}))
        return self

    def _fp8_forward(self) -> AttentionSpec:
        """What the FP8 forward is built for: sm_90a's warp-specialized kernel, head_dim 128 or 256
        (rows of whole 128-byte swizzle atoms), key tiles of 128-256 keys in k32 steps (V^T read in
        128-key boxes, one atom's row each), padded sequences, whole outputs, no backward; o in a
        half type, or e4m3 at an output scale. Sequences padded, or varlen q and K/V (V^T per
        sequence: fagen.fp8_inputs)."""
        fp8 = f"the {self.dtype} forward"
        o, seq = self.outputs, self.sequences
        # back to the half type (the copying or warp-specialized bf16 kernel of the same fields)
        half = {"dtype": KERNEL_TYPES[-1], **({"out_dtype": REMOVE} if self.out_dtype else {})}
        half_text = f"use dtype: {KERNEL_TYPES[-1]}" + (" and remove out_dtype" if self.out_dtype else "")
        hopper_only = self.pipeline.pingpong or self.pipeline.warp_specialized is not None
        refused = [  # (field, value, broken, why, fix text, fix)
            ("arch", self.arch, self.arch != "sm_90a", f"{fp8} runs on wgmma (sm_90a) only",
             *(("use arch: sm_90a", {"arch": "sm_90a"}) if hopper_only else (half_text, half))),
            ("pipeline.warp_specialized", None, self.pipeline.warp_specialized is None,
             f"{fp8} is the TMA producer's kernel", half_text, half),
            ("head_dim_v", self.dv, self.dv != self.head_dim, f"{fp8} has V as wide as Q and K",
             "remove head_dim_v", {"head_dim_v": REMOVE}),
            ("head_dim", self.head_dim, self.head_dim not in (128, 256), f"{fp8} is built for head_dim 128 or 256",
             "use head_dim: 128", {"head_dim": 128}),
            ("tiling.block_kv", self.tiling.block_kv,
             self.tiling.block_kv % FP8_KEY_STEP != 0 or not FP8_MIN_KEYS <= self.tiling.block_kv <= FP8_MAX_KEYS,
             f"{fp8} takes tiles of {FP8_MIN_KEYS}-{FP8_MAX_KEYS} keys in whole k{FP8_KEY_STEP} steps of P.V "
             f"(V^T is read in {FP8_MIN_KEYS}-key boxes, a 128-byte swizzle row)", f"use tiling.block_kv: {FP8_MIN_KEYS}",
             {"tiling.block_kv": FP8_MIN_KEYS}),
            ("backward", "set", self.backward is not None, f"{fp8} has no backward yet", "remove the backward: section",
             {"backward": REMOVE}),
            ("sequences", f"q {seq.q}, kv {seq.kv}" + (", seqused_k" if seq.seqused_k else ""),
             not (seq.padded or (seq.q, seq.kv, seq.seqused_k) == ("varlen", "varlen", False)),
             f"{fp8} takes padded [B, H, N, d] sequences, or varlen q and K/V (without seqused_k)",
             "remove sequences (padded)", {"sequences": REMOVE}),
            ("outputs", "partial / accumulate / merge_splits", o.partial or o.accumulate or o.merge_splits,
             f"{fp8} writes the whole output", "set partial, accumulate and merge_splits: false",
             {"outputs.partial": False, "outputs.accumulate": False, "outputs.merge_splits": False}),
            ("tiling.pack_gqa", True, self.tiling.pack_gqa, f"{fp8} does not pack GQA heads yet",
             "set tiling.pack_gqa: false", {"tiling.pack_gqa": False}),
        ]
        for field, value, broken, why, fix_text, fix in refused:
            if broken:
                raise ValueError(rule(field, value, f"{why}; {self.dtype} with these is not built yet", fix_text, fix))
        outs = ELEMENT_TYPES[self.dtype].out_types
        if self.out_dtype not in outs:  # the nearest: an FP8 one for an FP8 one, else the default
            fp8_out = self.out_dtype is not None and ELEMENT_TYPES[self.out_dtype].is_fp8
            near = next((o for o in outs if ELEMENT_TYPES[o].is_fp8 == fp8_out), outs[0])
            raise ValueError(rule("out_dtype", self.out_dtype, f"{fp8} writes o in {' or '.join(outs)}",
                                  f"use out_dtype: {near}", {"out_dtype": near}))
        return self

    def _widened_query(self) -> None:
        """q_dtype: an FP8 q read by an FP8 KV cache's kernel (dtype a half type, kv_dtype FP8), which
        widens it as it lands; no other kernel takes a q of its own type."""
        fp8_cache = self.dtype in KERNEL_TYPES and self.kv_dtype in FP8_KERNEL_TYPES
        if self.q_dtype != self.kv_dtype or not fp8_cache:
            raise ValueError(rule("q_dtype", self.q_dtype, f"a q of its own type is an FP8 q of the cache's type "
                                  f"read by an FP8 KV cache's kernel (dtype {' or '.join(KERNEL_TYPES)}, kv_dtype "
                                  f"{' or '.join(FP8_KERNEL_TYPES)}, q_dtype the same), which widens it as it "
                                  f"lands; this spec has dtype {self.dtype} and kv_dtype {self.kv_dtype}",
                                  f"remove q_dtype (q then {self.dtype})", {"q_dtype": REMOVE}))

    def _fp8_kv_cache(self) -> AttentionSpec:
        """What a half-type q against an FP8 KV cache is built for: the GQA-packed mma.sync kernels
        (decode), K and V widened to float16 in registers (cvt from FP8 pairs needs sm_89), head_dim
        128 in a swizzled tile, no backward; o in q's type."""
        kv = f"q {self.dtype} against k and v {self.kv_dtype}"
        refused = [  # (field, value, broken, why, fix text, fix)
            ("arch", self.arch, self.arch not in FP8_KV_ARCHS,
             f"{kv} widens FP8 pairs with cvt (sm_89 on) in the mma.sync kernel", f"use arch: {FP8_KV_ARCHS[-1]}",
             {"arch": FP8_KV_ARCHS[-1]}),
            ("tiling.pack_gqa", False, not self.tiling.pack_gqa,
             f"{kv} is the decode kernel's (the query heads of a KV group packed into its rows)",
             "set tiling.pack_gqa: true", {"tiling.pack_gqa": True}),
            ("head_dim", self.head_dim, self.head_dim not in FP8_KV_HEAD_DIMS or self.dv != self.head_dim,
             f"{kv} is built for head_dim {' or '.join(map(str, FP8_KV_HEAD_DIMS))}, V as wide",
             "use head_dim: 128 and remove head_dim_v", {"head_dim": 128, "head_dim_v": REMOVE}),
            ("tiling.block_kv", self.tiling.block_kv, self.tiling.block_kv % (FP8_KV_WARP_KEYS * self.tiling.warps_kv) != 0,
             f"{kv} gives each of the {self.tiling.warps_kv} key warps a multiple of {FP8_KV_WARP_KEYS} keys of a tile "
             "(a widened K load is two n8 fragments)", f"use tiling.block_kv: {FP8_KV_WARP_KEYS * self.tiling.warps_kv * -(-self.tiling.block_kv // (FP8_KV_WARP_KEYS * self.tiling.warps_kv))}",
             {"tiling.block_kv": FP8_KV_WARP_KEYS * self.tiling.warps_kv * -(-self.tiling.block_kv // (FP8_KV_WARP_KEYS * self.tiling.warps_kv))}),
            ("smem_layout", self.smem_layout, self.smem_layout != "swizzled",
             f"{kv} reads its FP8 tiles from swizzled rows", "use smem_layout: swizzled", {"smem_layout": "swizzled"}),
            ("pipeline.q_in_registers", True, self.pipeline.q_in_registers,
             f"{kv} reads Q's fragments in K's column order from shared memory", "set pipeline.q_in_registers: false",
             {"pipeline.q_in_registers": False}),
            ("backward", "set", self.backward is not None, f"{kv} has no backward (a KV cache is inference's)",
             "remove the backward: section", {"backward": REMOVE}),
            ("out_dtype", self.out_dtype, self.out_dtype not in (None, self.dtype), f"{kv} writes o in q's type",
             "remove out_dtype", {"out_dtype": REMOVE}),
        ]
        broken = [(field, value, why, fix_text, fix) for field, value, on, why, fix_text, fix in refused if on]
        if not broken:
            return self
        field, value, why = broken[0][:3]
        if any(b[0] == "tiling.pack_gqa" for b in broken):  # not a decode spec: far from any FP8 KV kernel
            fix_text, fix = (f"remove kv_dtype (k and v then {self.dtype}), or start from a decode spec "
                             "(specs/decode_*.yaml)", {"kv_dtype": REMOVE})
        else:  # every change at once, so that the fix validates
            fix_text = ", and ".join(b[3] for b in broken)
            fix = {k: v for b in broken for k, v in b[4].items()}
        raise ValueError(rule(field, value, f"{why}; not built otherwise yet", fix_text, fix))

    @model_validator(mode="after")
    def _qk_head_dim(self) -> AttentionSpec:
        """head_dim 192 is a Q.K^T width over a narrower V (DeepSeek's 192/128)."""
        if self.head_dim in QK_HEAD_DIMS and self.dv == self.head_dim:
            raise ValueError(rule("head_dim", self.head_dim, f"is a Q.K^T width that comes with a narrower V "
                                  f"(head_dim_v, e.g. DeepSeek's 192/128); a square {self.head_dim}-wide head is not "
                                  "built yet", "set head_dim_v: 128, or pad the head to head_dim: 256",
                                  {"head_dim_v": 128}))
        return self

    @model_validator(mode="after")
    def _two_head_widths(self) -> AttentionSpec:
        """head_dim_v apart from head_dim: the forward over padded or varlen tensors and caches
        (paged, ranged), its backward (wgmma or mma.sync, the dQ kernel's), and on mma.sync the
        decode kernels' split keys and packed GQA heads (split-KV partials, merged in the launch or
        after it; warps along the keys); what it does not reach yet is refused by name."""
        if self.dv == self.head_dim:
            return self
        why = f"head_dim_v {self.dv} differs from head_dim {self.head_dim}"
        fix = f"remove head_dim_v (V as wide as Q and K), or {{}}"
        o, t = self.outputs, self.tiling
        if self.arch == "sm_90a" and self.dv % SWIZZLE_ATOM_ELEMS:
            raise ValueError(rule("head_dim_v", self.dv, "must be a multiple of 64 on sm_90a (rows are stored in "
                                  "128-byte swizzle atoms that wgmma reads)", "use 64, 128 or 256",
                                  {"head_dim_v": -(-self.dv // SWIZZLE_ATOM_ELEMS) * SWIZZLE_ATOM_ELEMS}))
        if 96 in (self.head_dim, self.dv):
            raise ValueError(rule("head_dim_v", self.dv, f"with head_dim {self.head_dim}: a 96-wide row (12 "
                                  "chunks) is copied by a loop of its own, and one tile's K and V copies share one",
                                  "remove head_dim_v (V as wide as Q and K), or use head_dim_v 64 or 128 beside head_dim 64, "
                                  "128 or 256", {"head_dim_v": REMOVE}))
        # the wgmma kernels' epilogues and producers write and load one tile a block (whole outputs,
        # one warp along the keys); the mma.sync ones take O's width from head_dim_v everywhere
        wgmma = self.arch == "sm_90a"
        refused = [
            ("outputs", o.accumulate or wgmma and (o.partial or o.merge_splits),
             "write the whole output (partial, accumulate and merge_splits: false)" if wgmma else
             "fold no running output (accumulate: false)",
             {"outputs.partial": False, "outputs.accumulate": False, "outputs.merge_splits": False} if wgmma else
             {"outputs.accumulate": False}),
            ("tiling.pack_gqa", t.pack_gqa and wgmma, "set pack_gqa: false", {"tiling.pack_gqa": False}),
            ("tiling.warps_kv", t.warps_kv > 1 and wgmma, "set warps_kv: 1", {"tiling.warps_kv": 1}),
            # the dQ kernel's TMA producer loads one width (its byte counts are Q's and K's)
            ("backward.dq_warp_specialized", self.backward is not None and self.backward.dq_warp_specialized is not None,
             "remove backward.dq_warp_specialized", {"backward.dq_warp_specialized": REMOVE}),
        ]
        broken = [(field, change, values) for field, on, change, values in refused if on]
        if broken:  # the first named; the fix makes every change at once, so that it validates
            field = broken[0][0]
            value = t.warps_kv if field == "tiling.warps_kv" else "set"
            raise ValueError(rule(field, value,
                                  f"is not built yet where {why} (on sm_90a whole outputs, one warp along the "
                                  "keys and no packed GQA heads; no running output folded; no dQ producer)", fix.format(", ".join(c for _, c, _ in broken)),
                                  {k: v for _, _, values in broken for k, v in values.items()}))
        return self

    @property
    def element(self) -> ElementType:
        """The kernel's element type (dtype's): q's where q_dtype is not given, k's and v's where
        kv_dtype is not."""
        return ELEMENT_TYPES[self.dtype]

    @property
    def q_element(self) -> ElementType:
        """q's element type as the kernel reads it from memory: q_dtype, else dtype's."""
        return ELEMENT_TYPES[self.q_dtype or self.dtype]

    @property
    def widens_query(self) -> bool:
        """An FP8 q (q_dtype) that the FP8 KV cache's kernel widens to float16 as it lands."""
        return self.q_element.is_fp8 and self.fp8_kv

    @property
    def kv_element(self) -> ElementType:
        """k's and v's element type: kv_dtype, else q's."""
        return ELEMENT_TYPES[self.kv_dtype or self.dtype]

    @property
    def fp8_kv(self) -> bool:
        """A half-type q against FP8 k and v (an FP8 KV cache): K and V widen to float16 in
        registers, and the MMAs run in float16 (a bfloat16 q is rescaled to it in shared memory)."""
        return self.kv_element.is_fp8 and not self.element.is_fp8

    @property
    def mma_element(self) -> ElementType:
        """The type the MMAs read: q's, or float16 against an FP8 KV cache (FP8 widens to it exactly)."""
        return ELEMENT_TYPES["float16"] if self.fp8_kv else self.element

    @property
    def out_element(self) -> ElementType:
        """o's element type: out_dtype, else q's."""
        return ELEMENT_TYPES[self.out_dtype or self.dtype]

    @field_validator("head_dim", "head_dim_v")
    @classmethod
    def _head_dim(cls, v: int | None, info) -> int | None:
        field = info.field_name
        if field == "head_dim" and v in QK_HEAD_DIMS:
            return v  # with a V of its own (_qk_head_dim)
        if v is not None and v not in HEAD_DIMS:
            up = next((d for d in HEAD_DIMS if d >= v), None)
            if up is None:
                raise ValueError(rule(field, v, f"must be one of {list(HEAD_DIMS)}", f"split the heads: the "
                                      f"largest supported is {HEAD_DIMS[-1]}"))
            raise ValueError(rule(field, v, f"must be one of {list(HEAD_DIMS)}",
                                  f"pad the head dimension up to the next supported size, {field}: {up}", {field: up}))
        return v

    @model_validator(mode="after")
    def _rows_per_warp(self) -> AttentionSpec:
        """mma.sync tiles: each warp owns 1..4 m16 fragments of the rows. On sm_90a a warpgroup
        owns exactly 64 rows, a rule of its own (_wgmma_shapes), which offers only what it takes."""
        t = self.tiling
        if self.wgmma:
            return self
        if t.block_q % (MMA_M * t.warps_q) or not 1 <= t.block_q // (MMA_M * t.warps_q) <= 4:
            good = [MMA_M * t.warps_q * m for m in (1, 2, 3, 4)]
            closest = min(good, key=lambda g: abs(g - t.block_q))
            raise ValueError(rule(
                "tiling.block_q", t.block_q,
                f"must give each of the {t.warps_q} warps 16, 32, 48 or 64 whole rows "
                "(each warp owns m16 MMA fragments of the queries)",
                f"use block_q in {good} (e.g. block_q: {closest}) or change warps_q", {"tiling.block_q": closest}))
        return self

    @model_validator(mode="after")
    def _swizzle_needs_eight_chunks(self) -> AttentionSpec:
        chunks = self.row_width // 8
        if self.smem_layout == "swizzled" and chunks % 8 and self.arch != "sm_90a":  # sm_90a: _wgmma_shapes
            raise ValueError(rule(
                "smem_layout", "swizzled",
                f"XORs the 16-byte chunk index with row % 8, so a row needs a multiple of 8 "
                f"chunks; {'head_dim_v' if self.dv > self.head_dim else 'head_dim'} {self.row_width} has {chunks}",
                "use smem_layout: padded, or head_dim 64, 128 or 256", {"smem_layout": "padded"}))
        return self

    @model_validator(mode="after")
    def _wgmma_shapes(self) -> AttentionSpec:
        """sm_90a kernels are built from whole warpgroups and 128-byte swizzle atoms."""
        if self.arch != "sm_90a":
            if self.tiling.warps_q == THREE_WARPGROUPS_WARPS:
                rows = self.tiling.block_q * 8 // THREE_WARPGROUPS_WARPS  # the same rows a warp
                raise ValueError(rule("tiling.warps_q", self.tiling.warps_q, f"needs arch sm_90a with "
                                      f"pipeline.warp_specialized (three consumer warpgroups), not {self.arch}",
                                      f"use warps_q 8 or fewer (warps_q: 8 with block_q: {rows})",
                                      {"tiling.warps_q": 8, "tiling.block_q": rows}))
            if self.pipeline.pingpong:
                raise ValueError(rule("pipeline.pingpong", True, f"needs arch sm_90a (warpgroups taking turns "
                                      f"on wgmma), not {self.arch}", "set arch: sm_90a or pingpong: false",
                                      {"pipeline.pingpong": False}))
            if self.pipeline.warp_specialized is not None:
                raise ValueError(rule("pipeline.warp_specialized", "set", f"needs arch sm_90a (TMA loads, "
                                      f"setmaxnreg), not {self.arch}", "set arch: sm_90a, or remove it",
                                      {"pipeline.warp_specialized": REMOVE}))
            return self
        t, p = self.tiling, self.pipeline
        fix_arch = "or use arch: sm_90 for the mma.sync kernel"
        if t.warps_q == THREE_WARPGROUPS_WARPS and p.warp_specialized is None:
            raise ValueError(rule("tiling.warps_q", t.warps_q, "takes pipeline.warp_specialized (three consumer "
                                  "warpgroups beside a TMA producer; without one, 384 copying threads)",
                                  f"set pipeline.warp_specialized, or use warps_q: 8 (with block_q: {t.block_q * 8 // 12})",
                                  {"tiling.warps_q": 8, "tiling.block_q": t.block_q * 8 // THREE_WARPGROUPS_WARPS}))
        if t.warps_q % WARPGROUP_WARPS:
            raise ValueError(rule("tiling.warps_q", t.warps_q, "must be 4, 8 or 12 on sm_90a (whole warpgroups of "
                                  "4 warps; wgmma is issued by 128 threads together)", "use 8 (with block_q: 128), " + fix_arch,
                                  {"tiling.warps_q": 8, "tiling.block_q": 128}))
        if t.block_q != t.warps_q * MMA_M:
            raise ValueError(rule("tiling.block_q", t.block_q, f"must be 16 * warps_q = {t.warps_q * MMA_M} on "
                                  "sm_90a (a warpgroup owns the 64 rows of one wgmma.m64)",
                                  f"use block_q: {t.warps_q * MMA_M}, " + fix_arch, {"tiling.block_q": t.warps_q * MMA_M}))
        if self.head_dim % SWIZZLE_ATOM_ELEMS:
            raise ValueError(rule("head_dim", self.head_dim, "must be a multiple of 64 on sm_90a (rows are "
                                  "stored in 128-byte swizzle atoms that wgmma reads)", "use 64, 128 or 256, " + fix_arch,
                                  {"head_dim": -(-self.head_dim // SWIZZLE_ATOM_ELEMS) * SWIZZLE_ATOM_ELEMS}))
        if self.smem_layout != "swizzled":
            raise ValueError(rule("smem_layout", self.smem_layout, "must be swizzled on sm_90a (wgmma reads "
                                  "128-byte-swizzled tiles)", "set smem_layout: swizzled",
                                  {"smem_layout": "swizzled"}))
        if p.kv_smem != "separate" or p.stages < 2:
            raise ValueError(rule("pipeline", f"{p.kv_smem}, stages {p.stages}", "sm_90a needs kv_smem: separate "
                                  "with stages >= 2 (P.V of tile j - 1 runs while tile j's softmax does, and "
                                  "tile j + 1 loads meanwhile)", f"use kv_smem: separate, stages: {max(p.stages, 2)}",
                                  {"pipeline.kv_smem": "separate", "pipeline.stages": max(p.stages, 2)}))
        if p.q_in_registers:
            raise ValueError(rule("pipeline.q_in_registers", True, "does not apply on sm_90a (wgmma reads Q "
                                  "from shared memory)", "set q_in_registers: false",
                                  {"pipeline.q_in_registers": False}))
        if p.pingpong and t.warps_q == WARPGROUP_WARPS:
            raise ValueError(rule("pipeline.pingpong", True, f"takes two or three warpgroups (warps_q 8 or 12), "
                                  f"not warps_q {t.warps_q}", "use warps_q: 8 and block_q: 128, or pingpong: false",
                                  {"pipeline.pingpong": False}))
        if p.warp_specialized is not None:
            self._warp_specialized_rules()
        return self

    def _warp_specialized_rules(self) -> None:
        """The producer's TMA loads read [B, H, N, head_dim] tensors through tensor maps (a varlen
        batch is one such tensor, [1, H, total, head_dim]; a paged cache is not), and the register
        split must fit the SM's register file."""
        ws, consumers = self.pipeline.warp_specialized, self.tiling.warps_q // WARPGROUP_WARPS
        if self.sequences.kv == "paged":
            raise ValueError(rule("pipeline.warp_specialized", "set", f"with sequences {self.sequences}: its "
                                  "tensor maps describe [B, H, N, head_dim] tensors, and a paged cache's rows lie "
                                  "in the pages its table lists", "remove warp_specialized for a paged cache",
                                  {"pipeline.warp_specialized": REMOVE}))
        if consumers < 2:
            raise ValueError(rule("pipeline.warp_specialized", "set", f"with warps_q {self.tiling.warps_q}: one "
                                  "consumer warpgroup beside the producer already has every register a thread may "
                                  "hold (255), so there is nothing for setmaxnreg to move", "use warps_q: 8 and "
                                  "block_q: 128 (two consumer warpgroups), or remove warp_specialized",
                                  {"pipeline.warp_specialized": REMOVE}))
        register_split_rules("pipeline.warp_specialized", ws, consumers, blocks=1)

    @model_validator(mode="after")
    def _pack_gqa_rules(self) -> AttentionSpec:
        """A packed tile's rows are (position, query head) pairs: what reads a row by position alone
        works per row; arrays indexed by query tile or by (head, position) rows do not."""
        if not self.tiling.pack_gqa:
            return self
        unpacked, unpack = "or use an unpacked spec (tiling.pack_gqa: false)", {"tiling.pack_gqa": False}
        if self.wgmma:
            raise ValueError(rule("tiling.pack_gqa", True, "is built on the mma.sync main loop (m16 rows a warp, "
                                  "few rows for decode), not sm_90a's wgmma (64 rows a warpgroup)",
                                  "set arch: sm_80 (it runs on Hopper too), " + unpacked, unpack))
        if not KINDS[self.mask.kind].packable:
            raise ValueError(rule("tiling.pack_gqa", True, f"mask kind {self.mask.kind!r} reads an array by query "
                                  "tile or row, and a packed tile's rows mix the group's heads",
                                  "use none, causal, sliding_window, chunked or prefix_lm, " + unpacked, unpack))
        if self.score_mod.bias != "none":
            raise ValueError(rule("tiling.pack_gqa", True, "with score_mod.bias: a bias is read per (query head, "
                                  "position) row, which packing does not address", "remove the bias, " + unpacked, unpack))
        if self.backward is not None:
            raise ValueError(rule("tiling.pack_gqa", True, "is a decode (inference) layout; the backward kernels "
                                  "are not packed", "remove backward, " + unpacked, unpack))
        return self

    @model_validator(mode="after")
    def _key_warps_rules(self) -> AttentionSpec:
        """Warps along the keys (tiling.warps_kv > 1): each warp sees its share of a tile's keys and
        keeps its own softmax state; the mma.sync epilogue merges them."""
        t = self.tiling
        if t.warps_kv == 1:
            return self
        fix, one = "or use warps_kv: 1", {"tiling.warps_kv": 1}
        if self.wgmma:
            raise ValueError(rule("tiling.warps_kv", t.warps_kv, "is built on the mma.sync main loop (sm_90a's "
                                  "warpgroups own whole 64-row tiles)", "set arch: sm_80, " + fix, one))
        if t.block_kv % (MMA_K * t.warps_kv):
            raise ValueError(rule("tiling.warps_kv", t.warps_kv, f"must split block_kv {t.block_kv} into whole k16 "
                                  "steps of P.V, one share a warp", f"use block_kv {MMA_K * t.warps_kv * 2}, " + fix, one))
        if t.warps_q * t.warps_kv > 8:
            raise ValueError(rule("tiling.warps_kv", t.warps_kv, f"with warps_q {t.warps_q} makes "
                                  f"{t.warps_q * t.warps_kv} warps, over 8 (256 threads a block)",
                                  "use fewer warps_q, " + fix, one))
        if not KINDS[self.mask.kind].packable:
            raise ValueError(rule("tiling.warps_kv", t.warps_kv, f"mask kind {self.mask.kind!r} reads arrays by "
                                  "tile, not by position", "use none, causal, sliding_window, chunked or prefix_lm, "
                                  + fix, one))
        if self.backward is not None:
            raise ValueError(rule("tiling.warps_kv", t.warps_kv, "is a forward (decode) layout; the backward kernels "
                                  "have their own tiling", "remove backward, " + fix, one))
        return self

    @model_validator(mode="after")
    def _accumulate_rules(self) -> AttentionSpec:
        """A ring step's running LSE is a row slice of a longer [B, H, N] one (lse_head_stride):
        the packed rows of GQA packing and varlen's [H, total_q] LSE have no such view."""
        if not self.outputs.accumulate:
            return self
        if self.tiling.pack_gqa:
            raise ValueError(rule("outputs.accumulate", True, "with tiling.pack_gqa: a packed tile's rows spread "
                                  "over a group's heads, which a sliced running LSE does not lay out",
                                  "set tiling.pack_gqa: false (ring steps are long prefills)", {"tiling.pack_gqa": False}))
        if self.sequences.q != "padded":
            raise ValueError(rule("outputs.accumulate", True, f"with sequences.q {self.sequences.q!r}: the running "
                                  "output is [B, H, N, d] by padded positions", "use padded queries (remove sequences)",
                                  {"sequences": REMOVE}))
        return self

    @model_validator(mode="after")
    def _merge_splits_rules(self) -> AttentionSpec:
        """The merging split finds its tile's rows in out by padded positions, and runs in the
        mma.sync kernel's epilogue (a decode kernel's)."""
        if not self.outputs.merge_splits:
            return self
        if self.sequences.q != "padded":
            raise ValueError(rule("outputs.merge_splits", True, f"with sequences.q {self.sequences.q!r}: the merge "
                                  "writes out by padded positions", "set merge_splits: false (fagen.splitkv merges "
                                  "varlen rows)", {"outputs.merge_splits": False}))
        if self.pipeline.warp_specialized is not None:
            raise ValueError(rule("outputs.merge_splits", True, "with pipeline.warp_specialized: the producer's "
                                  "roles have no merge phase", "set merge_splits: false, or remove warp_specialized",
                                  {"outputs.merge_splits": False}))
        return self

    @model_validator(mode="after")
    def _sequence_rules(self) -> AttentionSpec:
        """Varlen and paged blocks find their sequence's lengths on the device; what is indexed by
        padded positions of every sequence (a bias, doc_ids, block-mask tiles) has no such view."""
        seq = self.sequences
        if seq.padded:
            return self
        padded, unpadded = "or use padded sequences (remove sequences)", {"sequences": REMOVE}
        if not KINDS[self.mask.kind].packable:  # the kinds that read arrays indexed by padded rows
            raise ValueError(rule("sequences", str(seq), f"mask kind {self.mask.kind!r} reads an array laid out "
                                  "by padded query tiles or positions", "varlen is itself the packed-documents "
                                  "layout: give each document its own sequence, " + padded, unpadded))
        if self.score_mod.bias != "none":
            raise ValueError(rule("sequences", str(seq), "with score_mod.bias: a bias is indexed by padded "
                                  "positions [B, H, Nq, Nk]", "remove the bias, " + padded, unpadded))
        if self.backward is not None:
            raise ValueError(rule("sequences", str(seq), "varlen and paged layouts are inference (forward) "
                                  "layouts here; the backward kernels read padded tensors", "remove backward, " + padded,
                                  unpadded))
        return self

    def _captured_grads_rules(self) -> None:
        """backward.captured_grads: arrays score_mod.expression reads, each read's derivative and
        index free of the score (the dK/dV kernel evaluates them from b, h, q_idx, kv_idx after
        the score has become P)."""
        wanted, count = self.backward.captured_grads, self.score_mod.captured
        if not wanted:
            return
        fix = {"backward.captured_grads": REMOVE}
        if list(wanted) != sorted(set(wanted)) or not all(0 <= i < count for i in wanted):
            raise ValueError(rule("backward.captured_grads", list(wanted), f"lists captured arrays by index, "
                                  f"ascending and distinct, each below score_mod.captured ({count})",
                                  "list the indices of the arrays whose gradient is wanted, or remove it", fix))
        tree = expression.score(self.score_mod.expression, count)
        names = expression.captured_names(count)
        unit = dict.fromkeys(names, (-1.0, 1.0))
        for i in wanted:
            reads = read_derivatives(tree, {names[i]})
            if not reads:
                raise ValueError(rule("backward.captured_grads", list(wanted), f"{names[i]}: no read of it has a "
                                      f"derivative (it is only compared, rounded or an index): its gradient is 0",
                                      "remove its index", fix))
            for read, grad in reads:
                if "score" in expression.reads(grad) | expression.reads(read.index):
                    raise ValueError(rule("backward.captured_grads", list(wanted), f"the read "
                                          f"{expression.source(read)}: its derivative or index depends on the score, "
                                          f"which the dK/dV kernel no longer holds where it adds the gradient",
                                          "remove it (fagen.flex then sums that gradient outside the kernels)", fix))
                if interval(grad, unit, {}) is None:
                    raise ValueError(rule("backward.captured_grads", list(wanted), f"the read "
                                          f"{expression.source(read)}: its derivative {expression.source(grad)} has "
                                          f"no known bound (a logarithm, a division by a variable), and the kernel's "
                                          f"fixed-point sums take their scale from one",
                                          "remove it (fagen.flex then sums that gradient outside the kernels)", fix))
        if self.backward.bias_grad and self.score_mod.nonlinear:
            raise ValueError(rule("backward.captured_grads", list(wanted), "with backward.bias_grad and a nonlinear "
                                  "expression: the bias's gradient takes the expression's factor, the captured "
                                  "arrays' the score's gradient before it, and the kernel keeps one of them",
                                  "remove captured_grads, or train with a fixed bias (bias_grad: false)", fix))

    @model_validator(mode="after")
    def _backward_rules(self) -> AttentionSpec:
        if self.backward is None:
            return self
        mod = self.score_mod
        if mod.expression is not None and mod.expression_grad is None:
            raise ValueError(rule("score_mod.expression", mod.expression, "has no derivative, and the backward "
                                  "needs one for its chain rule", "add score_mod.expression_grad (d expression "
                                  "/ d score over the same variables), or remove backward",
                                  {"backward": REMOVE}))
        if self.backward.bias_grad and mod.bias == "none":
            raise ValueError(rule("backward.bias_grad", True, "is the gradient of score_mod.bias, which is none",
                                  "set score_mod.bias: matrix or vector, or bias_grad: false", {"backward.bias_grad": False}))
        if self.backward.bias_grad and mod.softcap is not None and mod.expression is not None:
            raise ValueError(rule(
                "backward.bias_grad", True, "with both softcap and an expression the bias sits between two "
                "nonlinear factors of the chain rule, and the kernel keeps only their product per score",
                "drop softcap or the expression, or train with a fixed bias (bias_grad: false)",
                {"backward.bias_grad": False}))
        self._captured_grads_rules()
        if self.outputs.partial:
            raise ValueError(rule("backward", "set", "differentiates the whole attention, not split-KV partials",
                                  "remove backward, or set outputs.partial: false", {"backward": REMOVE}))
        if not self.outputs.lse:
            raise ValueError(rule("outputs.lse", False, "the backward recomputes P from the forward's LSE",
                                  "set outputs.lse: true", {"outputs.lse": True}))
        bwd = self.backward
        if self.wgmma_backward and (bwd.head_split != 1 or bwd.warps % WARPGROUP_WARPS
                                    or bwd.block_kv != bwd.warps * MMA_M):
            raise ValueError(rule(
                "backward", f"block_kv {bwd.block_kv}, warps {bwd.warps}, head_split {bwd.head_split}",
                f"on sm_90a with head_dim {self.head_dim} the dK/dV kernel is wgmma: whole warpgroups (warps 4 "
                "or 8), each owning 64 keys (block_kv = 16 * warps), head_dim not split",
                "use block_kv: 128, warps: 8, head_split: 1 (or block_kv: 64, warps: 4)",
                {"backward.block_kv": 128, "backward.warps": 8, "backward.head_split": 1}))
        if bwd.mma is not None and not self.wgmma_trains:
            raise ValueError(rule("backward.mma", bwd.mma, f"chooses the mma.sync loops over wgmma's, and this spec's "
                                  f"backward has no wgmma loops to choose from ({self._heads_text})",
                                  "remove backward.mma", {"backward.mma": REMOVE}))
        if bwd.warp_specialized is not None and not self.wgmma_backward:
            raise ValueError(rule(
                "backward.warp_specialized", "set", f"the TMA producer feeds the wgmma dK/dV kernel (sm_90a, head_dim "
                f"up to {WGMMA_BACKWARD_MAX_HEAD_DIM}, or two widths up to {WGMMA_BACKWARD_MAX_ROW_WIDTH}); this "
                f"spec's is mma.sync ({'backward.mma: ' + bwd.mma if bwd.mma else self._heads_text})",
                "remove backward.warp_specialized",
                {"backward.warp_specialized": REMOVE}))
        if bwd.warp_specialized is not None:
            register_split_rules("backward.warp_specialized", bwd.warp_specialized, bwd.warps // WARPGROUP_WARPS, blocks=1)
        if self.wgmma_backward and bwd.stages < 2:
            raise ValueError(rule(
                "backward.stages", bwd.stages, f"must be 2 or 3 on sm_90a with head_dim {self.head_dim} (each step "
                "of the wgmma dK/dV loop refills the slot the step before it used)", "use stages: 2",
                {"backward.stages": 2}))
        if self.atomic_dq:  # the warpgroups share a step's dQ tiles (block_q x head_dim, m64n64 each) out
            warpgroups = bwd.warps // WARPGROUP_WARPS
            tiles = bwd.block_q // WARPGROUP_ROWS * (self.head_dim // SWIZZLE_ATOM_ELEMS)
            if bwd.block_q % WARPGROUP_ROWS or warpgroups % tiles:
                fits = [q for q in (64, 128) if warpgroups % (q // WARPGROUP_ROWS * (self.head_dim // SWIZZLE_ATOM_ELEMS)) == 0]
                raise ValueError(rule(
                    "backward.block_q", bwd.block_q, f"with deterministic: false each of the {warpgroups} "
                    f"warpgroup(s) adds one 64 x 64 tile of a step's dQ (block_q x head_dim {self.head_dim}), over "
                    "all the block's keys or an equal share of them: the tiles must divide the warpgroups",
                    f"use {' or '.join(f'block_q: {q}' for q in fits) or 'warps: 8 and block_kv: 128'}, or "
                    "deterministic: true", {"backward.block_q": fits[0]} if fits else {"backward.deterministic": True}))
        if self.wgmma_backward and (bwd.dq_warps % WARPGROUP_WARPS or bwd.dq_block_q != bwd.dq_warps * MMA_M):
            raise ValueError(rule(
                "backward", f"dq_block_q {bwd.dq_block_q}, dq_warps {bwd.dq_warps}",
                f"on sm_90a with head_dim {self.head_dim} the dQ kernel is wgmma: whole warpgroups (dq_warps 4 or "
                "8), each owning 64 query rows (dq_block_q = 16 * dq_warps)",
                "use dq_block_q: 64, dq_warps: 4 (or dq_block_q: 128, dq_warps: 8)",
                {"backward.dq_block_q": 64, "backward.dq_warps": 4}))
        if bwd.dq_warp_specialized is not None:
            self._dq_producer_rules()
        return self

    def _dq_producer_rules(self) -> None:
        """The dQ kernel's TMA producer: a wgmma dQ kernel that runs (deterministic), a block a
        query tile, and the register split of the blocks an SM holds fitting its register file."""
        bwd, ws = self.backward, self.backward.dq_warp_specialized
        if not self.wgmma_backward or not bwd.deterministic:
            why = (f"this spec's is mma.sync ({self._heads_text})" if not self.wgmma_backward
                   else "without deterministic the dK/dV kernel adds dQ with atomics and there is no dQ kernel")
            raise ValueError(rule(
                "backward.dq_warp_specialized", "set", f"the TMA producer feeds the wgmma dQ kernel (sm_90a, head_dim "
                f"up to {WGMMA_BACKWARD_MAX_HEAD_DIM}, deterministic: true); {why}",
                "remove backward.dq_warp_specialized" + ("" if not self.wgmma_backward else ", or set deterministic: true"),
                {"backward.dq_warp_specialized": REMOVE}))
        if ws.persistent:
            raise ValueError(rule("backward.dq_warp_specialized.persistent", True, "the dQ kernel runs a block a "
                                  "query tile", "remove persistent",
                                  {"backward.dq_warp_specialized.persistent": REMOVE}))
        consumers = bwd.dq_warps // WARPGROUP_WARPS
        register_split_rules("backward.dq_warp_specialized", ws, consumers, dq_producer_blocks_per_sm(consumers))

    @property
    def _heads_text(self) -> str:
        """The arch and head widths, as the backward's loop refusals name them."""
        return f"arch {self.arch}, head_dim {self.head_dim}" + (f", head_dim_v {self.dv}" if self.dv != self.head_dim else "")

    @property
    def atomic_dq(self) -> bool:
        """dQ accumulates in the dK/dV kernel with float32 atomics (backward.deterministic false,
        on the wgmma loop, V as wide as Q and K); else a Q-major kernel of its own computes it."""
        return self.wgmma_backward and not self.backward.deterministic and self.dv == self.head_dim

    @property
    def wgmma_backward(self) -> bool:
        """The dK/dV kernel runs on wgmma (spec.wgmma_trains, backward.mma unset); else on mma.sync."""
        return self.backward is not None and self.wgmma_trains and self.backward.mma is None

    @property
    def wgmma_trains(self) -> bool:
        """Whether this spec's backward runs on wgmma: sm_90a, up to head_dim
        WGMMA_BACKWARD_MAX_HEAD_DIM, or two head widths up to WGMMA_BACKWARD_MAX_ROW_WIDTH."""
        if not self.wgmma:
            return False
        if self.dv == self.head_dim:
            return self.head_dim <= WGMMA_BACKWARD_MAX_HEAD_DIM
        return self.row_width <= WGMMA_BACKWARD_MAX_ROW_WIDTH

    @property
    def warp_specialized(self) -> bool:
        """A TMA producer warp feeds consumer warpgroups (pipeline.warp_specialized)."""
        return self.pipeline.warp_specialized is not None

    @property
    def wgmma(self) -> bool:
        return self.arch == "sm_90a"

    @property
    def dv(self) -> int:
        """V's and O's head width (head_dim_v, else head_dim)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def row_width(self) -> int:
        """The elements of a shared-memory tile's row: the wider of the two head widths, so Q, K, V
        and the staged O share one row layout (a narrower tensor leaves columns unused)."""
        return max(self.head_dim, self.dv)

    @property
    def causal(self) -> bool:
        """Plain causal attention (what fagen.attention's causal=True selects)."""
        return self.mask.kind == "causal"
