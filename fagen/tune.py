"""`fagen tune`: sweep a spec's tiling and pipeline choices, keep the fastest correct one.

Candidates are every combination the validator accepts (the validator is the pruner: its
smem and register rules drop what cannot fit before anything compiles). Each survivor is
checked against the oracle on a small problem, then timed on the asked shape.

`fagen tune --backward` sweeps the backward: section instead (the forward's tiling stays the
spec's, and so do its deterministic and bias_grad choices, which change what it computes, not
how fast): timed is the backward alone, given the forward's out and LSE, at 2.5x the forward's
FLOPs (the FlashAttention papers' convention).
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from fagen import device, mask_kinds
from fagen.backward import compile_backward as compile_gradients
from fagen.bench import time_spec
from fagen.bench_cases import HIDDEN, TOKENS
from fagen.check import check_backward_against_oracle, random_extras, random_inputs, time_ms
from fagen.nvcc import compile_backward, compile_offline, targets
from fagen.spec import WARPGROUP_WARPS, AttentionSpec, SpecError, WarpSpecialized, most_consumer_registers
from fagen.load import parse_spec
from fagen.variants import LONG_KEYS

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


# sm_90a: whole warpgroups (64 rows each), swizzled rings of K and V tiles; the kernel family is a
# choice too (every thread copying with cp.async, or warp-specialised: a TMA producer warp, the
# consumers at the most registers beside it: 240 for two consumer warpgroups, 160 for three), with
# ping-pong on or off and KV tiles that are not powers of two (80 at head_dim 256, 176 at 128: what
# the consumers' freed registers fit).
WGMMA_SPACE = {"warps_q": (4, 8, 12), "block_kv": (64, 80, 128, 176, 192), "stages": (2, 3), "pingpong": (False, True),
               "warp_specialized": (False, True)}
QUICK_WGMMA_SPACE = {**WGMMA_SPACE, "warps_q": (8, 12)}


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
    if base.wgmma:
        return wgmma_candidates(base, quick)
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


def wgmma_candidates(base: AttentionSpec, quick: bool = False) -> tuple[list[AttentionSpec], int]:
    """candidates() for an sm_90a base, over WGMMA_SPACE (QUICK_WGMMA_SPACE when quick)."""
    keep, refused = [], 0
    for wq, bkv, stages, pingpong, ws in itertools.product(*(QUICK_WGMMA_SPACE if quick else WGMMA_SPACE).values()):
        data = base.model_dump(mode="json")
        data["tiling"] = {"block_q": 16 * wq, "block_kv": bkv, "warps_q": wq}
        consumers = wq // WARPGROUP_WARPS
        data["pipeline"] = {"kv_smem": "separate", "stages": stages, "pingpong": pingpong,
                            "warp_specialized": {"consumer_registers": most_consumer_registers(
                                consumers, WarpSpecialized().producer_registers)} if ws else None}
        data["name"] = f"{base.name}_q{16 * wq}kv{bkv}_s{stages}{'_pp' if pingpong else ''}{'_ws' if ws else ''}"
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
    confirm(results, lambda c: time_spec(c.spec, b, h, nq, nk).ms)
    return sorted(results, key=lambda c: (c.ms is None, c.ms or 0.0))


# ---- the tile scheduler: a choice over a shape class ---------------------------------------------
# A persistent kernel (pipeline.warp_specialized.persistent) hides each tile's prologue and
# epilogue under the last one's work, which short sequences need, but walks its tiles in a fixed
# order, which long causal ones balance worse than the hardware's own block order. So it is chosen
# over a class of shapes, not at the sweep's one: the sweep's winner is timed with either scheduler
# at SCHEDULER_LENGTHS (the bench's shapes: bench_cases.TOKENS = B * N, HIDDEN = H * d)
# and the one with the larger geometric mean of TFLOP/s is kept. The two differ by a few percent
# where run-to-run drift on the H200 is as large (the same kernel timed twice in one process:
# 446 and 399 TF/s at d64 causal 16k), so each is timed SCHEDULER_ROUNDS times in alternating
# order and its median kept, as the sweep's confirm step does.
SCHEDULER_LENGTHS = (512, 1024, 4096, 16384)
SCHEDULER_ROUNDS = 3
# ... and persistent kept only where its geometric mean is ahead by more than that drift: a block a
# tile is the simpler launch, and the hardware's own order balances uneven tiles
SCHEDULER_MARGIN = 1.03


@dataclass
class SchedulerChoice:
    spec: AttentionSpec  # the winner, with the scheduler chosen
    grid: tuple[float, ...]  # TFLOP/s at `lengths`, a block a tile
    persistent: tuple[float, ...]  # ... one block an SM walking the tiles
    lengths: tuple[int, ...] = SCHEDULER_LENGTHS

    def summary(self) -> str:
        chosen = "persistent" if self.spec.pipeline.warp_specialized.persistent else "a block a tile"
        rates = ", ".join(f"N={n}: {g:.0f} / {p:.0f}" for n, g, p in zip(self.lengths, self.grid, self.persistent))
        return (f"scheduler: {chosen} (TFLOP/s a block a tile / persistent, B*N={TOKENS}, "
                f"H*d={HIDDEN}: {rates}; geometric means {_geomean(self.grid):.1f} / "
                f"{_geomean(self.persistent):.1f}; persistent needs {SCHEDULER_MARGIN:.2f}x)")


def _geomean(rates: tuple[float, ...]) -> float:
    return float(np.exp(np.mean(np.log(rates))))


def with_scheduler(spec: AttentionSpec, persistent: bool) -> AttentionSpec:
    """spec (warp-specialised) with a block a tile, or persistent."""
    data = spec.model_dump(mode="json")
    data["pipeline"]["warp_specialized"]["persistent"] = persistent
    return parse_spec(data, spec.name)


def scheduler_lengths(long: bool) -> tuple[int, ...]:
    """The lengths a scheduler is chosen over: all of SCHEDULER_LENGTHS, or a long class's."""
    return tuple(n for n in SCHEDULER_LENGTHS if n >= LONG_KEYS) if long else SCHEDULER_LENGTHS


def choose_scheduler(spec: AttentionSpec, time=time_spec, lengths: tuple[int, ...] = SCHEDULER_LENGTHS) -> SchedulerChoice:
    """Time `spec` with either tile scheduler over `lengths`, SCHEDULER_ROUNDS times in
    alternating order (time(spec, b, h, nq, nk, check=...) -> a Timing; check: against the
    oracle, each kernel's first time), and keep the faster by geometric mean of the medians."""
    candidates = {persistent: with_scheduler(spec, persistent) for persistent in (False, True)}
    samples: dict[tuple[bool, int], list[float]] = {}
    for round_ in range(SCHEDULER_ROUNDS):
        for persistent in ((False, True) if round_ % 2 == 0 else (True, False)):
            for n in lengths:
                timing = time(candidates[persistent], max(1, TOKENS // n),
                              max(1, HIDDEN // spec.head_dim), n, n,
                              check=round_ == 0 and n == lengths[0])
                samples.setdefault((persistent, n), []).append(timing.tflops)
    rates = {p: tuple(float(np.median(samples[(p, n)])) for n in lengths) for p in (False, True)}
    best = _geomean(rates[True]) > SCHEDULER_MARGIN * _geomean(rates[False])
    return SchedulerChoice(candidates[best], rates[False], rates[True], lengths)


# The first pass ranks; its leaders are timed again in alternating order, their median kept: a
# single pass in a fixed order favoured later candidates by 6-11% on the H100 (clocks ramping
# up), where an interleaved A/B of the same two found 0-3% (notes/perf.md).
CONFIRM_LEADERS, CONFIRM_ROUNDS = 4, 4


def confirm(results: list[Candidate], time_again) -> None:
    """Re-time the first pass's CONFIRM_LEADERS fastest CONFIRM_ROUNDS times each, alternating
    their order, and keep each one's median (TFLOP/s scaled to it); time_again(candidate) -> ms."""
    leaders = sorted((c for c in results if c.ms is not None), key=lambda c: c.ms)[:CONFIRM_LEADERS]
    samples = {id(c): [c.ms] for c in leaders}
    for round_ in range(CONFIRM_ROUNDS):
        for c in (leaders if round_ % 2 else leaders[::-1]):
            samples[id(c)].append(time_again(c))
    for c in leaders:
        ms = float(np.median(samples[id(c)]))
        c.tflops, c.ms = (c.tflops * c.ms / ms if c.tflops else None), ms


def _spills(spec: AttentionSpec) -> str | None:
    """Why ptxas spills this candidate (for any arch it ships for), or None; None too without nvcc."""
    if shutil.which("nvcc") is None:
        return None
    for arch in targets(spec):
        r = compile_offline(spec, arch)
        if r.spill_stores or r.stack_frame:
            return f"spills on {arch}: {r.spill_stores} bytes, {r.stack_frame} bytes stack"
    return None


# ---- the backward -------------------------------------------------------------------------------
# (block_kv, warps, head_split): the dK/dV kernel's keys and warps (wgmma: 64 keys a warpgroup,
# head_dim not split); then queries a step, Q/dO stages, and the dQ kernel's (dq_block_q,
# dq_block_kv, dq_warps), which atomic dQ does not run.
BACKWARD_SPACE = {
    "keys": ((128, 8, 1), (64, 4, 1), (128, 4, 1), (64, 8, 2)),
    "block_q": (16, 32, 64, 128),
    "stages": (1, 2, 3),
    "dq": ((64, 64, 4), (64, 32, 4), (64, 128, 4), (128, 64, 8)),
}
QUICK_BACKWARD_SPACE = {"keys": ((128, 8, 1), (64, 8, 2)), "block_q": (32, 64, 128), "stages": (2, 3),
                        "dq": ((64, 64, 4), (64, 32, 4))}


def backward_candidates(base: AttentionSpec, quick: bool = False) -> tuple[list[AttentionSpec], int]:
    """Valid backward tilings of `base` (its forward as is), and how many the validator refused.
    Atomic dQ runs no dQ kernel: its candidates differ in the dK/dV kernel only."""
    own = base.backward
    keep, refused, seen = [], 0, set()
    for (bkv, warps, split), bq, stages, (dqq, dqkv, dqw) in itertools.product(
            *(QUICK_BACKWARD_SPACE if quick else BACKWARD_SPACE).values()):
        data = base.model_dump(mode="json")
        data["backward"] = {"block_kv": bkv, "warps": warps, "head_split": split, "block_q": bq, "stages": stages,
                            "dq_block_q": dqq, "dq_block_kv": dqkv, "dq_warps": dqw,
                            "deterministic": own.deterministic if own else False,
                            "bias_grad": own.bias_grad if own else False, "mma": own.mma if own else None}
        data["name"] = f"{base.name}_bwd_kv{bkv}w{warps}s{split}_q{bq}_st{stages}_dq{dqq}x{dqkv}w{dqw}"
        try:
            spec = parse_spec(data, data["name"])
        except SpecError:
            refused += 1
            continue
        runs = (bkv, warps, split, bq, stages) + (() if spec.atomic_dq else (dqq, dqkv, dqw))
        if runs not in seen:
            seen.add(runs)
            keep.append(spec)
    return keep, refused


def tune_backward(base: AttentionSpec, b: int, h: int, nq: int, nk: int, *, quick: bool = False,
                  progress=None) -> list[Candidate]:
    """Check and time every backward candidate on one set of inputs, then its leaders again
    (`confirm`); fastest first (as `tune`)."""
    why = device.gpu_missing(torch=True)
    if why:
        raise RuntimeError(why)
    inputs = BackwardInputs(base, b, h, nq, nk)
    results, runs = [], {}
    for spec in backward_candidates(base, quick)[0]:
        cand = Candidate(spec)
        cand.error = _backward_spills(spec)  # as shipped kernels: no spills
        if cand.error is None:
            try:
                runs[spec.name] = inputs.run(spec)
                cand.ms = time_ms(runs[spec.name], warmup=10, iters=30)
                cand.tflops = inputs.flops / cand.ms / 1e9
            except Exception as err:  # a candidate that fails is reported, not fatal
                cand.error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        results.append(cand)
        if progress:
            progress(cand)
    confirm(results, lambda c: time_ms(runs[c.spec.name], warmup=3, iters=30))
    return sorted(results, key=lambda c: (c.ms is None, c.ms or 0.0))


class BackwardInputs:
    """One problem every candidate of a base spec runs on (MHA, fresh random inputs and side
    inputs, the forward's out and LSE): candidates share the forward, so it runs once. FLOPs:
    2.5x the forward's 4 d per kept (q, k) pair."""

    def __init__(self, base: AttentionSpec, b: int, h: int, nq: int, nk: int):
        self.shape = (b, h, nq, nk)
        self.q, self.k, self.v, _ = random_inputs("torch", base.dtype, b, h, h, nq, nk, base.head_dim)
        self.dout, self.dq, self.dk, self.dv = random_inputs("torch", base.dtype, b, h, h, nq, nk, base.head_dim)
        self.extras = random_extras(base, b, h, nq, nk)
        self.flops = 2.5 * 4 * b * h * base.head_dim * kept_pairs(base, nq, nk)
        self.out = self.lse = None

    def run(self, spec: AttentionSpec):
        """spec's backward on these inputs, as a function to time, once it passed the float64
        oracle on a smaller problem (AssertionError if not)."""
        b, h, nq, nk = self.shape
        check = check_backward_against_oracle(spec, 1, 2, 2, min(nq, 777), min(nk, 777), framework="torch")
        if not check.passed:
            raise AssertionError(f"refusing to time a wrong kernel: {check.summary()}")
        backward = compile_gradients(spec)
        if self.out is None:
            self.out, self.lse = backward.forward(self.q, self.k, self.v, return_lse=True, **self.extras)
        return lambda: backward(self.dout, self.q, self.k, self.v, self.out, self.lse, dq=self.dq, dk=self.dk,
                                dv=self.dv, **self.extras)


def kept_pairs(spec: AttentionSpec, nq: int, nk: int) -> int:
    """(q, k) pairs a static mask kind keeps (its NumPy `keep`); every pair for the kinds whose
    pattern comes in an array (documents, block masks) or from an expression alone."""
    kind = mask_kinds.KINDS[spec.mask.kind]
    if kind.side_input is not None:
        return nq * nk
    off = nk - nq if spec.mask.align == "bottom_right" else 0
    return int(kind.keep(spec.mask, np.arange(nq)[:, None], np.arange(nk)[None, :], off, None).sum())


def _backward_spills(spec: AttentionSpec) -> str | None:
    """Why ptxas spills a kernel of spec's backward, or None; None too without nvcc."""
    if shutil.which("nvcc") is None:
        return None
    for kernel, r in compile_backward(spec).items():
        if r.spill_stores or r.stack_frame:
            return f"{kernel} spills: {r.spill_stores} bytes, {r.stack_frame} bytes stack"
    return None


def tuned_name(base: AttentionSpec, slug: str, long: bool = False) -> str:
    """`<base>_<gpu>`, or for the long shape class `<base>_long_<gpu>` (fagen.variants.LONG_KEYS);
    a spec already tuned for this GPU keeps its name (tuning its backward into the file that holds
    its tuned forward)."""
    name = base.name.removesuffix(f"_{slug}").removesuffix("_long")
    return f"{name}{'_long' if long or base.name.endswith(f'_long_{slug}') else ''}_{slug}"


def write_tuned(best: Candidate, base: AttentionSpec, shape: tuple[int, ...], out_dir: Path, slug: str,
                backward: bool = False, notes: tuple[str, ...] = (), long: bool = False) -> Path:
    """Save the winner as `<base name>_<gpu>.yaml` with the measurement (and `notes`, e.g. the
    scheduler's choice) in comments. A backward tuned into an existing file keeps that file's
    comments (its forward's measurement)."""
    name = tuned_name(base, slug, long)
    data = best.spec.model_dump(mode="json", exclude_none=True)
    data["name"] = name
    parse_spec(data, name)
    b, h, nq, nk = shape
    what = "fagen tune --backward" if backward else "fagen tune"
    head = (f"# tuned by `{what}` on {slug}: B={b} H={h} Nq={nq} Nk={nk}: {best.ms:.3f} ms, "
            f"{best.tflops:.1f} TFLOP/s{' backward alone' if backward else ''} (checked against the oracle first)\n"
            + "".join(f"# {note}\n" for note in notes))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"{name}.yaml"
    if backward and path.exists():
        kept = [line for line in path.read_text().splitlines(keepends=True)
                if line.startswith("#") and "fagen tune --backward" not in line]
        head = "".join(kept) + head
    path.write_text(head + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    return path
