"""MLA decode (576/512 over a paged latent cache, page_size 64): fagen's kernel in the
memory-bound regime (Hq 16, Nq 1: bytes of cache read a second) and the compute-bound one (Hq
128, Nq 2, causal: TFLOP/s), the head-widths issue's bars.

    python3 -m fagen.bench_mla [--quick] [--out bench/bench_mla.json]

`fagen bench` puts the JSON's table in BENCHMARKS.md.

No peer runs this shape on the GPU host (FlashMLA is not installed there): the bars are FlashMLA's
published figures. Each case is checked against float32 attention over the gathered keys before
it is timed; its time is the median of CUDA-graph replays of REPS prepared steps (a decode
loop's launches, no host time; the host time of an eager step is its own column), and the cache's pages are shuffled across a cache of the whole
batch's keys. Bytes: B * Nk * 576 * 2 (each key's row read once); FLOPs: 2 * B * Hq * Nq * Nk *
(576 + 512), causal's lost pair ignored.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fagen import api
from fagen.mla_plan import HEAD_DIM, HEAD_DIM_V, PAGE_SIZE

JSON = "bench_mla.json"
MEMORY_CASES = tuple((b, 16, 1, nk) for b in (1, 4, 16) for nk in (8192, 32768, 65536))  # (B, Hq, Nq, Nk)
COMPUTE_CASES = ((64, 128, 2, 4096), (64, 128, 2, 8192))
QUICK_CASES = ((4, 16, 1, 32768), (64, 128, 2, 4096))
REPS, REPLAYS = 20, 15
TOLERANCE = 1e-2  # relative, against float32 attention (bfloat16 inputs)


@dataclass
class MlaRow:
    b: int
    hq: int
    nq: int
    nk: int
    splits: int
    microseconds: float | None = None
    tb_per_s: float | None = None  # cache bytes read a second
    tflops: float | None = None
    error: float | None = None
    host_us: float | None = None  # enqueue time a prepared step (eager, no graph)
    note: str = ""


def make_case(b: int, hq: int, nq: int, nk: int, seed: int = 0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-nk // PAGE_SIZE)
    kv = torch.randn(b * pages, PAGE_SIZE, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(b * pages, device="cuda", generator=g).to(torch.int32).view(b, pages)
    q = torch.randn(b, hq, nq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    lengths = torch.full((b,), nk, device="cuda", dtype=torch.int32)
    return q, kv, table, lengths


def reference(q, kv, table, lengths, causal: bool):
    """float32 attention over each sequence's gathered keys (the first 512 columns as V)."""
    import torch

    outs = []
    for i in range(q.shape[0]):
        n = int(lengths[i])
        keys = kv[table[i]].reshape(-1, HEAD_DIM)[:n].float()
        s = q[i].float() @ keys.T / HEAD_DIM ** 0.5  # [Hq, Nq, n]
        if causal:
            nq = q.shape[2]
            seen = torch.arange(n, device="cuda")[None, :] <= torch.arange(nq, device="cuda")[:, None] + n - nq
            s = s.masked_fill(~seen, float("-inf"))
        outs.append(torch.softmax(s, -1) @ keys[:, :HEAD_DIM_V])
    return torch.stack(outs)


def time_step(step, args) -> float:
    """Median microseconds a step over CUDA-graph replays of REPS steps."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(*args)  # warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(REPS):
                step(*args)
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPS)
    return sorted(times)[len(times) // 2]


def host_time(step, args, calls: int = 50, batches: int = 7) -> float:
    """Median microseconds of host time a prepared step: the enqueue time of `calls` calls."""
    import time

    import torch

    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            step(*args)
        times.append((time.perf_counter() - start) * 1e6 / calls)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def run_case(b: int, hq: int, nq: int, nk: int, splits: int | None = None) -> MlaRow:
    import torch

    causal = nq > 1
    q, kv, table, lengths = make_case(b, hq, nq, nk)
    step = api.prepare_mla_decode(q, kv, table, lengths, causal=causal, splits=splits)
    row = MlaRow(b, hq, nq, nk, step.splits)
    out = step(q, kv, table, lengths)
    ref = reference(q, kv, table, lengths, causal)
    row.error = float((out.float() - ref).norm() / ref.norm())
    if not row.error <= TOLERANCE:
        row.note = f"error {row.error:.2e} over {TOLERANCE}: not timed"
        return row
    row.microseconds = time_step(step, (q, kv, table, lengths))
    row.host_us = host_time(step, (q, kv, table, lengths))
    seconds = row.microseconds * 1e-6
    row.tb_per_s = b * nk * HEAD_DIM * 2 / seconds / 1e12
    row.tflops = 2 * b * hq * nq * nk * (HEAD_DIM + HEAD_DIM_V) / seconds / 1e12
    del q, kv, table, lengths, step
    torch.cuda.empty_cache()
    return row


def markdown(rows: list[MlaRow], meta: dict | None = None) -> list[str]:
    """BENCHMARKS.md's MLA section: what is timed, then a case a line."""
    out = ["## MLA decode: 576/512 over a paged latent cache", "",
           "`python3 -m fagen.bench_mla`: DeepSeek's absorbed MLA, q [B, Hq, Nq, 576] against one latent head of 576 "
           "(its first 512 columns V), bfloat16, page size 64, pages shuffled across the cache; a step's GPU time by "
           f"CUDA-graph replays of {REPS} prepared steps (the attention kernel and, with splits, the merge after it); "
           "cache TB/s = B * Nk * 1152 bytes a step; TFLOP/s = 2 * B * Hq * Nq * Nk * (576 + 512); host µs: the "
           "enqueue time of an eager prepared step. Each case is checked against float32 attention over the gathered "
           "keys first. No peer runs this shape on the GPU host (FlashMLA is not installed there): the bars are the "
           "head-widths issue's (3.6 TB/s memory-bound, 600 TFLOP/s compute-bound, from FlashMLA's published figures)."
           + (f" {meta['date']}, {meta.get('gpu', '')}." if meta and meta.get("date") else ""), "",
           "| B | Hq | Nq | Nk | splits | µs | cache TB/s | TFLOP/s | host µs | error |", "| --- " * 10 + "|"]
    for r in rows:
        cells = [r.b, r.hq, r.nq, r.nk, r.splits,
                 *(f"{x:.1f}" if x is not None else "—" for x in (r.microseconds,)),
                 *(f"{x:.2f}" if x is not None else "—" for x in (r.tb_per_s,)),
                 *(f"{x:.0f}" if x is not None else "—" for x in (r.tflops,)),
                 f"{r.host_us:.1f}" if r.host_us is not None else "—",
                 f"{r.error:.1e}" if r.error is not None else r.note]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return out


def read_json(path: Path) -> tuple[list[MlaRow], dict]:
    try:
        data = json.loads(Path(path).read_text())
        return [MlaRow(**r) for r in data["rows"]], dict(data.get("meta", {}))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a bench_mla JSON ({err}); rerun python3 -m fagen.bench_mla") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one memory-bound and one compute-bound case")
    parser.add_argument("--splits", type=int, nargs="*", default=None,
                        help="time each case at these split counts too (default: the kernel's own choice)")
    parser.add_argument("--out", type=Path, default=Path("bench") / JSON, help="where the rows go, as JSON")
    args = parser.parse_args(argv)
    import torch

    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for case in (QUICK_CASES if args.quick else MEMORY_CASES + COMPUTE_CASES):
        for splits in [None, *(args.splits or [])]:
            rows.append(run_case(*case, splits=splits))
            print(rows[-1], file=sys.stderr, flush=True)
            args.out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    print("\n".join(markdown(rows, meta)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
