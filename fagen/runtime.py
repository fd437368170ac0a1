"""CuPy runtime: compile a spec once per process, check arguments, launch.

Inputs are CuPy arrays or PyTorch CUDA tensors, read in place through their pointers and
strides (no copies); outputs are of the input's kind. Kernels run on CuPy's current stream,
or on PyTorch's current stream when the inputs are PyTorch tensors, so they order with the
framework's own work.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fagen import __version__
from fagen.plan import KernelPlan, plan
from fagen.render import SPECS, render
from fagen.spec import AttentionSpec, load_spec

try:
    import cupy
except ImportError:  # pragma: no cover - exercised on machines without CUDA
    cupy = None

NVRTC_OPTIONS = ("-std=c++17",)
MAX_GRID_Y = 65535
LOG2E = 1.4426950408889634


def _require_cupy() -> None:
    if cupy is None:
        raise RuntimeError("fagen's runtime needs CuPy and a CUDA GPU: pip install -e '.[cuda12]' or '.[cuda13]'")


@dataclass(frozen=True)
class DeviceTensor:
    """A CUDA tensor seen as pointer + shape + strides in elements, whatever its framework."""

    obj: object
    kind: str  # "cupy" | "torch"
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    device: int


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def as_device_tensor(x, what: str) -> DeviceTensor:
    if _is_torch(x):
        if not x.is_cuda:
            raise ValueError(f"{what}: a PyTorch tensor on {x.device}; fagen needs CUDA tensors: use {what}.cuda()")
        return DeviceTensor(x, "torch", x.data_ptr(), tuple(x.shape), tuple(x.stride()),
                            str(x.dtype).removeprefix("torch."), x.device.index)
    if cupy is not None and isinstance(x, cupy.ndarray):
        item = x.dtype.itemsize
        return DeviceTensor(x, "cupy", x.data.ptr, tuple(x.shape), tuple(s // item for s in x.strides),
                            str(x.dtype), x.device.id)
    if isinstance(x, np.ndarray):
        raise ValueError(f"{what}: a NumPy array lives on the host; move it to the GPU with cupy.asarray({what})")
    raise ValueError(f"{what}: expected a CuPy array or a PyTorch CUDA tensor, got {type(x).__name__}")


def _check_layout(t: DeviceTensor, what: str) -> None:
    if t.strides[-1] != 1:
        raise ValueError(f"{what}: last-dim stride is {t.strides[-1]}, must be 1 (16-byte copies read whole "
                         f"rows); pass a contiguous copy ({what}.contiguous() / cupy.ascontiguousarray)")
    bad = [s for s in t.strides[:-1] if s % 8]
    if t.ptr % 16 or bad:
        raise ValueError(f"{what}: strides {t.strides} (elements) and address must be multiples of 8 elements "
                         f"/ 16 bytes for cp.async; pass a contiguous copy")


def _empty_like(ref: DeviceTensor, shape, dtype: str):
    if ref.kind == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=ref.obj.device)
    return cupy.empty(shape, dtype=ref.obj.dtype if dtype == ref.dtype else dtype)


def _stream_for(ref: DeviceTensor):
    if ref.kind == "torch":
        import torch

        stream = torch.cuda.current_stream(ref.device)
        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14: the CUDA stream protocol
            return cupy.cuda.Stream.from_external(stream)
        return cupy.cuda.ExternalStream(stream.cuda_stream, ref.device)
    return cupy.cuda.get_current_stream()


def cache_key(source: str, options: tuple[str, ...], arch: str) -> str:
    return hashlib.sha256("\0".join([source, *options, arch, __version__]).encode()).hexdigest()


class Kernel:
    """A compiled spec. Call it like `fagen.attention`, without the choice of kernel."""

    def __init__(self, spec: AttentionSpec, source: str | None = None):
        _require_cupy()
        self.spec = spec
        self.plan: KernelPlan = plan(spec)
        self.source = render(spec) if source is None else source
        self.arch = f"sm_{cupy.cuda.Device().compute_capability}"
        if int(self.arch[3:]) < int(spec.arch[3:]):
            raise RuntimeError(f"{spec.name}: spec arch {spec.arch} is newer than this GPU ({self.arch}); "
                               f"set arch: sm_80 in the spec")
        self.key = cache_key(self.source, NVRTC_OPTIONS, self.arch)
        # CuPy caches the cubin on disk under a hash of source, options and arch.
        module = cupy.RawModule(code=self.source, options=NVRTC_OPTIONS)
        self.function = module.get_function(spec.name)
        if self.plan.smem_bytes > 48 * 1024:
            self.function.max_dynamic_shared_size_bytes = self.plan.smem_bytes

    def __repr__(self) -> str:
        return f"Kernel({self.spec.name}, {self.arch})"

    def check(self, q, k, v, out=None) -> tuple[DeviceTensor, DeviceTensor, DeviceTensor]:
        """Refuse bad arguments with a message a person can act on, before any launch."""
        spec, d = self.spec, self.spec.head_dim
        tq, tk, tv = (as_device_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        for t, n in ((tq, "q"), (tk, "k"), (tv, "v")):
            if t.kind != tq.kind:
                raise ValueError(f"{n} is a {t.kind} tensor but q is {tq.kind}: pass all three from one framework")
            if t.dtype != spec.dtype:
                raise ValueError(f"{n}: dtype {t.dtype}, but kernel {spec.name} takes {spec.dtype}; "
                                 f"cast it or use a {t.dtype} spec (fagen.attention picks one)")
            if t.device != tq.device:
                raise ValueError(f"{n} is on cuda:{t.device} but q on cuda:{tq.device}: put them on one GPU")
            if len(t.shape) != 4:
                raise ValueError(f"{n}: rank {len(t.shape)}, shape {t.shape}; expected [B, H, N, {d}]")
            if t.shape[-1] != d:
                raise ValueError(f"{n}: head_dim {t.shape[-1]}, but kernel {spec.name} is built for {d}")
            _check_layout(t, n)
        if cupy.cuda.Device().id != tq.device:
            raise ValueError(f"inputs are on cuda:{tq.device} but the current device is cuda:{cupy.cuda.Device().id}; "
                             f"use `with cupy.cuda.Device({tq.device}):`")
        (b, hq, nq, _), (bk, hkv, nk, _) = tq.shape, tk.shape
        if tk.shape != tv.shape:
            raise ValueError(f"k {tk.shape} and v {tv.shape} must have the same shape [B, Hkv, Nk, d]")
        if bk != b:
            raise ValueError(f"batch mismatch: q has B = {b}, k and v have B = {bk}")
        if hkv == 0 or hq % hkv:
            raise ValueError(f"q has Hq = {hq} heads, k and v Hkv = {hkv}: Hq must be a multiple of Hkv (GQA/MQA)")
        if min(b, hq, nq, nk) < 1:
            raise ValueError(f"empty input: q {tq.shape}, k {tk.shape}; every dimension must be >= 1")
        if math.ceil(nq / self.plan.block_q) > MAX_GRID_Y:
            raise ValueError(f"Nq = {nq} needs more than {MAX_GRID_Y} query tiles of {self.plan.block_q}")
        if out is not None:
            to = as_device_tensor(out, "out")
            if to.kind != tq.kind or to.dtype != spec.dtype or to.shape != tq.shape or to.device != tq.device:
                raise ValueError(f"out: {to.kind} {to.dtype} {to.shape} on cuda:{to.device}; expected a {tq.kind} "
                                 f"{spec.dtype} tensor of q's shape {tq.shape} on cuda:{tq.device}")
            _check_layout(to, "out")
        return tq, tk, tv

    def __call__(self, q, k, v, *, scale: float | None = None, return_lse: bool = False, out=None):
        tq, tk, tv = self.check(q, k, v, out)
        if return_lse and not self.spec.outputs.lse:
            raise ValueError(f"return_lse=True, but kernel {self.spec.name} has outputs.lse: false; "
                             f"use a spec with outputs: {{lse: true}}")
        scale = 1.0 / math.sqrt(self.spec.head_dim) if scale is None else float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale = {scale}: must be a finite positive number (default 1/sqrt(head_dim))")
        b, hq, nq, d = tq.shape
        out = _empty_like(tq, (b, hq, nq, d), self.spec.dtype) if out is None else out
        to = as_device_tensor(out, "out")
        lse = _empty_like(tq, (b, hq, nq), "float32")
        tl = as_device_tensor(lse, "lse")

        i32, i64 = np.int32, np.int64
        args = (
            np.uint64(tq.ptr), np.uint64(tk.ptr), np.uint64(tv.ptr), np.uint64(to.ptr), np.uint64(tl.ptr),
            i32(nq), i32(tk.shape[2]), i32(hq), i32(hq // tk.shape[1]),
            *(i64(s) for s in tq.strides[:3]), *(i64(s) for s in tk.strides[:3]),
            *(i64(s) for s in tv.strides[:3]), *(i64(s) for s in to.strides[:3]),
            np.float32(scale * LOG2E),
        )
        grid = (b * hq, math.ceil(nq / self.plan.block_q))
        with cupy.cuda.Device(tq.device), _stream_for(tq):
            self.function(grid, (self.plan.threads,), args, shared_mem=self.plan.smem_bytes)
        return (out, lse) if return_lse else out


_KERNELS: dict[str, Kernel] = {}


def compile_kernel(spec: AttentionSpec) -> Kernel:
    """One Kernel per (source, options, arch), device and process."""
    _require_cupy()
    device = cupy.cuda.Device()
    source = render(spec)
    key = f"{device.id}:" + cache_key(source, NVRTC_OPTIONS, f"sm_{device.compute_capability}")
    if key not in _KERNELS:
        _KERNELS[key] = Kernel(spec, source)
    return _KERNELS[key]


def default_spec_name(dtype: str, head_dim: int, causal: bool) -> str:
    short = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    return f"attn_{short}_d{head_dim}" + ("_causal" if causal else "")


@lru_cache(maxsize=None)
def default_spec(dtype: str, head_dim: int, causal: bool) -> AttentionSpec:
    path = SPECS / f"{default_spec_name(dtype, head_dim, causal)}.yaml"
    if not path.exists():
        raise ValueError(f"no shipped kernel for dtype {dtype}, head_dim {head_dim}: fagen.attention takes "
                         f"float16 or bfloat16 with head_dim 32, 64, 96, 128 or 256")
    return load_spec(path)


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False):
    tq = as_device_tensor(q, "q")
    if tq.dtype not in ("float16", "bfloat16"):
        raise ValueError(f"q: dtype {tq.dtype}; fagen.attention takes float16 or bfloat16")
    if len(tq.shape) != 4:
        raise ValueError(f"q: rank {len(tq.shape)}, shape {tq.shape}; expected [B, H, N, d]")
    kernel = compile_kernel(default_spec(tq.dtype, tq.shape[-1], bool(causal)))
    return kernel(q, k, v, scale=scale, return_lse=return_lse)
