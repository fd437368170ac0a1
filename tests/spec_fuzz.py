"""Random specs, most of them near the edge of validity, for the fuzz test and its long run.

The promise under test: a spec that validates renders, compiles with nvcc for its target, and
does not spill; one that does not validate is refused with a SpecError (never another
exception). Expressions are drawn from the language's grammar and then mutated, so the
parser sees valid formulas, near misses and token soup.

Long run (all cores):  python3 -m tests.spec_fuzz --count 3000 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from fagen.expression import FUNCTIONS, MASK_VARIABLES, SCORE_VARIABLES
from fagen.spec import HEAD_DIMS, SpecError
from fagen.load import parse_spec

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")
MASK_KINDS = ("none", "causal", "sliding_window", "chunked", "prefix_lm", "document", "block_mask")
OPERATORS = ("+", "-", "*", "/", "%", "==", "!=", "<", "<=", ">", ">=", "&&", "||", "&", "|", "^", "<<", ">>")
NOISE = ("%:", "<%", "%>", "<:", ":>", "#", ";", "{", "}", "\r", "\t", "=", "++", "[", "]", "/*", "//", "'", "\"",
         "n_kv", "doc", "printf", "and", "0x1", "1.0ff", ",", "?", ":", "(", ")", "\\")


def expression(rng: random.Random, variables: dict[str, str], depth: int = 0) -> str:
    """A formula from the language's grammar (types not enforced: the parser's type rules get
    exercised too)."""
    if depth > 3 or rng.random() < 0.3:
        return rng.choice([*variables, str(rng.randint(0, 99)), f"{rng.random() * 4:.2f}f", "true", "false"])
    roll = rng.random()
    if roll < 0.5:
        return (f"{expression(rng, variables, depth + 1)} {rng.choice(OPERATORS)} "
                f"{expression(rng, variables, depth + 1)}")
    if roll < 0.6:
        return f"({expression(rng, variables, depth + 1)})"
    if roll < 0.7:
        return f"{rng.choice('!-~')}{expression(rng, variables, depth + 1)}"
    if roll < 0.8:
        return f"({rng.choice(('int', 'float', 'bool'))})({expression(rng, variables, depth + 1)})"
    if roll < 0.9:
        name = rng.choice(sorted(FUNCTIONS))
        args = ", ".join(expression(rng, variables, depth + 1) for _ in FUNCTIONS[name][0])
        return f"{name}({args})"
    return (f"{expression(rng, variables, depth + 1)} ? {expression(rng, variables, depth + 1)} : "
            f"{expression(rng, variables, depth + 1)}")


def mutated(rng: random.Random, text: str) -> str:
    """Often the formula itself; otherwise a near miss: a character dropped or noise inserted."""
    roll = rng.random()
    if roll < 0.6 or not text:
        return text
    at = rng.randrange(len(text) + 1)
    if roll < 0.8:
        return text[:at] + rng.choice(NOISE) + text[at:]
    return text[:at] + text[at + 1:]


def random_spec(rng: random.Random) -> dict:
    """A spec dict: tilings built from the rules' own building blocks (so many validate), with
    a share of values just outside them."""
    arch = rng.choice(ARCHS)
    wgmma = arch == "sm_90a" and rng.random() < 0.8
    warps_q = rng.choice((4, 8)) if wgmma else rng.randint(1, 8)
    rows = 1 if wgmma else rng.randint(1, 4)
    block_q = 16 * warps_q * rows if rng.random() < 0.9 else rng.choice((8, 48, 100, 512))
    head_dim = rng.choice((64, 128, 256) if wgmma else HEAD_DIMS) if rng.random() < 0.95 else rng.choice((0, 80, 512))
    spec: dict = {
        "name": "fuzz",
        "dtype": rng.choice(("float16", "bfloat16")),
        "head_dim": head_dim,
        "tiling": {"block_q": block_q, "block_kv": 16 * rng.randint(1, 16) if rng.random() < 0.95 else 40,
                   "warps_q": warps_q},
        "pipeline": {"kv_smem": "separate" if wgmma else rng.choice(("shared", "separate")),
                     "stages": rng.randint(2, 3) if wgmma else rng.randint(1, 3),
                     "q_in_registers": not wgmma and rng.random() < 0.2,
                     "pingpong": wgmma and warps_q == 8 and rng.random() < 0.5},
        "smem_layout": "swizzled" if wgmma else rng.choice(("padded", "swizzled")),
        "arch": arch,
    }
    kind = rng.choice(MASK_KINDS)
    mask: dict = {"kind": kind, "align": rng.choice(("bottom_right", "top_left"))}
    if kind == "sliding_window":
        mask.update(window_left=rng.choice((0, 1, 127, 1024)), window_right=rng.choice((0, 3, 64)))
    elif kind == "chunked":
        mask["chunk_size"] = rng.choice((1, 64, 1000))
    elif kind == "prefix_lm":
        mask["prefix_len"] = rng.choice((1, 100, 4096))
    elif kind == "document":
        mask["causal"] = rng.random() < 0.5
    if rng.random() < 0.25:
        mask["expression"] = mutated(rng, expression(rng, MASK_VARIABLES))
    score_mod: dict = {}
    if rng.random() < 0.3:
        score_mod["softcap"] = rng.choice((5.0, 30.0))
    if rng.random() < 0.3:
        score_mod["alibi"] = rng.choice(("slopes", "geometric"))
    if rng.random() < 0.3:
        score_mod["bias"] = rng.choice(("vector", "matrix"))
    if rng.random() < 0.25:
        score_mod["expression"] = mutated(rng, expression(rng, SCORE_VARIABLES))
    if rng.random() < 0.3:
        score_mod["sinks"] = True
    partial = rng.random() < 0.2
    spec.update(mask=mask, score_mod=score_mod, outputs={"lse": partial or rng.random() < 0.8, "partial": partial})
    return spec


@dataclass
class Outcome:
    refused: bool
    compiled: bool = False
    problem: str | None = None  # a spec that validated and then failed: the finding


def try_spec(data: dict) -> Outcome:
    """Validate; if valid, compile for the spec's own target and require no spill, no stack."""
    from fagen.nvcc import compile_offline

    try:
        spec = parse_spec(data)
    except SpecError:
        return Outcome(refused=True)
    try:
        r = compile_offline(spec, spec.arch)
    except RuntimeError as err:
        return Outcome(refused=False, problem=f"does not compile: {str(err)[:2000]}")
    if r.spill_stores or r.spill_loads or r.stack_frame:
        return Outcome(refused=False, compiled=True,
                       problem=f"spills: {r.registers} registers, {r.stack_frame} bytes stack, "
                               f"{r.spill_stores}/{r.spill_loads} bytes spilled")
    return Outcome(refused=False, compiled=True)


def specs(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    return [random_spec(rng) for _ in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=None, help="write the findings as JSON here")
    args = parser.parse_args()
    start = time.perf_counter()
    data = specs(args.seed, args.count)
    with ProcessPoolExecutor(args.jobs) as pool:
        outcomes = list(pool.map(try_spec, data, chunksize=4))
    findings = [{"spec": d, "problem": o.problem} for d, o in zip(data, outcomes) if o.problem]
    refused = sum(o.refused for o in outcomes)
    compiled = sum(o.compiled for o in outcomes)
    print(f"{args.count} specs (seed {args.seed}): {refused} refused by validation, {compiled} compiled, "
          f"{len(findings)} validated and then failed; {time.perf_counter() - start:.0f} s on {args.jobs} processes")
    for f in findings[:20]:
        print(json.dumps(f))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"count": args.count, "seed": args.seed, "refused": refused, "compiled": compiled,
                       "findings": findings}, fh, indent=1)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
