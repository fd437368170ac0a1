"""Compile a broad, seeded sample of specs and record ptxas' registers and spills next to the
plan's register estimate: the data the estimate (fagen/plan.py) is fitted to and checked on.

The sample: random specs over the whole spec space (tilings, pipelines, layouts, Q in
registers, head_dim, dtype, every mask kind, every score-modifier combination, split-KV
partials, mma.sync archs sm_80..sm_90 and the sm_90a wgmma kernel), drawn densely near the
register limit. The register rule is lifted while sampling (a spec the estimate refuses is
compiled too, to see how many of those would have fit).

    python scripts/register_sweep.py --n 4000 --csv sweep.csv [--jobs N] [--seed 0]
    python scripts/register_sweep.py --tuner --csv tuner.csv

--fallbacks compiles instead every variant fagen.attention derives from the shipped defaults
(scripts/compile_matrix.py's matrix) with block_kv halved, down to 16: the tilings
fagen.variants.variant falls back to.

--tuner compiles instead every candidate `fagen tune` would consider (fagen.tune.candidates,
the register rule lifted) for every shipped spec as the base: attn_* ones for both their
targets, the others for one of them.

Prints the specs the estimate accepts that spill (must be none) and how many it refuses that
would not have spilled.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time

import fagen.plan as plan_mod
from fagen.nvcc import compile_many, default_jobs
from fagen.plan import plan
from fagen.spec import HEAD_DIMS, SpecError
from fagen.load import parse_spec

MMA_SYNC_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
MASKS = ({"kind": "none"}, {"kind": "causal"}, {"kind": "causal", "align": "top_left"},
         {"kind": "sliding_window", "window_left": 1000, "window_right": 0},
         {"kind": "sliding_window", "window_left": 256, "window_right": 256},
         {"kind": "chunked", "chunk_size": 1000}, {"kind": "prefix_lm", "prefix_len": 1000},
         {"kind": "document"}, {"kind": "document", "causal": True}, {"kind": "block_mask"})


def random_spec(rng: random.Random, i: int) -> dict:
    wgmma = rng.random() < 0.3
    d = rng.choice((64, 128, 256) if wgmma else HEAD_DIMS)
    if wgmma:
        wq = rng.choice((4, 8))
        tiling = {"block_q": 16 * wq, "block_kv": 16 * rng.randint(1, 16), "warps_q": wq}
        pipeline = {"kv_smem": "separate", "stages": rng.choice((2, 3)),
                    "pingpong": wq == 8 and rng.random() < 0.5}
        layout, arch = "swizzled", "sm_90a"
    else:
        wq = rng.choice((1, 2, 4, 4, 8, 8))
        tiling = {"block_q": 16 * wq * rng.randint(1, 4), "block_kv": rng.choice((16, 32, 32, 48, 64, 64, 96, 128, 128, 256)),
                  "warps_q": wq}
        kv_smem, stages = rng.choice((("shared", 1), ("shared", 2), ("separate", 1), ("separate", 2), ("separate", 3)))
        pipeline = {"kv_smem": kv_smem, "stages": stages, "q_in_registers": rng.random() < 0.3}
        layout = "swizzled" if d % 64 == 0 and rng.random() < 0.5 else "padded"
        arch = "sm_80"
    mask = dict(rng.choice(MASKS))
    mods = {}
    if rng.random() < 0.5:
        mods = {"softcap": 30.0 if rng.random() < 0.5 else None, "alibi": rng.choice(("none", "slopes", "geometric")),
                "bias": rng.choice(("none", "vector", "matrix")), "sinks": rng.random() < 0.5}
    outputs = {"lse": True, "partial": rng.random() < 0.15}
    if not outputs["partial"] and rng.random() < 0.1:
        outputs["lse"] = False
    return {"name": f"sweep_{i}", "dtype": rng.choice(("float16", "bfloat16")), "head_dim": d, "tiling": tiling,
            "pipeline": pipeline, "smem_layout": layout, "mask": mask, "score_mod": mods, "outputs": outputs,
            "arch": arch}


def sample(n: int, seed: int) -> list[tuple[dict, object, str]]:
    """(spec data, spec, arch to compile for): n specs that pass every rule but the register
    one, most with an estimate near the limit."""
    rng = random.Random(seed)
    out, i = [], 0
    while len(out) < n:
        i += 1
        data = random_spec(rng, i)
        try:
            spec = parse_spec(data)
        except SpecError:
            continue
        pred = plan(spec).predicted_registers
        if not 170 <= pred <= 330 and rng.random() > 0.15:
            continue
        arch = "sm_90a" if spec.wgmma else rng.choice(MMA_SYNC_ARCHS)
        if not spec.wgmma and plan(spec).smem_bytes > fagen_smem(arch):
            continue
        out.append((data, spec, arch))
    return out


def tuner_sample() -> list[tuple[dict, object, str]]:
    from fagen.nvcc import targets
    from fagen.load import SPECS
    from fagen.load import load_spec
    from fagen.tune import candidates

    out = []
    for i, path in enumerate(sorted(SPECS.glob("*.yaml"))):
        base = load_spec(path)
        archs = targets(base)
        if not path.stem.startswith("attn_"):
            archs = (archs[i % len(archs)],)
        for spec in candidates(base)[0]:
            out += [(None, spec, arch) for arch in archs]
    return out


def fallback_sample() -> list[tuple[dict, object, str]]:
    from fagen.nvcc import ATTENTION_GPUS, ATTENTION_MASKS, attention_defaults, score_mods

    out = []
    for gpu in ATTENTION_GPUS:
        for base, arch in attention_defaults(gpu):
            for m in (ATTENTION_MASKS if base.mask.kind != "causal" else ({"kind": "causal"},)):
                for mods in score_mods():
                    block_kv = base.tiling.block_kv // 2
                    while block_kv >= 16:
                        data = {**base.model_dump(mode="json"), "name": f"fallback_{len(out)}", "mask": m,
                                "score_mod": mods, "tiling": {**base.tiling.model_dump(), "block_kv": block_kv}}
                        out.append((data, parse_spec(data), arch))
                        block_kv //= 2
    return out


def fagen_smem(arch: str) -> int:
    from fagen.spec import SMEM_PER_BLOCK

    return SMEM_PER_BLOCK[arch]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=default_jobs())
    ap.add_argument("--csv", required=True)
    ap.add_argument("--tuner", action="store_true", help="the tuner's candidates of every shipped spec instead")
    ap.add_argument("--fallbacks", action="store_true", help="fagen.attention's variants with smaller block_kv instead")
    args = ap.parse_args()

    limit = plan_mod.MAX_REGISTERS
    plan_mod.MAX_REGISTERS = 10**6  # sample past the register rule: the estimate is what is tested
    t0 = time.perf_counter()
    rows = tuner_sample() if args.tuner else fallback_sample() if args.fallbacks else sample(args.n, args.seed)
    results = compile_many([(s, a) for _, s, a in rows], jobs=args.jobs)
    bad, refused_ok = [], 0
    with open(args.csv, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["arch", "predicted", "registers", "stack", "spill_stores", "spec"])
        for (data, spec, arch), r in zip(rows, results):
            pred = plan(spec).predicted_registers
            spills = (r.stack_frame, r.spill_stores, r.spill_loads) != (0, 0, 0)
            if pred <= limit and spills:
                bad.append((spec, arch, pred, r))
            refused_ok += pred > limit and not spills
            w.writerow([arch, pred, r.registers, r.stack_frame, r.spill_stores, json.dumps(spec.model_dump(mode="json"))])
    for spec, arch, pred, r in bad:
        print(f"ACCEPTED BUT SPILLS {arch} predicted {pred}: {r.registers} registers, {r.spill_stores} B spilled: "
              f"{json.dumps(spec.model_dump(mode='json', exclude={'name'}))}")
    print(f"{len(rows)} specs, {len(bad)} accepted but spilling, {refused_ok} refused that would fit; "
          f"{time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
