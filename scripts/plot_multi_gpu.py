"""The multi-GPU scaling plot from scripts/multi_gpu.py's TIMING rows (bench/multi_gpu.jsonl):
speed-up over the best one-GPU kernel of the same run against GPUs, per mode and length; the
best (least noisy) of the recorded runs at each point, and the worst as the bar's low end.

Run: python3 scripts/plot_multi_gpu.py bench/multi_gpu.jsonl docs/multi_gpu_scaling.png
"""

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


NAMES = {"ring": "ring (torch.distributed group)", "zigzag": "zigzag (torch.distributed group)"}


def series(rows):
    """{(label, n): {world: [speed-ups]}} for the forward modes and the ring's forward+backward."""
    points = defaultdict(lambda: defaultdict(list))
    for row in rows:
        modes = ("zigzag", "ring", "ring (fagen group)") if row["kind"] == "forward" else ("ring", "zigzag")
        for mode in modes:
            label = NAMES.get(mode, mode) if row["kind"] == "forward" else f"{mode} forward+backward (fagen group)"
            points[(label, row["n"])][row["world"]].append(row[mode]["speedup"])
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
            best = [max(by_world[w]) for w in ws]
            worst = [min(by_world[w]) for w in ws]
            line, = ax.plot(ws, best, marker="o", label=label)
            ax.vlines(ws, worst, best, color=line.get_color(), alpha=0.4)
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
