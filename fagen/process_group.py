"""The ranks of a multi-GPU run and the collectives fagen.distributed needs from them.

Two kinds of group do the same few things (all-reduce, all-gather, a ring's send/recv that
overlaps the current stream's work):

- `NcclGroup`: fagen's own, CuPy's NCCL bindings; `init()` joins it from torchrun's variables
  (or `fagen launch`'s).
- `TorchGroup`: a `torch.distributed` ProcessGroup (NCCL backend), e.g. under torchrun after
  `dist.init_process_group("nccl")`: `as_group(None)` takes the default one.

Every collective runs in order with the work already on the caller's current stream
(PyTorch's for torch tensors, else CuPy's: fagen.device.stream_for), and later work on that
stream sees its result; no host synchronisation. `send_recv` returns at once: its transfer
runs beside what the caller enqueues next, until `wait()`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fagen.device import as_device_tensor, cupy
from fagen.element_types import itemsize


def check_rank(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of world size {world}: need world >= 1 and 0 <= rank < world")


# CUDA clamps a stream priority to the device's range: this asks for the highest (lower is higher)
HIGHEST_PRIORITY = -1000


class Transfer:
    """An overlapped send/recv: `wait()` orders the current stream's later work after it."""

    def __init__(self, wait):
        self._wait = wait

    def wait(self) -> None:
        self._wait()


# ---- fagen's own NCCL group (CuPy) ------------------------------------------------------------

@dataclass
class NcclGroup:
    rank: int
    world: int
    device: int
    comm: object  # cupy.cuda.nccl.NcclCommunicator
    _side: object = field(default=None, repr=False)  # the stream transfers run on

    def barrier(self) -> None:
        flag = cupy.zeros(1, cupy.float32)
        self.all_reduce(flag, "sum")
        cupy.cuda.get_current_stream().synchronize()

    def all_reduce(self, x, op: str = "sum") -> None:
        from cupy.cuda import nccl

        t = as_device_tensor(x, "all_reduce input")
        ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX}
        self.comm.allReduce(t.ptr, t.ptr, _size(t), _nccl_dtype(t.dtype), ops[op], _current_stream())

    def all_gather(self, x, out) -> None:
        """out [world, *x.shape] (contiguous) gets every rank's x (contiguous, same shape)."""
        from cupy.cuda import nccl

        t, o = as_device_tensor(x, "all_gather input"), as_device_tensor(out, "all_gather output")
        self.comm.allGather(t.ptr, o.ptr, _size(t) * itemsize(t.dtype), nccl.NCCL_UINT8, _current_stream())

    def send_recv(self, send, recv, to: int, source: int) -> Transfer:
        """Send `send` to rank `to` and receive `recv` (same byte count) from `source`, on a side
        stream that starts after the current stream's work so far."""
        from cupy.cuda import nccl

        if self._side is None:  # high priority: its few blocks take the next free SMs from the compute's
            self._side = cupy.cuda.Stream(non_blocking=True, priority=HIGHEST_PRIORITY)
        main = cupy.cuda.get_current_stream()
        self._side.wait_event(main.record())
        s, r = as_device_tensor(send, "send"), as_device_tensor(recv, "recv")
        nbytes = _size(s) * itemsize(s.dtype)
        nccl.groupStart()
        self.comm.send(s.ptr, nbytes, nccl.NCCL_UINT8, to, self._side.ptr)
        self.comm.recv(r.ptr, nbytes, nccl.NCCL_UINT8, source, self._side.ptr)
        nccl.groupEnd()
        done = self._side.record()  # this transfer's end, not whatever the side stream takes on later
        return Transfer(lambda: cupy.cuda.get_current_stream().wait_event(done))


def _current_stream() -> int:
    return cupy.cuda.get_current_stream().ptr


def _size(t) -> int:
    return math.prod(t.shape)


def _nccl_dtype(dtype: str):
    from cupy.cuda import nccl

    try:  # NCCL's names are NumPy's, upper-cased
        return getattr(nccl, f"NCCL_{dtype.upper()}")
    except AttributeError:
        raise ValueError(f"all_reduce of {dtype}: NCCL has no such type here") from None


# ---- a torch.distributed group ----------------------------------------------------------------

class TorchGroup:
    """A torch.distributed ProcessGroup (NCCL) doing fagen's collectives on torch views of the
    arrays, from the current CuPy stream (which is PyTorch's for torch inputs)."""

    def __init__(self, process_group=None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group('nccl') first "
                               "(under torchrun), or use fagen.distributed.init() for fagen's own NCCL group")
        self.pg = process_group if process_group is not None else dist.group.WORLD
        backend = dist.get_backend(self.pg)
        if "nccl" not in str(backend):
            raise ValueError(f"process group backend {backend!r}: fagen's collectives run on CUDA tensors; "
                             f"use the 'nccl' backend")
        self.rank, self.world = dist.get_rank(self.pg), dist.get_world_size(self.pg)
        import torch

        self.device = torch.cuda.current_device()

    def _stream(self):
        """torch's current stream made CuPy's current one (the caller's stream), for the call."""
        import contextlib

        import torch

        ptr = cupy.cuda.get_current_stream().ptr
        if ptr == torch.cuda.current_stream().cuda_stream:
            return contextlib.nullcontext()
        if ptr == 0:  # the legacy default stream: torch's own object for it, not an external wrapper of 0
            return torch.cuda.stream(torch.cuda.default_stream())
        return torch.cuda.stream(torch.cuda.ExternalStream(ptr))

    def barrier(self) -> None:
        flag = cupy.zeros(1, cupy.float32)
        self.all_reduce(flag, "sum")
        cupy.cuda.get_current_stream().synchronize()

    def all_reduce(self, x, op: str = "sum") -> None:
        import torch.distributed as dist

        with self._stream():
            dist.all_reduce(_torch(x), op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=self.pg)

    def all_gather(self, x, out) -> None:
        import torch.distributed as dist

        with self._stream():
            dist.all_gather_into_tensor(_torch(out), _torch(x), group=self.pg)

    def send_recv(self, send, recv, to: int, source: int) -> Transfer:
        import torch.distributed as dist

        with self._stream():
            ops = [dist.P2POp(dist.isend, _torch(send), dist.get_global_rank(self.pg, to), self.pg),
                   dist.P2POp(dist.irecv, _torch(recv), dist.get_global_rank(self.pg, source), self.pg)]
            works = dist.batch_isend_irecv(ops)

        def wait():
            with self._stream():
                for work in works:
                    work.wait()  # NCCL: the current stream waits, the host does not

        return Transfer(wait)


def _torch(x):
    """A torch view of a CUDA array (no copy)."""
    import torch

    return x if torch.is_tensor(x) else torch.as_tensor(x, device=f"cuda:{x.device.id}")


def as_group(group):
    """fagen's NcclGroup as it is; a torch.distributed ProcessGroup (None: the default one)
    wrapped in a TorchGroup."""
    if isinstance(group, (NcclGroup, TorchGroup)):
        return group
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None
    if group is None or (dist is not None and isinstance(group, dist.ProcessGroup)):
        return TorchGroup(group)
    raise TypeError(f"group: {type(group).__name__}; expected fagen.distributed.init()'s group or a "
                    f"torch.distributed ProcessGroup (None: the default group)")


# ---- joining and launching ------------------------------------------------------------------

def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"{name} is not set: start the processes with `fagen launch -n N script.py` "
                               f"or torchrun")
        return default
    return int(value)


def _encode_id(uid) -> str:
    """NCCL's unique id as text: bytes in newer CuPy, a tuple of ints in older ones."""
    if isinstance(uid, (bytes, bytearray)):
        return json.dumps({"bytes": bytes(uid).hex()})
    return json.dumps({"ints": list(uid)})


def _decode_id(text: str):
    data = json.loads(text)
    return bytes.fromhex(data["bytes"]) if "bytes" in data else tuple(data["ints"])


def init(timeout_s: float = 120.0) -> NcclGroup:
    """Join fagen's NCCL group: RANK, WORLD_SIZE, LOCAL_RANK from the environment (fagen launch
    or torchrun); the NCCL id travels through fagen's rendezvous folder, or torch's TCPStore
    at MASTER_ADDR:MASTER_PORT under torchrun."""
    from cupy.cuda import nccl

    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    check_rank(rank, world)
    local = _env_int("LOCAL_RANK", rank)
    if local >= cupy.cuda.runtime.getDeviceCount():
        raise RuntimeError(f"rank {rank}: LOCAL_RANK {local} but this machine has "
                           f"{cupy.cuda.runtime.getDeviceCount()} GPUs")
    cupy.cuda.Device(local).use()
    folder = os.environ.get("FAGEN_RENDEZVOUS")
    if folder:
        path = Path(folder) / "nccl_id.json"
        if rank == 0:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(_encode_id(nccl.get_unique_id()))
            tmp.rename(path)
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: no NCCL id from rank 0 after {timeout_s:.0f} s")
            time.sleep(0.05)
        uid = _decode_id(path.read_text())
    else:
        from datetime import timedelta

        import torch.distributed as dist

        # under torchrun its agent already serves the store at MASTER_PORT: every rank is a client
        serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), _env_int("MASTER_PORT", 29500),
                              world, serve, timeout=timedelta(seconds=timeout_s))
        if rank == 0:
            store.set("fagen_nccl_id", _encode_id(nccl.get_unique_id()))
        uid = _decode_id(store.get("fagen_nccl_id").decode())
    comm = nccl.NcclCommunicator(world, uid, rank)
    return NcclGroup(rank, world, local, comm)


def launch(n: int, argv: list[str], timeout_s: float | None = None) -> int:
    """Start n copies of `python argv...`, one per GPU, with torchrun's variables; wait; if a
    rank fails, stop the others and report that rank's error instead of hanging."""
    if n < 1:
        raise ValueError(f"-n {n}: need at least one process")
    with tempfile.TemporaryDirectory(prefix="fagen-rdzv-") as rdzv:
        procs, logs = [], []
        port = 29500 + os.getpid() % 1000  # torch.distributed's rendezvous, for scripts that use it
        for rank in range(n):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       FAGEN_RENDEZVOUS=rdzv, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
            log = open(Path(rdzv) / f"rank{rank}.err", "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, *argv], env=env, stderr=log))
        start, failed = time.monotonic(), None
        while failed is None and any(p.poll() is None for p in procs):
            for rank, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    failed = rank
                    break
            if timeout_s and time.monotonic() - start > timeout_s:
                failed = -1
            time.sleep(0.05)
        if failed is None:
            failed = next((r for r, p in enumerate(procs) if p.returncode), None)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for rank, log in enumerate(logs):
            log.seek(0)
            text = log.read()
            log.close()
            if text.strip() and (failed is None or rank == failed):
                sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))
        if failed == -1:
            sys.stderr.write(f"fagen launch: timed out after {timeout_s} s; stopped every rank\n")
            return 124
        if failed is not None:
            sys.stderr.write(f"fagen launch: rank {failed} failed with exit code {procs[failed].returncode}; "
                             f"stopped the other ranks\n")
            return procs[failed].returncode or 1
        return 0
