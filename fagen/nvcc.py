"""Offline compilation with nvcc: resource usage of a rendered kernel, no GPU needed."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fagen.load import SPECS, load_spec
from fagen.backward_plan import backward_plan, kernel_symbols
from fagen.element_types import KERNEL_TYPES
from fagen.plan import plan
from fagen import expression
from fagen.rendering import expression_trees, render, render_backward
from fagen.spec import HEAD_DIMS, SMEM_PER_BLOCK, AttentionSpec, Mask, ScoreMod
from fagen.variants import LONG_KEYS, shipped_spec, variant

_USAGE = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")
# ptxas's C7520: it fenced wgmma's registers somewhere it could not prove the warpgroup converged,
# and so waits for every wgmma before the next (no MMA overlaps another): a slow kernel, not a wrong one
_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized.*? in the function '(\w+)'")
# the front end's warning and, on the next line, the source line it is about
_WARNING = re.compile(r"^.*\(\d+\): warning\b.*\n(.*)$", re.MULTILINE)
# what _ptxas adds to the log for each kernel of the cubin: its SASS instructions (sass_instructions)
_INSTRUCTIONS = re.compile(r"^fagen: (\w+) has (\d+) SASS instructions$", re.MULTILINE)
SASS_INSTRUCTION_BYTES = 16  # every instruction from sm_70 on


@dataclass(frozen=True)
class Resources:
    arch: str
    registers: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    static_smem: int
    log: str
    wgmma_serialized: bool = False  # ptxas serialised the kernel's wgmmas (C7520)
    # its code's static size (not a count of executed ones): two trees' kernels compared without a
    # GPU or a disassembler, as notes/perf.md's uniform warp index was
    instructions: int = 0


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
    log = _ptxas_log(spec, f"{spec.name}.cu", render(spec), arch)
    return _resources(arch, log, plan(spec).symbol, log)


def _ptxas(file: str, source: str, arch: str) -> tuple[int, str]:
    """nvcc -cubin -Xptxas -v on `source` (written as `file`): its return code and log."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / file
        src.write_text(source)
        cubin = Path(tmp) / "k.cubin"
        cmd = [find_nvcc(), "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", "-o", str(cubin), str(src)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        counts = sass_instructions(cubin.read_bytes()) if run.returncode == 0 else {}
    return run.returncode, run.stdout + run.stderr + "".join(f"fagen: {symbol} has {n} SASS instructions\n"
                                                            for symbol, n in counts.items())


def sass_instructions(cubin: bytes) -> dict[str, int]:
    """Each kernel's SASS instructions in a cubin (an ELF64 file): its `.text.<symbol>` section's
    bytes over SASS_INSTRUCTION_BYTES. Read from the section headers, so no disassembler is needed."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    # a section header: name (an offset into the names section), type, flags, address, offset, size, ...
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entry_size) for i in range(count)]
    names_at = headers[names_index][4]

    def name(header) -> str:
        start = names_at + header[0]
        return cubin[start:cubin.index(b"\0", start)].decode()

    return {n.removeprefix(".text."): h[5] // SASS_INSTRUCTION_BYTES for h in headers
            if (n := name(h)).startswith(".text.")}


def _ptxas_log(spec: AttentionSpec, file: str, source: str, arch: str) -> str:
    """_ptxas's log of one of `spec`'s files; raises with it where nvcc fails or warns on the
    spec's expression."""
    code, log = _ptxas(file, source, arch)
    if code:
        raise RuntimeError(f"nvcc failed on {file} for {arch}:\n{log}")
    _refuse_expression_warnings(spec, arch, log)
    return log


def expression_warnings(spec: AttentionSpec, log: str) -> list[str]:
    """nvcc's warnings on the lines that paste a spec's expression (the template writes each as
    `(<printed tree>);`): there they mean user code C leaves undefined (a division by zero, an
    overflowing constant) that nvcc may compile to anything, so they are errors. (Warnings
    elsewhere are the template's.)"""
    pasted = [f"({expression.cuda(tree)});" for tree in expression_trees(spec).values()]
    return [m[0] for m in _WARNING.finditer(log) if any(text in m[1] for text in pasted)]


def _refuse_expression_warnings(spec: AttentionSpec, arch: str, log: str) -> None:
    if expression_warnings(spec, log):
        raise RuntimeError(f"nvcc warns on the expression of {spec.name} for {arch} (warnings on an expression are "
                           f"errors: fix the expression it names):\n{log}")


def backward_target(spec: AttentionSpec, arch: str) -> str:
    """The arch a spec's backward compiles for when its forward compiles for `arch` (one of
    archs(spec)): the same, but sm_90a's backward on mma.sync main loops (head_dim 256) is an
    sm_90 build, as the runtime compiles it."""
    return "sm_90" if arch == "sm_90a" and not spec.wgmma_backward else arch


def compile_backward(spec: AttentionSpec, arch: str | None = None) -> dict[str, Resources]:
    """nvcc -Xptxas -v on a spec's backward file: each kernel's resources, by role (kernel_symbols)."""
    arch = backward_target(spec, arch or spec.arch)
    plan_ = backward_plan(spec)
    log = _ptxas_log(spec, f"{spec.name}_backward.cu", render_backward(spec), arch)
    entries = _parse_entries(log)
    return {name: _resources(arch, entries[symbol][1], symbol, log) for name, symbol in kernel_symbols(plan_).items()}


@dataclass(frozen=True)
class Kernel:
    """One kernel of a spec's rendered files and what ptxas reported for it."""
    file: str  # "forward" or "backward"
    role: str  # "forward"; the backward's: preprocess, dkdv, dq or postprocess (kernel_symbols)
    symbol: str
    resources: Resources

    @property
    def clean(self) -> bool:
        r = self.resources
        return not (r.spill_stores or r.spill_loads or r.stack_frame)

    @property
    def label(self) -> str:
        return self.file if self.role == self.file else f"{self.file} {self.role}"

    def summary(self) -> str:
        r = self.resources
        return (f"{self.symbol} ({self.label}) {r.arch}: {r.registers} registers, {r.stack_frame} bytes "
                f"stack frame, {r.spill_stores}/{r.spill_loads} bytes spilled (stores/loads), {r.instructions} SASS "
                f"instructions")


def compile_all(spec: AttentionSpec, arch: str) -> list[Kernel]:
    """Every kernel `spec` renders (fagen.rendering.renders): the forward file's, and with a
    `backward:` section the backward file's (preprocess, dK/dV, dQ or postprocess), the backward
    for backward_target(spec, arch). Each entry function ptxas reports is one Kernel, so a kernel
    a template adds is checked too; raises RuntimeError with nvcc's log where it fails."""
    kernels = []
    files = [("forward", render(spec), arch, {plan(spec).symbol: "forward"})]
    if spec.backward is not None:
        roles = {symbol: role for role, symbol in kernel_symbols(backward_plan(spec)).items()}
        files.append(("backward", render_backward(spec), backward_target(spec, arch), roles))
    for file, source, target, roles in files:
        log = _ptxas_log(spec, f"{spec.name}_{file}.cu", source, target)
        entries = _parse_entries(log)
        missing = sorted(set(roles) - set(entries))
        if missing:
            raise RuntimeError(f"ptxas reported no {', '.join(missing)} in {spec.name}'s {file} file:\n{log}")
        kernels += [Kernel(file, roles.get(symbol, "helper"), symbol, _resources(target, lines, symbol, log))
                    for symbol, (_, lines) in entries.items()]
    return kernels


def compile_backward_many(builds: list[tuple[AttentionSpec, str | None]], jobs: int | None = None
                          ) -> list[dict[str, Resources]]:
    """compile_backward of each (spec, arch), one nvcc run each, on every core; specs whose
    backward files differ only in names and comments compile once."""
    def key(build):
        spec, arch = build
        return backward_target(spec, arch or spec.arch), _COMMENT.sub("", render_backward(spec)).replace(spec.name, "")

    keys = [key(b) for b in builds]
    first = {k: b for k, b in zip(reversed(keys), reversed(builds))}  # the first build of each key
    with ThreadPoolExecutor(max_workers=jobs or default_jobs()) as pool:
        found = dict(zip(first, pool.map(lambda build: compile_backward(*build), first.values())))
    return [found[k] for k in keys]


# ---- many kernels at once ------------------------------------------------------------------
# One nvcc run costs ~0.5 s before its first kernel (preprocessing, the front end, process
# start-up) and ~0.4 s a kernel after that, so many kernels compile in one translation unit,
# each rendered kernel in a namespace of its own, and nvcc runs on every core at once.
_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_COMMENT = re.compile(r"(^|\s)//.*$", re.MULTILINE)
_PLACEHOLDER = "FAGEN_KERNEL_SYMBOL"


def kernel_body(spec: AttentionSpec) -> str:
    """The rendered kernel without comments and with a placeholder for its symbol: specs whose
    bodies are equal compile to the same machine code whatever their names."""
    text = _COMMENT.sub("", render(spec))
    text = re.sub(rf"\b{re.escape(plan(spec).symbol)}\b", _PLACEHOLDER, text)
    return "\n".join(line for line in text.splitlines() if line.strip()) + "\n"


def _parse_entries(log: str) -> dict[str, tuple[str, str]]:
    """ptxas -v output of a multi-kernel run: {symbol: (arch, that function's lines)}."""
    marks = list(_ENTRY.finditer(log))
    return {m[1]: (m[2], log[m.start():marks[i + 1].start() if i + 1 < len(marks) else len(log)])
            for i, m in enumerate(marks)}


def _resources(arch: str, log: str, symbol: str, whole_log: str) -> Resources:
    """Kernel `symbol`'s resources from its lines of ptxas -v (`log`); whole_log: the run's, where
    ptxas names the function it serialised before the function's own lines."""
    usage, frame, smem = _USAGE.search(log), _FRAME.search(log), _SMEM.search(log)
    if not (usage and frame):
        raise RuntimeError(f"could not read ptxas -v output for {symbol}:\n{log}")
    instructions = dict(_INSTRUCTIONS.findall(whole_log)).get(symbol, 0)
    return Resources(arch, int(usage[1]), int(frame[1]), int(frame[2]), int(frame[3]),
                     int(smem[1]) if smem else 0, log, symbol in _SERIALIZED.findall(whole_log), int(instructions))


def _compile_bundle(bodies: list[str], arch: str) -> tuple[int, str, list[str]]:
    """nvcc on one translation unit holding `bodies`; (return code, log, their symbols)."""
    symbols = [f"fagen_k{i}" for i in range(len(bodies))]
    unit = "".join(f"namespace fagen_ns{i} {{\n" + body.replace(_PLACEHOLDER, symbols[i])
                   .replace("smem_chunks", f"smem_chunks_{i}") + "}\n"  # extern __shared__ names are global
                   for i, body in enumerate(bodies))
    return (*_ptxas("bundle.cu", unit, arch), symbols)


def default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def compile_many(builds: list[tuple[AttentionSpec, str]], jobs: int | None = None,
                 per_unit: int = 12) -> list[Resources]:
    """Resources of every (spec, arch) in `builds`, in order, as `compile_offline` reports them.
    Specs with equal `kernel_body` compile once; up to `per_unit` kernels share one nvcc run;
    `jobs` runs (default: one a core) go at once. Raises with the log of a kernel that fails."""
    jobs = jobs or default_jobs()
    keys = [(arch, kernel_body(spec)) for spec, arch in builds]
    by_arch: dict[str, list[str]] = {}
    for arch, body in dict.fromkeys(keys):
        by_arch.setdefault(arch, []).append(body)
    units: list[tuple[str, list[str]]] = []
    for arch, bodies in by_arch.items():
        # bodies dealt round-robin, longest first: the units of an arch take about equal time
        n = max(1, min(len(bodies), max(-(-len(bodies) // per_unit), jobs)))
        ordered = sorted(bodies, key=len, reverse=True)
        units += [(arch, ordered[i::n]) for i in range(n)]
    units.sort(key=lambda u: -sum(map(len, u[1])))  # largest first: the pool ends together

    carriers = {key: spec for (spec, _), key in zip(builds, keys)}

    def run(unit: tuple[str, list[str]]) -> dict[tuple[str, str], Resources]:
        arch, bodies = unit
        code, log, symbols = _compile_bundle(bodies, arch)
        warned = any(expression_warnings(carriers[arch, body], log) for body in bodies)
        if code or warned:
            if len(bodies) > 1:  # find the culprit: each on its own
                return {k: v for body in bodies for k, v in run((arch, [body])).items()}
            what = "failed" if code else "warns on a spec's expression (warnings on an expression are errors)"
            raise RuntimeError(f"nvcc {what} for {arch}:\n{log}\n--- source ---\n{bodies[0]}")
        entries = _parse_entries(log)
        return {(arch, body): _resources(arch, entries.get(sym, ("", log))[1], sym, log)
                for body, sym in zip(bodies, symbols)}

    found: dict[tuple[str, str], Resources] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for part in pool.map(run, units):
            found.update(part)
    return [found[k] for k in keys]


# ---- the kernels fagen.attention can build ----------------------------------------------------
# Mask parameters are compile-time constants; these stand for any value (not powers of two, so
# the divisions stay divisions).
ATTENTION_MASKS = (
    {"kind": "none"}, {"kind": "sliding_window", "window_left": 1000, "window_right": 0},
    {"kind": "chunked", "chunk_size": 1000}, {"kind": "prefix_lm", "prefix_len": 1000},
    {"kind": "document"}, {"kind": "document", "causal": True}, {"kind": "block_mask"},
)
SOFTCAP = 30.0


def score_mods() -> list[dict]:
    """Every score-modifier combination fagen.attention passes (softcap, alibi_slopes, bias, sinks)."""
    return [{"softcap": cap, "alibi": alibi, "bias": bias, "sinks": sinks}
            for cap in (None, SOFTCAP) for alibi in ("none", "slopes")
            for bias in ("none", "vector", "matrix") for sinks in (False, True)]


# The GPUs whose defaults differ: None (no tuned spec: the generic attn_* specs, arch sm_80, as an
# A100 runs them) and "h200" (an H100 or H200: the tuned sm_90a specs, and the generic d32 and
# d96 ones, which have no sm_90a spec, compiled for sm_90).
ATTENTION_GPUS = {None: "sm_80", "h200": "sm_90"}


def attention_defaults(gpu: str | None, classes: tuple[int | None, ...] = (None, LONG_KEYS)) -> list[tuple[AttentionSpec, str]]:
    """(spec, arch it is compiled for) of every default fagen.attention picks on `gpu`
    (fagen.variants.shipped_spec): dtype x head_dim x causal x shape class (keys: None for all
    lengths, LONG_KEYS for the long class; training takes the first alone)."""
    specs = [shipped_spec(dt, d, causal, gpu=gpu, keys=keys) for dt in KERNEL_TYPES for d in HEAD_DIMS
             for causal in (False, True) for keys in classes]
    specs = list(dict.fromkeys(specs))  # a shape class without a spec of its own is the first
    return [(s, "sm_90a" if s.wgmma else ATTENTION_GPUS[gpu]) for s in specs]


def attention_variants(base: AttentionSpec, masks=None, mods=None) -> list[AttentionSpec]:
    """What fagen.attention derives from a default (fagen.variants.variant): a causal default takes
    the causal mask alone, the others every other kind; each with every modifier combination."""

    if masks is None:
        masks = ({"kind": "causal"},) if base.mask.kind == "causal" else ATTENTION_MASKS
    return [variant(base, Mask(**m), ScoreMod(**s)) for m in masks for s in (mods or score_mods())]
