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


@pytest.mark.parametrize("strides, order", [
    ((2048, 128, 64, 1), (0, 1, 2, 3)),          # [B, H, N, d] contiguous
    ((65536, 64, 512, 1), (0, 2, 1, 3)),         # [B, N, H, d] seen as [B, H, N, d]: a model's heads
    ((24576, 64, 1536, 1), (0, 2, 1, 3)),        # ... a slice of a fused QKV projection's heads
    ((512, 64, 512, 1), (0, 2, 1, 3)),           # one query (N = 1): B's and N's strides tie, logical order
    ((8, 8, 8, 1), (0, 1, 2, 3)),                # every leading dimension of size 1
    ((0, 128, 128, 1), (0, 1, 2, 3)),            # a batch broadcast (stride 0): outermost, d still innermost
    ((2048, 0, 64, 1), (1, 0, 2, 3)),            # a head broadcast
])
def test_layout_order_is_the_dimensions_outermost_first(strides, order):
    assert device.layout_order(strides) == order


def test_an_out_laid_out_as_a_transposed_q_transposes_back_contiguous():
    """empty_permuted's strides: an out [B, H, N, d] in q's order of a [B, N, H, d] tensor is one."""
    torch = pytest.importorskip("torch")
    q = torch.empty(2, 5, 3, 8).transpose(1, 2)  # [B, H, N, d] over [B, N, H, d]
    out = device.empty_permuted("torch", (2, 3, 5, 16), device.layout_order(q.stride()), torch.float32)
    assert out.shape == (2, 3, 5, 16) and out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("shape, strides, contiguous", [
    ((2, 3, 4), (12, 4, 1), True),
    ((2, 1, 4), (4, 999, 1), True),  # a dimension of one: its stride never stepped
    ((1, 32, 1, 128), (7, 128, 5, 1), True),
    ((2, 3, 4), (12, 1, 3), False),  # a transpose of the same shape
    ((2, 3, 4), (24, 8, 2), False),  # every other element
    ((2, 0, 4), (5, 3, 1), True),  # no element
])
def test_contiguous_strides_follow_torch_s_rule(shape, strides, contiguous):
    assert device.contiguous_strides(shape, strides) is contiguous


class _Tensor:
    """What laid_out_as reads of a torch tensor (its type's module is torch's)."""

    __module__ = "torch.stand_in"

    def __init__(self, shape, strides, dtype="float16", gpu=0):
        self.shape, self._strides, self.dtype, self._gpu = shape, strides, dtype, gpu

    def stride(self):
        return self._strides

    def get_device(self):
        return self._gpu

    def data_ptr(self):
        return 0

    def is_contiguous(self):
        return device.contiguous_strides(self.shape, self._strides)


def test_a_prepared_contiguous_tensor_takes_any_contiguous_one_of_its_shape():
    """laid_out_as, the Python paths' check: the C hot path's rule (hot_path.c), so a call the C
    path takes the Python path takes too: strides as prepared, or both contiguous; shape, dtype and
    device always as prepared."""
    prepared = device.tensor_signature(_Tensor((4, 32, 1, 128), (4096, 128, 128, 1)))
    assert device.laid_out_as(_Tensor((4, 32, 1, 128), (4096, 128, 4096, 1)), prepared)  # q transposed from [B, 1, H, d]
    assert not device.laid_out_as(_Tensor((4, 32, 1, 128), (4096, 1, 4096, 32)), prepared)
    assert not device.laid_out_as(_Tensor((4, 32, 1, 128), (4096, 128, 4096, 1), dtype="bfloat16"), prepared)
    assert not device.laid_out_as(_Tensor((4, 32, 1, 128), (4096, 128, 4096, 1), gpu=1), prepared)
    assert not device.laid_out_as(_Tensor((4, 32, 2, 128), (8192, 256, 128, 1)), prepared)
    strided = device.tensor_signature(_Tensor((4, 8, 16, 128), (65536, 256, 4096, 1)))  # not contiguous
    assert device.laid_out_as(_Tensor((4, 8, 16, 128), (65536, 256, 4096, 1)), strided)
    assert not device.laid_out_as(_Tensor((4, 8, 16, 128), (16384, 2048, 128, 1)), strided)
