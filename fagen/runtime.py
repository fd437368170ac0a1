"""CuPy runtime: compile a spec once per process, check arguments, launch.

Inputs are CuPy arrays or PyTorch CUDA tensors, read in place through their pointers and
strides (no copies); outputs are of the input's kind. Kernels run on CuPy's current stream,
or on PyTorch's current stream when the inputs are PyTorch tensors, so they order with the
framework's own work.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import threading
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache, partial

import numpy as np

from fagen import device, disk_cache, expression, fp8_inputs, masks, side_inputs, tensor_maps
from fagen.version import __version__
from fagen.dependent_launch import MIN_COMPUTE_CAPABILITY, DependentLaunch, pays_off
from fagen.device import (DeviceTensor, as_device_tensor, cupy, empty_laid_out_as, empty_like, empty_permuted, is_torch,
                          layout_order, require_cupy, stream_for, tensor_signature, torch_stream_handle, zeros_like)
from fagen.element_types import element_type, itemsize
from fagen.mask_kinds import KINDS
from fagen.padding_runs import THREADS as PADDING_RUNS_THREADS, fold as fold_padding_flags
from fagen.plan import TMA_MAP, KernelPlan, l2_section, merge_plan, merge_warps, plan
from fagen.rendering import (DOCUMENT_BOUNDS, DOCUMENT_BOUNDS_THREADS, MERGE_DTYPES, V_TRANSPOSE,
                             V_TRANSPOSE_MAX_D, merge_name, padding_runs_name, render, shared_kernel)
from fagen.spec import AttentionSpec

NVRTC_OPTIONS = ("-std=c++17",)
MAX_GRID_Y = 65535
LOG2E = 1.4426950408889634


def _check_layout(t: DeviceTensor, what: str) -> None:
    if t.strides[-1] != 1:
        raise ValueError(f"{what}: last-dim stride is {t.strides[-1]}, must be 1 (16-byte copies read whole "
                         f"rows); pass a contiguous copy ({what}.contiguous() / cupy.ascontiguousarray)")
    chunk = 16 // itemsize(t.dtype)  # elements in a 16-byte copy: 8 of a half type, 16 of FP8
    bad = [s for s in t.strides[:-1] if s % chunk]
    if t.ptr % 16 or bad:
        raise ValueError(f"{what}: strides {t.strides} (elements) and address must be multiples of {chunk} elements "
                         f"/ 16 bytes for cp.async; pass a contiguous copy")


# How a kernel parameter's C type travels through CuPy's launch: pointers as 64-bit addresses.
C_SCALARS = {"int": np.int32, "long long": np.int64, "float": np.float32, "unsigned": np.uint32,
             TMA_MAP: bytes}  # a tensor map: its 128 encoded bytes


def packers(params: tuple[tuple[str, str], ...]) -> tuple[tuple[str, type], ...]:
    """(name, NumPy type) per kernel parameter, in signature order: pointers travel as 64-bit
    addresses. Computed once a kernel; the plan's table drives the signature and the packing."""
    return tuple((name, np.uint64 if "*" in ctype else C_SCALARS[ctype]) for ctype, name in params)


def pack_arguments(typed: tuple[tuple[str, type], ...], values: dict) -> tuple:
    """The launch arguments in signature order, each converted to its C type (`packers`), from
    `values` by parameter name."""
    try:
        return tuple(convert(values[name]) for name, convert in typed)
    except KeyError:
        missing = [name for name, _ in typed if name not in values]
        raise ValueError(f"no value for kernel parameter(s) {missing}") from None


def cache_key(source: str, options: tuple[str, ...], arch: str) -> str:
    return hashlib.sha256("\0".join([source, *options, arch, __version__]).encode()).hexdigest()


def _compile_sm90a(source: str, name: str, key: str) -> str:
    """NVRTC for sm_90a (CuPy compiles for the plain arch, which has no wgmma): the cubin's path,
    cached on disk under the kernel's hash like CuPy's own cache."""
    cache = disk_cache.directory()
    path = cache / f"{key}.cubin"
    if path.exists():
        return str(path)
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, f"{name}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, (*NVRTC_OPTIONS, "-arch=sm_90a"))
        except nvrtc.NVRTCError:
            raise RuntimeError(f"NVRTC failed on {name} for sm_90a:\n{nvrtc.getProgramLog(prog)}") from None
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin)
    tmp.replace(path)  # atomic: a concurrent process sees the whole cubin or none
    return str(path)


def compile_module(source: str, name: str, *, wgmma: bool):
    """The CuPy module of a rendered source: for sm_90a through our NVRTC call (wgmma needs the
    arch-specific target), else CuPy's, which caches the cubin on disk under a hash of source,
    options and arch."""
    if wgmma:
        arch = f"sm_{cupy.cuda.Device().compute_capability}"
        return cupy.RawModule(path=_compile_sm90a(source, name, cache_key(source, NVRTC_OPTIONS, arch)))
    return cupy.RawModule(code=source, options=NVRTC_OPTIONS)


# Each kernel parameter in 8-byte slots of a Launch's buffer (struct format; x: padding): one
# slot, or a tensor map's 16.
SLOT_FORMATS = {"int": "i4x", "long long": "q", "float": "f4x", "unsigned": "I4x",
                TMA_MAP: f"{tensor_maps.MAP_BYTES}s"}
SLOT_BYTES = 8


def _slot_code(ctype: str) -> str:
    return "Q" if "*" in ctype else SLOT_FORMATS[ctype]


@cache
def slot_format(params: tuple[tuple[str, str], ...]) -> str:
    """The struct format packing `params` ((C type, name), signature order) into 8-byte slots:
    pointers as 64-bit addresses."""
    return "<" + "".join(_slot_code(ctype) for ctype, _ in params)


@cache
def slot_offsets(params: tuple[tuple[str, str], ...]) -> tuple[tuple[int, ...], int]:
    """Each parameter's first slot in the buffer, and the slots in all."""
    sizes = [struct.calcsize("<" + _slot_code(ctype)) // SLOT_BYTES for ctype, _ in params]
    return tuple(int(x) for x in np.cumsum([0, *sizes[:-1]])), sum(sizes)


@dataclass(frozen=True)
class TensorMap:
    """A tensor-map parameter (`param`) of the tensor whose address parameter is `tensor`: the
    Launch encodes it at packing, and anew when a prepared call re-points that tensor."""
    param: str
    tensor: str
    dtype: str
    layout: tensor_maps.MapLayout


def scalar_writer(buffer: np.ndarray, param_slots: dict[str, tuple[int, str]], names: tuple[str, ...]):
    """A function of len(names) values packing them into `buffer`'s slots of the parameters
    `names` (param_slots: name -> (first slot, C type)); parameters in adjacent slots, in that
    order, pack as one struct store."""
    runs: list[list] = []  # [first slot, format, value count]
    for offset, ctype in (param_slots[name] for name in names):
        code = _slot_code(ctype)
        if runs and runs[-1][0] + struct.calcsize("<" + runs[-1][1]) // SLOT_BYTES == offset:
            runs[-1][1] += code
            runs[-1][2] += 1
        else:
            runs.append([offset, code, 1])
    fields = [(struct.Struct("<" + code).pack_into, SLOT_BYTES * offset, count) for offset, code, count in runs]

    def write(*values) -> None:
        at = 0
        for pack_into, offset, count in fields:
            pack_into(buffer, offset, *values[at:at + count])
            at += count
    write.stores = len(fields)
    return write


class Launch:
    """One kernel launch packed once: grid, block, shared memory and every argument, each in
    its own 8-byte slot of a buffer handed to cuLaunchKernel. Calling it launches; `slots` name
    the pointer parameters a call may re-point at other tensors of the same shape and strides
    (a prepared call: a few stores and the driver call, no checks, specs or packing)."""

    __slots__ = ("function", "grid", "block", "smem", "values", "params", "slots", "maps", "held", "claims", "_pointers",
                 "_first_slots", "_mapped", "_repoint_all", "_driver_launch", "_param_slots")

    def __init__(self, function, grid: tuple[int, int, int], threads: int, smem: int,
                 params: tuple[tuple[str, str], ...], values: dict, slots: tuple[str, ...] = (),
                 maps: tuple[TensorMap, ...] = (), dependent: bool = False, held: object = None):
        names = [name for _, name in params]
        values = {**values, **{m.param: tensor_maps.encode(values[m.tensor], m.dtype, m.layout) for m in maps}}
        missing = [name for name in names if name not in values]
        if missing:
            raise ValueError(f"no value for kernel parameter(s) {missing}")
        self.function = getattr(function, "kernel", function).ptr  # the CUfunction of a RawKernel
        self.held = held  # what the launch reads beside its tensors (a claimed walk's counters): kept with it
        self.claims = "tiles_claimed" in values and bool(values["tiles_claimed"])  # from counters: not two at once
        self.grid, self.block, self.smem = grid, threads, smem
        offsets, total = slot_offsets(params)
        self._param_slots = {name: (offset, ctype) for offset, (ctype, name) in zip(offsets, params)}
        self.values = np.zeros(total, np.uint64)  # the driver reads each parameter from its first slot
        struct.pack_into(slot_format(params), self.values, 0, *(values[name] for name in names))
        # cuLaunchKernel reads the pointer array and the slots during the call: both live here
        self._pointers = self.values.ctypes.data + SLOT_BYTES * np.array(offsets, dtype=np.uint64)
        self.params = self._pointers.ctypes.data
        # a tensor a producer loads through its map is no parameter: its slot is -1, and a
        # re-point only re-encodes the map
        self.slots = tuple(offsets[names.index(name)] if name in names else -1 for name in slots)
        loose = [name for name, at in zip(slots, self.slots) if at < 0 and name not in {m.tensor for m in maps}]
        if loose:
            raise ValueError(f"slots {loose}: neither kernel parameters nor tensors of its maps")
        # (first slot, index of the mapped tensor among `slots`, dtype, layout): what a re-point re-encodes
        self.maps = tuple((offsets[names.index(m.param)], slots.index(m.tensor), m.dtype, m.layout) for m in maps)
        # the address each map was encoded for (a decode loop re-points k and v at the same cache):
        # one buffer, which the C hot path reads and writes too
        self._mapped = np.array([int(values[m.tensor]) for m in maps], np.uint64)
        # the usual case, slots the first parameters in order: one struct store re-points them all
        first = self.slots == tuple(range(len(self.slots)))
        self._first_slots = struct.Struct(f"<{len(self.slots)}Q") if first else None
        self._repoint_all = len(self.slots) if first else -1  # the address count that takes that store
        # the driver call with everything but the stream bound: a call passes two arguments, not eleven
        # (dependent: a programmatic dependent launch, fagen.dependent_launch)
        self._driver_launch = (DependentLaunch(self.function, grid, threads, smem) if dependent else
                               partial(cupy.cuda.driver.launchKernel, self.function, *grid, threads, 1, 1, smem))

    def __call__(self, stream: int | None, *addresses: int) -> None:
        """Launch on `stream` (a CUDA stream handle; None: CuPy's current stream), the slots
        given first pointing at `addresses` (all of them, or the first few)."""
        if len(addresses) == self._repoint_all:
            self._first_slots.pack_into(self.values, 0, *addresses)
        else:
            values = self.values
            for index, address in zip(self.slots, addresses):
                if index >= 0:
                    values[index] = address
        if self.maps:
            self.re_encode(addresses)
        if stream is None:
            stream = cupy.cuda.get_current_stream().ptr
        self._driver_launch(stream, self.params, 0)

    def writer(self, names: tuple[str, ...]):
        """A function of len(names) values writing those scalar parameters for later launches (a
        prepared call whose keys grow rewrites n_kv, the K/V strides and the split share); KeyError
        for a name the kernel does not take."""
        return scalar_writer(self.values, self._param_slots, names)

    def param_slots(self, names: tuple[str, ...]) -> tuple[tuple[int, str], ...]:
        """(first slot, C type) of each named scalar parameter: where a writer (or the C hot path)
        stores it."""
        return tuple(self._param_slots[name] for name in names)

    def driver_call(self) -> tuple:
        """(CUfunction, grid, threads, shared memory, dependent, the pointer array's address, the
        slots' address, their count): what launching this from C takes (fagen.hot_path)."""
        return (self.function, self.grid, self.block, self.smem, isinstance(self._driver_launch, DependentLaunch),
                self.params, self.values.ctypes.data, len(self.values))

    def map_encodings(self) -> tuple | None:
        """What the C hot path re-encodes the maps from: (the mapped addresses' buffer, ((first
        slot, index of the mapped tensor among the call's addresses, the driver's data type, dims,
        byte strides, box), ...)), or None without maps."""
        if not self.maps:
            return None
        return (self._mapped.ctypes.data, tuple((slot, tensor, element_type(dtype).tensor_map, *(tuple(map(int, x)) for x in (
            layout.dims, layout.strides, layout.box))) for slot, tensor, dtype, layout in self.maps))

    def re_encode(self, addresses: tuple[int, ...]) -> None:
        """TMA reads a tensor's address from its map: encode the maps of re-pointed tensors."""
        for i, (slot, tensor, dtype, layout) in enumerate(self.maps):
            if tensor < len(addresses) and addresses[tensor] != self._mapped[i]:
                struct.pack_into(SLOT_FORMATS[TMA_MAP], self.values, SLOT_BYTES * slot,
                                 tensor_maps.encode(addresses[tensor], dtype, layout))
                self._mapped[i] = addresses[tensor]  # (recorded once written: the C path skips what it names)


def call_signature(q, k, v, out, scale: float | None, return_lse: bool) -> tuple:
    """What a kernel's checks of a plain call read, as a dict key: q's, k's, v's (and out's, where
    given) tensor_signature, the scale and return_lse, and the calling thread (a Launch re-points
    its own buffer: one per thread)."""
    return (tensor_signature(q), tensor_signature(k), tensor_signature(v),
            None if out is None else tensor_signature(out), scale, return_lse, threading.get_ident())


class KeptLaunches:
    """Launches packed once, by a key of everything their checks and packing read, for calls that
    come again with new addresses (at most LIMIT keys; then it starts over)."""

    LIMIT = 64

    def __init__(self):
        self._launches: dict[tuple, Launch] = {}

    def get(self, key: tuple) -> Launch | None:
        return self._launches.get(key)

    def keep(self, key: tuple, launch: Launch) -> None:
        if len(self._launches) >= self.LIMIT:
            self._launches.clear()
        self._launches[key] = launch


class RepeatedCalls(KeptLaunches):
    """A kernel's repeated calls by their `key`: the first call of a key is checked and packed, and
    leaves its Launch here; a later one re-points that Launch at its tensors (re-encoding the
    tensor maps of new addresses) and launches it: a few microseconds of host time where checking
    and packing take tens (a ring step's launch: hundreds). The checks read only the key, apart
    from the addresses' 16-byte alignment and the current device, which a call checks itself.

    Repeatable: a plain kernel's calls with no side inputs, given LSE or splits (a moved diagonal
    is part of the key); a split-KV or accumulating kernel's (not merging) with its out and lse
    given, one split (a ring's steps)."""

    def __init__(self, writes_given: bool, per_stream: bool = False):
        super().__init__()
        self.writes_given = writes_given  # partial or accumulating: out and lse are the caller's
        # a claimed walk's launch claims its tiles from the counter pair it holds (zeroed again by
        # each launch's last block): kept a stream, so that no two run at once, and not from under
        # a graph capture (a graph's replays would claim from the pair beside eager calls)
        self.per_stream = per_stream

    def keep(self, key: tuple, launch: Launch) -> None:
        if launch.claims and cupy.cuda.get_current_stream().is_capturing():
            return
        super().keep(key, launch)

    def key(self, q, k, v, out, lse, scale: float | None, return_lse: bool, mask_offset: int | None,
            splits: int | None) -> tuple | None:
        """The call's key, or None where the call is not a repeatable one."""
        repeatable = (out is not None and lse is not None and splits in (None, 1) if self.writes_given
                      else lse is None and splits is None)
        if not repeatable:
            return None
        stream = (torch_stream_handle()(q.get_device()) if is_torch(q) else cupy.cuda.get_current_stream().ptr
                  ) if self.per_stream else None
        return (call_signature(q, k, v, out, scale, return_lse), None if lse is None else tensor_signature(lse),
                mask_offset, splits, stream)

    def run(self, launch: Launch, q, k, v, out, lse, return_lse: bool):
        """Launch `launch` on q, k, v (and out) of its key: a plain call's out (where not given) and
        LSE allocated on the launch stream; None where an address is not 16-byte aligned or the
        current device is not the tensors' (the checked call refuses those, with its message)."""
        if is_torch(q):
            device = q.get_device()
            if device != cupy.cuda.runtime.getDevice():
                return None
            addresses = q.data_ptr(), k.data_ptr(), v.data_ptr(), None if out is None else out.data_ptr()
            stream = torch_stream_handle()(device)
            if (addresses[0] | addresses[1] | addresses[2] | (addresses[3] or 0)) % 16:
                return None
            if launch.claims and _torch_capturing()():
                return None
            if not self.writes_given:  # out laid out as q (the key's), as the packing call's was
                out = empty_permuted("torch", (*q.shape[:3], v.shape[-1]), layout_order(q.stride()), q.dtype,
                                     q.device) if out is None else out
                lse = q.new_empty(q.shape[:3], dtype=_torch_float32())
            launch(stream, *addresses[:3], out.data_ptr(), lse.data_ptr())
        else:
            if q.device.id != cupy.cuda.runtime.getDevice():
                return None
            addresses = q.data.ptr, k.data.ptr, v.data.ptr, None if out is None else out.data.ptr
            if (addresses[0] | addresses[1] | addresses[2] | (addresses[3] or 0)) % 16:
                return None
            if launch.claims and cupy.cuda.get_current_stream().is_capturing():
                return None
            if not self.writes_given:
                out = empty_permuted("cupy", (*q.shape[:3], v.shape[-1]), layout_order(q.strides), q.dtype) \
                    if out is None else out
                lse = cupy.empty(q.shape[:3], cupy.float32)
            launch(None, *addresses[:3], out.data.ptr, lse.data.ptr)
        return (out, lse) if return_lse or self.writes_given else out


@cache
def _torch_capturing():
    """PyTorch's test of whether the current stream is recording a graph (a function)."""
    import torch

    return torch.cuda.is_current_stream_capturing


@cache
def _torch_float32():
    import torch

    return torch.float32


def _mapped(t: DeviceTensor, total) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape and strides a tensor map describes: the tensor itself, or for a varlen batch (a
    [B, H, max_seqlen, d] view of its token-major rows, `total` of them) the one tensor
    [1, H, total, d] every sequence is a run of rows of (the kernel adds cu_seqlens[b])."""
    if total is None:
        return tuple(t.shape), tuple(t.strides)
    return (1, t.shape[1], int(total), t.shape[3]), (0, t.strides[1], t.strides[2], 1)


class MergeLaunch:
    """The merge of given partials into given outputs, packed (a Launch): its slots re-point out
    and lse; `held` keeps a copy of the sinks alive."""

    def __init__(self, launch: Launch, held):
        self.launch, self.held = launch, held


def merge_launch(o_parts, lse_parts, out, lse, *, sinks=None) -> MergeLaunch:
    """Check the partials, the outputs and the sinks, and pack the merge's launch."""
    tp, tl = as_device_tensor(o_parts, "o_parts"), as_device_tensor(lse_parts, "lse_parts")
    if tp.dtype != "float32" or tl.dtype != "float32" or len(tp.shape) != 5 or tl.shape != tp.shape[:4]:
        raise ValueError(f"merge: o_parts {tp.dtype} {tp.shape}, lse_parts {tl.dtype} {tl.shape}; expected "
                         f"float32 [S, B, H, N, d] and [S, B, H, N]")
    if tp.strides != _contiguous(tp.shape) or tl.strides != _contiguous(tl.shape):
        raise ValueError("merge: o_parts and lse_parts must be contiguous")
    s, b, h, n, d = tp.shape
    to, tlse = as_device_tensor(out, "out"), as_device_tensor(lse, "lse")
    if to.shape != (b, h, n, d) or to.dtype not in MERGE_DTYPES or to.strides[-1] != 1:
        raise ValueError(f"merge: out {to.dtype} {to.shape}; expected [{b}, {h}, {n}, {d}], float16, bfloat16 or "
                         f"float32, unit stride along d")
    if tlse.shape != (b, h, n) or tlse.dtype != "float32" or tlse.strides != _contiguous(tlse.shape):
        raise ValueError(f"merge: lse {tlse.dtype} {tlse.shape}; expected contiguous float32 [{b}, {h}, {n}]")
    held, sink_ptr = None, np.uint64(0)
    if sinks is not None:
        with cupy.cuda.Device(tp.device):
            held = cupy.ascontiguousarray(cupy.asarray(sinks, dtype=cupy.float32))
        if held.shape != (h,):
            raise ValueError(f"merge: sinks shape {held.shape}; expected [{h}]")
        sink_ptr = np.uint64(held.data.ptr)
    rows = b * h * n
    geometry = merge_plan(to.dtype)
    if d > 32 * geometry.columns_per_lane:
        raise ValueError(f"merge: head_dim {d}; the merge sums at most {32 * geometry.columns_per_lane} columns")
    values = dict(o_parts=tp.ptr, lse_parts=tl.ptr, sinks=sink_ptr, out=to.ptr, lse=tlse.ptr,
                  splits=s, rows=rows, head_dim=d, heads=h, n_q=n, part_stride=b * h * n * d,
                  lse_part_stride=b * h * n, **dict(zip(("o_sb", "o_sh", "o_sn"), to.strides[:3])))
    launch = Launch(shared_function(merge_name(to.dtype), tp.device), (rows, 1, 1), 32 * merge_warps(s), 0, geometry.params, values,
                    slots=("out", "lse"))
    return MergeLaunch(launch, held)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))


@dataclass
class Packed:
    """A call's launches, packed and not yet launched: the kernel's and, where a split kernel's
    partials are merged outside it, the merge kernel's after it; the outputs they write and what
    they read beside the inputs (held: keep it while the launches may run)."""
    spec: AttentionSpec
    out: object
    lse: object
    kernel: Launch | None  # None: no query row, nothing to launch
    merge: MergeLaunch | None
    held: list
    split_counts: object = None  # a kernel merging its own splits: each tile's arrival count (0 between calls)
    first: Launch | None = None  # a launch before the kernel's: a varlen batch's tile table, from cu_seqlens_q

    def __call__(self, stream: int | None = None) -> None:
        """Launch on `stream` (None: CuPy's current stream), as packed."""
        if self.first is not None:
            self.first(stream)
        if self.kernel is not None:
            self.kernel(stream)
        if self.merge is not None:
            self.merge.launch(stream)


class Kernel:
    """A compiled spec. Call it like `fagen.attention`, without the choice of kernel."""

    def __init__(self, spec: AttentionSpec, source: str | None = None):
        require_cupy()
        self.spec = spec
        self.plan: KernelPlan = plan(spec)
        self.source = render(spec) if source is None else source
        self.arch = f"sm_{cupy.cuda.Device().compute_capability}"
        if spec.wgmma and self.arch != "sm_90":
            raise RuntimeError(f"{spec.name}: arch sm_90a (wgmma) runs on Hopper (sm_90) only, this GPU is "
                               f"{self.arch}; use a spec with arch: sm_80")
        if int(self.arch[3:]) < int(spec.arch[3:5]) and spec.fp8_kv:
            raise RuntimeError(f"{spec.name}: an FP8 KV cache's kernels run on {spec.arch} (Hopper) here, this GPU is "
                               f"{self.arch}; keep the cache in {spec.dtype} on it")
        if int(self.arch[3:]) < int(spec.arch[3:5]):
            raise RuntimeError(f"{spec.name}: spec arch {spec.arch} is newer than this GPU ({self.arch}); "
                               f"set arch: sm_80 in the spec")
        module = compile_module(self.source, spec.name, wgmma=spec.wgmma)
        self.function = module.get_function(self.plan.symbol)
        if self.plan.smem_bytes > 48 * 1024:
            self.function.max_dynamic_shared_size_bytes = self.plan.smem_bytes
        outputs = spec.outputs  # repeated calls skip the checks and the packing (not a merging kernel's, nor
        # FP8's: its launch reads V^T and the descales, made each call)
        self.repeated_calls = (None if outputs.merge_splits or self.takes_side_inputs or spec.element.is_fp8 or spec.fp8_kv
                               else RepeatedCalls(writes_given=outputs.partial or outputs.accumulate,
                                                  per_stream=self.plan.claimed_walk))

    def __repr__(self) -> str:
        return f"Kernel({self.spec.name}, {self.arch})"

    @cached_property
    def dependent_launch(self) -> bool:
        """Whether launches overlap the stream's previous kernel (fagen.dependent_launch): the
        kernel waits for it (plan.dependent_launch) and this GPU has griddepcontrol."""
        return self.plan.dependent_launch and int(self.arch[3:]) >= MIN_COMPUTE_CAPABILITY

    @cached_property
    def blocks_per_sm(self) -> int:
        """Blocks an SM holds at once, as the CUDA occupancy calculator reports for this launch."""
        return cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            getattr(self.function, "kernel", self.function).ptr, self.plan.threads, self.plan.smem_bytes)

    @cached_property
    def takes_side_inputs(self) -> bool:
        return bool(self.plan.mask_params or self.plan.score_params or self.takes_sinks)

    @cached_property
    def takes_sinks(self) -> bool:
        """Sinks join where a row's softmax ends: this kernel's epilogue, or its in-kernel merge of
        split-KV partials (outputs.merge_splits); a partial kernel leaves them to the merge kernel."""
        outputs = self.spec.outputs
        return self.spec.score_mod.sinks and (outputs.merge_splits or not outputs.partial)

    def check(self, q, k, v, out=None) -> tuple[DeviceTensor, DeviceTensor, DeviceTensor]:
        """Refuse bad arguments with a message a person can act on, before any launch."""
        spec = self.spec
        tq, tk, tv = (as_device_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        for t, n, d in ((tq, "q", spec.head_dim), (tk, "k", spec.head_dim), (tv, "v", spec.dv)):
            if t.kind != tq.kind:
                raise ValueError(f"{n} is a {t.kind} tensor but q is {tq.kind}: pass all three from one framework")
            element = spec.q_element if n == "q" else spec.kv_element
            if t.dtype not in (element.name, element.torch_name):
                raise ValueError(f"{n}: dtype {t.dtype}, but kernel {spec.name} takes {element.torch_name}; "
                                 f"cast it or use a {t.dtype} spec (fagen.attention picks one)")
            if t.device != tq.device:
                raise ValueError(f"{n} is on cuda:{t.device} but q on cuda:{tq.device}: put them on one GPU")
            if len(t.shape) != 4:
                raise ValueError(f"{n}: rank {len(t.shape)}, shape {t.shape}; expected [B, H, N, {d}]")
            if t.shape[-1] != d:
                width = "head_dim_v" if n == "v" and spec.dv != spec.head_dim else "head_dim"
                hint = ("; for a V of its own width, compile a spec with head_dim_v (fagen.compile), or call fagen.attention"
                        if n == "v" and spec.dv == spec.head_dim and tq.shape[-1:] == (d,) else "")
                raise ValueError(f"{n}: {width} {t.shape[-1]}, but kernel {spec.name} is built for {d}{hint}")
            if not (spec.element.is_fp8 and n == "v"):  # (the FP8 forward reads V^T, v_transposed's copy)
                _check_layout(t, n)
        if cupy.cuda.Device().id != tq.device:
            raise ValueError(f"inputs are on cuda:{tq.device} but the current device is cuda:{cupy.cuda.Device().id}; "
                             f"use `with cupy.cuda.Device({tq.device}):`")
        (b, hq, nq, _), (bk, hkv, nk, _) = tq.shape, tk.shape
        if tk.shape[:3] != tv.shape[:3]:
            raise ValueError(f"k {tk.shape} and v {tv.shape} must have the same [B, Hkv, Nk]")
        if bk != b:
            raise ValueError(f"batch mismatch: q has B = {b}, k and v have B = {bk}")
        if hkv == 0 or hq % hkv:
            raise ValueError(f"q has Hq = {hq} heads, k and v Hkv = {hkv}: Hq must be a multiple of Hkv (GQA/MQA)")
        if min(b, hq, nq, nk) < 1:
            raise ValueError(f"empty input: q {tq.shape}, k {tk.shape}; every dimension must be >= 1")
        if spec.mask.expression or spec.score_mod.expression:
            expression.check_indices(b=b, h=hq, q_idx=nq, kv_idx=nk)
        rows = nq * (hq // hkv if spec.tiling.pack_gqa else 1)
        if math.ceil(rows / self.plan.block_q) > MAX_GRID_Y:
            raise ValueError(f"Nq = {nq} needs more than {MAX_GRID_Y} query tiles of {self.plan.block_q} rows"
                             + (f" ({hq // hkv} query heads packed a KV head)" if spec.tiling.pack_gqa else ""))
        if out is not None:
            to = as_device_tensor(out, "out")
            shape = out_shape(tq, tv)
            named = (spec.out_element.name, spec.out_element.torch_name)
            if to.kind != tq.kind or to.dtype not in named or to.shape != shape or to.device != tq.device:
                raise ValueError(f"out: {to.kind} {to.dtype} {to.shape} on cuda:{to.device}; expected a {tq.kind} "
                                 f"{spec.out_element.torch_name} tensor [B, Hq, Nq, head_dim_v] = {shape} on cuda:{tq.device}")
            _check_layout(to, "out")
        return tq, tk, tv

    def __call__(self, q, k, v, *, scale: float | None = None, return_lse: bool = False, out=None,
                 block_mask=None, bias=None, alibi_slopes=None, sinks=None, doc_ids=None, captured=None,
                 splits: int | None = None, mask_offset: int | None = None, lse=None, q_descale=None,
                 k_descale=None, v_descale=None, scale_o=None, amax_o=None):
        """out (and lse) for q, k, v. A partial spec (outputs.partial) returns float32 partials
        (o_parts [S, B, Hq, Nq, d], lse_parts [S, B, Hq, Nq]) for `splits` shares of the KV
        tiles; fagen.splitkv merges them. An accumulating one (outputs.accumulate) folds its
        partial into the running float32 `out` [B, Hq, Nq, d] and `lse` [B, Hq, Nq] it is given
        (a ring step) and returns them. mask_offset moves the diagonal (key of query 0's
        diagonal): shards of a sequence pass their positions through it. captured: the float32
        arrays a score expression reads (score_mod.captured; each flattened, its indices checked
        against its length at this call's extents). q_descale, k_descale, v_descale: an FP8
        kernel's (FlashAttention-3's: float32, one number or [B, Hkv]; None is 1). scale_o, amax_o:
        an FP8 output's (out_dtype float8_e4m3, cuDNN's): o = e4m3(O * scale_o), saturated (a number
        or float32 [1] on q's device; None is 1), and max |O| written into amax_o (float32 [1]) where
        given."""
        key, repeated = None, self.repeated_calls
        if repeated is not None and all(x is None for x in (block_mask, bias, alibi_slopes, sinks, doc_ids, captured)):
            key = repeated.key(q, k, v, out, lse, scale, return_lse, mask_offset, splits)
            launch = None if key is None else repeated.get(key)
            result = None if launch is None else repeated.run(launch, q, k, v, out, lse, return_lse)
            if result is not None:
                return result
        partial, accumulate = self.spec.outputs.partial, self.spec.outputs.accumulate
        merged = self.spec.outputs.merge_splits  # partials inside, out and lse returned as a plain kernel's
        if accumulate:
            running = out, lse
            out, lse = self._running(q, out, lse, splits)
        elif lse is not None and (merged or not partial):
            raise ValueError(f"lse: kernel {self.spec.name} returns a fresh LSE (return_lse=True); only a split-KV "
                             f"kernel (outputs: {{partial: true}}) writes into a given one")
        if splits is not None and not partial:
            raise ValueError(f"splits={splits}: kernel {self.spec.name} is not a split-KV kernel "
                             f"(outputs: {{partial: true}})")
        if mask_offset is not None and not KINDS[self.spec.mask.kind].shiftable:
            raise ValueError(f"mask_offset: mask kind {self.spec.mask.kind!r} is not a function of q - k alone; "
                             f"shifted positions work with none, causal and sliding_window")
        tq, tk, tv = self.check(q, k, v, out if merged or not partial else None)
        if return_lse and not self.spec.outputs.lse:
            raise ValueError(f"return_lse=True, but kernel {self.spec.name} has outputs.lse: false; "
                             f"use a spec with outputs: {{lse: true}}")
        scale = side_inputs.check_scale(scale, self.spec.head_dim)
        (b, hq, nq, _), d = tq.shape, tv.shape[-1]  # O is as wide as V
        nk = tk.shape[2]
        if mask_offset is None:
            mask_offset = nk - nq if self.spec.mask.align == "bottom_right" else 0
        n_tiles = math.ceil(nk / self.plan.block_kv)
        splits = 1 if not partial else (splits or 1)
        if not 1 <= splits <= min(n_tiles, 65535):
            raise ValueError(f"splits = {splits}: must be 1..{min(n_tiles, 65535)} (the KV tiles of Nk = {nk})")
        # Everything below allocates on the launch stream, so memory a temporary frees can only
        # be reused by work ordered after this kernel.
        with cupy.cuda.Device(tq.device), stream_for(tq):
            given = dict(block_mask=block_mask, bias=bias, alibi_slopes=alibi_slopes, sinks=sinks, doc_ids=doc_ids,
                         captured=captured)
            if partial and not merged and sinks is not None:
                raise ValueError("sinks: a split-KV kernel leaves them to the merge (fagen.splitkv.merge)")
            if partial and not merged:
                given["sinks"] = None
            extras, keep_alive = self.extra_arguments(tq, tk, given)
            descaled = self.descale_arguments(tq, tk, q_descale, k_descale, v_descale)
            if descaled is not None:
                extras.update(descaled[0])
                keep_alive = [*keep_alive, descaled[1]]
            if self.spec.out_element.is_fp8 or scale_o is not None or amax_o is not None:
                scaled, held = self.output_scale_arguments(tq, scale_o, amax_o)
                extras.update(scaled)
                keep_alive = [*keep_alive, held]
            if partial:
                splits = math.ceil(n_tiles / math.ceil(n_tiles / splits))  # equal shares of the tiles
            if merged or not partial:  # out and lse are the call's (the partials, a workspace)
                out = empty_laid_out_as(tq, (b, hq, nq, d), self.spec.out_element.name) if out is None else out
                lse = empty_like(tq, (b, hq, nq), "float32")
                packed = self.pack(tq, tk, tv, out, lse, as_device_tensor(out, "out"), as_device_tensor(lse, "lse"),
                                   scale=scale, mask_offset=mask_offset, splits=splits, extras=extras,
                                   held=keep_alive)
                launch, keep_alive = packed.kernel, packed.held
            else:  # the partials are the caller's: split-KV's, or a ring step's running out and lse
                out = empty_like(tq, (splits, b, hq, nq, d), "float32") if out is None else out
                lse = empty_like(tq, (splits, b, hq, nq), "float32") if lse is None else lse
                to = as_device_tensor(out, "out")
                if to.shape != (splits, b, hq, nq, d) or to.dtype != "float32" or to.strides[-1] != 1:
                    raise ValueError(f"out: {to.dtype} {to.shape}; a split-KV kernel writes float32 "
                                     f"[{splits}, {b}, {hq}, {nq}, {d}]")
                if self.spec.fp8_kv and (to.ptr % 16 or any(x % 4 for x in to.strides[:-1])):
                    raise ValueError(f"out: strides {to.strides} at {to.ptr:#x}; an FP8 KV cache's split kernel writes "
                                     f"16 bytes at a time: pass 16-byte-aligned partials (a fresh contiguous tensor)")
                tl = as_device_tensor(lse, "lse")
                rows = tl.strides[2] if accumulate else nq  # an accumulating kernel reads the heads' stride
                if tl.shape != (splits, b, hq, nq) or tl.dtype != "float32" or tl.strides[1:] != (hq * rows, rows, 1):
                    raise ValueError(f"lse: {tl.dtype} {tl.shape} strides {tl.strides}; a split-KV kernel writes "
                                     f"float32 [{splits}, {b}, {hq}, {nq}], each split's rows contiguous")
                extras.update(self.split_arguments(nk, splits, to, tl))
                if accumulate:
                    extras["lse_head_stride"] = np.int64(tl.strides[2])
                to = DeviceTensor(to.obj, to.kind, to.ptr, to.shape[1:], to.strides[1:], to.dtype, to.device)
                launch = self.launch(tq, tk, tv, to, tl, scale=scale, mask_offset=mask_offset, splits=splits,
                                     extras=extras)
            launch(None)
            if key is not None:  # checked and packed: the key's later calls launch this
                repeated.keep(key, launch)
            del keep_alive  # side inputs copied for this launch: freed only after it is enqueued
        if accumulate:
            return running
        return (out, lse) if return_lse or partial and not merged else out

    def descale_arguments(self, tq: DeviceTensor, tk: DeviceTensor, q_descale, k_descale, v_descale,
                          moving: tuple[str, ...] = ()) -> tuple[dict, object] | None:
        """An FP8 kernel's descale arguments (each descale's address and (sequence, KV head)
        strides, fp8_inputs.descale_views) and the arrays behind them, but the `moving` ones (each
        call's own, re-pointed by a prepared call: not to be kept alive); None for others (which
        refuse descales)."""
        given = [name for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
                 if x is not None]
        spec = self.spec
        if not (spec.element.is_fp8 or spec.fp8_kv):
            if given:
                raise ValueError(f"{given[0]}: kernel {spec.name} takes {spec.dtype} inputs; descales "
                                 f"are for FP8 ones (dtype float8_e4m3)")
            return None
        # (an FP8 KV cache's q_descale: an FP8 q's, which the kernel widens as it lands; None reads 1)
        views = fp8_inputs.descale_views(q_descale, k_descale, v_descale, tq.shape[0], tk.shape[1], tq.obj)
        return descale_parameters(views), [array for name, (array, _, _) in views.items() if name not in moving]

    def output_scale_arguments(self, tq: DeviceTensor, scale_o, amax_o) -> tuple[dict, list]:
        """An FP8 output's kernel arguments (scale_o's address; amax_o's, zeroed on the launch's
        stream, or null where not asked for) and the arrays behind them; refused for other kernels."""
        spec = self.spec
        if not spec.out_element.is_fp8:
            name = "scale_o" if scale_o is not None else "amax_o"
            raise ValueError(f"{name}: kernel {spec.name} writes o in {spec.out_element.name}; scale_o and amax_o are "
                             f"an FP8 output's: compile fagen.variants.output_type_variant(spec, 'float8_e4m3') "
                             f"(FP8 q, k, v) for it, or drop them")
        scale = fp8_inputs.output_scale(scale_o, tq.obj)
        amax = 0
        if amax_o is not None:
            amax = as_device_tensor(fp8_inputs.output_amax(amax_o, tq.obj), "amax_o").ptr
            cupy.cuda.runtime.memsetAsync(amax, 0, 4, cupy.cuda.get_current_stream().ptr)  # the kernel max()es into it
        return dict(scale_o=np.uint64(as_device_tensor(scale, "scale_o").ptr), amax_o=np.uint64(amax)), [scale, amax_o]

    def merge_arguments(self, tq: DeviceTensor, hkv: int, out: DeviceTensor, lse: DeviceTensor) -> tuple[dict, object]:
        """outputs.merge_splits: the kernel arguments of the merged out (q's rows at V's width, any 16-byte-aligned
        strides) and LSE ([B, Hq, Nq], contiguous), and the tiles' arrival counts, allocated here
        (zeros; the kernel leaves them so): keep them as long as the launch is used."""
        _check_layout(out, "out")
        b, hq, nq, _ = tq.shape
        counts = zeros_like(tq, (math.prod(self.plan.tiles(b, hq, hkv, nq, 1)),), "int32")
        return dict(merged_o=out.ptr, merged_sb=np.int64(out.strides[0]), merged_sh=np.int64(out.strides[1]),
                    merged_sn=np.int64(out.strides[2]), merged_lse=lse.ptr,
                    split_counts=as_device_tensor(counts, "split_counts").ptr), counts

    def _running(self, q, out, lse, splits) -> tuple:
        """An accumulating kernel's running out and lse, checked, with out as one split's
        partials ([1, B, Hq, Nq, d]) for the split-KV path."""
        if out is None or lse is None:
            raise ValueError(f"kernel {self.spec.name} accumulates (outputs.accumulate): pass the running "
                             f"out (float32 [B, Hq, Nq, d]; zeros to start) and lse (float32 [B, Hq, Nq]; -inf)")
        if splits not in (None, 1):
            raise ValueError(f"splits={splits}: an accumulating kernel folds one partial a row (splits=1)")
        tq = as_device_tensor(q, "q")
        for name, x, shape in (("out", out, tq.shape), ("lse", lse, tq.shape[:3])):
            t = as_device_tensor(x, name)
            if t.kind != tq.kind or t.dtype != "float32" or t.shape != shape or t.device != tq.device \
                    or t.strides[-1] != 1:
                raise ValueError(f"{name}: {t.kind} {t.dtype} {t.shape} on cuda:{t.device}; the running {name} is a "
                                 f"{tq.kind} float32 {shape} on cuda:{tq.device} with a contiguous last dim")
        to = as_device_tensor(out, "out")
        if to.ptr % 16 or any(s % 4 for s in to.strides[:-1]):  # f32 pairs, and rows the producer prefetches whole
            raise ValueError(f"out: strides {to.strides} (elements) and address must be multiples of 4 elements / 16 "
                             f"bytes (the fold reads and writes whole row pieces); pass a contiguous running out")
        tl = as_device_tensor(lse, "lse")
        if tl.strides[0] != tq.shape[1] * tl.strides[1]:
            raise ValueError(f"lse: strides {tl.strides}; the running LSE's heads must lie evenly across the batch "
                             f"(a slice of [B, Hq, N] along N is fine): pass lse.contiguous()")
        return (out[None] if tq.kind == "cupy" else out.unsqueeze(0)), lse[None] if tq.kind == "cupy" else lse.unsqueeze(0)

    def pack(self, tq: DeviceTensor, tk: DeviceTensor, tv: DeviceTensor, out, lse, to: DeviceTensor,
             tl: DeviceTensor, *, scale: float, mask_offset: int, splits: int, extras: dict, held: list,
             indices: tuple[str, ...] = (), sinks=None, merged_views: tuple | None = None) -> Packed:
        """The launches writing a call's final `out` and `lse` (arrays; `to`, `tl`: the kernel's
        [B, Hq, Nq, d] and [B, Hq, Nq] views of them) from checked inputs and arguments: the
        one launch path of plain, decode, varlen, paged and prepared calls. A split kernel
        (outputs.partial) writes float32 partials into a workspace allocated here (held), one
        row block a split of `splits`; its last split merges them (outputs.merge_splits), or the
        merge kernel after it does, `sinks` joining there. The merge reads the partials as
        [splits, *shape of out]: `merged_views` gives out and lse as it sees them where the
        kernel's views are not (a varlen batch: [1, Hq, total_q, d]). `indices`: the layout's
        index parameters a prepared call re-points (its slots after q, k, v)."""
        if self.spec.element.is_fp8:  # the kernel reads V^T (fp8_inputs), kept with the launch
            vt = v_transposed(tv, extras.get("cu_seqlens_k"))
            held = [*held, vt]
            tv = as_device_tensor(vt, "v")
        if not self.spec.outputs.partial:
            launch = self.launch(tq, tk, tv, to, tl, scale=scale, mask_offset=mask_offset, splits=1, extras=extras,
                                 indices=indices)
            return Packed(self.spec, out, lse, launch, None, held)
        merge_out, merge_lse = merged_views or (out, lse)
        b, hq, nq, _ = tq.shape
        parts_shape = (splits, *(to.shape if merged_views is None else as_device_tensor(merge_out, "out").shape))
        o_parts = empty_like(tq, parts_shape, "float32")
        lse_parts = empty_like(tq, parts_shape[:-1], "float32")
        tp, tlp = as_device_tensor(o_parts, "o_parts"), as_device_tensor(lse_parts, "lse_parts")
        held = [*held, o_parts, lse_parts]
        extras = {**extras, **self.split_arguments(tk.shape[2], splits, tp, tlp)}
        if self.spec.outputs.merge_splits:
            args, counts = self.merge_arguments(tq, tk.shape[1], to, tl)
            extras.update(args)
            held.append(counts)
        # one split's partials as the kernel indexes them: [B, Hq, Nq, d] (a varlen batch: its one sequence)
        one = DeviceTensor(tp.obj, tp.kind, tp.ptr, (b, hq, nq, tp.shape[-1]),
                           (0 if parts_shape[1] == 1 else tp.strides[1], tp.strides[2], tp.strides[3], 1), tp.dtype, tp.device)
        launch = self.launch(tq, tk, tv, one, tlp, scale=scale, mask_offset=mask_offset, splits=splits, extras=extras,
                             indices=indices)
        if self.spec.outputs.merge_splits:
            return Packed(self.spec, out, lse, launch, None, held, split_counts=counts)
        merge = merge_launch(o_parts, lse_parts, merge_out, merge_lse, sinks=sinks)
        return Packed(self.spec, out, lse, launch, merge, [*held, merge.held])

    def split_arguments(self, n_kv: int, splits: int, parts: DeviceTensor, lse_parts: DeviceTensor) -> dict:
        """A split kernel's arguments: each split's share of the KV tiles and the partials' split strides."""
        per_split = math.ceil(math.ceil(n_kv / self.plan.block_kv) / splits)
        return dict(kv_tiles_per_split=np.int32(per_split), o_split_stride=np.int64(parts.strides[0]),
                    lse_split_stride=np.int64(lse_parts.strides[0]))

    def launch(self, tq: DeviceTensor, tk: DeviceTensor, tv: DeviceTensor, to: DeviceTensor, tl: DeviceTensor, *,
               scale: float, mask_offset: int, splits: int, extras: dict, indices: tuple[str, ...] = ()) -> Launch:
        """The launch for checked tensors (out `to`, lse `tl`; split-KV: one split's view) and
        arguments; its slots q, k, v, the index parameters `indices` (a batch layout's: paged
        cache_seqlens, page_table), o, lse take other tensors' addresses (prepared calls)."""
        b, hq, nq, _ = tq.shape
        values = dict(q=tq.ptr, k=tk.ptr, v=tv.ptr, o=to.ptr, lse=tl.ptr, n_q=nq, n_kv=tk.shape[2],
                      mask_offset=mask_offset, heads_q=hq, group=hq // tk.shape[1], scale=scale,
                      scale_log2=scale * LOG2E, **extras)
        for t, name in ((tq, "q"), (tk, "k"), (tv, "v"), (to, "o")):
            values.update(zip((f"{name}_sb", f"{name}_sh", f"{name}_sn"), t.strides[:3]))
        maps = tuple(TensorMap(f"{name}_map", name, self.spec.dtype, tensor_maps.layout(*_mapped(t, total), self.spec.element.bytes, rows, name))
                     for t, name, rows, total in ((tq, "q", self.plan.block_q, extras.get("total_q")),
                                                  (tk, "k", self.plan.block_kv, extras.get("total_k")),
                                                  (tv, "v", *((self.plan.head_dim_v, None) if self.spec.element.is_fp8
                                                              else (self.plan.block_kv, extras.get("total_k")))))
                     ) if self.plan.warp_specialized else ()
        tiles = self.plan.tiles(b, hq, tk.shape[1], nq, splits, total_q=int(extras["total_q"]) if "total_q" in extras else None)
        grid, counters = tiles, None
        if self.plan.scheduler_params:  # the blocks walk the tile grid: a block a tile, or one an SM
            kv_bytes = tk.shape[2] * (tk.shape[3] + tv.shape[3]) * self.spec.element.bytes // splits  # a KV head's K and V (a split's share)
            per_x = kv_bytes if self.spec.tiling.pack_gqa else kv_bytes // (hq // tk.shape[1])  # x: a query head, unpacked
            values.update(tiles_x=tiles[0], tiles_y=tiles[1], tiles_z=tiles[2],
                          tiles_section=l2_section(*tiles[:2], per_x, device.l2_bytes(tq.device),
                                                   extras.get("even_tiles", KINDS[self.spec.mask.kind].even_tiles)))
            count = math.prod(tiles)
            grid = (min(count, device.multiprocessors(tq.device)) if self.plan.persistent else count, 1, 1)
            if self.plan.claimed_walk and "tiles_claimed" not in values:  # a padded grid's walk
                # its counter pair (tiles claimed, blocks done), zeroed here and by each launch's
                # last block after it, kept with the launch; null where the tiles are one wave
                counters = zeros_like(tq, (2,), "int32") if count > grid[0] else None
                values["tiles_claimed"] = 0 if counters is None else as_device_tensor(counters, "tiles_claimed").ptr
        # a prepared call re-points the inputs and the outputs it returns (the merged ones, where the
        # partials are a workspace)
        outputs = ("merged_o", "merged_lse") if self.spec.outputs.merge_splits else ("o", "lse")
        return Launch(self.function, grid, self.plan.threads, self.plan.smem_bytes, self.plan.params, values,
                      slots=("q", "k", "v", *indices, *outputs), maps=maps,
                      dependent=self.dependent_launch and pays_off(2 * math.prod(tk.shape) * self.spec.kv_element.bytes),
                      held=counters)

    def extra_arguments(self, tq: DeviceTensor, tk: DeviceTensor, given: dict) -> tuple[dict, list]:
        """The mask and score-modifier arrays this kernel reads, checked, as kernel arguments by
        parameter name, and the device arrays behind them (keep them until the launch).
        Refuses an array the spec does not use, a missing one it needs, and wrong shapes, by the
        oracle's rules (fagen.side_inputs) and before anything reaches the device."""
        spec, (b, hq, nq, _), nk = self.spec, tq.shape, tk.shape[2]
        if not self.takes_side_inputs and all(value is None for value in given.values()):
            return {}, []  # the common launch: nothing to check or pass
        side_inputs.require_mask_inputs(spec.mask.kind, has_block_mask=given["block_mask"] is not None,
                                        has_doc_ids=given["doc_ids"] is not None)
        wants = {
            "block_mask": KINDS[spec.mask.kind].side_input == "block_mask",
            "doc_ids": KINDS[spec.mask.kind].side_input == "doc_ids",
            "bias": spec.score_mod.bias != "none",
            "alibi_slopes": spec.score_mod.alibi == "slopes",
            "sinks": self.takes_sinks,
            "captured": spec.score_mod.captured > 0,
        }
        for name, value in given.items():
            if value is not None and not wants[name] and not (name == "alibi_slopes" and spec.score_mod.alibi != "none"):
                raise ValueError(f"{name}: kernel {spec.name} does not take it; use a spec whose "
                                 f"{'mask' if name in ('block_mask', 'doc_ids') else 'score_mod'} asks for it "
                                 f"(see the README's masks and modifiers)")
            if value is None and wants[name]:
                raise ValueError(f"{name} is required: kernel {spec.name} was generated for it")
        side_inputs.check_shapes(b, hq, nq, nk, bias_kind=spec.score_mod.bias, **{
            name: tuple(np.shape(given[name])) for name in ("doc_ids", "alibi_slopes", "sinks", "bias")
            if given[name] is not None})
        args: dict = {}
        held: list = []
        if wants["block_mask"]:
            args.update(block_mask_arguments(given["block_mask"], self.plan.block_q, self.plan.block_kv, b, hq, nq, nk))
        if wants["doc_ids"]:
            docs = _doc_ids(given["doc_ids"], tq.device)
            bounds = document_bounds(docs, tq)  # what the loops read, the backward's as the forward's
            held += [docs.obj, bounds]
            args.update(doc_bounds=as_device_tensor(bounds, "doc_bounds").ptr,
                        doc_sb=np.int64(docs.strides[0] if docs.shape[0] > 1 else 0))
        if spec.score_mod.alibi != "none":
            slopes = given["alibi_slopes"]
            slopes = geometric_alibi_slopes(hq, tq.device) if slopes is None else _aux_array(slopes, "alibi_slopes", "float32", tq.device)
            held.append(cupy.ascontiguousarray(slopes))
            args.update(alibi_slopes=_ptr(held[-1]))
        if wants["bias"]:
            bias = _aux_array(given["bias"], "bias", "float32", tq.device)
            if bias.strides[-1] != 4:
                raise ValueError(f"bias: strides {bias.strides} (bytes); kernel {spec.name} reads the last dim at "
                                 f"unit stride: pass a contiguous copy")
            held.append(bias)
            st = [s // 4 if n > 1 else 0 for s, n in zip(bias.strides, bias.shape)]
            args.update(bias=_ptr(bias), bias_sb=np.int64(st[0]), bias_sh=np.int64(st[1]),
                        bias_sq=np.int64(st[2] if bias.ndim == 4 else 0))
        if wants["sinks"]:
            raw = given["sinks"]
            sinks = _aux_array(raw, "sinks", "float32", tq.device)
            # reading them back costs a host sync: once per array object, as for doc_ids
            side_inputs.once_per_object("finite sinks", raw,
                                        lambda: side_inputs.check_finite("sinks", cupy.asnumpy(sinks).tolist()))
            held.append(cupy.ascontiguousarray(sinks))
            args.update(sinks=_ptr(held[-1]))
        if wants["captured"]:
            arrays = captured_arrays(spec, given.get("captured"), dict(b=b, h=hq, q_idx=nq, kv_idx=nk), tq.device)
            held += arrays
            for name, a in zip(expression.captured_names(len(arrays)), arrays):
                args.update({name: _ptr(a), f"{name}_size": np.int32(a.size)})
        return args, held


def _check_sorted(docs) -> None:
    """doc_ids must be non-decreasing: the bounds kernel binary-searches each position's document."""
    if docs.shape[1] > 1 and bool((docs[:, 1:] < docs[:, :-1]).any()):
        raise ValueError("doc_ids must be non-decreasing along the sequence (packed documents); "
                         "sort the packing or build a block mask with fagen.masks.document")


@cache
def shared_function(name: str, device: int):
    """A kernel no one spec owns (rendering.shared_kernels: the split-KV merges, the document
    bounds, the varlen tile table), compiled once a device and process."""
    with cupy.cuda.Device(device):
        return cupy.RawModule(code=shared_kernel(f"{name}.cu"), options=NVRTC_OPTIONS).get_function(name)


def _doc_ids(raw, device: int) -> DeviceTensor:
    """doc_ids as the kernels read them: int32 [R, N] on q's device, rows contiguous (copied
    where they are not), checked non-decreasing once per array object (the check reads them
    back: a host sync). A contiguous CUDA tensor goes through as it is: no CuPy view a call."""
    contiguous = is_torch(raw) and raw.is_cuda and raw.is_contiguous() and raw.dtype.itemsize == 4
    if contiguous and str(raw.dtype) == "torch.int32" and raw.get_device() == device:
        side_inputs.once_per_object("sorted doc_ids", raw, lambda: _check_sorted(cupy.asarray(raw)))
        return as_device_tensor(raw, "doc_ids")
    docs = _aux_array(raw, "doc_ids", "int32", device)
    side_inputs.once_per_object("sorted doc_ids", raw, lambda: _check_sorted(docs))
    return as_device_tensor(cupy.ascontiguousarray(docs), "doc_ids")


def document_bounds(docs: DeviceTensor, like: DeviceTensor, out=None):
    """Each position's document [start, end) for doc_ids `docs` ([R, N] int32, rows contiguous
    and non-decreasing): [R, N, 2] int32 into `out`, or from `like`'s allocator (PyTorch's for
    torch tensors: a CUDA graph may capture it), resolved by one launch on the current stream."""
    rows, n = docs.shape
    bounds = empty_like(like, (rows, n, 2), "int32") if out is None else out
    # pointers as 64-bit scalars: no CuPy view of a torch tensor a call
    shared_function(DOCUMENT_BOUNDS, docs.device)(((n + DOCUMENT_BOUNDS_THREADS - 1) // DOCUMENT_BOUNDS_THREADS, rows),
                                                  (DOCUMENT_BOUNDS_THREADS,),
                                                  (np.uint64(docs.ptr), np.int64(docs.strides[0]), np.int32(n),
                                                   np.uint64(as_device_tensor(bounds, "doc_bounds").ptr)))
    return bounds


# The padding-runs kernel's parameters in its signature's order (templates/kernel/padding_runs.cu.j2)
PADDING_RUNS_PARAMS = (("const void*", "mask"), ("long long", "row_stride"), ("int", "n"), ("int", "batch"),
                       ("int*", "ranges"), ("int*", "flags"))


def padding_runs(mask):
    """fagen.padding_runs' answer for a PyTorch mask [B, n] on a GPU (a dtype of its MASK_TYPES,
    slots of unit stride): (flags, key ranges int32 [2, 1, B]), by one launch on the current stream
    (a block a row) and one wait for it (a host sync, as the ops it replaces made two). The launch
    is packed once a device, mask dtype, batch and thread (PaddingRunsLaunch) and goes to the
    driver directly, its rows' flags written into pinned host memory: CuPy's argument marshalling,
    stream and device contexts and a copy back took ~70 us of host time a call on an H200 host."""
    import torch

    b, n = mask.shape
    ranges = torch.empty((2, 1, b), dtype=torch.int32, device=mask.device)  # first token's slot, last's + 1
    if not b:
        return fold_padding_flags(()), ranges
    device = mask.get_device()
    launch = _padding_runs_launch(device, mask.dtype, b, threading.get_ident())
    stream = torch_stream_handle()(device)
    if cupy.cuda.runtime.getDevice() == device:
        launch(stream, mask, n, ranges.data_ptr())
    else:
        with cupy.cuda.Device(device):
            launch(stream, mask, n, ranges.data_ptr())
    return launch.flags(stream), ranges


class PaddingRunsLaunch:
    """The padding-runs kernel's launch for masks of one dtype and batch on one GPU, packed once:
    a call re-points the mask and the ranges and rewrites n and the row stride (the launch's
    buffer is one call's at a time: one object a thread), and the rows' flags land in pinned host
    memory, which the kernel writes through its unified address and the host reads after the
    stream's work is done (no copy back)."""

    def __init__(self, device: int, mask_dtype: str, b: int):
        self._pinned = cupy.cuda.alloc_pinned_memory(4 * b)  # (unified addressing: the kernel's address too)
        self._rows = np.frombuffer(self._pinned, np.int32, b)
        with cupy.cuda.Device(device):
            self._launch = Launch(shared_function(padding_runs_name(mask_dtype), device), (b, 1, 1),
                                  PADDING_RUNS_THREADS, 0, PADDING_RUNS_PARAMS,
                                  {"mask": 0, "row_stride": 0, "n": 0, "batch": b, "ranges": 0,
                                   "flags": self._pinned.ptr}, slots=("mask", "ranges"))
        self._write = self._launch.writer(("row_stride", "n"))

    def __call__(self, stream: int, mask, n: int, ranges_ptr: int) -> None:
        self._write(mask.stride(0), n)
        self._launch(stream, mask.data_ptr(), ranges_ptr)

    def flags(self, stream: int) -> int:
        """The batch's flags, once the launch on `stream` is done (a host sync)."""
        cupy.cuda.runtime.streamSynchronize(stream)
        return fold_padding_flags(self._rows.tolist())


@lru_cache(maxsize=64)
def _padding_runs_launch(device: int, dtype, b: int, thread: int) -> PaddingRunsLaunch:
    return PaddingRunsLaunch(device, str(dtype).removeprefix("torch."), b)


def descale_parameters(views: dict) -> dict:
    """The kernel parameters of descale_views' descales: each one's address, <name>_sb and <name>_sh."""
    args = {}
    for name, (array, sb, sh) in views.items():
        args.update({name: np.uint64(as_device_tensor(array, name).ptr), f"{name}_sb": np.int64(sb),
                     f"{name}_sh": np.int64(sh)})
    return args


def v_transposed(tv: DeviceTensor, cu_seqlens: int | None = None):
    """An FP8 forward's V [B, Hkv, N, d] as its kernel reads it, V^T [B, Hkv, d, padded N] in
    fp8_inputs' key order, from `tv`'s allocator by one launch on the current stream
    (fp8_inputs.transposed_v is its twin). The kernel reads V's rows 16 bytes at a time: a V whose
    address or strides are not multiples of 16 bytes (a slice of wider rows) is copied first.
    cu_seqlens (a device address): `tv` is a varlen batch's view ([B, Hkv, max_seqlen_k, d] over
    token-major rows), sequence b's keys rows cu_seqlens[b] .. cu_seqlens[b + 1], and its V^T
    sequence b's own, padded like a [B, Hkv, max_seqlen_k, d] batch's."""
    b, h, n, d = tv.shape
    if d % 16 or d > V_TRANSPOSE_MAX_D:
        raise ValueError(f"v: head_dim {d}; the FP8 V^T kernel takes multiples of 16 up to {V_TRANSPOSE_MAX_D}")
    if b * h > MAX_GRID_Y:
        raise ValueError(f"v: B * Hkv = {b * h}; the FP8 V^T kernel's grid takes at most {MAX_GRID_Y} (split the batch)")
    if tv.ptr % 16 or any(stride % 16 for stride, size in zip(tv.strides[:3], tv.shape[:3]) if size > 1):
        if cu_seqlens is not None:  # (a copy would lose the batch's view)
            raise ValueError(f"v: address {tv.ptr:#x}, strides {tv.strides}; the FP8 V^T kernel reads a varlen "
                             f"batch's rows 16 bytes at a time: pass v.contiguous()")
        tv = as_device_tensor(tv.obj.contiguous() if tv.kind == "torch" else cupy.ascontiguousarray(tv.obj), "v")
    keys = fp8_inputs.padded_keys(n)
    vt = empty_like(tv, (b, h, d, keys), tv.dtype)
    shared_function(V_TRANSPOSE, tv.device)(
        (keys // fp8_inputs.V_TILE_KEYS, b * h), (d // 16 * 32,),  # a warp 16 of V's columns
        (np.uint64(tv.ptr), np.int64(tv.strides[0]), np.int64(tv.strides[1]), np.int64(tv.strides[2]), np.int32(h),
         np.int32(n), np.int32(d), np.uint64(as_device_tensor(vt, "v^T").ptr), np.int32(keys),
         np.uint64(cu_seqlens or 0)))
    return vt


def _ptr(a) -> np.uint64:
    return np.uint64(a.data.ptr)


def captured_arrays(spec: AttentionSpec, captured, extents: dict[str, int], device: int) -> list:
    """A call's captured arrays as the kernel reads them (float32, flattened, contiguous, on q's
    device), refused where the spec's expressions could read one outside its length while b, h,
    q_idx and kv_idx stay below `extents` (the call's B, Hq, Nq, Nk): a kernel never reads past
    an array."""
    count = spec.score_mod.captured
    if not isinstance(captured, (list, tuple)) or len(captured) != count:
        given = "none" if captured is None else f"a {type(captured).__name__}" + (
            f" of {len(captured)}" if isinstance(captured, (list, tuple)) else "")
        raise ValueError(f"captured: {given}; kernel {spec.name} reads {count} arrays (score_mod.captured): pass a "
                         f"list of {count}")
    arrays = [cupy.ascontiguousarray(_aux_array(x, f"captured[{i}]", "float32", device)).ravel()
              for i, x in enumerate(captured)]
    check_captured_indices(spec, tuple(a.size for a in arrays), tuple(sorted(extents.items())))
    return arrays


@lru_cache(maxsize=256)
def check_captured_indices(spec: AttentionSpec, sizes: tuple[int, ...], extents: tuple[tuple[str, int], ...]) -> None:
    """Every captured0[i] ... the spec's expressions read has 0 <= i < that array's size where
    each variable stays below its extent (interval bounds of the index: an index they cannot
    prove in range is refused). Cached: a repeated call checks nothing."""
    bounds = dict(extents)
    for field in ("expression", "expression_grad"):
        text = getattr(spec.score_mod, field)
        if text is None:
            continue
        for load in expression.loads(expression.score(text, spec.score_mod.captured)):
            lo, hi = expression.int_bounds(load.index, bounds)
            size = sizes[expression.captured_names(len(sizes)).index(load.array)]
            if lo < 0 or hi >= size:
                at = ", ".join(f"{name} < {n}" for name, n in bounds.items())
                raise ValueError(f"score_mod.{field}: {expression.source(load)} may read index {lo if lo < 0 else hi}"
                                 f" of {load.array}, which has {size} elements, where {at}; index it within "
                                 f"0 .. {size - 1} (clamp the index, or pass a larger array)")


def _aux_array(x, name: str, dtype: str, device: int):
    """A CuPy view of a small side input (CuPy, PyTorch or NumPy), checked for dtype."""
    if is_torch(x):
        if not x.is_cuda:
            x = x.cuda(device)
        arr = cupy.asarray(x)
    else:
        arr = cupy.asarray(x)
    if str(arr.dtype) != dtype:
        raise ValueError(f"{name}: dtype {arr.dtype}, expected {dtype}; cast it (.astype / .to)")
    if arr.device.id != device:
        raise ValueError(f"{name} is on cuda:{arr.device.id} but q on cuda:{device}")
    return arr


@cache
def geometric_alibi_slopes(heads: int, gpu: int):
    with cupy.cuda.Device(gpu):
        return cupy.asarray(np.array(side_inputs.geometric_alibi_slopes(heads), np.float32))


def block_mask_arguments(mask, block_q: int, block_kv: int, b: int, hq: int, nq: int, nk: int,
                         key_major_group: int | None = None) -> dict:
    """A BlockMask as a kernel's bm_* arguments, re-blocked to its tiles: query-major lists for
    the forward and the dQ kernel; with key_major_group, the dK/dV kernel's lists per KV block
    (fagen.masks.BlockMask.key_major). Patterns are laid out by thread (masks.thread_words).
    Device copies are cached on the mask, per device. Beside them, `even_tiles` (no parameter:
    the tile walk's order, BlockMask.even_tiles)."""
    side_inputs.check_block_mask(mask, b, hq, nq, nk)  # the oracle's rule
    tiles = mask.for_tiles(block_q, block_kv)
    key = ("device", cupy.cuda.Device().id, key_major_group)
    if key not in tiles._cache:
        if key_major_group is None:
            lists = (tiles.kv_num_blocks, tiles.kv_indices, tiles.block_types, tiles.partial_index)
        else:
            km = tiles.key_major(key_major_group)
            lists = (km.num, km.entries, km.types, km.partial_index)
        # the patterns by thread (masks.thread_words): over keys, or over queries for the dK/dV kernel's S^T
        patterns = masks.thread_words(tiles.partial_masks, block_kv, transposed=key_major_group is not None)
        tiles._cache[key] = tuple(cupy.asarray(np.ascontiguousarray(a)) for a in (*lists, patterns))
    num, idx, types, partial, bits = tiles._cache[key]
    _, heads, rows = num.shape  # rows: query blocks (query-major) or KV blocks (key-major) of a head
    return dict(bm_num=_ptr(num), bm_idx=_ptr(idx), bm_type=_ptr(types), bm_partial=_ptr(partial),
                bm_bits=_ptr(bits), bm_sb=np.int32(heads * rows if num.shape[0] > 1 else 0),
                bm_sh=np.int32(rows if heads > 1 else 0), bm_max=np.int32(idx.shape[-1]),
                bm_causal_offset=np.int32(tiles.causal_offset),
                even_tiles=tiles._cache.setdefault("even_tiles", tiles.even_tiles))


_KERNELS: dict[str, Kernel] = {}


_BY_SPEC: dict[tuple[AttentionSpec, int], Kernel] = {}


def compile_kernel(spec: AttentionSpec) -> Kernel:
    """One Kernel per (source, options, arch), device and process. A spec seen before on this
    device skips even the render (specs are frozen, so they key a dict)."""
    require_cupy()
    device = cupy.cuda.Device()
    hit = _BY_SPEC.get((spec, device.id))
    if hit is not None:
        return hit
    source = render(spec)
    key = f"{device.id}:" + cache_key(source, NVRTC_OPTIONS, f"sm_{device.compute_capability}")
    if key not in _KERNELS:
        _KERNELS[key] = Kernel(spec, source)
    _BY_SPEC[(spec, device.id)] = _KERNELS[key]
    return _KERNELS[key]


def out_shape(tq: DeviceTensor, tv: DeviceTensor) -> tuple[int, int, int, int]:
    """O's shape: q's rows, V's width [B, Hq, Nq, head_dim_v]."""
    return (*tq.shape[:3], tv.shape[-1])
