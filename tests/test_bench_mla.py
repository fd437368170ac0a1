"""The MLA decode benchmark's table, without a GPU (fagen.bench_mla runs its cases)."""

import json
from dataclasses import asdict

import pytest

from fagen.bench_mla import COMPUTE_CASES, MEMORY_CASES, MlaRow, markdown, read_json


def test_the_cases_are_the_issue_bars_shapes():
    """Memory-bound: B 1-16, Hq 16, Nq 1, 8k-64k keys; compute-bound: Hq 128, Nq 2, B 64."""
    assert {(b, hq, nq) for b, hq, nq, _ in MEMORY_CASES} == {(1, 16, 1), (4, 16, 1), (16, 16, 1)}
    assert {nk for *_, nk in MEMORY_CASES} == {8192, 32768, 65536}
    assert all((b, hq, nq) == (64, 128, 2) for b, hq, nq, _ in COMPUTE_CASES)


def test_a_timed_row_shows_its_rates_and_an_untimed_one_why():
    timed = MlaRow(4, 16, 1, 32768, 33, 47.7, 3.16, 96.0, 1.7e-3, host_us=9.04)
    failed = MlaRow(1, 16, 1, 8192, 128, error=0.5, note="error 5.00e-01 over 1.00e-02: not timed")
    failed.error = None
    lines = markdown([timed, failed], {"date": "2026-11-29", "gpu": "NVIDIA H200"})
    assert lines[0] == "## MLA decode: 576/512 over a paged latent cache"
    assert lines[2].endswith("2026-11-29, NVIDIA H200.")
    assert lines[-2] == "| 4 | 16 | 1 | 32768 | 33 | 47.7 | 3.16 | 96 | 9.0 | 1.7e-03 |"
    assert lines[-1] == "| 1 | 16 | 1 | 8192 | 128 | — | — | — | — | error 5.00e-01 over 1.00e-02: not timed |"


def test_the_json_round_trips_and_a_foreign_one_is_refused(tmp_path):
    rows = [MlaRow(16, 16, 1, 65536, 8, 290.4, 4.16, 126.0, 1.7e-3, host_us=19.5)]
    path = tmp_path / "bench_mla.json"
    path.write_text(json.dumps({"meta": {"date": "2026-11-29"}, "rows": [asdict(r) for r in rows]}))
    assert read_json(path) == (rows, {"date": "2026-11-29"})
    path.write_text("[]")
    with pytest.raises(ValueError, match="not a bench_mla JSON"):
        read_json(path)


def test_the_committed_rows_read_back():
    """bench/bench_mla.json, which `fagen bench` turns into BENCHMARKS.md's section."""
    from pathlib import Path

    rows, meta = read_json(Path(__file__).parent.parent / "bench" / "bench_mla.json")
    assert meta["gpu"] and all(r.error is not None and r.error < 1e-2 for r in rows)
