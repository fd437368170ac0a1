"""fagen.flex against FlexAttention: the benchmark's rows, JSON and table (fagen.bench_flex runs
them): apart from the runner so that `fagen bench` redraws BENCHMARKS.md from the JSON where
there is no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

JSON = "bench_flex.json"  # beside fagen bench's JSON, whose BENCHMARKS.md takes its table


@dataclass
class FlexRow:
    case: str
    mod: str
    impl: str  # fagen | flex
    head_dim: int
    n: int
    batch: int
    heads: int
    fwd_ms: float | None = None
    fwd_tflops: float | None = None
    fwd_bwd_ms: float | None = None
    fwd_bwd_tflops: float | None = None
    error: float | None = None  # worst relative error of out, dq, dk, dv against FlexAttention in float32
    note: str = ""


def read_json(path: Path) -> tuple[list[FlexRow], dict]:
    """The rows and meta of a bench_flex.json; ValueError (one line) for a file that is not one."""
    try:
        data = json.loads(Path(path).read_text())
        return [FlexRow(**r) for r in data["rows"]], dict(data.get("meta", {}))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a bench_flex.json ({error}); run python3 -m fagen.bench_flex") from None


def markdown(rows: list[FlexRow], meta: dict | None = None) -> list[str]:
    """BENCHMARKS.md's section: a case a line, fagen and compiled FlexAttention forward and
    forward + backward TFLOP/s (kept pairs) and their ratios; a row that was not timed says why."""
    out = ["## FlexAttention's API: fagen.flex against compiled FlexAttention", "",
           "attention-gym's mods, the same Python functions on both (`python3 -m fagen.bench_flex`); fp16, "
           "B * N = 16k tokens, H * d = 2048; TFLOP/s of the kept (q, k) pairs; each checked against "
           "FlexAttention in float32 before it is timed." + (f" {meta['date']}." if meta and meta.get("date") else ""),
           "", "| mod | d | N | fagen fwd | Flex fwd | fagen / Flex | fagen fwd+bwd | Flex fwd+bwd | fagen / Flex | note |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by_case: dict[str, dict[str, FlexRow]] = {}
    for r in rows:
        by_case.setdefault(r.case, {})[r.impl] = r
    for impls in by_case.values():
        f, x = impls.get("fagen"), impls.get("flex")
        any_row = f or x
        notes = "; ".join(f"{r.impl}: {r.note}" for r in (f, x) if r is not None and r.note)
        out.append(f"| {any_row.mod} | {any_row.head_dim} | {any_row.n} | {_tf(f, 'fwd_tflops')} | "
                   f"{_tf(x, 'fwd_tflops')} | {_ratio(f, x, 'fwd_tflops')} | {_tf(f, 'fwd_bwd_tflops')} | "
                   f"{_tf(x, 'fwd_bwd_tflops')} | {_ratio(f, x, 'fwd_bwd_tflops')} | {notes} |")
    return out


def _tf(row: FlexRow | None, field: str) -> str:
    value = None if row is None else getattr(row, field)
    return "n/a" if value is None else f"{value:.0f}"


def _ratio(a: FlexRow | None, b: FlexRow | None, field: str) -> str:
    x, y = (None if r is None else getattr(r, field) for r in (a, b))
    return "n/a" if not x or not y else f"{x / y:.2f}x"
