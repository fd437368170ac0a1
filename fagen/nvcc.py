"""Offline compilation with nvcc: resource usage of a rendered kernel, no GPU needed."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fagen.plan import plan
from fagen.render import render
from fagen.spec import SMEM_PER_BLOCK, AttentionSpec

_USAGE = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass(frozen=True)
class Resources:
    arch: str
    registers: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    static_smem: int
    log: str


MMA_SYNC_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")  # oldest first
ARCHS = (*MMA_SYNC_ARCHS, "sm_90a")


def targets(spec: AttentionSpec) -> tuple[str, ...]:
    """The archs a shipped spec must compile for: wgmma kernels exist for sm_90a alone; an
    mma.sync spec builds for its `arch` (the lowest it targets) and for sm_90."""
    return ("sm_90a",) if spec.wgmma else tuple(dict.fromkeys((spec.arch, "sm_90")))


def archs(spec: AttentionSpec) -> tuple[str, ...]:
    """Every arch `spec` may be compiled for: sm_90a alone for a wgmma kernel; otherwise the
    mma.sync archs from the spec's `arch` up whose per-block shared memory holds its plan's."""
    if spec.wgmma:
        return ("sm_90a",)
    smem = plan(spec).smem_bytes
    return tuple(a for a in MMA_SYNC_ARCHS[MMA_SYNC_ARCHS.index(spec.arch):] if SMEM_PER_BLOCK[a] >= smem)


def arch_error(spec: AttentionSpec, arch: str) -> str | None:
    """Why `spec` must not be compiled for `arch` (one line: the rule and a fix), or None."""
    allowed = archs(spec)
    if arch in allowed:
        return None
    use = "use --arch " + (f"{', '.join(allowed[:-1])} or {allowed[-1]}" if len(allowed) > 1 else allowed[0])
    if arch not in ARCHS:
        return f"{arch}: not a target fagen knows (one of {', '.join(ARCHS)}); {use}"
    if spec.wgmma:
        return f"{arch}: {spec.name} is an sm_90a (wgmma) kernel, which exists for sm_90a only; {use}"
    if arch == "sm_90a":
        return (f"{arch}: selects the wgmma kernel, and {spec.name} is an mma.sync spec (arch: {spec.arch}); "
                f"{use}, or set arch: sm_90a in the spec")
    if MMA_SYNC_ARCHS.index(arch) < MMA_SYNC_ARCHS.index(spec.arch):
        return f"{arch}: below the spec's arch {spec.arch} (its lowest target); {use}, or lower arch in the spec"
    return (f"{arch}: a block gets at most {SMEM_PER_BLOCK[arch]} bytes of shared memory there, and "
            f"{spec.name} needs {plan(spec).smem_bytes}; {use}")


def find_nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc not found on PATH: install the CUDA toolkit (fagen compile and the "
                           "compile tests need it)")
    return nvcc


def compile_offline(spec: AttentionSpec, arch: str) -> Resources:
    """nvcc -cubin -arch=ARCH -Xptxas -v on the rendered source; raises with the log on error."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{spec.name}.cu"
        src.write_text(render(spec))
        cmd = [find_nvcc(), "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v",
               "-o", str(Path(tmp) / "k.cubin"), str(src)]
        run = subprocess.run(cmd, capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode:
        raise RuntimeError(f"nvcc failed on {spec.name} for {arch}:\n{log}")
    usage, frame, smem = _USAGE.search(log), _FRAME.search(log), _SMEM.search(log)
    if not (usage and frame):
        raise RuntimeError(f"could not read ptxas -v output for {spec.name}:\n{log}")
    return Resources(arch, int(usage[1]), int(frame[1]), int(frame[2]), int(frame[3]),
                     int(smem[1]) if smem else 0, log)
