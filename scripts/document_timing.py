"""Document masks as fagen.attention builds them (variants of the shipped defaults): checked
against the oracle, then timed at B=4, H=16, N=4096 on 8 packed documents; with --old DIR,
also the sources in DIR/<variant name>.cu (rendered from other templates) for comparison.

    python scripts/document_timing.py [--old DIR] [--family h200|generic]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fagen.check import check_against_oracle, random_inputs, time_ms
from fagen.load import SPECS
from fagen.runtime import Kernel, compile_kernel
from fagen.variants import variant
from fagen.spec import Mask, ScoreMod
from fagen.load import load_spec

B, H, N = 4, 16, 4096
DOC_LENGTHS = [400, 700, 300, 600, 500, 800, 296, 500]  # 8 documents, 4096 tokens


def variants(family: str):
    suffix = "_h200" if family == "h200" else ""
    for dt in ("f16", "bf16"):
        for d in (64, 128, 256):
            base = load_spec(SPECS / f"attn_{dt}_d{d}{suffix}.yaml")
            for causal in (False, True):
                yield variant(base, Mask(kind="document", causal=causal), ScoreMod())
    base = load_spec(SPECS / f"attn_f16_d128{suffix}.yaml")
    yield variant(base, Mask(kind="document"), ScoreMod(softcap=30.0, alibi="slopes", bias="matrix", sinks=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path)
    ap.add_argument("--family", default="h200")
    args = ap.parse_args()
    doc_ids = np.repeat(np.arange(len(DOC_LENGTHS), dtype=np.int32), DOC_LENGTHS)[None]
    print(f"{'variant':54} {'check':>9} {'new ms':>8} {'old ms':>8}")
    for spec in variants(args.family):
        rng = np.random.default_rng(0)
        errs = []
        for b, hq, hkv, n in ((1, 2, 2, 777), (2, 4, 2, 1000), (1, 2, 1, 130), (1, 1, 1, 4096)):
            r = check_against_oracle(spec, b, hq, hkv, n, n, framework="torch", seed=int(rng.integers(1 << 30)))
            assert r.passed, f"{spec.name}: {r.summary()}"
            errs.append(r.out_error if hasattr(r, "out_error") else 0.0)
        q, k, v, out = random_inputs("torch", spec.dtype, B, H, H, N, N, spec.head_dim)
        import torch

        docs = torch.from_numpy(doc_ids).cuda()
        extras = {"doc_ids": docs}
        if spec.score_mod.bias != "none":
            extras["bias"] = torch.randn(B, H, N, N, device="cuda", dtype=torch.float32) \
                if spec.score_mod.bias == "matrix" else torch.randn(B, H, N, device="cuda", dtype=torch.float32)
        if spec.score_mod.alibi == "slopes":
            extras["alibi_slopes"] = torch.rand(H, device="cuda", dtype=torch.float32) * 0.1
        if spec.score_mod.sinks:
            extras["sinks"] = torch.zeros(H, device="cuda", dtype=torch.float32)
        new = compile_kernel(spec)
        ms_new = time_ms(lambda: new(q, k, v, out=out, **extras), warmup=10, iters=100)
        ms_old = float("nan")
        old_path = args.old / f"{spec.name}.cu" if args.old else None
        if old_path and old_path.exists():
            old = Kernel(spec, old_path.read_text())
            ms_old = time_ms(lambda: old(q, k, v, out=out, **extras), warmup=10, iters=100)
        print(f"{spec.name:54} {'ok':>9} {ms_new:8.3f} {ms_old:8.3f}", flush=True)


if __name__ == "__main__":
    main()
