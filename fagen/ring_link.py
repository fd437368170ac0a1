"""How a block travels one hop around ring attention's ring: rank r sends the block it holds
to r + 1 and receives r - 1's, under the compute on the block it holds.

Two links do the same thing:

- `CopyEngineLink` (the default where every pair of neighbours can reach each other's memory,
  e.g. GPUs on NVLink): each rank owns two receive slots in its own memory, shared with its
  neighbours through CUDA IPC once. The sender's copy engine writes the block straight into
  the next rank's slot (cudaMemcpyAsync to a peer address), then writes the transfer's number
  into that rank's `arrived` flag; the receiver's stream waits on the flag. The flags are
  written and waited on by stream memory operations (cuStreamWriteValue64 and
  cuStreamWaitValue64), so a transfer takes no SM from the attention kernel and no host
  thread waits for anything. NCCL's send/recv runs as a kernel on SMs that the attention
  kernel holds until its last tile: on 4 H200s at 32k tokens each 64 MB send/recv took
  0.8-1.2 ms beside a 0.45 ms step, and a ring call 2.6-2.7 ms against 2.0-2.2 on the copy
  engines and 1.97 for the same launches with no transfers.
- `NcclLink`: the group's send/recv (fagen's NCCL group or torch.distributed), on a side
  stream; anywhere NCCL runs.

The copy engine link's invariant: transfer t goes into slot t % 2 of the next rank, once that
rank has released transfer t - 2 (its `released` flag, written into the sender's memory); a
rank releases a slot when the work its stream has queued on the block (the compute, and the
copy forwarding it) is done. The flags count transfers over the link's lifetime, so every rank
must make the same sequence of calls on it, as the ring's schedule makes them; like an NCCL
collective, a ring call that fails on one rank part-way leaves the others waiting.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import numpy as np

from fagen.element_types import element_type, itemsize
from fagen.device import DeviceTensor, as_device_tensor, cupy, empty_like

TRANSPORTS = ("auto", "copy_engine", "nccl")

# byte offsets in a link's allocation: the two flags on their own 128-byte lines, a word for the
# stream memory operations' self-test, then the slots
ARRIVED, RELEASED, SELF_TEST, SLOTS = 0, 128, 256, 512
CU_STREAM_WAIT_VALUE_GEQ, CU_STREAM_WRITE_VALUE_DEFAULT = 0x0, 0x0
CUDA_MEMCPY_DEFAULT = 4


def slot_offset(t: int, nbytes: int) -> int:
    """Where transfer t's block lands in the receiver's allocation (two slots, 256-byte aligned)."""
    return SLOTS + (t % 2) * _aligned(nbytes)


def release_due(t: int) -> int:
    """The transfer the receiver must have released before transfer t may overwrite its slot."""
    return t - 2


def _aligned(nbytes: int) -> int:
    return (nbytes + 255) // 256 * 256


@dataclass(frozen=True)
class Copy:
    """One cudaMemcpy2DAsync into a slot: `height` rows of `width` bytes from `src` (rows
    src_pitch apart) to `offset` in the slot (rows dst_pitch apart)."""
    src: int
    offset: int
    width: int
    height: int
    src_pitch: int
    dst_pitch: int


@dataclass(frozen=True)
class Block:
    """What travels: a contiguous array of this shape and dtype, in the ref's framework."""
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * itemsize(self.dtype)


@cache
def _driver():
    """cuStreamWaitValue64 and cuStreamWriteValue64 from libcuda (CuPy does not wrap them)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    functions = []
    for name in ("cuStreamWaitValue64_v2", "cuStreamWriteValue64_v2"):
        function = getattr(cuda, name)
        function.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        function.restype = ctypes.c_int
        functions.append(function)
    return tuple(functions)


@cache
def _capture_status():
    """cuStreamIsCapturing from libcuda."""
    function = ctypes.CDLL("libcuda.so.1").cuStreamIsCapturing
    function.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    function.restype = ctypes.c_int
    return function


def capturing(stream_ptr: int) -> bool:
    """Whether the stream is being captured into a CUDA graph."""
    status = ctypes.c_int(0)
    _check(_capture_status()(stream_ptr, ctypes.byref(status)), "cuStreamIsCapturing")
    return status.value != 0


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


class _PeerSlots:
    """A rank's allocation (flags and two slots) and its neighbours', mapped into this process;
    a stream for the copies and one for the releases. Built collectively (every rank of the group at once); None where some
    rank cannot map a neighbour's memory (no peer access)."""

    def __init__(self, base: int, nbytes: int, peers: dict[int, int], rank: int, world: int, device: int):
        self.base, self.nbytes, self.rank, self.world, self.device = base, nbytes, rank, world, device
        self.next, self.prev = peers[(rank + 1) % world], peers[(rank - 1) % world]
        with cupy.cuda.Device(device):  # the copies, and the releases (see release)
            self.stream, self.releases = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        self.forwarded: dict[int, object] = {}  # transfer -> event: the copy forwarding its block has read it
        self.sent = 0  # transfers this rank has started; the same count on every rank
        self.views: dict[tuple, object] = {}  # a slot as an array, made once (see CopyEngineLink._view)

    @classmethod
    def build(cls, group, nbytes: int, device: int) -> _PeerSlots | None:
        rt = cupy.cuda.runtime
        with cupy.cuda.Device(device):
            base = rt.malloc(SLOTS + 2 * _aligned(nbytes))
            rt.memset(base, 0, SLOTS)
            rt.deviceSynchronize()  # the flags are zero before any peer can write them
            handle = np.frombuffer(rt.ipcGetMemHandle(base), np.int32)
            handles = cupy.empty((group.world, handle.size), cupy.int32)
            group.all_gather(cupy.asarray(handle), handles)
            handles = handles.get()
            peers, failed = {group.rank: base}, cupy.zeros(1, cupy.int32)
            if not _stream_memory_operations_work(base + SELF_TEST):
                failed.fill(1)
            for r in {(group.rank + 1) % group.world, (group.rank - 1) % group.world} - {group.rank}:
                try:
                    peers[r] = rt.ipcOpenMemHandle(handles[r].tobytes())
                except cupy.cuda.runtime.CUDARuntimeError:
                    failed.fill(1)
            group.all_reduce(failed, "max")  # every rank takes the same link
            if int(failed.get()[0]):
                for r, ptr in peers.items():
                    if r != group.rank:
                        rt.ipcCloseMemHandle(ptr)
                rt.free(base)
                return None
        return cls(base, nbytes, peers, group.rank, group.world, device)

    def pass_on(self, copies: list[Copy], main, source: int | None, as_received: bool) -> int:
        """Start the next transfer into the next rank's slot: `copies` lay the block out there.
        source: the transfer whose slot here the copies read (None: memory of the caller's);
        as_received: they read it as it landed (nothing written to it since), so it leaves as
        soon as it lands, else once main's work so far is done. Returns the transfer's number."""
        wait, write = _driver()
        self.sent += 1
        t = self.sent
        if as_received and source is not None:
            _check(wait(self.stream.ptr, self.base + ARRIVED, source, CU_STREAM_WAIT_VALUE_GEQ),
                   "cuStreamWaitValue64 (the block to forward landed)")
        else:
            self.stream.wait_event(main.record())
        if release_due(t) > 0:
            _check(wait(self.stream.ptr, self.base + RELEASED, release_due(t), CU_STREAM_WAIT_VALUE_GEQ),
                   "cuStreamWaitValue64 (the next rank's slot released)")
        slot = self.next + slot_offset(t, self.nbytes)
        for c in copies:
            if c.height == 1:  # a whole block: no pitch (cudaMemcpy2D caps pitches below 2 GiB)
                cupy.cuda.runtime.memcpyAsync(slot + c.offset, c.src, c.width, CUDA_MEMCPY_DEFAULT, self.stream.ptr)
            else:
                cupy.cuda.runtime.memcpy2DAsync(slot + c.offset, c.dst_pitch, c.src, c.src_pitch, c.width, c.height,
                                                CUDA_MEMCPY_DEFAULT, self.stream.ptr)
        _check(write(self.stream.ptr, self.next + ARRIVED, t, CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue64 (arrived)")
        if source is not None:  # its slot here is free once this copy has read it (release)
            self.forwarded[source] = self.stream.record()
        return t

    def arrival(self, t: int, main) -> int:
        """main waits until transfer t has landed here; the address of its slot."""
        wait, _ = _driver()
        _check(wait(main.ptr, self.base + ARRIVED, t, CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue64 (arrived)")
        return self.base + slot_offset(t, self.nbytes)

    def release(self, t: int, main) -> None:
        """Transfer t's slot here is free once main's work so far and the copy forwarding it
        are done: tell the previous rank (from a stream of its own, so that the next block's
        forwarding never queues behind this rank's compute)."""
        _, write = _driver()
        self.releases.wait_event(main.record())
        if t in self.forwarded:
            self.releases.wait_event(self.forwarded.pop(t))
        _check(write(self.releases.ptr, self.prev + RELEASED, t, CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue64 (released)")

    def join(self, main) -> None:
        """main's later work waits for every copy started so far (the blocks they read stay
        alive in stream order)."""
        main.wait_event(self.stream.record())


def _stream_memory_operations_work(address: int) -> bool:
    """One 64-bit write and wait on a stream of this device (a driver or platform without
    stream memory operations refuses them): the link's flags need both."""
    try:
        wait, write = _driver()
        stream = cupy.cuda.Stream(non_blocking=True)
        ok = write(stream.ptr, address, 1, CU_STREAM_WRITE_VALUE_DEFAULT) == 0 and \
            wait(stream.ptr, address, 1, CU_STREAM_WAIT_VALUE_GEQ) == 0
        stream.synchronize()
        return ok
    except (OSError, AttributeError, cupy.cuda.runtime.CUDARuntimeError):
        return False


_slots: dict[tuple, _PeerSlots | None] = {}


def peer_bytes(group=None) -> int:
    """Device memory the copy-engine slots of this process hold (outside the framework's
    allocator: add it to a peak-memory reading): of one group's rings where given (a group
    of fagen.process_group, e.g. as_group(None) for torch's default one), else of all."""
    key = None if group is None else _group_key(group)
    return sum(SLOTS + 2 * _aligned(s.nbytes) for k, s in _slots.items() if s is not None and key in (None, k[0]))


def _group_key(group) -> tuple:
    return (type(group).__name__, id(getattr(group, "comm", None) or getattr(group, "pg", None)))


def peer_slots(group, purpose: str, nbytes: int, device: int) -> _PeerSlots | None:
    """The copy-engine slots for `purpose` blocks of nbytes on this group, built on first use
    (a collective: every rank reaches it in the same call) and kept for the process: a ring
    reuses them call after call, and its flags keep counting."""
    key = (_group_key(group), purpose, nbytes, device)
    if key not in _slots:
        _slots[key] = _PeerSlots.build(group, nbytes, device)
    return _slots[key]


class CopyEngineLink:
    def __init__(self, slots: _PeerSlots, ref: DeviceTensor, block: Block):
        self.slots, self.ref, self.block = slots, ref, block
        self.held = None  # the transfer whose slot this rank is computing on
        # arrays of the caller's framework a copy reads: kept until finish() joins the copies, so
        # that the allocator cannot hand their memory to later work while the copy engine reads it
        self.reading: list = []

    def send(self, held, *, as_received: bool = False):
        """Start sending `held` (a whole block) on; the returned function, called once the
        work on `held` is queued, releases the slot held before and returns the block that
        arrived. as_received: `held` is the block this link delivered last, unchanged (it
        leaves as soon as it lands, not after this rank's work so far)."""
        whole = Copy(_ptr(held), 0, self.block.nbytes, 1, self.block.nbytes, self.block.nbytes)
        self.reading.append(held)  # the caller's memory (or a slot's view, kept anyway)
        return self._send([whole], as_received)

    def send_bundle(self, held, share, position: int):
        """Start sending a bundle of shares on (the ring backward's dK/dV, travelling home):
        `held`'s first `position` shares (the bundle this link delivered last, unchanged since;
        None at position 0) and `share` after them, each share one [2, B, Hkv, rows, d] block,
        both copied straight from where they are. Returns `send`'s function; once it has
        returned, the stream's later work may write `share` again (the copy has read it)."""
        size = self.block.nbytes // self.block.shape[0]
        copies = [Copy(_ptr(share), position * size, size, 1, size, size)]
        if position:
            copies.insert(0, Copy(_ptr(held), 0, position * size, 1, position * size, position * size))
        self.reading.append(share)
        main = cupy.cuda.get_current_stream()
        arrived = self._send(copies, False)
        copied = self.slots.stream.record()

        def arrived_and_copied():
            main.wait_event(copied)
            return arrived()

        return arrived_and_copied

    def send_own(self, k, v):
        """The first hop of a ring: this rank's K and V ([B, Hkv, rows, d], contiguous) laid
        out as a block's [2, B, Hkv, rows_max, d] straight from where they are (no staging
        copy; rows_max >= rows)."""
        tk, tv = as_device_tensor(k, "k_local"), as_device_tensor(v, "v_local")
        _, b, hkv, most, d = self.block.shape
        rows, item = tk.shape[2], itemsize(self.block.dtype)
        if any(t.strides != (hkv * rows * d, rows * d, d, 1) for t in (tk, tv)):
            return _staged(self, k, v)
        half = self.block.nbytes // 2
        self.reading += [k, v]
        return self._send([Copy(t.ptr, at, rows * d * item, b * hkv, rows * d * item, most * d * item)
                           for t, at in ((tk, 0), (tv, half))], False)

    def _send(self, copies: list[Copy], as_received: bool):
        """The ring sends the block it holds: the slot of the transfer held, or before any
        arrived, the caller's own memory."""
        main = cupy.cuda.get_current_stream()
        t = self.slots.pass_on(copies, main, self.held, as_received)

        def arrived():
            if self.held is not None:
                self.slots.release(self.held, main)
            self.held = t
            return self._view(self.slots.arrival(t, main))

        return arrived

    def finish(self) -> None:
        """After the last work on the last block is queued: release its slot, join the copies."""
        main = cupy.cuda.get_current_stream()
        if self.held is not None:
            self.slots.release(self.held, main)
        self.slots.join(main)
        self.reading.clear()  # main's later work now waits for the copies that read them

    def _view(self, ptr: int):
        """The slot as an array of the ref's framework, made on the slot's first use and kept:
        building a torch tensor from a CuPy array goes through the CUDA array interface, which
        costs host time a step (and may synchronise)."""
        key = (ptr, self.block, self.ref.kind, self.ref.dtype)
        if key not in self.slots.views:
            self.slots.views[key] = self._make_view(ptr)
        return self.slots.views[key]

    def _make_view(self, ptr: int):
        """CuPy has no bfloat16: torch views the bytes as their carrier first (array_carrier); a
        CuPy caller gets its own dtype object where the block has its dtype."""
        memory = cupy.cuda.UnownedMemory(ptr, self.block.nbytes, self.slots, self.slots.device)
        if self.ref.kind != "torch":
            dtype = self.ref.obj.dtype if self.block.dtype == self.ref.dtype else self.block.dtype
            return cupy.ndarray(self.block.shape, dtype, cupy.cuda.MemoryPointer(memory, 0))
        element = element_type(self.block.dtype)
        view = cupy.ndarray(self.block.shape, element.array_carrier, cupy.cuda.MemoryPointer(memory, 0))
        import torch

        out = torch.as_tensor(view, device=self.ref.obj.device)
        return out if element.array_carrier == element.torch_name else out.view(getattr(torch, element.torch_name))


class NcclLink:
    def __init__(self, group, ref: DeviceTensor, block: Block):
        self.group, self.ref, self.block = group, ref, block
        self.spare = empty_like(ref, block.shape, block.dtype)

    def send_own(self, k, v):
        return _staged(self, k, v)

    def send_bundle(self, held, share, position: int):
        """CopyEngineLink.send_bundle's bundle: `share` written into `held` (the bundle received
        last; at position 0 a new one) behind its first `position` shares, and those position + 1
        shares sent (the previous rank sends as many: it is at the same step)."""
        out = empty_like(self.ref, self.block.shape, self.block.dtype) if held is None else held
        out[position] = share
        into, count = self.spare, position + 1
        transfer = self.group.send_recv(out[:count], into[:count], (self.group.rank + 1) % self.group.world,
                                        (self.group.rank - 1) % self.group.world)

        def arrived():
            transfer.wait()
            self.spare = out
            return into

        return arrived

    def send(self, held, *, as_received: bool = False):
        into = self.spare
        transfer = self.group.send_recv(held, into, (self.group.rank + 1) % self.group.world,
                                        (self.group.rank - 1) % self.group.world)

        def arrived():
            transfer.wait()
            self.spare = held
            return into

        return arrived

    def finish(self) -> None:
        pass


def _staged(link, k, v):
    """The first hop through a staging block: this rank's K and V copied into one, then sent."""
    held = empty_like(link.ref, link.block.shape, link.block.dtype)
    rows = as_device_tensor(k, "k_local").shape[2]
    held[0, :, :, :rows] = k
    held[1, :, :, :rows] = v
    return link.send(held)


def link(group, purpose: str, ref: DeviceTensor, block: Block, transport: str = "auto"):
    """The link a ring sends `block`s over (see the module's docstring); `transport` 'auto'
    takes the copy engines where every rank can, else NCCL. Call inside the ref's device and
    stream; collective on first use."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: expected one of {', '.join(map(repr, TRANSPORTS))} "
                         f"('auto' takes the copy engines where the GPUs reach each other's memory)")
    if transport != "nccl" and capturing(cupy.cuda.get_current_stream().ptr):
        # a captured wait or write keeps the transfer numbers of its capture: on replay the
        # flags would already hold them and nothing would be waited for
        if transport == "copy_engine":
            raise RuntimeError("transport='copy_engine' under CUDA graph capture: its flags count transfers, "
                               "and a replayed graph would repeat the captured counts; use transport='nccl'")
        transport = "nccl"
    if transport != "nccl":
        slots = peer_slots(group, purpose, block.nbytes, ref.device)
        if slots is not None:
            return CopyEngineLink(slots, ref, block)
        if transport == "copy_engine":
            raise RuntimeError("transport='copy_engine': some rank cannot map its neighbours' memory (no peer "
                               "access between the GPUs); use transport='auto' or 'nccl'")
    return NcclLink(group, ref, block)


def _ptr(x) -> int:
    return x.data_ptr() if hasattr(x, "data_ptr") else x.data.ptr
