"""The float64 NumPy reference every kernel is diffed against: exactly the kernels' semantics.

- q: [B, Hq, Nq, d]; k, v: [B, Hkv, Nk, d] with Hq a multiple of Hkv (query head h reads
  KV head h // (Hq // Hkv)).
- s = q.k * scale (scale defaults to 1 / sqrt(d)), then, in this order: softcap
  (cap * tanh(s / cap)), ALiBi (- slope_h * |q + Nk - Nq - k|), bias (vector [B|1, H|1, Nk] or
  matrix [B|1, H|1, Nq, Nk]), score_mod(s, b, h, q_idx, kv_idx); then the mask. score_mod may
  be a spec's ScoreMod (or a dict of its fields) instead: then its softcap, ALiBi and
  expression apply (expression_grad is its derivative for the backward), and the side inputs
  it asks for must be given (geometric ALiBi slopes are computed).
- causal is aligned to the bottom right: query i sees key j iff j <= i + Nk - Nq. `mask` (a
  spec's Mask, dict or kind), `block_mask`, `doc_ids` and `mask_mod(b, h, q_idx, kv_idx)` all
  AND together.
- a spec's expressions are evaluated from the syntax tree the kernel is printed from
  (fagen.expression): a mask expression with the kernel's int32 and float32 arithmetic (the
  same pairs kept), a score expression in float64 (the formula's value).
- sinks [Hq]: one finite logit per head that joins each row's max and denominator but has no
  value.
- a row with no visible key gives O = 0 and LSE = -inf (with sinks: the sink's logit); a NaN
  in a row's visible scores gives NaN O and LSE.
- side inputs of the wrong shape, and a block_mask / document mask kind without its array, are
  refused by the runtime's rules (fagen.side_inputs).

attention_varlen and attention_paged apply it per sequence of a varlen batch or a paged
cache (FlashAttention's layouts, fagen.sequences), each sequence a batch of one; a sequence
with no keys gives O = 0 and LSE = -inf, as a row with no visible key does.

FP8 (attention's q_descale, k_descale, v_descale, p_type, p_scale): q, k and v hold an FP8
tensor's values (each rounded to its element type by the caller) and the descales, one number or
one per (batch row, KV head) as FlashAttention-3's, give the real ones: s = q.k * scale *
q_descale * k_descale. The kernel's steps are kept: P = exp(s - max) unnormalised, its row sum l
in full precision, P * p_scale rounded to p_type (round to nearest even) and divided back, then
O = (P.V) * v_descale / l.

attention_backward differentiates the same computation analytically (dq, dk, dv; dbias, dsinks),
sharing its scores, mask and softmax through _attend.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from fagen import expression, fp8_backward_rounding, mask_kinds, side_inputs
from fagen.derivatives import read_derivatives
from fagen.element_types import element_type


def causal_mask(n_q: int, n_kv: int) -> np.ndarray:
    """[n_q, n_kv] bool, True where query i may see key j (bottom-right aligned)."""
    return np.arange(n_kv)[None, :] <= np.arange(n_q)[:, None] + (n_kv - n_q)


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
              mask=None, block_mask=None, doc_ids=None, mask_mod=None, softcap: float | None = None,
              alibi_slopes=None, bias=None, score_mod=None, sinks=None, captured=None,
              q_descale=None, k_descale=None, v_descale=None, p_type: str | None = None, p_scale: float = 1.0):
    f = _attend(q, k, v, causal=causal, scale=scale, mask=mask, block_mask=block_mask, doc_ids=doc_ids,
                mask_mod=mask_mod, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, score_mod=score_mod,
                sinks=sinks, captured=captured, quantized=_quantized(q_descale, k_descale, v_descale, p_type, p_scale))
    return (f["out"], f["lse"]) if return_lse else f["out"]


def scaled_output(out, scale_o: float, out_type: str = "float8_e4m3") -> tuple[np.ndarray, float]:
    """An FP8 output of the attention `out` (float64): (out * scale_o rounded to out_type, to
    nearest even and saturated, as the kernel writes it; max |out| over its numbers, its amax_o:
    a NaN left out, as the kernel's fmaxf leaves it)."""
    out = np.asarray(out, dtype=np.float64)
    amax = float(np.max(np.abs(out), initial=0.0, where=~np.isnan(out)))
    return element_type(out_type).round_saturated(out * scale_o), amax


def _quantized(q_descale, k_descale, v_descale, p_type: str | None, p_scale: float) -> dict | None:
    """An FP8 forward's extra steps, or None where none is asked: the descales (checked against
    the shapes in _attend) and P's rounding."""
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if p_type is None and p_scale == 1.0 and all(x is None for x in descales.values()):
        return None
    rounding = None
    if p_type is not None:
        element = element_type(p_type)
        try:
            value = float(p_scale)
        except (TypeError, ValueError):
            value = math.nan
        if not (math.isfinite(value) and 0 < value <= element.max_finite):
            raise ValueError(f"p_scale = {p_scale!r}: must be a finite number in (0, {element.max_finite:g}] (P <= 1 "
                             f"is multiplied by it before its rounding to {element.name}, so that its largest "
                             f"value stays finite); e.g. 1.0, or {element.max_finite:g} to use the whole range")
        rounding = lambda p: element.round(p * value) / value  # noqa: E731
    elif p_scale != 1.0:
        raise ValueError(f"p_scale = {p_scale!r} without p_type: P is scaled only to be rounded; pass "
                         f"p_type='float8_e4m3' with it, or leave p_scale out")
    return {**descales, "rounding": rounding}


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, **kwargs):
    """q [total_q, Hq, d], k, v [total_k, Hkv, d]; sequence b is rows cu_seqlens[b] ..
    cu_seqlens[b + 1] (its keys, with seqused_k: rows cu_seqlens_k[b] .. cu_seqlens_k[b] +
    seqused_k[b]). Returns out [total_q, Hq, d] (and lse [Hq, total_q] with return_lse).
    cu_seqlens and seqused_k are refused by the runtime's rules (fagen.side_inputs)."""
    q, k, v = _tokens(q, "q", "Hq"), _tokens(k, "k", "Hkv"), _tokens(v, "v", "Hkv")
    cu_seqlens_q, cu_seqlens_k = _prefix_sums(cu_seqlens_q, "cu_seqlens_q"), _prefix_sums(cu_seqlens_k, "cu_seqlens_k")
    side_inputs.check_cu_seqlens_pair(cu_seqlens_q.size, cu_seqlens_k.size)
    side_inputs.check_cu_seqlens(cu_seqlens_q, q.shape[0], None, "q")
    if seqused_k is None:
        side_inputs.check_cu_seqlens(cu_seqlens_k, k.shape[0], None, "k")
    else:  # sequences may share rows: cu_seqlens_k only says where each one's keys start
        seqused_k = np.asarray(seqused_k)
        if seqused_k.shape != (cu_seqlens_q.size - 1,) or seqused_k.dtype.kind not in "iu":
            raise ValueError(f"seqused_k.shape = {list(seqused_k.shape)} of {seqused_k.dtype}: must be integers [B] = "
                             f"[{cu_seqlens_q.size - 1}] (each sequence's keys); pass one count a sequence")
        side_inputs.check_cu_seqlens(cu_seqlens_k, k.shape[0], None, "k")
        side_inputs.check_seqused_k(seqused_k, cu_seqlens_k, k.shape[0], k.shape[0])
    keys = cu_seqlens_k if seqused_k is None else [(cu_seqlens_k[b], cu_seqlens_k[b] + seqused_k[b])
                                                    for b in range(len(cu_seqlens_q) - 1)]
    sequences = [(_rows(q, cu_seqlens_q, b), _rows(k, keys, b), _rows(v, keys, b)) for b in range(len(cu_seqlens_q) - 1)]
    return _per_sequence(sequences, (*q.shape[:2], v.shape[-1]), kwargs)


def attention_paged(q, k_cache, v_cache, page_table, cache_seqlens, *, cu_seqlens_q=None, **kwargs):
    """k_cache, v_cache [num_pages, page_size, Hkv, d] (v_cache's d its own: head_dim_v): sequence b's keys are its cache_seqlens[b]
    first slots of pages page_table[b, 0], page_table[b, 1], ... q: [B, Hq, Nq, d], or
    [total_q, Hq, d] with cu_seqlens_q (then out and lse as attention_varlen's). The page table
    and lengths are refused by the runtime's rules (fagen.side_inputs.check_pages): only the
    pages a sequence's keys lie in are read, and each must be a page of the cache."""
    k_cache, v_cache = _real(k_cache, "k_cache"), _real(v_cache, "v_cache")
    if k_cache.ndim != 4 or v_cache.ndim != 4 or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"k_cache.shape = {list(k_cache.shape)}, v_cache.shape = {list(v_cache.shape)}: must be "
                         f"[num_pages, page_size, Hkv, d] and [num_pages, page_size, Hkv, d_v]; pass the caches of one "
                         f"paged layout")
    if cu_seqlens_q is None:
        q = _real(q, "q")
        if q.ndim != 4:
            raise ValueError(f"q.shape = {list(q.shape)}: must be [B, Hq, Nq, d] (or [total_q, Hq, d] with "
                             f"cu_seqlens_q); pass q padded, or its token-major rows with cu_seqlens_q")
        batch = q.shape[0]
    else:
        q, cu_seqlens_q = _tokens(q, "q", "Hq"), _prefix_sums(cu_seqlens_q, "cu_seqlens_q")
        side_inputs.check_cu_seqlens(cu_seqlens_q, q.shape[0], None, "q")
        batch = cu_seqlens_q.size - 1
    page_table, cache_seqlens = np.asarray(page_table), np.asarray(cache_seqlens)
    if page_table.ndim != 2 or page_table.shape != (batch, page_table.shape[-1]) or page_table.shape[1] < 1 \
            or page_table.dtype.kind not in "iu":
        raise ValueError(f"page_table.shape = {list(page_table.shape)} of {page_table.dtype}: must be integers [B, "
                         f"max_pages] with B = {batch} (q's sequences) and max_pages >= 1; pass one row of page ids a "
                         f"sequence")
    if cache_seqlens.shape != (batch,) or cache_seqlens.dtype.kind not in "iu":
        raise ValueError(f"cache_seqlens.shape = {list(cache_seqlens.shape)} of {cache_seqlens.dtype}: must be "
                         f"integers [B] = [{batch}] (each sequence's keys); pass one length a sequence")
    num_pages, page_size = k_cache.shape[:2]
    side_inputs.check_pages(page_table, cache_seqlens, num_pages, page_size)

    def keys(cache, b):  # [Hkv, n, d]: the first cache_seqlens[b] slots of the pages they lie in
        n = int(cache_seqlens[b])
        rows = cache[page_table[b, :-(-n // page_size)]].reshape(-1, *cache.shape[2:])[:n]
        return rows.transpose(1, 0, 2)
    if cu_seqlens_q is None:
        outs = [_one(q[b:b + 1], keys(k_cache, b)[None], keys(v_cache, b)[None], _sequence_kwargs(kwargs, b, batch))
                for b in range(q.shape[0])]
        out, lse = np.concatenate([o for o, _ in outs]), np.concatenate([l for _, l in outs])
        return (out, lse) if kwargs.get("return_lse") else out
    sequences = [(_rows(q, cu_seqlens_q, b), keys(k_cache, b), keys(v_cache, b)) for b in range(len(cu_seqlens_q) - 1)]
    return _per_sequence(sequences, (*q.shape[:2], v_cache.shape[-1]), kwargs)


def attention_cache(q, k_cache, v_cache, cache_seqlens, cache_leftpad=None, **kwargs):
    """An unpaged KV cache: q [B, Hq, Nq, d], k_cache, v_cache [B, slots, Hkv, d], sequence b's
    keys being slots cache_leftpad[b] .. cache_seqlens[b] (FlashAttention's flash_attn_with_kvcache;
    no cache_leftpad: from slot 0). Masks align per sequence, bottom right: q's rows are the
    last Nq positions before cache_seqlens[b]. The ranges are refused by the runtime's rules
    (fagen.side_inputs.check_key_ranges)."""
    q, k_cache, v_cache = _real(q, "q"), _real(k_cache, "k_cache"), _real(v_cache, "v_cache")
    if q.ndim != 4 or k_cache.ndim != 4 or v_cache.shape[:3] != k_cache.shape[:3] or k_cache.shape[0] != q.shape[0]:
        raise ValueError(f"q.shape = {list(q.shape)}, k_cache.shape = {list(k_cache.shape)}, v_cache.shape = "
                         f"{list(v_cache.shape)}: must be [B, Hq, Nq, d] and [B, slots, Hkv, d] (one B, slots, Hkv); "
                         f"pass q padded and the caches of one layout")
    ends = np.asarray(cache_seqlens)
    starts = np.zeros_like(ends) if cache_leftpad is None else np.asarray(cache_leftpad)
    for name, x in (("cache_seqlens", ends), ("cache_leftpad", starts)):
        if x.shape != (q.shape[0],) or x.dtype.kind not in "iu":
            raise ValueError(f"{name}.shape = {list(x.shape)} of {x.dtype}: must be integers [B] = [{q.shape[0]}]; "
                             f"pass one a sequence")
    side_inputs.check_key_ranges(ends, None if cache_leftpad is None else starts, k_cache.shape[1])

    def keys(cache, b):  # [1, Hkv, n, d]
        return cache[b, int(starts[b]):int(ends[b])].transpose(1, 0, 2)[None]
    outs = [_one(q[b:b + 1], keys(k_cache, b), keys(v_cache, b), kwargs) for b in range(q.shape[0])]
    out, lse = np.concatenate([o for o, _ in outs]), np.concatenate([l for _, l in outs])
    return (out, lse) if kwargs.get("return_lse") else out


def _one(q, k, v, kwargs):
    """(out, lse) of one sequence [1, H, n, d]; no keys: O = 0, LSE = -inf (no sinks), as for a row no key is visible to."""
    if k.shape[2] == 0 and kwargs.get("sinks") is None:
        return np.zeros((*q.shape[:3], v.shape[-1])), np.full(q.shape[:3], -np.inf)
    if k.shape[2] == 0:  # only the sink: O = 0, LSE = its logit
        return np.zeros((*q.shape[:3], v.shape[-1])), np.broadcast_to(np.asarray(kwargs["sinks"], np.float64)[None, :, None], q.shape[:3]).copy()
    return attention(q, k, v, **{**kwargs, "return_lse": True})


DESCALES = ("q_descale", "k_descale", "v_descale")


def _sequence_kwargs(kwargs: dict, b: int, batch: int) -> dict:
    """kwargs for sequence b of a batch the oracle runs a sequence at a time: a descale given per
    (sequence, KV head), [B, Hkv], becomes that sequence's row [1, Hkv]."""
    return {name: (np.asarray(x)[b:b + 1] if name in DESCALES and np.ndim(x) == 2 and np.shape(x)[0] == batch else x)
            for name, x in kwargs.items()}


def _real(x, name: str) -> np.ndarray:
    """x as a float64 array: the kernels' inputs are real numbers, so complex ones are refused
    rather than cast (NumPy would drop the imaginary part)."""
    a = np.asarray(x)
    if a.dtype.kind == "c":
        raise ValueError(f"{name}.dtype = {a.dtype}: must be real (the kernels take float16 or bfloat16, the oracle "
                         f"any real floats, and NumPy would drop the imaginary part); pass {name}.real if it is 0, "
                         f"or a float array")
    try:
        return a.astype(np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name}.dtype = {a.dtype}: must be numbers (a float array); pass a float array, e.g. "
                         f"numpy.asarray({name}, numpy.float32)") from None


def _tokens(x, name: str, heads: str) -> np.ndarray:
    """A varlen tensor: token-major [total, H, d], float64."""
    a = _real(x, name)
    if a.ndim != 3:
        raise ValueError(f"{name}.shape = {list(a.shape)}: must be [total, {heads}, d] (varlen is token-major: "
                         f"sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1]); pass a padded [B, H, N, d] "
                         f"batch to oracle.attention instead, or {name}[b].transpose(1, 0, 2) row by row")
    return a


def _prefix_sums(cu, name: str) -> np.ndarray:
    """cu_seqlens as an integer array [B + 1], its values for side_inputs.check_cu_seqlens."""
    a = np.asarray(cu)
    if a.ndim != 1 or a.size < 2 or a.dtype.kind not in "iu":
        raise ValueError(f"{name} = {a.tolist()!r}: must be integers [B + 1] with B >= 1 (the prefix sums of the "
                         f"sequence lengths, from 0); pass e.g. numpy.cumsum([0, *lengths])")
    return a


def _rows(x, cu, b):
    """Sequence b of a token-major [total, H, d] array, as [H, n, d]: rows cu[b] .. cu[b + 1] of
    prefix sums, or cu[b]'s (start, end)."""
    start, end = cu[b] if isinstance(cu[b], tuple) else (cu[b], cu[b + 1])
    return x[start:end].transpose(1, 0, 2)


def _per_sequence(sequences, out_shape, kwargs):
    """The oracle on each ([H, n, d] q, k, v) sequence, gathered token-major: out [total_q, Hq,
    d_v] (out_shape), lse [Hq, total_q]."""
    out = np.zeros(out_shape, np.float64)
    lse = np.zeros((out_shape[1], out_shape[0]), np.float64)
    row = 0
    for b, (sq, sk, sv) in enumerate(sequences):
        n = sq.shape[1]
        if n:
            o, l = _one(sq[None], sk[None], sv[None], _sequence_kwargs(kwargs, b, len(sequences)))
            out[row:row + n] = o[0].transpose(1, 0, 2)
            lse[:, row:row + n] = l[0]
        row += n
    return (out, lse) if kwargs.get("return_lse") else out


def attention_backward(q, k, v, dout, *, causal: bool = False, scale: float | None = None, mask=None,
                       block_mask=None, doc_ids=None, mask_mod=None, softcap: float | None = None,
                       alibi_slopes=None, bias=None, score_mod=None, score_mod_grad=None, sinks=None,
                       captured=None, fp8_type: str | None = None, out=None, lse=None) -> dict:
    """Gradients of L = sum(attention(...) * dout), arguments as attention's: {"dq", "dk", "dv"},
    dk and dv of k's and v's shape (GQA sums a group's query heads), plus "dbias" (the given
    bias's shape, summed over its broadcast axes) and "dsinks" ([Hq]) when those are given, and
    "dcaptured" (a list, each as its array) for a spec's score_mod reading captured arrays.
    score_mod_grad(s, b, h, q_idx, kv_idx) is d score_mod / d s at the same point. Masked
    pairs, and rows that see no key, get zero gradient. fp8_type ("float8_e4m3"): dq, dk and dv
    as fagen's FP8 backward rounds its operands (fagen.fp8_backward_rounding: dO a scale a KV head,
    P times 2^8, dS a scale a key and step for dK and a tile for dQ); D = rowsum(dO * O) from the
    unrounded dO, as its preprocess computes it. out: the forward's output as a kernel saved it
    (rounded to its type, from its own rounded P where FP8) for D, and lse its log-sum-exp ([B, Hq,
    Nq], natural log) for P = exp(s - lse), as the backward kernels read them; None: the oracle's
    own. (An FP8 forward's LSE carries its MMA's ~13-bit accumulation: a row's P moves with it.)"""
    if callable(score_mod) and score_mod_grad is None:
        raise ValueError("score_mod_grad = None: is required with score_mod (the backward needs d score_mod / d s); "
                         "pass score_mod_grad(s, b, h, q_idx, kv_idx), elementwise, e.g. lambda s, b, h, q_idx, "
                         "kv_idx: 0.5 for score_mod s * 0.5")
    spec_mod = None if score_mod is None or callable(score_mod) else _score_fields(score_mod)
    if spec_mod is not None and spec_mod.expression is not None and spec_mod.expression_grad is None:
        raise ValueError(f"score_mod.expression_grad = None: is required with score_mod.expression "
                         f"{spec_mod.expression!r} (the backward needs d expression / d score); set it, e.g. 0.5f "
                         f"for score * 0.5f")
    f = _attend(q, k, v, causal=causal, scale=scale, mask=mask, block_mask=block_mask, doc_ids=doc_ids,
                mask_mod=mask_mod, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, score_mod=score_mod,
                score_mod_grad=score_mod_grad, sinks=sinks, captured=captured)
    p = f["p"]
    if lse is not None:  # P against the given LSE: exp(s - lse) = P exp(lse_own - lse); a row that saw no key stays 0
        lse = np.asarray(lse, np.float64)
        if lse.shape != f["lse"].shape:
            raise ValueError(f"oracle.attention_backward: lse.shape = {lse.shape}: must be [B, Hq, Nq], "
                             f"{f['lse'].shape}")
        finite = np.isfinite(f["lse"]) & np.isfinite(lse)
        shift = np.where(finite, f["lse"], 0.0) - np.where(finite, lse, 0.0)  # (no inf - inf computed)
        p = p * np.where(finite, np.exp(shift), 0.0)[..., None]
    dout = np.asarray(dout, np.float64)
    if dout.shape != f["out"].shape or (out is not None and np.shape(out) != f["out"].shape):
        raise ValueError(f"oracle.attention_backward: dout.shape = {dout.shape}, out: "
                         f"{None if out is None else np.shape(out)}: must be O's, {f['out'].shape}")
    out = f["out"] if out is None else np.asarray(out, np.float64)
    delta = (dout * out).sum(axis=-1, keepdims=True)  # D = rowsum(dO * O)
    rounding = _fp8_backward_rounding(fp8_type)
    dout_mma = rounding.round_dout(dout, np.shape(k)[1]) if rounding else dout  # the products' dO
    dp = dout_mma @ f["v"].swapaxes(-1, -2)
    # d L / d s at bias level (score_mod's input); np.where so that score_mod_grad at a masked
    # pair, where it may be inf or NaN, never reaches a sum
    ds = np.where(f["keep"], p * (dp - delta) * f["dmod"], 0.0)
    ds_dot = ds * f["dcap"] * f["scale"]  # back through softcap and the scale to q.k
    ds_for_dk = ds_dot
    if rounding:  # dS is rounded at q.k's level, before the softmax scale the epilogue applies
        ds_for_dk = rounding.round_ds_for_dk(ds * f["dcap"]) * f["scale"]
        ds_dot = rounding.round_ds_for_dq(ds * f["dcap"]) * f["scale"]
    b, heads_q = f["q"].shape[:2]
    heads_kv = np.shape(k)[1]

    def per_kv_head(x):  # sum each GQA group's query heads onto its KV head
        return x.reshape(b, heads_kv, heads_q // heads_kv, *x.shape[2:]).sum(axis=2)

    grads = {"dq": ds_dot @ f["k"],
             "dk": per_kv_head(ds_for_dk.swapaxes(-1, -2) @ f["q"]),
             "dv": per_kv_head((rounding.round_p(p) if rounding else p).swapaxes(-1, -2) @ dout_mma)}
    if bias is not None:
        shape = np.shape(bias)
        dbias = ds.sum(axis=2) if len(shape) == 3 else ds  # a vector bias is shared by every query
        grads["dbias"] = dbias.sum(axis=tuple(i for i in (0, 1) if shape[i] == 1), keepdims=True)
    if sinks is not None:
        # the sink's logit only divides: d O / d sink = -P_sink O
        grads["dsinks"] = -(f["p_sink"] * delta).sum(axis=(0, 2, 3))
    if spec_mod is not None and spec_mod.captured:
        grads["dcaptured"] = _captured_grads(spec_mod, captured, np.where(f["keep"], p * (dp - delta), 0.0),
                                             f["expression_input"], f["keep"])
    return grads


def _fp8_backward_rounding(fp8_type: str | None):
    """attention_backward's roundings for fp8_type (None: none): functions of one array each."""
    if fp8_type is None:
        return None
    element = element_type(fp8_type)
    if not element.is_fp8:
        raise ValueError(f"fp8_type = {fp8_type!r}: must be an FP8 element type (float8_e4m3, float8_e5m2), or None "
                         f"for the unrounded backward")
    return SimpleNamespace(round_dout=lambda x, heads_kv: fp8_backward_rounding.round_dout(x, element, heads_kv),
                           **{name: (lambda x, f=getattr(fp8_backward_rounding, name): f(x, element))
                              for name in ("round_p", "round_ds_for_dq", "round_ds_for_dk")})


def _captured_grads(mod, captured, ds, score, keep) -> list[np.ndarray]:
    """d L / d each captured array (its shape): for each read of it in the expression (an element
    clamped into the array, as the kernel reads it), the expression's gradient ds times d
    expression / d that read (fagen.derivatives), evaluated in float64, summed into the element."""
    tree = expression.score(mod.expression, mod.captured)
    names = expression.captured_names(mod.captured)
    arrays = [np.asarray(a, np.float64) for a in captured]
    b, h, n_q, n_kv = ds.shape
    values = dict(score=score, b=np.arange(b)[:, None, None, None], h=np.arange(h)[None, :, None, None],
                  q_idx=np.arange(n_q)[None, None, :, None], kv_idx=np.arange(n_kv)[None, None, None, :],
                  **{name: a.ravel() for name, a in zip(names, arrays)})
    grads = [np.zeros(a.size) for a in arrays]
    for read, grad in read_derivatives(tree, set(names)):
        i = names.index(read.array)
        index = np.clip(expression.evaluate(read.index, values, np.float64), 0, arrays[i].size - 1)
        with np.errstate(invalid="ignore", over="ignore"):  # a masked pair's derivative may be anything
            terms = np.where(keep, ds * expression.evaluate(grad, values, np.float64), 0.0)
        np.add.at(grads[i], np.broadcast_to(index, ds.shape).ravel(), np.broadcast_to(terms, ds.shape).ravel())
    return [g.reshape(a.shape) for g, a in zip(grads, arrays)]


def _attend(q, k, v, *, causal, scale, mask, block_mask, doc_ids, mask_mod, softcap, alibi_slopes, bias,
            score_mod, sinks, score_mod_grad=None, captured=None, quantized=None) -> dict:
    """The forward, keeping what the backward reads: q, and k, v repeated to Hq heads; scale;
    keep; p (normalized weights, 0 where masked) and p_sink; out and lse; and the chain-rule
    factors dcap (d softcap / d s) and dmod (score_mod_grad, 1 without it). `quantized`
    (_quantized): FP8 descales, and P rounded before P.V (out; p and lse stay exact)."""
    q, k, v = (_real(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"oracle.attention: expected q [B,Hq,Nq,d], k [B,Hkv,Nk,d] and v [B,Hkv,Nk,d_v]; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or 0 in q.shape or 0 in k.shape or v.shape[-1] == 0:
        raise ValueError(f"oracle.attention: q {q.shape} and k {k.shape} must agree on B and d, and be non-empty")
    b, heads_q, n_q, d = q.shape
    heads_kv, n_kv = k.shape[1], k.shape[2]
    if heads_q % heads_kv:
        raise ValueError(f"oracle.attention: Hq = {heads_q} must be a multiple of Hkv = {heads_kv}")
    group = heads_q // heads_kv
    # doc_ids alone mean a document mask, causal within documents if asked, as fagen.attention
    # reads them
    if doc_ids is not None and mask is None:
        mask, causal = {"kind": "document", "causal": causal}, False
    if mask is not None:
        mask = mask_kinds.fields_of(mask)
        side_inputs.require_mask_inputs(mask.kind, has_block_mask=block_mask is not None,
                                        has_doc_ids=doc_ids is not None)
    given = dict(doc_ids=doc_ids, alibi_slopes=alibi_slopes, sinks=sinks, bias=bias)
    side_inputs.check_shapes(b, heads_q, n_q, n_kv,
                             **{name: np.shape(x) for name, x in given.items() if x is not None})
    if sinks is not None:
        sinks = np.asarray(sinks, np.float64)
        side_inputs.check_finite("sinks", sinks.tolist())
    if block_mask is not None:
        side_inputs.check_block_mask(block_mask, b, heads_q, n_q, n_kv)
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = side_inputs.check_scale(scale, d)
    v_descale = 1.0
    if quantized is not None:  # per (batch row, KV head): a group's query heads share its factors
        q_descale, k_descale, v_descale = (
            1.0 if quantized[name] is None else
            np.repeat(side_inputs.check_descale(name, quantized[name], b, heads_kv), group, axis=1)[:, :, None, None]
            for name in ("q_descale", "k_descale", "v_descale"))
        scale = scale * q_descale * k_descale
    bi = np.arange(b)[:, None, None, None]
    hi = np.arange(heads_q)[None, :, None, None]
    qi = np.arange(n_q)[None, None, :, None]
    ki = np.arange(n_kv)[None, None, None, :]

    if score_mod is not None and not callable(score_mod):  # a spec's ScoreMod: every field of it applies
        score_mod, score_mod_grad, softcap, alibi_slopes = _spec_score_mod(
            score_mod, score_mod_grad, softcap, alibi_slopes, bias, sinks, heads_q, captured)
    if softcap is not None:  # the spec's rule (score_mod.softcap)
        softcap = side_inputs.check_softcap("softcap", softcap)

    # scores and their modifiers
    s = (q @ k.swapaxes(-1, -2)) * scale
    dcap = dmod = 1.0
    if softcap is not None:
        t = np.tanh(s / softcap)
        s, dcap = softcap * t, 1.0 - t * t
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, np.float64)[None, :, None, None]
        s = s - slopes * np.abs(qi + (n_kv - n_q) - ki)
    if bias is not None:
        bias = np.asarray(bias, np.float64)
        s = s + (bias[:, :, None, :] if bias.ndim == 3 else bias)
    expression_input = s  # the score a spec's expression reads (its captured arrays' derivatives too)
    if score_mod is not None:
        if score_mod_grad is not None:
            dmod = np.asarray(score_mod_grad(s, bi, hi, qi, ki), np.float64)
        s = score_mod(s, bi, hi, qi, ki)

    # which pairs count
    keep = np.ones((1, 1, n_q, n_kv), bool)
    if causal:
        keep = keep & causal_mask(n_q, n_kv)
    if mask is not None:
        keep = keep & mask_kinds.predicate(mask, n_q, n_kv, doc_ids)(bi, hi, qi, ki)
        if mask.expression is not None:  # the kind's pattern, AND the spec's expression
            keep = keep & expression.evaluate(_parsed("mask.expression", mask.expression, expression.mask),
                                              dict(b=bi, h=hi, q_idx=qi, kv_idx=ki))
    if block_mask is not None:
        keep = keep & block_mask.to_dense()
    if mask_mod is not None:
        keep = keep & mask_kinds.as_keep(mask_mod(bi, hi, qi, ki), "oracle.attention: mask_mod(b, h, q_idx, kv_idx)")
    s = np.where(keep, s, -np.inf)

    # softmax, with the sink as one more logit per row that carries no value
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks[None, :, None, None]
        m = np.maximum(m, sink)
    # Only a row that sees no key has m = -inf. A NaN score makes m NaN (max and maximum keep
    # NaN), and it must reach O and LSE rather than pass for an empty row.
    empty = m == -np.inf
    m0 = np.where(empty, 0.0, m)
    p = np.exp(s - m0)
    l = p.sum(axis=-1, keepdims=True)  # >= 1 where not empty: the max's own term, or NaN
    if sinks is not None:
        l = l + np.exp(sink - m0)
    l = np.where(empty, 1.0, l)
    if quantized is None:
        p = p / l
        out = p @ v
    else:  # the kernel's order: P rounded unnormalised (its row sum l taken before), 1 / l and V's descale after;
        # P relative to the keys' own max (a sink joins the max only in the epilogue)
        keys_max = s.max(axis=-1, keepdims=True)
        shift = np.where((keys_max == -np.inf) | empty, 0.0, m0 - keys_max) if sinks is not None else 0.0
        rounded = p if quantized["rounding"] is None else quantized["rounding"](p * np.exp(shift)) * np.exp(-shift)
        out = (rounded @ v) * v_descale / l
        p = p / l
    return dict(q=q, k=k, v=v, scale=scale, keep=keep, p=p, out=out,
                p_sink=None if sinks is None else np.exp(sink - m0) / l,
                lse=np.where(empty, -np.inf, m0 + np.log(l))[..., 0], dcap=dcap, dmod=dmod,
                expression_input=expression_input)


# ---- a spec's score modifiers --------------------------------------------------------------
SCORE_FIELD_DEFAULTS = {"softcap": None, "alibi": "none", "bias": "none", "captured": 0, "expression": None,
                        "expression_grad": None, "sinks": False}


def _score_fields(score_mod) -> SimpleNamespace:
    """A spec's ScoreMod (or a dict of its fields) as its fields, defaults filled."""
    given = dict(score_mod) if isinstance(score_mod, dict) else \
        {f: getattr(score_mod, f) for f in SCORE_FIELD_DEFAULTS if hasattr(score_mod, f)}
    if (not given and not isinstance(score_mod, dict)) or set(given) - set(SCORE_FIELD_DEFAULTS):
        raise ValueError(f"score_mod = {score_mod!r}: must be score_mod(s, b, h, q_idx, kv_idx), a spec's ScoreMod or "
                         f"a dict of its fields {list(SCORE_FIELD_DEFAULTS)}; pass e.g. spec.score_mod")
    return SimpleNamespace(**{**SCORE_FIELD_DEFAULTS, **given})


def _parsed(field: str, text: str, parse) -> expression.Node:
    try:
        return parse(text)
    except expression.ExpressionError as err:
        raise ValueError(f"{field} = {text!r}: {err}") from None


def _expression_function(field: str, text: str | None, captured: tuple = ()):
    """fn(s, b, h, q_idx, kv_idx) of a score expression (None: none) reading the `captured`
    arrays (flattened), in float64, shaped as s."""
    if text is None:
        return None
    tree = _parsed(field, text, lambda t: expression.score(t, len(captured)))
    arrays = {name: np.asarray(a, np.float64).ravel() for name, a in zip(expression.captured_names(len(captured)),
                                                                         captured)}
    return lambda s, b, h, q, k: np.broadcast_to(expression.evaluate(
        tree, dict(score=s, b=b, h=h, q_idx=q, kv_idx=k, **arrays), np.float64), np.shape(s))


def _spec_score_mod(score_mod, score_mod_grad, softcap, alibi_slopes, bias, sinks, heads: int, captured=None):
    """(score_mod, score_mod_grad, softcap, alibi_slopes) that apply a spec's ScoreMod; the side
    inputs it asks for must be given, and a softcap given beside it must be its own."""
    m = _score_fields(score_mod)
    captured = tuple(captured or ())
    if len(captured) != m.captured:
        raise ValueError(f"captured: {len(captured)} arrays; score_mod.captured = {m.captured} asks for that many")
    if softcap is not None and softcap != m.softcap:
        raise ValueError(f"softcap = {softcap}: score_mod has softcap {m.softcap}; pass the spec's score_mod alone")
    if score_mod_grad is not None:
        raise ValueError("score_mod_grad: a spec's score_mod carries its derivative (expression_grad); leave it out")
    if m.alibi == "geometric" and alibi_slopes is None:
        alibi_slopes = side_inputs.geometric_alibi_slopes(heads)
    for name, given, field, wants in (("alibi_slopes", alibi_slopes, "alibi", m.alibi == "slopes"),
                                      ("bias", bias, "bias", m.bias != "none"), ("sinks", sinks, "sinks", m.sinks)):
        if wants and given is None:
            raise ValueError(f"{name} = None: score_mod.{field} = {getattr(m, field)!r} asks for it; pass {name}")
    return (_expression_function("score_mod.expression", m.expression, captured),
            _expression_function("score_mod.expression_grad", m.expression_grad, captured), m.softcap, alibi_slopes)
