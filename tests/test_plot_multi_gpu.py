"""scripts/plot_multi_gpu.py's points: the latest H200 run of each (kind, length, world), its
rounds as the bar; rows of other GPUs (a "gpu" field) left out of the H200 plot."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "plot_multi_gpu.py"
spec = importlib.util.spec_from_file_location("plot_multi_gpu", SCRIPT)
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)


def _row(run: str, ring_ms: float, rounds: list[float], **extra) -> dict:
    return {"kind": "forward+backward", "n": 32768, "world": 4, "run": run,
            "forward+backward single_ms": {"fagen": 28.0, "cudnn": 30.0},
            "ring": {"ms": ring_ms, "speedup": round(28.0 / ring_ms, 3), "rounds_ms": rounds}, **extra}


def test_the_latest_h200_run_gives_the_point_and_its_rounds_the_bar():
    rows = [_row("run30", 8.0, [7.0, 8.0, 10.0]), _row("run9", 7.0, [7.0]),
            _row("run32", 5.0, [5.0], gpu="H100")]
    point = plot.series(rows)[("ring forward+backward", 32768)][4]
    assert point == (3.5, 28.0 / 10.0, 28.0 / 7.0)
