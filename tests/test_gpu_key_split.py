"""The 192/128 backward (fagen.key_split) on the GPU against the float64 oracle (marked `gpu`):
inputs random and fresh per case, every buffer the backward allocates NaN-filled, awkward lengths,
GQA, both layouts, and fagen.attention's autograd taking it."""

import zlib

import numpy as np
import pytest

import fagen
from fagen import key_split, oracle
from fagen.check import OUT_TOLERANCE, relative_error, to_numpy

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
D, DV = 192, 128


def _inputs(seed: str, b, hq, hkv, nq, nk, dtype, layout="bhsd"):
    """q, k [.., 192], v and dout [.., 128] as torch tensors: [B, H, N, d], or FlashAttention's
    [B, N, H, d] seen through a transpose."""
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    dt = getattr(torch, dtype)

    def tensor(h, n, d):
        if layout == "bhsd":
            return torch.from_numpy(rng.standard_normal((b, h, n, d)).astype(np.float32)).to("cuda", dt)
        return torch.from_numpy(rng.standard_normal((b, n, h, d)).astype(np.float32)).to("cuda", dt).transpose(1, 2)
    return tensor(hq, nq, D), tensor(hkv, nk, D), tensor(hkv, nk, DV), tensor(hq, nq, DV)


def _reference(q, k, v, dout, causal, scale=None):
    return oracle.attention_backward(*(to_numpy(x).astype(np.float64) for x in (q, k, v, dout)), causal=causal,
                                     scale=scale)


# (B, Hq, Hkv, Nq, Nk): ragged tiles both ways (a partial 96-key block, a partial 64-query step);
# GQA with more keys than queries (causal bottom right); more queries than keys (causal: the first
# rows see none, and whole key blocks see no query step); one query; a few full blocks
SHAPES = [(2, 4, 2, 300, 300), (1, 4, 1, 77, 513), (1, 2, 2, 200, 100), (3, 2, 1, 1, 1000), (1, 2, 1, 100, 40),
          (1, 2, 1, 1152, 1152)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_192_128_backward_matches_the_oracle(dtype, causal, shape):
    """dq, dk, dv (every buffer the backward allocates NaN-filled) against the float64 oracle."""
    from fagen.bench_backward import nan_filled_empties

    q, k, v, dout = _inputs(f"ks{dtype}{causal}{shape}", *shape, dtype)
    out, lse = fagen.attention(q, k, v, causal=causal, return_lse=True)
    with nan_filled_empties() as filled:
        dq, dk, dv = key_split.backward(dout, q, k, v, out, lse, causal=causal)
    assert filled
    ref = _reference(q, k, v, dout, causal)
    errors = {name: relative_error(to_numpy(got), ref[name]) for name, got in (("dq", dq), ("dk", dk), ("dv", dv))}
    print(errors)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert got.shape == ref[name].shape and got.dtype == q.dtype
        assert errors[name] < OUT_TOLERANCE[dtype], (name, errors)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fagen_attention_trains_192_128_through_it_in_flash_attention_s_layout(monkeypatch, causal):
    """Autograd through fagen.attention takes this kernel (counted) for [B, N, H, d] views, GQA and
    a scale; the gradients against the oracle's. Deterministic training keeps the general kernels."""
    calls = []
    run = key_split.backward
    monkeypatch.setattr(key_split, "backward", lambda *a, **kw: calls.append(1) or run(*a, **kw))
    q, k, v, dout = _inputs(f"train{causal}", 2, 4, 2, 257, 700, "bfloat16", layout="bshd")
    for deterministic in (False, True):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = fagen.attention(*leaves, causal=causal, scale=0.06, deterministic=deterministic)
        out.backward(dout)
        assert len(calls) == 1, calls  # (the deterministic call took the general kernels)
        ref = _reference(q, k, v, dout, causal, scale=0.06)
        for name, leaf in zip(("dq", "dk", "dv"), leaves):
            assert leaf.grad.shape == leaf.shape
            assert relative_error(to_numpy(leaf.grad), ref[name]) < OUT_TOLERANCE["bfloat16"], (name, deterministic)


def test_what_it_does_not_run_takes_the_general_kernels():
    """A modifier, a mask beyond causal, or deterministic: `takes` (or the op's check before it)
    leaves the call to the general kernels; fp32 and other widths are refused by name here."""
    q, k, v, dout = _inputs("refuse", 1, 2, 1, 64, 64, "bfloat16")
    assert key_split.takes(q.shape, k.shape, v.shape, "bfloat16", 0, causal=True, align="bottom_right",
                           deterministic=False)
    assert not key_split.takes(q.shape, k.shape, v.shape, "bfloat16", 0, causal=False, align="bottom_right",
                               deterministic=True)
    assert not key_split.takes(q.shape, k.shape, k.shape, "bfloat16", 0, causal=False, align="bottom_right",
                               deterministic=False)
    out, lse = fagen.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"head_dim: q 192, k 192, v 192; this backward takes 192/128"):
        key_split.backward(dout, q, k, k, out, lse)
    with pytest.raises(ValueError, match=r"dtype float32"):
        key_split.backward(dout.float(), q.float(), k.float(), v.float(), out.float(), lse)
