"""Random specs, most of them near the edge of validity, for the fuzz test and its long run.

The promise under test: a spec that validates renders every kernel (the forward and, with
`backward:`, the backward's), each compiles with nvcc for every arch the spec allows
(fagen.nvcc.archs) and none spills or uses a stack frame; one that does not validate is refused
with a SpecError (never another exception). Expressions are drawn from the language's grammar and then mutated, so the
parser sees valid formulas, near misses and token soup.

Long run (all cores):  python3 -m tests.spec_fuzz --count 10000 --seed 1 --jobs 64 --out fuzz.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from fagen.expression import FUNCTIONS, MASK_VARIABLES, SCORE_VARIABLES
from fagen.spec import HEAD_DIMS, SpecError
from fagen.load import parse_spec

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")
MASK_KINDS = ("none", "causal", "sliding_window", "chunked", "prefix_lm", "document", "block_mask")
OPERATORS = ("+", "-", "*", "/", "%", "==", "!=", "<", "<=", ">", ">=", "&&", "||", "&", "|", "^", "<<", ">>")
# well-typed expressions (a bool mask; a float score and its derivative), for training specs
TYPED_MASKS = ("kv_idx <= q_idx", "(q_idx - kv_idx) % 4 != 3", "h % 2 == 0 || kv_idx < 64", "q_idx / 64 >= kv_idx / 64")
TYPED_SCORES = (("score + 0.5f", "1.0f"), ("score * 0.9f", "0.9f"), ("score - (float)(q_idx - kv_idx) * 0.01f", "1.0f"),
                ("score * score * 0.01f", "score * 0.02f"))
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
    a share of values just outside them. A quarter are training specs (a backward: section):
    their forward keeps mostly to what the backward differentiates, so that their backward
    tilings, drawn by its own rules (backward()), are what decides."""
    training = rng.random() < 0.25
    edge = 0.1 if training else 1.0  # a training spec's forward: fewer values off its rules
    arch = rng.choice(ARCHS)
    wgmma = arch == "sm_90a" and rng.random() < (0.8 if not training else 1.0)
    # training: the forward tilings the shipped specs use (the backward's tiling is its own)
    warps_q = rng.choice((4, 8)) if wgmma else rng.choice((4, 4, 8)) if training else rng.randint(1, 8)
    rows = 1 if wgmma else rng.choice((1, 1, 2)) if training else rng.randint(1, 4)
    block_q = 16 * warps_q * rows if rng.random() > 0.1 * edge else rng.choice((8, 48, 100, 512))
    head_dim = (rng.choice((64, 128, 256) if wgmma else HEAD_DIMS) if rng.random() > 0.05 * edge
                else rng.choice((0, 80, 512)))
    spec: dict = {
        "name": "fuzz",
        "dtype": rng.choice(("float16", "bfloat16")),
        "head_dim": head_dim,
        "tiling": {"block_q": block_q,
                   "block_kv": (rng.choice((32, 64, 64, 128)) if training else 16 * rng.randint(1, 16))
                   if rng.random() > 0.05 * edge else 40,
                   "warps_q": warps_q},
        "pipeline": {"kv_smem": "separate" if wgmma else rng.choice(("shared", "separate")),
                     "stages": rng.randint(2, 3) if wgmma else rng.choice((2, 2, 3)) if training else rng.randint(1, 3),
                     "q_in_registers": not wgmma and rng.random() < 0.2,
                     "pingpong": wgmma and warps_q == 8 and rng.random() < 0.5},
        # swizzling takes rows of 8 chunks off sm_90a: a training spec mostly keeps to that
        "smem_layout": "swizzled" if wgmma else rng.choice(("padded", "swizzled") if not training or head_dim % 64 == 0
                                                           or rng.random() < 0.1 else ("padded",)),
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
    # a training spec's expressions: mostly well formed (the backward's rules are under test)
    if rng.random() < 0.25:
        mask["expression"] = (rng.choice(TYPED_MASKS) if training and rng.random() < 0.8
                              else mutated(rng, expression(rng, MASK_VARIABLES)))
    score_mod: dict = {}
    if rng.random() < 0.3:
        score_mod["softcap"] = rng.choice((5.0, 30.0))
    if rng.random() < 0.3:
        score_mod["alibi"] = rng.choice(("slopes", "geometric"))
    if rng.random() < 0.3:
        score_mod["bias"] = rng.choice(("vector", "matrix"))
    if rng.random() < 0.25:
        if training and rng.random() < 0.8:
            score_mod["expression"], score_mod["expression_grad"] = rng.choice(TYPED_SCORES)
        else:
            score_mod["expression"] = mutated(rng, expression(rng, SCORE_VARIABLES))
            if training and rng.random() < 0.9:  # the chain rule needs its derivative
                score_mod["expression_grad"] = expression(rng, SCORE_VARIABLES)
    if rng.random() < 0.3:
        score_mod["sinks"] = True
    outputs = {"lse": rng.random() < 0.8, "partial": rng.random() < 0.2}
    if rng.random() < 0.1:  # folding into a running O and LSE needs a partial with its LSE: mostly given
        outputs.update(accumulate=True, **({"partial": True, "lse": True} if rng.random() < 0.8 else {}))
    elif rng.random() < 0.1:
        outputs.update(merge_splits=True, **({"partial": True, "lse": True} if rng.random() < 0.8 else {}))
    if training and rng.random() < 0.9:  # the backward differentiates whole outputs, from their LSE
        outputs = {"lse": True}
    spec.update(mask=mask, score_mod=score_mod, outputs=outputs)
    t, p = spec["tiling"], spec["pipeline"]
    inference = 1.0 if not training else 0.1  # decode layouts, which the backward refuses: now and then
    if rng.random() < 0.15 * inference:  # warps along the keys: a warp's keys whole k16 steps, mostly
        t["warps_kv"] = rng.choice((2, 4))
        t["block_kv"] = 16 * t["warps_kv"] * rng.randint(1, 4) if rng.random() < 0.8 else t["block_kv"]
    if rng.random() < 0.15 * inference and (not outputs.get("accumulate") or rng.random() < 0.2):
        t["pack_gqa"] = True
    if rng.random() < 0.25 * inference:  # mostly within the rules tying sequences to the bias and outputs
        kv = rng.choice(("padded", "varlen") if training else ("padded", "varlen", "paged"))
        spec["sequences"] = {"q": rng.choice(("padded", "varlen")), "kv": kv,
                             "seqused_k": rng.random() < (0.3 if kv == "varlen" else 0.03)}
        if rng.random() < 0.9:
            score_mod.pop("bias", None)
            outputs["merge_splits"] = outputs.get("merge_splits", False) and spec["sequences"]["q"] == "padded"
    if wgmma and rng.random() < 0.4:  # a TMA producer: two or three consumer warpgroups, near their limit
        consumers = rng.choice((2, 2, 3)) if rng.random() < 0.9 else 1
        t.update(warps_q=4 * consumers, block_q=64 * consumers)
        most = {1: 256, 2: 240, 3: 160}[consumers]
        p["warp_specialized"] = {"consumer_registers": most - 8 * rng.choice((0, 0, 1, 2, 3)),
                                 "persistent": rng.random() < 0.3}
        p["pingpong"] = consumers == 2 and rng.random() < 0.5
    if not training and rng.random() < 0.2:
        fp8(rng, spec, wgmma)
    if training:
        spec["backward"] = backward(rng, head_dim, wgmma, "bias" in score_mod)
    return spec


FP8_TYPES = ("float8_e4m3", "float8_e5m2")


def fp8(rng: random.Random, spec: dict, wgmma: bool) -> None:
    """FP8 element types on an inference spec, mostly within their rules: on sm_90a the FP8
    forward (q, k, v FP8, o bfloat16 or float16, the TMA producer's kernel, 128-256 keys a tile
    in k32 steps, head_dim 128 or 256, padded or varlen); elsewhere an FP8 KV cache under a
    half-type q (the GQA-packed mma.sync decode kernels, head_dim 64, 128 or 256, swizzled rows,
    16-64 keys a key warp); a share of values just outside."""
    t, p = spec["tiling"], spec["pipeline"]
    near = rng.random() < 0.85  # within the rules; else as drawn
    if wgmma and rng.random() < 0.7:
        spec.update(dtype=rng.choice(FP8_TYPES), out_dtype=rng.choice(("bfloat16", "float16")) if near else
                    rng.choice((None, "float8_e4m3")))
        if near:
            spec["head_dim"] = rng.choice((128, 128, 256))
            t.update(block_kv=rng.choice((128, 160, 192, 224, 256)), pack_gqa=False, warps_kv=1)
            spec["outputs"] = {"lse": True}
            if spec.get("sequences", {}).get("kv") == "paged" or rng.random() < 0.5:
                spec["sequences"] = {"q": "varlen", "kv": "varlen"} if rng.random() < 0.5 else {}
            if "warp_specialized" not in p:
                t.update(warps_q=8, block_q=128)
                p.update(warp_specialized={"consumer_registers": 240, "persistent": rng.random() < 0.5},
                         pingpong=rng.random() < 0.7)
        return
    spec["kv_dtype"] = rng.choice(FP8_TYPES)
    if rng.random() < 0.4:  # an FP8 q of the cache's type, widened as it lands (or, far, refused)
        spec["q_dtype"] = spec["kv_dtype"] if near or rng.random() < 0.5 else rng.choice(FP8_TYPES)
    if near:
        spec.update(arch=rng.choice(("sm_89", "sm_90")), head_dim=rng.choice((64, 128, 128, 256)), smem_layout="swizzled")
        warps_kv = rng.choice((1, 2, 4))
        warps_q = rng.choice([w for w in (1, 2, 4) if w * warps_kv <= 8])
        t.update(pack_gqa=True, warps_kv=warps_kv, block_kv=rng.choice((16, 32, 32, 64)) * warps_kv, warps_q=warps_q,
                 block_q=16 * warps_q)
        if spec["mask"]["kind"] in ("document", "block_mask"):  # (a packed tile's rows mix the group's heads)
            spec["mask"] = {"kind": rng.choice(("none", "causal"))}
        spec["score_mod"].pop("bias", None)
        p.update(q_in_registers=False, pingpong=False)
        p.pop("warp_specialized", None)
        spec["outputs"] = {"lse": True, "partial": rng.random() < 0.6}


def backward(rng: random.Random, head_dim: int, wgmma: bool, bias: bool) -> dict:
    """A backward: section by the backward's rules (fagen.spec.Backward; docs/kernels.md, "The backward"),
    about one in six with a value just across one of them. On sm_90a up to head_dim 128 both
    main loops are wgmma: whole warpgroups owning 64 keys (block_kv = 16 warps) or 64 query rows
    (dq_block_q = 16 dq_warps), head_dim not split, 2 or 3 stages; atomic dQ (deterministic
    false) gives each warpgroup one 64 x 64 tile of a step's dQ. Elsewhere mma.sync tilings as
    fagen.variants' (16 or 32 rows a warp, head_split 2 at head_dim 256)."""
    if wgmma and head_dim <= 128:
        warps, dq_warps = rng.choice((4, 8, 8)), rng.choice((4, 4, 8))
        deterministic = rng.random() < 0.4
        if deterministic:
            block_q = rng.choice((32, 64, 64, 128) if head_dim == 64 else (32, 64, 64))
        else:  # tiles of 64 x 64: block_q / 64 * head_dim / 64 of them must divide the warpgroups
            deterministic = head_dim == 128 and warps == 4 and rng.random() < 0.9  # no tiling has one tile
            block_q = 128 if head_dim == 64 and warps == 8 and rng.random() < 0.5 else 64
        bwd = {"block_kv": 16 * warps, "warps": warps, "block_q": block_q, "stages": rng.choice((2, 2, 3)),
               "dq_block_q": 16 * dq_warps, "dq_warps": dq_warps, "dq_block_kv": rng.choice((32, 64, 64)),
               "deterministic": deterministic}
        if rng.random() < 0.3:  # a TMA producer for the dK/dV consumers, near their limit
            bwd["warp_specialized"] = {"consumer_registers": rng.choice((240, 240, 232, 224)),
                                       "persistent": rng.random() < 0.2}
        if deterministic and rng.random() < 0.3:
            bwd["dq_warp_specialized"] = {"consumer_registers": rng.choice((232, 232, 224))}
    else:
        split = 2 if head_dim == 256 else rng.choice((1, 1, 1, 2))  # half the warps a half of head_dim
        warps, dq_warps = rng.choice((4, 8, 8)), rng.choice((2, 4, 4, 8))
        bwd = {"block_kv": 16 * (warps // split) * rng.choice((1, 1, 2)), "warps": warps, "head_split": split,
               "block_q": rng.choice((16, 32, 32, 64)), "stages": rng.choice((1, 2, 2, 3)),
               "dq_block_q": 16 * dq_warps * rng.choice((1, 1, 2)), "dq_warps": dq_warps,
               "dq_block_kv": rng.choice((32, 32, 64)), "deterministic": rng.random() < 0.3}
    if rng.random() < (0.5 if bias else 0.03):
        bwd["bias_grad"] = True
    if rng.random() < 0.15:  # one value just across an edge
        field, value = rng.choice([
            ("block_kv", bwd["block_kv"] + rng.choice((-16, 16))), ("block_q", rng.choice((8, 48, 144))),
            ("stages", rng.choice((0, 1, 4))), ("head_split", rng.choice((2, 3, 4))),
            ("dq_block_q", bwd["dq_block_q"] + rng.choice((-16, 16))), ("warps", rng.choice((2, 3, 16))),
            ("dq_block_kv", rng.choice((0, 144))), ("deterministic", not bwd["deterministic"])])
        bwd[field] = value
    return bwd


@dataclass
class Outcome:
    refused: bool
    kernels: int = 0  # kernels compiled (each kernel of each file, for each arch)
    problem: str | None = None  # a spec that validated and then failed: the finding


def try_spec(data: dict, every_arch: bool = True) -> Outcome:
    """Validate; if valid, compile every kernel the spec renders, for every arch it allows (or,
    every_arch false, the one its data picks), and require no spill and no stack frame."""
    from fagen.nvcc import archs, compile_all

    try:
        spec = parse_spec(data)
    except SpecError:
        return Outcome(refused=True)
    except Exception as err:  # noqa: BLE001 - validation must refuse by name, never crash: a finding
        return Outcome(refused=False, problem=f"validation raised {type(err).__name__}: {str(err)[:2000]}")
    try:
        targets = archs(spec)
        if not every_arch:  # one of them, fixed by the data (so a rerun compiles the same)
            targets = (targets[zlib.crc32(json.dumps(data, sort_keys=True).encode()) % len(targets)],)
        kernels = [k for arch in targets for k in compile_all(spec, arch)]
    except Exception as err:  # noqa: BLE001 - a render or nvcc failure of a valid spec is the finding
        return Outcome(refused=False, problem=f"does not render or compile: {type(err).__name__}: {str(err)[:2000]}")
    bad = [k.summary() for k in kernels if not k.clean]
    return Outcome(refused=False, kernels=len(kernels), problem=f"spills: {'; '.join(bad)}" if bad else None)


def specs(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    return [random_spec(rng) for _ in range(count)]


def run(count: int, seed: int, jobs: int, every_arch: bool = True) -> dict:
    """The fuzz: `count` specs from `seed`, on `jobs` processes. The counts and the findings."""
    start = time.perf_counter()
    data = specs(seed, count)
    with ProcessPoolExecutor(jobs) as pool:
        outcomes = list(pool.map(try_spec, data, [every_arch] * count, chunksize=1))
    findings = [{"spec": d, "problem": o.problem} for d, o in zip(data, outcomes) if o.problem]
    refused = sum(o.refused for o in outcomes)
    return {"count": count, "seed": seed, "refused": refused, "validated": count - refused,
            "with_backward": sum(not o.refused and "backward" in d for d, o in zip(data, outcomes)),
            "kernels_compiled": sum(o.kernels for o in outcomes), "failed": len(findings),
            "seconds": round(time.perf_counter() - start), "jobs": jobs, "findings": findings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=None, help="write the counts and the findings as JSON here")
    args = parser.parse_args()
    result = run(args.count, args.seed, args.jobs)
    print(f"{result['count']} specs (seed {result['seed']}): {result['refused']} refused by validation, "
          f"{result['validated']} validated ({result['with_backward']} with a backward), "
          f"{result['kernels_compiled']} kernels compiled, {result['failed']} validated and then failed; "
          f"{result['seconds']} s on {result['jobs']} processes")
    for f in result["findings"]:
        print(json.dumps(f))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 1 if result["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
