"""What a fallback tiling costs: a variant fagen.variants.variant moves to a smaller block_kv (the
plan refuses the default's tiling with its modifiers), timed against the same variant forced onto
the default's tiling (which ptxas may or may not fit). B=4, H=16, N=4096, no mask or 8 documents.

    python scripts/fallback_timing.py
"""

from __future__ import annotations

import numpy as np
import torch

import fagen.plan as plan_mod
from fagen.check import random_inputs, time_ms
from fagen.load import SPECS, load_spec, parse_spec
from fagen.runtime import compile_kernel
from fagen.spec import Mask, ScoreMod
from fagen.variants import variant

B, H, N = 4, 16, 4096
CASES = [("attn_f16_d128_h200", Mask(kind="none"), ScoreMod(softcap=30.0, alibi="slopes", bias="vector", sinks=True)),
         ("attn_f16_d128_h200", Mask(kind="document"), ScoreMod(softcap=30.0, bias="vector")),
         ("attn_f16_d256_h200", Mask(kind="none"), ScoreMod(softcap=30.0, alibi="slopes", bias="vector")),
         ("attn_f16_d256", Mask(kind="none"), ScoreMod(bias="vector", alibi="slopes", sinks=True))]


def main() -> None:
    lengths = [400, 700, 300, 600, 500, 800, 296, 500]  # 8 packed documents, 4096 tokens
    docs = torch.from_numpy(np.repeat(np.arange(8, dtype=np.int32), lengths)[None]).cuda()
    for name, mask, mods in CASES:
        base = load_spec(SPECS / f"{name}.yaml")
        chosen = variant(base, mask, mods)
        limit, plan_mod.MAX_REGISTERS = plan_mod.MAX_REGISTERS, 10**6
        forced = parse_spec({**chosen.model_dump(), "name": chosen.name + "_forced", "tiling": base.tiling.model_dump(),
                             "pipeline": base.pipeline.model_dump()})
        plan_mod.MAX_REGISTERS = limit
        q, k, v, out = random_inputs("torch", base.dtype, B, H, H, N, N, base.head_dim)
        extras = {"bias": torch.randn(B, H, N, device="cuda"), "alibi_slopes": torch.rand(H, device="cuda") * 0.1,
                  "sinks": torch.zeros(H, device="cuda"), "doc_ids": docs}
        extras = {k_: v_ for k_, v_ in extras.items() if (k_ == "bias" and mods.bias != "none") or
                  (k_ == "alibi_slopes" and mods.alibi != "none") or (k_ == "sinks" and mods.sinks) or
                  (k_ == "doc_ids" and mask.kind == "document")}
        row = []
        for spec in (chosen, forced):
            plan_mod.MAX_REGISTERS = 10**6
            kernel = compile_kernel(spec)
            plan_mod.MAX_REGISTERS = limit
            local = getattr(kernel.function, "local_size_bytes", "?")  # spills land in local memory
            row.append(f"kv{spec.tiling.block_kv} {spec.pipeline.kv_smem}{spec.pipeline.stages} local {local} B "
                       f"{time_ms(lambda: kernel(q, k, v, out=out, **extras), warmup=10, iters=50):.3f} ms")
        print(f"{name} {mask} {mods.softcap, mods.alibi, mods.bias, mods.sinks}: chosen {row[0]} | default tiling {row[1]}", flush=True)


if __name__ == "__main__":
    np.random.seed(0)
    main()
