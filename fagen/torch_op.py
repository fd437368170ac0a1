"""fagen.attention as PyTorch operators: fagen::attention_forward and fagen::attention_backward
(torch.library), with fake implementations (shapes only) and an autograd formula, so
autograd, torch.compile(fullgraph=True) and CUDA graphs see one opaque op each way.

The ops launch fagen's kernels (fagen.runtime, fagen.backward) on torch's current stream; all
they allocate comes from torch's caching allocator, and they wait on the device only where the
runtime checks a side input's values, once per tensor object. Eager calls launch the same kernels
without the op, whose dispatch costs tens of microseconds of host time: those autograd does not
record (no_grad, inference, inputs that do not require grad) directly, those it records through
_EagerAttention (the op's implementation and formula); traced calls see the op. The mask travels as JSON of
fagen.spec.Mask's fields ("" for none): an op takes no Python objects.
"""

import inspect
import sys
from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

# torch.library's register_fake records its caller's file and line through inspect, whose first
# lookup of a frame's module walks sys.modules and, touching each module's __file__, loads every
# lazily imported module there: CuPy's cupyx and SciPy behind it, 0.34 s of an eager first call
# on an H200 host. Looked up once here, before the imports below bring CuPy in, the walk finds
# none, and the registrations below find this file's module in inspect's cache.
inspect.getframeinfo(sys._getframe())

from fagen import (backward, captured_grads, decode, dispatch, fp8_backward, fp8_inputs, key_split, mod_tracing,  # noqa: E402
                   runtime, side_inputs, variants, wide_head)
from fagen import incoherent as incoherent_rotation  # noqa: E402  (the parameter is named incoherent)
from fagen.device import layout_order  # noqa: E402
from fagen.fp8_backward_plan import FP8_BACKWARD_HEAD_DIMS, FP8_BACKWARD_MASKS  # noqa: E402
from fagen.spec import Mask  # noqa: E402
from fagen.wide_head_plan import WIDE_HEAD_DIMS  # noqa: E402


def mask_json(mask) -> str:
    """The mask as the ops carry it: JSON of fagen.spec.Mask's fields (a Mask, a dict of its
    fields or a kind name), "" for none."""
    return "" if mask is None else Mask.model_validate(mask).model_dump_json(exclude_defaults=True)


# pydantic is not traceable: torch.compile bakes mask_json's string in. This is what
# torch.compiler.assume_constant_result sets, without the import of torch._dynamo that the
# decorator makes (about a second, and the torch.compile machinery eager calls never use).
mask_json._dynamo_marked_constant = True
# Dynamo hands a marked function's arguments over as Python constants, and newer releases refuse
# a user-defined object there (a Mask a model passes: "UserDefinedObjectVariable(Mask) is not a
# constant") unless its class is a pytree constant: hashable and compared by value, as a frozen
# pydantic model is
if hasattr(torch.utils._pytree, "register_constant"):
    torch.utils._pytree.register_constant(Mask)


@lru_cache(maxsize=64)
def mask_of(text: str) -> Mask | None:
    """The mask mask_json encoded (None for "")."""
    return Mask.model_validate_json(text) if text else None


# Detached aliases of side inputs that require grad (a sinks parameter). The runtime reads them
# through __cuda_array_interface__, which PyTorch refuses on tensors that require grad, and
# checks their values once per object (a host sync): one alias per tensor keeps that check to
# the first call, so training steps (and CUDA graph captures after a warm-up) never sync.
_ALIASES = WeakIdKeyDictionary()


def _without_grad(t: Tensor | None) -> Tensor | None:
    if t is None or not t.requires_grad:
        return t
    alias = _ALIASES.get(t)
    if alias is None or (alias.data_ptr(), alias.shape, alias.stride()) != (t.data_ptr(), t.shape, t.stride()):
        alias = _ALIASES[t] = t.detach()  # new storage (t.data = ...): a new alias
    return alias


def _side_inputs(bias, alibi_slopes, sinks, doc_ids) -> dict:
    """The side inputs as the runtime takes them. Vectors and doc_ids made contiguous here, by
    torch (a no-op when they are), so the runtime never copies them into CuPy's memory pool."""
    vectors = (_without_grad(t) for t in (alibi_slopes, sinks, doc_ids))
    alibi_slopes, sinks, doc_ids = (None if t is None else t.contiguous() for t in vectors)
    return dict(bias=_without_grad(bias), alibi_slopes=alibi_slopes, sinks=sinks, doc_ids=doc_ids)


def _spec(q, mask: str, causal: bool, softcap: float | None, side: dict, keys: int | None = None, v=None):
    return dispatch.derive_spec(q, causal=causal, mask=mask_of(mask), softcap=softcap, keys=keys, v=v, **side)


# The ops are defined through a torch.library.Library rather than the custom_op decorator: the
# decorator wraps each implementation in torch._disable_dynamo, whose first call imports
# torch._dynamo (measured on a CPU host: a first call 1.05 s against 2.4 ms), which every eager
# process paid on its first call. torch.compile, autograd and opcheck see the ops alike: their
# schemas are inferred from the annotations, their fake implementations and autograd formula
# registered through torch.library as before.
_LIBRARY = torch.library.Library("fagen", "DEF")


def _op(fn):
    """fagen::<fn's name>, its schema from fn's annotations, fn its implementation on every device."""
    # pt2_compliant: as custom_op tags its ops (torch.compile's only_allow_pt2_compliant_ops)
    _LIBRARY.define(fn.__name__ + torch.library.infer_schema(fn, mutates_args=()), tags=(torch.Tag.pt2_compliant_tag,))
    _LIBRARY.impl(fn.__name__, fn, "CompositeExplicitAutograd")
    return fn


@_op
def attention_forward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], alibi_slopes: Optional[Tensor],
                      sinks: Optional[Tensor], doc_ids: Optional[Tensor], cache_seqlens: Optional[Tensor],
                      cache_leftpad: Optional[Tensor], mask: str, causal: bool, softcap: Optional[float],
                      scale: Optional[float], deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, Nq, head_dim_v] of q's dtype, lse [B, Hq, Nq] float32, natural log):
    fagen.attention's kernel for these arguments (deterministic is its backward's)."""
    side = _side_inputs(bias, alibi_slopes, sinks, doc_ids)
    if q.shape[-1] in WIDE_HEAD_DIMS:  # (head_dim 512: its own forward, which refuses what it does not run)
        return decode.attention(q, k, v, causal=causal, mask=mask_of(mask), softcap=softcap, scale=scale,
                                return_lse=True, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, **side)
    plain = _spec(q, mask, causal, softcap, side, keys=dispatch.sequence_keys(k), v=v)
    # a few query rows take the decode path (its backward is the plain one's)
    return decode.forward(plain, q, k, v, scale=scale, return_lse=True, cache_seqlens=cache_seqlens,
                          cache_leftpad=cache_leftpad, **side)


def _empty_out(q, head_dim_v, dtype=None):
    """A forward op's out [B, Hq, Nq, head_dim_v] for its fake: laid out as q, as the kernels'
    calls allocate it (device.empty_laid_out_as)."""
    return torch.empty_permuted((*q.shape[:3], head_dim_v), layout_order(q.stride()), dtype=dtype or q.dtype,
                                device=q.device)


@torch.library.register_fake("fagen::attention_forward")
def _(q, k, v, bias, alibi_slopes, sinks, doc_ids, cache_seqlens, cache_leftpad, mask, causal, softcap, scale,
      deterministic):
    b, hq, nq, _ = q.shape
    return _empty_out(q, v.shape[-1]), q.new_empty((b, hq, nq), dtype=torch.float32)


@_op
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       bias: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                       doc_ids: Optional[Tensor], mask: str, causal: bool, softcap: Optional[float],
                       scale: Optional[float], deterministic: bool,
                       bias_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks, dbias) of sum(out * dout) for the forward that gave out and lse from
    the same arguments. dsinks is [Hq] float32, zeros without sinks; dbias (bias_grad) is
    float32 of bias's shape, else empty (an op cannot return None). deterministic, or
    torch.use_deterministic_algorithms(True): no two blocks add into one element (bitwise
    repeatable)."""
    if dispatch.no_work(q.shape, k.shape):  # the forward computed nothing: out was constant (empty, or zeros)
        dbias = torch.zeros(bias.shape if bias_grad else (0,), dtype=torch.float32, device=q.device)
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                torch.zeros(q.shape[1], dtype=torch.float32, device=q.device), dbias)
    if q.shape[-1] in WIDE_HEAD_DIMS:  # head_dim 512: its own backward (no modifier, sinks or bias to differentiate)
        dq, dk, dv = wide_head.backward(dout, q, k, v, out, lse, causal=wide_head.causal_of(causal, mask_of(mask)),
                                        scale=scale, deterministic=_deterministic(deterministic))
        return (dq, dk, dv, torch.zeros(q.shape[1], dtype=torch.float32, device=q.device),
                torch.empty(0, dtype=torch.float32, device=q.device))
    key_split_causal = _key_split_causal(q, k, v, mask, causal, softcap, (bias, alibi_slopes, sinks, doc_ids),
                                         _deterministic(deterministic))
    if key_split_causal is not None:  # DeepSeek's 192/128: its own kernel (no modifier to differentiate)
        dq, dk, dv = key_split.backward(dout, q, k, v, out, lse, causal=key_split_causal, scale=scale)
        return (dq, dk, dv, torch.zeros(q.shape[1], dtype=torch.float32, device=q.device),
                torch.empty(0, dtype=torch.float32, device=q.device))
    side = _side_inputs(bias, alibi_slopes, sinks, doc_ids)
    spec = variants.trainable(_spec(q, mask, causal, softcap, side, v=v), _deterministic(deterministic), bias_grad)
    grads = backward.compile_backward(spec)(backward.readable(dout), q, k, v, out, lse, scale=scale, **side)
    dsinks = grads.dsinks if sinks is not None else torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
    dbias = grads.dbias if bias_grad else torch.empty(0, dtype=torch.float32, device=q.device)
    return grads.dq, grads.dk, grads.dv, dsinks, dbias


def _key_split_causal(q: Tensor, k: Tensor, v: Tensor, mask: str, causal: bool, softcap: float | None,
                      side: tuple, deterministic: bool) -> bool | None:
    """causal for fagen.key_split's backward where it runs this call (no mask or causal, nothing
    else to differentiate, its widths and types), else None."""
    if softcap is not None or any(t is not None for t in side) or q.shape[-1] == v.shape[-1]:
        return None
    whole = dispatch.call_mask(causal, mask_of(mask))
    if whole.kind not in ("none", "causal") or whole.expression is not None:
        return None
    is_causal = whole.kind == "causal"
    dtype = str(q.dtype).removeprefix("torch.")
    takes = key_split.takes(q.shape, k.shape, v.shape, dtype, q.device.index, causal=is_causal, align=whole.align,
                            deterministic=deterministic)
    return is_causal if takes else None


@torch.library.register_fake("fagen::attention_backward")
def _(dout, q, k, v, out, lse, bias, alibi_slopes, sinks, doc_ids, mask, causal, softcap, scale, deterministic,
      bias_grad):
    dbias = q.new_empty(bias.shape if bias_grad else (0,), dtype=torch.float32)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(q.shape[1], dtype=torch.float32), dbias)


def _deterministic(asked: bool) -> bool:
    """Asked for, or PyTorch's global switch on (as its own kernels honour it)."""
    return asked or torch.are_deterministic_algorithms_enabled()


# Refused where autograd would record a call with key ranges: before the op launches (attention),
# and by the op's own autograd registration for a direct call of it
RANGES_HAVE_NO_BACKWARD = ("cache_seqlens, cache_leftpad: key ranges are an inference layout (no backward); call "
                           "under torch.no_grad(), or train with the padding as a bias (0 on tokens, a large negative "
                           "value on pads)")


def _save_for_backward(ctx, inputs, output):
    q, k, v, bias, alibi_slopes, sinks, doc_ids, cache_seqlens, cache_leftpad, mask, causal, softcap, scale, \
        deterministic = inputs
    if (cache_seqlens is not None or cache_leftpad is not None) and any(ctx.needs_input_grad):
        raise ValueError(RANGES_HAVE_NO_BACKWARD)
    out, lse = output
    # d loss / d lse would change every row's D in the kernels: not supported, and said so by
    # lse.requires_grad being False rather than by a silently missing term
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, bias, alibi_slopes, sinks, doc_ids)
    ctx.statics = (mask, causal, softcap, scale, deterministic)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, bias, alibi_slopes, sinks, doc_ids = ctx.saved_tensors
    bias_grad = ctx.needs_input_grad[3]
    # eager: the implementation itself (the op's dispatch is host time a short backward waits on);
    # under tracing, the op that torch.compile records
    run = attention_backward if _eager(dout, q) else torch.ops.fagen.attention_backward
    dq, dk, dv, dsinks, dbias = run(dout, q, k, v, out, lse, bias, alibi_slopes, sinks, doc_ids, *ctx.statics, bias_grad)
    # alibi_slopes and doc_ids get none: slopes are fixed by design, ids are integers
    return (dq, dk, dv, dbias.to(bias.dtype) if bias_grad else None, None, dsinks if ctx.needs_input_grad[5] else None,
            *[None] * 8)


torch.library.register_autograd("fagen::attention_forward", _backward, setup_context=_save_for_backward)


# ---- fagen.flex's kernels, and its ops under torch.compile -----------------------------------
# What an op cannot carry, a block mask and a traced score_mod, is registered once for each
# (score_mod, block_mask) pair torch.compile traces (fagen.flex.flex_attention), and the ops take
# its index. The captured tensors are the ops' inputs (the score_mod's closure's tensors, `slots`
# picking the ones the trace read), so a graph reads whichever closure it is called with. Kept
# for the process: a compiled graph holds the index.
FLEX_CALLS: list[tuple] = []  # index -> (TracedScoreMod or None, fagen.masks.BlockMask or None, slots)


def flex_kernels_forward(q, k, v, traced, block_mask, scale, tables=()):
    """out, lse of fagen.flex's kernels for a traced score_mod (None: none) reading `tables` (its
    captured tensors), and a block mask: checked against these lengths, and one that is exactly a
    causal mask's pattern, or no mask, run on fagen's own causal or unmasked kernels."""
    extents = dict(b=q.shape[0], h=q.shape[1], q_idx=q.shape[2], kv_idx=k.shape[2])
    if traced is not None:
        mod_tracing.check_int32(traced, extents)
        mod_tracing.check_captured(traced, extents)
    spec, block_mask = _flex_spec(q, k, v, traced, block_mask)
    return runtime.compile_kernel(spec)(q, k, v, scale=scale, return_lse=True, block_mask=block_mask,
                                        captured=_flex_captured(tables, q))


def flex_kernels_backward(dout, q, k, v, out, lse, traced, block_mask, scale, tables=(), wanted=(),
                          inputs_wanted: bool = True):
    """(dq, dk, dv, the captured tensors' gradients) of fagen.flex's kernels (flex_kernels_forward's):
    a gradient for each captured tensor `wanted` says requires one (None for the others), summed
    by the dK/dV kernel where its reads allow (captured_grads.split_wanted), else by
    captured_grads.captured_grads. Without inputs_wanted (q, k and v frozen) the kernels run only
    where they sum a table, and dq, dk, dv are None."""
    spec, kernel_mask = _flex_spec(q, k, v, traced, block_mask)
    wanted = list(wanted) + [False] * (len(tables) - len(wanted))
    tree = captured_grads.score_tree(traced.expression, len(tables)) if any(wanted) else None
    extents = {"b": q.shape[0], "h": q.shape[1], "q_idx": q.shape[2], "kv_idx": k.shape[2]}
    fused, eager = captured_grads.split_wanted(tree, wanted, extents) if tree is not None else ((), wanted)
    sums = captured_grads.FixedPointSums(dout, v, tree, tables, fused) if fused else None
    dq = dk = dv = None
    if inputs_wanted or fused:
        grads = backward.compile_backward(variants.trainable(spec, _deterministic(False), captured_grads=fused))(
            backward.readable(dout), q, k, v, out, lse, scale=scale, block_mask=kernel_mask,
            captured=_flex_captured(tables, q), captured_sums=None if sums is None else (sums.sums, sums.scales))
        dq, dk, dv = grads.dq, grads.dk, grads.dv
    table_grads = captured_grads.captured_grads(dout, q, k, v, out, lse, tree, block_mask, scale, tables, eager) \
        if any(eager) else [None] * len(tables)
    for i, grad in ({} if sums is None else sums.gradients(tables, dk)).items():
        table_grads[i] = grad
    return dq, dk, dv, table_grads


def _flex_spec(q, k, v, traced, block_mask):
    """(spec, the block mask its kernels read): a block mask that is exactly a mask kind's pattern
    (masks.BlockMask.as_kind: none, causal, a causal window, prefix-LM) runs that kind's kernels,
    which read no list (d64 4k forward as a block mask against the kind's kernel: causal 392 against
    ~450-500 TFLOP/s, sliding window 275 against 342, prefix-LM 401 against 448), and its block mask
    is then None."""
    mask = None
    if block_mask is not None:
        side_inputs.check_block_mask(block_mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        mask = block_mask.as_kind()
        if mask is not None:
            block_mask = None
    fields = None if traced is None else (traced.expression, traced.expression_grad, len(traced.captured))
    return dispatch.derive_spec(q, mask=mask, block_mask=block_mask, keys=dispatch.sequence_keys(k), v=v,
                                score_expression=fields), block_mask


def _flex_captured(tables, q) -> list | None:
    """Captured tensors as the kernels read them: float32, contiguous, on q's device (the tensors
    themselves where they are: a CUDA graph reads their current values)."""
    return [t.detach().to(q.device, torch.float32).contiguous() for t in tables] or None


@_op
def flex_forward(q: Tensor, k: Tensor, v: Tensor, captured: list[Tensor], call: int,
                 scale: Optional[float]) -> tuple[Tensor, Tensor]:
    """(out, lse) of fagen.flex.flex_attention's registered call `call` (FLEX_CALLS), its
    score_mod's closure's tensors `captured`."""
    traced, block_mask, slots = FLEX_CALLS[call]
    return flex_kernels_forward(q, k, v, traced, block_mask, scale, [captured[i] for i in slots])


@torch.library.register_fake("fagen::flex_forward")
def _(q, k, v, captured, call, scale):
    b, hq, nq, _ = q.shape
    return _empty_out(q, v.shape[-1]), q.new_empty((b, hq, nq), dtype=torch.float32)


@_op
def flex_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, captured: list[Tensor],
                  call: int, scale: Optional[float], wanted: list[bool],
                  inputs_wanted: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """(dq, dk, dv, d loss / d each of `captured` that is `wanted`, zeros for the others) of
    sum(out * dout) for flex_forward's call (dq, dk, dv zeros without inputs_wanted, where the
    kernels do not run for them)."""
    traced, block_mask, slots = FLEX_CALLS[call]
    dq, dk, dv, grads = flex_kernels_backward(dout, q, k, v, out, lse, traced, block_mask, scale,
                                              [captured[i] for i in slots], [wanted[i] for i in slots], inputs_wanted)
    by_slot = {slot: grad for slot, grad in zip(slots, grads) if grad is not None}
    dq, dk, dv = (torch.zeros_like(x) if g is None else g for g, x in ((dq, q), (dk, k), (dv, v)))
    return dq, dk, dv, [by_slot[i] if i in by_slot else torch.zeros_like(t) for i, t in enumerate(captured)]


@torch.library.register_fake("fagen::flex_backward")
def _(dout, q, k, v, out, lse, captured, call, scale, wanted, inputs_wanted):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), [t.new_empty(t.shape) for t in captured]


def _flex_save(ctx, inputs, output):
    q, k, v, captured, call, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, *captured)
    ctx.call, ctx.scale = call, scale
    ctx.wanted = [t.requires_grad for t in captured]  # a learned table's gradient
    ctx.inputs_wanted = any(t.requires_grad for t in (q, k, v))


def _flex_backward(ctx, dout, _dlse):
    q, k, v, out, lse, *captured = ctx.saved_tensors
    dq, dk, dv, grads = torch.ops.fagen.flex_backward(dout, q, k, v, out, lse, captured, ctx.call, ctx.scale,
                                                      ctx.wanted, ctx.inputs_wanted)
    return dq, dk, dv, [g if w else None for g, w in zip(grads, ctx.wanted)], None, None


torch.library.register_autograd("fagen::flex_forward", _flex_backward, setup_context=_flex_save)


class _EagerAttention(torch.autograd.Function):
    """fagen::attention_forward's implementation and autograd formula, for eager calls autograd
    records: the same kernels, saved tensors and checks, without the op's dispatch and default
    filling (about half a millisecond of host time a training step, measured on an H200 host,
    which a short sequence's forward and backward wait on). Traced calls take the op."""

    forward = staticmethod(attention_forward)
    setup_context = staticmethod(_save_for_backward)  # (the style torch.func's transforms need)
    backward = staticmethod(_backward)


class _EagerKernelAttention(torch.autograd.Function):
    """Autograd for what the op cannot carry: a runtime block mask (a BlockMask is no tensor). The
    same kernels run eagerly (torch.compile breaks the graph here), on torch's stream."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, block_mask, causal, mask, softcap, scale, deterministic, side):
        spec = dispatch.derive_spec(q, causal=causal, mask=mask, softcap=softcap, block_mask=block_mask, v=v, **side)
        out, lse = runtime.compile_kernel(spec)(q, k, v, scale=scale, return_lse=True, block_mask=block_mask, **side)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.block_mask, ctx.scale, ctx.side, ctx.deterministic = spec, block_mask, scale, side, deterministic
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        bias = ctx.side["bias"]
        spec = variants.trainable(ctx.spec, _deterministic(ctx.deterministic), ctx.needs_input_grad[3])
        grads = backward.compile_backward(spec)(backward.readable(dout), q, k, v, out, lse, scale=ctx.scale,
                                                block_mask=ctx.block_mask, **ctx.side)
        return (grads.dq, grads.dk, grads.dv, grads.dbias.to(bias.dtype) if ctx.needs_input_grad[3] else None,
                grads.dsinks if ctx.needs_input_grad[4] else None, *[None] * 7)


FP8_TYPES = {torch.float8_e4m3fn: "float8_e4m3", torch.float8_e5m2: "float8_e5m2"}  # torch's dtype: fagen's


@_op
def fp8_attention_forward(q: Tensor, k: Tensor, v: Tensor, q_descale: Optional[Tensor], k_descale: Optional[Tensor],
                          v_descale: Optional[Tensor], sinks: Optional[Tensor], alibi_slopes: Optional[Tensor],
                          bias: Optional[Tensor], doc_ids: Optional[Tensor], mask: str, causal: bool,
                          softcap: Optional[float], scale: Optional[float], scale_o: Optional[Tensor],
                          return_amax: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(out [B, Hq, Nq, d], lse [B, Hq, Nq] float32, amax) with FlashAttention-3's descales (float32, one
    number or [B, Hkv]; None is 1): FP8 q, k, v: the FP8 forward, bfloat16 out (sinks: float32 [Hq]
    logits; alibi_slopes float32 [Hq]; bias [B, Hq, Nk] or [B, Hq, Nq, Nk], added to the scaled
    scores; doc_ids [B|1, N] int32: a document mask), or for a decode step's few rows
    (_decodes_on_cache) the FP8 KV cache's kernels, which widen q as it lands and read
    q_descale beside k's; a half-type q against FP8 k and v (an FP8 KV cache; q_descale only for
    an FP8 q, which fagen.attention refuses for a half-type q given): the decode kernels' FP8
    variant, out in q's type. scale_o (float32 [1]; FP8 q, k, v): the FP8 forward's e4m3 out,
    e4m3(O * scale_o) saturated; the third output is max |O| (float32 [1]) with return_amax, else
    empty ([0])."""
    fp8_inputs.check_output_request(scale_o, return_amax, q.dtype in FP8_TYPES and k.dtype == v.dtype == q.dtype,
                                    f"q is {q.dtype}, k {k.dtype}, v {v.dtype}")
    amax = q.new_empty((1 if return_amax else 0,), dtype=torch.float32)  # (zeroed by the launch that writes it)
    if scale_o is None and (q.dtype not in FP8_TYPES or _decodes_on_cache(
            q, k, v, causal, mask_of(mask), softcap, sinks=sinks, alibi_slopes=alibi_slopes, bias=bias, doc_ids=doc_ids)):
        out, lse = decode.attention(q, k, v, mask=mask_of(mask), causal=causal, softcap=softcap, scale=scale,
                                    return_lse=True, sinks=sinks, alibi_slopes=alibi_slopes, q_descale=q_descale,
                                    k_descale=k_descale, v_descale=v_descale)
        return out, lse, amax
    out, lse = _fp8_forward(q, k, v, (q_descale, k_descale, v_descale), mask_of(mask), causal, softcap, scale,
                            sinks=sinks, alibi_slopes=alibi_slopes, bias=bias, doc_ids=doc_ids, scale_o=scale_o,
                            amax_o=amax if return_amax else None)
    return out, lse, amax


def _kept_fp8_call(q, k, v, causal: bool, mask, softcap, scale, sinks, return_lse: bool, ranges: tuple,
                   descales: tuple):
    """decode.SHAPE_CLASSES for a call with descales: an FP8 KV cache's (a half-type q), or FP8 q,
    k, v of a decode step (the class decides: dispatch.fp8_on_cache_kernels); NotImplemented for the
    rest (a half-type q with q_descale is refused by the general path, the FP8 forward has no
    class)."""
    if k.dtype not in FP8_TYPES or descales[0] is not None and q.dtype not in FP8_TYPES:
        return NotImplemented  # descales beside half-type k and v, or q_descale of a half-type q: refused there
    return decode.SHAPE_CLASSES(q, k, v, causal, mask, softcap, scale, sinks if sinks is None else _without_grad(sinks),
                                return_lse, ranges, descales)


def _decodes_on_cache(q, k, v, causal: bool, mask, softcap, **side) -> bool:
    """Whether FP8 q, k, v run on an FP8 KV cache's kernels (dispatch.fp8_on_cache_kernels: they
    widen q as it lands and read q_descale beside k's), not the FP8 forward. side: the side inputs,
    and `ranged` (key ranges given)."""
    return k.dtype == q.dtype == v.dtype and dispatch.fp8_on_cache_kernels(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), FP8_TYPES[k.dtype], causal=causal, mask=mask, softcap=softcap,
        gpu=q.get_device(), **side)


def _fp8_forward(q, k, v, descales, mask: Mask | None, causal: bool, softcap, scale, *, scale_o=None, amax_o=None,
                 **side):
    """The FP8 forward's kernel for these arguments (side: sinks, alibi_slopes, bias, doc_ids,
    block_mask; None where not given; scale_o: its e4m3 output, amax_o written where given),
    launched: (out, lse)."""
    spec = dispatch.fp8_forward_spec(FP8_TYPES[q.dtype], q.shape[-1], causal, mask, softcap=softcap,
                                     out_dtype=None if scale_o is None else fp8_inputs.OUTPUT_TYPE, **side)
    side = {name: x for name, x in side.items() if x is not None}
    if scale_o is not None:
        side.update(scale_o=scale_o, amax_o=amax_o)
    q_descale, k_descale, v_descale = descales
    return runtime.compile_kernel(spec)(q, k, v, scale=scale, return_lse=True, q_descale=q_descale,
                                        k_descale=k_descale, v_descale=v_descale, **side)


@torch.library.register_fake("fagen::fp8_attention_forward")
def _(q, k, v, q_descale, k_descale, v_descale, sinks, alibi_slopes, bias, doc_ids, mask, causal, softcap, scale,
      scale_o, return_amax):
    b, hq, nq, _ = q.shape
    out_type = torch.float8_e4m3fn if scale_o is not None else torch.bfloat16 if q.dtype in FP8_TYPES else q.dtype
    return (_empty_out(q, v.shape[-1], out_type), q.new_empty((b, hq, nq), dtype=torch.float32),
            q.new_empty((1 if return_amax else 0,), dtype=torch.float32))


def _fp8_attention(q, k, v, causal, mask, softcap, scale, return_lse, descales, *, sinks=None, alibi_slopes=None,
                   bias=None, doc_ids=None, block_mask=None, cache_seqlens=None, cache_leftpad=None, scale_o=None,
                   return_amax: bool = False):
    """The FP8 forward, or a half-type q against an FP8 KV cache (k and v FP8): straight to the
    kernels eagerly, through fagen::fp8_attention_forward under torch.compile (which sees no
    gradient: there is no backward for FP8 tensors given; fp8=True has one). A block_mask (no
    tensor) and key ranges (the op carries none) run eagerly only. FP8 q, k, v of a decode step
    (dispatch.fp8_on_cache_kernels) run as an FP8 KV cache's, q widened as it lands. scale_o: the
    FP8 forward's e4m3 out (the decode kernels write bfloat16, so a decode step takes the forward
    too), max |O| returned last with return_amax."""
    fp8_q = q.dtype in FP8_TYPES
    fp8_inputs.check_output_request(scale_o, return_amax, fp8_q and k.dtype == v.dtype == q.dtype,
                                    f"q is {q.dtype}, k {k.dtype}, v {v.dtype}")
    # (traced: the op's body decides, unseen)
    decodes = fp8_q and scale_o is None and not torch.compiler.is_compiling() and _decodes_on_cache(
        q, k, v, causal, mask, softcap, sinks=sinks, alibi_slopes=alibi_slopes, bias=bias, doc_ids=doc_ids,
        block_mask=block_mask, ranged=cache_seqlens is not None or cache_leftpad is not None)
    kv_cache = k.dtype in FP8_TYPES and (not fp8_q or decodes)
    what = (f"q {q.dtype} against an FP8 KV cache" if kv_cache and not fp8_q
            else f"{q.dtype} q, k, v (the FP8 forward{', a decode step' if kv_cache else ''})")
    if not fp8_q and not kv_cache:
        raise ValueError(f"q_descale, k_descale, v_descale: for float8_e4m3fn or float8_e5m2 tensors (FlashAttention-3's "
                         f"FP8 forward, or k and v of an FP8 KV cache); q is {q.dtype}, k {k.dtype}")
    side = {"sinks": sinks, "alibi_slopes": alibi_slopes, "bias": bias, "doc_ids": doc_ids, "block_mask": block_mask}
    ranges = {"cache_seqlens": cache_seqlens, "cache_leftpad": cache_leftpad}
    # what the decode kernels, GQA-packed, take beside a mask of positions; the FP8 forward takes
    # the side inputs, not key ranges
    packs = ("sinks", "alibi_slopes", *ranges)
    taken = {**side, **ranges}.items() if kv_cache else ranges.items()
    unsupported = [name for name, x in taken if x is not None and not (kv_cache and name in packs)]
    if kv_cache and not fp8_q and descales[0] is not None:
        raise ValueError(f"q_descale: q is {q.dtype}, which has no descale; pass k_descale and v_descale for the "
                         f"{k.dtype} k and v only")
    if unsupported and scale_o is not None and unsupported[0] in ranges:
        raise ValueError(f"{unsupported[0]}: not with scale_o (the FP8 forward writes e4m3 out, and takes no key "
                         f"ranges; the FP8 KV cache's kernels, which do, write bfloat16): drop scale_o, or "
                         f"{unsupported[0]}")
    if unsupported:
        raise ValueError(f"{unsupported[0]}: not with {what} yet (it takes causal, mask, softcap, scale, "
                         f"{', '.join(packs if kv_cache else side)} and the descales); pass bfloat16 tensors for it")
    if _records_grad(q, k, v, sinks, bias):
        raise ValueError(f"{what}: no backward yet; call it under torch.no_grad()" + (
            "" if kv_cache and not fp8_q
            else ", or pass bfloat16 tensors with fp8=True (quantized inside, with the FP8 backward)"))
    if kv_cache and (cache_seqlens is not None or cache_leftpad is not None):  # eagerly: the op carries no ranges
        if not _eager(q, k, v, *descales, cache_seqlens, cache_leftpad):
            raise ValueError("cache_seqlens, cache_leftpad with an FP8 KV cache: eager calls only yet (the op "
                             "fagen::fp8_attention_forward carries no key ranges); call it outside torch.compile")
        return decode.attention(q, k, v, mask=mask, causal=causal, softcap=softcap, scale=scale, return_lse=return_lse,
                                sinks=sinks, alibi_slopes=alibi_slopes, cache_seqlens=cache_seqlens,
                                cache_leftpad=cache_leftpad, q_descale=descales[0], k_descale=descales[1],
                                v_descale=descales[2])
    if not (q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and k.dtype == v.dtype and (kv_cache or q.dtype == k.dtype)):
        raise ValueError(f"q, k, v: {q.dtype} {tuple(q.shape)}, {k.dtype} {tuple(k.shape)}, {v.dtype} "
                         f"{tuple(v.shape)}; the FP8 forward takes all three of one FP8 type, an FP8 KV cache a "
                         f"float16 or bfloat16 q with k and v of one FP8 type, each [B, H, N, d]")
    # descales as the op takes them: tensors (a number becomes one, on q's device)
    descales = [x if x is None or isinstance(x, Tensor) else torch.full((1,), float(x), device=q.device)
                for x in descales]
    if scale_o is not None and not isinstance(scale_o, Tensor):
        scale_o = torch.full((1,), fp8_inputs.checked_output_scale(scale_o), dtype=torch.float32, device=q.device)
    if sinks is not None and not isinstance(sinks, Tensor):
        sinks = torch.as_tensor(sinks, dtype=torch.float32, device=q.device)
    alibi_slopes, bias, doc_ids = (x if x is None or isinstance(x, Tensor) else torch.as_tensor(x, device=q.device)
                                   for x in (alibi_slopes, bias, doc_ids))
    eager = _eager(q, k, v, *descales, sinks, alibi_slopes, bias, doc_ids, scale_o)
    if block_mask is not None:
        if not eager:
            raise ValueError("block_mask with FP8 q, k, v: eager calls only (a BlockMask is no tensor, so it cannot "
                             "enter fagen::fp8_attention_forward); call it outside torch.compile, or pass doc_ids "
                             "or a mask kind of positions instead")
        amax = q.new_empty((1,), dtype=torch.float32) if return_amax else None
        out, lse = _fp8_forward(q, k, v, descales, mask_of(mask_json(mask)), causal, softcap, scale, sinks=sinks,
                                alibi_slopes=alibi_slopes, bias=bias, block_mask=block_mask, scale_o=scale_o,
                                amax_o=amax)
    elif eager:
        out, lse, amax = fp8_attention_forward(q, k, v, *descales, sinks, alibi_slopes, bias, doc_ids, mask_json(mask),
                                               causal, softcap, scale, scale_o, return_amax)
    else:
        out, lse, amax = torch.ops.fagen.fp8_attention_forward(q, k, v, *descales, sinks, alibi_slopes, bias, doc_ids,
                                                               mask_json(mask), causal, softcap, scale, scale_o,
                                                               return_amax)
    asked = ((lse,) if return_lse else ()) + ((amax,) if return_amax else ())
    return (out, *asked) if asked else out


def _fp8_quantized_attention(q, k, v, mask: Mask, scale, return_lse: bool, deterministic: bool, others: list[str],
                             incoherent: bool = False):
    """fagen.attention(..., fp8=True): its checks, then _Fp8Quantized."""
    if others:
        raise ValueError(f"{others[0]}: not with fp8=True (it takes causal, mask, scale, deterministic and "
                         f"return_lse; the scales are its own); drop it, or call without fp8")
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, Tensor) or t.dtype != torch.bfloat16 or t.dim() != 4 or not t.is_cuda:
            raise ValueError(f"{name}: {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}; "
                             f"fp8=True quantizes bfloat16 CUDA tensors [B, H, N, d] (pass q.bfloat16() and so on)")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: fp8=True takes k and v of one "
                         f"[B, Hkv, Nk], q's B, and Hq a multiple of Hkv (its scales are a batch and KV head's)")
    if q.shape[-1] not in FP8_BACKWARD_HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        raise ValueError(f"head_dim: q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}; fp8=True takes "
                         f"{' or '.join(map(str, FP8_BACKWARD_HEAD_DIMS))} for all three (the FP8 backward's)")
    if mask.kind not in FP8_BACKWARD_MASKS or mask.expression is not None:
        raise ValueError(f"mask: kind {mask.kind!r}{' with an expression' if mask.expression else ''}; fp8=True "
                         f"takes {', '.join(FP8_BACKWARD_MASKS)} (the FP8 backward's); call without fp8 for it")
    if not _eager(q, k, v):
        raise ValueError("fp8=True: eager calls only yet (no op for torch.compile or a graph being traced); "
                         "call it outside torch.compile")
    out, lse = _Fp8Quantized.apply(q, k, v, mask, scale, deterministic, incoherent)
    return (out, lse) if return_lse else out


class _Fp8Quantized(torch.autograd.Function):
    """fp8=True's forward and backward: q, k, v quantized (fp8_inputs.quantized; q and k rotated
    first where incoherent), the FP8 forward, and fagen.fp8_backward's gradients of attention over
    the quantized tensors, handed to q, k, v as theirs (straight through the rounding; dq and dk
    rotated back)."""

    @staticmethod
    def forward(ctx, q, k, v, mask: Mask, scale, deterministic: bool, incoherent: bool = False):
        if incoherent:  # float32 products, rounded once, to e4m3
            q, k = incoherent_rotation.rotate(q.detach()), incoherent_rotation.rotate(k.detach())
        (q8, qd), (k8, kd), (v8, vd) = (fp8_inputs.quantized(x, k.shape[1]) for x in (q, k, v))
        # the FP8 forward itself, whatever the shape (the cache's kernels would round P otherwise than the
        # backward's model of it: fp8_backward_rounding)
        out, lse = _fp8_forward(q8, k8, v8, (qd, kd, vd), mask, False, None, scale)
        ctx.save_for_backward(q8, k8, v8, qd, kd, vd, out, lse)
        ctx.mask, ctx.scale, ctx.deterministic, ctx.incoherent = mask, scale, deterministic, incoherent
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        q8, k8, v8, qd, kd, vd, out, lse = ctx.saved_tensors
        dq, dk, dv = fp8_backward.backward(dout, q8, k8, v8, out, lse, mask=ctx.mask, scale=ctx.scale, q_descale=qd,
                                           k_descale=kd, v_descale=vd, deterministic=ctx.deterministic)
        if ctx.incoherent:
            dq, dk = (incoherent_rotation.unrotate(g).to(g.dtype) for g in (dq, dk))
        return dq, dk, dv, None, None, None, None


def _records_grad(*tensors) -> bool:
    """Whether autograd records a call on these tensors (anything else given, a list or an array, is not one)."""
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def _eager(*tensors) -> bool:
    """Plain tensors (or parameters, or absent ones) outside torch.compile's tracing: no fake,
    functional or other subclass that only the op's registrations know how to run."""
    return not torch.compiler.is_compiling() and all(t is None or type(t) in _PLAIN for t in tensors)


_PLAIN = (Tensor, torch.nn.Parameter)


def attention(q, k, v, *, causal: bool = False, mask=None, softcap: float | None = None, scale: float | None = None,
              return_lse: bool = False, block_mask=None, bias=None, alibi_slopes=None, sinks=None, doc_ids=None,
              deterministic: bool = False, cache_seqlens=None, cache_leftpad=None, q_descale=None, k_descale=None,
              v_descale=None, fp8: bool = False, incoherent: bool = False, scale_o=None, return_amax: bool = False):
    """fagen.attention for PyTorch tensors: through fagen::attention_forward, so gradients flow
    to q, k, v, bias and sinks. lse (return_lse=True) carries no gradient. A block_mask is no tensor,
    so it cannot enter an op: its gradients come from an eager autograd.Function instead.
    deterministic (as FlashAttention's; or torch.use_deterministic_algorithms(True)): a backward
    without atomics, bitwise repeatable, where the default adds dQ atomically (sm_90a).
    cache_seqlens, cache_leftpad (int32 [B] on q's GPU, FlashAttention's names): sequence b's keys
    are rows cache_leftpad[b] .. cache_seqlens[b] of k and v, read on the device (inference).
    q, k, v float8_e4m3fn or float8_e5m2: the FP8 forward (bfloat16 out), with FlashAttention-3's q_descale,
    k_descale, v_descale (float32, one number or [B, Hkv]; None is 1), and the masks (doc_ids; a
    block_mask in eager calls), softcap, sinks, ALiBi slopes and biases as for half types; a decode
    step's (a KV head's query rows few enough for a decode kernel) runs as an FP8 KV cache's, q
    widened to float16 exactly as it lands, its descale read beside k's (GQA packed, keys split). A float16
    or bfloat16 q against FP8 k and v: an FP8 KV cache, read by the decode kernels (k_descale,
    v_descale; masks of positions, softcap, sinks, ALiBi slopes and, eagerly, key ranges; out in q's
    type).
    scale_o (FP8 q, k, v; a number or float32 [1] on q's GPU): out in float8_e4m3fn, e4m3(O * scale_o)
    rounded to nearest and saturated (cuDNN's FP8 output); return_amax=True returns max |O| (float32
    [1], for the next call's scale_o) last: (out, amax_o), or (out, lse, amax_o).
    fp8=True: bfloat16 q, k, v quantized to e4m3 inside (a scale a batch and KV head, from their
    amax), the FP8 forward and, where autograd records, the FP8 backward (fagen.fp8_backward);
    bfloat16 out and gradients, passed straight through the rounding to q, k and v. incoherent=True
    (with fp8=True): q and k rotated by one orthogonal matrix before they are quantized
    (fagen.incoherent), which leaves the scores as they are but spreads outlier channels, so that
    a head's scale does not spend e4m3's range on a few of them; dq and dk rotate back."""
    if incoherent and not fp8:
        raise ValueError("incoherent=True: only with fp8=True (it rotates q and k before they are quantized); "
                         "for FP8 tensors you quantize yourself, rotate q and k with fagen.incoherent.rotate first")
    if scale_o is not None or return_amax:  # an FP8 output: the FP8 forward's alone
        if fp8:
            raise ValueError(f"{'scale_o' if scale_o is not None else 'return_amax'}: not with fp8=True (its output "
                             f"is bfloat16, for its backward); quantize q, k and v yourself "
                             f"(fagen.fp8_inputs.quantized) and pass the FP8 tensors with their descales")
        return _fp8_attention(q, k, v, causal, mask, softcap, scale, return_lse, (q_descale, k_descale, v_descale),
                              sinks=sinks, alibi_slopes=alibi_slopes, bias=bias, doc_ids=doc_ids,
                              block_mask=block_mask, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
                              scale_o=scale_o, return_amax=return_amax)
    if fp8:
        others = {"softcap": softcap, "block_mask": block_mask, "bias": bias, "alibi_slopes": alibi_slopes,
                  "sinks": sinks, "doc_ids": doc_ids, "cache_seqlens": cache_seqlens, "cache_leftpad": cache_leftpad,
                  "q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
        return _fp8_quantized_attention(q, k, v, dispatch.call_mask(causal, mask), scale, return_lse,
                                        _deterministic(deterministic), [n for n, x in others.items() if x is not None],
                                        incoherent)
    ranged = cache_seqlens is not None or cache_leftpad is not None
    # q, k and v plain tensors outside tracing, in a call autograd does not record (_eager and
    # _records_grad's test, spelled out inline: a decode loop's host time)
    if (bias is None and alibi_slopes is None and doc_ids is None and block_mask is None
            and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and (sinks is None or isinstance(sinks, Tensor) and sinks.is_cuda and sinks.is_contiguous()
                 and not (sinks.requires_grad and torch.is_grad_enabled()))):
        # an eager call for inference, the common case of a generation loop: its shape class's
        # packed launch where one is kept (decode.ShapeClasses), before any other work. Sinks on
        # the GPU only: the kernel reads those in place, where host ones are copied at packing.
        # FP8 q and wide heads have no class (ShapeClasses declines them): their paths below
        if q_descale is None and k_descale is None and v_descale is None:
            done = decode.SHAPE_CLASSES(q, k, v, causal, mask, softcap, scale,
                                        sinks if sinks is None else _without_grad(sinks), return_lse,
                                        (cache_seqlens, cache_leftpad) if ranged else ())
        else:  # an FP8 KV cache: its descales in its class's key; FP8 q, k, v of a decode step too
            done = _kept_fp8_call(q, k, v, causal, mask, softcap, scale, sinks, return_lse,
                                  (cache_seqlens, cache_leftpad) if ranged else (), (q_descale, k_descale, v_descale))
        if done is not NotImplemented:
            return done
    if (q.dtype in FP8_TYPES or k.dtype in FP8_TYPES or q_descale is not None or k_descale is not None
            or v_descale is not None):
        return _fp8_attention(q, k, v, causal, mask, softcap, scale, return_lse, (q_descale, k_descale, v_descale),
                              sinks=sinks, alibi_slopes=alibi_slopes, bias=bias, doc_ids=doc_ids, block_mask=block_mask,
                              cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad)
    if q.dim() and q.shape[-1] in WIDE_HEAD_DIMS:  # head_dim 512: its own forward and backward
        records = _records_grad(q, k, v, bias, sinks)
        if _eager(q, k, v) and not records:
            return decode.attention(q, k, v, causal=causal, mask=mask, softcap=softcap, scale=scale,
                                    return_lse=return_lse, block_mask=block_mask, bias=bias, alibi_slopes=alibi_slopes,
                                    sinks=sinks, doc_ids=doc_ids, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad)
        # recorded or traced: the op (or its eager twin), the options it does not run refused here (the mask by the op)
        wide_head.refuse_others(softcap=softcap, block_mask=block_mask, bias=bias, alibi_slopes=alibi_slopes,
                                sinks=sinks, doc_ids=doc_ids, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad)
        if records and _deterministic(deterministic):
            wide_head.refuse_deterministic()
        forward = _EagerAttention.apply if _eager(q, k, v) else torch.ops.fagen.attention_forward
        out, lse = forward(q, k, v, None, None, None, None, None, None, mask_json(mask), causal, None, scale,
                           deterministic)
        return (out, lse) if return_lse else out
    if ranged and _records_grad(q, k, v, bias, sinks):
        raise ValueError(RANGES_HAVE_NO_BACKWARD)
    # side inputs given as NumPy or CuPy arrays, as the runtime takes them: tensors on q's device
    bias, alibi_slopes, sinks, doc_ids = (
        x if x is None or isinstance(x, torch.Tensor) else torch.as_tensor(x, device=q.device)
        for x in (bias, alibi_slopes, sinks, doc_ids))
    if block_mask is not None:
        side = _side_inputs(bias, alibi_slopes, sinks, doc_ids)
        if not _records_grad(q, k, v, bias, sinks):
            return decode.attention(q, k, v, causal=causal, mask=mask, softcap=softcap, scale=scale,
                                    return_lse=return_lse, block_mask=block_mask, **side)
        out, lse = _EagerKernelAttention.apply(q, k, v, bias, sinks, block_mask, causal, mask, softcap, scale,
                                             deterministic, side)
        return (out, lse) if return_lse else out
    if _eager(q, k, v) and not _records_grad(q, k, v, bias, sinks):
        # nothing for autograd or a compiler to see: the op's dispatch would add tens of microseconds
        # of host time to the same launches
        return decode.attention(q, k, v, causal=causal, mask=mask, softcap=softcap, scale=scale,
                                return_lse=return_lse, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
                                **_side_inputs(bias, alibi_slopes, sinks, doc_ids))
    forward = _EagerAttention.apply if _eager(q, k, v, bias, sinks) else torch.ops.fagen.attention_forward
    out, lse = forward(q, k, v, bias, alibi_slopes, sinks, doc_ids, cache_seqlens, cache_leftpad, mask_json(mask), causal,
                       softcap, scale, deterministic)
    return (out, lse) if return_lse else out
