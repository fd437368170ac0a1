"""Offline compilation with nvcc: resource usage of a rendered kernel, no GPU needed."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fagen.render import render
from fagen.spec import AttentionSpec

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


def targets(spec: AttentionSpec) -> tuple[str, ...]:
    """The archs a shipped spec must compile for: wgmma kernels exist for sm_90a alone."""
    return ("sm_90a",) if spec.wgmma else ("sm_80", "sm_90")


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
