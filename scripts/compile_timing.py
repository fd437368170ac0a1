"""Time to a runnable kernel: a spec never compiled (render + NVRTC + load), then the same
spec in a fresh process with CuPy's disk cache warm (render + cache hit + load)."""

import os
import subprocess
import sys
import tempfile

PROBE = """
import time
import cupy
cupy.empty(1)  # the CUDA context: paid by any CUDA program, not by fagen
import fagen
from fagen.rendering import render
from fagen.load import SPECS
spec = fagen.parse_spec({**fagen.load_spec(SPECS / "attn_f16_d128.yaml").model_dump(), "name": "compile_probe_f16_d128"})
t0 = time.perf_counter()
render(spec)
t1 = time.perf_counter()
fagen.compile(spec)
t2 = time.perf_counter()
print(f"{(t2 - t1) * 1e3:.0f} ms to a launchable kernel after a {(t1 - t0) * 1e3:.0f} ms first render")
"""
with tempfile.TemporaryDirectory() as cache:
    env = dict(os.environ, CUPY_CACHE_DIR=cache)
    for label in ("new spec, cold cache", "same spec, new process, disk cache"):
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
        print(f"{label:36} {out.stdout.strip() or out.stderr[-500:]}")
