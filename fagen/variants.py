"""The shipped specs fagen.attention picks from, and the variants it derives from them: other
masks and score modifiers, split-KV partials. Pure: which GPU is a parameter, so CPU tests
derive (and compile) exactly what a GPU would run.
"""

from __future__ import annotations

import hashlib
from functools import cache

from fagen.load import SPECS, load_spec, parse_spec
from fagen.spec import AttentionSpec, Mask, ScoreMod

# GPUs whose tuned specs stand in for one another where only one was tuned (same SM, same smem).
SAME_CHIP = {"h100": "h200", "h200": "h100"}


def default_spec_name(dtype: str, head_dim: int, causal: bool) -> str:
    short = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    return f"attn_{short}_d{head_dim}" + ("_causal" if causal else "")


@cache
def shipped_spec(dtype: str, head_dim: int, causal: bool, *, gpu: str | None, partial: bool = False) -> AttentionSpec:
    """The shipped spec for a dtype and head_dim; the one tuned for `gpu` (from `fagen tune`,
    e.g. gpu "h200") where it exists. partial: the split-KV kernel (`<name>_partial_<gpu>.yaml`
    where shipped, else the untuned tiling made partial: tilings tuned for full outputs can
    spill as partials)."""
    name = default_spec_name(dtype, head_dim, causal)
    suffix = "_partial" if partial else ""
    tuned = SPECS / f"{name}{suffix}_{gpu}.yaml"
    if not tuned.exists() and gpu in SAME_CHIP:  # H100 and H200: one sm_90 chip, different memory
        tuned = SPECS / f"{name}{suffix}_{SAME_CHIP[gpu]}.yaml"
    if partial and not tuned.exists():
        return partial_variant(load_spec(SPECS / f"{name}.yaml"))
    path = tuned if tuned.exists() else SPECS / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"no shipped kernel for dtype {dtype}, head_dim {head_dim}: fagen.attention takes "
                         f"float16 or bfloat16 with head_dim 32, 64, 96, 128 or 256")
    return load_spec(path)


@cache
def variant(base: AttentionSpec, mask: Mask, score_mod: ScoreMod) -> AttentionSpec:
    """`base` with another mask and score modifiers, named after them (deterministically) and
    validated like any spec."""
    if (mask, score_mod) == (base.mask, base.score_mod):
        return base
    tag = hashlib.sha256(repr((mask, score_mod)).encode()).hexdigest()[:10]
    return parse_spec({**base.model_dump(), "name": f"{base.name}_{mask.kind}_{tag}", "mask": mask.model_dump(),
                       "score_mod": score_mod.model_dump()}, f"variant of {base.name}")


def partial_variant(spec: AttentionSpec) -> AttentionSpec:
    """`spec` writing float32 partials (outputs.partial), named <name>_partial."""
    if spec.outputs.partial:
        return spec
    return parse_spec({**spec.model_dump(), "name": f"{spec.name}_partial",
                       "outputs": {**spec.outputs.model_dump(), "partial": True, "lse": True}}, f"partial of {spec.name}")
