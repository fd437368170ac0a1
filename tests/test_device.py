"""fagen.device on a machine without a GPU: what it says is missing, and the tensor adapter's
refusals (the GPU paths run in the gpu-marked suites)."""

import numpy as np
import pytest

from fagen import device


def test_gpu_missing_without_cupy_or_a_device(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "cupy", None)
    assert device.gpu_missing().startswith("CuPy is not installed")
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 0)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))
    assert device.gpu_missing().startswith("no CUDA GPU found")
    runtime.getDeviceCount = lambda: 1
    monkeypatch.setitem(sys.modules, "torch", None)
    assert device.gpu_missing() is None
    assert device.gpu_missing(torch=True).startswith("PyTorch is not installed")


def test_host_arrays_are_refused_with_the_move_to_make():
    with pytest.raises(ValueError, match="cupy.asarray"):
        device.as_device_tensor(np.zeros((1, 1, 1, 8), np.float16), "q")
    with pytest.raises(ValueError, match="expected a CuPy array or a PyTorch CUDA tensor"):
        device.as_device_tensor([1, 2], "k")
