"""The backward of DeepSeek's two head widths (Q.K over 192, V and O over 128) on sm_90a, no mask
or causal (bottom right), GQA: one kernel whose two consumer warpgroups split each block's 96 keys
and hold dK^T and dV^T (templates/sm90/key_split_backward.cu.j2, fagen.key_split_plan). dQ is
added by bulk reduce-adds across key tiles, in no fixed order: not bitwise repeatable, so a
deterministic backward keeps the general kernels. fagen.attention's autograd takes it where
`takes` says so.

    dq, dk, dv = fagen.key_split.backward(dout, q, k, v, out, lse, causal=True)
"""

from __future__ import annotations

import math

from fagen import accumulated_dq
from fagen.device import as_device_tensor, compute_capability, require_cupy
from fagen.key_split_plan import KEY_SPLIT_TYPES, KEY_SPLIT_WIDTHS, KeySplitBackwardPlan
from fagen.rendering import render_key_split_backward

KEY_SPLIT_ARCH = "90"  # compute capability: the kernel is wgmma's (sm_90a)
MAX_GRID_YZ = 65535  # the grids' heads (y) and batch (z): more take the general kernels


def takes(q_shape, k_shape, v_shape, dtype: str, device: int, *, causal: bool, align: str, deterministic: bool) -> bool:
    """Whether this kernel runs a backward of these inputs (anything else the general kernels
    run): the widths and types it is built for, on an sm_90 GPU, no mask or causal where the
    diagonal sits bottom right (or Nq = Nk), not deterministic."""
    return ((q_shape[-1], v_shape[-1]) in KEY_SPLIT_WIDTHS and k_shape[-1] == q_shape[-1] and dtype in KEY_SPLIT_TYPES
            and not deterministic and (not causal or align == "bottom_right" or q_shape[2] == k_shape[2])
            and q_shape[0] <= MAX_GRID_YZ and q_shape[1] <= MAX_GRID_YZ
            and compute_capability(device) == KEY_SPLIT_ARCH)


def backward(dout, q, k, v, out, lse, *, causal: bool = False, scale: float | None = None):
    """(dq, dk, dv) of sum(out * dout) for attention(q, k, v, causal=causal, scale=scale) with q, k
    [B, H, N, 192] and v, out, dout [B, H, N, 128] (Hq a multiple of Hkv), given the forward's out
    and lse (return_lse=True); causal bottom right. dq is summed across key tiles by bulk
    reduce-adds, in no fixed order."""
    require_cupy()
    tq, tk, tv = (as_device_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    for t, name in ((tq, "q"), (tk, "k"), (tv, "v")):
        if len(t.shape) != 4:
            raise ValueError(f"{name}: shape {t.shape}; expected [B, H, N, d]")
    b, hq, nq, d = tq.shape
    hkv, d_v = tk.shape[1], tv.shape[-1]
    if (d, d_v) not in KEY_SPLIT_WIDTHS or tk.shape[-1] != d:
        raise ValueError(f"head_dim: q {d}, k {tk.shape[-1]}, v {d_v}; this backward takes "
                         f"{' or '.join(f'{x}/{y}' for x, y in KEY_SPLIT_WIDTHS)} (q and k / v)")
    if tq.dtype not in KEY_SPLIT_TYPES:
        raise ValueError(f"q: dtype {tq.dtype}; this backward reads {' or '.join(KEY_SPLIT_TYPES)}")
    if tk.shape[:3] != tv.shape[:3] or tk.shape[0] != b or hkv < 1 or hq % hkv:
        raise ValueError(f"k {tk.shape}, v {tv.shape}: [B, Hkv, Nk, d] of one B, Hkv, Nk, q's B = {b}, and Hq = {hq} "
                         f"a multiple of Hkv")
    for t, name in ((tk, "k"), (tv, "v")):
        if t.dtype != tq.dtype or t.kind != tq.kind or t.device != tq.device:
            raise ValueError(f"{name}: a {t.kind} {t.dtype} tensor on cuda:{t.device}; expected q's {tq.kind} "
                             f"{tq.dtype} on cuda:{tq.device}")
    arch = compute_capability(tq.device)
    if arch != KEY_SPLIT_ARCH:
        raise ValueError(f"q: sm_{arch}; this backward is built for sm_{KEY_SPLIT_ARCH}a (Hopper's wgmma) only")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale = {scale}: must be a positive finite number (default 1 / sqrt({d}))")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return accumulated_dq.launch(KeySplitBackwardPlan(tq.dtype, d, d_v), render_key_split_backward, tq, tk, tv, out,
                                 dout, lse, causal=causal, scale=scale)
