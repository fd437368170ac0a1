import copy
import json
import os

import pytest

import fagen


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device
        return False


HAS_GPU = _has_gpu()


# ---- the GPU suite's worst errors --------------------------------------------------------------
# With FAGEN_ERRORS set to a path, every relative error a test measures through
# fagen.check.relative_error (the tests import it by name after this wrapper is in place) is kept,
# the largest a test, and written there as JSON lines at the end (one file a pytest-xdist worker).
_ERRORS_PATH = os.environ.get("FAGEN_ERRORS")
_worst: dict[str, float] = {}

if _ERRORS_PATH:
    import fagen.check as _check

    _measure = _check.relative_error

    def _recording_relative_error(out, ref):
        error = _measure(out, ref)
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        _worst[test] = max(_worst.get(test, 0.0), float(error))
        return error

    _check.relative_error = _recording_relative_error


def pytest_sessionfinish(session, exitstatus):
    if _ERRORS_PATH and _worst:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{_ERRORS_PATH}.{worker}", "w") as log:
            log.writelines(json.dumps({"test": t, "error": e}) + "\n" for t, e in _worst.items())


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- spec builders shared by the spec tests ------------------------------------------------

BASE = {  # specs/attn_f16_d128.yaml
    "name": "attn_f16_d128",
    "dtype": "float16",
    "head_dim": 128,
    "tiling": {"block_q": 64, "block_kv": 64, "warps_q": 4},
    "pipeline": {"kv_smem": "separate", "stages": 1, "q_in_registers": False},
    "smem_layout": "padded",
    "mask": "none",
    "outputs": {"lse": True},
    "arch": "sm_80",
}


def base(**overrides) -> dict:
    """A valid spec dict; a dict override for a nested section updates only the keys it names."""
    spec = copy.deepcopy(BASE)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key].update(value)
        else:
            spec[key] = value
    return spec


def rejected(data: dict) -> str:
    with pytest.raises(fagen.SpecError) as info:
        fagen.parse_spec(data)
    return str(info.value)


# ---- compute-sanitizer on a script (the GPU suites' sanitizer tests) ---------------------------
def assert_sanitizer_clean(tool: str, script: str) -> None:
    """Run `script` (Python, printing "ran" at its end) under compute-sanitizer's `tool`; fail with
    its report unless it ran and the tool found nothing."""
    import re
    import shutil
    import subprocess
    import sys

    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(sanitizer):
        pytest.fail("compute-sanitizer is not on this GPU machine (CUDA toolkit's bin/)")
    run = subprocess.run([sanitizer, "--tool", tool, "--error-exitcode", "3", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=600, env={**os.environ})
    assert run.returncode == 0 and "ran" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    # memcheck and synccheck end with "ERROR SUMMARY: 0 errors", racecheck with "(0 errors, 0 warnings)"
    assert re.search(r"ERROR SUMMARY: 0 errors|\(0 errors, 0 warnings\)", run.stdout + run.stderr), run.stdout[-3000:]
