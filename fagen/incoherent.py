"""Incoherent processing for FP8 attention (issue 55): q and k multiplied by one orthogonal matrix
M before they are rounded to e4m3. Q.K^T does not change ((q M)(k M)^T = q k^T), but a few large
channels, which would set a head's scale and leave the other channels a handful of e4m3's
values, are spread over all of them (FlashAttention-3's paper, section 3.3).

M = diag(s) H / sqrt(d): H Sylvester's Hadamard matrix (d a power of two), s random signs from a
fixed seed, so every call rotates alike (and its backward undoes the same M). A channel c of x
becomes s_c x_c H[c, :] / sqrt(d) in x M: magnitude |x_c| / sqrt(d) in every channel.

    m = rotation(128)                # float64 [d, d], NumPy
    q_r, k_r = rotate(q), rotate(k)  # x @ rotation(d): torch float32 on x's device, or NumPy float64

fagen.attention(..., fp8=True, incoherent=True) rotates inside and hands dq and dk back through
M^T; callers quantizing their own FP8 tensors rotate q and k with `rotate` first."""

from __future__ import annotations

import functools
import math

import numpy as np

SEED = 0x5EED  # the signs' (a fixed rotation: a call and its backward, and every run, agree)


def rotation(head_dim: int, seed: int = SEED) -> np.ndarray:
    """M = diag(s) H / sqrt(head_dim), float64 [head_dim, head_dim], orthogonal (M M^T = I)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim = {head_dim}: a Hadamard rotation needs a power of two (64, 128, 256); "
                         f"call without incoherent=True")
    h = np.ones((1, 1))
    while h.shape[0] < head_dim:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice((-1.0, 1.0), head_dim)
    return signs[:, None] * h / math.sqrt(head_dim)


@functools.cache
def _device_rotation(head_dim: int, device):
    import torch

    return torch.from_numpy(rotation(head_dim)).float().to(device)


def rotate(x):
    """x [..., d] times M = rotation(d): a PyTorch tensor as float32 on its device, a NumPy array
    (the oracle's side) as float64."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64) @ rotation(x.shape[-1])
    return x.float() @ _device_rotation(x.shape[-1], x.device)


def unrotate(dx):
    """A gradient with respect to x M, taken back to x: dx M^T (float32)."""
    return dx.float() @ _device_rotation(dx.shape[-1], dx.device).T
