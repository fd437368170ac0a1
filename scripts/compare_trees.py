"""Two checkouts against each other on one GPU: the same benchmark in alternating processes.

    python3 scripts/compare_trees.py OLD_DIR NEW_DIR [--what quick|serving|host] [--rounds 4]

Each round runs both trees, each in a process of its own pinned to one core (host time moves
with the core and the process), the order alternating from round to round (OLD, NEW, then NEW,
OLD) so that drift falls on both. `quick` is `fagen bench --quick` (TF/s), `serving` is `fagen
bench --serving` (us, GPU time from CUDA-graph replays), `host` the serving benchmark's host-time
cases alone (us of host time a call). Per case: both medians, new / old (for TF/s, old / new:
above 1 is slower either way), both ranges, and whether the ranges are apart: a ratio past the
bar with overlapping ranges is the noise's, not the change's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HOST_CASES = """
import json, sys
import numpy as np
from fagen import bench_serving
rng = np.random.default_rng(0)
rows = [row for case in bench_serving.cases() if case.section == "host" for row in bench_serving.run_host(case, rng)]
json.dump([{"case": r.case, "impl": r.impl, "us": r.us} for r in rows], open(sys.argv[1], "w"))
"""


def run_once(tree: Path, what: str, core: int) -> dict[tuple[str, str], float]:
    """{(case, impl): value} of one process of `tree`: TF/s for quick, us otherwise."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory() as out:
        if what == "host":
            command = [sys.executable, "-c", HOST_CASES, f"{out}/rows.json"]
        else:
            command = [sys.executable, "-m", "fagen", "bench", f"--{what}", "-o", out, "--markdown", f"{out}/B.md"]
        subprocess.run(["taskset", "-c", str(core), *command], cwd=tree, env=env, check=True, capture_output=True)
        if what == "host":
            rows = json.loads(Path(out, "rows.json").read_text())
            return {(r["case"], r["impl"]): r["us"] for r in rows if r["us"] is not None}
        name = "bench.json" if what == "quick" else "bench_serving.json"
        rows = json.loads(Path(out, name).read_text())["rows"]
        key = "tflops" if what == "quick" else "us"
        return {(r["case"], r["impl"]): r[key] for r in rows if r.get(key) is not None}


def compare(old: list[dict], new: list[dict], higher_is_better: bool) -> list[dict]:
    """Per case both trees ran: medians, the slowdown (new over old in time, old over new in
    rate: above 1 is slower), the ranges, and whether they are apart."""
    table = []
    for key in sorted(set.intersection(*(set(run) for run in old + new))):
        o, n = [run[key] for run in old], [run[key] for run in new]
        mo, mn = statistics.median(o), statistics.median(n)
        table.append(dict(case=key[0], impl=key[1], old=mo, new=mn, slowdown=mo / mn if higher_is_better else mn / mo,
                          old_range=(min(o), max(o)), new_range=(min(n), max(n)),
                          apart=max(o) < min(n) or max(n) < min(o)))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--what", choices=("quick", "serving", "host"), default="host")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--core", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for i in range(args.rounds):
        for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
            runs[name].append(run_once(getattr(args, name).resolve(), args.what, args.core))
    for row in compare(runs["old"], runs["new"], higher_is_better=args.what == "quick"):
        print(f"{row['case'][:52]:52} {row['impl']:16} old {row['old']:9.2f} new {row['new']:9.2f} "
              f"slowdown {row['slowdown']:6.3f}  old {row['old_range'][0]:.1f}-{row['old_range'][1]:.1f} "
              f"new {row['new_range'][0]:.1f}-{row['new_range'][1]:.1f}{'  APART' if row['apart'] else ''}")


if __name__ == "__main__":
    main()
