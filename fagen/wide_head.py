"""The attention forward at head_dim 512 on sm_90a (Gemma-4's global layers): q [B, Hq, Nq, 512],
k, v [B, Hkv, Nk, 512] (Hq a multiple of Hkv), no mask or causal (bottom right), out like q and
the LSE. One kernel (templates/sm90/wide_forward.cu.j2) splits O's 512 columns over two
warpgroups, as MLA decode does; fagen.attention takes this path for head_dim 512. Decode packs
a GQA group's heads as one tile's rows, and splits the keys over blocks (merged by LSE) where the
tiles and heads leave SMs idle.

    out = fagen.wide_head.attention(q, k, v, causal=True)

    dq, dk, dv = fagen.wide_head.backward(dout, q, k, v, out, lse, causal=True)

The backward (templates/sm90/wide_backward.cu.j2) runs each 64-key tile as a cluster of two
blocks, each owning half of the 512 columns, exchanging S^T's and dP^T's partial products through
distributed shared memory; dQ is added by bulk reduce-adds across key tiles (not bitwise
repeatable). fagen.attention's autograd takes it for head_dim 512.
"""

from __future__ import annotations

import functools
import math

from fagen import accumulated_dq, tensor_maps
from fagen.dispatch import call_mask
from fagen.device import (as_device_tensor, cupy, empty_laid_out_as, empty_like, multiprocessors, require_cupy, stream_for,
                          torch_stream_handle)
from fagen.element_types import ELEMENT_TYPES
from fagen.rendering import render_wide, render_wide_backward
from fagen.runtime import LOG2E, Launch, TensorMap, compile_module
from fagen.wide_head_plan import WIDE_HEAD_DIMS, WIDE_TYPES, WideBackwardPlan, WideHeadPlan

WIDE_ARCH = "90"  # compute capability: the kernel is wgmma's (sm_90a)


@functools.cache
def _functions(dtype: str, device: int):
    """The forward's kernel and its merge for `dtype`, compiled once a device and process."""
    with cupy.cuda.Device(device):
        plan = WideHeadPlan(dtype)
        module = compile_module(render_wide(dtype), plan.name, wgmma=True)
        function = module.get_function(plan.name)
        function.max_dynamic_shared_size_bytes = plan.smem_bytes
        return function, module.get_function(plan.merge_name)


def check(tq, tk, tv) -> None:
    """q, k and v against what the kernel reads, each refusal naming its fix."""
    for t, name, heads in ((tq, "q", "Hq"), (tk, "k", "Hkv"), (tv, "v", "Hkv")):
        if len(t.shape) != 4:
            raise ValueError(f"{name}: shape {t.shape}; expected [B, {heads}, N, d]")
    d = tq.shape[-1]
    if d not in WIDE_HEAD_DIMS or tk.shape[-1] != d or tv.shape[-1] != d:
        raise ValueError(f"head_dim: q {d}, k {tk.shape[-1]}, v {tv.shape[-1]}; the wide-head forward takes "
                         f"{' or '.join(map(str, WIDE_HEAD_DIMS))} for all three")
    if tq.dtype not in WIDE_TYPES or tk.dtype != tq.dtype or tv.dtype != tq.dtype:
        raise ValueError(f"q, k, v: dtypes {tq.dtype}, {tk.dtype}, {tv.dtype}; head_dim {d} reads float16 or "
                         f"bfloat16, one for all three: cast them")
    b, hq, _, _ = tq.shape
    if tk.shape != tv.shape or tk.shape[0] != b:
        raise ValueError(f"k {tk.shape} and v {tv.shape}: one shape [B, Hkv, Nk, d] with q's B = {b}")
    hkv = tk.shape[1]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"heads: q has {hq}, k and v {hkv}; Hq must be a multiple of Hkv (GQA)")
    for t, name in ((tk, "k"), (tv, "v")):
        if t.kind != tq.kind or t.device != tq.device:
            raise ValueError(f"{name}: a {t.kind} tensor on cuda:{t.device}, q a {tq.kind} tensor on "
                             f"cuda:{tq.device}: pass all from one framework on one GPU")


def _checked_scale(tq, scale: float | None, kernel: str) -> float:
    """The softmax scale (1 / sqrt(head_dim) by default), a GPU other than sm_90 and a scale that
    is no positive finite number refused by name."""
    d = tq.shape[-1]
    arch = cupy.cuda.Device(tq.device).compute_capability
    if arch != WIDE_ARCH:
        raise ValueError(f"q: head_dim {d} on sm_{arch}; its {kernel} is built for sm_{WIDE_ARCH}a (Hopper's wgmma) "
                         f"only: run it on an H100 or H200, or use head_dim 256 or less")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale = {scale}: must be a positive finite number (default 1 / sqrt({d}))")
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _out(out, shape: tuple[int, ...], tq):
    if out is None:
        return empty_laid_out_as(tq, shape, tq.dtype)
    to = as_device_tensor(out, "out")
    if to.shape != shape or to.dtype != tq.dtype or to.kind != tq.kind or to.device != tq.device \
            or to.strides[-1] != 1 or to.ptr % 4 or any(s % 2 for s in to.strides[:3]):
        raise ValueError(f"out: {to.kind} {to.dtype} {to.shape}, strides {to.strides} on cuda:{to.device}; expected a "
                         f"{tq.kind} {tq.dtype} tensor {shape} on cuda:{tq.device} with a unit last stride and even "
                         f"others (the kernel stores column pairs)")
    return out


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False, out=None):
    """softmax(q k^T * scale) v at head_dim 512 (scale 1 / sqrt(512) by default); causal aligns
    the diagonal bottom right (query i sees keys up to i + Nk - Nq). Returns out [B, Hq, Nq, 512]
    (and lse [B, Hq, Nq] float32, natural log; a row that sees no key: out 0, lse -inf)."""
    require_cupy()
    tq, tk, tv = (as_device_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    check(tq, tk, tv)
    b, hq, nq, d = tq.shape
    hkv, nk = tk.shape[1], tk.shape[2]
    scale = _checked_scale(tq, scale, "forward")
    plan = WideHeadPlan(tq.dtype)
    element = ELEMENT_TYPES[tq.dtype].bytes
    with cupy.cuda.Device(tq.device), stream_for(tq):
        out = _out(out, (b, hq, nq, d), tq)
        lse = empty_like(tq, (b, hq, nq), "float32")
        if 0 in (b, hq, nq):
            return (out, lse) if return_lse else out
        if nk == 0:  # no key: every row sees none
            out[...] = 0
            lse[...] = -math.inf
            return (out, lse) if return_lse else out
        to = as_device_tensor(out, "out")
        # A group's query heads as rows of one tile where their rows line up (one query a head, or
        # heads Nq rows apart): each KV head's keys are read once for its group, not once a head.
        group = hq // hkv
        q_rows, o_rows = _packed_rows(tq, group, causal), _packed_rows(to, group, causal)
        if group > 1 and q_rows and o_rows:
            heads, rows, group, q_view, o_strides = hkv, group * nq, 1, q_rows, o_rows[1]
            causal = causal and nq > 1  # (one query sees every key: bottom right)
        else:
            heads, rows, q_view, o_strides = hq, nq, (tq.shape, tq.strides), to.strides
        q_tiles = -(-rows // plan.block_rows)
        splits = default_splits(b * heads * q_tiles, -(-nk // plan.block_kv), multiprocessors(tq.device))
        # TMA maps: q's boxes of 64 rows, k's and v's of a KV tile's rows (refusing strides TMA cannot take)
        maps = tuple(TensorMap(f"{name}_map", name, tq.dtype, tensor_maps.layout(*view, element, box, name))
                     for view, name, box in ((q_view, "q", plan.block_rows), ((tk.shape, tk.strides), "k", plan.block_kv),
                                             ((tv.shape, tv.strides), "v", plan.block_kv)))
        parts = ((empty_like(tq, (splits, b, heads * rows, d), "float32"), empty_like(tq, (splits, b, heads * rows), "float32"))
                 if splits > 1 else ())
        part_ptrs = tuple(as_device_tensor(x, "parts").ptr for x in parts) or (0, 0)
        values = dict(q=tq.ptr, k=tk.ptr, v=tv.ptr, out=to.ptr, o_sb=o_strides[0], o_sh=o_strides[1],
                      o_sn=o_strides[2], lse=as_device_tensor(lse, "lse").ptr, o_parts=part_ptrs[0],
                      lse_parts=part_ptrs[1], splits=splits, heads=heads, group=group, n_q=rows, n_kv=nk,
                      causal=int(bool(causal)), scale_log2=scale * LOG2E)
        function, merge = _functions(tq.dtype, tq.device)
        stream = torch_stream_handle()(tq.device) if tq.kind == "torch" else None
        Launch(function, (q_tiles * splits, heads, b), plan.threads, plan.smem_bytes, plan.params, values,
               slots=("q", "k", "v", "out", "lse"), maps=maps)(stream)
        if splits > 1:
            merged = dict(o_parts=part_ptrs[0], lse_parts=part_ptrs[1], out=to.ptr, o_sb=o_strides[0],
                          o_sh=o_strides[1], o_sn=o_strides[2], lse=values["lse"], splits=splits, batch=b, heads=heads,
                          n_q=rows)
            Launch(merge, (b * heads * rows, d // plan.merge_columns, 1), plan.merge_threads(splits), 0,
                   plan.merge_params, merged, dependent=True)(stream)
    return (out, lse) if return_lse else out


def _packed_rows(t, group: int, causal: bool):
    """(shape, strides) of [B, Hq, Nq, d] `t` seen as [B, Hkv, group * Nq, d], its heads' rows one
    after the other at one stride, or None where they are not (or causal rows would need their own
    diagonals: Nq > 1)."""
    b, hq, nq, d = t.shape
    sb, sh, sn, sd = t.strides
    if nq == 1:
        row = sh
    elif not causal and sh == nq * sn:
        row = sn
    else:
        return None
    return (b, hq // group, group * nq, d), (sb, group * sh, row, sd)


def default_splits(blocks: int, kv_tiles: int, sms: int) -> int:
    """Splits of each tile's keys: as many as keep a block on every one of `sms` SMs (one fits an
    SM: 193 KB of shared memory) where the `blocks` of tiles and heads do not, at most a KV tile a split."""
    return max(1, min(sms // blocks, kv_tiles))


def backward(dout, q, k, v, out, lse, *, causal: bool = False, scale: float | None = None, deterministic: bool = False):
    """(dq, dk, dv) of sum(out * dout) for attention(q, k, v, causal=causal, scale=scale) at
    head_dim 512, given its out and lse (return_lse=True). dq is summed across key tiles by bulk
    reduce-adds, in no fixed order: deterministic=True is refused."""
    require_cupy()
    if deterministic:
        refuse_deterministic()
    tq, tk, tv = (as_device_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    check(tq, tk, tv)
    scale = _checked_scale(tq, scale, "backward")
    return accumulated_dq.launch(WideBackwardPlan(tq.dtype), render_wide_backward, tq, tk, tv, out, dout, lse,
                                 causal=causal, scale=scale)


def refuse_deterministic() -> None:
    raise ValueError("deterministic: head_dim 512's backward adds dQ atomically across key tiles (no bitwise "
                     "repeatable mode yet); pass deterministic=False (and leave torch.use_deterministic_algorithms "
                     "off), or train at head_dim 256 or less")


def refuse_others(**others) -> None:
    """Every option of fagen.attention's given here (but causal and mask) refused by name: the
    head_dim 512 forward runs none yet. Plain Python, so torch.compile traces it."""
    given = [name for name, x in others.items() if x is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: head_dim 512 runs no score modifier, side input or key range yet "
                         f"(its forward takes causal only); drop them, or use head_dim 256 or less")


def causal_of(causal: bool = False, mask=None, **others) -> bool:
    """fagen.attention's options at head_dim 512 as the kernel's one (causal, bottom right, or no
    mask), every other option given refused by name."""
    refuse_others(**others)
    mask = call_mask(causal, {"kind": mask} if isinstance(mask, str) else mask)
    if mask.kind not in ("none", "causal") or mask.align != "bottom_right":
        raise ValueError(f"mask: kind {mask.kind!r}, align {mask.align!r}; head_dim 512 runs no mask but causal "
                         f"(bottom right) yet: pass causal=True, or no mask")
    return mask.kind == "causal"


def attention_with_options(q, k, v, *, causal: bool = False, mask=None, scale: float | None = None,
                           return_lse: bool = False, **others):
    """fagen.attention's call at head_dim 512 (causal_of's options)."""
    return attention(q, k, v, causal=causal_of(causal, mask, **others), scale=scale, return_lse=return_lse)
