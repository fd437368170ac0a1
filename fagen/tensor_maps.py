"""TMA tensor maps: how the warp-specialised sm_90a kernels' producer finds Q, K and V.

A tensor map (the driver's CUtensorMap, 128 opaque bytes) describes a tensor in global memory
and the box one TMA instruction copies out of it. The kernel takes one map per input by value
(templates/sm90/tma.cu.j2); this module builds them on the host through the CUDA driver's
cuTensorMapEncodeTiled, called with ctypes (CuPy does not wrap it, and the driver library is
loaded whenever CuPy is). `layout` is pure and CPU-tested; `encode` needs the driver.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache, lru_cache

import numpy as np

from fagen.element_types import element_type

MAP_BYTES, MAP_ALIGN = 128, 64  # sizeof and alignof(CUtensorMap)
SWIZZLE_ROW_BYTES = 128  # one 128-byte swizzle atom's row: a box is one column block of a tile ...
BOX_COLUMNS = 64  # ... 64 columns of a half type (the backward's row groups: half types only)
MAX_BOX_ROWS = 256
ROW_GROUP_ROWS = 8  # rows of one 128-byte swizzle atom
GLOBAL_STRIDE_ALIGN = 16  # bytes
MAX_GLOBAL_STRIDE = 1 << 40  # bytes, exclusive
# The driver's enums (cuda.h)
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3  # the layout wgmma's descriptors read (DESC_SWIZZLE_128B)
L2_PROMOTION_128B = 2
OOB_FILL_ZEROS = 0  # rows past the tensor's end load as zeros, as cp.async's zero-fill did
ENCODE_FLAGS = (INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_128B, OOB_FILL_ZEROS)  # every map's
CUDA_SUCCESS = 0


@dataclass(frozen=True)
class MapLayout:
    """What cuTensorMapEncodeTiled takes, innermost dimension first: the dims, the byte strides
    of all but the first, and the box. A column-block map of a [B, H, N, d] tensor is dims (d, N,
    H, B) with a box of (64, rows, 1, 1); a row-group map is dims (64, N, d / 64, H, B)."""

    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]


def _byte_strides(shape: tuple[int, ...], strides: tuple[int, ...], element_bytes: int, what: str) -> tuple[int, int, int]:
    """The sequence, head and batch strides of a [B, H, N, d] tensor in bytes, checked for TMA. A
    dimension of size 1 is never stepped along, so its stride is replaced by a valid one; any
    other must be a positive multiple of 16 bytes under 2^40."""
    b, h, n, d = shape
    columns = box_columns(element_bytes)
    if strides[-1] != 1 or d % columns:
        raise ValueError(f"{what}: shape {tuple(shape)}, strides {tuple(strides)}: TMA reads rows of head_dim "
                         f"(a multiple of {columns}) at unit stride; pass a contiguous copy")
    natural = element_bytes * d  # a row's bytes: the stride a size-1 dimension gets
    byte_strides = []
    for size, stride, name in ((n, strides[2], "sequence"), (h, strides[1], "head"), (b, strides[0], "batch")):
        step = element_bytes * stride if size > 1 else natural
        if step <= 0 or step % GLOBAL_STRIDE_ALIGN or step >= MAX_GLOBAL_STRIDE:
            raise ValueError(
                f"{what}: {name} stride {stride} elements ({step} bytes): a TMA tensor map needs a positive "
                f"multiple of {GLOBAL_STRIDE_ALIGN} bytes under 2^40 (a broadcast, stride-0 dimension has none); "
                f"pass a contiguous copy ({what}.contiguous() / cupy.ascontiguousarray)")
        byte_strides.append(step)
        natural = step * size
    return tuple(byte_strides)


@lru_cache(maxsize=256)
def layout(shape: tuple[int, ...], strides: tuple[int, ...], element_bytes: int, rows: int, what: str) -> MapLayout:
    """The map of a [B, H, N, d] tensor (strides in elements, the last 1) whose boxes are `rows`
    rows of one 64-column block: a tile's column blocks one after the other."""
    b, h, n, d = shape
    if not 1 <= rows <= MAX_BOX_ROWS:
        raise ValueError(f"{what}: a TMA box of {rows} rows; boxes hold 1..{MAX_BOX_ROWS}")
    return MapLayout(dims=(d, n, h, b), strides=_byte_strides(shape, strides, element_bytes, what),
                     box=(box_columns(element_bytes), rows, 1, 1))


def box_columns(element_bytes: int) -> int:
    """A box's columns: one 128-byte swizzle atom's row (64 of a half type, 128 of FP8)."""
    return SWIZZLE_ROW_BYTES // element_bytes


@lru_cache(maxsize=256)
def row_groups(shape: tuple[int, ...], strides: tuple[int, ...], element_bytes: int, what: str) -> MapLayout:
    """The map of a [B, H, N, d] tensor whose box is one 8-row group of a tile, head_dim's
    64-column blocks side by side (the backward dQ kernel's layout, the one its wgmma descriptors
    read; the dK/dV kernel's producer loads column blocks, `layout`):
    a row's 64-column blocks are a dimension of their own, 128 bytes apart, outside the rows, so
    one box lands as 8 rows of block 0, then 8 rows of block 1, ... Rows past N load as zeros."""
    b, h, n, d = shape
    sequence, head, batch = _byte_strides(shape, strides, element_bytes, what)
    blocks = d // BOX_COLUMNS
    return MapLayout(dims=(BOX_COLUMNS, n, blocks, h, b), strides=(sequence, BOX_COLUMNS * element_bytes, head, batch),
                     box=(BOX_COLUMNS, ROW_GROUP_ROWS, blocks, 1, 1))


@lru_cache(maxsize=64)
def paged_latent(shape: tuple[int, ...], strides: tuple[int, ...], element_bytes: int, page_size: int) -> MapLayout:
    """The map of a paged latent cache [num_pages, page_size, 1, d] (MLA's one KV head; strides
    in elements) whose box is one 64-column block of a whole page: dims (d, page_size,
    num_pages). A page id outside the cache loads as zeros."""
    pages, rows, heads, d = shape
    columns = box_columns(element_bytes)
    if strides[-1] != 1 or d % columns or heads != 1 or rows != page_size:
        raise ValueError(f"kv_cache: shape {tuple(shape)}, strides {tuple(strides)}: TMA reads pages of {page_size} "
                         f"rows of one head at unit stride along d; pass a contiguous cache")
    row_step, page_step = element_bytes * strides[1], element_bytes * strides[0]
    for step, name in ((row_step, "row"), (page_step, "page")):
        if step <= 0 or step % GLOBAL_STRIDE_ALIGN or step >= MAX_GLOBAL_STRIDE:
            raise ValueError(f"kv_cache: {name} stride {step} bytes: a TMA tensor map needs a positive multiple of "
                             f"{GLOBAL_STRIDE_ALIGN} bytes under 2^40; pass a contiguous cache (kv_cache.contiguous())")
    return MapLayout(dims=(d, rows, pages), strides=(row_step, page_step), box=(columns, rows, 1))


@cache
def _encoder():
    """cuTensorMapEncodeTiled from the driver library CuPy has loaded."""
    function = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    u32, u64 = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64, u64, u32, u32,
                         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return function


# Encoding costs a few microseconds of host time a map; a training or serving loop passes the same
# few addresses (PyTorch's caching allocator hands blocks back) and shapes again and again.
@lru_cache(maxsize=1024)
def encode(address: int, dtype: str, mapping: MapLayout) -> bytes:
    """The 128 bytes of the tensor map of `mapping` over the tensor at `address`."""
    storage = np.zeros(MAP_BYTES + MAP_ALIGN, np.uint8)  # the driver writes to a 64-byte-aligned map
    start = -storage.ctypes.data % MAP_ALIGN
    out = storage[start:start + MAP_BYTES]
    rank = len(mapping.dims)
    dims = (ctypes.c_uint64 * rank)(*mapping.dims)
    strides = (ctypes.c_uint64 * (rank - 1))(*mapping.strides)
    box = (ctypes.c_uint32 * rank)(*mapping.box)
    unit = (ctypes.c_uint32 * rank)(*[1] * rank)  # every element of the box, no stepping
    status = _encoder()(out.ctypes.data, element_type(dtype).tensor_map, rank, address, dims, strides, box, unit,
                        *ENCODE_FLAGS)
    if status != CUDA_SUCCESS:
        raise ValueError(f"cuTensorMapEncodeTiled refused a {dtype} tensor at {address:#x} with dims {mapping.dims}, "
                         f"byte strides {mapping.strides}, box {mapping.box} (CUresult {status})")
    return out.tobytes()
