"""Two checkouts against each other on one GPU: the same benchmark in alternating processes.

    python3 scripts/compare_trees.py OLD_DIR NEW_DIR [--rounds 4]
        [--what quick|backward|serving|host|host-one-process|kernels-one-process|sass]

Each round runs both trees, each in a process of its own pinned to one core (host time moves
with the core and the process), the order alternating from round to round (OLD, NEW, then NEW,
OLD) so that drift falls on both. `quick` is `fagen bench --quick` (TF/s), `backward` `fagen bench --quick --backward` (the
backward's TF/s), `serving` is `fagen
bench --serving` (us, GPU time from CUDA-graph replays), `host` the serving benchmark's host-time
cases alone (us of host time a call). Per case: both medians, new / old (for TF/s, old / new:
above 1 is slower either way), both ranges, and whether the ranges are apart: a ratio past the
bar with overlapping ranges is the noise's, not the change's.

`sass` needs no GPU: each tree renders the forward and (head_dim 64 and 128) the trainable
backward that fagen.attention derives on an H200 for a few shapes, nvcc compiles them for sm_90a,
and each kernel's SASS instructions are counted from its cubin (fagen.nvcc.sass_instructions):
a static count, not a speed, but it shows what a template change adds to or takes from the
code, in any two trees, old ones included.

`host-one-process` takes process placement out of host time: OLD's package is copied and renamed
`fagen_old` (its torch ops `fagen_old::`), both are imported into one process, and each case's
calls through OLD and NEW are timed back to back, the order alternating, for `--rounds` rounds
(both trees' outputs checked against SDPA's first).

`kernels-one-process` does the same for the kernels' GPU time: the forward that fagen.attention
derives (dense and causal; float16 and bfloat16; head_dim 64, 128, 256; N 1k, 4k, 16k at
B * N = 16k, H * d = 2048) and the backward's three kernels (float16, head_dim 64 and 128, N 1k
to 16k), each tree's call timed by CUDA events (fagen.check.time_ms) back to back with the other's,
the order alternating; TF/s. Outputs are checked first: the forward's against SDPA's, the
gradients (up to 4k) against float32 SDPA's. The old tree can be any directory holding a checkout
(`git worktree add`, or `git archive` of a revision unpacked) from 2026-11-28 on (fagen.dispatch),
carried to the GPU machine beside the new one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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

# the kernels `sass` counts: each tree's own derivation and rendering (names that old trees have
# too), one cubin a file written to argv[1] as <case>~<file>.cubin
SASS_CASES = """
import subprocess, sys
from pathlib import Path
from fagen import device, dispatch, variants
try:
    from fagen.rendering import render, render_backward
except ModuleNotFoundError as missing:  # a tree from before the module's rename (fagen.render)
    if missing.name != "fagen.rendering":
        raise
    from fagen.render import render, render_backward
device.gpu_slug = lambda *a: "h200"
out = Path(sys.argv[1])
for dtype, d, causal in (("float16", 64, False), ("float16", 64, True), ("float16", 128, False),
                         ("float16", 128, True), ("bfloat16", 256, True)):
    spec = dispatch.derive_spec_for(dtype, d, causal=causal, keys=4096)
    case = f"{dtype} d{d} {'causal' if causal else 'dense'} 4k"
    files = {"forward": render(spec)}
    if d <= 128:
        files["backward"] = render_backward(variants.trainable(spec))
    for file, source in files.items():
        src = out / f"{case}~{file}.cu"
        src.write_text(source)
        subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-o", str(src.with_suffix(".cubin")), str(src)],
                       check=True, capture_output=True)
"""

ONE_PROCESS = """
import json, sys
import numpy as np
import torch
import fagen, fagen_old
from fagen import bench_serving
from fagen.check import random_inputs, relative_error, to_numpy, OUT_TOLERANCE

rng = np.random.default_rng(0)
runs = {"old": [], "new": []}
calls = {}
for case in [c for c in bench_serving.cases() if c.section == "host"]:
    q, k, v, out = random_inputs("torch", case.dtype, case.b, case.hq, case.hkv, case.nq, case.nk, case.head_dim)
    ref = bench_serving._sdpa_reference(q, k, v, case.causal)
    for tree, package in (("old", fagen_old), ("new", fagen)):
        api = package
        if case.page_size:
            k_cache, v_cache, table = bench_serving.paged_cache(k, v, case.page_size, rng)
            lengths = torch.full((case.b,), case.nk, dtype=torch.int32, device="cuda")
            tensors = (q, k_cache, v_cache, lengths, table)
            step = api.prepare_with_kvcache(*tensors, causal=case.causal)
            status = torch.zeros(1, dtype=torch.int32, device="cuda")
            unprepared = lambda api=api, t=tensors, s=status, c=case.causal: api.attention_with_kvcache(*t, causal=c, status=s, validate=False)
        else:
            tensors = (q, k, v)
            step = api.prepare(*tensors, causal=case.causal)
            unprepared = lambda api=api, t=tensors, c=case.causal: api.attention(*t, causal=c)
        for impl, fn in (("fagen", lambda s=step, t=tensors: s(*t)), ("fagen_out", lambda s=step, t=tensors, o=out: s(*t, out=o)),
                         ("fagen_attention", unprepared)):
            out.fill_(float("nan"))
            got = fn()
            err = relative_error(to_numpy(out if got is None or impl == "fagen_out" else got), ref)
            assert err <= OUT_TOLERANCE[case.dtype], (tree, case.key, impl, err)
            calls[(case.key, impl, tree)] = fn
for r in range(int(sys.argv[2])):
    for (key, impl, tree), fn in (list(calls.items()) if r % 2 == 0 else list(calls.items())[::-1]):
        calls_us = bench_serving.host_us(fn)
        runs[tree].append(((key, impl), calls_us))
json.dump({tree: [[list(k), us] for k, us in rows] for tree, rows in runs.items()}, open(sys.argv[1], "w"))
"""

KERNELS_ONE_PROCESS = """
import json, re, sys
import torch
import fagen, fagen_old
from fagen.bench_backward import FULL_TOLERANCE
from fagen.check import OUT_TOLERANCE, time_ms

def forward(package, dtype, d, n, causal, q, k, v):
    spec = package.dispatch.default_spec(dtype, d, causal, keys=n)
    kernel = package.runtime.compile_kernel(spec)
    return lambda q, k, v, dout: kernel(q, k, v)

def case_key(what, dtype, d, n, causal):
    return f"{what} {dtype} d{d} n{n} {'causal' if causal else 'dense'}"

def backward(package, dtype, d, n, causal, q, k, v):
    spec, _ = package.bench_backward.fagen_spec(package.bench_cases.Case(dtype, d, n, causal), q)
    kernels = package.backward.compile_backward(spec)
    out, lse = kernels.forward(q, k, v, return_lse=True)  # the forward's saved out and LSE
    return lambda q, k, v, dout: kernels(dout, q, k, v, out, lse)

CASES = [("forward", dt, d, n, c) for dt in ("float16", "bfloat16") for d in (64, 128, 256)
         for n in (1024, 4096, 16384) for c in (False, True)]
CASES += [("backward", "float16", d, n, c) for d in (64, 128) for n in (1024, 4096, 16384) for c in (False, True)]
CASES = [case for case in CASES if re.search(sys.argv[3], case_key(*case))]
if not CASES:
    sys.exit(f"--only {sys.argv[3]!r} picks none of the cases (keys like 'forward float16 d128 n4096 causal')")
rounds = int(sys.argv[2])
runs = {"old": [{} for _ in range(rounds)], "new": [{} for _ in range(rounds)]}
for what, dtype, d, n, causal in CASES:
    b, h = 16384 // n, 2048 // d
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=getattr(torch, dtype)) for _ in range(4))
    maker = forward if what == "forward" else backward
    calls = {tree: maker(package, dtype, d, n, causal, q, k, v) for tree, package in (("old", fagen_old), ("new", fagen))}
    if what == "forward":
        ref = [torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).float()]
        got = {tree: [call(q, k, v, dout).float()] for tree, call in calls.items()}
    elif n <= 4096:
        x = [t.detach().float().requires_grad_() for t in (q, k, v)]
        ref = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*x, is_causal=causal), x, dout.float())
        got = {tree: [g.float() for g in (lambda r: (r.dq, r.dk, r.dv))(call(q, k, v, dout))] for tree, call in calls.items()}
    else:
        ref, got = None, {}
    for tree, outputs in got.items():
        err = max(((o - r).norm() / r.norm()).item() for o, r in zip(outputs, ref))
        assert err <= (OUT_TOLERANCE[dtype] if what == "forward" else FULL_TOLERANCE), (tree, what, dtype, d, n, causal, err)
    flops = (4 if what == "forward" else 10) * b * h * n * n * d / (2 if causal else 1)
    key = (case_key(what, dtype, d, n, causal), what)
    for r in range(rounds):
        for tree in (("old", "new") if r % 2 == 0 else ("new", "old")):
            ms = time_ms(lambda: calls[tree](q, k, v, dout), warmup=10, iters=30)
            runs[tree][r][key] = flops / ms / 1e9
json.dump({tree: [[[list(k), v] for k, v in run.items()] for run in rounds_] for tree, rounds_ in runs.items()},
          open(sys.argv[1], "w"))
"""


def renamed_copy(tree: Path, into: Path) -> Path:
    """`tree` copied into `into` with its package renamed fagen_old (every `fagen` word in its
    Python sources, the torch op namespace among them), so that it imports beside fagen."""
    shutil.copytree(tree, into, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build"))
    shutil.move(into / "fagen", into / "fagen_old")
    for source in (into / "fagen_old").rglob("*.py"):
        source.write_text(re.sub(r"\bfagen\b", "fagen_old", source.read_text()))
    return into


def run_kernels_one_process(old: Path, new: Path, rounds: int, only: str) -> dict[str, list[dict]]:
    """Both trees in one process (KERNELS_ONE_PROCESS): per tree, one {(case, pass): TF/s} a round,
    for the cases whose key ("forward float16 d128 n4096 causal") `only` finds."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = renamed_copy(old, Path(tmp, "old"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(new), str(copy), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-c", KERNELS_ONE_PROCESS, f"{tmp}/rows.json", str(rounds), only],
                       cwd=new, env=env, check=True)
        rows = json.loads(Path(tmp, "rows.json").read_text())
    return {tree: [{tuple(key): value for key, value in run} for run in measured] for tree, measured in rows.items()}


def run_one_process(old: Path, new: Path, rounds: int, core: int) -> dict[str, list[dict]]:
    """Both trees in one process (ONE_PROCESS): per tree, one {(case, impl): us} a round."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = renamed_copy(old, Path(tmp, "old"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(new), str(copy), os.environ.get("PYTHONPATH", "")])}
        subprocess.run(["taskset", "-c", str(core), sys.executable, "-c", ONE_PROCESS, f"{tmp}/rows.json", str(rounds)],
                       cwd=new, env=env, check=True)
        rows = json.loads(Path(tmp, "rows.json").read_text())
    runs: dict[str, list[dict]] = {}
    for tree, measured in rows.items():
        per_case: dict[tuple[str, str], list[float]] = {}
        for key, us in measured:
            per_case.setdefault(tuple(key), []).append(us)
        runs[tree] = [{key: values[i] for key, values in per_case.items()} for i in range(rounds)]
    return runs


def run_once(tree: Path, what: str, core: int) -> dict[tuple[str, str], float]:
    """{(case, impl): value} of one process of `tree`: TF/s for quick and backward, us otherwise."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory() as out:
        if what == "host":
            command = [sys.executable, "-c", HOST_CASES, f"{out}/rows.json"]
        else:
            flags = ["--quick", "--backward"] if what == "backward" else [f"--{what}"]
            command = [sys.executable, "-m", "fagen", "bench", *flags, "-o", out, "--markdown", f"{out}/B.md"]
        subprocess.run(["taskset", "-c", str(core), *command], cwd=tree, env=env, check=True, capture_output=True)
        if what == "host":
            rows = json.loads(Path(out, "rows.json").read_text())
            return {(r["case"], r["impl"]): r["us"] for r in rows if r["us"] is not None}
        name, key = {"quick": ("bench.json", "tflops"), "backward": ("bench_backward.json", "bwd_tflops")}.get(
            what, ("bench_serving.json", "us"))
        rows = json.loads(Path(out, name).read_text())["rows"]
        return {(r["case"], r["impl"]): r[key] for r in rows if r.get(key) is not None}


def run_sass(tree: Path) -> dict[tuple[str, str], float]:
    """{(case, kernel): SASS instructions} of `tree`'s kernels (SASS_CASES), counted by this
    tree's fagen.nvcc.sass_instructions: the kernel named by its role, the spec's name left out."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fagen.nvcc import sass_instructions

    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-c", SASS_CASES, out], cwd=tree, env=env, check=True, capture_output=True)
        counted = {}
        for cubin in Path(out).glob("*.cubin"):
            case, file = cubin.stem.split("~")
            for symbol, n in sass_instructions(cubin.read_bytes()).items():
                role = symbol.rsplit("_", 1)[-1] if file == "backward" else "forward"
                counted[(case, f"{file} {role}" if file == "backward" else file)] = float(n)
        return counted


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
    parser.add_argument("--what", choices=("quick", "backward", "serving", "host", "host-one-process", "kernels-one-process",
                                            "sass"),
                        default="host")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--core", type=int, default=2)
    parser.add_argument("--only", default="", metavar="REGEX",
                        help="kernels-one-process: the cases whose key (\"forward float16 d128 n4096 causal\") "
                             "it finds")
    args = parser.parse_args()
    if args.only and args.what != "kernels-one-process":
        parser.error("--only picks kernels-one-process's cases; the other comparisons run their benchmark whole")
    try:
        re.compile(args.only)
    except re.error as bad:
        parser.error(f"--only {args.only!r} is not a regular expression ({bad}); write e.g. 'forward .* d128'")
    if args.what == "host-one-process":
        runs = run_one_process(args.old.resolve(), args.new.resolve(), args.rounds, args.core)
    elif args.what == "kernels-one-process":
        runs = run_kernels_one_process(args.old.resolve(), args.new.resolve(), args.rounds, args.only)
    elif args.what == "sass":  # deterministic: one run each
        runs = {name: [run_sass(getattr(args, name).resolve())] for name in ("old", "new")}
    else:
        runs = {"old": [], "new": []}
        for i in range(args.rounds):
            for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                runs[name].append(run_once(getattr(args, name).resolve(), args.what, args.core))
    for row in compare(runs["old"], runs["new"], higher_is_better=args.what in ("quick", "backward", "kernels-one-process")):
        print(f"{row['case'][:52]:52} {row['impl']:16} old {row['old']:9.2f} new {row['new']:9.2f} "
              f"slowdown {row['slowdown']:6.3f}  old {row['old_range'][0]:.1f}-{row['old_range'][1]:.1f} "
              f"new {row['new_range'][0]:.1f}-{row['new_range'][1]:.1f}{'  APART' if row['apart'] else ''}")


if __name__ == "__main__":
    main()
