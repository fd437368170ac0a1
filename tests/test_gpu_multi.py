"""Every multi-GPU mode against the oracle through real NCCL processes (marked `gpu`), on
fagen's NCCL group with CuPy arrays and on a torch.distributed group with torch tensors.

World size 1 runs on any GPU machine; 2 and 4 where the machine has the GPUs; under `fagen
launch` and under torchrun. scripts/multi_gpu.py's lengths (1000, 777) divide by no 2 * world.
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


# 2 groups x (2 lengths x (batch, sequence, zigzag, zigzag at B = 1 in one launch and its LSE, ring
# causal and full over the copy-engine link, ring causal over NCCL) + the ring's dq, dk, dv over
# each link and the zigzag's, at one length)
CHECKS = 2 * (2 * 8 + 3 * 3)


@pytest.mark.parametrize("launcher", ["fagen", "torchrun"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_mode_against_the_oracle(world, launcher):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs")
    start = ([sys.executable, "-m", "fagen", "launch", "-n", str(world), "--timeout", "300"] if launcher == "fagen"
             else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"])
    run = subprocess.run([*start, str(SCRIPT), "--backward"], capture_output=True, text=True, timeout=330)
    print(run.stdout[-3000:], run.stderr[-3000:])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("PASS") == CHECKS and "FAIL" not in run.stdout
    if world > 1:  # the rings' blocks went over the copy engines wherever the GPUs are peers
        import cupy

        peers = all(cupy.cuda.runtime.deviceCanAccessPeer(a, b) for a in range(world) for b in range(world) if a != b)
        assert f"LINK {'copy_engine' if peers else 'nccl'} world={world}" in run.stdout
