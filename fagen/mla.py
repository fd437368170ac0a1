"""MLA decode: DeepSeek's multi-head latent attention in its absorbed form, on sm_90a.

Every query head attends to one latent KV head of 576 columns a key (512 latent + 64 rotary),
and V is the first 512 columns of the same row: q [B, Hq, Nq, 576] against a paged latent cache
[num_pages, 64, 1, 576] (FlashMLA's layout: page_size 64, a page table [B, max_pages] and
cache_seqlens [B]). One kernel (templates/sm90/mla_decode.cu.j2) reads each page once for
64 packed query rows (heads x Nq) and splits O's 512 columns across two warpgroups; split-KV
fills the GPU where the batch does not, its partials merged by the module's merge kernel.

    out = fagen.mla_decode(q, kv_cache, page_table, cache_seqlens)            # a call
    step = fagen.prepare_mla_decode(q, kv_cache, page_table, cache_seqlens)   # a decode loop
    out = step(q, kv_cache, page_table, cache_seqlens)

Nq 2 (speculative decoding) is causal within the pair where causal=True: query n of Nq sees the
keys up to cache_seqlens[b] - Nq + n, bottom-right aligned as FlashAttention aligns it.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from fagen import hot_path, side_inputs, tensor_maps
from fagen.device import (as_device_tensor, cupy, empty_like, laid_out_as, multiprocessors, require_cupy,
                          stream_for, tensor_signature, torch_stream_handle)
from fagen.element_types import ELEMENT_TYPES
from fagen.mla_plan import HEAD_DIM, HEAD_DIM_V, MLA_TYPES, PAGE_SIZE, MlaPlan
from fagen.rendering import render_mla
from fagen.runtime import LOG2E, Launch, TensorMap, compile_module

QUERY_TOKENS = (1, 2)  # Nq: a decode step, or one with a speculative token


@functools.cache
def _functions(dtype: str, device: int):
    """The module's attention kernel and its merge, compiled once a device and process."""
    with cupy.cuda.Device(device):
        plan = MlaPlan(dtype)
        module = compile_module(render_mla(dtype), plan.name, wgmma=True)
        attention, merge = module.get_function(plan.name), module.get_function(plan.merge_name)
        attention.max_dynamic_shared_size_bytes = plan.smem_bytes
        return attention, merge


def _check(tq, tc, tp, ts) -> None:
    """The call's tensors against the layouts the kernel reads, each refusal naming its fix."""
    if len(tq.shape) != 4 or tq.shape[-1] != HEAD_DIM:
        raise ValueError(f"q: shape {tq.shape}; MLA decode takes q [B, Hq, Nq, {HEAD_DIM}] (512 latent + 64 rotary "
                         f"columns a head, W_UK absorbed)")
    b, hq, nq, _ = tq.shape
    if tq.dtype not in MLA_TYPES:
        raise ValueError(f"q: dtype {tq.dtype}; MLA decode reads float16 or bfloat16: cast q and kv_cache to one")
    if nq not in QUERY_TOKENS:
        raise ValueError(f"q: Nq = {nq} query tokens a sequence; MLA decode takes {QUERY_TOKENS} (a decode step, or "
                         f"one with a speculative token): run longer chunks through fagen.attention")
    if b < 1 or hq < 1:
        raise ValueError(f"q: shape {tq.shape}; B and Hq must be >= 1")
    if len(tc.shape) != 4 or tc.shape[1:] != (PAGE_SIZE, 1, HEAD_DIM):
        raise ValueError(f"kv_cache: shape {tc.shape}; expected [num_pages, {PAGE_SIZE}, 1, {HEAD_DIM}] (one latent "
                         f"head, page_size {PAGE_SIZE} as FlashMLA's); allocate the cache with pages of {PAGE_SIZE} keys")
    if tc.dtype != tq.dtype:
        raise ValueError(f"kv_cache: dtype {tc.dtype}, but q is {tq.dtype}; cast it to {tq.dtype}")
    for t, n in ((tc, "kv_cache"), (tp, "page_table"), (ts, "cache_seqlens")):
        if t.kind != tq.kind:
            raise ValueError(f"{n} is a {t.kind} tensor but q is {tq.kind}: pass all from one framework")
        if t.device != tq.device:
            raise ValueError(f"{n} is on cuda:{t.device} but q on cuda:{tq.device}: put them on one GPU")
    if tq.strides[-1] != 1 or any(s % 8 for s in tq.strides[:3]) or tq.ptr % 16:
        raise ValueError(f"q: strides {tq.strides}; the kernel reads 16-byte pieces of each row: pass a contiguous "
                         f"q (q.contiguous())")
    if tp.dtype != "int32" or len(tp.shape) != 2 or tp.shape[0] != b or tp.shape[1] < 1 or tp.strides[1] != 1:
        raise ValueError(f"page_table: {tp.dtype} {tp.shape}, strides {tp.strides}; expected int32 [B, max_pages] = "
                         f"[{b}, >= 1] with unit stride along the pages (page_table.to(torch.int32).contiguous())")
    if ts.dtype != "int32" or ts.shape != (b,) or ts.strides != (1,):
        raise ValueError(f"cache_seqlens: {ts.dtype} {ts.shape}; expected contiguous int32 [B] = [{b}] (each "
                         f"sequence's keys)")


def default_splits(batch: int, row_tiles: int, max_pages: int, device: int) -> int:
    """Splits of each sequence's pages: as many as keep a block on every SM (one fits an SM: 225
    KB of shared memory), whole waves only, at most a page a split."""
    return max(1, min(multiprocessors(device) // (batch * row_tiles), max_pages))


class PreparedMlaDecode:
    """mla_decode packed once for a decode loop: `step(q, kv_cache, page_table, cache_seqlens,
    out=None)` takes tensors of the prepared shapes, strides and dtypes (the engine rewrites the
    page table and lengths in place between steps) and launches with no checks and no host sync.
    The page table's values are checked here, once (validate=True); a call trusts them: the
    kernel's TMA loads zeros for a page id outside the cache, and a length past the table row
    is cut to it, so that bad values never read or write out of bounds. The split partials are
    this object's workspace: one step at a time (not on two streams at once), and keep it alive
    as long as a CUDA graph that captured it may replay."""

    def __init__(self, q, kv_cache, page_table, cache_seqlens, *, causal: bool = False, scale: float | None = None,
                 splits: int | None = None, validate: bool = True):
        require_cupy()
        tq, tc = as_device_tensor(q, "q"), as_device_tensor(kv_cache, "kv_cache")
        tp, ts = as_device_tensor(page_table, "page_table"), as_device_tensor(cache_seqlens, "cache_seqlens")
        _check(tq, tc, tp, ts)
        arch = cupy.cuda.Device(tq.device).compute_capability
        if arch != "90":
            raise ValueError(f"q: MLA decode on sm_{arch}; its kernel is built for sm_90a (Hopper's wgmma) only: run it "
                             f"on an H100 or H200")
        b, hq, nq, _ = tq.shape
        self.shape, self.dtype, self.device = tq.shape, tq.dtype, tq.device
        if validate:
            with cupy.cuda.Device(tq.device), stream_for(tq):
                table, lengths = (cupy.asnumpy(cupy.asarray(x)) for x in (page_table, cache_seqlens))
            side_inputs.check_pages(table, lengths, tc.shape[0], PAGE_SIZE)
        if scale is not None and not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale = {scale}: must be a positive finite number (default 1 / sqrt({HEAD_DIM}))")
        scale = 1.0 / math.sqrt(HEAD_DIM) if scale is None else float(scale)
        rows = hq * nq
        row_tiles = -(-rows // MlaPlan(tq.dtype).block_rows)
        max_pages = tp.shape[1]
        if splits is None:
            splits = default_splits(b, row_tiles, max_pages, tq.device)
        if not (isinstance(splits, (int, np.integer)) and 1 <= splits <= max_pages):
            raise ValueError(f"splits = {splits}: must be an integer in 1..{max_pages} (page_table's pages a "
                             f"sequence); leave it None for what fills the GPU")
        self.splits = int(splits)
        plan = MlaPlan(tq.dtype)
        with cupy.cuda.Device(tq.device), stream_for(tq):
            self.out = empty_like(tq, (b, hq, nq, HEAD_DIM_V), tq.dtype)
            self.lse = empty_like(tq, (b, hq, nq), "float32")
            if self.splits > 1:
                self._o_parts = empty_like(tq, (self.splits, b, hq, nq, HEAD_DIM_V), "float32")
                self._lse_parts = empty_like(tq, (self.splits, b, hq, nq), "float32")
        to = as_device_tensor(self.out, "out")
        parts = ((as_device_tensor(self._o_parts, "o_parts").ptr, as_device_tensor(self._lse_parts, "lse_parts").ptr)
                 if self.splits > 1 else (0, 0))
        cache_map = tensor_maps.paged_latent(tc.shape, tc.strides, ELEMENT_TYPES[tc.dtype].bytes, plan.page_size)
        values = dict(kv_cache=tc.ptr, q=tq.ptr, q_sb=tq.strides[0], q_sh=tq.strides[1], q_sn=tq.strides[2],
                      page_table=tp.ptr, page_table_stride=tp.strides[0], max_pages=max_pages, cache_seqlens=ts.ptr,
                      out=to.ptr, o_sb=to.strides[0], o_sh=to.strides[1], o_sn=to.strides[2],
                      lse=as_device_tensor(self.lse, "lse").ptr, o_parts=parts[0], lse_parts=parts[1], batch=b,
                      heads=hq, n_q=nq, causal=int(bool(causal) and nq > 1), scale_log2=scale * LOG2E)
        with cupy.cuda.Device(tq.device):
            attention, merge = _functions(tq.dtype, tq.device)
            self._launch = Launch(attention, (self.splits, row_tiles, b), plan.threads,
                                  plan.smem_bytes, plan.params, values,
                                  slots=("q", "kv_cache", "page_table", "cache_seqlens", "out", "lse"),
                                  maps=(TensorMap("kv_map", "kv_cache", tc.dtype, cache_map),))
            self._merge = None
            if self.splits > 1:
                merged = dict(o_parts=parts[0], lse_parts=parts[1], out=to.ptr, o_sb=to.strides[0], o_sh=to.strides[1],
                              o_sn=to.strides[2], lse=values["lse"], splits=self.splits, batch=b, heads=hq, n_q=nq)
                self._merge = Launch(merge, (b * rows, HEAD_DIM_V // plan.merge_columns, 1), plan.merge_threads(self.splits), 0,
                                     plan.merge_params, merged, slots=("out", "lse"), dependent=True)
        self._signatures = tuple(tensor_signature(x) for x in (q, kv_cache, page_table, cache_seqlens))
        self._out_signature = tensor_signature(self.out)
        self._torch = tq.kind == "torch"
        self._hot = self._hot_path((q, kv_cache, page_table, cache_seqlens)) if self._torch else None

    def _hot_path(self, inputs: tuple):
        """The C path of a torch step (fagen.hot_path: its checks and launches, the cache's map
        re-encoded where another cache comes), or None where it could not be built. A step
        captured in a graph is the caller's to keep alive, as always: no hook keeps it."""
        module = hot_path.module()
        if module is None:
            return None
        import torch

        launches = ((self._launch, tuple(range(6))),) + (((self._merge, (4, 5)),) if self._merge else ())
        workspace = (self.lse, getattr(self, "_o_parts", None), getattr(self, "_lse_parts", None))
        return module.HotPath(tuple(x for t in inputs for x in (t.shape, t.stride())),
                              (*(t.dtype for t in inputs), self.out.dtype), self.device, torch.Size(self.out.shape),
                              self.out.stride(), torch_stream_handle(), cupy.cuda.runtime.getDevice,
                              # (empty_like of the prepared out: 2 us of host time where q.new_empty took 4)
                              lambda q, like=self.out: torch.empty_like(like), lambda: None,
                              as_device_tensor(self.lse, "lse").ptr,
                              *hot_path.driver_functions(), tensor_maps.ENCODE_FLAGS,
                              tuple(hot_path.launch_entry(launch, at, 6, (launch, workspace)) for launch, at in launches))

    def __call__(self, q, kv_cache, page_table, cache_seqlens, *, out=None, return_lse: bool = False):
        """out [B, Hq, Nq, 512] (and lse [B, Hq, Nq], natural log) of this step, allocated on the
        stream; `out` given (same shape, strides and dtype as the prepared one), the step writes
        there and returns it. A call compares the tensors' signatures and launches: no checks of
        values, no host sync."""
        if self._hot is not None and not return_lse:
            done = self._hot.run(q, kv_cache, page_table, cache_seqlens, out)  # NotImplemented: checked below
            if done is not NotImplemented:
                return done
        tensors = (q, kv_cache, page_table, cache_seqlens)
        if not all(map(laid_out_as, tensors, self._signatures)):
            for x, name, want in zip(tensors, ("q", "kv_cache", "page_table", "cache_seqlens"), self._signatures):
                if not laid_out_as(x, want):
                    t = as_device_tensor(x, name)
                    raise ValueError(f"{name}: {t.dtype} {t.shape}, strides {t.strides} on cuda:{t.device}; this step "
                                     f"was prepared for {want}: prepare another for it")
        if out is not None and not laid_out_as(out, self._out_signature):
            t = as_device_tensor(out, "out")
            raise ValueError(f"out: {t.dtype} {t.shape}, strides {t.strides}; expected {self._out_signature} (the "
                             f"prepared out's)")
        with cupy.cuda.Device(self.device):
            if self._torch:  # (new_empty: the tensor's own framework, device and the current stream)
                target = self.out.new_empty(self.out.shape) if out is None else out
                lse = self.lse.new_empty(self.lse.shape) if return_lse else self.lse  # else a scratch LSE
                addresses = [x.data_ptr() for x in (*tensors, target, lse)]
                stream = torch_stream_handle()(self.device)
            else:
                target = cupy.empty_like(self.out) if out is None else out
                lse = cupy.empty_like(self.lse) if return_lse else self.lse
                addresses = [x.data.ptr for x in (*tensors, target, lse)]
                stream = cupy.cuda.get_current_stream().ptr
            misaligned = [name for name, at in (("q", addresses[0]), ("out", addresses[4])) if at % 16]
            if misaligned:  # (the C path hands these back: refused here by name, never launched)
                raise ValueError(f"{', '.join(misaligned)}: address not a multiple of 16 bytes (a view starting inside "
                                 f"a row), though laid out as prepared; the kernels copy whole 16-byte pieces: pass a "
                                 f"contiguous copy")
            self._launch(stream, *addresses)
            if self._merge is not None:
                self._merge(stream, addresses[4], addresses[5])
        return (target, lse) if return_lse else target


def prepare_mla_decode(q, kv_cache, page_table, cache_seqlens, **kwargs) -> PreparedMlaDecode:
    """A decode loop's MLA step, packed once (PreparedMlaDecode)."""
    return PreparedMlaDecode(q, kv_cache, page_table, cache_seqlens, **kwargs)


def mla_decode(q, kv_cache, page_table, cache_seqlens, *, causal: bool = False, scale: float | None = None,
               splits: int | None = None, return_lse: bool = False, validate: bool = True):
    """Absorbed MLA decode: q [B, Hq, Nq, 576] (Nq 1 or 2) against a paged latent cache
    kv_cache [num_pages, 64, 1, 576] whose first 512 columns are V; page_table int32 [B,
    max_pages], cache_seqlens int32 [B]. Returns out [B, Hq, Nq, 512] like q's dtype (and lse
    [B, Hq, Nq] float32). scale defaults to 1 / sqrt(576), as FlashMLA's."""
    step = PreparedMlaDecode(q, kv_cache, page_table, cache_seqlens, causal=causal, scale=scale, splits=splits,
                             validate=validate)
    out, lse = step(q, kv_cache, page_table, cache_seqlens, return_lse=True)
    return (out, lse) if return_lse else out


__all__ = ["HEAD_DIM", "HEAD_DIM_V", "PAGE_SIZE", "MlaPlan", "PreparedMlaDecode", "mla_decode", "prepare_mla_decode",
           "render_mla"]
