"""Gradients: a spec's backward kernels (fagen.backward_plan), launched on the forward's inputs
and outputs, on the inputs' framework's current stream.

The caller keeps what the forward saw: q, k, v, out, lse and the same side inputs. Everything
allocated here (D and LSE rows, the gradients) comes from the inputs' framework, so PyTorch
callers stay inside its caching allocator (CUDA graphs capture the whole step).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fagen.backward_plan import TMA_TENSORS, BackwardPlan, backward_plan, bias_grad_layout, kernel_symbols
from fagen.device import (DeviceTensor, as_device_tensor, cupy, empty_like, fork_join, is_torch, l2_bytes,
                          multiprocessors, require_cupy, stream_for, tensor_signature, torch_stream_handle, zeros_like)
from fagen.mask_kinds import KINDS
from fagen.plan import l2_heads
from fagen.rendering import render_backward
from fagen import tensor_maps
from fagen.runtime import (LOG2E, Kernel, Launch, KeptLaunches, TensorMap, block_mask_arguments, compile_kernel,
                           compile_module, pack_arguments, packers)
from fagen.side_inputs import check_scale
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
        self.repeated_adds = KeptLaunches()  # QueryRows.add's dK/dV launches, by QueryRows._add_key
        self.repeated_calls = KeptLaunches()  # plain calls' launches (KeptCall), by Backward._call_key

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
                 block_mask=None, bias=None, alibi_slopes=None, sinks=None, doc_ids=None, captured=None,
                 captured_sums=None, dq=None, dk=None, dv=None) -> Gradients:
        """The gradients of sum(out * dout) by q, k, v (and sinks), for the forward that gave
        out and lse (natural-log LSE [B, Hq, Nq], f32) from the same arguments. dq, dk, dv:
        where to write them (like q, k, v), else fresh arrays. captured_sums: (sums, scales),
        where the dK/dV kernel adds the gradients of backward.captured_grads's arrays
        (fagen.captured_grads.FixedPointSums: int64 zeroed, an element each, and a float64
        scale an array)."""
        spec, bp = self.spec, self.plan
        given = (block_mask, bias, alibi_slopes, sinks, doc_ids, captured, captured_sums, dq, dk, dv)
        key = self._call_key(dout, q, k, v, out, lse, scale, mask_offset) if all(x is None for x in given) else None
        kept = None if key is None else self.repeated_calls.get(key)
        if kept is not None:
            done = kept.run(dout, q, k, v, out, lse)
            if done is not None:
                return done
        tq, tk, tv = self.forward.check(q, k, v)
        b, hq, nq, d = tq.shape
        hkv, nk = tk.shape[1], tk.shape[2]
        tdo, to, tl, scale = _forward_rows(tq, dout, out, lse, scale, spec.dv)
        if mask_offset is None:
            mask_offset = nk - nq if spec.mask.align == "bottom_right" else 0
        n_pad = -(-nq // bp.row_pad) * bp.row_pad
        with cupy.cuda.Device(tq.device), stream_for(tq):
            given = dict(block_mask=block_mask, bias=bias, alibi_slopes=alibi_slopes, sinks=sinks, doc_ids=doc_ids,
                         captured=captured)
            extras, keep_alive = self.forward.extra_arguments(tq, tk, given)
            extras.pop("sinks", None)  # the sink's share of each row is in the forward's LSE
            delta, lse2 = (empty_like(tq, (b, hq, n_pad), "float32") for _ in range(2))
            for given, name, t in ((dq, "dq", tq), (dk, "dk", tk), (dv, "dv", tv)):
                if given is not None:
                    _like(given, name, t)  # where the caller asks them written: checked first
            dq, dk, dv = (empty_like(t, t.shape, spec.dtype) if given is None else given
                          for t, given in ((tq, dq), (tk, dk), (tv, dv)))
            # atomic dQ: the dK/dV kernel adds into f32 rows padded as D's, which the preprocess zeroes
            # (in its own order: backward_plan.dq_accum_index)
            dq_accum = empty_like(tq, (b, hq, n_pad, d), "float32") if bp.atomic_dq else None
            dbias, dbias_args, summed = self._bias_grad_buffer(bias, tq, b, hkv)
            dbias_args.update(self._captured_sums_arguments(captured_sums))
            values = dict(o=to.ptr, dout=tdo.ptr, lse=tl.ptr, delta=_ptr(delta), lse2=_ptr(lse2), n_q=nq, n_kv=nk, batch=b,
                          heads_section=self._heads_section(b, hq, hkv, n_pad, nk, d, tq.device),
                          mask_offset=mask_offset, heads_q=hq, group=hq // hkv, n_pad=n_pad, q=tq.ptr, k=tk.ptr,
                          v=tv.ptr, dq=_ptr(dq), dk=_ptr(dk), dv=_ptr(dv), scale=scale, scale_log2=scale * LOG2E,
                          **({"dq_accum": _ptr(dq_accum)} if bp.atomic_dq else {}), **dbias_args, **extras)
            outputs = ((name, as_device_tensor(x, name)) for name, x in (("dq", dq), ("dk", dk), ("dv", dv)))
            values.update(_stride_values(("q", tq), ("k", tk), ("v", tv), ("o", to), ("dout", tdo), *outputs))
            per_kernel = dict.fromkeys(self.kernels, values)
            if block_mask is not None:  # each loop walks the mask's tiles at its own tiling, dK/dV transposed
                shape = (b, hq, nq, nk)
                per_kernel["dq"] = values | block_mask_arguments(block_mask, bp.dq.block_q, bp.dq.block_kv, *shape)
                per_kernel["dkdv"] = values | block_mask_arguments(block_mask, bp.dkdv.block_q, bp.dkdv.block_kv, *shape,
                                                                   key_major_group=hq // hkv)
            maps = {role: self._maps(role, tq, tk, tv, tdo) for role in self.kernels}

            if key is not None:  # packed as a kept call's launches, then kept
                launches = tuple(self._kept_launch(role, per_kernel[role], self._grid(role, b, hq, hkv, nq, nk, n_pad,
                                                                                      tq.device), maps[role])
                                 for role in self.kernels)
                if all(launch is not None for _, launch in launches):
                    kept = KeptCall(launches, n_pad, bp.atomic_dq)
                    self.repeated_calls.keep(key, kept)
                    for names, launch in launches:
                        launch(None, *(values[name] for name in names))
                    return Gradients(dq, dk, dv)

            def run(role: str) -> None:  # on CuPy's current stream
                self._launch(role, per_kernel[role], self._grid(role, b, hq, hkv, nq, nk, n_pad, tq.device), maps[role])

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

    def query_rows(self, dout, q, out, lse, *, scale: float | None = None) -> QueryRows:
        """These query rows' backward, to be added up over K/V blocks one launch at a time (ring
        attention's steps): their D and LSE rows computed now, once. lse: the rows' final LSE
        (the whole sequence's), so that each block's softmax is the whole one's."""
        tq = as_device_tensor(q, "q")
        tdo, to, tl, scale = _forward_rows(tq, dout, out, lse, scale, self.spec.dv)
        b, hq, nq, d = tq.shape
        n_pad = -(-nq // self.plan.row_pad) * self.plan.row_pad
        with cupy.cuda.Device(tq.device), stream_for(tq):
            delta, lse2 = (empty_like(tq, (b, hq, n_pad), "float32") for _ in range(2))
            # atomic dQ: the dK/dV kernels add into rows padded as D's (backward_plan.dq_accum_index's
            # order), which the preprocess zeroes; else each block's dQ is summed here
            dq_sum = (empty_like(tq, (b, hq, n_pad, d), "float32") if self.plan.atomic_dq
                      else zeros_like(tq, (b, hq, nq, d), "float32"))
            values = dict(o=to.ptr, dout=tdo.ptr, lse=tl.ptr, delta=_ptr(delta), lse2=_ptr(lse2), n_q=nq, heads_q=hq,
                          n_pad=n_pad, dq_accum=_ptr(dq_sum), **_stride_values(("o", to), ("dout", tdo)))
            self._launch("preprocess", values, self._grid("preprocess", b, hq, 0, nq, 0, n_pad, tq.device), ())
        return QueryRows(self, tq, tdo, scale, n_pad, delta, lse2, dq_sum)

    def _heads_section(self, b: int, hq: int, hkv: int, n_pad: int, n_kv: int, d: int, device_id: int) -> int:
        """The warp-specialised dK/dV walk's KV heads a section (templates/kernel/backward.cu.j2):
        one at a time where every KV block of a head does the same work (its blocks read its Q and
        dO in step, once from DRAM), or where a head's blocks fill half the GPU by themselves (its
        heaviest already start a wave ahead of its lightest); else as many as keep their Q, dO,
        LSE and D within L2's share (plan.l2_heads), so that every head's heaviest block starts
        first and the last wave holds light ones (causal: KV block 0 sees every query, the last
        only the diagonal's). Measured, d128 causal (notes/perf.md): +4% at 4k keys, 0 at 1k, and
        -2.5% at 16k, whose 128 blocks a head now walk one head at a time as before."""
        if KINDS[self.spec.mask.kind].even_tiles or 2 * -(-n_kv // self.plan.dkdv.block_kv) >= multiprocessors(device_id):
            return 1
        per_head = (hq // hkv) * n_pad * ((d + self.spec.dv) * self.spec.element.bytes + 8)  # Q and dO rows, LSE and D
        return l2_heads(b * hkv, per_head, l2_bytes(device_id))

    def _dkdv_grid(self, tiles: int, device_id: int) -> tuple[int, int]:
        """The warp-specialised dK/dV kernel walks a 1-D tile grid: a block a tile, or (persistent)
        one block an SM."""
        return (min(tiles, multiprocessors(device_id)) if self.plan.dkdv.persistent else tiles, 1)

    def _grid(self, role: str, b: int, hq: int, hkv: int, nq: int, nk: int, n_pad: int, device: int) -> tuple:
        """A kernel's launch: its grid, threads and dynamic shared memory."""
        bp = self.plan
        if role == "preprocess":
            return (-(-n_pad // bp.preprocess_rows), b * hq), bp.preprocess_threads, 0
        if role == "dkdv":
            return (self._dkdv_grid(b * hkv * -(-nk // bp.dkdv.block_kv), device) if bp.dkdv.warp_specialized
                    else (-(-nk // bp.dkdv.block_kv), b * hkv)), bp.dkdv.threads, bp.dkdv.smem_bytes
        if role == "dq":
            return (b * hq, -(-nq // bp.dq.block_q)), bp.dq.threads, bp.dq_smem_bytes
        return (bp.postprocess_blocks(nq), b * hq), bp.preprocess_threads, 0

    def _maps(self, role: str, tq: DeviceTensor, tk: DeviceTensor, tv: DeviceTensor, tdo: DeviceTensor) -> tuple:
        """A producer-fed kernel's tensor maps, by value: the dK/dV kernel's boxes are a tile's
        64-column blocks (Q and dO tiles of block_q rows, K and V of block_kv), the dQ kernel's
        8-row groups; () for a kernel without a producer."""
        if role not in self.producer_threads:
            return ()
        size, dkdv = self.spec.element.bytes, self.plan.dkdv

        def layout(name: str, t: DeviceTensor) -> tensor_maps.MapLayout:
            if role == "dkdv":
                rows = dkdv.block_q if name in ("q", "dout") else dkdv.block_kv
                return tensor_maps.layout(t.shape, t.strides, size, rows, name)
            return tensor_maps.row_groups(t.shape, t.strides, size, name)

        return tuple(TensorMap(f"{name}_map", name, self.spec.dtype, layout(name, t))
                     for name, t in zip(TMA_TENSORS, (tq, tk, tv, tdo)))

    def _launch(self, role: str, values: dict, launch: tuple, maps: tuple,
                slots: tuple[str, ...] = TMA_TENSORS) -> Launch | None:
        """One kernel on CuPy's current stream, its arguments packed by name from `values`; the
        Launch of a producer-fed kernel (`slots` the pointers a later launch may re-point) or of a
        dependent one (BackwardPlan.dependent_roles)."""
        (grid, threads, smem), function = launch, self.kernels[role]
        if 0 in grid:  # no rows (a ring's empty chunk)
            return None
        producers = self.producer_threads
        if role in producers or role in self.plan.dependent_roles:
            packed = Launch(function, (*grid, 1), producers.get(role, threads), smem,
                            getattr(self.plan, f"{role}_params"), values, slots=slots if role in producers else (),
                            maps=maps, dependent=role in self.plan.dependent_roles)
            packed(None)
            return packed
        function(grid, (threads,), pack_arguments(self.packers[role], values), shared_mem=smem)
        return None

    def _call_key(self, dout, q, k, v, out, lse, scale: float | None, mask_offset: int | None) -> tuple | None:
        """What a plain call's checks and packing read, as a dict key (KeptCall); None where its
        launches are not kept (dQ on a stream of its own beside dK/dV)."""
        if self.plan.concurrent_dq:
            return None
        return (tensor_signature(q), tensor_signature(k), tensor_signature(v), tensor_signature(out),
                tensor_signature(dout), tensor_signature(lse), scale, mask_offset, threading.get_ident())

    def _kept_launch(self, role: str, values: dict, launch: tuple, maps: tuple) -> tuple[tuple[str, ...], Launch | None]:
        """A kernel of a plain call packed as a Launch (not launched): the CALL_ADDRESSES it takes,
        in that order, as its re-pointable slots; None for a grid with no blocks."""
        (grid, threads, smem), function = launch, self.kernels[role]
        taken = {name for _, name in getattr(self.plan, f"{role}_params")} | {m.tensor for m in maps if role in
                                                                              self.producer_threads}
        names = tuple(name for name in CALL_ADDRESSES if name in taken)
        if 0 in grid:
            return names, None
        return names, Launch(function, (*grid, 1), self.producer_threads.get(role, threads), smem,
                             getattr(self.plan, f"{role}_params"), values, slots=names,
                             maps=maps if role in self.producer_threads else (),
                             dependent=role in self.plan.dependent_roles)

    def _captured_sums_arguments(self, captured_sums) -> dict:
        """The dK/dV kernel's backward.captured_grads arguments: each array's sums, the scales."""
        arrays = self.plan.dkdv.captured_grads
        if not arrays:
            if captured_sums is not None:
                raise ValueError(f"captured_sums: kernel {self.spec.name} adds no captured array's gradient "
                                 f"(backward.captured_grads is empty); pass None, or train a spec that lists them")
            return {}
        if captured_sums is None or len(captured_sums[0]) != len(arrays):
            raise ValueError(f"captured_sums: kernel {self.spec.name} adds the gradients of {', '.join(arrays)} "
                             f"(backward.captured_grads); pass their sums and scales "
                             f"(fagen.captured_grads.FixedPointSums)")
        sums, scales = captured_sums
        return {f"{name}_grad": _ptr(total) for name, total in zip(arrays, sums)} | {"captured_grad_scales": _ptr(scales)}

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


# a plain call's re-pointable addresses: each kernel takes those of them it has, in this order
# (a producer-fed kernel its tensor maps' tensors among them)
CALL_ADDRESSES = ("q", "k", "v", "dout", "o", "lse", "delta", "lse2", "dq", "dk", "dv", "dq_accum")


@dataclass
class KeptCall:
    """A plain backward call's launches, packed by the first call of its key (Backward._call_key:
    the inputs' shapes, strides, dtypes and devices, the scale, the diagonal and the thread): a
    later call allocates D's and the LSE's rows and the gradients, re-points the launches at them
    and at its inputs (re-encoding the tensor maps of moved tensors), and launches: tens of
    microseconds of host time where checking and packing take hundreds, which a short sequence's
    backward (a few hundred microseconds of GPU time) would otherwise wait on."""

    launches: tuple[tuple[tuple[str, ...], Launch], ...]  # in launch order: (its CALL_ADDRESSES, the Launch)
    n_pad: int
    atomic_dq: bool

    def run(self, dout, q, k, v, out, lse) -> Gradients | None:
        """The gradients, or None (nothing launched) where an input is not 16-byte aligned or the
        current device is not the inputs' (the checked call refuses those, with its message)."""
        if is_torch(q):
            import torch

            device = q.get_device()
            if device != cupy.cuda.runtime.getDevice():
                return None
            b, hq, _, d = q.shape
            rows = torch.empty((2, b, hq, self.n_pad), dtype=torch.float32, device=q.device)
            grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
            accum = torch.empty((b, hq, self.n_pad, d), dtype=torch.float32, device=q.device) if self.atomic_dq else None
            address, stream = (lambda t: t.data_ptr()), torch_stream_handle()(device)
        else:
            if q.device.id != cupy.cuda.runtime.getDevice():
                return None
            b, hq, _, d = q.shape
            rows = cupy.empty((2, b, hq, self.n_pad), dtype=cupy.float32)
            grads = tuple(cupy.empty(t.shape, dtype=t.dtype) for t in (q, k, v))
            accum = cupy.empty((b, hq, self.n_pad, d), dtype=cupy.float32) if self.atomic_dq else None
            address, stream = (lambda t: t.data.ptr), None
        inputs = tuple(address(t) for t in (q, k, v, dout, out, lse))
        if any(a % 16 for a in inputs):
            return None
        at = dict(zip(CALL_ADDRESSES, (*inputs, address(rows[0]), address(rows[1]), *(address(g) for g in grads),
                                       address(accum) if accum is not None else 0)))
        for names, launch in self.launches:
            launch(stream, *(at[name] for name in names))
        return Gradients(*grads)


# an add's re-pointable addresses, in QueryRows._run_again's order: the tensor maps' first
ADD_SLOTS = (*TMA_TENSORS, "dk", "dv", "delta", "lse2", "dq_accum")


@dataclass
class QueryRows:
    """A set of query rows' backward over K/V blocks that arrive one at a time (Backward.query_rows):
    `add` runs a block's dK/dV kernel (and, without atomic dQ, its dQ kernel), returns the block's
    dK and dV, and sums its dQ here in float32; `dq()` reads the sum out once. The ring's masks
    take no side inputs, and neither do these launches."""

    backward: Backward  # whose preprocess laid out the rows (and dQ's sum, under atomic dQ)
    q: DeviceTensor
    dout: DeviceTensor
    scale: float
    n_pad: int
    delta: object  # D = rowsum(dO * O), f32 [B, Hq, n_pad]
    lse2: object  # LSE * log2(e), likewise
    dq_sum: object  # f32: atomic dQ's accumulator [B, Hq, n_pad, d] in its order, else [B, Hq, Nq, d]
    row0: int = 0  # where these rows start in the buffers above (a tail of another set's: `tail`)
    owner: QueryRows | None = None  # the set whose buffers these rows share

    def tail(self, start: int) -> QueryRows | None:
        """Rows start.. of these (a ring's second chunk) as a set of their own: `_share`."""
        return self._share(start, None)

    def head(self, end: int) -> QueryRows | None:
        """Rows ..end of these (a ring's first chunk, against its own keys): `_share`."""
        return self._share(0, end)

    def _share(self, start: int, end: int | None) -> QueryRows | None:
        """Rows start..end of these as a set of their own that shares their D, LSE rows and dQ sum
        (its launches' dQ lands in the whole rows' sum, rounded once), under atomic dQ and where
        start and end fall on whole tiles of those rows (the kernels read D and LSE by tiles, and
        the sum is in a tile's order); else None."""
        pad = self.backward.plan.row_pad
        if not self.backward.plan.atomic_dq or start % pad or (end or 0) % pad or self.owner is not None:
            return None
        q, dout = (as_device_tensor(t.obj[:, :, start:end], name) for t, name in ((self.q, "q"), (self.dout, "dout")))
        return QueryRows(self.backward, q, dout, self.scale, self.n_pad, self.delta, self.lse2, self.dq_sum,
                         row0=start, owner=self)

    def add(self, kernels: Backward, k, v, *, mask_offset: int = 0, dk=None, dv=None) -> tuple[object, object]:
        """One K/V block's share: dK and dV (written into dk and dv where given, like k and v),
        dQ added into the sum. `kernels`: the block's mask's backward, of the same tiling as the
        rows' (a ring's causal own block and its full steps). A block of a key seen before
        (`_add_key`: a ring's steps, call after call) re-points the launch packed for it."""
        key = self._add_key(kernels, k, v, mask_offset, dk, dv)
        launch = None if key is None else kernels.repeated_adds.get(key)
        if launch is not None and self._run_again(launch, k, v, dk, dv):
            return dk, dv
        mine, theirs = self.backward.plan, kernels.plan
        if _rows_layout(mine) != _rows_layout(theirs):
            raise ValueError(f"{kernels.spec.name}: its rows lie unlike {self.backward.spec.name}'s (row pad, dK/dV "
                             f"query tile or atomic dQ differ); add blocks with backwards of one tiling")
        tq, tk, tv = kernels.forward.check(self.q.obj, k, v)
        b, hq, nq, d = tq.shape
        hkv, nk = tk.shape[1], tk.shape[2]
        with cupy.cuda.Device(tq.device), stream_for(tq):
            for given, name, t in ((dk, "dk", tk), (dv, "dv", tv)):
                if given is not None:
                    _like(given, name, t)
            dk, dv = (empty_like(t, t.shape, kernels.spec.dtype) if given is None else given
                      for t, given in ((tk, dk), (tv, dv)))
            dq = None if mine.atomic_dq else empty_like(tq, tq.shape, kernels.spec.dtype)
            values = dict(n_q=nq, n_kv=nk, batch=b, mask_offset=mask_offset, heads_q=hq, group=hq // hkv,
                          heads_section=kernels._heads_section(b, hq, hkv, self.n_pad, nk, d, tq.device),
                          n_pad=self.n_pad, scale=self.scale, scale_log2=self.scale * LOG2E,
                          **self._row_addresses(), q=tq.ptr, k=tk.ptr, v=tv.ptr, dk=_ptr(dk), dv=_ptr(dv),
                          **({} if mine.atomic_dq else {"dq": _ptr(dq)}),
                          **_stride_values(("q", tq), ("k", tk), ("v", tv), ("dout", self.dout),
                                           *((name, as_device_tensor(x, name)) for name, x in
                                             (("dk", dk), ("dv", dv), ("dq", dq)) if x is not None)))
            for role in ("dkdv",) if mine.atomic_dq else ("dkdv", "dq"):
                launch = kernels._launch(role, values, kernels._grid(role, b, hq, hkv, nq, nk, self.n_pad, tq.device),
                                         kernels._maps(role, tq, tk, tv, self.dout),
                                         slots=ADD_SLOTS if mine.atomic_dq else TMA_TENSORS)
            if key is not None and launch is not None:
                kernels.repeated_adds.keep(key, launch)
            if dq is not None:
                self.dq_sum += dq
        return dk, dv

    def _row_addresses(self) -> dict:
        """The rows' buffers as an add's kernel reads them (this set's first row on), by parameter."""
        delta, lse2, dq_sum = self._buffers
        rows_at = 4 * self.row0  # bytes into D's and the LSE's rows
        return dict(dout=self.dout.ptr, delta=delta + rows_at, lse2=lse2 + rows_at,
                    dq_accum=dq_sum + rows_at * self.q.shape[3])

    @cached_property
    def _buffers(self) -> tuple[int, int, int]:
        """D's, the LSE rows' and the dQ sum's addresses, read once (each of the ring's adds needs them)."""
        return tuple(as_device_tensor(x, "buffer").ptr for x in (self.delta, self.lse2, self.dq_sum))

    def _add_key(self, kernels: Backward, k, v, mask_offset: int, dk, dv) -> tuple | None:
        """What an add's checks and packing read, as a dict key; None where its launch is not kept
        (dK and dV not given, or no atomic dQ: the dQ kernel's own launch and sum)."""
        if dk is None or dv is None or not self.backward.plan.atomic_dq:
            return None
        return (self.backward, tensor_signature(self.q.obj), tensor_signature(self.dout.obj), self.n_pad, self.row0,
                self.scale, tensor_signature(k), tensor_signature(v), tensor_signature(dk), tensor_signature(dv),
                mask_offset, threading.get_ident())

    def _run_again(self, launch: Launch, k, v, dk, dv) -> bool:
        """Launch an add's kept launch on these rows and this block; False (nothing launched) where
        an address is off 16 bytes or the current device is not the rows' (the checked add says why)."""
        torch = self.q.kind == "torch"
        addresses = (self.q.ptr, *(x.data_ptr() if torch else x.data.ptr for x in (k, v)), self.dout.ptr,
                     *(x.data_ptr() if torch else x.data.ptr for x in (dk, dv)))
        if self.q.device != cupy.cuda.runtime.getDevice() or any(a % 16 for a in addresses):
            return False
        rows = self._row_addresses()
        stream = torch_stream_handle()(self.q.device) if torch else None
        launch(stream, *addresses, rows["delta"], rows["lse2"], rows["dq_accum"])
        return True

    def dq(self):
        """dQ of the blocks added so far, in q's dtype and layout."""
        if self.owner is not None:
            raise ValueError(f"rows {self.row0}.. share the dQ sum of a larger set of rows: read it there")
        bw, tq = self.backward, self.q
        b, hq, nq, d = tq.shape
        with cupy.cuda.Device(tq.device), stream_for(tq):
            dq = empty_like(tq, tq.shape, bw.spec.dtype)
            if not bw.plan.atomic_dq:
                dq[...] = self.dq_sum
                return dq
            values = dict(dq_accum=_ptr(self.dq_sum), dq=_ptr(dq), n_q=nq, heads_q=hq, n_pad=self.n_pad,
                          scale=self.scale, **_stride_values(("dq", as_device_tensor(dq, "dq"))))
            bw._launch("postprocess", values, bw._grid("postprocess", b, hq, 0, nq, 0, self.n_pad, tq.device), ())
        return dq


def _rows_layout(plan: BackwardPlan) -> tuple:
    """What decides how a backward lays out D's and the LSE's rows and atomic dQ's sum."""
    return plan.row_pad, plan.dkdv.block_q, plan.atomic_dq


def _forward_rows(tq: DeviceTensor, dout, out, lse, scale: float | None, d_v: int) -> tuple:
    """dout and out (like q, head_dim_v wide), lse (the forward's f32 [B, Hq, Nq]) and the scale, checked."""
    b, hq, nq, d = tq.shape
    tdo, to = (_like(x, name, tq, (b, hq, nq, d_v)) for x, name in ((dout, "dout"), (out, "out")))
    tl = as_device_tensor(lse, "lse")
    if tl.kind != tq.kind:
        raise ValueError(f"lse: a {tl.kind} array with {tq.kind} q; pass the lse the forward returned for these inputs")
    if tl.shape != (b, hq, nq) or tl.dtype != "float32" or tl.strides != (hq * nq, nq, 1):
        raise ValueError(f"lse: {tl.dtype} {tl.shape} strides {tl.strides}; expected the forward's contiguous "
                         f"float32 [{b}, {hq}, {nq}] (return_lse=True)")
    return tdo, to, tl, check_scale(scale, d)


def _stride_values(*named: tuple[str, DeviceTensor]) -> dict:
    """The kernels' <name>_sb, _sh, _sn arguments: batch, head and row strides in elements."""
    return {f"{name}_{axis}": stride for name, t in named for axis, stride in zip(("sb", "sh", "sn"), t.strides[:3])}


def _like(x, name: str, ref: DeviceTensor, shape: tuple | None = None) -> DeviceTensor:
    """x as a DeviceTensor of ref's framework, dtype and device, of `shape` (else ref's), with 16-byte rows."""
    t = as_device_tensor(x, name)
    shape = ref.shape if shape is None else shape
    if t.kind != ref.kind or t.dtype != ref.dtype or t.shape != shape or t.device != ref.device:
        raise ValueError(f"{name}: {t.kind} {t.dtype} {t.shape} on cuda:{t.device}; expected a {ref.kind} "
                         f"{ref.dtype} {shape} tensor on cuda:{ref.device}")
    if not _rows_readable(t):
        raise ValueError(f"{name}: strides {t.strides} (elements); the last must be 1 and the others positive "
                         f"multiples of 8 (16-byte rows): pass {name}.contiguous()")
    return t


def _rows_readable(t: DeviceTensor) -> bool:
    """Whether the kernels read t by its strides: unit last stride, 16-byte rows, no broadcast (a
    TMA map has no stride 0)."""
    return t.strides[-1] == 1 and all(s > 0 and s % 8 == 0 for s in t.strides[:-1]) and t.ptr % 16 == 0


def readable(x, what: str = "dout"):
    """x itself where the backward reads it by its strides (a model's dout is often a transposed
    view), else a contiguous copy (a broadcast dout from a pooled loss, odd strides)."""
    t = as_device_tensor(x, what)
    if _rows_readable(t):
        return x
    return x.contiguous() if t.kind == "torch" else cupy.ascontiguousarray(x)


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
