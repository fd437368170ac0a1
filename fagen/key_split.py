"""The backward of DeepSeek's two head widths (Q.K over 192, V and O over 128) on sm_90a, no mask
or causal (bottom right), GQA: one kernel whose two consumer warpgroups split each block's 96 keys
and hold dK^T and dV^T (templates/sm90/key_split_backward.cu.j2, fagen.key_split_plan). dQ is
added by bulk reduce-adds across key tiles, in no fixed order: not bitwise repeatable, so a
deterministic backward keeps the general kernels. fagen.attention's autograd takes it where
`takes` says so.

    dq, dk, dv = fagen.key_split.backward(dout, q, k, v, out, lse, causal=True)
"""

from __future__ import annotations

import functools
import math

from fagen import tensor_maps
from fagen.device import as_device_tensor, cupy, empty_like, require_cupy, stream_for, torch_stream_handle
from fagen.element_types import ELEMENT_TYPES
from fagen.key_split_plan import KEY_SPLIT_TYPES, KEY_SPLIT_WIDTHS, KeySplitBackwardPlan
from fagen.render import render_key_split_backward
from fagen.runtime import LOG2E, Launch, TensorMap, compile_module
from fagen.wide_head_plan import WIDE_POSTPROCESS_PARAMS, WIDE_PREPROCESS_PARAMS

KEY_SPLIT_ARCH = "90"  # compute capability: the kernel is wgmma's (sm_90a)
PREPROCESS_ROWS = 4  # query rows a preprocess block: a warp each
ROW_ALIGN_ELEMENTS = 8  # the kernels read rows in 16-byte pieces (TMA boxes; the preprocess's 8-byte loads)


def takes(q_shape, k_shape, v_shape, dtype: str, device: int, *, causal: bool, align: str, deterministic: bool) -> bool:
    """Whether this kernel runs a backward of these inputs (anything else the general kernels
    run): the widths and types it is built for, on an sm_90 GPU, no mask or causal where the
    diagonal sits bottom right (or Nq = Nk), not deterministic."""
    return ((q_shape[-1], v_shape[-1]) in KEY_SPLIT_WIDTHS and k_shape[-1] == q_shape[-1] and dtype in KEY_SPLIT_TYPES
            and not deterministic and (not causal or align == "bottom_right" or q_shape[2] == k_shape[2])
            and cupy.cuda.Device(device).compute_capability == KEY_SPLIT_ARCH)


@functools.cache
def _functions(dtype: str, device: int):
    """The preprocess, kernel and postprocess for `dtype`, compiled once a device and process."""
    with cupy.cuda.Device(device):
        plan = KeySplitBackwardPlan(dtype)
        module = compile_module(render_key_split_backward(dtype), plan.name, wgmma=True)
        kernel = module.get_function(plan.name)
        kernel.max_dynamic_shared_size_bytes = plan.smem_bytes
        return module.get_function(f"{plan.name}_preprocess"), kernel, module.get_function(f"{plan.name}_postprocess")


def _checked(x, what: str, shape: tuple[int, ...], tq):
    """x as the kernels read it: `shape`, q's type and device, 16-byte rows (a copy where they are
    not: a broadcast dout from a pooled loss, odd strides)."""
    t = as_device_tensor(x, what)
    if t.shape != shape or t.dtype != tq.dtype or t.kind != tq.kind or t.device != tq.device:
        raise ValueError(f"{what}: {t.kind} {t.dtype} {t.shape} on cuda:{t.device}; expected a {tq.kind} {tq.dtype} "
                         f"{shape} on cuda:{tq.device}")
    if t.strides[-1] != 1 or t.ptr % 16 or any(s % ROW_ALIGN_ELEMENTS or s <= 0 for s in t.strides[:-1]):
        x = x.contiguous() if t.kind == "torch" else cupy.ascontiguousarray(x)
        t = as_device_tensor(x, what)
    return t


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
    hkv, nk, d_v = tk.shape[1], tk.shape[2], tv.shape[-1]
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
    arch = cupy.cuda.Device(tq.device).compute_capability
    if arch != KEY_SPLIT_ARCH:
        raise ValueError(f"q: sm_{arch}; this backward is built for sm_{KEY_SPLIT_ARCH}a (Hopper's wgmma) only")
    tl = as_device_tensor(lse, "lse")
    if tl.shape != (b, hq, nq) or tl.dtype != "float32" or tl.kind != tq.kind or tl.device != tq.device:
        raise ValueError(f"lse: {tl.kind} {tl.dtype} {tl.shape}; expected the forward's float32 [B, Hq, Nq] = "
                         f"{(b, hq, nq)} on q's device (return_lse=True)")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale = {scale}: must be a positive finite number (default 1 / sqrt({d}))")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    plan = KeySplitBackwardPlan(tq.dtype, d, d_v)
    element = ELEMENT_TYPES[tq.dtype].bytes
    with cupy.cuda.Device(tq.device), stream_for(tq):
        dq, dk, dv = (empty_like(t, t.shape, tq.dtype) for t in (tq, tk, tv))
        if 0 in (b, hq, nq, nk):  # nothing attended: out was constant
            for g in (dq, dk, dv):
                g[...] = 0
            return dq, dk, dv
        to, tdo = (_checked(x, what, (b, hq, nq, d_v), tq) for x, what in ((out, "out"), (dout, "dout")))
        if tl.strides != (hq * nq, nq, 1):
            lse = lse.contiguous() if tl.kind == "torch" else cupy.ascontiguousarray(lse)
            tl = as_device_tensor(lse, "lse")
        padded_q = -(-nq // plan.block_q) * plan.block_q
        rows = empty_like(tq, (b, hq, 2, padded_q), "float32")
        dq_accum = empty_like(tq, (b, hq, padded_q, d), "float32")
        tr, ta = as_device_tensor(rows, "rows"), as_device_tensor(dq_accum, "dq_accum")
        tdq, tdk, tdv = (as_device_tensor(g, n) for g, n in ((dq, "dq"), (dk, "dk"), (dv, "dv")))
        preprocess, kernel, postprocess = _functions(tq.dtype, tq.device)
        stream = torch_stream_handle()(tq.device) if tq.kind == "torch" else None
        Launch(preprocess, (-(-padded_q // PREPROCESS_ROWS), hq, b), 32 * PREPROCESS_ROWS, 0, WIDE_PREPROCESS_PARAMS,
               dict(out=to.ptr, o_sb=to.strides[0], o_sh=to.strides[1], o_sn=to.strides[2], dout=tdo.ptr,
                    do_sb=tdo.strides[0], do_sh=tdo.strides[1], do_sn=tdo.strides[2], lse=tl.ptr, rows=tr.ptr,
                    dq_accum=ta.ptr, heads=hq, n_q=nq, padded_q=padded_q))(stream)
        # TMA maps (refusing strides TMA cannot take): q's and dO's boxes a step's rows, k's and v's the block's keys
        maps = tuple(TensorMap(param, name, tq.dtype, tensor_maps.layout(t.shape, t.strides, element, rows_, name))
                     for t, name, param, rows_ in ((tq, "q", "q_map", plan.block_q), (tk, "k", "k_map", plan.block_kv),
                                                   (tv, "v", "v_map", plan.block_kv),
                                                   (tdo, "dout", "do_map", plan.block_q)))
        values = dict(q=tq.ptr, k=tk.ptr, v=tv.ptr, dout=tdo.ptr, rows=tr.ptr, dq_accum=ta.ptr,
                      dk=tdk.ptr, dk_sb=tdk.strides[0], dk_sh=tdk.strides[1], dk_sn=tdk.strides[2],
                      dv=tdv.ptr, dv_sb=tdv.strides[0], dv_sh=tdv.strides[1], dv_sn=tdv.strides[2],
                      heads=hq, group=hq // hkv, n_q=nq, n_kv=nk, padded_q=padded_q, causal=int(bool(causal)),
                      scale_log2=scale * LOG2E, scale=scale)
        Launch(kernel, (-(-nk // plan.block_kv), hkv, b), plan.threads, plan.smem_bytes, plan.params, values,
               slots=("q", "k", "v", "dout"), maps=maps)(stream)
        pieces = padded_q // plan.block_q * plan.consumer_warpgroups * plan.dq_pieces  # a postprocess block a piece
        Launch(postprocess, (pieces, hq, b), plan.warpgroup_threads, 0, WIDE_POSTPROCESS_PARAMS,
               dict(dq_accum=ta.ptr, dq=tdq.ptr, dq_sb=tdq.strides[0], dq_sh=tdq.strides[1], dq_sn=tdq.strides[2],
                    heads=hq, n_q=nq, padded_q=padded_q, scale=scale))(stream)
    return dq, dk, dv
