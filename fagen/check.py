"""Run a kernel on the GPU against the float64 oracle: fresh random inputs, NaN-poisoned
output, relative error under a per-dtype tolerance, then (optionally) a timing.

Shared by `fagen check` and the GPU tests, so both prove kernels the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fagen import oracle
from fagen.spec import AttentionSpec

# ||out - ref|| / ||ref||. The oracle sees the same rounded inputs, so the error is P's
# rounding to the MMA input type plus f32 accumulation: ~2^-11 for float16, ~2^-8 for bfloat16.
OUT_TOLERANCE = {"float16": 4e-3, "bfloat16": 2e-2}
LSE_TOLERANCE = 1e-4
LAYOUTS = ("bhnd", "bnhd")  # how q, k, v, out sit in memory; the kernel always sees [B, H, N, d]


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
                  layout: str = "bhnd", seed: int | None = None):
    """q, k, v and a NaN-filled out in `layout`, as views of shape [B, H, N, d]."""
    if framework == "torch":
        import torch

        gen = torch.Generator(device="cuda")
        gen.manual_seed(int(np.random.default_rng(seed).integers(2**62)))

        def make(h, n, fill=None):
            shape = (b, h, n, d) if layout == "bhnd" else (b, n, h, d)
            if fill is not None:
                x = torch.full(shape, fill, dtype=getattr(torch, dtype), device="cuda")
            else:
                x = torch.randn(shape, generator=gen, device="cuda").to(getattr(torch, dtype))
            return x if layout == "bhnd" else x.transpose(1, 2)
    else:
        import cupy

        if dtype != "float16":
            raise ValueError(f"CuPy has no {dtype}: pass PyTorch tensors for {dtype}")
        rng = cupy.random.default_rng(seed)

        def make(h, n, fill=None):
            shape = (b, h, n, d) if layout == "bhnd" else (b, n, h, d)
            x = cupy.full(shape, fill, dtype=cupy.float16) if fill is not None else \
                rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
            return x if layout == "bhnd" else x.transpose(0, 2, 1, 3)

    return make(hq, nq), make(hkv, nk), make(hkv, nk), make(hq, nq, fill=float("nan"))


def to_numpy(x) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        return x.detach().float().cpu().numpy()
    return x.get().astype(np.float32)


def time_ms(fn, warmup: int = 5, iters: int = 30) -> float:
    """Median of CUDA-event timings of fn() on the current stream, after warm-up."""
    import cupy

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def check_against_oracle(spec: AttentionSpec, b: int, hq: int, hkv: int, nq: int, nk: int, *,
                         framework: str | None = None, layout: str = "bhnd", seed: int | None = None,
                         scale: float | None = None, time_it: bool = False) -> CheckResult:
    from fagen.runtime import compile_kernel

    if framework is None:
        framework = "cupy" if spec.dtype == "float16" else "torch"
    kernel = compile_kernel(spec)
    q, k, v, out = random_inputs(framework, spec.dtype, b, hq, hkv, nq, nk, spec.head_dim, layout, seed)
    with_lse = spec.outputs.lse
    got = kernel(q, k, v, scale=scale, out=out, return_lse=with_lse)
    got_out, got_lse = got if with_lse else (got, None)
    ref_out, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=spec.causal,
                                        scale=scale, return_lse=True)
    result = CheckResult(
        spec.name, (b, hq, hkv, nq, nk),
        relative_error(to_numpy(got_out), ref_out),
        relative_error(to_numpy(got_lse), ref_lse) if with_lse else 0.0,
        OUT_TOLERANCE[spec.dtype],
        flops=attention_flops(b, hq, nq, nk, spec.head_dim, spec.causal),
    )
    if time_it and result.passed:  # a wrong kernel is never timed
        result.ms = time_ms(lambda: kernel(q, k, v, scale=scale, out=out))
    return result
