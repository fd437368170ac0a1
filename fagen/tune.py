"""`fagen tune`: sweep a spec's tiling and pipeline choices, keep the fastest correct one.

Candidates are every combination the validator accepts (the validator is the pruner: its
smem and register rules drop what cannot fit before anything compiles). Each survivor is
checked against the oracle on a small problem, then timed on the asked shape.
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from fagen import device
from fagen.bench import time_spec
from fagen.nvcc import compile_offline, targets
from fagen.spec import AttentionSpec, SpecError
from fagen.load import parse_spec

SPACE = {
    "block_q": (64, 128),
    "warps_q": (4, 8),
    "block_kv": (32, 64, 128),
    "pipeline": (("shared", 1), ("shared", 2), ("separate", 1), ("separate", 2), ("separate", 3)),
    "smem_layout": ("padded", "swizzled"),
    "q_in_registers": (False, True),
}
# 16 rows a warp (the configurations that win on H100/H200), the common KV tiles and pipelines
QUICK_SPACE = {**SPACE, "block_kv": (32, 64, 128), "pipeline": (("separate", 1), ("separate", 2), ("separate", 3)),
               "q_in_registers": (False,)}


def _quick_keeps(bq: int, wq: int, layout: str, head_dim: int) -> bool:
    """16 rows a warp, swizzled where the head_dim allows it (padded otherwise)."""
    return bq == 16 * wq and layout == ("swizzled" if head_dim % 64 == 0 else "padded")


@dataclass
class Candidate:
    spec: AttentionSpec
    ms: float | None = None
    tflops: float | None = None
    error: str | None = None


def candidates(base: AttentionSpec, quick: bool = False) -> tuple[list[AttentionSpec], int]:
    """Valid variants of `base` over the space (QUICK_SPACE, narrowed, when quick), and how
    many combinations the validator refused."""
    keep, refused = [], 0
    for bq, wq, bkv, (kv_smem, stages), layout, q_regs in itertools.product(*(QUICK_SPACE if quick else SPACE).values()):
        if quick and not _quick_keeps(bq, wq, layout, base.head_dim):
            continue
        data = base.model_dump(mode="json")
        data["tiling"] = {"block_q": bq, "block_kv": bkv, "warps_q": wq}
        data["pipeline"] = {**data["pipeline"], "kv_smem": kv_smem, "stages": stages, "q_in_registers": q_regs}
        data["smem_layout"] = layout
        data["name"] = f"{base.name}_q{bq}w{wq}kv{bkv}_{kv_smem}{stages}_{layout[0]}{'_qreg' if q_regs else ''}"
        try:
            keep.append(parse_spec(data, data["name"]))
        except SpecError:
            refused += 1
    return keep, refused


def tune(base: AttentionSpec, b: int, h: int, nq: int, nk: int, *, quick: bool = False,
         progress=None) -> list[Candidate]:
    """Check and time every candidate; fastest first. `progress(candidate)` after each.
    RuntimeError, before any candidate, where there is no GPU to time them on."""

    why = device.gpu_missing(torch=True)
    if why:
        raise RuntimeError(why)
    specs, _ = candidates(base, quick)
    results = []
    for spec in specs:
        cand = Candidate(spec)
        spills = _spills(spec)
        if spills:
            cand.error = spills  # shipped kernels must compile without spills for every target
            results.append(cand)
            if progress:
                progress(cand)
            continue
        try:
            timing = time_spec(spec, b, h, nq, nk)
            cand.ms, cand.tflops = timing.ms, timing.tflops
        except Exception as err:  # a candidate that fails is reported, not fatal
            cand.error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        results.append(cand)
        if progress:
            progress(cand)
    return sorted(results, key=lambda c: (c.ms is None, c.ms or 0.0))


def _spills(spec: AttentionSpec) -> str | None:
    """Why ptxas spills this candidate (for any arch it ships for), or None; None too without nvcc."""
    if shutil.which("nvcc") is None:
        return None
    for arch in targets(spec):
        r = compile_offline(spec, arch)
        if r.spill_stores or r.stack_frame:
            return f"spills on {arch}: {r.spill_stores} bytes, {r.stack_frame} bytes stack"
    return None


def write_tuned(best: Candidate, base: AttentionSpec, shape: tuple[int, ...], out_dir: Path, slug: str) -> Path:
    """Save the winner as `<base name>_<gpu>.yaml` with the measurement in a comment."""
    name = f"{base.name}_{slug}"
    data = best.spec.model_dump(mode="json", exclude_none=True)
    data["name"] = name
    parse_spec(data, name)
    b, h, nq, nk = shape
    head = (f"# tuned by `fagen tune` on {slug}: B={b} H={h} Nq={nq} Nk={nk}: "
            f"{best.ms:.3f} ms, {best.tflops:.1f} TFLOP/s (checked against the oracle first)\n")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"{name}.yaml"
    path.write_text(head + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    return path
