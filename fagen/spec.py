"""The kernel spec: a pydantic model one-to-one with the YAML a kernel engineer writes.

Structural rules live here (field by field, then across fields). Rules that need derived
numbers (shared-memory bytes, register pressure) live in `fagen.plan`, which every path to
a rendered kernel goes through, so no invalid spec ever reaches a template.

Every error names the field, the value, the rule and a valid alternative.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from fagen import expression

HEAD_DIMS = (32, 64, 96, 128, 256)
# Largest dynamic shared memory one block may opt into, in bytes, per target.
SMEM_PER_BLOCK = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448, "sm_90a": 232448}
MMA_M, MMA_N, MMA_K = 16, 8, 16  # mma.sync.m16n8k16
# sm_90a (Hopper only) selects warpgroup MMAs: wgmma.m64nNk16, K and V (and Q) read straight from
# 128-byte-swizzled shared memory. A warpgroup is 4 warps owning 64 query rows.
WARPGROUP_WARPS, WARPGROUP_ROWS = 4, 64
SWIZZLE_ATOM_ELEMS = 64  # one 128-byte swizzle row of half-precision elements
MAX_NAME_LENGTH = 100  # a file name with room for a suffix and a tuned variant's tags


class SpecError(ValueError):
    """A spec that fagen refuses; the message says which field, why, and what to use."""


def rule(field: str, value: object, broken: str, fix: str) -> str:
    return f"{field} = {value!r}: {broken}; {fix}"


class _Frozen(BaseModel):
    # strict: YAML's `head_dim: "128"` or `stages: true` is a mistake, not something to coerce
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Tiling(_Frozen):
    """Br x Bc tile of the score matrix owned by one thread block, and its warps."""

    block_q: int  # Br: query rows per block
    block_kv: int  # Bc: keys per KV tile
    warps_q: int = 4  # warps stacked along the query rows; each owns block_q / warps_q rows
    warps_kv: int = 1  # warps along the keys of a tile

    @field_validator("warps_q")
    @classmethod
    def _warps_q(cls, v: int) -> int:
        if not 1 <= v <= 8:
            raise ValueError(rule("tiling.warps_q", v, "must be 1..8 (at most 256 threads a block)", "use 4"))
        return v

    @field_validator("warps_kv")
    @classmethod
    def _warps_kv(cls, v: int) -> int:
        if v != 1:
            raise ValueError(rule(
                "tiling.warps_kv", v,
                "must be 1: splitting a KV tile across warps needs a shared-memory reduction of "
                "the row max and sum on every tile (FlashAttention-1's split-K, slower)",
                "add warps along the queries with warps_q instead"))
        return v

    @field_validator("block_kv")
    @classmethod
    def _block_kv(cls, v: int) -> int:
        if v % MMA_K or not MMA_K <= v <= 256:
            raise ValueError(rule(
                "tiling.block_kv", v,
                "must be a multiple of 16 in 16..256 (P.V consumes keys 16 at a time, the MMA's k)",
                "use 32, 64 or 128"))
        return v

    @model_validator(mode="after")
    def _rows_per_warp(self) -> Tiling:
        rows = self.block_q / self.warps_q
        if self.block_q % (MMA_M * self.warps_q) or not 1 <= rows / MMA_M <= 4:
            good = [MMA_M * self.warps_q * m for m in (1, 2, 3, 4)]
            raise ValueError(rule(
                "tiling.block_q", self.block_q,
                f"must give each of the {self.warps_q} warps 16, 32, 48 or 64 whole rows "
                "(each warp owns m16 MMA fragments of the queries)",
                f"use block_q in {good} or change warps_q"))
        return self


class Pipeline(_Frozen):
    """How K and V tiles travel from global to shared memory."""

    kv_smem: Literal["shared", "separate"] = "shared"
    stages: int = 1  # an int, then a range: Literal[1, 2, 3] would take `true` and `2.0` as equal
    q_in_registers: bool = False
    # sm_90a, two warpgroups: they take turns on the tensor cores, one's softmax running under
    # the other's MMAs (loads for a stage are issued a step later: use stages 3)
    pingpong: bool = False

    @field_validator("stages")
    @classmethod
    def _stages(cls, v: int) -> int:
        if v not in (1, 2, 3):
            raise ValueError(rule("pipeline.stages", v, "must be 1, 2 or 3 (KV tiles in flight per buffer)",
                                  "use 2"))
        return v


MAX_MASK_SPAN = 1 << 28  # positions: a window of 2^28 is unbounded in practice and int32-safe
MaskKind = Literal["none", "causal", "sliding_window", "chunked", "prefix_lm", "document", "block_mask"]
# The fields each mask kind reads (beside kind, align and expression); any other is an error.
MASK_FIELDS = {
    "none": (), "causal": (), "sliding_window": ("window_left", "window_right"), "chunked": ("chunk_size",),
    "prefix_lm": ("prefix_len",), "document": ("causal",), "block_mask": (),
}


def _check_expression(field: str, text: str, variables: dict[str, str], example: str) -> str:
    """Parsed against fagen.expression's allow-list: the text is pasted into the kernel."""
    try:
        expression.check(text, variables)
    except expression.ExpressionError as err:
        raise ValueError(rule(field, text, f"must be one expression over {', '.join(variables)} in fagen's "
                              f"expression language ({err})", f"e.g. {example}")) from None
    return text


class Mask(_Frozen):
    """Which (query, key) pairs count. Rendered into the kernel: tile ranges and full/partial
    status are computed in the kernel from these numbers (block_mask: read from arrays)."""

    kind: MaskKind = "none"
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
        allowed = MASK_FIELDS[self.kind]
        for field in ("window_left", "window_right", "chunk_size", "prefix_len"):
            value = getattr(self, field)
            if value is not None and field not in allowed:
                raise ValueError(rule(f"mask.{field}", value, f"does not apply to mask kind {self.kind!r}",
                                      "remove it, or use the kind it belongs to"))
            low = 0 if field.startswith("window") else 1  # a window may be empty on one side
            if value is not None and not low <= value <= MAX_MASK_SPAN:
                raise ValueError(rule(f"mask.{field}", value, f"must be in {low}..{MAX_MASK_SPAN} (the kernel "
                                      f"does int32 position arithmetic)", "use e.g. 1024"))
        if self.causal and "causal" not in allowed:
            raise ValueError(rule("mask.causal", True, "only refines kind 'document'",
                                  "use kind: causal for plain causal attention"))
        required = {"sliding_window": "window_left", "chunked": "chunk_size", "prefix_lm": "prefix_len"}
        need = required.get(self.kind)
        if need and getattr(self, need) is None:
            raise ValueError(rule(f"mask.{need}", None, f"is required by mask kind {self.kind!r}",
                                  f"set mask.{need}, e.g. 1024"))
        return self

    @field_validator("expression")
    @classmethod
    def _expression(cls, v: str | None) -> str | None:
        return v if v is None else _check_expression("mask.expression", v, expression.MASK_VARIABLES,
                                                     "(q_idx - kv_idx) % 2 == 0")


    def __str__(self) -> str:
        args = [f"{f}={getattr(self, f)}" for f in MASK_FIELDS[self.kind] if getattr(self, f) not in (None, False)]
        if self.align != "bottom_right" and self.kind not in ("none", "block_mask", "document"):
            args.append(self.align)
        text = f"{self.kind}({', '.join(args)})" if args else self.kind
        return text + (" & expr" if self.expression else "")


class ScoreMod(_Frozen):
    """Changes to the scaled score s = q.k * scale before the mask and the softmax, in this order."""

    softcap: float | None = None  # s -> softcap * tanh(s / softcap)
    alibi: Literal["none", "slopes", "geometric"] = "none"  # s -> s - slope_h * |q + offset - k|
    bias: Literal["none", "vector", "matrix"] = "none"  # s -> s + bias[b, h, (q,) k], float32
    expression: str | None = None  # s -> a CUDA float expression over score, b, h, q_idx, kv_idx
    sinks: bool = False  # one learned logit per head joins every row's softmax denominator

    @field_validator("softcap")
    @classmethod
    def _softcap(cls, v: float | None) -> float | None:
        if v is not None and not 1e-3 <= v <= 1e6:
            raise ValueError(rule("score_mod.softcap", v, "must be a finite number in [1e-3, 1e6] (it is a "
                                  "float32 constant in the kernel)", "use e.g. 30.0 (Gemma 2), or remove it"))
        return v

    @field_validator("expression")
    @classmethod
    def _expression(cls, v: str | None) -> str | None:
        return v if v is None else _check_expression("score_mod.expression", v, expression.SCORE_VARIABLES,
                                                     "score * 0.5f")

    @property
    def changes_scores(self) -> bool:
        return self.softcap is not None or self.alibi != "none" or self.bias != "none" or self.expression is not None


class Outputs(_Frozen):
    lse: bool = True
    # split-KV: each block attends to a share of the KV tiles and writes a float32 partial O
    # (normalised over its keys) and its LSE; fagen.splitkv merges partials by LSE
    partial: bool = False

    @model_validator(mode="after")
    def _partial_needs_lse(self) -> Outputs:
        if self.partial and not self.lse:
            raise ValueError(rule("outputs.lse", False, "partials are merged by their LSE", "set lse: true"))
        return self


class AttentionSpec(_Frozen):
    name: str
    dtype: Literal["float16", "bfloat16"]
    head_dim: int
    tiling: Tiling
    pipeline: Pipeline = Pipeline()
    smem_layout: Literal["padded", "swizzled"] = "padded"
    mask: Mask = Mask()
    score_mod: ScoreMod = ScoreMod()
    outputs: Outputs = Outputs()
    arch: Literal["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"] = "sm_80"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        # The kernel symbol is fagen_<name> (plan.KERNEL_SYMBOL_PREFIX): any identifier is safe there
        # except those C++ reserves for the implementation (a double underscore).
        if (not v.isidentifier() or not v.isascii() or v != v.lower() or v.startswith("_") or "__" in v
                or len(v) > MAX_NAME_LENGTH):
            raise ValueError(rule(
                "name", v, f"must be a lowercase C identifier of at most {MAX_NAME_LENGTH} characters, not "
                "starting with '_' or holding '__' (it names the kernel's symbol and file)",
                "use letters, digits and single underscores, e.g. flash_f16_d128"))
        return v

    @field_validator("head_dim")
    @classmethod
    def _head_dim(cls, v: int) -> int:
        if v not in HEAD_DIMS:
            raise ValueError(rule("head_dim", v, f"must be one of {list(HEAD_DIMS)}",
                                  "pad the head dimension up to the next supported size"))
        return v

    @model_validator(mode="after")
    def _swizzle_needs_eight_chunks(self) -> AttentionSpec:
        chunks = self.head_dim // 8
        if self.smem_layout == "swizzled" and chunks % 8 and self.arch != "sm_90a":  # sm_90a: _wgmma_shapes
            raise ValueError(rule(
                "smem_layout", "swizzled",
                f"XORs the 16-byte chunk index with row % 8, so a row needs a multiple of 8 "
                f"chunks; head_dim {self.head_dim} has {chunks}",
                "use smem_layout: padded, or head_dim 64, 128 or 256"))
        return self

    @model_validator(mode="after")
    def _wgmma_shapes(self) -> AttentionSpec:
        """sm_90a kernels are built from whole warpgroups and 128-byte swizzle atoms."""
        if self.arch != "sm_90a":
            if self.pipeline.pingpong:
                raise ValueError(rule("pipeline.pingpong", True, f"needs arch sm_90a (warpgroups taking turns "
                                      f"on wgmma), not {self.arch}", "set arch: sm_90a or pingpong: false"))
            return self
        t, p = self.tiling, self.pipeline
        fix_arch = "or use arch: sm_90 for the mma.sync kernel"
        if t.warps_q % WARPGROUP_WARPS:
            raise ValueError(rule("tiling.warps_q", t.warps_q, "must be 4 or 8 on sm_90a (whole warpgroups of "
                                  "4 warps; wgmma is issued by 128 threads together)", "use 8, " + fix_arch))
        if t.block_q != t.warps_q * MMA_M:
            raise ValueError(rule("tiling.block_q", t.block_q, f"must be 16 * warps_q = {t.warps_q * MMA_M} on "
                                  "sm_90a (a warpgroup owns the 64 rows of one wgmma.m64)",
                                  f"use block_q: {t.warps_q * MMA_M}, " + fix_arch))
        if self.head_dim % SWIZZLE_ATOM_ELEMS:
            raise ValueError(rule("head_dim", self.head_dim, "must be a multiple of 64 on sm_90a (rows are "
                                  "stored in 128-byte swizzle atoms that wgmma reads)", "use 64, 128 or 256, " + fix_arch))
        if self.smem_layout != "swizzled":
            raise ValueError(rule("smem_layout", self.smem_layout, "must be swizzled on sm_90a (wgmma reads "
                                  "128-byte-swizzled tiles)", "set smem_layout: swizzled"))
        if p.kv_smem != "separate" or p.stages < 2:
            raise ValueError(rule("pipeline", f"{p.kv_smem}, stages {p.stages}", "sm_90a needs kv_smem: separate "
                                  "with stages >= 2 (P.V of tile j - 1 runs while tile j's softmax does, and "
                                  "tile j + 1 loads meanwhile)", "use kv_smem: separate, stages: 2"))
        if p.q_in_registers:
            raise ValueError(rule("pipeline.q_in_registers", True, "does not apply on sm_90a (wgmma reads Q "
                                  "from shared memory)", "set q_in_registers: false"))
        if p.pingpong and t.warps_q != 2 * WARPGROUP_WARPS:
            raise ValueError(rule("pipeline.pingpong", True, f"takes two warpgroups (warps_q 8), not warps_q "
                                  f"{t.warps_q}", "use warps_q: 8 and block_q: 128, or pingpong: false"))
        return self

    @property
    def wgmma(self) -> bool:
        return self.arch == "sm_90a"

    @property
    def causal(self) -> bool:
        """Plain causal attention (what fagen.attention's causal=True selects)."""
        return self.mask.kind == "causal"


def _type_fix(e: dict, leaf: str) -> str:
    """The fix for a value of the wrong type: what to write instead, in YAML."""
    given = e.get("input")
    if e["type"] == "literal_error":
        close = difflib.get_close_matches(str(given), re.findall(r"'([^']*)'", e["ctx"]["expected"]), n=1)
        return f"did you mean {close[0]!r}?" if close else "use one of those"
    if e["type"] == "int_type":
        example = given if isinstance(given, str) and given.strip().isdigit() else 2
        return f"write a whole number without quotes, e.g. {leaf}: {str(example).strip()}"
    if e["type"] == "float_type":
        return f"write a number without quotes, e.g. {leaf}: 30.0"
    if e["type"] == "bool_type":
        return f"write true or false without quotes, e.g. {leaf}: true"
    if e["type"] == "string_type":
        return f"write text, e.g. {leaf}: \"...\""
    if e["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"write a mapping of {leaf}'s fields (see specs/ for examples)"
    return "see the README's spec reference"


def _explain(err: ValidationError, source: str) -> str:
    lines = [f"invalid spec {source}:"]
    for e in err.errors():
        loc = [str(p) for p in e["loc"] if not str(p).startswith("function-")]
        where = ".".join(loc)
        msg = e["msg"].removeprefix("Value error, ")
        if not where:  # a rule across fields: its message names them already
            pass
        elif e["type"] == "extra_forbidden":
            msg = f"unknown key {where!r}; remove it or check its spelling"
        elif e["type"] == "missing":
            msg = f"{where} is required; add it (specs/attn_f16_d128.yaml shows every field)"
        elif e["type"] == "value_error":
            msg = msg if where in msg else f"{where} = {e.get('input')!r}: {msg}"
        else:  # the wrong type: pydantic says what it expected, we add what to write
            rule_text = f"must be one of {e['ctx']['expected']}" if e["type"] == "literal_error" else \
                msg[0].lower() + msg[1:]
            msg = f"{where} = {e.get('input')!r}: {rule_text}; {_type_fix(e, loc[-1])}"
        lines.append(f"  - {msg}")
    if len(lines) == 2:  # one broken rule: one line
        return f"{lines[0]} {lines[1].removeprefix('  - ')}"
    return "\n".join(lines)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML lets a repeated key silently win; in a spec two `stages:` lines are a mistake."""


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}: keep one of its lines", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _yaml(text: str, source: str) -> object:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise SpecError(f"spec {source} is not valid YAML: {' '.join(str(err).split())}") from None


def parse_spec(data: dict | str, source: str = "<dict>") -> AttentionSpec:
    """Validate a mapping of fields, or YAML text, into a spec, with the plan's resource rules
    (shared memory, registers) checked too. For a file, use `load_spec(path)`."""
    from fagen.plan import plan  # plan depends on spec; import here keeps the module graph one-way

    if isinstance(data, str):
        data, source = _yaml(data, "<text>" if source == "<dict>" else source), "<text>" if source == "<dict>" else source
    if isinstance(data, Path):
        raise SpecError(f"parse_spec takes a mapping or YAML text, got the path {str(data)!r}; "
                        f"use fagen.load_spec({str(data)!r})")
    if not isinstance(data, dict):
        raise SpecError(f"invalid spec {source}: expected a mapping of fields, got {type(data).__name__}; "
                        f"see specs/attn_f16_d128.yaml for the fields")
    try:
        spec = AttentionSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_explain(err, source)) from None
    try:
        plan(spec)  # smem and register budgets
    except SpecError as err:
        raise SpecError(f"invalid spec {source}: {err}") from None
    return spec


def validated(spec: AttentionSpec) -> AttentionSpec:
    """`spec`, validated again: `model_copy(update=...)` builds a spec without running a rule,
    so every path from a spec to kernel text passes through here."""
    if not isinstance(spec, AttentionSpec):
        raise SpecError(f"expected an AttentionSpec, got {type(spec).__name__}; build one with "
                        f"fagen.load_spec(path) or fagen.parse_spec(mapping or YAML text)")
    return parse_spec(spec.model_dump(), f"{spec.name!r}")


def load_spec(path: str | Path) -> AttentionSpec:
    """The spec in a YAML file; its name must be the file's stem. Mappings and YAML text go
    through `parse_spec`."""
    if not isinstance(path, (str, Path)):
        raise SpecError(f"load_spec takes a path to a YAML file, got {type(path).__name__}; "
                        f"for a mapping or YAML text use fagen.parse_spec")
    if isinstance(path, str) and "\n" in path:
        raise SpecError("load_spec takes a path, and this looks like YAML text; use fagen.parse_spec(text)")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(f"cannot read spec {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise SpecError(f"spec {path} is not UTF-8 text: {err.reason}") from None
    spec = parse_spec(_yaml(text, str(path)), str(path))
    if spec.name != path.stem:
        raise SpecError(rule("name", spec.name, f"must equal the file's stem {path.stem!r} "
                                                "(generated/<name>.cu is rendered from specs/<name>.yaml)",
                             f"rename the file or set name: {path.stem}"))
    return spec
