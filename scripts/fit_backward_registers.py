"""The backward's register estimate (fagen.backward_plan.REGISTER_COSTS), refitted.

  python3 scripts/fit_backward_registers.py sweep 120 --seed 2 > runs.jsonl   # random backward specs
  python3 scripts/fit_backward_registers.py fit runs.jsonl ...                # the LP over every run
  python3 scripts/fit_backward_registers.py sweep-d256 > d256.jsonl           # head_dim 256's grid
  python3 scripts/fit_backward_registers.py fit --d256 d256.jsonl             # its own table ("*_d256")

`sweep` renders random backward specs (head_dim, tiling, mask kind, modifiers, sm_80 or sm_90),
compiles each with nvcc -Xptxas -v on every core and prints one JSON line per spec: its
registers and spill stores per kernel. `fit` finds costs >= 0 per term of
backward_plan.register_terms such that every kernel that spilled is predicted over 255 + 4 and
every other at least at its count, minimising the total over-prediction (scipy's linprog).
`sweep-d256` compiles head_dim 256's mma.sync backward (head_split 2, 64 keys a block) under every
mask kind with softcap, ALiBi, both or neither, at block_q and dq_block_kv 16 and 32, sm_80 and
sm_90, bfloat16 (128 runs); `fit --d256` fits REGISTER_COSTS' "dkdv_d256" and "dq_d256" from them
(their accumulators are 128 registers in every run: the base takes them, at a register each).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from fagen import backward_plan as bp
from fagen import plan as plan_module
from fagen.nvcc import default_jobs, find_nvcc
from fagen.rendering import context, environment
from fagen.spec import AttentionSpec

MASKS = ["none", "causal", {"kind": "sliding_window", "window_left": 100}, {"kind": "chunked", "chunk_size": 64},
         {"kind": "prefix_lm", "prefix_len": 100}, {"kind": "document"}, {"kind": "document", "causal": True}]
MODS = [{}, {}, {"softcap": 20.0}, {"alibi": "slopes"}, {"bias": "matrix"}, {"bias": "vector"},
        {"softcap": 20.0, "alibi": "slopes", "bias": "matrix"}, {"expression": "score * 0.5f", "expression_grad": "0.5f"}]


def random_spec(rng: random.Random, i: int) -> AttentionSpec:
    d = rng.choice([32, 64, 96, 128, 256])
    head_split = 2 if d == 256 else rng.choice([1, 1, 2])
    warps = rng.choice([4, 8, 8])
    key_frags = rng.choice([1, 2]) if d <= 64 else 1
    backward = dict(block_kv=16 * key_frags * warps // head_split, block_q=rng.choice([16, 32, 64]), warps=warps,
                    head_split=head_split, stages=rng.choice([1, 2]), dq_block_q=rng.choice([64, 64, 128]) if d <= 128 else 64,
                    dq_block_kv=rng.choice([32, 64]), dq_warps=4)
    return AttentionSpec.model_validate(dict(
        name=f"s{i}", dtype=rng.choice(["float16", "bfloat16"]), head_dim=d, tiling=dict(block_q=64, block_kv=32, warps_q=4),
        pipeline=dict(kv_smem="separate", stages=1), mask=rng.choice(MASKS), score_mod=rng.choice(MODS),
        arch=rng.choice(["sm_80", "sm_90"]), backward=backward))


def measure(spec: AttentionSpec) -> dict | None:
    """ptxas -v of the spec's backward, rendered without the plan's register refusal."""
    limit, bp.MAX_REGISTERS = bp.MAX_REGISTERS, 10**6  # measuring: no refusal
    forward_limit, plan_module.MAX_REGISTERS = plan_module.MAX_REGISTERS, 10**6  # nor of the dQ kernel's forward plan
    try:
        source = environment().get_template("kernel/backward.cu.j2").render(
            {**context(spec), "bplan": bp.backward_plan(spec), "backward": True, "grads": spec.score_mod.nonlinear})
    except ValueError:  # shared memory over the target's, or the dQ kernel's forward plan refused
        return None
    finally:
        bp.MAX_REGISTERS, plan_module.MAX_REGISTERS = limit, forward_limit
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.cu"
        src.write_text(source)
        log = subprocess.run([find_nvcc(), "-cubin", f"-arch={spec.arch}", "-Xptxas", "-v", str(src), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True).stderr
    entry = r"Compiling entry function 'fagen_\w+?_bwd_(\w+)'.*?"
    return dict(spec=spec.model_dump(mode="json"), regs=dict(re.findall(entry + r"Used (\d+) registers", log, re.S)),
                spills=dict(re.findall(entry + r"(\d+) bytes spill stores", log, re.S)))


D256_MASKS = [*MASKS, {"kind": "block_mask"}]
D256_MODS = [{}, {"softcap": 30.0}, {"alibi": "slopes"}, {"softcap": 30.0, "alibi": "slopes"}]


def d256_specs() -> list[AttentionSpec]:
    return [AttentionSpec.model_validate(dict(
        name=f"d{i}", dtype="bfloat16", head_dim=256, tiling=dict(block_q=64, block_kv=32, warps_q=4),
        pipeline=dict(kv_smem="separate", stages=2), mask=mask, score_mod=mod, arch=arch,
        backward=dict(block_kv=64, warps=8, head_split=2, block_q=steps, dq_block_kv=steps)))
        for i, (arch, mask, mod, steps) in enumerate(
            (a, m, s, n) for a in ("sm_80", "sm_90") for m in D256_MASKS for s in D256_MODS for n in (16, 32))]


def fit(rows: list[dict], d256: bool = False) -> None:
    from scipy.optimize import linprog

    for kernel in ("dkdv", "dq"):
        specs = [AttentionSpec.model_validate(r["spec"]) for r in rows]
        terms = [bp.register_terms(s, kernel) for s in specs]
        if d256:  # constant over the grid (the base holds them), or refused before (a bias)
            terms = [{n: a for n, a in t.items() if n not in ("acc", "chunk_copy", "stages1", "bias")} for t in terms]
        names = sorted({n for t in terms for n in t})
        x = np.array([[t.get(n, 0.0) for n in names] for t in terms])
        used = np.array([int(r["regs"][kernel]) for r in rows])
        spilled = np.array([int(r["spills"][kernel]) > 0 for r in rows])
        a = np.vstack([-x[~spilled], -x[spilled]])
        b = np.concatenate([-used[~spilled], -np.full(spilled.sum(), bp.MAX_REGISTERS + 1 + 4)])
        res = linprog(x[~spilled].sum(0), A_ub=a, b_ub=b, bounds=[(0, None)] * len(names))
        refused = int(((x @ res.x > bp.MAX_REGISTERS) & ~spilled).sum())
        print(f"{kernel}: {len(rows)} runs, {spilled.sum()} spilled, {refused} that fit refused")
        print({n: round(float(c), 2) for n, c in zip(names, res.x) if c > 1e-6})


def main(argv: list[str]) -> None:
    if argv[:1] in (["sweep"], ["sweep-d256"]):
        if argv[0] == "sweep-d256":
            specs = d256_specs()
        else:
            rng = random.Random(int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0)
            specs = [random_spec(rng, i) for i in range(int(argv[1]))]
        with ThreadPoolExecutor(default_jobs()) as pool:
            for row in pool.map(measure, specs):
                if row:
                    print(json.dumps(row), flush=True)
    elif argv[:1] == ["fit"]:
        paths = [a for a in argv[1:] if a != "--d256"]
        fit([json.loads(line) for path in paths for line in Path(path).read_text().splitlines()], "--d256" in argv)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
