"""Every multi-GPU mode against the oracle through real NCCL processes (marked `gpu`).

One GPU: the modes with world size 1 (ring_size 1 is the plain kernel). Two or more GPUs:
the same with two ranks, plus the N=32k timings printed by the script.
"""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "multi_gpu.py"


def _gpus() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


@pytest.mark.parametrize("world", [1, 2])
def test_every_mode_against_the_oracle(world):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs")
    run = subprocess.run([sys.executable, "-m", "fagen", "launch", "-n", str(world), "--timeout", "300", str(SCRIPT)],
                         capture_output=True, text=True, timeout=330)
    print(run.stdout[-3000:], run.stderr[-3000:])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("PASS") == 8 and "FAIL" not in run.stdout
