"""The launch of a dedicated backward whose dQ is added across key blocks into a float32
accumulator (head_dim 512's cluster pair, fagen.wide_head; DeepSeek's 192/128 key split,
fagen.key_split): three kernels of one module,
  <name>_preprocess   D = rowsum(dO * O) and the LSE in log2 units per query row, padded to whole
                      tiles (a padded row's LSE +inf), and the accumulator cleared
  <name>              dK, dV and dQ's adds
  <name>_postprocess  dQ = scale * the accumulator, in q's type
Each plan says what differs (`AccumulatedDqPlan`): its query tile, its grid of key blocks, its
TMA boxes and the postprocess's blocks; the checks of the inputs are the caller's."""

from __future__ import annotations

import functools
from typing import Callable, Protocol

from fagen import tensor_maps
from fagen.backward import readable
from fagen.device import DeviceTensor, as_device_tensor, cupy, empty_like, stream_for, torch_stream_handle
from fagen.element_types import ELEMENT_TYPES
from fagen.runtime import LOG2E, Launch, TensorMap, compile_module
from fagen.wide_head_plan import WIDE_POSTPROCESS_PARAMS, WIDE_PREPROCESS_PARAMS

PREPROCESS_ROWS = 4  # query rows a preprocess block: a warp each
POSTPROCESS_THREADS = 128  # a postprocess block: four warps, 16 rows each of a 64-row tile's piece
TMA_TENSORS = (("q", "q_map"), ("k", "k_map"), ("v", "v_map"), ("dout", "do_map"))


class AccumulatedDqPlan(Protocol):
    """What the launch reads of a kernel's plan (frozen: a cache key)."""

    dtype: str
    name: str
    params: tuple[tuple[str, str], ...]
    threads: int
    smem_bytes: int

    @property
    def tile_rows(self) -> int: ...  # query rows of a step and of an accumulator tile

    def grid(self, n_kv: int, heads_kv: int, batch: int) -> tuple[int, int, int]: ...

    def box_rows(self, tensor: str) -> int: ...  # a TMA box's rows of q, k, v or dout

    def postprocess_blocks(self, padded_q: int) -> int: ...  # a batch and head's postprocess blocks


@functools.cache
def _functions(plan: AccumulatedDqPlan, render: Callable[[str], str], device: int) -> tuple:
    """The module's preprocess, kernel and postprocess (its source render(plan.dtype)), compiled
    once a device and process."""
    with cupy.cuda.Device(device):
        module = compile_module(render(plan.dtype), plan.name, wgmma=True)
        kernel = module.get_function(plan.name)
        kernel.max_dynamic_shared_size_bytes = plan.smem_bytes
        return module.get_function(f"{plan.name}_preprocess"), kernel, module.get_function(f"{plan.name}_postprocess")


def launch(plan: AccumulatedDqPlan, render: Callable[[str], str], tq: DeviceTensor, tk: DeviceTensor,
           tv: DeviceTensor, out, dout, lse, *, causal: bool, scale: float):
    """(dq, dk, dv) for checked q, k, v ([B, H, N, d]; v of its own width), the forward's out and
    lse (float32 [B, Hq, Nq]) and dout; out and dout copied only where the kernels cannot read
    them by their strides. `render`: the module's source for a dtype."""
    b, hq, nq, d = tq.shape
    hkv, nk = tk.shape[1], tk.shape[2]
    tl = as_device_tensor(lse, "lse")
    if tl.shape != (b, hq, nq) or tl.dtype != "float32" or tl.kind != tq.kind or tl.device != tq.device:
        raise ValueError(f"lse: {tl.kind} {tl.dtype} {tl.shape}; expected the forward's float32 [B, Hq, Nq] = "
                         f"{(b, hq, nq)} on q's device (return_lse=True)")
    preprocess, kernel, postprocess = _functions(plan, render, tq.device)
    with cupy.cuda.Device(tq.device), stream_for(tq):
        dq, dk, dv = (empty_like(t, t.shape, tq.dtype) for t in (tq, tk, tv))
        if 0 in (b, hq, nq, nk):  # nothing attended: out was constant
            for g in (dq, dk, dv):
                g[...] = 0
            return dq, dk, dv
        to, tdo = (forward_rows(x, what, (b, hq, nq, tv.shape[-1]), tq.dtype, tq)
                   for x, what in ((out, "out"), (dout, "dout")))
        if tl.strides != (hq * nq, nq, 1):
            tl = as_device_tensor(tl.obj.contiguous() if tl.kind == "torch" else cupy.ascontiguousarray(tl.obj), "lse")
        padded_q = -(-nq // plan.tile_rows) * plan.tile_rows
        rows = empty_like(tq, (b, hq, 2, padded_q), "float32")
        dq_accum = empty_like(tq, (b, hq, padded_q, d), "float32")
        tr, ta = as_device_tensor(rows, "rows"), as_device_tensor(dq_accum, "dq_accum")
        tdq, tdk, tdv = (as_device_tensor(g, n) for g, n in ((dq, "dq"), (dk, "dk"), (dv, "dv")))
        stream = torch_stream_handle()(tq.device) if tq.kind == "torch" else None
        Launch(preprocess, (-(-padded_q // PREPROCESS_ROWS), hq, b), 32 * PREPROCESS_ROWS, 0, WIDE_PREPROCESS_PARAMS,
               dict(out=to.ptr, o_sb=to.strides[0], o_sh=to.strides[1], o_sn=to.strides[2], dout=tdo.ptr,
                    do_sb=tdo.strides[0], do_sh=tdo.strides[1], do_sn=tdo.strides[2], lse=tl.ptr, rows=tr.ptr,
                    dq_accum=ta.ptr, heads=hq, n_q=nq, padded_q=padded_q))(stream)
        # TMA maps, each box the plan's rows of 64 columns (refusing strides TMA cannot take)
        element = ELEMENT_TYPES[tq.dtype].bytes
        tensors = {"q": tq, "k": tk, "v": tv, "dout": tdo}
        maps = tuple(TensorMap(param, name, tq.dtype, tensor_maps.layout(tensors[name].shape, tensors[name].strides,
                                                                         element, plan.box_rows(name), name))
                     for name, param in TMA_TENSORS)
        values = dict(q=tq.ptr, k=tk.ptr, v=tv.ptr, dout=tdo.ptr, rows=tr.ptr, dq_accum=ta.ptr,
                      dk=tdk.ptr, dk_sb=tdk.strides[0], dk_sh=tdk.strides[1], dk_sn=tdk.strides[2],
                      dv=tdv.ptr, dv_sb=tdv.strides[0], dv_sh=tdv.strides[1], dv_sn=tdv.strides[2],
                      heads=hq, group=hq // hkv, n_q=nq, n_kv=nk, padded_q=padded_q, causal=int(bool(causal)),
                      scale_log2=scale * LOG2E, scale=scale)
        Launch(kernel, plan.grid(nk, hkv, b), plan.threads, plan.smem_bytes, plan.params, values,
               slots=tuple(name for name, _ in TMA_TENSORS), maps=maps)(stream)
        Launch(postprocess, (plan.postprocess_blocks(padded_q), hq, b), POSTPROCESS_THREADS, 0, WIDE_POSTPROCESS_PARAMS,
               dict(dq_accum=ta.ptr, dq=tdq.ptr, dq_sb=tdq.strides[0], dq_sh=tdq.strides[1], dq_sn=tdq.strides[2],
                    heads=hq, n_q=nq, padded_q=padded_q, scale=scale))(stream)
    return dq, dk, dv


def forward_rows(x, what: str, shape: tuple[int, ...], dtype: str, tq: DeviceTensor) -> DeviceTensor:
    """out or dout as the kernels read it: `shape` (v's width), `dtype`, q's framework and device."""
    t = as_device_tensor(x, what)
    if t.shape != shape or t.dtype != dtype or t.kind != tq.kind or t.device != tq.device:
        raise ValueError(f"{what}: {t.kind} {t.dtype} {t.shape} on cuda:{t.device}; expected a {tq.kind} {dtype} "
                         f"{shape} on cuda:{tq.device}")
    return as_device_tensor(readable(x, what), what)
