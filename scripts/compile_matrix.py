"""Compile every kernel fagen.attention can build from the shipped defaults and report spills.

The matrix: dtype (f16, bf16) x head_dim (32, 64, 96, 128, 256) x causal x mask kind (none,
causal, sliding_window, chunked, prefix_lm, document, document causal, block_mask; a causal
default takes the causal mask, the others every other kind) x score modifiers (softcap x alibi
slopes x bias none/vector/matrix x sinks), for the defaults of a GPU without tuned specs (the
generic attn_* specs, sm_80: A100-class GPUs) and of an H100 or H200 (the sm_90a *_h200 specs,
and for head_dim 32 and 96, which have none, the generic ones compiled for sm_90).

    python scripts/compile_matrix.py [--csv out.csv] [--jobs N]

Prints the counts (variants, distinct kernels, refused by the plan, spilling), every spilling or
refused variant, and the time; exits 1 if any spilled or was refused. tests/test_nvcc.py
compiles a covering subset of this in CI.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time

from fagen.nvcc import (ATTENTION_GPUS, ATTENTION_MASKS, attention_defaults, attention_variants, compile_many,
                        default_jobs, kernel_body, score_mods)
from fagen.plan import plan
from fagen.spec import SpecError


def builds() -> list[tuple[str, object, str, object]]:
    """(gpu, base spec, arch, variant spec or the SpecError that refused it)."""
    out = []
    for gpu in ATTENTION_GPUS:
        for base, arch in attention_defaults(gpu):
            for m in (ATTENTION_MASKS if base.mask.kind != "causal" else ({"kind": "causal"},)):
                for s in score_mods():
                    try:
                        out.append((gpu or "generic", base, arch, attention_variants(base, [m], [s])[0]))
                    except SpecError as err:
                        out.append((gpu or "generic", base, arch, err))
    return out


def describe(spec) -> str:
    m = spec.score_mod
    mods = [n for n, on in (("softcap", m.softcap is not None), ("alibi", m.alibi != "none"),
                            (f"bias_{m.bias}", m.bias != "none"), ("sinks", m.sinks)) if on]
    return f"{spec.mask}{' + ' + '+'.join(mods) if mods else ''}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", help="write one row per variant here")
    ap.add_argument("--jobs", type=int, default=default_jobs())
    args = ap.parse_args()

    t0 = time.perf_counter()
    rows = builds()
    ok = [(f, b, a, s) for f, b, a, s in rows if not isinstance(s, SpecError)]
    refused = [(f, b, a, s) for f, b, a, s in rows if isinstance(s, SpecError)]
    distinct = len({(a, kernel_body(s)) for _, _, a, s in ok})
    print(f"{len(rows)} variants ({len(refused)} refused by the plan), {distinct} distinct kernels; "
          f"compiling with {args.jobs} jobs ...", flush=True)
    results = compile_many([(s, a) for _, _, a, s in ok], jobs=args.jobs)
    elapsed = time.perf_counter() - t0

    spills = []
    table = []
    for (family, base, arch, spec), r in zip(ok, results):
        bad = (r.stack_frame, r.spill_stores, r.spill_loads) != (0, 0, 0)
        if bad:
            spills.append((base, arch, spec, r))
        table.append([family, base.name, arch, spec.name, describe(spec), spec.tiling.block_kv,
                      plan(spec).predicted_registers, r.registers, r.stack_frame, r.spill_stores, r.spill_loads, "",
                      json.dumps(spec.model_dump(mode="json"))])
    for family, base, arch, err in refused:
        table.append([family, base.name, arch, "", "", "", "", "", "", "", "", str(err).splitlines()[-1], ""])
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["family", "default", "arch", "variant", "mask_and_mods", "block_kv", "predicted",
                        "registers", "stack", "spill_stores", "spill_loads", "refused", "spec"])
            w.writerows(table)

    for base, arch, spec, r in spills:
        print(f"SPILL {base.name} {arch} {describe(spec)}: {r.registers} registers, "
              f"{r.spill_stores} B spill stores, {r.stack_frame} B stack (predicted {plan(spec).predicted_registers})")
    for _, base, arch, err in refused:
        print(f"REFUSED {base.name} {arch}: {str(err).splitlines()[-1]}")
    regs = [r.registers for r in results]
    print(f"{len(rows)} variants, {distinct} distinct kernels, {len(spills)} spilling, {len(refused)} refused; "
          f"registers {min(regs, default=0)}..{max(regs, default=0)}; {elapsed:.0f} s")
    return 1 if spills or refused else 0


if __name__ == "__main__":
    sys.exit(main())
