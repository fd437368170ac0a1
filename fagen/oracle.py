"""The float64 NumPy reference every kernel is diffed against: exactly the kernels' semantics.

- q: [B, Hq, Nq, d]; k, v: [B, Hkv, Nk, d] with Hq a multiple of Hkv (query head h reads
  KV head h // (Hq // Hkv)).
- s = q.k * scale (scale defaults to 1 / sqrt(d)), then, in this order: softcap
  (cap * tanh(s / cap)), ALiBi (- slope_h * |q + Nk - Nq - k|), bias (vector [B|1, H|1, Nk] or
  matrix [B|1, H|1, Nq, Nk]), score_mod(s, b, h, q_idx, kv_idx); then the mask.
- causal is aligned to the bottom right: query i sees key j iff j <= i + Nk - Nq. `mask` (a
  spec's Mask, dict or kind), `block_mask`, `doc_ids` and `mask_mod(b, h, q_idx, kv_idx)` all
  AND together.
- sinks [Hq]: one finite logit per head that joins each row's max and denominator but has no
  value.
- a row with no visible key gives O = 0 and LSE = -inf (with sinks: the sink's logit); a NaN
  in a row's visible scores gives NaN O and LSE.
- side inputs of the wrong shape, and a block_mask / document mask kind without its array, are
  refused by the runtime's rules (fagen.side_inputs).

attention_varlen and attention_paged apply it per sequence of a varlen batch or a paged
cache (FlashAttention's layouts, fagen.sequences), each sequence a batch of one; a sequence
with no keys gives O = 0 and LSE = -inf, as a row with no visible key does.

attention_backward differentiates the same computation analytically (dq, dk, dv; dbias, dsinks),
sharing its scores, mask and softmax through _attend.
"""

from __future__ import annotations

import numpy as np

from fagen import mask_kinds, side_inputs


def causal_mask(n_q: int, n_kv: int) -> np.ndarray:
    """[n_q, n_kv] bool, True where query i may see key j (bottom-right aligned)."""
    return np.arange(n_kv)[None, :] <= np.arange(n_q)[:, None] + (n_kv - n_q)


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
              mask=None, block_mask=None, doc_ids=None, mask_mod=None, softcap: float | None = None,
              alibi_slopes=None, bias=None, score_mod=None, sinks=None):
    f = _attend(q, k, v, causal=causal, scale=scale, mask=mask, block_mask=block_mask, doc_ids=doc_ids,
                mask_mod=mask_mod, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, score_mod=score_mod,
                sinks=sinks)
    return (f["out"], f["lse"]) if return_lse else f["out"]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, **kwargs):
    """q [total_q, Hq, d], k, v [total_k, Hkv, d]; sequence b is rows cu_seqlens[b] ..
    cu_seqlens[b + 1] (its keys, with seqused_k: rows cu_seqlens_k[b] .. cu_seqlens_k[b] +
    seqused_k[b]). Returns out [total_q, Hq, d] (and lse [Hq, total_q] with return_lse)."""
    keys = cu_seqlens_k if seqused_k is None else [(cu_seqlens_k[b], cu_seqlens_k[b] + seqused_k[b])
                                                    for b in range(len(cu_seqlens_q) - 1)]
    sequences = [(_rows(q, cu_seqlens_q, b), _rows(k, keys, b), _rows(v, keys, b)) for b in range(len(cu_seqlens_q) - 1)]
    return _per_sequence(sequences, q.shape, kwargs)


def attention_paged(q, k_cache, v_cache, page_table, cache_seqlens, *, cu_seqlens_q=None, **kwargs):
    """k_cache, v_cache [num_pages, page_size, Hkv, d]: sequence b's keys are its cache_seqlens[b]
    first slots of pages page_table[b, 0], page_table[b, 1], ... q: [B, Hq, Nq, d], or
    [total_q, Hq, d] with cu_seqlens_q (then out and lse as attention_varlen's)."""
    def keys(cache, b):
        rows = np.concatenate([cache[p] for p in page_table[b]], axis=0)[:cache_seqlens[b]]  # [n, Hkv, d]
        return rows.transpose(1, 0, 2)
    if cu_seqlens_q is None:
        outs = [_one(q[b:b + 1], keys(k_cache, b)[None], keys(v_cache, b)[None], kwargs) for b in range(q.shape[0])]
        out, lse = np.concatenate([o for o, _ in outs]), np.concatenate([l for _, l in outs])
        return (out, lse) if kwargs.get("return_lse") else out
    sequences = [(_rows(q, cu_seqlens_q, b), keys(k_cache, b), keys(v_cache, b)) for b in range(len(cu_seqlens_q) - 1)]
    return _per_sequence(sequences, q.shape, kwargs)


def _one(q, k, v, kwargs):
    """(out, lse) of one sequence [1, H, n, d]; no keys: O = 0, LSE = -inf (no sinks), as for a row no key is visible to."""
    if k.shape[2] == 0 and kwargs.get("sinks") is None:
        return np.zeros(q.shape), np.full(q.shape[:3], -np.inf)
    if k.shape[2] == 0:  # only the sink: O = 0, LSE = its logit
        return np.zeros(q.shape), np.broadcast_to(np.asarray(kwargs["sinks"], np.float64)[None, :, None], q.shape[:3]).copy()
    return attention(q, k, v, **{**kwargs, "return_lse": True})


def _rows(x, cu, b):
    """Sequence b of a token-major [total, H, d] array, as [H, n, d]: rows cu[b] .. cu[b + 1] of
    prefix sums, or cu[b]'s (start, end)."""
    start, end = cu[b] if isinstance(cu[b], tuple) else (cu[b], cu[b + 1])
    return x[start:end].transpose(1, 0, 2)


def _per_sequence(sequences, q_shape, kwargs):
    """The oracle on each ([H, n, d] q, k, v) sequence, gathered token-major: out [total_q, Hq, d], lse [Hq, total_q]."""
    out = np.zeros(q_shape, np.float64)
    lse = np.zeros((q_shape[1], q_shape[0]), np.float64)
    row = 0
    for sq, sk, sv in sequences:
        n = sq.shape[1]
        if n:
            o, l = _one(sq[None], sk[None], sv[None], kwargs)
            out[row:row + n] = o[0].transpose(1, 0, 2)
            lse[:, row:row + n] = l[0]
        row += n
    return (out, lse) if kwargs.get("return_lse") else out


def attention_backward(q, k, v, dout, *, causal: bool = False, scale: float | None = None, mask=None,
                       block_mask=None, doc_ids=None, mask_mod=None, softcap: float | None = None,
                       alibi_slopes=None, bias=None, score_mod=None, score_mod_grad=None, sinks=None) -> dict:
    """Gradients of L = sum(attention(...) * dout), arguments as attention's: {"dq", "dk", "dv"},
    dk and dv of k's and v's shape (GQA sums a group's query heads), plus "dbias" (the given
    bias's shape, summed over its broadcast axes) and "dsinks" ([Hq]) when those are given.
    score_mod_grad(s, b, h, q_idx, kv_idx) is d score_mod / d s at the same point. Masked
    pairs, and rows that see no key, get zero gradient."""
    if score_mod is not None and score_mod_grad is None:
        raise ValueError("score_mod_grad = None: is required with score_mod (the backward needs d score_mod / d s); "
                         "pass score_mod_grad(s, b, h, q_idx, kv_idx), elementwise, e.g. lambda s, b, h, q_idx, "
                         "kv_idx: 0.5 for score_mod s * 0.5")
    f = _attend(q, k, v, causal=causal, scale=scale, mask=mask, block_mask=block_mask, doc_ids=doc_ids,
                mask_mod=mask_mod, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, score_mod=score_mod,
                score_mod_grad=score_mod_grad, sinks=sinks)
    out, p = f["out"], f["p"]
    dout = np.asarray(dout, np.float64)
    if dout.shape != out.shape:
        raise ValueError(f"oracle.attention_backward: dout.shape = {dout.shape}: must be O's, {out.shape}")
    delta = (dout * out).sum(axis=-1, keepdims=True)  # D = rowsum(dO * O)
    dp = dout @ f["v"].swapaxes(-1, -2)
    # d L / d s at bias level (score_mod's input); np.where so that score_mod_grad at a masked
    # pair, where it may be inf or NaN, never reaches a sum
    ds = np.where(f["keep"], p * (dp - delta) * f["dmod"], 0.0)
    ds_dot = ds * f["dcap"] * f["scale"]  # back through softcap and the scale to q.k
    b, heads_q = f["q"].shape[:2]
    heads_kv = np.shape(k)[1]

    def per_kv_head(x):  # sum each GQA group's query heads onto its KV head
        return x.reshape(b, heads_kv, heads_q // heads_kv, *x.shape[2:]).sum(axis=2)

    grads = {"dq": ds_dot @ f["k"],
             "dk": per_kv_head(ds_dot.swapaxes(-1, -2) @ f["q"]),
             "dv": per_kv_head(p.swapaxes(-1, -2) @ dout)}
    if bias is not None:
        shape = np.shape(bias)
        dbias = ds.sum(axis=2) if len(shape) == 3 else ds  # a vector bias is shared by every query
        grads["dbias"] = dbias.sum(axis=tuple(i for i in (0, 1) if shape[i] == 1), keepdims=True)
    if sinks is not None:
        # the sink's logit only divides: d O / d sink = -P_sink O
        grads["dsinks"] = -(f["p_sink"] * delta).sum(axis=(0, 2, 3))
    return grads


def _attend(q, k, v, *, causal, scale, mask, block_mask, doc_ids, mask_mod, softcap, alibi_slopes, bias,
            score_mod, sinks, score_mod_grad=None) -> dict:
    """The forward, keeping what the backward reads: q, and k, v repeated to Hq heads; scale;
    keep; p (normalized weights, 0 where masked) and p_sink; out and lse; and the chain-rule
    factors dcap (d softcap / d s) and dmod (score_mod_grad, 1 without it)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"oracle.attention: expected q [B,Hq,Nq,d] and k, v [B,Hkv,Nk,d]; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or 0 in q.shape or 0 in k.shape:
        raise ValueError(f"oracle.attention: q {q.shape} and k, v {k.shape} must agree on B and d, and be non-empty")
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
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    bi = np.arange(b)[:, None, None, None]
    hi = np.arange(heads_q)[None, :, None, None]
    qi = np.arange(n_q)[None, None, :, None]
    ki = np.arange(n_kv)[None, None, None, :]

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
    p = p / l
    return dict(q=q, k=k, v=v, scale=scale, keep=keep, p=p, out=p @ v,
                p_sink=None if sinks is None else np.exp(sink - m0) / l,
                lse=np.where(empty, -np.inf, m0 + np.log(l))[..., 0], dcap=dcap, dmod=dmod)
