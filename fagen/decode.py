"""Decode: a few query rows against a long KV cache, at the speed of reading K and V.

Three things make it memory-bound rather than launch-bound (fagen.variants.decode_spec):
- GQA packing: the query heads of a KV group share a tile's rows, so a block reads its keys
  once for the group, not once per query head;
- split-KV: the keys are split across enough blocks to fill the GPU (flash-decoding), each
  writing a float32 partial O and its LSE;
- the merge: the last split of each tile to finish reads the tile's partials back and merges them
  by LSE (sinks join there) in the same launch (outputs.merge_splits); where the blocks fill the
  GPU unsplit, the kernel writes out and the LSE itself (variants.unsplit_variant). Either way a
  decode step is one launch.
`fagen.attention` takes this path by itself when Nq x group fits a decode kernel.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Callable

import numpy as np

from fagen import fp8_inputs, hot_path, side_inputs, tensor_maps, wide_head
from fagen.device import (as_device_tensor, cupy, empty_laid_out_as, empty_like, empty_permuted, full_like,
                          laid_out_as, layout_order, stream_for, tensor_signature, torch_stream_handle)
from fagen.dispatch import (derive_spec, fp8_kv_refusal, fp8_on_cache_kernels, no_work, packed_spec, sequence_keys,
                            step_spec)
from fagen.element_types import fp8_element
from fagen.runtime import _aux_array, compile_kernel
from fagen.spec import AttentionSpec
from fagen.splitkv import merge
from fagen.variants import sequence_variant
from fagen.wide_head_plan import WIDE_HEAD_DIMS


def answer_without_work(plain: AttentionSpec, q, k, v, *, return_lse: bool = False, sinks=None, **side):
    """out (and lse) of a call with no work (no_work), launching nothing: without query rows (B,
    Hq or Nq 0) both are empty; rows without keys (Nk 0) see no key, so O = 0 and LSE = -inf, or
    the head's sink (a row with no visible key, as everywhere). The inputs are checked as a
    kernel checks them (Kernel.check), but for their sizes; side inputs by the oracle's rules."""
    tq, tk, tv = (as_device_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    (b, hq, nq, d), (bk, hkv, nk, _) = tq.shape, tk.shape
    for t, n in ((tk, "k"), (tv, "v")):
        if t.kind != tq.kind:
            raise ValueError(f"{n} is a {t.kind} tensor but q is {tq.kind}: pass all three from one framework")
        if t.dtype != tq.dtype and not (fp8_element(t.dtype) is not None and tk.dtype == tv.dtype):  # (an FP8 cache)
            raise ValueError(f"{n}: dtype {t.dtype}, but q is {tq.dtype}; cast it to {tq.dtype}")
        if t.device != tq.device:
            raise ValueError(f"{n} is on cuda:{t.device} but q on cuda:{tq.device}: put them on one GPU")
        if len(t.shape) != 4 or n == "k" and t.shape[-1] != d:
            raise ValueError(f"{n}: shape {t.shape}; expected [B, Hkv, Nk, {d if n == 'k' else 'head_dim_v'}]"
                             + (" (q's head_dim)" if n == "k" else ""))
    if tk.shape[:3] != tv.shape[:3]:
        raise ValueError(f"k {tk.shape} and v {tv.shape} must have the same [B, Hkv, Nk]")
    if bk != b:
        raise ValueError(f"batch mismatch: q has B = {b}, k and v have B = {bk}")
    if hkv == 0 and hq or hkv and hq % hkv:
        raise ValueError(f"q has Hq = {hq} heads, k and v Hkv = {hkv}: Hq must be a multiple of Hkv (GQA/MQA)")
    given = {name: tuple(np.shape(x)) for name, x in (("sinks", sinks), *side.items())
             if x is not None and name in ("sinks", "alibi_slopes", "doc_ids", "bias")}
    side_inputs.check_shapes(b, hq, nq, nk, bias_kind=None if plain.score_mod.bias == "none" else plain.score_mod.bias,
                             **given)
    with cupy.cuda.Device(tq.device), stream_for(tq):
        out = empty_laid_out_as(tq, (b, hq, nq, tv.shape[-1]), plain.out_element.name)
        out[...] = 0
        lse = full_like(tq, (b, hq, nq), -math.inf, "float32")
        if sinks is not None and b * hq * nq:  # rows that see only their sink
            cupy.asarray(lse)[...] = _aux_array(sinks, "sinks", "float32", tq.device)[None, :, None]
    return (out, lse) if return_lse else out


def forward(plain: AttentionSpec, q, k, v, *, scale: float | None = None, return_lse: bool = False,
            cache_seqlens=None, cache_leftpad=None, q_descale=None, k_descale=None, v_descale=None, **side):
    """out (and lse) of fagen.attention's call whose spec is `plain` (derive_spec's): nothing
    launched where there is no work (answer_without_work), the decode kernel where one takes the
    call (packed_spec), else the plain forward; key ranges (cache_seqlens, cache_leftpad) through
    a PreparedAttention of them. `side`: block_mask, bias, alibi_slopes, sinks, doc_ids."""
    if len(getattr(q, "shape", ())) == 4 and len(getattr(k, "shape", ())) == 4 and no_work(q.shape, k.shape):
        return answer_without_work(plain, q, k, v, return_lse=return_lse, **side)
    fp8_kv = fp8_element(as_device_tensor(k, "k").dtype) is not None and not plain.element.is_fp8
    if cache_seqlens is not None or cache_leftpad is not None:
        taken = {name: value for name, value in side.items() if value is not None and name not in ("alibi_slopes", "sinks")}
        if taken:
            raise ValueError(f"{', '.join(taken)} with key ranges (cache_seqlens): a side input indexed by padded "
                             f"positions has no view of each sequence's range; pass a padding bias without the ranges")
        prepared = PreparedAttention(q, k, v, plain=plain, scale=scale, alibi_slopes=side.get("alibi_slopes"),
                                     sinks=side.get("sinks"), cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
                                     q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        return prepared.once(q, k, v, *prepared.ranges, return_lse=return_lse)
    spec = packed_spec(plain, q, k)
    if spec is None:
        if fp8_kv:
            tq, tk = as_device_tensor(q, "q"), as_device_tensor(k, "k")
            raise ValueError(fp8_kv_refusal("k, v", tk.dtype, plain, tq.shape[2] * (tq.shape[1] // max(tk.shape[1], 1))))
        descales = {name: x for name, x in zip(fp8_inputs.DESCALE_NAMES, (q_descale, k_descale, v_descale))
                    if x is not None}  # (the plain kernel refuses them by name: they are FP8 inputs')
        return compile_kernel(plain)(q, k, v, scale=scale, return_lse=return_lse, **side, **descales)
    return run(spec, q, k, v, scale=scale, return_lse=return_lse, alibi_slopes=side.get("alibi_slopes"),
               sinks=side.get("sinks"), q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def run(spec: AttentionSpec, q, k, v, *, scale: float | None = None, splits: int | None = None,
        return_lse: bool = False, alibi_slopes=None, sinks=None, q_descale=None, k_descale=None, v_descale=None):
    """out (and lse) through the decode kernel `spec` (a GQA-packed partial spec): one launch, or
    two where the merge kernel combines the partials (step_spec)."""
    tq, tk = as_device_tensor(q, "q"), as_device_tensor(k, "k")
    b, hq, nq, _ = tq.shape
    step, splits = step_spec(spec, b, hq, tk.shape[1], nq, tk.shape[2], splits, sinks is not None)
    kernel = compile_kernel(step)
    # an FP8 KV cache's (FlashAttention-3's; q's for an FP8 q); other kernels refuse descales
    descales = {} if q_descale is None and k_descale is None and v_descale is None else {
        "q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if step.outputs.partial and not step.outputs.merge_splits:  # the merge kernel's launch after it
        o_parts, lse_parts = kernel(q, k, v, scale=scale, splits=splits, alibi_slopes=alibi_slopes,
                                    **descales)
        out = empty_laid_out_as(tq, (b, hq, nq, as_device_tensor(v, "v").shape[-1]), step.out_element.name)
        out, lse = merge(o_parts, lse_parts, sinks=sinks, out=out)
        return (out, lse) if return_lse else out
    return kernel(q, k, v, scale=scale, return_lse=return_lse, alibi_slopes=alibi_slopes, sinks=sinks,
                  splits=None if splits == 1 else splits, **descales)


def attention(q, k, v, *, causal: bool = False, mask=None, softcap: float | None = None, scale: float | None = None,
              return_lse: bool = False, block_mask=None, bias=None, alibi_slopes=None, sinks=None, doc_ids=None,
              cache_seqlens=None, cache_leftpad=None, q_descale=None, k_descale=None, v_descale=None):
    """fagen.attention for CuPy arrays (and PyTorch tensors outside autograd): the decode path
    where a decode kernel takes the arguments, else the plain forward of the derived spec
    (fagen.dispatch chooses which). cache_seqlens, cache_leftpad (int32 [B] on the GPU): sequence
    b's keys are rows cache_leftpad[b] .. cache_seqlens[b] of k and v (KeyRanges). k and v in an
    FP8 type against a half-type q: an FP8 KV cache, read by the decode kernels, with
    FlashAttention-3's k_descale and v_descale (float32, one number or [B, Hkv]; None is 1), and
    q_descale where q is FP8 too (a decode step's, which those kernels widen as it lands)."""
    side = dict(block_mask=block_mask, bias=bias, alibi_slopes=alibi_slopes, sinks=sinks, doc_ids=doc_ids)
    shape = getattr(q, "shape", ())
    if len(shape) and shape[-1] in WIDE_HEAD_DIMS:  # head_dim 512: its own kernel
        return wide_head.attention_with_options(q, k, v, causal=causal, mask=mask, scale=scale, return_lse=return_lse,
                                                softcap=softcap, cache_seqlens=cache_seqlens,
                                                cache_leftpad=cache_leftpad, q_descale=q_descale,
                                                k_descale=k_descale, v_descale=v_descale, **side)
    plain = derive_spec(q, causal=causal, mask=mask, softcap=softcap, keys=sequence_keys(k), v=v,
                        ranged=cache_seqlens is not None or cache_leftpad is not None, **side)
    return forward(plain, q, k, v, scale=scale, return_lse=return_lse, cache_seqlens=cache_seqlens,
                   cache_leftpad=cache_leftpad, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                   **side)


# Prepared calls captured in a CUDA graph. The graph holds their kernel arguments, which point at
# the workspace (partials, arrival counts, the LSE nobody asked for) each object owns; freed with
# the object while the graph lives, that memory goes to other tensors and the replays corrupt them
# (or, reused by another call's counts, skip the merge: out is never written). A graph gives no
# hook at its destruction, so they stay: a process captures a few, at start-up.
CAPTURED: list[PreparedAttention] = []


class PreparedAttention:
    """fagen.attention packed once for repeated shapes (a decode loop): the kernel chosen,
    compiled and its arguments packed at prepare time; a call checks that its tensors have the
    prepared shapes, strides, dtype and device, points the launch at them and launches (the
    decode path: a split kernel that merges its partials itself, through a workspace of partials
    and arrival counts owned here; many-row tiles: the merge kernel after it). Calls go to the
    caller's current stream (PyTorch's for torch tensors; their checks and launches run in C,
    fagen.hot_path, where this host could build it: 5.5 against 7.7 us a decode step on an H200
    host) and, for the same reason as any workspace, must not run concurrently on two streams.
    A call captured in a CUDA graph keeps this object alive for the rest of the process
    (CAPTURED): the graph's replays write its workspace, which must not go back to the
    allocator while a graph may still replay. sequences.PreparedKVCache is the paged form. An FP8
    cache's k_descale and v_descale (and q_descale, for an FP8 q) are read at prepare time
    (a copy: prepare again for others); those `moving_descales` names (fagen's kept calls: float32
    tensors on q's GPU) are read where they lie instead, and a call passes its own after the index
    tensors. `split_keys`: the key count the split count is chosen and evened for (a growing class's
    least, so that its splits are the class's, whichever length made it), k's own where None."""

    def __init__(self, q, k, v, *, causal: bool = False, mask=None, softcap: float | None = None,
                 scale: float | None = None, alibi_slopes=None, sinks=None, splits: int | None = None,
                 cache_seqlens=None, cache_leftpad=None, plain: AttentionSpec | None = None, q_descale=None,
                 k_descale=None, v_descale=None, moving_descales: tuple[str, ...] = (), split_keys: int | None = None):
        tq, tk, tv = (as_device_tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        if plain is None:  # else the caller derived it from the same options
            plain = derive_spec(q, causal=causal, mask=mask, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                keys=sequence_keys(k), v=v,
                                ranged=cache_seqlens is not None or cache_leftpad is not None)
        spec = packed_spec(plain, q, k)
        b, hq, nq, d = tq.shape
        hkv, nk = tk.shape[1], tk.shape[2]
        refuse_without_work(tq.shape, tk.shape)
        # key ranges: sequence b's keys are rows cache_leftpad[b] .. cache_seqlens[b] of its own
        # (sequences.kv ranged), read on the device; the index tensors a call passes after q, k, v
        ranges = KeyRanges(tq, cache_seqlens, cache_leftpad) if cache_seqlens is not None or cache_leftpad is not None \
            else None
        if spec is not None:
            spec, splits = step_spec(spec if ranges is None else ranges.variant(spec), b, hq, hkv, nq,
                                     split_keys or nk, splits, sinks is not None)
        else:  # no decode kernel packs the call: the plain forward's (an FP8 cache has no other)
            if fp8_element(tk.dtype) is not None and not plain.element.is_fp8:
                raise ValueError(fp8_kv_refusal("k, v", tk.dtype, plain, nq * (hq // max(hkv, 1))))
            spec = plain if ranges is None else ranges.variant(plain)
        kernel = compile_kernel(spec)
        out = empty_laid_out_as(tq, (b, hq, nq, tv.shape[-1]), spec.out_element.name)  # the outputs' strides, for packing (O as wide as V)
        # the LSE goes here unless the caller asks for it (return_lse): one allocation less a call
        lse = empty_like(tq, (b, hq, nq), "float32")
        with cupy.cuda.Device(tq.device), stream_for(tq):
            extras, held = kernel.extra_arguments(tq, tk, {
                "alibi_slopes": alibi_slopes, "sinks": sinks if kernel.takes_sinks else None,
                "block_mask": None, "bias": None, "doc_ids": None})
            kernel.check(q, k, v, out)
            descales, moved = fp8_inputs.prepared((q_descale, k_descale, v_descale), moving_descales)
            descaled = kernel.descale_arguments(tq, tk, **descales, moving=moving_descales)  # (an FP8 cache's)
            if descaled is not None:
                extras.update(descaled[0])
                held = [*held, descaled[1]]
            # ranges: each sequence's diagonal is the kernel's own (plan.sequence_offset)
            offset = nk - nq if spec.mask.align == "bottom_right" and ranges is None else 0
            if ranges is not None:
                extras.update(ranges.arguments)
                held = [*held, *ranges.held]
            packed = kernel.pack(tq, tk, tv, out, lse, as_device_tensor(out, "out"), as_device_tensor(lse, "lse"),
                                 scale=side_inputs.check_scale(scale, tq.shape[-1]), mask_offset=offset,
                                 splits=splits or 1, extras=extras, held=held, sinks=sinks,
                                 indices=(*(ranges.names if ranges is not None else ()), *moving_descales))
        self.split_counts = packed.split_counts
        self.ranges = ranges.tensors if ranges is not None else ()  # prepared calls pass theirs after q, k, v
        self._arm(spec, (q, k, v, *self.ranges, *moved), out, lse, packed.kernel, packed.merge, packed.held)

    def _arm(self, spec: AttentionSpec, inputs: tuple, out, lse, kernel, merge, held: list,
             first: tuple | None = None) -> None:
        """Keep what a call checks and re-points: `inputs` (q, k, v, then the batch layout's index
        tensors) as prepared, out's and lse's shapes and strides, the kernel's Launch (slots: the
        inputs, then out and lse where it writes them) and the merge kernel's after it (slots out,
        lse), or None; `first`: (a Launch before the kernel's, the positions among the inputs of
        the tensors its slots take), or None; `held`: memory the launches read."""
        q = inputs[0]
        tq = as_device_tensor(q, "q")
        self.spec, self.kernel, self.merge, self._held = spec, kernel, merge, held
        n = len(inputs)  # a call's addresses: the inputs, out, lse
        # each launch in order with the positions of the addresses its slots take
        self._launches = ((() if first is None else (first,))
                          + (((kernel, tuple(range(n))), (merge.launch, (n, n + 1))) if merge else
                             ((kernel, tuple(range(n + 2))),)))
        self.torch = tq.kind == "torch"
        self.inputs = len(inputs)
        self.device = tq.device
        self._current_device = cupy.cuda.runtime.getDevice  # bound once: a call's device check
        self._captured = False  # in CAPTURED: a graph replays into this object's workspace
        self.signature = tuple(tensor_signature(x) for x in inputs)
        self._lse = lse
        self.out_shape, self.lse_shape = tuple(out.shape), tuple(lse.shape)
        self.out_signature, self.lse_signature = tensor_signature(out), tensor_signature(lse)
        self._out_order = layout_order(self.signature[0][1])  # q's: the packed out's own (empty_laid_out_as)
        self._lse_ptr = as_device_tensor(lse, "lse").ptr
        self._hot = None  # the C hot path of a torch call (fagen.hot_path), where it could be built
        if self.torch:
            import torch

            self._torch = torch  # the call's allocations, without an import statement a call
            self._stream = torch_stream_handle()
            self._capturing = torch._C._cuda_isCurrentStreamCapturing
            self._layout = tuple(x for t in inputs for x in (t.shape, t.stride()))
            self._dtypes = tuple(t.dtype for t in inputs)
            self._dtype = out.dtype
            self._allocate_out = self._out_allocator()
            self._hot = self._hot_path()

    def __call__(self, q, k, v, *indices, out=None, lse=None, return_lse: bool = False):
        """out, or (out, lse) with return_lse, for tensors of the prepared shapes (fagen.attention's
        convention; `indices`: a batch layout's index tensors, as prepared). out and lse may be
        given (of the shapes prepare allocated; a given lse is returned too), else out is
        allocated on the stream and lse, when asked for."""
        if self._hot is not None and lse is None and not return_lse:
            done = self._hot.run(q, k, v, *indices, out)  # NotImplemented: not as prepared, checked below
            if done is not NotImplemented:
                return done
        inputs = (q, k, v, *indices)
        if len(inputs) != self.inputs:
            raise TypeError(f"prepared for {self.inputs} tensors (q, k, v{', and the index tensors' if self.inputs > 3 else ''}); "
                            f"got {len(inputs)}")
        if self.torch:  # attribute reads, no signature tuples (laid_out_as where they differ)
            if ((tuple(x for t in inputs for x in (t.shape, t.stride())) != self._layout
                    or any(t.dtype is not dtype for t, dtype in zip(inputs, self._dtypes))
                    or any(t.get_device() != self.device for t in inputs))
                    and not all(map(laid_out_as, inputs, self.signature))):
                self._refuse(inputs)
            if out is not None and not laid_out_as(out, self.out_signature) \
                    or lse is not None and tensor_signature(lse) != self.lse_signature:
                self._refuse_outputs(out, lse)
        elif tuple(tensor_signature(t) for t in inputs) != self.signature:
            self._refuse(inputs)
        elif out is not None and tensor_signature(out) != self.out_signature \
                or lse is not None and tensor_signature(lse) != self.lse_signature:
            self._refuse_outputs(out, lse)
        if self._current_device() != self.device:
            raise ValueError(f"prepared on cuda:{self.device}, but the current device is "
                             f"cuda:{self._current_device()}; use `with cupy.cuda.Device({self.device}):`")
        if lse is not None:
            return_lse = True
        if self.torch:
            return self._launch_torch(q, tuple(t.data_ptr() for t in inputs), out, lse, return_lse)
        current = cupy.cuda.get_current_stream()
        if not self._captured and current.is_capturing():
            self._keep_for_graphs()
        if out is None:
            out = empty_permuted("cupy", self.out_shape, self._out_order, self.out_signature[2])
        if return_lse and lse is None:
            lse = cupy.empty(self.lse_shape, dtype=cupy.float32)
        self._launch(current.ptr, tuple(t.data.ptr for t in inputs), out.data.ptr,
                     lse.data.ptr if return_lse else self._lse_ptr)
        return (out, lse) if return_lse else out

    def once(self, q, k, v, *indices, out=None, return_lse: bool = False):
        """The one call of an object made for it (an unprepared call, the PyTorch op's under a graph
        capture too): its workspace is this call's and goes with the object, which a capture must
        not keep. Made during the capture, the workspace came from the capture's own memory pool,
        which the graph holds for its replays (as for any op's temporaries; torch.compile's
        CUDA graphs refuse memory of their pool that outlives the recording)."""
        self._captured = True  # (not kept in CAPTURED)
        return self(q, k, v, *indices, out=out, return_lse=return_lse)

    def _launch_torch(self, q, addresses: tuple, out, lse, return_lse: bool):
        """A torch call's launches on the current stream (keeping this object for a graph being
        captured), out and lse allocated where not given; out, or (out, lse)."""
        torch = self._torch
        stream = self._stream(self.device)
        if not self._captured and self._capturing():
            self._keep_for_graphs()
        if out is None:
            out = self._allocate_out(q)
        if return_lse and lse is None:
            lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        self._launch(stream, addresses, out.data_ptr(), lse.data_ptr() if return_lse else self._lse_ptr)
        return (out, lse) if return_lse else out

    def _launch(self, stream: int, addresses: tuple, out_ptr: int, lse_ptr: int) -> None:
        """The kernel's launch (and the merge kernel's after it) at these addresses, refusing any
        of q, k, v and out not 16-byte aligned (a view starting inside a row has the prepared strides)."""
        misaligned = [name for name, at in zip(("q", "k", "v", "out"), (*addresses[:3], out_ptr)) if at % 16]
        if misaligned:
            raise ValueError(f"{', '.join(misaligned)}: address not a multiple of 16 bytes (a view starting inside a "
                             f"row), though laid out as prepared; the kernels copy whole 16-byte pieces: pass a "
                             f"contiguous copy")
        addresses = (*addresses, out_ptr, lse_ptr)
        for launch, at in self._launches:
            launch(stream, *(addresses[i] for i in at))

    def _keep_for_graphs(self):
        if not self._captured:
            CAPTURED.append(self)
            self._captured = True

    def _out_allocator(self):
        """A function of a torch call's q allocating its out (uninitialised, on q's GPU)."""
        torch, shape, order, dtype = self._torch, self.out_shape, self._out_order, self._dtype
        # out laid out as q is (its strides too where V is as wide as Q): torch.empty_like(q)
        # allocates it in half torch.empty's host time (H200 host: 3.7-3.9 µs against 7.2-9.7,
        # q.new_empty 5.4), of out's dtype where q's differs (an FP8 q)
        if self.signature[0][:2] == self.out_signature[:2]:
            return torch.empty_like if self.signature[0][2] == dtype else functools.partial(torch.empty_like, dtype=dtype)
        return lambda q: torch.empty_permuted(shape, order, dtype=dtype, device=q.device)

    def _hot_path(self, growing: tuple | None = None):
        """The C hot path of this call (fagen.hot_path.HotPath) for torch tensors, or None where
        the module could not be built: the same checks, addresses and launches as __call__'s
        Python path, which a call takes where the hot path declines. `growing`: a GrowingKeys
        class's (HotPath's growing argument)."""
        module = hot_path.module() if self.torch else None
        if module is None:
            return None
        torch = self._torch
        n = self.inputs  # addresses: the inputs, out, lse
        launch_kernel, is_capturing, encode_tiled = hot_path.driver_functions()
        workspace = (self._lse, self._held)  # the LSE and partials the launches write: alive while the C path is
        return module.HotPath(self._layout, (*self._dtypes, self._dtype), self.device, torch.Size(self.out_shape),
                              self.out_signature[1], self._stream, self._current_device, self._allocate_out,
                              functools.partial(_keep_for_graphs, weakref.ref(self)), self._lse_ptr,
                              launch_kernel, is_capturing, encode_tiled, tensor_maps.ENCODE_FLAGS,
                              tuple(hot_path.launch_entry(launch, at, n + 2, (launch, workspace)) for launch, at in self._launches),
                              growing)

    def _refuse(self, inputs):
        raise ValueError(f"prepared for {self.signature}; got {tuple(tensor_signature(t) for t in inputs)}: "
                         f"prepare again (fagen.prepare) for new shapes, strides, dtype or device")

    def _refuse_outputs(self, out, lse):
        raise ValueError(f"out, lse: expected {self.out_signature} and {self.lse_signature} (as prepared), got "
                         f"{tensor_signature(out) if out is not None else None}, {tensor_signature(lse) if lse is not None else None}")


KEYS_TO_THE_END = 2**31 - 1  # an absent cache_seqlens: clamped to k's rows by the kernel


class KeyRanges:
    """Key ranges of a padded K/V: sequence b's keys are rows cache_leftpad[b] .. cache_seqlens[b]
    of its own (FlashAttention's flash_attn_with_kvcache names; a left-padded batch, a static
    cache), int32 [B] tensors on q's device that the kernel reads there, clamped to the rows k
    holds (sequences.kv ranged). Without cache_leftpad, rows from 0 (a zero array kept here);
    without cache_seqlens, every row to the end (likewise k's row count). A prepared call passes
    the given ones after q, k, v, and may point them at other tensors of the same layout."""

    def __init__(self, tq, cache_seqlens, cache_leftpad):
        b = tq.shape[0]
        self.names, self.tensors, self.held, self.arguments = (), (), [], {}
        for name, x in (("cache_seqlens", cache_seqlens), ("cache_leftpad", cache_leftpad)):
            if x is None:  # the kernel clamps the end to k's rows
                with cupy.cuda.Device(tq.device), stream_for(tq):
                    array = full_like(tq, (b,), KEYS_TO_THE_END if name == "cache_seqlens" else 0, "int32")
                self.held.append(array)
                self.arguments[name] = np.uint64(as_device_tensor(array, name).ptr)
                continue
            t = as_device_tensor(x, name)
            if t.dtype != "int32" or t.shape != (b,) or b > 1 and t.strides != (1,) or t.device != tq.device \
                    or t.kind != tq.kind:
                raise ValueError(f"{name}: a {t.kind} {t.dtype} tensor {t.shape} on cuda:{t.device}; expected a "
                                 f"contiguous int32 {tq.kind} tensor [{b}] (one a sequence of q) on q's cuda:{tq.device}"
                                 f", e.g. {name}.to(torch.int32).contiguous()")
            self.names += (name,)
            self.tensors += (x,)
            self.arguments[name] = np.uint64(t.ptr)

    @staticmethod
    def variant(spec: AttentionSpec) -> AttentionSpec:
        return sequence_variant(spec, "padded", "ranged")


def refuse_without_work(q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> None:
    """A prepared call is for a loop of calls that launch: one with no work (no_work) has nothing
    to pack."""
    if no_work(q_shape, k_shape):
        raise ValueError(f"q {tuple(q_shape)}, k {tuple(k_shape)}: no work to prepare (B, Hq, Nq and Nk must be >= 1); "
                         f"call fagen.attention, which answers a call without query rows or keys with no launch")


def _keep_for_graphs(owner: weakref.ref) -> None:
    """The hot path's capture hook: a weak reference, so that the C object does not keep its
    owner alive (it cannot take part in garbage collection's cycle search)."""
    prepared = owner()
    if prepared is not None:
        prepared._keep_for_graphs()


class GrowingKeys(PreparedAttention):
    """A decode kernel's PreparedAttention for any key length in [lo, 2 lo) and any K/V strides
    (a cache that grows by a token a step, re-allocated as it grows): the split count is fixed
    for the class, chosen and evened for lo keys so that each split has a tile at every length in
    it (at a longer one a share past the keys is empty and merges as nothing) and a call's bits do
    not depend on the length that made the class, and a call with a new
    length or new K/V strides rewrites n_kv, the diagonal's offset, the K/V strides and each
    split's share of the tiles before it launches. PyTorch tensors; `run` declines
    (NotImplemented) what it was not built for, which the general path then takes or refuses."""

    WRITTEN = ("n_kv", "mask_offset", "k_sb", "k_sh", "k_sn", "v_sb", "v_sh", "v_sn")  # HotPath's GROWING_FIELDS

    def __init__(self, q, k, v, *, lo: int, **options):
        super().__init__(q, k, v, split_keys=lo, **options)
        self.lo, self.hi = lo, 2 * lo
        plan = compile_kernel(self.spec).plan
        self._block_kv = plan.block_kv
        self._splits = self.kernel.grid[2]
        self._split = self.spec.outputs.partial
        self._nq = q.shape[2]
        self._chunk = plan.kv_chunk_elems  # K's and V's elements a 16-byte copy
        # a ranged kernel finds each sequence's diagonal itself (the offset stays 0)
        self._bottom_right = self.spec.mask.align == "bottom_right" and not self.ranges
        names = self.WRITTEN + (("kv_tiles_per_split",) if self._split else ())
        self._write = self.kernel.writer(names)
        self._keys = (k.stride(), v.stride(), k.shape[2])
        # the C path of the class (in place of the prepared layout's): the same checks and writes
        # as `run`'s, every call, then the prepared launches
        fields = tuple((slot, 8 if ctype == "long long" else 4) for slot, ctype in self.kernel.param_slots(names))
        self._hot = self._hot_path(growing=(self.lo, self.hi, self._block_kv, self._splits, self._nq,
                                            self._bottom_right, self._chunk, (k.shape[0], k.shape[1], k.shape[3]),
                                            (v.shape[0], v.shape[1], v.shape[3]), fields))

    def run(self, q, k, v, ranges: tuple, return_lse: bool):
        """out (and lse) for q as prepared, k and v of the class (their B, Hkv, d, dtypes and
        devices as prepared, and the key ranges' layout: the caller's key holds them; v as long
        as k and the current device the prepared one, checked here), or NotImplemented."""
        if self._hot is not None:
            if not return_lse:
                done = self._hot.run(q, k, v, *ranges, None)
                if done is not NotImplemented:
                    return done
            # the C path writes the slots (this call's, even where it declined, or a remembered
            # class's call: ShapeClasses): rewritten below
            self._keys = None
        ks, vs, nk = k.stride(), v.stride(), k.shape[2]
        if v.shape[2] != nk or self._current_device() != self.device:  # the general path says why
            return NotImplemented
        if (ks, vs, nk) != self._keys:
            if not (self.lo <= nk < self.hi and ks[3] == 1 and vs[3] == 1
                    and not (ks[0] | ks[1] | ks[2] | vs[0] | vs[1] | vs[2]) % self._chunk):
                return NotImplemented
            share = (-(-(-(-nk // self._block_kv)) // self._splits),) if self._split else ()
            self._write(nk, nk - self._nq if self._bottom_right else 0, *ks[:3], *vs[:3], *share)
            self._keys = (ks, vs, nk)
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if (addresses[0] | addresses[1] | addresses[2]) % 16:  # the general path refuses it by name
            return NotImplemented
        return self._launch_torch(q, (*addresses, *(t.data_ptr() for t in ranges)), None, None, return_lse)


class ShapeClasses:
    """fagen.attention's eager PyTorch calls, packed once a shape class: a call that comes again
    launches through a PreparedAttention kept under a key of everything its choice and packing
    read but the addresses (a few microseconds of host time where dispatch, checks and packing
    take hundreds). A decode step's class takes every key length in [2^k, 2^(k+1)) and any K/V
    strides (GrowingKeys: a generation loop's cache grows a token a call); other calls' classes
    are their exact shapes and strides (PreparedAttention, its C path). The key holds the
    stream and the thread (a class's workspace and argument buffer are one call's at a time).
    At most LIMIT classes of each kind; then they start over (one a graph captured stays alive,
    CAPTURED)."""

    LIMIT = 64

    def __init__(self):
        self._growing: dict[tuple, GrowingKeys] = {}
        self._exact: dict[tuple, PreparedAttention] = {}
        # the options' key (no tensor's layout in it) -> the C path (HotPath.run) of the class a
        # call with them last took: a model's layers call with the same options and tensors of
        # one class, so a call tries that class's C path first, which checks the tensors' layouts
        # itself (half the host time of building and hashing the whole key)
        self._last: dict[tuple, Callable] = {}
        self._stream = None
        # .run: the C path of the class this thread's last keyed call took (None: none, or not
        # keyed), for a caller whose own key says more cheaply what the options key says
        # (fagen.transformers: a layer's attention module calls with the same options every step)
        self.taken = threading.local()

    def __call__(self, q, k, v, causal: bool, mask, softcap, scale, sinks, return_lse: bool, ranges: tuple = (),
                 descales: tuple = ()):
        """out (and lse) of fagen.attention's call, or NotImplemented where no class takes it (the
        general path then runs it, or refuses it by name). `ranges`: (cache_seqlens,
        cache_leftpad), either None, as KeyRanges takes them. `descales`: an FP8 KV cache's
        (q_descale, k_descale, v_descale) (q's for an FP8 q): the moving ones
        (fp8_inputs.kept_form) re-pointed each call after the ranges, the others in the key."""
        if self._stream is None:
            self._stream = torch_stream_handle()
        options = None
        given = tuple(t for t in ranges if t is not None) if ranges else ()
        # the descales as the last class's C path takes them: every torch tensor re-pointed (that
        # path checks each one's layout, dtype and GPU itself), numbers by value in the options
        descale_options, tensors = fp8_inputs.re_pointed(descales, type(q))
        if not return_lse and descale_options is not None:  # (the C path's calls; no generator here: a decode step's host time)
            try:
                device = q.get_device()
                if device >= 0:
                    options = (q.shape, causal, mask if mask is None or isinstance(mask, str) else tuple(mask.items()),
                               softcap, scale,
                               None if sinks is None else (sinks.data_ptr(), sinks._version, sinks.dtype, sinks.shape),
                               device, self._stream(device), threading.get_ident(),
                               ranges and (ranges[0] is None, ranges[1] is None),
                               descale_options)
                    hot = self._last.get(options)
                    if hot is not None:
                        done = hot(q, k, v, *given, *tensors, None)
                        if done is not NotImplemented:
                            self.taken.run = hot
                            return done
            except (AttributeError, TypeError):  # not a tensor, or a mask with unhashable parts: the key's test below
                options = None
        descale_keys = moves = ()
        if descales:
            try:
                moves, moved, descale_keys = fp8_inputs.kept_form(descales, q.get_device())
            except (AttributeError, TypeError):  # not a tensor or a number: the general path says why
                return NotImplemented
            given += moved
            if len(moved) != len(tensors):  # a descale copied: its class's C path is not the options' to try
                options = None
        try:  # the key alone: what is not a tensor of this rank, or a mask with unhashable parts, is not ours
            if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
                return NotImplemented
            device = q.get_device()
            if device < 0:  # a host tensor: the general path says what to do
                return NotImplemented
            base = (q.shape, q.stride(), q.dtype, k.dtype, v.dtype, device, k.get_device(), v.get_device(),
                    k.shape[0], k.shape[1], k.shape[3], v.shape[0], v.shape[1], v.shape[3], causal,
                    mask if mask is None or isinstance(mask, str) else tuple(sorted(mask.items())), softcap, scale,
                    None if sinks is None else (sinks.data_ptr(), sinks._version, sinks.dtype, sinks.shape),
                    return_lse, self._stream(device), threading.get_ident(),
                    *(None if t is None else (t.dtype, t.shape, t.stride(), t.get_device()) for t in ranges),
                    descale_keys)
            growing_key = (*base, k.shape[2].bit_length())
            exact_key = (*base, k.shape, k.stride(), v.shape, v.stride())
            growing, exact = self._growing.get(growing_key), self._exact.get(exact_key)
        except (AttributeError, TypeError):
            return NotImplemented
        if growing is not None:
            done = growing.run(q, k, v, given, return_lse)
            if done is not NotImplemented:
                self._remember(options, growing)
                return done
        if exact is not None:
            self._remember(options, exact)
            return exact(q, k, v, *given, return_lse=return_lse)
        if growing is not None:
            return NotImplemented
        cache_seqlens, cache_leftpad = ranges or (None, None)
        q_descale, k_descale, v_descale = descales or (None, None, None)
        return self._add(base, exact_key, q, k, v, dict(causal=causal, mask=mask, softcap=softcap, scale=scale,
                                                       sinks=sinks, cache_seqlens=cache_seqlens,
                                                       cache_leftpad=cache_leftpad, q_descale=q_descale,
                                                       k_descale=k_descale, v_descale=v_descale,
                                                       moving_descales=moves), given, return_lse)

    def _remember(self, options: tuple | None, prepared: PreparedAttention) -> None:
        """`prepared` as the class of calls with these options (None: not the C path's call)."""
        if options is not None and prepared._hot is not None:
            if len(self._last) >= self.LIMIT:
                self._last.clear()
            self._last[options] = self.taken.run = prepared._hot.run

    def _add(self, base: tuple, exact_key: tuple, q, k, v, options: dict, given: tuple, return_lse: bool):
        """The call's class, packed and kept, and the call through it; NotImplemented (nothing kept)
        where the general path is the call's: no work, or an input it refuses by name."""
        if q.shape[-1] in WIDE_HEAD_DIMS:
            return NotImplemented  # its own path (fagen.torch_op): head_dim 512's kernels
        q8 = fp8_element(str(q.dtype).removeprefix("torch."))
        ranged = options["cache_seqlens"] is not None or options["cache_leftpad"] is not None
        if q8 is not None and not (k.dtype == q.dtype == v.dtype and fp8_on_cache_kernels(
                tuple(q.shape), tuple(k.shape), tuple(v.shape), q8.name, causal=options["causal"], mask=options["mask"],
                softcap=options["softcap"], sinks=options["sinks"], ranged=ranged, gpu=q.get_device())):
            return NotImplemented  # the FP8 forward's (fagen.torch_op): not a decode step on the cache's kernels
        try:
            plain = derive_spec(q, causal=options["causal"], mask=options["mask"], softcap=options["softcap"],
                                sinks=options["sinks"], keys=sequence_keys(k), v=v, ranged=ranged)
            if no_work(q.shape, k.shape):
                return NotImplemented
            spec = packed_spec(plain, q, k)
            descaled = any(options[name] is not None for name in fp8_inputs.DESCALE_NAMES)
            if spec is None and (descaled or fp8_element(str(k.dtype).removeprefix("torch."))):
                return NotImplemented  # an FP8 cache no decode kernel takes: the general path refuses it by name
            b, hq, nq, _ = q.shape
            hkv, nk = k.shape[1], k.shape[2]
            if spec is not None and not spec.pipeline.warp_specialized:
                lo = 1 << (nk.bit_length() - 1)
                if ranged:
                    spec = KeyRanges.variant(spec)
                _, splits = step_spec(spec, b, hq, hkv, nq, lo, None, options["sinks"] is not None)
                kept = self._growing
                key, prepared = (*base, nk.bit_length()), GrowingKeys(q, k, v, lo=lo, splits=splits, **options)
            else:
                kept, key, prepared = self._exact, exact_key, PreparedAttention(q, k, v, **options)
        except ValueError:
            return NotImplemented
        if prepared._capturing():
            # made during a stream capture: what its packing wrote (its walk's counters, the split
            # merge's zeroed counts, a copied descale, a missing one's 1, a missing key range) was
            # written by nodes of the graph being recorded, and an eager call of a kept class before
            # the graph's first replay would read it unwritten
            return prepared.once(q, k, v, *given, return_lse=return_lse)
        if len(kept) >= self.LIMIT:
            kept.clear()
            self._last.clear()  # (it keeps only classes kept here)
        # the sinks' and copied descales' addresses and versions are in the key: held, never another's
        prepared._held.extend((options["sinks"], *(options[name] for name in fp8_inputs.DESCALE_NAMES
                                                   if name not in options["moving_descales"])))
        kept[key] = prepared
        if isinstance(prepared, GrowingKeys):
            return prepared.run(q, k, v, given, return_lse)  # NotImplemented (misaligned addresses): the general path's
        return prepared(q, k, v, *given, return_lse=return_lse)


SHAPE_CLASSES = ShapeClasses()


def prepare(q, k, v, **kwargs) -> PreparedAttention:
    """fagen.attention's kernels for these tensors' shapes, packed once (PreparedAttention)."""
    return PreparedAttention(q, k, v, **kwargs)
