"""Where an FP8 backward rounds, and with which scales: the NumPy twin of its kernel's
quantisation (notes/fp8_backward.md), read by the oracle (attention_backward's fp8_type) and by
scripts/fp8_backward_accuracy.py.

A scale is only usable where the kernel can take it back out of a product's sum; dK and dV are
sums over every query step of a block, accumulated in place by wgmma:
- dO, the B operand of dP = dO.V^T and of dV += P^T.dO: one scale a (batch, KV head), onto the
  type's largest (a step's scale could not leave dV's sum, and a GQA group's query heads add
  into one dV).
- P, the A operand of dV: times 2^p_log2_scale (the forward's), P <= 1 being exact after the LSE.
- dS as dK's A operand (registers, keys as rows): a power of two a key and a step of
  STEP_QUERIES queries; a key's dK row is rescaled by the ratio of two powers of two (exact in
  float32) when its scale moves, as the forward's O is by the running max.
- dS as dQ's A operand (shared memory): one scale a step's STEP_QUERIES x BLOCK_KEYS tile, taken
  out where the step's dQ is added into its float32 accumulator.
"""

from __future__ import annotations

import numpy as np

from fagen.element_types import ElementType

STEP_QUERIES = 64  # the queries of a backward step: dK's scale period
BLOCK_KEYS = 128  # the keys of a block: dQ's scale tile is a step's queries by them


def _positive_scale(amax: np.ndarray, element: ElementType) -> np.ndarray:
    """amax onto the type's largest; 1 where a tile is all zeros."""
    return np.where(amax == 0, 1.0, amax / element.max_finite)


def per_head(x: np.ndarray, element: ElementType) -> np.ndarray:
    """x [B, H, N, M] rounded to `element` with one scale a (batch, head)."""
    scale = _positive_scale(np.abs(x).max(axis=(2, 3), keepdims=True), element)
    return element.round(x / scale) * scale


def per_tile(x: np.ndarray, element: ElementType, rows: int, cols: int | None = None) -> np.ndarray:
    """x [B, H, N, M] rounded to `element` with one scale a (rows x cols) tile (cols None: whole rows)."""
    b, h, n, m = x.shape
    cols = cols or m
    pad_n, pad_m = -n % rows, -m % cols
    t = np.pad(x, ((0, 0), (0, 0), (0, pad_n), (0, pad_m))).reshape(b, h, (n + pad_n) // rows, rows,
                                                                     (m + pad_m) // cols, cols)
    scale = _positive_scale(np.abs(t).max(axis=(3, 5), keepdims=True), element)
    return (element.round(t / scale) * scale).reshape(b, h, n + pad_n, m + pad_m)[:, :, :n, :m]


def per_key_step(ds: np.ndarray, element: ElementType) -> np.ndarray:
    """dS [B, H, queries, keys] rounded as dK's operand: a power-of-two scale a key and a step of
    STEP_QUERIES queries, the smallest that keeps the step's amax of that key finite."""
    b, h, n, m = ds.shape
    pad = -n % STEP_QUERIES
    t = np.pad(ds, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(b, h, (n + pad) // STEP_QUERIES, STEP_QUERIES, m)
    amax = np.abs(t).max(axis=3, keepdims=True)
    scale = 2.0 ** np.ceil(np.log2(_positive_scale(amax, element)))
    return (element.round(t / scale) * scale).reshape(b, h, n + pad, m)[:, :, :n]


def round_p(p: np.ndarray, element: ElementType) -> np.ndarray:
    """P rounded as dV's A operand: times 2^p_log2_scale, to `element`, and back."""
    scale = 2.0 ** element.p_log2_scale
    return element.round(p * scale) / scale


def round_dout(dout: np.ndarray, element: ElementType, heads_kv: int | None = None) -> np.ndarray:
    """dO [B, Hq, N, dv] as the preprocess quantises it: one scale a (batch, KV head), over its
    group's query heads (heads_kv None: a scale a query head)."""
    b, hq, n, m = dout.shape
    heads_kv = heads_kv or hq
    grouped = dout.reshape(b, heads_kv, hq // heads_kv * n, m)
    return per_head(grouped, element).reshape(b, hq, n, m)


def round_ds_for_dq(ds: np.ndarray, element: ElementType) -> np.ndarray:
    """dS as dQ's operand: one scale a step's tile of the block's keys."""
    return per_tile(ds, element, STEP_QUERIES, BLOCK_KEYS)


def round_ds_for_dk(ds: np.ndarray, element: ElementType) -> np.ndarray:
    """dS as dK's operand: a power of two a key and a step."""
    return per_key_step(ds, element)
