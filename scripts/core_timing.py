"""The Core issue's timing: d=128 prefetch kernel at B=4, H=16, N=4096 beside SDPA."""

import sys

import fagen
from fagen.device import gpu_missing

if (missing := gpu_missing(torch=True)) is not None:  # say what is missing in one line, not a traceback
    sys.exit(f"core_timing.py: {missing}")

from fagen.bench import time_fagen, time_sdpa  # noqa: E402 (after the check: it may import torch)
from fagen.load import SPECS  # noqa: E402

B, H, N, D = 4, 16, 4096, 128
for causal in (False, True):
    name = "attn_f16_d128" if not causal else "attn_f16_d128_causal"
    rows = [time_fagen(fagen.load_spec(SPECS / f"{name}.yaml"), B, H, N)]
    rows += [t for be in ("sdpa_flash", "sdpa_cudnn") if (t := time_sdpa(be, "float16", B, H, N, D, causal))]
    for t in rows:
        print(f"{'causal' if causal else 'dense ':6} {t.kernel:28} {t.ms:8.3f} ms {t.tflops:7.1f} TFLOP/s")
