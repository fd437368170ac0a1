"""Run a kernel on the GPU against the float64 oracle: fresh random inputs, NaN-poisoned
output, relative error under a per-dtype tolerance, then (optionally) a timing.

Shared by `fagen check` and the GPU tests, so both prove kernels the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from contextlib import contextmanager
from functools import cache

import numpy as np

from fagen import masks, oracle
from fagen.device import cupy
from fagen.element_types import ELEMENT_TYPES, KERNEL_TYPES
from fagen.backward import compile_backward
from fagen.runtime import compile_kernel
from fagen.spec import AttentionSpec
from fagen.splitkv import merge

# ||out - ref|| / ||ref||. The oracle sees the same rounded inputs, so the error is P's
# rounding to the MMA input type plus f32 accumulation: ~2^-11 for float16, ~2^-8 for bfloat16.
OUT_TOLERANCE = {name: ELEMENT_TYPES[name].tolerance for name in KERNEL_TYPES}  # (element_types)
LSE_TOLERANCE = 1e-4


@dataclass
class CheckResult:
    name: str
    shape: tuple[int, ...]
    out_error: float
    lse_error: float
    out_tolerance: float
    ms: float | None = None
    flops: float = 0.0

    @property
    def passed(self) -> bool:
        return self.out_error <= self.out_tolerance and self.lse_error <= LSE_TOLERANCE

    def summary(self) -> str:
        b, hq, hkv, nq, nk = self.shape
        text = (f"{self.name} B={b} Hq={hq} Hkv={hkv} Nq={nq} Nk={nk}: rel err out {self.out_error:.2e} "
                f"(tol {self.out_tolerance:.0e}), lse {self.lse_error:.2e} (tol {LSE_TOLERANCE:.0e}) "
                f"{'PASS' if self.passed else 'FAIL'}")
        if self.ms is not None:
            text += f"; {self.ms:.3f} ms, {self.flops / self.ms / 1e9:.1f} TFLOP/s"
        return text


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref||; NaN or a mismatch of infinities counts as an infinite error."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if np.isnan(out).any():
        return float("inf")
    inf = np.isinf(ref)
    if (np.isinf(out) != inf).any() or (out[inf] != ref[inf]).any():
        return float("inf")
    num, den = np.linalg.norm(out[~inf] - ref[~inf]), np.linalg.norm(ref[~inf])
    return float(num / den) if den > 0 else float(num)


def attention_flops(b: int, h: int, nq: int, nk: int, d: int, causal: bool) -> float:
    """4 B H Nq Nk d (two matmuls of 2 Nq Nk d each), halved for causal."""
    return 4.0 * b * h * nq * nk * d / (2.0 if causal else 1.0)


def random_inputs(framework: str, dtype: str, b: int, hq: int, hkv: int, nq: int, nk: int, d: int,
                  layout: str = "bhnd", seed: int | None = None, d_v: int | None = None):
    """q, k, v and a NaN-filled out as views of shape [B, H, N, d] (v and out d_v wide where
    given); layout says how they sit in memory: "bhnd" contiguous, "bnhd" a transposed [B, N, H, d]
    buffer."""
    d_v = d if d_v is None else d_v
    if framework == "torch":
        import torch

        gen = torch.Generator(device="cuda")
        gen.manual_seed(int(np.random.default_rng(seed).integers(2**62)))

        def make(h, n, fill=None, d=d):
            shape = (b, h, n, d) if layout == "bhnd" else (b, n, h, d)
            if fill is not None:
                x = torch.full(shape, fill, dtype=getattr(torch, dtype), device="cuda")
            else:
                x = torch.randn(shape, generator=gen, device="cuda").to(getattr(torch, dtype))
            return x if layout == "bhnd" else x.transpose(1, 2)
    else:
        if not ELEMENT_TYPES[dtype].in_cupy:
            raise ValueError(f"CuPy has no {dtype}: pass PyTorch tensors for {dtype}")
        rng = cupy.random.default_rng(seed)

        def make(h, n, fill=None, d=d):
            shape = (b, h, n, d) if layout == "bhnd" else (b, n, h, d)
            x = cupy.full(shape, fill, dtype=cupy.float16) if fill is not None else \
                rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
            return x if layout == "bhnd" else x.transpose(0, 2, 1, 3)

    return make(hq, nq), make(hkv, nk), make(hkv, nk, d=d_v), make(hq, nq, fill=float("nan"), d=d_v)


def _nan_like(ref, shape):
    """A float32 array of NaN in ref's framework and device."""
    if type(ref).__module__.startswith("torch"):
        import torch

        return torch.full(shape, float("nan"), dtype=torch.float32, device=ref.device)
    return cupy.full(shape, cupy.nan, dtype=cupy.float32)


def to_numpy(x) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        return x.detach().float().cpu().numpy()
    return x.get().astype(np.float32)


# nvbench's blocking kernel: one thread sleeps until the host releases it through a flag in
# pinned host memory (its pointer is the device's too, under unified addressing), or a timeout
# passes (a call that waits for the stream would otherwise wait for the hold for ever)
HOLD_TIMEOUT_S = 0.5
HOLD = r"""
extern "C" __global__ void fagen_hold(const volatile int* release, unsigned long long timeout_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (*release == 0 && now - start < timeout_ns);
}
"""


@contextmanager
def stream_held():
    """Work enqueued on the current stream inside the block starts only after it ends (or after
    HOLD_TIMEOUT_S): the host gets ahead of the GPU by the whole block."""
    memory, release = _hold_release()
    release[0] = 0
    _hold_kernel()((1,), (1,), (memory.ptr, np.uint64(int(HOLD_TIMEOUT_S * 1e9))))
    try:
        yield
    finally:
        release[0] = 1


@cache
def _hold_kernel():
    return cupy.RawKernel(HOLD, "fagen_hold")


@cache
def _hold_release():
    memory = cupy.cuda.alloc_pinned_memory(4)
    return memory, np.frombuffer(memory, np.int32, 1)


def time_ms(fn, warmup: int = 5, iters: int = 30) -> float:
    """Median of CUDA-event timings of fn() on the current stream, after warm-up: the GPU time of
    a call. The timed calls queue behind a kernel that holds the stream until the host has
    enqueued them all (nvbench's blocking kernel), then run back to back: a call whose host work
    outlasts its kernels would otherwise time the host, by turns (host time a call is measured on
    its own: `fagen bench --serving`)."""
    for _ in range(warmup):
        fn()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)]
    with stream_held():
        for start, stop in events:
            start.record()
            fn()
            stop.record()
    events[-1][1].synchronize()
    return float(np.median([cupy.cuda.get_elapsed_time(start, stop) for start, stop in events]))


# CUDA-graph timing (fagen.bench_serving, fagen.bench_fp8): a graph of REPS calls, REPLAYS timed replays
REPS, REPLAYS = 10, 9
# Untimed replays before the timed ones, until this much GPU time has passed: a case's first
# measurement follows host work (the float32 reference, its copy to the host) that leaves the
# GPU idle, and its clocks take milliseconds to come back (H200: the first graph of a decode step
# after the reference ran 9-10% slow, the next ones at speed; the peers, timed after it, did not pay)
WARM_MS = 25.0


def in_a_cuda_graph(fn, calls: int = 1):
    """(graph, the last call's outputs): fn run three times on a side stream first (compiles,
    caches, allocations outside the capture), then `calls` calls of it captured on a CUDA graph."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            outputs = fn()
    return graph, outputs


def _captured(fn):
    """A CUDA graph of REPS calls of fn, replayed untimed for WARM_MS."""
    graph, _ = in_a_cuda_graph(fn, REPS)
    warm_for(graph.replay, WARM_MS)
    return graph


def warm_for(fn, ms: float) -> None:
    """fn() until `ms` of GPU time has passed: the clocks a timing then sees are fn's own, not
    those the host's work or the last arm left."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        fn()
        end.record()
        end.synchronize()
        if start.elapsed_time(end) >= ms:
            return


def _replay_us(graph) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with stream_held():  # the replay is enqueued whole before its start event runs: GPU time only
        start.record()
        graph.replay()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / REPS


def graph_us(fn) -> float:
    """GPU microseconds a call of fn: a CUDA graph of REPS calls, the median of REPLAYS replays
    after WARM_MS of untimed ones."""
    graph = _captured(fn)
    return float(np.median([_replay_us(graph) for _ in range(REPLAYS)]))


def interleaved_us(*fns) -> list[float]:
    """graph_us of each fn, their replays taken in turns (each round starting one further on):
    arms compared with each other see the same clocks, where one after the other a kernel at the
    GPU's power cap read 3-8% apart from run to run (H200)."""
    graphs = [_captured(fn) for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for r in range(REPLAYS):
        for i in range(len(graphs)):
            at = (r + i) % len(graphs)
            times[at].append(_replay_us(graphs[at]))
    return [float(np.median(t)) for t in times]


def random_extras(spec: AttentionSpec, b: int, hq: int, nq: int, nk: int, seed: int | None = None) -> dict:
    """Host (NumPy) side inputs a spec's mask and modifiers need, drawn fresh: a random block
    mask with every block type, packed documents of random lengths, a bias, sinks, slopes."""
    rng = np.random.default_rng(seed)
    extras: dict = {}
    if spec.mask.kind == "block_mask":
        sizes = [16, 32, 64, 128] if nq * nk <= 300_000 else [64, 128]  # small blocks: many Python-built blocks
        q_block, kv_block = (int(rng.choice(sizes)) for _ in range(2))
        extras["block_mask"] = random_block_mask(rng, b, hq, nq, nk, q_block, kv_block)
    if spec.mask.kind == "document":  # each batch row its own packing
        rows = []
        for _ in range(b):
            cuts = np.sort(rng.choice(np.arange(1, nk), size=min(7, nk - 1), replace=False)) if nk > 1 else []
            rows.append(np.searchsorted(cuts, np.arange(nk), side="right"))
        extras["doc_ids"] = np.stack(rows).astype(np.int32)
    if spec.score_mod.bias == "vector":
        extras["bias"] = rng.standard_normal((b, 1, nk)).astype(np.float32)
    elif spec.score_mod.bias == "matrix":
        extras["bias"] = rng.standard_normal((1, hq, nq, nk)).astype(np.float32)
    if spec.score_mod.alibi == "slopes":
        extras["alibi_slopes"] = rng.uniform(0.01, 0.5, hq).astype(np.float32)
    if spec.score_mod.sinks:
        extras["sinks"] = rng.uniform(-1.0, 3.0, hq).astype(np.float32)
    return extras


def random_block_mask(rng: np.random.Generator, b: int, h: int, nq: int, nk: int, q_block: int, kv_block: int):
    """Each (b, h, block) at random one of: masked, full, causal diagonal, random pattern."""
    qi, ki = np.arange(nq)[:, None], np.arange(nk)[None, :]
    dense = np.zeros((b, h, nq, nk), bool)
    n_qb, n_kb = -(-nq // q_block), -(-nk // kv_block)
    choice = rng.integers(0, 4, (b, h, n_qb, n_kb))
    noise = rng.random((b, h, nq, nk)) < 0.5
    causal = ki <= qi + (nk - nq)
    for t, pattern in ((1, np.ones((nq, nk), bool)), (2, causal)):
        sel = np.repeat(np.repeat(choice == t, q_block, 2), kv_block, 3)[:, :, :nq, :nk]
        dense |= sel & pattern
    sel = np.repeat(np.repeat(choice == 3, q_block, 2), kv_block, 3)[:, :, :nq, :nk]
    dense |= sel & noise
    return masks.from_dense(dense, q_block, kv_block, causal_offset=nk - nq)


def check_against_oracle(spec: AttentionSpec, b: int, hq: int, hkv: int, nq: int, nk: int, *,
                         framework: str | None = None, layout: str = "bhnd", seed: int | None = None,
                         scale: float | None = None, time_it: bool = False, extras: dict | None = None) -> CheckResult:
    """extras: side inputs (block_mask, doc_ids, bias, alibi_slopes, sinks) as NumPy arrays,
    drawn by random_extras when not given. The oracle reads the spec's mask and score_mod
    whole, their expressions included."""

    if spec.element.is_fp8 or spec.fp8_kv:
        raise ValueError(f"{spec.name}: FP8 inputs need descales and an oracle that rounds as the kernel does; its "
                         f"checks are tests/test_gpu_fp8.py and tests/test_gpu_fp8_kv.py (fagen.attention on float8 "
                         f"tensors), not this half-type check")
    if framework is None:
        framework = "cupy" if spec.element.in_cupy else "torch"
    kernel = compile_kernel(spec)
    q, k, v, out = random_inputs(framework, spec.dtype, b, hq, hkv, nq, nk, spec.head_dim, layout, seed, spec.dv)
    extras = random_extras(spec, b, hq, nq, nk, seed) if extras is None else extras
    with_lse = spec.outputs.lse
    if spec.outputs.partial and not spec.outputs.merge_splits:  # split-KV: NaN-poisoned partials over 3 splits, then the merge
        tiles = -(-nk // kernel.plan.block_kv)
        per_split = -(-tiles // min(3, tiles))
        parts = _nan_like(q, (-(-tiles // per_split), b, hq, nq, spec.dv))  # (O as wide as V)
        sinks = extras.pop("sinks", None)
        o_parts, lse_parts = kernel(q, k, v, scale=scale, out=parts, splits=min(3, tiles), **extras)
        got_out, got_lse = merge(o_parts, lse_parts, sinks=sinks, out_dtype=spec.dtype)
        if sinks is not None:
            extras["sinks"] = sinks
    else:  # a merging split kernel (outputs.merge_splits) over 3 splits, merged in the launch
        splits = {"splits": min(3, -(-nk // kernel.plan.block_kv))} if spec.outputs.merge_splits else {}
        got = kernel(q, k, v, scale=scale, out=out, return_lse=with_lse, **splits, **extras)
        got_out, got_lse = got if with_lse else (got, None)
    ref_out, ref_lse = oracle.attention(
        to_numpy(q), to_numpy(k), to_numpy(v), scale=scale, return_lse=True, mask=spec.mask,
        block_mask=extras.get("block_mask"), doc_ids=extras.get("doc_ids"), alibi_slopes=extras.get("alibi_slopes"),
        bias=extras.get("bias"), score_mod=spec.score_mod, sinks=extras.get("sinks"), captured=extras.get("captured"))
    result = CheckResult(
        spec.name, (b, hq, hkv, nq, nk),
        relative_error(to_numpy(got_out), ref_out),
        relative_error(to_numpy(got_lse), ref_lse) if with_lse else 0.0,
        OUT_TOLERANCE[spec.dtype],
        # Q.K^T over head_dim, P.V over head_dim_v: half the count of each
        flops=attention_flops(b, hq, nq, nk, (spec.head_dim + spec.dv) / 2, spec.causal),
    )
    if time_it and result.passed and not spec.outputs.partial:  # a wrong kernel is never timed
        result.ms = time_ms(lambda: kernel(q, k, v, scale=scale, out=out, **extras))
    return result


def check_backward_against_oracle(spec: AttentionSpec, b: int, hq: int, hkv: int, nq: int, nk: int, *,
                                  framework: str | None = None, layout: str = "bhnd", seed: int | None = None,
                                  scale: float | None = None, extras: dict | None = None) -> CheckResult:
    """The backward of a spec with a backward: section: its forward, then dq, dk, dv (and
    dsinks, dbias) from a random dout, each NaN-poisoned before the launch, against
    fagen.oracle.attention_backward. out_error is the worst gradient's relative error."""
    framework = framework or ("cupy" if spec.element.in_cupy else "torch")
    backward = compile_backward(spec)
    q, k, v, out = random_inputs(framework, spec.dtype, b, hq, hkv, nq, nk, spec.head_dim, layout, seed, d_v=spec.dv)
    dout = random_inputs(framework, spec.dtype, b, hq, hkv, nq, nk, spec.dv, layout,
                         None if seed is None else seed + 1)[0]
    dq = random_inputs(framework, spec.dtype, b, hq, hkv, nq, nk, spec.head_dim, layout)[3]
    # NaN-filled, in k's and v's shapes and layout
    dk, dv = (random_inputs(framework, spec.dtype, b, hkv, hkv, nk, nk, width, layout)[3]
              for width in (spec.head_dim, spec.dv))
    extras = random_extras(spec, b, hq, nq, nk, seed) if extras is None else extras
    out, lse = backward.forward(q, k, v, out=out, scale=scale, return_lse=True, **extras)
    grads = backward(dout, q, k, v, out, lse, scale=scale, dq=dq, dk=dk, dv=dv, **extras)
    ref = oracle.attention_backward(
        to_numpy(q), to_numpy(k), to_numpy(v), to_numpy(dout), scale=scale, mask=spec.mask,
        block_mask=extras.get("block_mask"),
        doc_ids=extras.get("doc_ids"), alibi_slopes=extras.get("alibi_slopes"), bias=extras.get("bias"),
        score_mod=spec.score_mod, sinks=extras.get("sinks"), captured=extras.get("captured"))
    errors = [relative_error(to_numpy(getattr(grads, name)), ref[name]) for name in ("dq", "dk", "dv")]
    for name in ("dsinks", "dbias"):
        if getattr(grads, name) is not None:
            errors.append(relative_error(to_numpy(getattr(grads, name)), ref[name]))
    return CheckResult(spec.name + " backward", (b, hq, hkv, nq, nk), max(errors), 0.0, OUT_TOLERANCE[spec.dtype],
                       flops=2.5 * attention_flops(b, hq, nq, nk, (spec.head_dim + spec.dv) / 2, spec.causal))
