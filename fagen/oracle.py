"""The float64 NumPy reference every kernel is diffed against: exactly the kernels' semantics.

- q: [B, Hq, Nq, d]; k, v: [B, Hkv, Nk, d] with Hq a multiple of Hkv (query head h reads
  KV head h // (Hq // Hkv)).
- s = q.k * scale (scale defaults to 1 / sqrt(d)), then, in this order: softcap
  (cap * tanh(s / cap)), ALiBi (- slope_h * |q + Nk - Nq - k|), bias (vector [B|1, H|1, Nk] or
  matrix [B|1, H|1, Nq, Nk]), score_mod(s, b, h, q_idx, kv_idx); then the mask.
- causal is aligned to the bottom right: query i sees key j iff j <= i + Nk - Nq. `mask` (a
  spec's Mask, dict or kind), `block_mask`, `doc_ids` and `mask_mod(b, h, q_idx, kv_idx)` all
  AND together.
- sinks [Hq]: one logit per head that joins each row's max and denominator but has no value.
- a row with no visible key gives O = 0 and LSE = -inf (with sinks: the sink's logit).
"""

from __future__ import annotations

import numpy as np


def causal_mask(n_q: int, n_kv: int) -> np.ndarray:
    """[n_q, n_kv] bool, True where query i may see key j (bottom-right aligned)."""
    return np.arange(n_kv)[None, :] <= np.arange(n_q)[:, None] + (n_kv - n_q)


def _as_mask_spec(mask):
    from fagen.spec import Mask

    return mask if isinstance(mask, Mask) else Mask.model_validate(mask)


def _broadcast_heads(x: np.ndarray, name: str, b: int, h: int, tail: tuple[int, ...]) -> np.ndarray:
    if x.ndim != 2 + len(tail) or x.shape[0] not in (1, b) or x.shape[1] not in (1, h) or x.shape[2:] != tail:
        raise ValueError(f"oracle.attention: {name} shape {x.shape}; expected [{b}|1, {h}|1, {', '.join(map(str, tail))}]")
    return x


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
              mask=None, block_mask=None, doc_ids=None, mask_mod=None, softcap: float | None = None,
              alibi_slopes=None, bias=None, score_mod=None, sinks=None):
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
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    bi = np.arange(b)[:, None, None, None]
    hi = np.arange(heads_q)[None, :, None, None]
    qi = np.arange(n_q)[None, None, :, None]
    ki = np.arange(n_kv)[None, None, None, :]

    # scores and their modifiers
    s = (q @ k.swapaxes(-1, -2)) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, np.float64).reshape(1, heads_q, 1, 1)
        s = s - slopes * np.abs(qi + (n_kv - n_q) - ki)
    if bias is not None:
        bias = np.asarray(bias, np.float64)
        if bias.ndim == 3:
            s = s + _broadcast_heads(bias, "bias", b, heads_q, (n_kv,))[:, :, None, :]
        else:
            s = s + _broadcast_heads(bias, "bias", b, heads_q, (n_q, n_kv))
    if score_mod is not None:
        s = score_mod(s, bi, hi, qi, ki)

    # which pairs count (doc_ids alone mean a document mask, causal within documents if asked,
    # as fagen.attention reads them)
    if doc_ids is not None and mask is None:
        mask, causal = {"kind": "document", "causal": causal}, False
    keep = np.ones((1, 1, n_q, n_kv), bool)
    if causal:
        keep = keep & causal_mask(n_q, n_kv)
    if mask is not None:
        from fagen.masks import static_predicate

        keep = keep & static_predicate(_as_mask_spec(mask), n_q, n_kv, doc_ids)(bi, hi, qi, ki)
    if block_mask is not None:
        keep = keep & block_mask.to_dense()
    if mask_mod is not None:
        keep = keep & mask_mod(bi, hi, qi, ki)
    s = np.where(keep, s, -np.inf)

    # softmax, with the sink as one more logit per row that carries no value
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.asarray(sinks, np.float64).reshape(1, heads_q, 1, 1)
        m = np.maximum(m, sink)
    seen = np.isfinite(m)
    m0 = np.where(seen, m, 0.0)
    p = np.exp(s - m0)
    l = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(sink - m0)
    out = (p / np.where(l > 0, l, 1.0)) @ v
    if not return_lse:
        return out
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m0 + np.log(np.where(l > 0, l, 1.0)), -np.inf)[..., 0]
    return out, lse
