"""The warp-specialised sm_90a forward on the GPU (marked `gpu`; Hopper only): what the shipped
specs' suite (tests/test_gpu.py) does not reach. A prepared call re-pointed at other tensors
encodes their tensor maps anew; tensors TMA cannot describe are refused before launch; and
compute-sanitizer's memcheck, racecheck and synccheck find nothing in a representative launch."""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import fagen
from fagen import oracle, variants
from fagen.check import OUT_TOLERANCE, random_inputs, relative_error, to_numpy
from fagen.runtime import compile_kernel
from fagen.spec import Mask, ScoreMod

pytestmark = pytest.mark.gpu


def _hopper_default(causal: bool = False):
    spec = variants.shipped_spec("float16", 128, causal, gpu="h200")
    if not spec.warp_specialized:
        pytest.fail("the shipped H200 d128 default is expected to be warp-specialised")
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("sm_90a kernels need a Hopper GPU")
    return spec


def test_a_prepared_call_re_encodes_its_maps_for_new_tensors():
    _hopper_default()
    first = random_inputs("torch", "float16", 2, 4, 2, 333, 517, 128)
    prepared = fagen.prepare(*first[:3], causal=True)
    for q, k, v, out in (random_inputs("torch", "float16", 2, 4, 2, 333, 517, 128) for _ in range(2)):
        got, lse = prepared(q, k, v, out=out)
        ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), mask=Mask(kind="causal"), return_lse=True)
        assert relative_error(to_numpy(got), ref) < OUT_TOLERANCE["float16"]
        assert relative_error(to_numpy(lse), ref_lse) < 1e-4


def test_variants_of_the_warp_specialized_default():
    """A mask with a modifier and sinks, on the TMA producer's kernel (fagen.attention's path)."""
    base = _hopper_default()
    spec = variants.variant(base, Mask(kind="sliding_window", window_left=200), ScoreMod(softcap=20.0, sinks=True))
    assert spec.warp_specialized
    q, k, v, out = random_inputs("torch", "float16", 1, 4, 1, 700, 700, 128)
    import torch

    sinks = torch.randn(4, device="cuda")
    got = compile_kernel(spec)(q, k, v, out=out, sinks=sinks)
    ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), mask=spec.mask, softcap=20.0,
                           sinks=sinks.cpu().numpy())
    assert relative_error(to_numpy(got), ref) < OUT_TOLERANCE["float16"]


def test_a_broadcast_tensor_is_refused_before_launch():
    import torch

    spec = _hopper_default()
    q, k, v, out = random_inputs("torch", "float16", 1, 4, 1, 128, 128, 128)
    k4 = k.expand(1, 4, 128, 128)  # head stride 0: TMA needs a positive multiple of 16 bytes
    out.fill_(7)
    with pytest.raises(ValueError, match="k: head stride 0"):
        compile_kernel(spec)(q, k4, v.expand(1, 4, 128, 128), out=out)
    torch.cuda.synchronize()
    assert bool((out == 7).all())  # nothing ran


SANITIZED = """
import torch, fagen
from fagen import variants
from fagen.runtime import compile_kernel
from fagen.check import random_inputs
for causal in (False, True):
    spec = variants.shipped_spec("float16", 128, causal, gpu="h200")
    q, k, v, out = random_inputs("torch", "float16", 1, 2, 1, 300, 421, 128)
    compile_kernel(spec)(q, k, v, out=out)
torch.cuda.synchronize()
print("ran")
"""


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer_is_clean(tool):
    _hopper_default()
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(sanitizer):
        pytest.fail("compute-sanitizer is not on this GPU machine (CUDA toolkit's bin/)")
    run = subprocess.run([sanitizer, "--tool", tool, "--error-exitcode", "3", sys.executable, "-c", SANITIZED],
                         capture_output=True, text=True, timeout=600, env={**os.environ})
    assert run.returncode == 0 and "ran" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    # memcheck and synccheck end with "ERROR SUMMARY: 0 errors", racecheck with "(0 errors, 0 warnings)"
    assert re.search(r"ERROR SUMMARY: 0 errors|\(0 errors, 0 warnings\)", run.stdout + run.stderr), run.stdout[-3000:]
