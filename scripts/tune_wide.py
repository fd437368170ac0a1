"""Tune the default kernels over a middle-sized space (no shared/1 stage, Q in smem), writing
the winners to the folder given as argv[1]."""

import sys
from pathlib import Path

import fagen
from fagen import tune
from fagen.load import SPECS

tune.SPACE = {**tune.SPACE, "pipeline": (("shared", 2), ("separate", 1), ("separate", 2)), "q_in_registers": (False,)}
out = Path(sys.argv[1])
names = sys.argv[2:] or ["attn_f16_d64", "attn_f16_d64_causal", "attn_f16_d128_causal", "attn_bf16_d128"]
for name in names:
    shape = (8, 32, 2048, 2048) if "_d64" in name else (4, 16, 4096, 4096)
    base = fagen.load_spec(SPECS / f"{name}.yaml")
    results = tune.tune(base, *shape)
    for c in results[:3]:
        print(f"{c.spec.name:56} {c.ms:8.3f} ms {c.tflops:7.1f} TFLOP/s" if c.ms else f"{c.spec.name} {c.error}")
    default = [c for c in results if c.spec.tiling == base.tiling and c.spec.pipeline == base.pipeline
               and c.spec.smem_layout == base.smem_layout]
    if default and default[0].ms:
        print(f"  (shipped default {default[0].ms:.3f} ms)")
    print(tune.write_tuned(results[0], base, shape, out, tune.gpu_slug()), flush=True)
