"""Head widths: DeepSeek's 192/128 and 512 (no peer but SDPA's memory-efficient backend runs it),
fagen's forward and backward against FlashAttention-4 and SDPA's cuDNN and memory-efficient
backends, one process.

    python3 -m fagen.bench_head_widths [--quick] [--widths 512/512] [--decode] [--append] [--out bench/bench_head_widths.json]

bfloat16, B * N = 16k tokens, H * d_v = 2048. TFLOP/s: forward 2 * B * H * N^2 * (d_qk + d_v),
backward 2.5 times that (FlashAttention's convention), both halved for causal; Triton's do_bench
(host time included). Each implementation's output and gradients are checked against float32
attention (B 1, H 4, N 2000) before it is timed; one that fails is not timed, its row says why.
--decode runs head_dim 512 decode instead: one query a head (Hq 16, Hkv 4), the step's GPU time by
CUDA-graph replays, the cache's TB/s, against SDPA's memory-efficient backend.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fagen import api

JSON = "bench_head_widths.json"
WIDTHS = ((192, 128), (512, 512))  # (d_qk, d_v)
LENGTHS = (4096, 16384)
TOKENS, V_COLUMNS = 16384, 2048  # B * N, H * d_v
IMPLS = ("fagen", "fa4", "sdpa_cudnn", "sdpa_efficient")
LABELS = {"fagen": "fagen", "fa4": "FA4", "sdpa_cudnn": "SDPA cuDNN", "sdpa_efficient": "SDPA efficient"}
CHECK_SHAPE = (1, 4, 2000)  # B, H, N of the check against float32 attention
TOLERANCE = 2e-2  # relative, the worst of O, dQ, dK, dV (bfloat16 inputs)


@dataclass
class WidthRow:
    impl: str
    d_qk: int
    d_v: int
    n: int
    causal: bool
    forward_tflops: float | None = None
    backward_tflops: float | None = None
    error: float | None = None  # the worst of O, dQ, dK, dV against float32 attention
    note: str = ""

    @property
    def case(self) -> str:
        return f"d{self.d_qk}/{self.d_v} N{self.n} {'causal' if self.causal else 'none'}"


DECODE_HEADS = (16, 4)  # Hq, Hkv of a decode step at head_dim 512: a group of 4
DECODE_DIM = 512
DECODE_BATCHES = (1, 4, 16)
DECODE_KEYS = (8192, 32768, 65536)
DECODE_IMPLS = ("fagen", "sdpa_efficient")
DECODE_CALLS = 10  # steps a CUDA graph replays


@dataclass
class DecodeRow:
    """One implementation's head_dim 512 decode step: B sequences of nk keys, one query a head."""
    impl: str
    batch: int
    nk: int
    us: float | None = None  # GPU time a step
    error: float | None = None  # O against float32 attention of the same inputs
    note: str = ""
    kind: str = "decode"  # (tells the rows apart in the JSON)

    @property
    def case(self) -> str:
        return f"B{self.batch} Nk{self.nk}"

    @property
    def cache_bytes(self) -> int:  # K and V of every KV head, bf16
        return self.batch * DECODE_HEADS[1] * self.nk * DECODE_DIM * 2 * 2

    @property
    def tbps(self) -> float | None:
        return self.cache_bytes / self.us / 1e6 if self.us else None


def decode_implementations() -> dict:
    """Each as f(q, k, v) on [B, H, 1, 512] q and [B, Hkv, N, 512] k, v (GQA)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa_efficient(q, k, v):
        group = q.shape[1] // k.shape[1]
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # (its GQA: the KV heads repeated)
            return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))

    return {"fagen": lambda q, k, v: api.attention(q, k, v, causal=True), "sdpa_efficient": sdpa_efficient}


def run_decode(impls: dict, batch: int, nk: int) -> list[DecodeRow]:
    import torch

    hq, hkv = DECODE_HEADS
    q = torch.randn(batch, hq, 1, DECODE_DIM, device="cuda").bfloat16()
    k, v = (torch.randn(batch, hkv, nk, DECODE_DIM, device="cuda").bfloat16() for _ in range(2))
    group = hq // hkv
    ref = torch.softmax(q.float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(DECODE_DIM), -1)
    ref = ref @ v.float().repeat_interleave(group, 1)
    rows = []
    for impl in DECODE_IMPLS:
        row = DecodeRow(impl, batch, nk)
        rows.append(row)
        try:
            f = impls[impl]
            row.error = ((f(q, k, v).float() - ref).norm() / ref.norm()).item()
            if row.error > TOLERANCE:
                row.note = f"error {row.error:.1e} over {TOLERANCE:.0e}: not timed"
                continue
            row.us = graph_step_us(lambda: f(q, k, v))
        except Exception as err:  # noqa: BLE001 - a failing implementation is its row
            row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return rows


def graph_step_us(step, replays: int = 20) -> float:
    """The median GPU time of one call of `step`, from replays of a CUDA graph of DECODE_CALLS calls."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(DECODE_CALLS):
            step()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / DECODE_CALLS)
    return sorted(times)[len(times) // 2]


def decode_markdown(rows: list[DecodeRow]) -> list[str]:
    out = ["", f"### Head dim 512 decode (bfloat16, Hq {DECODE_HEADS[0]}, Hkv {DECODE_HEADS[1]}, one query a head; "
           f"the step's GPU time by CUDA-graph replays; TB/s of K and V read)", "",
           "| B | Nk | fagen µs | TB/s | SDPA efficient µs | TB/s | fagen / SDPA | errors | note |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by_case: dict[tuple[int, int], dict[str, DecodeRow]] = {}
    for r in rows:
        by_case.setdefault((r.batch, r.nk), {})[r.impl] = r
    for (batch, nk), impls in by_case.items():
        mine, peer = impls.get("fagen"), impls.get("sdpa_efficient")
        cells = [f"{r.us:.1f} | {r.tbps:.2f}" if r is not None and r.us else "- | -" for r in (mine, peer)]
        ratio = f"{peer.us / mine.us:.2f}x" if mine and peer and mine.us and peer.us else "-"
        errors = ", ".join(f"{LABELS[i]} {r.error:.1e}" for i, r in impls.items() if r.error is not None)
        notes = "; ".join(f"{LABELS[i]}: {r.note}" for i, r in impls.items() if r.note)
        out.append(f"| {batch} | {nk} | {' | '.join(cells)} | {ratio} | {errors} | {notes} |")
    return out


def forward_flops(d_qk: int, d_v: int, n: int, causal: bool) -> float:
    heads = V_COLUMNS // d_v
    return 2 * (TOKENS // n) * heads * n * n * (d_qk + d_v) / (2 if causal else 1)


def implementations() -> dict:
    """Each implementation as f(q, k, v, causal) on [B, H, N, d] tensors; FA4 where it imports."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    impls = {"fagen": lambda q, k, v, causal: api.attention(q, k, v, causal=causal)}
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v, causal):
            out = flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=causal)
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

        impls["fa4"] = fa4
    except ImportError:
        pass
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def sdpa(q, k, v, causal, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        impls[name] = sdpa
    return impls


def check_error(f, d_qk: int, d_v: int, causal: bool) -> float:
    """The worst relative error of f's O, dQ, dK and dV against float32 attention."""
    import torch

    b, h, n = CHECK_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(d_qk + d_v + causal)
    q, k = (torch.randn(b, h, n, d_qk, device="cuda", generator=gen).bfloat16() for _ in range(2))
    v, dout = (torch.randn(b, h, n, d_v, device="cuda", generator=gen).bfloat16() for _ in range(2))
    ref = [x.float().requires_grad_() for x in (q, k, v)]
    s = ref[0] @ ref[1].transpose(-1, -2) / math.sqrt(d_qk)
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    ref_out = torch.softmax(s, -1) @ ref[2]
    ref_out.backward(dout.float())
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = f(*leaves, causal)
    out.backward(dout)
    pairs = [(out, ref_out), *((x.grad, r.grad) for x, r in zip(leaves, ref))]
    return max(((a.float() - r.float()).norm() / r.float().norm()).item() for a, r in pairs)


def run_case(impls: dict, d_qk: int, d_v: int, n: int, causal: bool, errors: dict) -> list[WidthRow]:
    import torch
    from triton.testing import do_bench

    b, h = TOKENS // n, V_COLUMNS // d_v
    q, k = (torch.randn(b, h, n, d_qk, device="cuda").bfloat16() for _ in range(2))
    v, dout = (torch.randn(b, h, n, d_v, device="cuda").bfloat16() for _ in range(2))
    flops = forward_flops(d_qk, d_v, n, causal)
    rows = []
    for impl in IMPLS:
        row = WidthRow(impl, d_qk, d_v, n, causal)
        rows.append(row)
        if impl not in impls:
            row.note = "not installed"
            continue
        f = impls[impl]
        try:
            if (impl, d_qk, d_v, causal) not in errors:
                errors[impl, d_qk, d_v, causal] = check_error(f, d_qk, d_v, causal)
            row.error = errors[impl, d_qk, d_v, causal]
            if row.error > TOLERANCE:
                row.note = f"error {row.error:.1e} over {TOLERANCE:.0e}: not timed"
                continue
            with torch.no_grad():
                row.forward_tflops = flops / do_bench(lambda: f(q, k, v, causal), warmup=50, rep=300) / 1e9
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            out = f(*leaves, causal)
            ms = do_bench(lambda: out.backward(dout, retain_graph=True), warmup=30, rep=300, grad_to_none=leaves)
            row.backward_tflops = 2.5 * flops / ms / 1e9
        except Exception as err:  # noqa: BLE001 - a failing implementation is its row
            row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return rows


def markdown(rows: list[WidthRow], meta: dict | None = None) -> list[str]:
    """BENCHMARKS.md's head-widths section: a case a line, each implementation's forward and
    backward TFLOP/s, and fagen's over FlashAttention-4's and cuDNN's."""
    out = ["## Head widths: DeepSeek's 192/128 and 512, forward and backward", "",
           "`python3 -m fagen.bench_head_widths`: bfloat16, B * N = 16k tokens, H * d_v = 2048; TFLOP/s with "
           "forward 2 * B * H * N^2 * (d_qk + d_v), backward 2.5 times that, halved for causal (Triton's do_bench, "
           "host time included); each implementation's O, dQ, dK and dV checked against float32 attention first "
           "(the worst relative error shown)."
           + (f" {meta['date']}, {meta.get('gpu', '')}." if meta and meta.get("date") else "")
           + _older_runs(meta), "",
           "| case | " + " | ".join(f"{LABELS[i]} fwd / bwd" for i in IMPLS) + " | fagen / FA4, fwd / bwd | "
           "fagen / cuDNN, fwd / bwd | errors | note |",
           "| --- |" + " --- |" * (len(IMPLS) + 4)]
    by_case: dict[str, dict[str, WidthRow]] = {}
    for r in rows:
        if isinstance(r, WidthRow):
            by_case.setdefault(r.case, {})[r.impl] = r
    for case, impls in by_case.items():
        cells = [f"{_tf(impls.get(i), 'forward')} / {_tf(impls.get(i), 'backward')}" for i in IMPLS]
        ratios = [_ratios(impls.get("fagen"), impls.get(peer)) for peer in ("fa4", "sdpa_cudnn")]
        errors = ", ".join(f"{LABELS[i]} {impls[i].error:.1e}" for i in IMPLS if i in impls and impls[i].error is not None)
        notes = "; ".join(f"{LABELS[i]}: {impls[i].note}" for i in IMPLS if i in impls and impls[i].note)
        out.append(f"| {case} | {' | '.join(cells)} | {' | '.join(ratios)} | {errors} | {notes} |")
    decode = [r for r in rows if isinstance(r, DecodeRow)]
    return out + (decode_markdown(decode) if decode else [])


def _older_runs(meta: dict | None) -> str:
    """The rows kept from runs before the last one (--append): which widths, and when."""
    runs = (meta or {}).get("runs", {})
    older = {key: date for key, date in runs.items() if date != meta.get("date")}
    return (" Rows from earlier runs: " + ", ".join(f"{key} {date}" for key, date in sorted(older.items())) + "."
            if older else "")


def _tf(row: WidthRow | None, which: str) -> str:
    value = None if row is None else getattr(row, f"{which}_tflops")
    return f"{value:.0f}" if value else "-"


def _ratios(mine: WidthRow | None, peer: WidthRow | None) -> str:
    def ratio(which: str) -> str:
        a, b = (None if r is None else getattr(r, f"{which}_tflops") for r in (mine, peer))
        return f"{a / b:.2f}x" if a and b else "-"
    return f"{ratio('forward')} / {ratio('backward')}"


def read_json(path: Path) -> tuple[list[WidthRow], dict]:
    try:
        data = json.loads(Path(path).read_text())
        return ([DecodeRow(**r) if r.get("kind") == "decode" else WidthRow(**r) for r in data["rows"]],
                dict(data.get("meta", {})))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a bench_head_widths JSON ({err}); rerun python3 -m fagen.bench_head_widths") from None


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one case (192/128, N 4k, causal)")
    parser.add_argument("--widths", default=None, help="d_qk/d_v pairs to run, comma-separated (default: all)")
    parser.add_argument("--decode", action="store_true", help="head_dim 512 decode instead of the widths")
    parser.add_argument("--append", action="store_true",
                        help="keep --out's rows of other cases (a run of some widths beside an earlier one's)")
    parser.add_argument("--out", type=Path, default=Path("bench") / JSON)
    args = parser.parse_args(argv)
    widths = WIDTHS if args.widths is None else tuple(tuple(int(x) for x in w.split("/")) for w in args.widths.split(","))
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    impls, errors, rows = implementations(), {}, []
    cases = [(192, 128, 4096, True)] if args.quick else [
        (d_qk, d_v, n, causal) for d_qk, d_v in widths for n in LENGTHS for causal in (False, True)]
    ran = {"decode"} if args.decode else {f"{d_qk}/{d_v}" for d_qk, d_v, _, _ in cases}
    meta["runs"] = dict.fromkeys(ran, meta["date"])  # each table's rows: the date they were run
    if args.append and args.out.exists():
        kept, earlier = read_json(args.out)
        if args.decode:  # the widths kept, the decode rows run again
            rows = [r for r in kept if isinstance(r, WidthRow)]
        else:  # the decode rows and other widths kept
            rows = [r for r in kept if isinstance(r, DecodeRow) or f"{r.d_qk}/{r.d_v}" not in ran]
        meta["runs"] = {**earlier.get("runs", {}), **meta["runs"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.decode:
        decode_impls = decode_implementations()
        for batch in DECODE_BATCHES:
            for nk in DECODE_KEYS:
                rows += run_decode(decode_impls, batch, nk)
                print(" | ".join(f"{r.case} {r.impl} {r.us} us {r.note}" for r in rows[-len(DECODE_IMPLS):]),
                      file=sys.stderr, flush=True)
                args.out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    else:
        for case in cases:
            rows += run_case(impls, *case, errors)
            print(" | ".join(f"{r.case} {r.impl} {_tf(r, 'forward')}/{_tf(r, 'backward')} {r.note}"
                             for r in rows[-len(IMPLS):]), file=sys.stderr, flush=True)
            args.out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    print("\n".join(markdown(rows, meta)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
