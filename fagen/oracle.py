"""The float64 NumPy reference every kernel is diffed against: exactly the kernels' semantics.

- q: [B, Hq, Nq, d]; k, v: [B, Hkv, Nk, d] with Hq a multiple of Hkv (query head h reads
  KV head h // (Hq // Hkv)).
- scale defaults to 1 / sqrt(d).
- causal is aligned to the bottom right: query i sees key j iff j <= i + Nk - Nq.
- a row with no visible key gives O = 0 and LSE = -inf; LSE is the natural log of the sum.
"""

from __future__ import annotations

import numpy as np


def causal_mask(n_q: int, n_kv: int) -> np.ndarray:
    """[n_q, n_kv] bool, True where query i may see key j (bottom-right aligned)."""
    return np.arange(n_kv)[None, :] <= np.arange(n_q)[:, None] + (n_kv - n_q)


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"oracle.attention: expected q [B,Hq,Nq,d] and k, v [B,Hkv,Nk,d]; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or 0 in q.shape or 0 in k.shape:
        raise ValueError(f"oracle.attention: q {q.shape} and k, v {k.shape} must agree on B and d, and be non-empty")
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_q % heads_kv:
        raise ValueError(f"oracle.attention: Hq = {heads_q} must be a multiple of Hkv = {heads_kv}")
    group = heads_q // heads_kv
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)

    s = (q @ k.swapaxes(-1, -2)) * scale
    if causal:
        s = np.where(causal_mask(q.shape[2], k.shape[2]), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    seen = np.isfinite(m)
    p = np.exp(s - np.where(seen, m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    out = (p / np.where(seen, l, 1.0)) @ v
    if not return_lse:
        return out
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(l), -np.inf)[..., 0]
    return out, lse
