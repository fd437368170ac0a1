"""Split-KV attention: partial outputs over shares of the keys, merged by their LSE.

On one GPU this is flash-decoding: with few query rows (decode) the plain kernel launches too
few blocks to fill the GPU, so the keys are split and each split runs as its own block. The
same partials and merge carry sequence-sharded attention across GPUs (fagen.distributed).
"""

from __future__ import annotations

import math

import numpy as np

from fagen import variants
from fagen.device import DeviceTensor, as_device_tensor, cupy, empty_like, multiprocessors, stream_for
from fagen.render import MERGE_DTYPES, merge_name
from fagen.plan import merge_plan, merge_warps
from fagen.runtime import Launch, compile_kernel, default_spec, shared_function
from fagen.spec import AttentionSpec


def choose_splits(blocks: int, kv_tiles: int, sm_count: int) -> int:
    """Splits that give about two waves of blocks over the SMs, at least 2 KV tiles a split;
    1 when the unsplit launch already fills the GPU, or has no block to split."""
    if blocks < 1 or blocks >= sm_count or kv_tiles < 4:
        return 1
    return max(1, min(kv_tiles // 2, math.ceil(2 * sm_count / blocks)))


def merge(o_parts, lse_parts, *, sinks=None, out=None, out_dtype: str | None = None):
    """Combine partials o_parts [S, B, H, N, d] (float32) and lse_parts [S, B, H, N] into
    (out [B, H, N, d], lse [B, H, N]); sinks [H] float32 join the denominator here."""
    tp = as_device_tensor(o_parts, "o_parts")
    _, b, h, n, d = tp.shape if len(tp.shape) == 5 else (0,) * 5
    out_dtype = out_dtype or (as_device_tensor(out, "out").dtype if out is not None else "float32")
    with cupy.cuda.Device(tp.device), stream_for(tp):
        out = empty_like(tp, (b, h, n, d), out_dtype) if out is None else out
        lse = empty_like(tp, (b, h, n), "float32")
        launch = merge_launch(o_parts, lse_parts, out, lse, sinks=sinks)
        launch.launch(None)
        del launch  # the sinks' copy, if one was made, is freed only after the launch is enqueued
    return out, lse


class MergeLaunch:
    """The merge of given partials into given outputs, packed (fagen.runtime.Launch): its slots
    re-point out and lse; `held` keeps a copy of the sinks alive."""

    def __init__(self, launch: Launch, held):
        self.launch, self.held = launch, held


def merge_launch(o_parts, lse_parts, out, lse, *, sinks=None) -> MergeLaunch:
    """Check the partials, the outputs and the sinks, and pack the merge's launch."""
    tp, tl = as_device_tensor(o_parts, "o_parts"), as_device_tensor(lse_parts, "lse_parts")
    if tp.dtype != "float32" or tl.dtype != "float32" or len(tp.shape) != 5 or tl.shape != tp.shape[:4]:
        raise ValueError(f"merge: o_parts {tp.dtype} {tp.shape}, lse_parts {tl.dtype} {tl.shape}; expected "
                         f"float32 [S, B, H, N, d] and [S, B, H, N]")
    if tp.strides != _contiguous(tp.shape) or tl.strides != _contiguous(tl.shape):
        raise ValueError("merge: o_parts and lse_parts must be contiguous")
    s, b, h, n, d = tp.shape
    to, tlse = as_device_tensor(out, "out"), as_device_tensor(lse, "lse")
    if to.shape != (b, h, n, d) or to.dtype not in MERGE_DTYPES or to.strides[-1] != 1:
        raise ValueError(f"merge: out {to.dtype} {to.shape}; expected [{b}, {h}, {n}, {d}], float16, bfloat16 or "
                         f"float32, unit stride along d")
    if tlse.shape != (b, h, n) or tlse.dtype != "float32" or tlse.strides != _contiguous(tlse.shape):
        raise ValueError(f"merge: lse {tlse.dtype} {tlse.shape}; expected contiguous float32 [{b}, {h}, {n}]")
    held, sink_ptr = None, np.uint64(0)
    if sinks is not None:
        with cupy.cuda.Device(tp.device):
            held = cupy.ascontiguousarray(cupy.asarray(sinks, dtype=cupy.float32))
        if held.shape != (h,):
            raise ValueError(f"merge: sinks shape {held.shape}; expected [{h}]")
        sink_ptr = np.uint64(held.data.ptr)
    rows = b * h * n
    geometry = merge_plan(to.dtype)
    if d > 32 * geometry.columns_per_lane:
        raise ValueError(f"merge: head_dim {d}; the merge sums at most {32 * geometry.columns_per_lane} columns")
    values = dict(o_parts=tp.ptr, lse_parts=tl.ptr, sinks=sink_ptr, out=to.ptr, lse=tlse.ptr,
                  splits=s, rows=rows, head_dim=d, heads=h, n_q=n, part_stride=b * h * n * d,
                  lse_part_stride=b * h * n, **dict(zip(("o_sb", "o_sh", "o_sn"), to.strides[:3])))
    launch = Launch(shared_function(merge_name(to.dtype), tp.device), (rows, 1, 1), 32 * merge_warps(s), 0, geometry.params, values,
                    slots=("out", "lse"))
    return MergeLaunch(launch, held)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, splits: int | None = None,
              sinks=None, return_lse: bool = False, spec: AttentionSpec | None = None):
    """Attention through split-KV partials and the merge; `splits` defaults to what fills the GPU."""
    tq: DeviceTensor = as_device_tensor(q, "q")
    partial = variants.partial_variant(spec) if spec else default_spec(tq.dtype, tq.shape[-1], causal, partial=True)
    kernel = compile_kernel(partial)
    b, hq, nq, _ = tq.shape
    nk = as_device_tensor(k, "k").shape[2]
    if splits is None:
        sm_count = multiprocessors(tq.device)
        blocks = b * hq * math.ceil(nq / kernel.plan.block_q)
        splits = choose_splits(blocks, math.ceil(nk / kernel.plan.block_kv), sm_count)
    o_parts, lse_parts = kernel(q, k, v, scale=scale, splits=splits)
    out, lse = merge(o_parts, lse_parts, sinks=sinks, out_dtype=tq.dtype)
    return (out, lse) if return_lse else out
