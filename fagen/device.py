"""The GPU as fagen sees it: the optional CuPy import, CUDA tensors of either framework as
pointer + shape + strides, allocation and streams that follow the caller's framework, and
the GPU's identity. Everything that touches a device goes through here; the layers below
(spec, plan, render) never import CuPy or PyTorch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cache

import numpy as np

from fagen.element_types import ELEMENT_TYPES

try:
    import cupy
except ImportError:  # pragma: no cover - exercised on machines without CUDA
    cupy = None

CUPY_INSTALL = ("pip install 'fagen[cuda12]' or 'fagen[cuda13]' to match the driver's CUDA "
                "(in a checkout: pip install -e '.[cuda12]')")


def gpu_missing(torch: bool = False) -> str | None:
    """Why kernels cannot run on this machine, in one line with how to get what is missing;
    None when they can. CuPy and a CUDA device are always needed; `torch`: PyTorch with CUDA
    too (bench and tune time kernels on PyTorch tensors)."""
    try:
        import cupy  # looked up at call time: a test may take it away
    except ImportError:
        return f"CuPy is not installed (fagen compiles and launches kernels through it): {CUPY_INSTALL}"
    try:
        count, why = cupy.cuda.runtime.getDeviceCount(), ""
    except Exception as err:  # no driver, or a driver older than CuPy's CUDA
        count, why = 0, f" ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
    if count == 0:
        return (f"no CUDA GPU found{why}: run on a machine with an NVIDIA GPU and its driver "
                f"(nvidia-smi lists it)")
    if torch:
        try:
            import torch as _torch
        except ImportError:
            return "PyTorch is not installed (timings run on PyTorch tensors): pip install torch (a CUDA build)"
        if not _torch.cuda.is_available():
            return (f"PyTorch {_torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False): "
                    f"install a CUDA build of torch")
    return None


@cache
def compute_capability(device: int) -> str:
    """A device's compute capability as CuPy spells it ("90" for an H100 or H200), asked once."""
    return cupy.cuda.Device(device).compute_capability


def require_cupy() -> None:
    if cupy is None:
        raise RuntimeError(f"fagen's runtime needs CuPy and a CUDA GPU: {CUPY_INSTALL}")


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


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def as_device_tensor(x, what: str) -> DeviceTensor:
    if is_torch(x):
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


def tensor_signature(x) -> tuple:
    """Shape, strides, dtype and device of a tensor of either framework (of anything else, what
    it has of those): what a packed launch must see again. torch.Size compares equal to the tuple
    it holds, and get_device is an int (-1 off the GPU): no conversion on the hot path."""
    if is_torch(x):
        return x.shape, x.stride(), x.dtype, x.get_device()
    return (getattr(x, "shape", None), getattr(x, "strides", None), getattr(x, "dtype", None),
            getattr(getattr(x, "device", None), "id", None))


def contiguous_strides(shape, strides) -> bool:
    """Whether strides are shape's contiguous ones by torch's is_contiguous() rule: dimensions of
    one skipped, and no element contiguous (hot_path.c's `contiguous`)."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1:
            if stride != expected:
                return 0 in shape
            expected *= size
    return True


def laid_out_as(x, signature: tuple) -> bool:
    """Whether x is laid out as a prepared call's tensor of this tensor_signature was: its shape,
    dtype and device, and its strides, where that tensor was contiguous any strides of a contiguous
    torch tensor (a stride over a dimension of one is never stepped): the rule of the C hot path,
    so a call it takes the Python path takes too."""
    got = tensor_signature(x)
    if got == signature:
        return True
    shape, strides, dtype, device = signature
    return (is_torch(x) and got[0] == shape and got[2] == dtype and got[3] == device
            and contiguous_strides(shape, strides) and x.is_contiguous())


def torch_dtype(dtype: str):
    """torch's dtype for fagen's name of it (float8_e4m3: torch.float8_e4m3fn; int32 and other
    names of no element type: torch's own)."""
    import torch

    return getattr(torch, ELEMENT_TYPES[dtype].torch_name if dtype in ELEMENT_TYPES else dtype)


def empty_like(ref: DeviceTensor, shape, dtype: str):
    """An uninitialised array of `ref`'s framework and device."""
    if ref.kind == "torch":
        import torch

        return torch.empty(shape, dtype=torch_dtype(dtype), device=ref.obj.device)
    return cupy.empty(shape, dtype=ref.obj.dtype if dtype == ref.dtype else dtype)


def layout_order(strides) -> tuple[int, ...]:
    """A tensor's dimensions from outermost to innermost in memory, the last one innermost (the
    kernels read and write rows at unit stride): the others by stride, largest first, a
    broadcast one (stride 0) outermost, ties (size-1 dimensions among them) in their logical order."""
    last = len(strides) - 1
    return (*sorted(range(last), key=lambda i: (strides[i] != 0, -strides[i])), last)


def empty_permuted(framework, shape, order: tuple[int, ...], dtype, device=None):
    """An uninitialised array of `shape` whose dimensions lie in memory in `order` (outermost
    first): torch.empty_permuted, or its CuPy equivalent (a transposed contiguous array)."""
    if framework == "torch":
        import torch

        return torch.empty_permuted(shape, order, dtype=dtype, device=device)
    return cupy.empty([shape[i] for i in order], dtype=dtype).transpose(np.argsort(order).tolist())


def empty_laid_out_as(ref: DeviceTensor, shape, dtype: str):
    """An uninitialised array of `shape` (ref's rank) whose dimensions lie in memory in ref's order
    (layout_order): an attention output laid out as q is, as SDPA's and FlashAttention's are, so
    that a [B, N, H, d] tensor seen as [B, H, N, d] (a model's heads split off its hidden size)
    gets an out that transposes back without a copy."""
    if ref.kind == "torch":
        return empty_permuted("torch", shape, layout_order(ref.strides), torch_dtype(dtype), ref.obj.device)
    return empty_permuted("cupy", shape, layout_order(ref.strides), ref.obj.dtype if dtype == ref.dtype else dtype)


def zeros_like(ref: DeviceTensor, shape, dtype: str):
    """A zeroed array of `ref`'s framework and device (the memset on its current stream)."""
    if ref.kind == "torch":
        import torch

        return torch.zeros(shape, dtype=torch_dtype(dtype), device=ref.obj.device)
    return cupy.zeros(shape, dtype=dtype)


def full_like(ref: DeviceTensor, shape, value: float, dtype: str):
    """An array of `ref`'s framework and device filled with `value` (on its current stream)."""
    out = empty_like(ref, shape, dtype)
    out.fill_(value) if ref.kind == "torch" else out.fill(value)
    return out


def stream_for(ref: DeviceTensor):
    """The stream work on `ref` goes to: PyTorch's current stream for its tensors, else CuPy's."""
    if ref.kind == "torch":
        import torch

        stream = torch.cuda.current_stream(ref.device)
        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14: the CUDA stream protocol
            return cupy.cuda.Stream.from_external(stream)
        return cupy.cuda.ExternalStream(stream.cuda_stream, ref.device)
    return cupy.cuda.get_current_stream()


@cache
def torch_stream_handle():
    """A function of a device giving PyTorch's current stream there as a raw handle, without
    building a Stream object where this torch can (a launch's hot path)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else lambda device: torch.cuda.current_stream(device).cuda_stream


def gpu_slug() -> str:
    """'h200' for 'NVIDIA H200', 'h100' for 'NVIDIA H100 80GB HBM3': tuned specs are per GPU."""
    require_cupy()
    return _gpu_slug(cupy.cuda.Device().id)


@cache
def _gpu_slug(device: int) -> str:  # reading the properties costs a millisecond: once a device
    name = cupy.cuda.runtime.getDeviceProperties(device)["name"].decode()
    words = [w for w in name.lower().replace("nvidia", "").split() if w]
    return "".join(c for c in (words[0] if words else "gpu") if c.isalnum())


@cache
def multiprocessors(device: int) -> int:
    """The SMs of GPU `device` (a persistent kernel's grid, split-KV's fill target)."""
    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device)


def current_device() -> int:
    """The current CUDA device's index (CuPy's, which follows `with cupy.cuda.Device(i)`)."""
    require_cupy()
    return cupy.cuda.runtime.getDevice()


@cache
def l2_bytes(device: int) -> int:
    """The L2 cache of GPU `device`, in bytes (the tile walk's sections: fagen.plan.l2_section)."""
    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrL2CacheSize, device)


HIGHEST_STREAM_PRIORITY = -(1 << 16)


@cache
def priority_stream(device: int):
    """A non-blocking stream of the highest priority on GPU `device`, made once: work forked onto
    it takes SMs ahead of the current stream's (priority 0, the lowest) where both are ready.
    Work forked here joins back before its caller returns (fork_join)."""
    with cupy.cuda.Device(device):  # CUDA clamps a priority to the device's range ([-5, 0] on sm_90)
        return cupy.cuda.Stream(non_blocking=True, priority=HIGHEST_STREAM_PRIORITY)


class fork_join:
    """`with fork_join(device) as side:` runs what is launched under `with side:` concurrently with
    what the current stream gets meanwhile: the side stream waits for the current stream's work so
    far at entry, and the current stream waits for the side stream's at exit. Inside a CUDA graph
    capture both joins are captured as edges."""

    def __init__(self, device: int):
        self.side, (self.forked, self.joined) = priority_stream(device), _fork_events(device, threading.get_ident())

    def __enter__(self):
        self.main = cupy.cuda.get_current_stream()
        self.forked.record(self.main)
        self.side.wait_event(self.forked)
        return self.side

    def __exit__(self, *exc) -> None:
        self.joined.record(self.side)
        self.main.wait_event(self.joined)


@cache
def _fork_events(device: int, thread: int):  # reused by a thread: a wait takes the event's latest record
    with cupy.cuda.Device(device):
        return cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)
