"""The backward of FP8 attention on sm_90a: e4m3 q, k, v with FlashAttention-3's descales (the true
tensors are q * q_descale and so on), O and dO in bfloat16 or float16, the gradients of the true
tensors in that type (templates/sm90/fp8_backward.cu.j2, fagen.fp8_backward_plan).

Every product runs in e4m3 (notes/fp8_backward.md says why each rounding is where it is, and
what it costs against a bf16 backward): dO at one scale a (batch, KV head), P times 2^8, dS at a
power of two a key and step for dK and at one scale a step's tile for dQ. The float64 oracle
rounds the same operands at the same scales (`oracle.attention_backward(..., fp8_type=...)`).
dQ is added across key blocks by bulk reduce-adds, in no fixed order: not bitwise repeatable.

    out, lse = fagen.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    dq, dk, dv = fagen.fp8_backward.backward(dout, q8, k8, v8, out, lse, q_descale=qd, k_descale=kd, v_descale=vd)
"""

from __future__ import annotations

import functools
import math

from fagen import fp8_inputs, tensor_maps
from fagen.accumulated_dq import forward_rows
from fagen.device import (as_device_tensor, compute_capability, cupy, empty_like, require_cupy, stream_for,
                          torch_stream_handle, zeros_like)
from fagen.dispatch import call_mask
from fagen.element_types import fp8_element
from fagen.fp8_backward_plan import (FP8_AMAX_PARAMS, FP8_BACKWARD_HEAD_DIMS, FP8_BACKWARD_MASKS,
                                     FP8_BACKWARD_OUT_TYPES, FP8_BACKWARD_PARAMS, FP8_BACKWARD_TYPES, FP8_POSTPROCESS_PARAMS,
                                     FP8_PREPROCESS_PARAMS, POSTPROCESS_THREADS, PREPROCESS_ROWS, Fp8BackwardPlan)
from fagen.rendering import render_fp8_backward
from fagen.runtime import LOG2E, Launch, TensorMap, compile_module

FP8_BACKWARD_ARCH = "90"  # compute capability: the kernel is wgmma's (sm_90a)
MAX_GRID_YZ = 65535  # the grid's KV heads (y) and batch (z)
TMA_TENSORS = (("q", "q_map"), ("k", "k_map"), ("v", "v_map"), ("do8", "do_map"))


@functools.cache
def _functions(plan: Fp8BackwardPlan, device: int) -> tuple:
    """The module's amax, preprocess, kernel and postprocess, compiled once a device and process."""
    with cupy.cuda.Device(device):
        source = render_fp8_backward(plan.dtype, plan.out_dtype, plan.mask, plan.deterministic)
        module = compile_module(source, plan.name, wgmma=True)
        kernel = module.get_function(plan.name)
        kernel.max_dynamic_shared_size_bytes = plan.smem_bytes
        return tuple(module.get_function(f"{plan.name}{part}") if part else kernel
                     for part in ("_amax", "_preprocess", "", "_postprocess"))


def backward(dout, q, k, v, out, lse, *, causal: bool = False, mask=None, scale: float | None = None,
             q_descale=None, k_descale=None, v_descale=None, deterministic: bool = False):
    """(dq, dk, dv) of sum(out * dout) for the FP8 forward attention(q, k, v, causal=causal,
    mask=mask, scale=scale, q_descale=.., k_descale=.., v_descale=..), given its out and lse
    (return_lse=True): q [B, Hq, Nq, 128], k and v [B, Hkv, Nk, 128] torch.float8_e4m3fn (Hq a
    multiple of Hkv); dout and out [B, Hq, Nq, 128] in bfloat16 or float16, the gradients' type;
    the descales None (1), one number or [B, Hkv] float32. mask as fagen.attention's, of a kind
    in FP8_BACKWARD_MASKS (none, causal, sliding_window, chunked, prefix_lm; either align).
    deterministic (as fagen.attention's; or torch.use_deterministic_algorithms(True)): dQ's adds
    in key-block order, bitwise repeatable, where the default adds them as they come."""
    require_cupy()
    mask = call_mask(causal, mask)
    if mask.kind not in FP8_BACKWARD_MASKS or mask.expression is not None:
        what = f"kind {mask.kind!r}" if mask.expression is None else "an expression"
        raise ValueError(f"mask: {what}; the FP8 backward takes the kinds {', '.join(FP8_BACKWARD_MASKS)} without "
                         f"an expression (their tests read positions alone); run the bfloat16 backward for it "
                         f"(fagen.attention on bfloat16 q, k, v)")
    tq, tk, tv = (as_device_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    for t, name in ((tq, "q"), (tk, "k"), (tv, "v")):
        if len(t.shape) != 4:
            raise ValueError(f"{name}: shape {t.shape}; expected [B, H, N, d]")
        if t.kind != "torch" or (fp8_element(t.dtype) is None or fp8_element(t.dtype).name not in FP8_BACKWARD_TYPES):
            raise ValueError(f"{name}: a {t.kind} {t.dtype} tensor; the FP8 backward reads torch.float8_e4m3fn "
                             f"q, k and v "
                             f"(fagen.fp8_backward); a bfloat16 or float16 one takes fagen.attention's backward")
        if t.device != tq.device:
            raise ValueError(f"{name}: on cuda:{t.device}; expected q's device, cuda:{tq.device}")
    b, hq, nq, d = tq.shape
    hkv, nk = tk.shape[1], tk.shape[2]
    if d not in FP8_BACKWARD_HEAD_DIMS or tk.shape[-1] != d or tv.shape[-1] != d:
        raise ValueError(f"head_dim: q {d}, k {tk.shape[-1]}, v {tv.shape[-1]}; the FP8 backward takes "
                         f"{' or '.join(map(str, FP8_BACKWARD_HEAD_DIMS))} for all three")
    if tk.shape[:3] != tv.shape[:3] or tk.shape[0] != b or hkv < 1 or hq % hkv:
        raise ValueError(f"k {tk.shape}, v {tv.shape}: [B, Hkv, Nk, d] of one B, Hkv, Nk, q's B = {b}, and Hq = {hq} "
                         f"a multiple of Hkv")
    if b > MAX_GRID_YZ or hkv > MAX_GRID_YZ:
        raise ValueError(f"q: B = {b}, Hkv = {hkv}: the grid takes at most {MAX_GRID_YZ} of each; split the batch")
    arch = compute_capability(tq.device)
    if arch != FP8_BACKWARD_ARCH:
        raise ValueError(f"q: sm_{arch}; the FP8 backward is built for sm_{FP8_BACKWARD_ARCH}a (Hopper's FP8 "
                         f"wgmma) only")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale = {scale}: must be a positive finite number (default 1 / sqrt({d}))")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    tdo = as_device_tensor(dout, "dout")
    out_dtype = tdo.dtype
    if out_dtype not in FP8_BACKWARD_OUT_TYPES:
        raise ValueError(f"dout: dtype {tdo.dtype}; the FP8 backward takes dout and out in "
                         f"{' or '.join(FP8_BACKWARD_OUT_TYPES)} (the forward's out_dtype), the gradients' type")
    tl = as_device_tensor(lse, "lse")
    if tl.shape != (b, hq, nq) or tl.dtype != "float32" or tl.kind != tq.kind or tl.device != tq.device:
        raise ValueError(f"lse: {tl.kind} {tl.dtype} {tl.shape}; expected the forward's float32 [B, Hq, Nq] = "
                         f"{(b, hq, nq)} on q's device (return_lse=True)")
    deterministic = bool(deterministic) or _torch_deterministic()  # (q is a torch tensor: checked above)
    plan = Fp8BackwardPlan(fp8_element(tq.dtype).name, out_dtype, mask=mask, deterministic=deterministic)
    amax, preprocess, kernel, postprocess = _functions(plan, tq.device)
    with cupy.cuda.Device(tq.device), stream_for(tq):
        dq, dk, dv = (empty_like(t, t.shape, out_dtype) for t in (tq, tk, tv))
        if 0 in (b, hq, nq, nk):  # nothing attended: out was constant
            for g in (dq, dk, dv):
                g[...] = 0
            return dq, dk, dv
        to, tdo = (forward_rows(x, what, (b, hq, nq, d), out_dtype, tq) for x, what in ((out, "out"), (dout, "dout")))
        if tl.strides != (hq * nq, nq, 1):
            tl = as_device_tensor(tl.obj.contiguous(), "lse")
        descales = fp8_inputs.descale_views(q_descale, k_descale, v_descale, b, hkv, tq.obj)
        descale_values = {}
        for name, (array, sb, sh) in descales.items():
            descale_values.update({name: as_device_tensor(array, name).ptr, f"{name}_sb": sb, f"{name}_sh": sh})
        padded_q = -(-nq // plan.block_q) * plan.block_q
        do_amax = as_device_tensor(zeros_like(tq, (b, hkv), "float32"), "do_amax")
        do8 = as_device_tensor(empty_like(tq, (b, hq, padded_q, d), "uint8"), "do8")
        rows = as_device_tensor(empty_like(tq, (b, hq, 2, padded_q), "float32"), "rows")
        dq_accum = as_device_tensor(empty_like(tq, (b, hq, padded_q, d), "float32"), "dq_accum")
        # a tile's turn count (deterministic; the preprocess starts it): the key blocks' warps that have added into it
        turns = as_device_tensor(empty_like(tq, (b, hq, padded_q // plan.block_q), "int32"), "dq_turns").ptr \
            if deterministic else 0
        mask_offset = nk - nq if mask.align == "bottom_right" else 0
        tdq, tdk, tdv = (as_device_tensor(g, n) for g, n in ((dq, "dq"), (dk, "dk"), (dv, "dv")))
        stream = torch_stream_handle()(tq.device)
        shape = dict(heads=hq, group=hq // hkv, n_q=nq, padded_q=padded_q)
        Launch(amax, (-(-nq // PREPROCESS_ROWS), hq, b), 32 * PREPROCESS_ROWS, 0, FP8_AMAX_PARAMS,
               dict(dout=tdo.ptr, do_sb=tdo.strides[0], do_sh=tdo.strides[1], do_sn=tdo.strides[2],
                    do_amax=do_amax.ptr, **shape))(stream)
        Launch(preprocess, (padded_q // PREPROCESS_ROWS, hq, b), 32 * PREPROCESS_ROWS, 0, FP8_PREPROCESS_PARAMS,
               dict(out=to.ptr, o_sb=to.strides[0], o_sh=to.strides[1], o_sn=to.strides[2], dout=tdo.ptr,
                    do_sb=tdo.strides[0], do_sh=tdo.strides[1], do_sn=tdo.strides[2], lse=tl.ptr, do_amax=do_amax.ptr,
                    do8=do8.ptr, rows=rows.ptr, dq_accum=dq_accum.ptr, dq_turns=turns, n_kv=nk,
                    mask_offset=mask_offset, **descale_values, **shape))(stream)
        # TMA maps, each box the plan's rows of one 128-byte row (refusing strides TMA cannot take)
        tensors = {"q": tq, "k": tk, "v": tv, "do8": do8}
        maps = tuple(TensorMap(param, name, plan.dtype, tensor_maps.layout(tensors[name].shape, tensors[name].strides,
                                                                           1, plan.box_rows(name), name))
                     for name, param in TMA_TENSORS)
        Launch(kernel, plan.grid(nk, hkv, b), plan.threads, plan.smem_bytes, FP8_BACKWARD_PARAMS,
               dict(q=tq.ptr, k=tk.ptr, v=tv.ptr, do8=do8.ptr, rows=rows.ptr, do_amax=do_amax.ptr,
                    dq_accum=dq_accum.ptr, dq_turns=turns, dk=tdk.ptr, dk_sb=tdk.strides[0], dk_sh=tdk.strides[1],
                    dk_sn=tdk.strides[2],
                    dv=tdv.ptr, dv_sb=tdv.strides[0], dv_sh=tdv.strides[1], dv_sn=tdv.strides[2], n_kv=nk,
                    mask_offset=mask_offset, scale_log2=scale * LOG2E, scale=scale,
                    **descale_values, **shape),
               slots=tuple(name for name, _ in TMA_TENSORS), maps=maps)(stream)
        Launch(postprocess, (plan.postprocess_blocks(padded_q), hq, b), POSTPROCESS_THREADS, 0, FP8_POSTPROCESS_PARAMS,
               dict(dq_accum=dq_accum.ptr, do_amax=do_amax.ptr, dq=tdq.ptr, dq_sb=tdq.strides[0],
                    dq_sh=tdq.strides[1], dq_sn=tdq.strides[2], scale=scale, **descale_values, **shape))(stream)
    return dq, dk, dv


def _torch_deterministic() -> bool:
    """torch.use_deterministic_algorithms(True) in force (the inputs are torch tensors: torch is loaded)."""
    import torch

    return torch.are_deterministic_algorithms_enabled()
