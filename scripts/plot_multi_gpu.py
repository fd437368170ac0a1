"""The multi-GPU scaling plot from scripts/multi_gpu.py's TIMING rows (bench/multi_gpu.jsonl):
speed-up over the best one-GPU kernel of the same run against GPUs, per mode and length. Each
point is the latest H200 run that measured it (the code as it stands; rows of other GPUs carry a
"gpu" field and are left out); where that run timed its arms in rounds, the bar spans the rounds.

Run: python3 scripts/plot_multi_gpu.py bench/multi_gpu.jsonl docs/multi_gpu_scaling.png
"""

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


NAMES = {"ring": "ring (torch.distributed group)", "zigzag": "zigzag (torch.distributed group)"}


def _run_number(row) -> int:
    return int(row.get("run", "run0").removeprefix("run") or 0)


def series(rows):
    """{(label, n): {world: (speed-up, low, high)}} for the forward modes and the ring's
    forward+backward, from the latest run at each point."""
    latest = {}
    for row in rows:
        if row.get("gpu", "H200") != "H200":
            continue
        key = (row["kind"], row["n"], row["world"])
        if key not in latest or _run_number(row) >= _run_number(latest[key]):
            latest[key] = row
    points = defaultdict(dict)
    for row in latest.values():
        forward = row["kind"] == "forward"
        single = row["single_ms"] if forward else row["forward+backward single_ms"]
        best = min(single.values())
        for mode in (("zigzag", "ring", "ring (fagen group)") if forward else ("ring",)):
            if mode not in row:
                continue
            label = NAMES.get(mode, mode) if forward else "ring forward+backward"
            each = [best / ms for ms in row[mode].get("rounds_ms", [])] or [row[mode]["speedup"]]
            points[(label, row["n"])][row["world"]] = (row[mode]["speedup"], min(each), max(each))
    return points


def main(source: str, target: str) -> None:
    rows = [json.loads(line) for line in open(source)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, n in zip(axes, (32768, 131072)):
        worlds = sorted({r["world"] for r in rows})
        ax.plot(worlds, worlds, color="grey", linestyle=":", label="linear")
        for (label, length), by_world in sorted(series(rows).items()):
            if length != n:
                continue
            ws = sorted(by_world)
            line, = ax.plot(ws, [by_world[w][0] for w in ws], marker="o", label=label)
            ax.vlines(ws, [by_world[w][1] for w in ws], [by_world[w][2] for w in ws], color=line.get_color(), alpha=0.4)
        ax.set_title(f"causal, N = {n // 1024}k, d = 128, B = 1, H = 16, fp16")
        ax.set_xlabel("GPUs (H200, NVLink)")
        ax.set_xticks(worlds)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speed-up over the best one-GPU kernel")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
