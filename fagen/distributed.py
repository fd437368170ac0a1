"""Attention across GPUs over NCCL (one process per GPU).

Schedules (the index arithmetic is pure and simulated rank by rank on the CPU in the tests):

1. batch_sharded       each rank computes a slice of the batch; outputs all-gathered.
2. sequence_sharded    each rank holds a contiguous shard of K/V; split-KV partials; the
                       softmax max/sum are synchronised once, at the end (seed 003's deferred
                       sync): all-reduce max of LSE, then sums of weighted O and weights;
                       sinks join there.
3. ring_zigzag_causal  K/V on every rank; rank r takes query chunks r and 2n-1-r of 2n
                       (seed 004), so cheap early rows pair with expensive late ones; fully
                       masked KV tiles are skipped by the causal kernel; outputs are written
                       contiguously per rank, all-gathered and reshuffled to sequence order.
4. ring_attention      each rank holds only its zigzag chunks of Q, K and V; K/V travel
                       around the ring by NCCL send/recv, overlapped with the local kernel;
                       partials merge by LSE in float32.

`fagen launch -n N script.py` (or torchrun) starts the processes; `init()` joins them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fagen.runtime import compile_kernel, default_spec
from fagen.splitkv import merge

# ---- schedules (pure) ------------------------------------------------------------------------


def shard_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` contiguous pieces of n, sizes differing by at most 1 (the first
    n % parts pieces one longer): lengths need not divide."""
    if parts < 1:
        raise ValueError(f"parts = {parts}: must be >= 1")
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def zigzag_chunks(rank: int, ring_size: int) -> tuple[int, int]:
    """Seed 004: of 2 * ring_size chunks, rank r takes r and 2 * ring_size - 1 - r."""
    check_rank(rank, ring_size)
    return rank, 2 * ring_size - 1 - rank


def zigzag_rows(n: int, rank: int, ring_size: int) -> list[tuple[int, int]]:
    chunks = shard_bounds(n, 2 * ring_size)
    return [chunks[c] for c in zigzag_chunks(rank, ring_size)]


def zigzag_order(n: int, ring_size: int) -> np.ndarray:
    """Sequence positions in the order the all-gather lays them out (rank 0's two chunks, then
    rank 1's, ...): out_sequence[order] = gathered, the reshuffle."""
    return np.concatenate([np.arange(s, e) for r in range(ring_size) for s, e in zigzag_rows(n, r, ring_size)])


def reshuffle(gathered: np.ndarray, n: int, ring_size: int, axis: int = -2) -> np.ndarray:
    """Undo the zigzag: rows of `gathered` (rank-major, two chunks each) back to sequence order."""
    order = zigzag_order(n, ring_size)
    out = np.empty_like(gathered)
    index = [slice(None)] * gathered.ndim
    index[axis] = order
    out[tuple(index)] = gathered
    return out


def causal_pairs(rows: tuple[int, int], keys: tuple[int, int]) -> int:
    """Kept (q, k) pairs, k <= q, between a block of query rows and a block of keys."""
    total = 0
    for q in range(*rows):
        total += max(0, min(q + 1, keys[1]) - keys[0])
    return total


def work_per_rank(n: int, ring_size: int, schedule: str = "zigzag", causal: bool = True) -> list[int]:
    """Kept (q, k) pairs each rank computes for self-attention over n positions.
    schedule: zigzag (mode 3/4) or contiguous (rank r takes rows chunk r of ring_size)."""
    work = []
    for r in range(ring_size):
        rows = zigzag_rows(n, r, ring_size) if schedule == "zigzag" else [shard_bounds(n, ring_size)[r]]
        work.append(sum(causal_pairs(rr, (0, n)) if causal else (rr[1] - rr[0]) * n for rr in rows))
    return work


def imbalance(work: list[int]) -> float:
    """max / mean - 1: 0 is perfect balance."""
    mean = sum(work) / len(work)
    return max(work) / mean - 1.0 if mean else 0.0


def ring_pair_kind(q_chunk: int, kv_chunk: int) -> str:
    """Causal relation of a query chunk and a KV chunk of the same sequence."""
    return "full" if kv_chunk < q_chunk else ("diagonal" if kv_chunk == q_chunk else "skip")


def merge_numpy(o_parts: np.ndarray, lse_parts: np.ndarray, sinks=None) -> tuple[np.ndarray, np.ndarray]:
    """The merge kernel's math in float64: partials [S, ..., H, N, d] and LSEs [S, ..., H, N];
    sinks [H] line up with the head axis."""
    lse_parts = np.asarray(lse_parts, np.float64)
    m = lse_parts.max(axis=0)
    if sinks is not None:
        sink = np.asarray(sinks, np.float64).reshape(-1, 1)
        m = np.maximum(m, sink)
    seen = np.isfinite(m)
    m0 = np.where(seen, m, 0.0)
    w = np.exp(lse_parts - m0)
    total = w.sum(axis=0) + (np.exp(sink - m0) if sinks is not None else 0.0)
    total = np.where(seen, total, 1.0)
    out = (w[..., None] * np.asarray(o_parts, np.float64)).sum(axis=0) / total[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m0 + np.log(total), -np.inf)
    return out, lse


def check_rank(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of world size {world}: need world >= 1 and 0 <= rank < world")


# ---- process group ---------------------------------------------------------------------------

@dataclass
class Group:
    rank: int
    world: int
    device: int
    comm: object  # cupy.cuda.nccl.NcclCommunicator

    def barrier(self) -> None:
        import cupy

        flag = cupy.zeros(1, cupy.float32)
        self.all_reduce(flag, "sum")
        cupy.cuda.get_current_stream().synchronize()

    def all_reduce(self, x, op: str = "sum") -> None:
        from cupy.cuda import nccl

        ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX}
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, _nccl_dtype(x), ops[op],
                            _cupy_stream_ptr())

    def all_gather(self, x):
        """[world, *x.shape] of every rank's x (same shape on every rank)."""
        import cupy

        out = cupy.empty((self.world,) + x.shape, x.dtype)
        x = cupy.ascontiguousarray(x)
        from cupy.cuda import nccl

        self.comm.allGather(x.data.ptr, out.data.ptr, x.nbytes, nccl.NCCL_UINT8, _cupy_stream_ptr())
        return out


def _cupy_stream_ptr() -> int:
    import cupy

    return cupy.cuda.get_current_stream().ptr


def _nccl_dtype(x):
    from cupy.cuda import nccl

    return {"float32": nccl.NCCL_FLOAT32, "float16": nccl.NCCL_FLOAT16, "float64": nccl.NCCL_FLOAT64,
            "int32": nccl.NCCL_INT32}[str(x.dtype)]


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


def init(timeout_s: float = 120.0) -> Group:
    """Join the process group: RANK, WORLD_SIZE, LOCAL_RANK from the environment (fagen launch
    or torchrun); the NCCL id travels through fagen's rendezvous folder, or torch's TCPStore
    at MASTER_ADDR:MASTER_PORT under torchrun."""
    import cupy
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

        store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), _env_int("MASTER_PORT", 29500),
                              world, rank == 0, timeout=timedelta(seconds=timeout_s))
        if rank == 0:
            store.set("fagen_nccl_id", _encode_id(nccl.get_unique_id()))
        uid = _decode_id(store.get("fagen_nccl_id").decode())
    comm = nccl.NcclCommunicator(world, uid, rank)
    return Group(rank, world, local, comm)


def launch(n: int, argv: list[str], timeout_s: float | None = None) -> int:
    """Start n copies of `python argv...`, one per GPU, with torchrun's variables; wait; if a
    rank fails, stop the others and report that rank's error instead of hanging."""
    if n < 1:
        raise ValueError(f"-n {n}: need at least one process")
    with tempfile.TemporaryDirectory(prefix="fagen-rdzv-") as rdzv:
        procs, logs = [], []
        for rank in range(n):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", FAGEN_RENDEZVOUS=rdzv,
                       NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
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


# ---- the four modes (each rank calls these with its group) -----------------------------------

def _kernel(dtype: str, head_dim: int, causal: bool, partial: bool):
    return compile_kernel(default_spec(dtype, head_dim, causal, partial=partial))


def _dtype(x) -> str:
    return str(x.dtype).removeprefix("torch.")


def batch_sharded(group: Group, q, k, v, *, causal: bool = False):
    """Mode 1: rank r computes batch rows shard_bounds(B, world)[r]; outputs all-gathered."""
    import cupy

    b = q.shape[0]
    bounds = shard_bounds(b, group.world)
    lo, hi = bounds[group.rank]
    per = bounds[0][1] - bounds[0][0]
    local = cupy.zeros((per,) + q.shape[1:], q.dtype)
    if hi > lo:
        kernel = _kernel(_dtype(q), q.shape[-1], causal, False)
        kernel(q[lo:hi], k[lo:hi], v[lo:hi], out=local[: hi - lo])
    gathered = group.all_gather(local)  # [world, per, H, N, d], padded shards
    return cupy.concatenate([gathered[r, : e - s] for r, (s, e) in enumerate(bounds)], axis=0)


def sequence_sharded(group: Group, q, k_shard, v_shard, *, n_kv: int, causal: bool = False, sinks=None,
                     return_lse: bool = False):
    """Mode 2: rank r holds keys shard_bounds(n_kv, world)[r] of the sequence; every rank has
    all of q. Partials over the local keys, then one deferred softmax sync across ranks."""
    import cupy

    kv0, kv1 = shard_bounds(n_kv, group.world)[group.rank]
    if k_shard.shape[2] != kv1 - kv0:
        raise ValueError(f"rank {group.rank}: k shard has {k_shard.shape[2]} keys; shard_bounds({n_kv}, "
                         f"{group.world}) gives this rank {kv1 - kv0}")
    b, h, nq, d = q.shape
    if kv1 > kv0:
        kernel = _kernel(_dtype(q), d, causal, True)
        o_parts, lse_parts = kernel(q, k_shard, v_shard, splits=1, mask_offset=(n_kv - nq) - kv0 if causal else None)
        o, lse = o_parts[0], lse_parts[0]
    else:  # an empty shard: contributes nothing
        o, lse = cupy.zeros((b, h, nq, d), cupy.float32), cupy.full((b, h, nq), -cupy.inf, cupy.float32)
    m = lse.copy()
    if sinks is not None:
        m = cupy.maximum(m, cupy.asarray(sinks, cupy.float32)[None, :, None])
    group.all_reduce(m, "max")
    m0 = cupy.where(cupy.isfinite(m), m, 0)
    w = cupy.exp(lse - m0)
    num = o * w[..., None]
    group.all_reduce(num, "sum")
    group.all_reduce(w, "sum")
    if sinks is not None:
        w = w + cupy.exp(cupy.asarray(sinks, cupy.float32)[None, :, None] - m0)
    seen = cupy.isfinite(m)
    out = cupy.where(seen[..., None], num / cupy.where(seen, w, 1)[..., None], 0).astype(q.dtype)
    if return_lse:
        return out, cupy.where(seen, m0 + cupy.log(cupy.where(seen, w, 1)), -cupy.inf)
    return out


def ring_zigzag_causal(group: Group, q, k, v):
    """Mode 3 (seed 004): causal self-attention; rank r computes query chunks r and 2n-1-r
    against the full K/V (tiles past the diagonal skipped), all-gather, reshuffle."""
    import cupy

    n = q.shape[2]
    kernel = _kernel(_dtype(q), q.shape[-1], True, False)
    if group.world == 1:
        return kernel(q, k, v)
    rows = zigzag_rows(n, group.rank, group.world)
    per = shard_bounds(n, 2 * group.world)[0][1] - shard_bounds(n, 2 * group.world)[0][0]
    local = cupy.zeros(q.shape[:2] + (2 * per, q.shape[3]), q.dtype)
    at = 0
    with _side_by_side(2) as streams:  # the two chunks' launches fill each other's tail waves
        for (s, e), stream in zip(rows, streams):  # written contiguously: first chunk, then second
            if e > s:
                with stream:
                    kernel(q[:, :, s:e], k[:, :, :e], v[:, :, :e], out=local[:, :, at:at + e - s], mask_offset=s)
            at += e - s
    gathered = group.all_gather(local)  # [world, B, H, 2 * per, d]
    parts = []
    for r in range(group.world):
        sizes = [e - s for s, e in zigzag_rows(n, r, group.world)]
        parts.append(gathered[r, :, :, : sum(sizes)])
    flat = cupy.concatenate(parts, axis=2)  # rank-major order
    out = cupy.empty_like(flat)
    out[:, :, cupy.asarray(zigzag_order(n, group.world))] = flat
    return out


def ring_attention(group: Group, q_local, k_local, v_local, *, n: int, causal: bool = True):
    """Mode 4: each rank holds its zigzag chunks (r, 2n-1-r) of Q, K and V, concatenated. K/V
    travel the ring (send to r+1, receive from r-1) while the local kernel runs; partials
    merge by LSE in float32. Returns this rank's output rows (same layout as q_local)."""
    import cupy
    from cupy.cuda import nccl

    world, rank = group.world, group.rank
    b, h, rows, d = q_local.shape
    my_rows = zigzag_rows(n, rank, world)
    sizes = [e - s for s, e in my_rows]
    full = _kernel(_dtype(q_local), d, False, True)
    diag = _kernel(_dtype(q_local), d, True, True)
    acc_o = [cupy.zeros((2, b, h, sz, d), cupy.float32) for sz in sizes]  # slot 0: running, 1: new
    acc_l = [cupy.full((2, b, h, sz), -cupy.inf, cupy.float32) for sz in sizes]
    # K/V travel in buffers sized for the largest pair of chunks (lengths need not divide
    # 2 * world); each rank's rows sit first, and the receiver slices by the sender's sizes
    max_rows = 2 * (shard_bounds(n, 2 * world)[0][1] - shard_bounds(n, 2 * world)[0][0])
    kv = cupy.zeros((2, b, h, max_rows, d), q_local.dtype)
    kv[0, :, :, :rows] = k_local
    kv[1, :, :, :rows] = v_local
    nxt = cupy.empty_like(kv)
    compute, comm_stream = cupy.cuda.get_current_stream(), cupy.cuda.Stream(non_blocking=True)
    for step in range(world):
        src = (rank - step) % world
        if step + 1 < world:  # the next K/V travels while this step computes
            comm_stream.wait_event(compute.record())
            nccl.groupStart()
            group.comm.send(kv.data.ptr, kv.nbytes, nccl.NCCL_UINT8, (rank + 1) % world, comm_stream.ptr)
            group.comm.recv(nxt.data.ptr, nxt.nbytes, nccl.NCCL_UINT8, (rank - 1) % world, comm_stream.ptr)
            nccl.groupEnd()
        src_rows = zigzag_rows(n, src, world)
        src_sizes = [e - s for s, e in src_rows]
        with _side_by_side(2) as streams:  # the two query chunks accumulate independently
            for qi, (q_chunk, stream) in enumerate(zip(zigzag_chunks(rank, world), streams)):
                q_part = q_local[:, :, sum(sizes[:qi]): sum(sizes[: qi + 1])]
                for kj, kv_chunk in enumerate(zigzag_chunks(src, world)):
                    kind = ring_pair_kind(q_chunk, kv_chunk) if causal else "full"
                    if kind == "skip" or sizes[qi] == 0 or src_sizes[kj] == 0:
                        continue
                    lo = sum(src_sizes[:kj])
                    k_part = kv[0][:, :, lo: lo + src_sizes[kj]]
                    v_part = kv[1][:, :, lo: lo + src_sizes[kj]]
                    kernel = diag if kind == "diagonal" else full
                    with stream:
                        _, lse_new = kernel(q_part, k_part, v_part, splits=1, out=acc_o[qi][1:2],
                                            mask_offset=0 if kind == "diagonal" else None)
                        acc_l[qi][1] = lse_new[0]
                        # fold (running, new) into the running slot; each element is read before written
                        _, acc_l[qi][0] = merge(acc_o[qi], acc_l[qi], out=acc_o[qi][0], out_dtype="float32")
        if step + 1 < world:
            compute.wait_event(comm_stream.record())
            kv, nxt = nxt, kv
    out = cupy.concatenate([acc_o[i][0] for i in range(2)], axis=2).astype(q_local.dtype)
    return out


class _side_by_side:
    """Streams that start after the current stream's work so far and that the current stream
    waits for on exit: independent launches overlap (one's tail wave fills with the other)."""

    _pool: dict[int, list] = {}

    def __init__(self, count: int):
        self.count = count

    def __enter__(self):
        import cupy

        self.main = cupy.cuda.get_current_stream()
        device = cupy.cuda.Device().id
        pool = self._pool.setdefault(device, [])
        while len(pool) < self.count:
            pool.append(cupy.cuda.Stream(non_blocking=True))
        self.streams = pool[: self.count]
        start = self.main.record()
        for stream in self.streams:
            stream.wait_event(start)
        return self.streams

    def __exit__(self, *exc):
        for stream in self.streams:
            self.main.wait_event(stream.record())
        return False


def sharded_inputs(x, n: int, world: int, rank: int, how: str):
    """This rank's piece of a full [B, H, N, d] tensor: 'sequence' (contiguous shard) or
    'zigzag' (chunks r and 2n-1-r, concatenated)."""
    import cupy

    if how == "sequence":
        s, e = shard_bounds(n, world)[rank]
        return cupy.ascontiguousarray(x[:, :, s:e])
    return cupy.ascontiguousarray(cupy.concatenate([x[:, :, s:e] for s, e in zigzag_rows(n, rank, world)], axis=2))


__all__ = ["Group", "batch_sharded", "causal_pairs", "check_rank", "imbalance", "init", "launch", "merge_numpy",
           "reshuffle", "ring_attention", "ring_pair_kind", "ring_zigzag_causal", "sequence_sharded",
           "shard_bounds", "sharded_inputs", "work_per_rank", "zigzag_chunks", "zigzag_order", "zigzag_rows"]
