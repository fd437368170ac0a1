"""Programmatic dependent launch (sm_90 and later): a kernel launched with it is scheduled while
the kernel before it on the stream is still running, and waits inside (griddepcontrol.wait, the
first thing its threads do) until that kernel has finished and its writes are visible. What it
saves is the gap between two kernels, the launch and the blocks' start: 0.3-0.9 us a decode step
on the H200 under a CUDA graph (notes/perf.md), which a step of a few microseconds feels. A
decode kernel lets the kernel after it launch once every block has read its keys
(griddepcontrol.launch_dependents), so that one's blocks are resident when the merge ends.

CuPy wraps cuLaunchKernel only: cuLaunchKernelEx, whose launch attribute asks for it, is called
through ctypes (as fagen.tensor_maps calls the driver's cuTensorMapEncodeTiled)."""

from __future__ import annotations

import ctypes
from functools import cache

# Where a step reads more K and V than this, it launches plainly: the gap it would hide is under
# 2% of the step, and the overlap measured 0.8-1.3% slower there (H200, d128: B1 128k 123.4
# against 122.5 us, B8 32k 239.6 against 236.5); at 64-128 MiB it was 2-4% faster, at 8 MiB 8%.
MAX_STEP_KV_BYTES = 128 * 2**20


def pays_off(kv_bytes: int) -> bool:
    """Whether a decode step reading `kv_bytes` of K and V is short enough for the overlap to pay."""
    return kv_bytes <= MAX_STEP_KV_BYTES


# CUlaunchAttributeID (cuda.h): the stream's previous kernel may overlap this one's launch
PROGRAMMATIC_STREAM_SERIALIZATION = 6
MIN_COMPUTE_CAPABILITY = 90  # griddepcontrol is sm_90's


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)),
                ("num_attrs", ctypes.c_uint)]


@cache
def _launch_kernel_ex():
    function = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return function


class DependentLaunch:
    """cuLaunchKernelEx of one CUfunction with its grid, block and shared memory fixed and the
    programmatic-serialization attribute on: called as cupy.cuda.driver.launchKernel's partial
    is, (stream, kernel parameter array, extra), so runtime.Launch takes either. Not for two
    threads at once (the config holds the stream of the call in progress)."""

    __slots__ = ("_attribute", "_config", "_config_ref", "_function", "_launch")

    def __init__(self, function: int, grid: tuple[int, int, int], threads: int, smem: int):
        self._attribute = (_Attribute * 1)()
        self._attribute[0].id = PROGRAMMATIC_STREAM_SERIALIZATION
        self._attribute[0].value[0] = 1
        self._config = _Config(*grid, threads, 1, 1, smem, None, self._attribute, 1)
        self._config_ref = ctypes.byref(self._config)
        self._function = function
        self._launch = _launch_kernel_ex()

    def __call__(self, stream: int, params: int, extra: int = 0) -> None:
        self._config.stream = stream
        status = self._launch(self._config_ref, self._function, params, None)
        if status:
            raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {status}")
