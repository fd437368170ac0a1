"""Split-KV attention: partial outputs over shares of the keys, merged by their LSE.

On one GPU this is flash-decoding: with few query rows (decode) the plain kernel launches too
few blocks to fill the GPU, so the keys are split and each split runs as its own block. The
same partials and merge carry sequence-sharded attention across GPUs (fagen.distributed).
"""

from __future__ import annotations

import math

from fagen import variants
from fagen.device import DeviceTensor, as_device_tensor, cupy, empty_like, multiprocessors, stream_for
from fagen.dispatch import default_spec
from fagen.runtime import compile_kernel, merge_launch
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
