"""FP8 attention: fagen's e4m3 forward beside its own bfloat16 forward and cuDNN's FP8 SDPA
(cudnn-frontend's `sdpa_fp8`, where `import cudnn` works), on the same FP8 values, each checked
against exact attention of those values (float64, on the GPU, one head) before it is timed; and
decode against an e4m3 KV cache beside the bfloat16 cache (KV_CASES: device time of a step, from
CUDA graph replays, and the FP8 bytes a second it reads); and the FP8 backward beside fagen's
bfloat16 backward on the same values (BACKWARD_CASES: kernel time given the forward's out and lse,
the gradients checked against exact ones of head 0 first); and FP8's error against the
unquantized attention (ERROR_CASES: fagen.attention(..., fp8=True) with and without incoherent
processing, beside the bfloat16 attention, each against exact attention of the float32 inputs);
and a chunk of prefill against an e4m3 cache beside the bfloat16 cache, padded and paged
(CHUNK_CASES: causal queries after a cache's keys, device time from CUDA graph replays, the FP8
output checked against the bfloat16 kernel's on the dequantized cache first).

    python3 -m fagen.bench_fp8 [--quick] [--kv-only | --backward-only | --errors-only | --chunk-only]
                               [--out bench/bench_fp8.json]

Activations are Gaussian ("plain") or with 4 channels of q and k 100x the rest ("outliers",
rescaled to the same score variance); descales at amax / 448 per tensor (cuDNN takes one number
each; fagen the same numbers, broadcast). Each row: TFLOP/s of the whole call (fagen's includes
its V^T pass), the relative error against exact attention, and the error of an oracle that only
rounds P (the format's floor)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from fagen import api, fp8_backward, fp8_inputs, runtime, variants
from fagen.backward import compile_backward
from fagen.bench_cases import SweepSize
from fagen.check import WARM_MS, interleaved_us, time_ms, warm_for
from fagen.dispatch import derive_spec
from fagen.spec import Mask, ScoreMod

JSON = "bench_fp8.json"
# fagen's FP8 forward with bfloat16 out, cuDNN's (e4m3 out on sm90), fagen's bfloat16 forward, and
# fagen's FP8 forward with e4m3 out at cuDNN's scale_o (like for like beside cuDNN's)
IMPLS = ("fagen_fp8", "cudnn_fp8", "fagen_bf16", "fagen_fp8_e4m3")
HEAD_DIMS, LENGTHS = (128, 256), (4096, 16384)
OUTLIER_CHANNELS, OUTLIER_SCALE = 4, 100.0
P_SCALE_LOG2 = 8  # cuDNN's P scale, as fagen's (its s_scale; s_descale the inverse)


@dataclass(frozen=True)
class Fp8Case(SweepSize):
    n: int
    head_dim: int
    causal: bool
    activations: str  # plain | outliers

    @property
    def key(self) -> str:
        return f"d{self.head_dim}-n{self.n}-{'causal' if self.causal else 'dense'}-{self.activations}"

    @property
    def flops(self) -> float:
        return 4.0 * self.batch * self.heads * self.n * self.n * self.head_dim / (2 if self.causal else 1)


@dataclass
class Fp8Row:
    case: str
    impl: str
    head_dim: int
    n: int
    causal: bool
    activations: str
    ms: float | None = None
    tflops: float | None = None
    error: float | None = None  # ||out - exact|| / ||exact||, head 0 of batch 0
    note: str = ""


@dataclass(frozen=True)
class KvCase:
    """A decode step: B sequences of Nk cached keys, Hq query heads over Hkv 8 (32 at d 64 and 128,
    Llama's; 16 at d 256, Gemma-2's), one query."""
    batch: int
    keys: int
    head_dim: int = 128

    @property
    def heads_q(self) -> int:
        return 16 if self.head_dim == 256 else 32

    heads_kv = 8

    @property
    def key(self) -> str:
        return f"kv-b{self.batch}-n{self.keys}" + ("" if self.head_dim == 128 else f"-d{self.head_dim}")

    def cache_bytes(self, item: int) -> int:
        """K's and V's bytes a step reads, at `item` bytes an element."""
        return 2 * self.batch * self.heads_kv * self.keys * self.head_dim * item


@dataclass
class KvRow:
    case: str
    batch: int
    keys: int
    bf16_us: float | None = None  # a step's device time against the bfloat16 cache
    fp8_us: float | None = None  # ... against the e4m3 cache
    error: float | None = None  # FP8's ||out - exact|| / ||exact||, exact of the FP8 values (float64, sequence 0)
    note: str = ""
    # a plain read of the e4m3 cache's bytes (one torch.sum over them, in the same graphs' turns):
    # what a step that only reads them costs on this GPU, launch included
    read_us: float | None = None
    head_dim: int = 128
    # e4m3 q too (FlashAttention-3's FP8 call: q_descale a sequence and KV head), on the same e4m3
    # cache: q read by the cache's kernels, which widen it as it lands (fagen.dispatch.fp8_on_cache_kernels)
    fp8_q_us: float | None = None
    fp8_q_error: float | None = None

    @property
    def speedup(self) -> float | None:
        """Tokens a second against the FP8 cache over against the bfloat16 one."""
        return self.bf16_us / self.fp8_us if self.bf16_us and self.fp8_us else None

    @property
    def read_ratio(self) -> float | None:
        """The bfloat16 step's time over a plain read's of the FP8 bytes: what a launch that did
        nothing but read them would gain. A yardstick for small steps, where a launch's fixed cost
        weighs (the sum is no fastest reader: at large sizes the FP8 step beats it)."""
        return self.bf16_us / self.read_us if self.bf16_us and self.read_us else None

    def tbps(self, fp8: bool) -> float | None:
        """The cache's bytes a second read, TB/s."""
        us = self.fp8_us if fp8 else self.bf16_us
        return KvCase(self.batch, self.keys, self.head_dim).cache_bytes(1 if fp8 else 2) / us / 1e6 if us else None


KV_CASES = ([KvCase(b, n) for b in (1, 8, 32) for n in (8192, 32768, 131072)]
            + [KvCase(b, n, 64) for b, n in ((1, 32768), (8, 32768), (32, 32768), (8, 131072))]
            + [KvCase(b, n, 256) for b, n in ((1, 32768), (8, 8192), (8, 32768), (16, 32768))])


@dataclass(frozen=True)
class ChunkCase:
    """A chunk of prefill: B sequences of Nq new queries (causal, bottom right) after Nk - Nq
    cached keys, Hq 32 over Hkv 8, against a cache padded [B, Hkv, Nk, d] or paged (pages of 64
    keys, shuffled)."""
    batch: int
    queries: int
    keys: int
    head_dim: int = 128
    paged: bool = False
    heads_q = 32
    heads_kv = 8
    page_size = 64

    @property
    def key(self) -> str:
        return (f"chunk-b{self.batch}-q{self.queries}-n{self.keys}-d{self.head_dim}"
                + ("-paged" if self.paged else ""))

    @property
    def flops(self) -> float:
        """Causal, bottom right: each query sees the cached keys and the queries up to its own."""
        return 4.0 * self.batch * self.heads_q * self.queries * self.head_dim * (self.keys - self.queries / 2)


CHUNK_CASES = [ChunkCase(b, nq, nk, d, paged) for paged in (False, True)
               for d, b, nq, nk in ((128, 1, 2048, 10240), (128, 4, 512, 4096), (128, 8, 256, 16384),
                                    (64, 1, 2048, 10240), (64, 4, 512, 8192))]


@dataclass
class ChunkRow:
    case: str
    head_dim: int
    batch: int
    queries: int
    keys: int
    paged: bool
    bf16_tflops: float | None = None  # against the bfloat16 cache (padded: the wgmma forward; paged: mma.sync)
    fp8_tflops: float | None = None  # against its e4m3 rounding (the FP8 cache's chunk kernel)
    error: float | None = None  # ||FP8 out - bf16 out|| / ||bf16 out||, the bfloat16 kernel on the dequantized cache
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return self.fp8_tflops / self.bf16_tflops if self.fp8_tflops and self.bf16_tflops else None


@dataclass
class BackwardRow:
    """The FP8 backward and fagen's bfloat16 backward on one case (d128, plain activations)."""
    case: str
    n: int
    causal: bool
    fp8_tflops: float | None = None  # 10 B H N^2 d (halved causal) over the backward's kernel time
    bf16_tflops: float | None = None
    error: float | None = None  # the FP8 gradients' largest ||g - exact|| / ||exact|| of dq, dk, dv, head 0
    bf16_error: float | None = None
    note: str = ""


@dataclass
class ErrorRow:
    """FP8 attention's error against exact attention of the unquantized (float32) inputs, head 0:
    q, k, v quantized a batch and KV head at a time (fagen.attention's fp8=True), then with q and
    k rotated first (incoherent=True), and the bfloat16 attention of the same inputs."""
    case: str
    n: int
    causal: bool
    activations: str
    fp8_error: float | None = None
    incoherent_error: float | None = None
    bf16_error: float | None = None
    note: str = ""


ERROR_CASES = [Fp8Case(4096, 128, causal, act) for causal in (False, True) for act in ("plain", "outliers")]
BACKWARD_CASES = [Fp8Case(n, 128, causal, "plain") for n in LENGTHS for causal in (False, True)]
BACKWARD_CHECK = 0.1  # an FP8 backward's gradients past this against exact ones (its own ~4e-2) are wrong: not timed


def cases(quick: bool = False) -> list[Fp8Case]:
    if quick:
        return [Fp8Case(4096, 128, False, "plain")]
    return [Fp8Case(n, d, causal, act) for d in HEAD_DIMS for n in LENGTHS for causal in (False, True)
            for act in ("plain", "outliers")]


def markdown(rows: list, meta: dict | None = None) -> list[str]:
    """BENCHMARKS.md's FP8 sections, each where it has rows: the forward's (a case a line, each
    implementation's TFLOP/s and error, and fagen FP8 over cuDNN FP8), the KV cache's
    (kv_markdown), the backward's (backward_markdown); a blank line between."""
    out: list[str] = []
    for kind, section in ((Fp8Row, _forward_markdown), (ErrorRow, error_markdown), (KvRow, kv_markdown),
                          (ChunkRow, chunk_markdown), (BackwardRow, backward_markdown)):
        mine = [r for r in rows if isinstance(r, kind)]
        if mine:
            out += ([""] if out else []) + section(mine, meta)
    return out


def _forward_markdown(rows: list[Fp8Row], meta: dict | None = None) -> list[str]:
    out = ["## FP8 forward: fagen e4m3 against cuDNN FP8 and fagen bfloat16", "",
           "`python3 -m fagen.bench_fp8`: B * N = 16k tokens, H * d = 2048, per-tensor descales at amax / 448; "
           "TFLOP/s of the whole call (each implementation's best of as many rounds as there are implementations, "
           f"taken in turns, each timing after {WARM_MS:.0f} ms of its own untimed calls: rotated_ms); errors against "
           "exact attention of the same FP8 values (head 0). "
           "On sm90 cuDNN builds FP8 attention only with an e4m3 out (its bf16 out is Blackwell's), so its error "
           "includes O's rounding to e4m3, and it writes half the bytes: fagen's e4m3-out columns are the like-for-like "
           "ones (scale_o = 1 / v_descale, amax_o asked for, as cuDNN's run)."
           + _dated(meta, "forward"), "",
           "| d | N | mask | activations | fagen FP8 | cuDNN FP8 | fagen / cuDNN | fagen bf16 | fagen FP8 error | "
           "cuDNN FP8 error | fagen FP8, e4m3 out | e4m3 out / cuDNN | its error | note |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by_case: dict[str, dict[str, Fp8Row]] = {}
    for r in rows:
        by_case.setdefault(r.case, {})[r.impl] = r
    for impls in by_case.values():
        f, c, h, e = (impls.get(i) for i in IMPLS)
        one = f or c or h or e
        notes = "; ".join(f"{r.impl}: {r.note}" for r in (f, c, h, e) if r is not None and r.note)
        out.append(f"| {one.head_dim} | {one.n} | {'causal' if one.causal else 'none'} | {one.activations} | "
                   f"{_tf(f)} | {_tf(c)} | {_ratio(f, c)} | {_tf(h)} | {_err(f)} | {_err(c)} | {_tf(e)} | "
                   f"{_ratio(e, c)} | {_err(e)} | {notes} |")
    return out


def _ratio(mine: Fp8Row | None, peer: Fp8Row | None) -> str:
    return f"{mine.tflops / peer.tflops:.2f}x" if mine and peer and mine.tflops and peer.tflops else "-"


def kv_markdown(rows: list[KvRow], meta: dict | None = None) -> list[str]:
    """BENCHMARKS.md's FP8 KV cache section: a decode step against the e4m3 and the bfloat16 cache."""
    out = ["## FP8 KV cache: decode against an e4m3 cache and a bfloat16 one", "",
           "`python3 -m fagen.bench_fp8 --kv-only`: a bfloat16 q (one query; Hq 32, or 16 at d 256) against Hkv 8 heads, "
           "device time of a step (CUDA graph replays), the cache's bytes a second; the FP8 step's error against "
           "exact attention of the FP8 values (float64, sequence 0). Plain read: one `torch.sum` over exactly the "
           "e4m3 cache's bytes, replayed in turn with the two steps: a yardstick for small steps, where a launch's fixed cost weighs "
           "(at large sizes the FP8 step reads faster than the sum). e4m3 q, k, v: the same step with q in e4m3 too "
           "(q_descale a sequence and KV head), its error against exact attention of all three FP8 values."
           + _dated(meta, "kv"), "",
           "| d | B | Nk | bf16 cache us | TB/s | e4m3 cache us | TB/s | tokens/s, e4m3 / bf16 | plain read us | "
           "bf16 / read | e4m3 error | e4m3 q, k, v us | its error | note |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [f"{x:.1f}" if x else "-" for x in (r.bf16_us, r.tbps(False), r.fp8_us, r.tbps(True))]
        speedup = f"{r.speedup:.2f}x" if r.speedup else "-"
        read = f"{r.read_us:.1f} | {r.read_ratio:.2f}x" if r.read_ratio else "- | -"
        error, q_error = (f"{x:.1e}" if x is not None else "-" for x in (r.error, r.fp8_q_error))
        fp8_q = f"{r.fp8_q_us:.1f}" if r.fp8_q_us else "-"
        out.append(f"| {r.head_dim} | {r.batch} | {r.keys} | {' | '.join(cells)} | {speedup} | {read} | {error} | "
                   f"{fp8_q} | {q_error} | {r.note} |")
    return out


def chunk_markdown(rows: list[ChunkRow], meta: dict | None = None) -> list[str]:
    """BENCHMARKS.md's chunked-prefill section: a chunk of queries against the e4m3 and the
    bfloat16 cache, padded and paged."""
    out = ["## FP8 KV cache: a chunk of prefill against an e4m3 cache and a bfloat16 one", "",
           "`python3 -m fagen.bench_fp8 --chunk-only`: Nq causal queries a sequence after Nk - Nq cached keys "
           "(bottom right), Hq 32 over Hkv 8, a bfloat16 q; TFLOP/s of the device time (CUDA graph replays); padded "
           "[B, Hkv, Nk, d] (`fagen.attention`) or paged (pages of 64 keys, shuffled; `fagen.prepare_with_kvcache`). The "
           "bfloat16 cache runs the wgmma forward padded and the mma.sync kernel paged; the e4m3 cache the FP8 "
           "cache's chunk kernel (mma.sync) in both. Error: the e4m3 output against the bfloat16 kernel's on the "
           "dequantized cache." + _dated(meta, "chunk"), "",
           "| d | B | Nq | Nk | layout | bf16 cache TFLOP/s | e4m3 cache TFLOP/s | e4m3 / bf16 | error | note |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [f"{x:.0f}" if x else "-" for x in (r.bf16_tflops, r.fp8_tflops)]
        ratio = f"{r.ratio:.2f}x" if r.ratio else "-"
        error = f"{r.error:.1e}" if r.error is not None else "-"
        out.append(f"| {r.head_dim} | {r.batch} | {r.queries} | {r.keys} | {'paged' if r.paged else 'padded'} | "
                   f"{' | '.join(cells)} | {ratio} | {error} | {r.note} |")
    return out


def error_markdown(rows: list[ErrorRow], meta: dict | None = None) -> list[str]:
    """BENCHMARKS.md's FP8 error section: the error against the unquantized attention, plain and
    with incoherent processing, beside bfloat16's."""
    out = ["## FP8 error against the unquantized attention: incoherent processing", "",
           "`python3 -m fagen.bench_fp8 --errors-only`: d 128, H 16, B x N = 16k; each output's relative error "
           "against exact attention (float64) of the float32 inputs, head 0: `fagen.attention(..., fp8=True)` "
           "(q, k, v quantized to e4m3 a batch and KV head at a time), the same with `incoherent=True` (q and k "
           "rotated by a random-sign Hadamard matrix before they are quantized: fagen.incoherent), and the "
           "bfloat16 attention of the inputs rounded to bfloat16. Outliers: 4 channels of q and k 100x the rest."
           + _dated(meta, "errors"), "",
           "| N | mask | activations | FP8 | FP8, incoherent | incoherent / plain | bfloat16 | note |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [f"{x:.1e}" if x is not None else "-" for x in (r.fp8_error, r.incoherent_error)]
        ratio = f"{r.incoherent_error / r.fp8_error:.2f}x" if r.fp8_error and r.incoherent_error else "-"
        bf16 = f"{r.bf16_error:.1e}" if r.bf16_error is not None else "-"
        out.append(f"| {r.n} | {'causal' if r.causal else 'none'} | {r.activations} | {' | '.join(cells)} | {ratio} | "
                   f"{bf16} | {r.note} |")
    return out


def backward_markdown(rows: list[BackwardRow], meta: dict | None = None) -> list[str]:
    """BENCHMARKS.md's FP8 backward section: its TFLOP/s and fagen's bfloat16 backward's, a case a line."""
    out = ["## FP8 backward: fagen e4m3 against fagen bfloat16", "",
           "`python3 -m fagen.bench_fp8 --backward-only`: d 128, B * N = 16k tokens, H 16, per-tensor descales; "
           "the backward alone given the forward's out and lse (TFLOP/s of 10 B H N^2 d, halved causal); "
           "errors: the largest of dq's, dk's and dv's against exact gradients of the same FP8 values "
           "(float64, head 0), the bfloat16 backward on those values widened."
           + _dated(meta, "backward"), "",
           "| N | mask | fagen FP8 | fagen bf16 | FP8 / bf16 | FP8 error | bf16 error | note |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{r.fp8_tflops / r.bf16_tflops:.2f}x" if r.fp8_tflops and r.bf16_tflops else "-"
        tf = [f"{x:.0f}" if x else "-" for x in (r.fp8_tflops, r.bf16_tflops)]
        errors = [f"{x:.1e}" if x is not None else "-" for x in (r.error, r.bf16_error)]
        out.append(f"| {r.n} | {'causal' if r.causal else 'none'} | {tf[0]} | {tf[1]} | {ratio} | {errors[0]} | "
                   f"{errors[1]} | {r.note} |")
    return out


def _dated(meta: dict | None, section: str) -> str:
    """A section's date and GPU: its own run's (meta["<section>_date"], written by --<section>-only,
    which keeps the other sections' rows) or the whole run's."""
    date = meta and (meta.get(f"{section}_date") or meta.get("date"))
    return f" {date}, {meta.get('gpu', '')}." if date else ""


def _tf(row: Fp8Row | None) -> str:
    return f"{row.tflops:.0f}" if row is not None and row.tflops else "-"


def _err(row: Fp8Row | None) -> str:
    return f"{row.error:.1e}" if row is not None and row.error is not None else "-"


def read_json(path: Path) -> tuple[list, dict]:
    """Every section's rows (Fp8Row, ErrorRow, KvRow, BackwardRow) and the run's meta."""
    try:
        data = json.loads(Path(path).read_text())
        rows = ([Fp8Row(**r) for r in data["rows"]] + [ErrorRow(**r) for r in data.get("errors_rows", [])]
                + [KvRow(**r) for r in data.get("kv_rows", [])]
                + [ChunkRow(**r) for r in data.get("chunk_rows", [])]
                + [BackwardRow(**r) for r in data.get("backward_rows", [])])
        return rows, dict(data.get("meta", {}))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a {JSON} ({error}); run python3 -m fagen.bench_fp8") from None


def activations(case: Fp8Case, gen):
    """q, k, v float32 [B, H, N, d] on the GPU: Gaussian, or with OUTLIER_CHANNELS channels of q
    and k OUTLIER_SCALE times the rest, rescaled so that the scores keep unit variance."""
    import torch

    shape = (case.batch, case.heads, case.n, case.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen) for _ in range(3))
    if case.activations == "outliers":
        for x in (q, k):
            x[..., :OUTLIER_CHANNELS] *= OUTLIER_SCALE
        spread = ((case.head_dim - OUTLIER_CHANNELS + OUTLIER_CHANNELS * OUTLIER_SCALE ** 4) / case.head_dim) ** 0.25
        q, k = q / spread, k / spread
    return q, k, v


def quantized(x):
    """x's e4m3 tensor and its per-tensor descale (amax / 448)."""
    import torch

    descale = x.abs().amax().clamp(min=1e-12) / 448.0
    return (x / descale).to(torch.float8_e4m3fn), descale.reshape(1).float()


def exact_head0(q8, k8, v8, descales, causal: bool, scale: float):
    """Exact attention (float64, GPU) of batch 0, head 0 of the FP8 values."""
    import torch

    q, k, v = (x[0, 0].double() * d.double() for x, d in zip((q8, k8, v8), descales))
    s = (q @ k.T) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def relative(out, ref) -> float:
    import torch

    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm())


def cudnn_fp8(case: Fp8Case, q8, k8, v8, descales, scale: float):
    """A callable running cuDNN's FP8 SDPA on q8, k8, v8 ([B, H, N, d] contiguous), the out it writes
    and a function reading that out as float; None where cudnn-frontend is not importable. The out is
    bfloat16 where cuDNN builds that, else e4m3 in v's units (scale_o = 1 / v_descale)."""
    try:
        import cudnn
    except ImportError:
        return None
    failures = []
    for out_type in ("BFLOAT16", "FP8_E4M3"):
        try:
            return _cudnn_fp8_graph(cudnn, out_type, case, q8, k8, v8, descales, scale)
        except Exception as err:  # noqa: BLE001 - try the next out type, report both if neither builds
            failures.append(f"{out_type} out: {str(err).splitlines()[0][:120]}")
    raise RuntimeError("; ".join(failures))


def _cudnn_fp8_graph(cudnn, out_type: str, case: Fp8Case, q8, k8, v8, descales, scale: float):
    import torch

    b, h, n, d = q8.shape
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    stride = (h * n * d, n * d, d, 1)
    q, k, v = (graph.tensor(uid=uid, dim=(b, h, n, d), stride=stride, data_type=cudnn.data_type.FP8_E4M3)
               for uid in (1, 2, 3))
    one = lambda uid: graph.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)  # noqa: E731
    scalars = {name: one(uid) for uid, name in enumerate(("descale_q", "descale_k", "descale_v", "scale_s",
                                                          "descale_s", "scale_o"), start=10)}
    o, _, amax_s, amax_o = graph.sdpa_fp8(q=q, k=k, v=v, generate_stats=False, attn_scale=scale,
                                          use_causal_mask=case.causal, **scalars)
    o.set_uid(4).set_output(True).set_dim((b, h, n, d)).set_stride(stride).set_data_type(
        getattr(cudnn.data_type, out_type))
    for uid, amax in ((5, amax_s), (6, amax_o)):
        amax.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(
            cudnn.data_type.FLOAT)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    fp8_out = out_type == "FP8_E4M3"
    if fp8_out:
        out = torch.zeros((b, h, n, d), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        scale_o, read = 1.0 / descales[2], (lambda: out.float() * descales[2])
    else:
        out = torch.full((b, h, n, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        scale_o, read = torch.ones(1, device="cuda"), (lambda: out)
    values = [descales[0], descales[1], descales[2], torch.tensor([2.0 ** P_SCALE_LOG2], device="cuda"),
              torch.tensor([2.0 ** -P_SCALE_LOG2], device="cuda"), scale_o.reshape(1).float()]
    pack = {1: q8, 2: k8, 3: v8, 4: out, 5: torch.zeros(1, device="cuda"), 6: torch.zeros(1, device="cuda"),
            **{uid: x for uid, x in enumerate(values, start=10)}}
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device="cuda")
    return (lambda: graph.execute(pack, workspace)), read, ("e4m3 out" if fp8_out else "")


def run_case(case: Fp8Case) -> list[Fp8Row]:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.key.encode()))
    q, k, v = activations(case, gen)
    (q8, qd), (k8, kd), (v8, vd) = (quantized(x) for x in (q, k, v))
    scale = case.head_dim ** -0.5
    exact = exact_head0(q8, k8, v8, (qd, kd, vd), case.causal, scale)
    scale_o = 1.0 / vd  # O in v's units, as cuDNN's run writes it (cudnn_fp8)
    runners = {
        "fagen_fp8": lambda: api.attention(q8, k8, v8, causal=case.causal, q_descale=qd, k_descale=kd, v_descale=vd),
        "fagen_fp8_e4m3": lambda: api.attention(q8, k8, v8, causal=case.causal, q_descale=qd, k_descale=kd,
                                                v_descale=vd, scale_o=scale_o, return_amax=True)[0],
        "fagen_bf16": (lambda qb=q.bfloat16(), kb=k.bfloat16(), vb=v.bfloat16():
                       api.attention(qb, kb, vb, causal=case.causal)),
    }
    rows, timed = [], {}
    for impl in IMPLS:  # each checked first
        row = Fp8Row(case.key, impl, case.head_dim, case.n, case.causal, case.activations)
        rows.append(row)
        try:
            if impl == "cudnn_fp8":
                made = cudnn_fp8(case, q8, k8, v8, (qd, kd, vd), scale)
                if made is None:
                    row.note = "cudnn-frontend not importable"
                    continue
                fn, read, row.note = made
                fn()
                torch.cuda.synchronize()
                got = read()
            else:
                fn = runners[impl]
                got = fn()
                if impl == "fagen_fp8_e4m3":  # back to O's units
                    got = got.float() * vd
            torch.cuda.synchronize()
            row.error = relative(got[0, 0], exact)
            timed[impl] = (row, fn)
        except Exception as err:  # noqa: BLE001 - a refused or failing implementation is its row
            row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    for row, ms in zip((row for row, _ in timed.values()), rotated_ms([fn for _, fn in timed.values()])):
        row.ms, row.tflops = ms, case.flops / ms / 1e9
    return rows


def rotated_ms(fns: list, warm_ms: float = WARM_MS) -> list[float]:
    """time_ms of each fn, its best of as many rounds as there are fns, each round starting one
    further on, and each timing after warm_ms of the arm's own untimed calls: an arm timed right
    after another (the bfloat16 forward, cuDNN's) read 6-10% under its best with time_ms's five
    warm-up calls alone, where in turns fagen's two outputs are within 1% (an H200 near its power
    cap, 2026-12-01)."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(len(fns)):
        for i in range(len(fns)):
            at = (r + i) % len(fns)
            warm_for(fns[at], warm_ms)
            times[at].append(time_ms(fns[at]))
    return [min(t) for t in times]


def run_error_case(case: Fp8Case) -> ErrorRow:
    """One ERROR_CASES row: fagen.attention on the case's activations in bfloat16, with fp8=True
    (incoherent or not) and without, each against exact attention of the float32 inputs."""
    import torch

    row = ErrorRow(case.key, case.n, case.causal, case.activations)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.key.encode()))
    q, k, v = activations(case, gen)
    scale = case.head_dim ** -0.5
    ones = tuple(torch.ones(1, device="cuda") for _ in range(3))
    exact = exact_head0(q, k, v, ones, case.causal, scale)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    try:
        with torch.no_grad():
            row.fp8_error = relative(api.attention(qb, kb, vb, causal=case.causal, fp8=True)[0, 0], exact)
            row.incoherent_error = relative(api.attention(qb, kb, vb, causal=case.causal, fp8=True, incoherent=True)[0, 0],
                                            exact)
            row.bf16_error = relative(api.attention(qb, kb, vb, causal=case.causal)[0, 0], exact)
    except Exception as err:  # noqa: BLE001 - a failing case is its row
        row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return row


def run_kv_case(case: KvCase) -> KvRow:
    """One decode step against the bfloat16 cache and against its e4m3 rounding (descales per
    (sequence, KV head)), the FP8 step checked against exact attention of the FP8 values before
    both are timed."""
    import torch

    row = KvRow(case.key, case.batch, case.keys, head_dim=case.head_dim)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.key.encode()))
    shape = (case.batch, case.heads_kv, case.keys, case.head_dim)
    q = torch.randn((case.batch, case.heads_q, 1, case.head_dim), device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(shape, device="cuda", generator=gen).bfloat16() for _ in range(2))
    (k8, kd), (v8, vd) = (fp8_inputs.quantized(x) for x in (k, v))
    try:
        with torch.no_grad():
            got = api.attention(q, k8, v8, k_descale=kd, v_descale=vd)
            kx, vx = (x[0].double() * d[0][:, None, None].double() for x, d in ((k8, kd), (v8, vd)))
            group = case.heads_q // case.heads_kv
            kx, vx = (x.repeat_interleave(group, dim=0) for x in (kx, vx))
            exact = torch.softmax((q[0].double() @ kx.transpose(1, 2)) * case.head_dim ** -0.5, dim=-1) @ vx
            row.error = relative(got[0], exact)
            q8, qd = fp8_inputs.quantized(q, case.heads_kv)
            got8 = api.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
            qx = q8[0].double() * qd[0].repeat_interleave(group)[:, None, None].double()
            exact8 = torch.softmax((qx @ kx.transpose(1, 2)) * case.head_dim ** -0.5, dim=-1) @ vx
            row.fp8_q_error = relative(got8[0], exact8)
            # the e4m3 cache's bytes in one buffer, for the plain read beside the steps
            raw = torch.cat([k8.view(torch.uint8).reshape(-1), v8.view(torch.uint8).reshape(-1)]).view(torch.bfloat16)
            # replayed in turns: the arms see the same clocks (check.interleaved_us)
            row.bf16_us, row.fp8_us, row.read_us, row.fp8_q_us = interleaved_us(
                lambda: api.attention(q, k, v), lambda: api.attention(q, k8, v8, k_descale=kd, v_descale=vd),
                lambda: raw.sum(), lambda: api.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd))
    except Exception as err:  # noqa: BLE001 - a failing case is its row
        row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return row


def run_chunk_case(case: ChunkCase) -> ChunkRow:
    """A chunk of prefill against the bfloat16 cache and its e4m3 rounding (descales a sequence
    and KV head), the e4m3 output checked against the bfloat16 kernel's on the dequantized cache
    (within bfloat16's tolerance: the FP8 cache's kernels widen K and V exactly) before both are
    timed, in turns."""
    import torch

    row = ChunkRow(case.key, case.head_dim, case.batch, case.queries, case.keys, case.paged)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.key.encode()))
    q = torch.randn((case.batch, case.heads_q, case.queries, case.head_dim), device="cuda", generator=gen).bfloat16()
    shape = (case.batch, case.heads_kv, case.keys, case.head_dim)
    (k8, kd), (v8, vd) = (fp8_inputs.quantized(torch.randn(shape, device="cuda", generator=gen)) for _ in range(2))
    k16, v16 = (x.float().mul(d[:, :, None, None]).bfloat16() for x, d in ((k8, kd), (v8, vd)))
    try:
        if case.paged:
            pages = case.batch * case.keys // case.page_size
            order = torch.randperm(pages, device="cuda", generator=gen)
            table = torch.empty_like(order)
            table[order] = torch.arange(pages, device="cuda")
            table = table.view(case.batch, -1).to(torch.int32)
            lengths = torch.full((case.batch,), case.keys, dtype=torch.int32, device="cuda")

            def paged(x):  # [B, Hkv, Nk, d] as pages of a shuffled pool: page p of the pool is table's entry
                return x.permute(0, 2, 1, 3).reshape(pages, case.page_size, case.heads_kv, case.head_dim)[order]

            k16p, v16p, k8p, v8p = (paged(x).contiguous() for x in (k16, v16, k8, v8))
            # prepared (a serving loop's form; packed outside the graphs the timing captures)
            bf16_step = api.prepare_with_kvcache(q, k16p, v16p, lengths, table, causal=True)
            fp8_step = api.prepare_with_kvcache(q, k8p, v8p, lengths, table, causal=True, k_descale=kd, v_descale=vd)
            bf16 = lambda: bf16_step(q, k16p, v16p, lengths, table)
            fp8 = lambda: fp8_step(q, k8p, v8p, lengths, table)
        else:
            bf16 = lambda: api.attention(q, k16, v16, causal=True)
            fp8 = lambda: api.attention(q, k8, v8, causal=True, k_descale=kd, v_descale=vd)
        with torch.no_grad():
            want = bf16()
            row.error = relative(fp8(), want.double())
            if row.error > 1e-2:  # (bfloat16's own tolerance against the same values)
                row.note = f"FP8 cache output off by {row.error:.1e}: not timed"
                return row
            bf16_us, fp8_us = interleaved_us(bf16, fp8)
        row.bf16_tflops, row.fp8_tflops = (case.flops / us / 1e6 for us in (bf16_us, fp8_us))
    except Exception as err:  # noqa: BLE001 - a failing case is its row
        row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return row


def run_backward_case(case: Fp8Case) -> BackwardRow:
    """The FP8 backward (fagen.fp8_backward) and fagen's bfloat16 backward on the same values,
    each checked against exact gradients of head 0 (float64 autograd on the GPU) before timing."""
    import torch

    row = BackwardRow(case.key, case.n, case.causal)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.key.encode()))
    (q8, qd), (k8, kd), (v8, vd) = (quantized(x) for x in activations(case, gen))
    dout = torch.randn(q8.shape, device="cuda", generator=gen).bfloat16()
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    flops = 10.0 * case.batch * case.heads * case.n * case.n * case.head_dim / (2 if case.causal else 1)
    try:
        mask = Mask(kind="causal", align="bottom_right") if case.causal else Mask(kind="none")
        out, lse = runtime.compile_kernel(variants.fp8_spec("float8_e4m3", case.head_dim, mask, ScoreMod()))(
            q8, k8, v8, return_lse=True, **descales)
        fp8 = lambda: fp8_backward.backward(dout, q8, k8, v8, out, lse, causal=case.causal, **descales)  # noqa: E731
        qb, kb, vb = (x.float().mul(d).bfloat16() for x, d in ((q8, qd), (k8, kd), (v8, vd)))
        backward = compile_backward(variants.trainable(derive_spec(qb, causal=case.causal, keys=case.n)))
        out_b, lse_b = backward.forward(qb, kb, vb, return_lse=True)
        bf16 = lambda: (lambda g: (g.dq, g.dk, g.dv))(backward(dout, qb, kb, vb, out_b, lse_b))  # noqa: E731
        exact = _exact_gradients_head0(q8, k8, v8, (qd, kd, vd), dout, case.causal, case.head_dim ** -0.5)
        row.error, row.bf16_error = (max(relative(g[0, 0], e) for g, e in zip(fn(), exact)) for fn in (fp8, bf16))
        if not row.error <= BACKWARD_CHECK:
            row.note = f"WRONG, not timed: FP8 gradients {row.error:.1e} against exact (check {BACKWARD_CHECK})"
            return row
        row.fp8_tflops, row.bf16_tflops = (flops / time_ms(fn) / 1e9 for fn in (fp8, bf16))
    except Exception as err:  # noqa: BLE001 - a failing case is its row
        row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return row


def _exact_gradients_head0(q8, k8, v8, descales, dout, causal: bool, scale: float):
    """dq, dk, dv of batch 0, head 0 of the FP8 values' attention (float64 autograd on the GPU)."""
    import torch

    q, k, v = (x[0, 0].double().mul(d.double()).requires_grad_() for x, d in zip((q8, k8, v8), descales))
    s = (q @ k.T) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.autograd.grad(torch.softmax(s, dim=-1) @ v, (q, k, v), dout[0, 0].double())


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one case of each section (d128, N 4k, dense)")
    only_sections = parser.add_mutually_exclusive_group()
    for section, what in (("forward", "the forward's cases (fagen FP8 with bfloat16 and e4m3 out, cuDNN FP8, fagen "
                                      "bfloat16)"), ("kv", "the KV cache's cases"), ("chunk", "the chunked-prefill cases"),
                          ("backward", "the FP8 backward's cases"),
                          ("errors", "the error report's cases (FP8 against the unquantized attention)")):
        only_sections.add_argument(f"--{section}-only", dest="only", action="store_const", const=section,
                                   help=f"{what} alone (the other sections kept from --out's JSON)")
    parser.add_argument("--out", type=Path, default=Path("bench") / JSON)
    args = parser.parse_args(argv)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    kept: list = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.only and args.out.exists():
        kept, kept_meta = read_json(args.out)
        # the kept sections keep their dates; the one run now gets today's
        meta = {**kept_meta, "gpu": meta["gpu"], "torch": meta["torch"], f"{args.only}_date": meta["date"]}
        meta.setdefault("date", meta[f"{args.only}_date"])
    runs = (("forward", Fp8Row, cases(args.quick)), ("errors", ErrorRow, ERROR_CASES[:1] if args.quick else ERROR_CASES),
            ("kv", KvRow, KV_CASES[:1] if args.quick else KV_CASES),
            ("chunk", ChunkRow, CHUNK_CASES[:1] if args.quick else CHUNK_CASES),
            ("backward", BackwardRow, BACKWARD_CASES[:1] if args.quick else BACKWARD_CASES))
    # each section's rows: run now, or kept from the JSON where another section alone runs
    sections = {name: [] if args.only in (None, name) else [r for r in kept if isinstance(r, kind)]
                for name, kind, _ in runs}

    def write() -> None:
        args.out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in sections["forward"]],
                                        **{f"{name}_rows": [asdict(r) for r in sections[name]]
                                           for name in ("errors", "kv", "chunk", "backward")}}, indent=1))

    run = {"forward": run_case, "errors": run_error_case, "kv": run_kv_case, "chunk": run_chunk_case,
           "backward": run_backward_case}
    for name, _, section_cases in runs:
        if args.only not in (None, name):
            continue
        for case in section_cases:
            got = run[name](case)
            sections[name] += got if isinstance(got, list) else [got]
            print(f"{case.key}: {got}", file=sys.stderr, flush=True)
            write()
    print("\n".join(markdown([r for name, _, _ in runs for r in sections[name]], meta)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
