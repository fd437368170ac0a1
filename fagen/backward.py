"""Gradients: a spec's backward kernels (fagen.backward_plan), launched on the forward's inputs
and outputs, on the inputs' framework's current stream.

The caller keeps what the forward saw: q, k, v, out, lse and the same side inputs. Everything
allocated here (D and LSE rows, the gradients) comes from the inputs' framework, so PyTorch
callers stay inside its caching allocator (CUDA graphs capture the whole step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fagen.backward_plan import TMA_TENSORS, BackwardPlan, backward_plan, bias_grad_layout, kernel_symbols
from fagen.device import (DeviceTensor, as_device_tensor, cupy, empty_like, fork_join, multiprocessors, require_cupy,
                          stream_for, zeros_like)
from fagen.render import render_backward
from fagen import tensor_maps
from fagen.runtime import (LOG2E, Kernel, Launch, TensorMap, block_mask_arguments, compile_kernel, compile_module,
                           pack_arguments, packers)
from fagen.spec import AttentionSpec


@dataclass
class Gradients:
    """dq, dk, dv of the inputs' framework and shapes; dsinks [Hq] f32 when the spec has sinks;
    dbias (f32, the bias's shape) when it asks for it (backward.bias_grad)."""

    dq: object
    dk: object
    dv: object
    dsinks: object | None = None
    dbias: object | None = None


class Backward:
    """The compiled backward kernels of a spec with a `backward:` section."""

    def __init__(self, spec: AttentionSpec):
        require_cupy()
        if spec.backward is None:
            raise ValueError(f"{spec.name}: the spec has no backward: section, so it renders no backward kernels; "
                             f"add `backward: {{}}` (the defaults) to train with it")
        self.spec = spec
        self.forward: Kernel = compile_kernel(spec)
        self.plan: BackwardPlan = backward_plan(spec)
        module = compile_module(render_backward(spec), f"{spec.name}_backward", wgmma=spec.wgmma_backward)
        # by role: preprocess, dkdv, then dq, or under atomic dQ the postprocess
        self.kernels = {role: module.get_function(symbol) for role, symbol in kernel_symbols(self.plan).items()}
        for role, smem in (("dkdv", self.plan.dkdv.smem_bytes), ("dq", self.plan.dq_smem_bytes)):
            if role in self.kernels and smem > 48 * 1024:
                self.kernels[role].max_dynamic_shared_size_bytes = smem

    def __repr__(self) -> str:
        return f"Backward({self.spec.name})"

    @cached_property
    def producer_threads(self) -> dict[str, int]:
        """The kernels a TMA producer warpgroup feeds, by role: their block's threads."""
        bp = self.plan
        return {role: threads for role, threads in (
            ("dkdv", bp.dkdv.block_threads if bp.dkdv.warp_specialized else 0),
            ("dq", bp.dq_producer.block_threads if bp.dq_producer else 0)) if threads}

    @cached_property
    def packers(self) -> dict[str, tuple]:
        return {role: packers(getattr(self.plan, f"{role}_params")) for role in self.kernels}

    def __call__(self, dout, q, k, v, out, lse, *, scale: float | None = None, mask_offset: int | None = None,
                 block_mask=None, bias=None, alibi_slopes=None, sinks=None, doc_ids=None,
                 dq=None, dk=None, dv=None) -> Gradients:
        """The gradients of sum(out * dout) by q, k, v (and sinks), for the forward that gave
        out and lse (natural-log LSE [B, Hq, Nq], f32) from the same arguments. dq, dk, dv:
        where to write them (like q, k, v), else fresh arrays."""
        spec, bp = self.spec, self.plan
        tq, tk, tv = self.forward.check(q, k, v)
        b, hq, nq, d = tq.shape
        hkv, nk = tk.shape[1], tk.shape[2]
        tdo, to = (_like(x, name, tq) for x, name in ((dout, "dout"), (out, "out")))
        tl = as_device_tensor(lse, "lse")
        if tl.shape != (b, hq, nq) or tl.dtype != "float32" or tl.strides != (hq * nq, nq, 1):
            raise ValueError(f"lse: {tl.dtype} {tl.shape} strides {tl.strides}; expected the forward's contiguous "
                             f"float32 [{b}, {hq}, {nq}] (return_lse=True)")
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale = {scale}: must be a finite positive number (default 1/sqrt(head_dim))")
        if mask_offset is None:
            mask_offset = nk - nq if spec.mask.align == "bottom_right" else 0
        n_pad = -(-nq // bp.row_pad) * bp.row_pad
        with cupy.cuda.Device(tq.device), stream_for(tq):
            given = dict(block_mask=block_mask, bias=bias, alibi_slopes=alibi_slopes, sinks=sinks, doc_ids=doc_ids)
            extras, keep_alive = self.forward.extra_arguments(tq, tk, given)
            extras.pop("sinks", None)  # the sink's share of each row is in the forward's LSE
            delta, lse2 = (empty_like(tq, (b, hq, n_pad), "float32") for _ in range(2))
            for given, name, t in ((dq, "dq", tq), (dk, "dk", tk), (dv, "dv", tv)):
                if given is not None:
                    _like(given, name, t)  # where the caller asks them written: checked first
            dq, dk, dv = (empty_like(t, t.shape, spec.dtype) if given is None else given
                          for t, given in ((tq, dq), (tk, dk), (tv, dv)))
            # atomic dQ: the dK/dV kernel adds into f32 rows padded as D's, zeroed first (in its own order:
            # backward_plan.dq_accum_index)
            dq_accum = zeros_like(tq, (b, hq, n_pad, d), "float32") if bp.atomic_dq else None
            dbias, dbias_args, summed = self._bias_grad_buffer(bias, tq, b, hkv)
            values = dict(o=to.ptr, dout=tdo.ptr, lse=tl.ptr, delta=_ptr(delta), lse2=_ptr(lse2), n_q=nq, n_kv=nk, batch=b,
                          mask_offset=mask_offset, heads_q=hq, group=hq // hkv, n_pad=n_pad, q=tq.ptr, k=tk.ptr,
                          v=tv.ptr, dq=_ptr(dq), dk=_ptr(dk), dv=_ptr(dv), scale=scale, scale_log2=scale * LOG2E,
                          **({"dq_accum": _ptr(dq_accum)} if bp.atomic_dq else {}), **dbias_args, **extras)
            for name, t in (("q", tq), ("k", tk), ("v", tv), ("o", to), ("dout", tdo), ("dq", as_device_tensor(dq, "dq")),
                            ("dk", as_device_tensor(dk, "dk")), ("dv", as_device_tensor(dv, "dv"))):
                values.update(zip((f"{name}_sb", f"{name}_sh", f"{name}_sn"), t.strides[:3]))
            per_kernel = dict.fromkeys(self.kernels, values)
            if block_mask is not None:  # each loop walks the mask's tiles at its own tiling, dK/dV transposed
                shape = (b, hq, nq, nk)
                per_kernel["dq"] = values | block_mask_arguments(block_mask, bp.dq.block_q, bp.dq.block_kv, *shape)
                per_kernel["dkdv"] = values | block_mask_arguments(block_mask, bp.dkdv.block_q, bp.dkdv.block_kv, *shape,
                                                                   key_major_group=hq // hkv)
            launch = {  # role: grid, threads, dynamic smem
                "preprocess": ((-(-n_pad // bp.preprocess_rows), b * hq), bp.preprocess_threads, 0),
                "dkdv": (self._dkdv_grid(b * hkv * -(-nk // bp.dkdv.block_kv), tq.device) if bp.dkdv.warp_specialized
                         else (-(-nk // bp.dkdv.block_kv), b * hkv), bp.dkdv.threads, bp.dkdv.smem_bytes),
                "dq": ((b * hq, -(-nq // bp.dq.block_q)), bp.dq.threads, bp.dq_smem_bytes),
                "postprocess": ((bp.postprocess_blocks(nq), b * hq), bp.preprocess_threads, 0),
            }
            producers = self.producer_threads
            if producers:  # the producer-fed kernels' tensor maps, by value (row groups, both kernels alike)
                maps = tuple(TensorMap(f"{name}_map", name, spec.dtype, tensor_maps.row_groups(t.shape, t.strides, name))
                             for name, t in zip(TMA_TENSORS, (tq, tk, tv, tdo)))

            def run(role: str) -> None:  # on CuPy's current stream
                grid, threads, smem = launch[role]
                function = self.kernels[role]
                if role in producers:
                    Launch(function, (*grid, 1), producers[role], smem, getattr(bp, f"{role}_params"), per_kernel[role],
                           slots=TMA_TENSORS, maps=maps)(None)
                else:
                    function(grid, (threads,), pack_arguments(self.packers[role], per_kernel[role]), shared_mem=smem)

            run("preprocess")
            if bp.concurrent_dq:
                # The dK/dV and dQ kernels read the same inputs and write different outputs: the
                # dQ kernel's blocks fill the SMs the dK/dV kernel's last wave leaves idle. dK/dV
                # goes to the higher-priority stream, so its blocks are placed first.
                with fork_join(tq.device) as side:
                    with side:
                        run("dkdv")
                    run("dq")
            else:
                for role in [r for r in self.kernels if r != "preprocess"]:  # dkdv, then dq or the postprocess
                    run(role)
            dsinks = None if sinks is None else _sink_gradient(sinks, lse, delta, nq, tq)
            if summed:  # one copy per (batch, KV head), summed in a fixed order
                dbias = dbias.sum(dim=summed, keepdim=True) if tq.kind == "torch" else dbias.sum(summed, keepdims=True)
            del keep_alive
        return Gradients(dq, dk, dv, dsinks, dbias)

    def _dkdv_grid(self, tiles: int, device_id: int) -> tuple[int, int]:
        """The warp-specialised dK/dV kernel walks a 1-D tile grid: a block a tile, or (persistent)
        one block an SM."""
        return (min(tiles, multiprocessors(device_id)) if self.plan.dkdv.persistent else tiles, 1)

    def _bias_grad_buffer(self, bias, ref: DeviceTensor, b: int, hkv: int) -> tuple[object, dict, tuple]:
        """The zeroed f32 buffer the dK/dV kernel adds d loss / d bias into, its arguments, and
        the axes to sum afterwards (none of them without backward.bias_grad)."""
        if not self.plan.dkdv.bias_grad:
            return None, {}, ()
        if bias is None:
            raise ValueError(f"bias = None: kernel {self.spec.name} computes the bias's gradient "
                             f"(backward.bias_grad); pass the bias the forward saw")
        layout = bias_grad_layout(tuple(np.shape(bias)), b, hkv, self.spec.backward.deterministic)
        buffer = zeros_like(ref, layout.buffer_shape, "float32")
        return buffer, {"dbias": _ptr(buffer), **{k: np.int64(v) for k, v in layout.strides.items()}}, layout.summed_axes


def _like(x, name: str, ref: DeviceTensor) -> DeviceTensor:
    """x as a DeviceTensor of ref's framework, dtype, shape and device, with 16-byte rows."""
    t = as_device_tensor(x, name)
    if t.kind != ref.kind or t.dtype != ref.dtype or t.shape != ref.shape or t.device != ref.device:
        raise ValueError(f"{name}: {t.kind} {t.dtype} {t.shape} on cuda:{t.device}; expected a {ref.kind} "
                         f"{ref.dtype} {ref.shape} tensor on cuda:{ref.device}")
    if t.strides[-1] != 1 or any(s % 8 for s in t.strides[:-1]) or t.ptr % 16:
        raise ValueError(f"{name}: strides {t.strides} (elements); the last must be 1 and the others multiples of 8 "
                         f"(16-byte rows): pass {name}.contiguous()")
    return t


def _ptr(a) -> np.uint64:
    return np.uint64(as_device_tensor(a, "buffer").ptr)


def _sink_gradient(sinks, lse, delta, n_q: int, ref: DeviceTensor):
    """d loss / d sink_h = -sum over batch and rows of P_sink * D (P_sink = exp(sink - LSE)), in
    the inputs' framework: a deterministic reduction, no atomics."""
    if ref.kind == "torch":
        import torch

        s = torch.as_tensor(sinks, device=ref.obj.device, dtype=torch.float32)
        return -(torch.exp(s[None, :, None] - lse) * delta[..., :n_q]).sum(dim=(0, 2))
    s = cupy.asarray(sinks, dtype=cupy.float32)
    return -(cupy.exp(s[None, :, None] - lse) * delta[..., :n_q]).sum(axis=(0, 2))


_CACHE: dict[tuple[AttentionSpec, int], Backward] = {}


def compile_backward(spec: AttentionSpec) -> Backward:
    """One Backward per spec and device, per process."""
    require_cupy()
    key = (spec, cupy.cuda.Device().id)
    if key not in _CACHE:
        _CACHE[key] = Backward(spec)
    return _CACHE[key]
