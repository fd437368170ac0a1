"""Attention across GPUs (one process per GPU), on fagen's NCCL group or a torch.distributed
process group (fagen.process_group).

Schedules (the index arithmetic is pure and simulated rank by rank on the CPU in the tests):

1. batch_sharded       each rank computes a slice of the batch; outputs all-gathered.
2. sequence_sharded    each rank holds a contiguous shard of K/V; split-KV partials; the
                       softmax max/sum are synchronised once, at the end (seed 003's deferred
                       sync): all-reduce max of LSE, then sums of weighted O and weights;
                       sinks join there.
3. zigzag_attention    causal; K/V on every rank; rank r holds query chunks r and 2w-1-r of
                       2w (seed 004), so cheap early rows pair with expensive late ones; fully
                       masked KV tiles are skipped by the causal kernel. Output rows stay on
                       their rank (gather_sequence assembles the sequence where wanted).
4. ring_attention      each rank holds only its zigzag chunks of Q, K and V; K/V travel
                       around the ring by send/recv, overlapped with the compute: one launch
                       a step (ring_schedule), each folding its partial into the running O and
                       LSE inside the kernel.

`fagen launch -n N script.py` or torchrun starts the processes; `init()` joins fagen's group,
or pass a torch.distributed ProcessGroup.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache

import numpy as np

from fagen import ring_link, sequences, variants
from fagen.backward import compile_backward
from fagen.device import DeviceTensor, as_device_tensor, cupy, empty_like, full_like, stream_for, zeros_like
from fagen.process_group import NcclGroup, TorchGroup, as_group, check_rank, init, launch
from fagen.rendering import GRADIENT_SUM_THREADS, gradient_sum_name
from fagen.dispatch import default_spec
from fagen.runtime import compile_kernel, shared_function
from fagen.spec import Mask, ScoreMod

FOLD_LONG_KEYS = 16384  # a ring's full steps take the long class's tiling from this many keys (_fold_spec)

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


@dataclass(frozen=True)
class RingStep:
    """One launch of ring attention on one rank: its local query rows [q0, q1) against rows
    [k0, k1) of the K/V block it holds at this step (rank `source`'s zigzag chunks), the
    diagonal at local row = local key (causal) or every pair (full)."""
    source: int
    q: tuple[int, int]
    kv: tuple[int, int]
    causal: bool

    @property
    def empty(self) -> bool:  # chunks of fewer than 2 * world positions may hold nothing
        return self.q[1] <= self.q[0] or self.kv[1] <= self.kv[0]


def ring_schedule(n: int, rank: int, world: int, causal: bool = True) -> list[RingStep]:
    """Rank `rank`'s launches, step by step (the block of rank - step arrives at step `step`).

    Each rank holds zigzag chunks (a, b) = (r, 2w-1-r) of the sequence, back to back. Step 0
    is its own block: under causal masking, local row i sees local key j exactly when i >= j
    (chunk a precedes chunk b in the sequence and the two chunks line up), so one causal launch
    covers it. A later step's block from source s: s < r, both query chunks see s's first
    chunk whole and its second not at all; s > r, only the second query chunk sees anything,
    and all of both of s's chunks. One full launch each, over contiguous local rows."""
    check_rank(rank, world)
    mine = [e - s for s, e in zigzag_rows(n, rank, world)]
    steps = []
    for step in range(world):
        source = (rank - step) % world
        theirs = [e - s for s, e in zigzag_rows(n, source, world)]
        if not causal:
            q, kv = (0, sum(mine)), (0, sum(theirs))
        elif step == 0:
            q, kv = (0, sum(mine)), (0, sum(mine))
        elif source < rank:
            q, kv = (0, sum(mine)), (0, theirs[0])
        else:
            q, kv = (mine[0], sum(mine)), (0, sum(theirs))
        steps.append(RingStep(source, q, kv, causal and step == 0))
    return steps


def own_block_pieces(n: int, rank: int, world: int, causal: bool = True) -> tuple[RingStep, RingStep]:
    """The backward's own block (ring_schedule's step 0) in two launches: the first chunk's rows
    first, while the first block arrives; the second chunk's rows last, while the bundle of the
    block's dK/dV shares makes its last hop home, which then has compute to hide under (the
    bundle is complete only when it is home). Local positions: a causal piece's
    diagonal is at local row = local key, its rows start at q0 and its keys at 0."""
    first, second = (e - s for s, e in zigzag_rows(n, rank, world))
    rows = first + second
    return (RingStep(rank, (0, first), (0, first if causal else rows), causal),
            RingStep(rank, (first, rows), (0, rows), causal))


def share_rows(n: int, rank: int, world: int, causal: bool = True) -> tuple[int, ...]:
    """The rows of rank's K/V block that each dK/dV share summed at its home holds (every launch
    on a block covers its rows 0 .. k1): the own block's two pieces (own_block_pieces), then the
    bundle that came home, whose position j is rank (rank + 1 + j)'s share, written at its step
    j + 1 (the ranks the block visits, in the order it visits them). 0 for an empty launch."""
    check_rank(rank, world)
    rows = [0 if piece.empty else piece.kv[1] for piece in own_block_pieces(n, rank, world, causal)]
    for j in range(world - 1):
        step = ring_schedule(n, (rank + 1 + j) % world, world, causal)[j + 1]
        assert step.source == rank and step.kv[0] == 0
        rows.append(0 if step.empty else step.kv[1])
    return tuple(rows)


def ring_step_work(n: int, world: int, causal: bool = True) -> list[list[int]]:
    """Kept (q, k) pairs of each rank's launch at each ring step, [step][rank]: the ranks wait
    for each other every step (the next block must arrive), so a step's imbalance is what
    costs. The backward runs the same launches (2.5x their FLOPs), its own block in two
    (own_block_pieces: the first at step 0, the second after the last)."""
    per_rank = [ring_schedule(n, r, world, causal) for r in range(world)]
    work = []
    for i in range(world):
        row = []
        for r in range(world):
            step = per_rank[r][i]
            rows, keys = step.q[1] - step.q[0], step.kv[1] - step.kv[0]
            if step.empty:
                row.append(0)
            elif step.causal:  # local row >= local key, rows == keys
                row.append(rows * (rows + 1) // 2)
            else:
                row.append(rows * keys)
        work.append(row)
    return work


# ---- the four modes (each rank calls these with its group) -----------------------------------
#
# Every mode takes CuPy arrays or torch tensors and either group (fagen.process_group:
# fagen's NcclGroup, or a torch.distributed ProcessGroup, None for the default one); its work
# runs on the inputs' current stream and what it allocates comes from their framework.

def _xp(ref: DeviceTensor):
    """The inputs' array module: the few elementwise functions the modes use have one name in both."""
    if ref.kind == "torch":
        import torch

        return torch
    return cupy


def _cast(x, ref: DeviceTensor, dtype: str):
    out = empty_like(ref, tuple(x.shape), dtype)
    out[...] = x
    return out


def _device_array(ref: DeviceTensor, values, dtype: str):
    """values (host, or a CUDA array of either framework, e.g. learned sinks) on ref's device,
    in ref's framework."""
    if ref.kind == "torch":
        import torch

        return torch.as_tensor(values, dtype=getattr(torch, dtype), device=ref.obj.device)
    return cupy.asarray(values, dtype=dtype)


def _spec(dtype: str, head_dim: int, causal: bool, keys: int | None = None):
    """The shipped forward for ref's dtype and head_dim; `keys` a launch's keys, for a long
    sequence's class as fagen.attention picks it (the zigzag's launches, the ring's own block:
    2 H200s, +4-17%). sequence_sharded's partials, the ring's full steps (no long class for
    them) and the backward keep the base class."""
    return default_spec(dtype, head_dim, causal, keys=keys)


def _fold_spec(dtype: str, head_dim: int, keys: int):
    """The ring's full steps (a block of rows against another rank's `keys` keys, every pair):
    from FOLD_LONG_KEYS keys, where the GPU has a long class (shipped for causal masks), that
    class's tiling without its mask, else the shipped full-mask spec. 4 H200s, in the ring, the
    arms' order alternated: at 128k (32k keys a step) the long tiling 3% faster a ring, at 32k (8k
    keys) the full-mask one 4% faster, at 2 GPUs 32k (16k keys) a tie (notes/perf.md)."""
    long = _spec(dtype, head_dim, True, keys)
    if keys < FOLD_LONG_KEYS or long == _spec(dtype, head_dim, True):  # short steps, or no long class here
        return _spec(dtype, head_dim, False)
    return variants.variant(long, Mask(kind="none"), ScoreMod())


@cache
def _ring_kernels(dtype: str, head_dim: int, causal: bool, rows: int, most: int, device: int) -> tuple:
    """The ring forward's launches on `device`: its own block's (the diagonal, rows x rows: the
    class fagen.attention would take for them) and a full step's (_fold_spec), looked up once a
    shape (building and hashing specs is host time that a step's launch must not wait for)."""
    with cupy.cuda.Device(device):
        return (compile_kernel(variants.ring_start_variant(_spec(dtype, head_dim, causal, rows))),
                compile_kernel(variants.accumulate_variant(_fold_spec(dtype, head_dim, most))))


@cache
def _ring_backward_kernels(dtype: str, head_dim: int, causal: bool, device: int) -> tuple:
    """The ring backward's launches on `device`: its own block's mask's and a full step's
    (the full step's trained on the own block's tiling, so that their dQ shares one sum), looked
    up once."""
    with cupy.cuda.Device(device):
        own = variants.trainable(_spec(dtype, head_dim, causal))
        return compile_backward(own), compile_backward(variants.trainable_alike(_spec(dtype, head_dim, False), own))


def batch_sharded(group, q, k, v, *, causal: bool = False):
    """Mode 1: rank r computes batch rows shard_bounds(B, world)[r]; outputs all-gathered."""
    group, ref = as_group(group), as_device_tensor(q, "q")
    b = ref.shape[0]
    bounds = shard_bounds(b, group.world)
    lo, hi = bounds[group.rank]
    per = bounds[0][1] - bounds[0][0]
    with cupy.cuda.Device(ref.device), stream_for(ref):
        local = zeros_like(ref, (per,) + ref.shape[1:], ref.dtype)
        if hi > lo:
            kernel = compile_kernel(_spec(ref.dtype, ref.shape[-1], causal, as_device_tensor(k, "k").shape[2]))
            kernel(q[lo:hi], k[lo:hi], v[lo:hi], out=local[: hi - lo])
        gathered = empty_like(ref, (group.world, per) + ref.shape[1:], ref.dtype)
        group.all_gather(local, gathered)  # padded shards
        out = empty_like(ref, ref.shape, ref.dtype)
        for r, (s, e) in enumerate(bounds):
            out[s:e] = gathered[r, : e - s]
    return out


def sequence_sharded(group, q, k_shard, v_shard, *, n_kv: int, causal: bool = False, sinks=None,
                     return_lse: bool = False):
    """Mode 2: rank r holds keys shard_bounds(n_kv, world)[r] of the sequence; every rank has
    all of q. Partials over the local keys, then one deferred softmax sync across ranks."""
    group, ref = as_group(group), as_device_tensor(q, "q")
    kv0, kv1 = shard_bounds(n_kv, group.world)[group.rank]
    if k_shard.shape[2] != kv1 - kv0:
        raise ValueError(f"rank {group.rank}: k shard has {k_shard.shape[2]} keys; shard_bounds({n_kv}, "
                         f"{group.world}) gives this rank {kv1 - kv0}")
    b, h, nq, d = ref.shape
    xp = _xp(ref)
    with cupy.cuda.Device(ref.device), stream_for(ref):
        if kv1 > kv0:
            kernel = compile_kernel(variants.partial_variant(_spec(ref.dtype, ref.shape[-1], causal)))
            o_parts, lse_parts = kernel(q, k_shard, v_shard, splits=1,
                                        mask_offset=(n_kv - nq) - kv0 if causal else None)
            o, lse = o_parts[0], lse_parts[0]
        else:  # an empty shard: contributes nothing
            o = zeros_like(ref, (b, h, nq, d), "float32")
            lse = full_like(ref, (b, h, nq), -np.inf, "float32")
        m = lse.clone() if ref.kind == "torch" else lse.copy()
        sink = None if sinks is None else _device_array(ref, sinks, "float32").reshape(1, -1, 1)
        if sink is not None:
            m = xp.maximum(m, sink)
        group.all_reduce(m, "max")
        seen = xp.isfinite(m)
        m0 = xp.where(seen, m, 0)
        w = xp.exp(lse - m0)
        num = o * w[..., None]
        group.all_reduce(num, "sum")
        group.all_reduce(w, "sum")
        if sink is not None:
            w = w + xp.exp(sink - m0)
        w = xp.where(seen, w, 1)
        out = _cast(xp.where(seen[..., None], num / w[..., None], 0), ref, ref.dtype)
        if return_lse:
            return out, xp.where(seen, m0 + xp.log(w), -np.inf)
    return out


def zigzag_attention(group, q_local, k, v, *, n: int, return_lse: bool = False):
    """Mode 3 (seed 004): causal self-attention with all of K/V on every rank; rank r holds its
    zigzag query chunks (r, 2w-1-r, back to back: sharded_inputs(q, n, w, r, "zigzag")) and
    computes their rows against the keys up to each chunk's end (tiles past the diagonal
    skipped): at B = 1 one launch over both chunks (_zigzag_one_launch), else the two chunks'
    launches side by side. Returns this rank's output rows, laid out as q_local
    (gather_sequence assembles the whole sequence), and with return_lse their natural-log LSE
    [B, H, rows] (float32)."""
    group, ref = as_group(group), as_device_tensor(q_local, "q_local")
    rows = zigzag_rows(n, group.rank, group.world)
    _check_rows(ref, rows, "q_local")
    if ref.shape[0] == 1:
        return _zigzag_one_launch(ref, q_local, k, v, rows, n, return_lse)
    kernel = compile_kernel(_spec(ref.dtype, ref.shape[-1], True, n))  # the later chunk's launch sees all n keys
    with cupy.cuda.Device(ref.device), stream_for(ref):
        out = empty_like(ref, ref.shape, ref.dtype)
        lse = empty_like(ref, ref.shape[:3], "float32") if return_lse else None
        at = 0
        with _side_by_side(ref, 2) as streams:  # the two chunks' launches fill each other's tail waves
            for (s, e), stream in zip(rows, streams):
                if e > s:
                    with stream:
                        got = kernel(q_local[:, :, at:at + e - s], k[:, :, :e], v[:, :, :e],
                                     out=out[:, :, at:at + e - s], mask_offset=s, return_lse=return_lse)
                        if return_lse:
                            lse[:, :, at:at + e - s] = got[1]
                at += e - s
    return (out, lse) if return_lse else out


def _token_major(x):
    """Batch row 0 of [1, H, N, d] as [N, H, d] (a view): varlen's layout."""
    return x[0].transpose(0, 1) if as_device_tensor(x, "x").kind == "torch" else x[0].transpose(1, 0, 2)


def _zigzag_one_launch(ref: DeviceTensor, q_local, k, v, rows, n: int, return_lse: bool):
    """zigzag_attention at B = 1 in one launch: the two chunks are a varlen batch of two
    sequences over one K/V (Sequences.seqused_k), chunk (s, e) its rows against keys 0 .. e,
    causal bottom right; the kernel walks both chunks' tiles, the heavier chunk's first."""
    lengths = [e - s for s, e in rows]
    total_k = as_device_tensor(k, "k").shape[2]
    spec = variants.sequence_variant(_spec(ref.dtype, ref.shape[-1], True, n), "varlen", "varlen", seqused_k=True)
    with cupy.cuda.Device(ref.device), stream_for(ref):
        cu_q, cu_k, used = _zigzag_sequences(tuple(rows), total_k, ref.device)
        out = empty_like(ref, ref.shape, ref.dtype)
        batch = sequences.varlen_batch(_token_major(q_local), _token_major(k), _token_major(v), cu_q, cu_k,
                                       max(max(lengths), 1), max(max(e for _, e in rows), 1), seqused_k=used,
                                       validate=False)
        _, lse = sequences.run(batch, spec, out=_token_major(out))
    return (out, lse[None]) if return_lse else out


@cache
def _zigzag_sequences(rows: tuple[tuple[int, int], ...], total_k: int, device: int):
    """cu_seqlens_q, cu_seqlens_k and seqused_k of a rank's two chunks, on the device once: a
    copy from the host each call would wait for the stream (pageable memory), and the host could
    not queue the next step behind this one."""
    lengths = [e - s for s, e in rows]
    return (cupy.asarray(np.array([0, lengths[0], sum(lengths)], np.int32)),
            cupy.asarray(np.array([0, 0, total_k], np.int32)),  # both chunks' keys start at key 0
            cupy.asarray(np.array([e for _, e in rows], np.int32)))


def zigzag_attention_backward(group, dout_local, q_local, k, v, out_local, lse_local, *, n: int):
    """The gradients through zigzag_attention: dq of this rank's rows (as q_local), and dk, dv
    of the whole K/V (as k, v), each rank's share summed across the group (all-reduce), from
    zigzag_attention's out and LSE (return_lse=True) and dout."""
    group, ref = as_group(group), as_device_tensor(q_local, "q_local")
    rows = zigzag_rows(n, group.rank, group.world)
    _check_rows(ref, rows, "q_local")
    kernels = compile_backward(variants.trainable(_spec(ref.dtype, ref.shape[-1], True)))
    tk = as_device_tensor(k, "k")
    with cupy.cuda.Device(ref.device), stream_for(ref):
        dq = empty_like(ref, ref.shape, ref.dtype)
        dkv = zeros_like(ref, (2,) + tk.shape, "float32")
        at = 0
        for s, e in rows:
            if e > s:
                part = slice(at, at + e - s)
                lse = lse_local[:, :, part]
                lse = _contiguous(lse)
                grads = kernels(dout_local[:, :, part], q_local[:, :, part], k[:, :, :e], v[:, :, :e],
                                out_local[:, :, part], lse, mask_offset=s, dq=dq[:, :, part])
                dkv[0, :, :, :e] += grads.dk
                dkv[1, :, :, :e] += grads.dv
            at += e - s
        group.all_reduce(dkv, "sum")
        return dq, _cast(dkv[0], ref, ref.dtype), _cast(dkv[1], ref, ref.dtype)


def ring_attention(group, q_local, k_local, v_local, *, n: int, causal: bool = True, return_lse: bool = False,
                   transport: str = "auto"):
    """Mode 4: each rank holds its zigzag chunks (r, 2w-1-r) of Q, K and V, back to back
    (sharded_inputs(x, n, w, r, "zigzag")). The K/V blocks travel the ring (sent to r+1,
    received from r-1) while this rank computes on the one it holds: ring_schedule's one launch
    a step, each folding its partial into the running float32 O and LSE inside the kernel
    (outputs.accumulate). Returns this rank's output rows, laid out as q_local (and their
    natural-log LSE [B, H, rows], float32, with return_lse). `transport`: how the blocks
    travel (fagen.ring_link: 'auto' takes the copy engines where the GPUs reach each other's
    memory, else the group's NCCL send/recv)."""
    group, ref = as_group(group), as_device_tensor(q_local, "q_local")
    world, rank = group.world, group.rank
    b, h, rows, d = ref.shape
    _check_rows(ref, zigzag_rows(n, rank, world), "q_local")
    for name, x in (("k_local", k_local), ("v_local", v_local)):
        t = as_device_tensor(x, name)
        if t.shape[0] != b or t.shape[2] != rows or t.shape[3] != d or t.dtype != ref.dtype:
            raise ValueError(f"{name}: {t.dtype} {t.shape}; expected {ref.dtype} [{b}, Hkv, {rows}, {d}] "
                             f"(this rank's zigzag chunks, as q_local)")
    hkv = as_device_tensor(k_local, "k_local").shape[1]
    # K/V travel in buffers sized for the largest pair of chunks (lengths need not divide
    # 2 * world); each rank's rows sit first, and the receiver slices by the sender's sizes
    most = _largest_pair(n, world)
    block = ring_link.Block((2, b, hkv, most, d), ref.dtype)
    first, fold = _ring_kernels(ref.dtype, d, causal, rows, most, ref.device)
    with cupy.cuda.Device(ref.device), stream_for(ref):
        # the running O and LSE: the first step writes them (its own block: every row sees a key)
        acc_o, acc_l = empty_like(ref, (b, h, rows, d), "float32"), empty_like(ref, (b, h, rows), "float32")
        if world > 1:
            kv = ring_link.link(group, "kv", ref, block, transport)
        held = None
        for i, step in enumerate(ring_schedule(n, rank, world, causal)):
            # the next block travels while this one is computed on; a block received is passed
            # on as soon as it lands
            arrived = None
            if i + 1 < world:
                arrived = kv.send_own(k_local, v_local) if i == 0 else kv.send(held, as_received=True)
            (q0, q1), (k0, k1) = step.q, step.kv
            if i == 0 and not step.empty:  # its own block first
                first(q_local, k_local, v_local, out=acc_o[None], lse=acc_l[None], mask_offset=0)  # one split
            elif not step.empty:
                fold(q_local[:, :, q0:q1], held[0, :, :, k0:k1], held[1, :, :, k0:k1],
                     out=acc_o[:, :, q0:q1], lse=acc_l[:, :, q0:q1])
            if arrived is not None:
                held = arrived()
        if world > 1:
            kv.finish()
        out = _cast(acc_o, ref, ref.dtype)
    return (out, acc_l) if return_lse else out


def ring_attention_backward(group, dout_local, q_local, k_local, v_local, out_local, lse_local, *, n: int,
                            causal: bool = True, transport: str = "auto"):
    """The gradients through ring attention: dq, dk, dv of this rank's zigzag rows (laid out as
    q_local, k_local, v_local), from ring_attention's out and LSE (return_lse=True) and dout.

    The K/V blocks travel the ring again. At each step this rank runs the block's dK/dV kernel on
    ring_schedule's launch (the rows' final LSE makes each block's softmax the whole
    sequence's), its dQ summed across the steps in float32 (backward.QueryRows: D and LSE rows
    once a call). The block's dK and dV shares (q's dtype, as the kernel writes them) travel the
    ring behind it as a bundle, one share a rank the block visited, every hop on the copy engines
    with no SM work; at home the bundle and the own block's two pieces (own_block_pieces: the
    first chunk's rows at step 0, the second's while the bundle makes its last hop) are summed
    once in float32 (share_rows says which rows each share holds) and rounded once into dk and
    dv. K/V's transfer runs under the step's compute; the bundle's, under the next step's. The
    bundle grows a share a hop (world (world - 1) / 2 shares copied a call, against 2 (world - 1)
    for float32 sums): at 4 GPUs its last hop, 3 shares, hides under the own block's second
    launch; at 8 (7 shares against a launch of a quarter the rows) it may not. `transport` as
    ring_attention's."""
    group, ref = as_group(group), as_device_tensor(q_local, "q_local")
    world, rank = group.world, group.rank
    b, h, rows, d = ref.shape
    _check_rows(ref, zigzag_rows(n, rank, world), "q_local")
    hkv = as_device_tensor(k_local, "k_local").shape[1]
    first, fold = _ring_backward_kernels(ref.dtype, d, causal, ref.device)
    block = (2, b, hkv, _largest_pair(n, world), d)
    own_first, own_last = own_block_pieces(n, rank, world, causal)
    with cupy.cuda.Device(ref.device), stream_for(ref):
        query_rows = {}  # a launch's rows: a chunk of this rank's or all of them, made on first use

        def rows_of(q0: int, q1: int):
            if (q0, q1) not in query_rows:  # a chunk's: a view of all of them where its bounds allow
                whole = (q0, q1) == (0, rows)
                view = (None if whole else rows_of(0, rows).tail(q0) if q1 == rows
                        else rows_of(0, rows).head(q1) if q0 == 0 else None)
                query_rows[(q0, q1)] = view or first.query_rows(
                    dout_local[:, :, q0:q1], q_local[:, :, q0:q1], out_local[:, :, q0:q1],
                    lse_local if whole else _contiguous(lse_local[:, :, q0:q1]))
            return query_rows[(q0, q1)]

        def add_share(piece: RingStep, kernel, k, v, share) -> None:  # its dK and dV into the share's rows 0 ..
            (q0, q1), (k0, k1) = piece.q, piece.kv
            if not piece.empty:
                rows_of(q0, q1).add(kernel, k[:, :, :k1], v[:, :, :k1], mask_offset=q0 - k0 if piece.causal else 0,
                                    dk=share[0, :, :, :k1], dv=share[1, :, :, :k1])

        own = empty_like(ref, (2, *block), ref.dtype)  # the own block's two pieces' shares
        # a step's share, two steps' alternating: a share is read by its hop (send_bundle) while
        # the next step writes the other one
        shares = empty_like(ref, (2, *block), ref.dtype)
        if world > 1:
            kv = ring_link.link(group, "kv", ref, ring_link.Block(block, ref.dtype), transport)
            dkv = ring_link.link(group, "dkv", ref, ring_link.Block((world - 1, *block), ref.dtype), transport)
        held_kv, pending = None, None  # pending: the bundle on its way from the previous rank
        for i, step in enumerate(ring_schedule(n, rank, world, causal)):
            kv_arrived = None
            if i + 1 < world:
                kv_arrived = kv.send_own(k_local, v_local) if i == 0 else kv.send(held_kv, as_received=True)
            assert step.kv[0] == 0  # a block's rows start with its first chunk: a step's share is rows 0 .. k1
            if i == 0:
                add_share(own_first, first if own_first.causal else fold, k_local, v_local, own[0])
            else:
                add_share(step, fold, held_kv[0], held_kv[1], shares[i % 2])
                bundle = None if pending is None else pending()  # the block's shares so far
                pending = dkv.send_bundle(bundle, shares[i % 2], i - 1)
            if kv_arrived is not None:
                held_kv = kv_arrived()
        # while the bundle of this rank's block comes home: the own block's second chunk, and dQ
        add_share(own_last, first if own_last.causal else fold, k_local, v_local, own[1])
        if rows == 0:  # chunks of fewer than 2 * world positions may hold nothing
            dq = empty_like(ref, ref.shape, ref.dtype)
        else:
            dq = rows_of(0, rows).dq()
        for (q0, q1), part in query_rows.items():  # a chunk off a tile of all the rows: its dQ rounded twice
            if (q0, q1) != (0, rows) and part.owner is None:
                dq[:, :, q0:q1] += part.dq()
        home = None if pending is None else pending()
        dk, dv = (empty_like(ref, (b, hkv, rows, d), ref.dtype) for _ in range(2))
        if rows:
            _sum_gradients(own, home, share_counts(n, rank, world, causal, d, ref.device), dk, dv)
        if world > 1:
            kv.finish()
            dkv.finish()
        return dq, dk, dv


@lru_cache(maxsize=256)
def share_counts(n: int, rank: int, world: int, causal: bool, head_dim: int, device: int):
    """share_rows as the gradient sum reads it: elements a plane, int32 on `device`, made once."""
    with cupy.cuda.Device(device):
        return cupy.asarray([r * head_dim for r in share_rows(n, rank, world, causal)], dtype=np.int32)


def _sum_gradients(own, bundle, counts, dk, dv) -> None:
    """dk and dv ([B, Hkv, rows, d] each, contiguous, q's dtype) = the sum in float32 of the own
    block's pieces (`own`, [2, 2, B, Hkv, rows_max, d]) and the bundle's shares ([world - 1, 2,
    B, Hkv, rows_max, d], or None), each share over the first counts[s] elements of a plane
    (share_counts). One launch on CuPy's current stream."""
    t_own, t_dk, t_dv = (as_device_tensor(x, name) for x, name in ((own, "own"), (dk, "dk"), (dv, "dv")))
    own_shares, _, b, hkv, most, d = t_own.shape
    t_bundle = None if bundle is None else as_device_tensor(bundle, "bundle")
    bundle_shares = 0 if t_bundle is None else t_bundle.shape[0]
    rows = t_dk.shape[2]
    if counts.dtype != np.int32 or counts.shape != (own_shares + bundle_shares,):
        raise ValueError(f"share counts {counts.dtype} {counts.shape}: expected int32 ({own_shares + bundle_shares},), "
                         f"one a share (share_counts)")
    for t in (t_own, t_bundle):
        if t is not None and (t.shape[1:] != t_own.shape[1:] or t.strides != _contiguous_strides(t.shape)):
            raise ValueError(f"gradient shares {t.shape} {t.strides}: expected contiguous [shares, 2, B, Hkv, rows, d] "
                             f"blocks of one layout")
    for t in (t_dk, t_dv):
        if t.shape != (b, hkv, rows, d) or t.strides != _contiguous_strides(t.shape) or t.dtype != t_own.dtype:
            raise ValueError(f"gradient out {t.shape} {t.strides} {t.dtype}: expected contiguous {t_own.dtype} "
                             f"[{b}, {hkv}, {rows}, {d}]")
    threads, count = GRADIENT_SUM_THREADS, rows * d
    shared_function(gradient_sum_name(t_own.dtype), t_own.device)(
        (-(-count // (8 * threads)), 2 * b * hkv), (threads,),
        (np.uint64(t_own.ptr), np.int32(own_shares), np.uint64(0 if t_bundle is None else t_bundle.ptr),
         np.int32(bundle_shares), np.int64(2 * b * hkv * most * d),
         np.uint64(counts.data.ptr), np.int64(most * d), np.int64(count), np.int32(b * hkv),
         np.uint64(t_dk.ptr), np.uint64(t_dv.ptr)))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))


def _contiguous(x):
    return x.contiguous() if hasattr(x, "contiguous") else cupy.ascontiguousarray(x)


def _largest_pair(n: int, world: int) -> int:
    """Rows of the largest pair of zigzag chunks (the first chunks are the longest): what a
    buffer holding any rank's rows needs."""
    first, end = shard_bounds(n, 2 * world)[0]
    return 2 * (end - first)


def _check_rows(ref: DeviceTensor, rows: list[tuple[int, int]], what: str) -> None:
    want = sum(e - s for s, e in rows)
    if len(ref.shape) != 4 or ref.shape[2] != want:
        raise ValueError(f"{what}: shape {ref.shape}; this rank's zigzag chunks {rows} are {want} rows: expected "
                         f"[B, H, {want}, d] (sharded_inputs(x, n, world, rank, 'zigzag'))")


class _side_by_side:
    """Streams that start after the current stream's work so far and that the current stream
    waits for on exit: independent launches overlap (one's tail wave fills with the other).
    PyTorch's streams for torch inputs (its kernels launch on torch's current stream)."""

    _pool: dict[tuple[str, int], list] = {}

    def __init__(self, ref: DeviceTensor, count: int):
        self.ref, self.count = ref, count

    def __enter__(self):
        pool = self._pool.setdefault((self.ref.kind, self.ref.device), [])
        if self.ref.kind == "torch":
            import torch

            self.main = torch.cuda.current_stream(self.ref.device)
            while len(pool) < self.count:
                pool.append(torch.cuda.Stream(self.ref.device))
            self.streams = pool[: self.count]
            for stream in self.streams:
                stream.wait_stream(self.main)
            return [torch.cuda.stream(s) for s in self.streams]
        self.main = cupy.cuda.get_current_stream()
        while len(pool) < self.count:
            pool.append(cupy.cuda.Stream(non_blocking=True))
        self.streams = pool[: self.count]
        start = self.main.record()
        for stream in self.streams:
            stream.wait_event(start)
        return self.streams

    def __exit__(self, *exc):
        for stream in self.streams:
            if self.ref.kind == "torch":
                self.main.wait_stream(stream)
            else:
                self.main.wait_event(stream.record())
        return False


def sharded_inputs(x, n: int, world: int, rank: int, how: str):
    """This rank's piece of a full [B, H, N, d] tensor of n positions: 'sequence' (a contiguous
    shard) or 'zigzag' (chunks rank and 2 * world - 1 - rank of 2 * world, back to back),
    contiguous, in x's framework."""
    ref = as_device_tensor(x, "x")
    pieces = [shard_bounds(n, world)[rank]] if how == "sequence" else zigzag_rows(n, rank, world)
    with cupy.cuda.Device(ref.device), stream_for(ref):
        out = empty_like(ref, ref.shape[:2] + (sum(e - s for s, e in pieces), ref.shape[3]), ref.dtype)
        at = 0
        for s, e in pieces:
            out[:, :, at:at + e - s] = x[:, :, s:e]
            at += e - s
    return out


def gather_sequence(group, local, *, n: int):
    """The whole sequence's rows [B, H, n, d] on every rank from each rank's zigzag rows
    (ring_attention's and zigzag_attention's outputs): all-gather, then the reshuffle."""
    group, ref = as_group(group), as_device_tensor(local, "local")
    world = group.world
    most = _largest_pair(n, world)
    with cupy.cuda.Device(ref.device), stream_for(ref):
        padded = zeros_like(ref, ref.shape[:2] + (most, ref.shape[3]), ref.dtype)
        padded[:, :, : ref.shape[2]] = local
        gathered = empty_like(ref, (world,) + tuple(padded.shape), ref.dtype)
        group.all_gather(padded, gathered)
        out = empty_like(ref, ref.shape[:2] + (n, ref.shape[3]), ref.dtype)
        for r in range(world):
            at = 0
            for s, e in zigzag_rows(n, r, world):
                out[:, :, s:e] = gathered[r, :, :, at:at + e - s]
                at += e - s
    return out


__all__ = ["NcclGroup", "RingStep", "TorchGroup", "as_group", "batch_sharded", "causal_pairs", "check_rank",
           "gather_sequence", "imbalance", "init", "launch", "merge_numpy", "reshuffle", "ring_attention",
           "own_block_pieces", "ring_attention_backward", "ring_step_work", "zigzag_attention_backward",
           "ring_schedule", "sequence_sharded", "shard_bounds", "sharded_inputs", "work_per_rank",
           "zigzag_attention", "zigzag_chunks", "zigzag_order", "zigzag_rows"]
