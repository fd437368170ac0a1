"""The head_dim 512 forward on the GPU (fagen.wide_head; fagen.attention takes it at head_dim
512), against the float64 oracle (marked `gpu`). Inputs are random and fresh per case, out is
NaN-poisoned before the launch: a row left unwritten fails."""

import zlib

import numpy as np
import pytest

import fagen
from fagen import oracle, wide_head
from fagen.check import LSE_TOLERANCE, OUT_TOLERANCE, relative_error, to_numpy

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
D = 512


def _inputs(seed: str, b, hq, hkv, nq, nk, dtype, layout="bhsd"):
    """q, k, v as torch tensors: [B, H, N, d], or FlashAttention's [B, N, H, d] seen through a
    transpose (the strides a model hands over)."""
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    dt = getattr(torch, dtype)

    def tensor(h, n):
        if layout == "bhsd":
            return torch.from_numpy(rng.standard_normal((b, h, n, D)).astype(np.float32)).to("cuda", dt)
        return torch.from_numpy(rng.standard_normal((b, n, h, D)).astype(np.float32)).to("cuda", dt).transpose(1, 2)
    return tensor(hq, nq), tensor(hkv, nk), tensor(hkv, nk)


def _reference(q, k, v, causal, scale=None):
    return oracle.attention(*(to_numpy(x).astype(np.float64) for x in (q, k, v)), causal=causal, scale=scale,
                            return_lse=True)


def _check(out, lse, ref, ref_lse, dtype):
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE[dtype]
    finite = np.isfinite(ref_lse)
    assert (to_numpy(lse)[~finite] == -np.inf).all()
    assert relative_error(to_numpy(lse)[finite], ref_lse[finite]) < LSE_TOLERANCE


# (B, Hq, Hkv, Nq, Nk): a ragged last tile; GQA with more keys than queries (causal bottom right);
# more queries than keys (causal: the first rows see none); one query; many tiles
SHAPES = [(2, 4, 2, 300, 300), (1, 4, 1, 77, 513), (1, 2, 2, 200, 100), (3, 2, 1, 1, 1000), (1, 2, 1, 1024, 1024)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_head_dim_512_forward_matches_the_oracle(dtype, causal, shape):
    q, k, v = _inputs(f"{dtype}{causal}{shape}", *shape, dtype)
    out = torch.full_like(q, float("nan"))
    got, lse = wide_head.attention(q, k, v, causal=causal, return_lse=True, out=out)
    assert got is out
    _check(out, lse, *_reference(q, k, v, causal), dtype)


# (B, Hq, Hkv, Nq, Nk) of decode: one query a head, a group's heads packed as one tile's rows and
# the keys split over blocks that fill the GPU, merged by LSE
DECODE_SHAPES = [(1, 8, 2, 1, 20000), (4, 16, 4, 1, 4097), (2, 4, 4, 1, 300)]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_head_dim_512_decode_packs_a_group_s_heads_and_splits_the_keys(shape, layout):
    from fagen.bench_backward import nan_filled_empties

    q, k, v = _inputs(f"decode{shape}{layout}", *shape, "bfloat16", layout=layout)
    out = torch.full(q.shape, float("nan"), device="cuda", dtype=q.dtype)
    if layout == "bshd":  # FlashAttention's [B, 1, H, d] out, seen as [B, H, 1, d]
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
    with nan_filled_empties():  # (the partials and the LSE too)
        got, lse = wide_head.attention(q, k, v, causal=True, return_lse=True, out=out)
    _check(got, lse, *_reference(q, k, v, True), "bfloat16")


def test_a_split_decode_writes_a_caller_s_out_that_is_only_4_byte_aligned():
    """The merge stores into out what the attention kernel would: pairs, 4-byte aligned (out 4
    bytes past an 8-byte boundary, heads 514 elements apart)."""
    q, k, v = _inputs("aligned 4", 1, 8, 2, 1, 4096, "bfloat16")
    flat = torch.full((8 * 514 + 2,), float("nan"), device="cuda", dtype=q.dtype)
    out = flat[2:].view(1, 8, 1, 514)[..., :512]
    assert out.data_ptr() % 8 == 4
    got, lse = wide_head.attention(q, k, v, return_lse=True, out=out)
    _check(got, lse, *_reference(q, k, v, False), "bfloat16")


def test_a_few_long_rows_split_their_keys_under_causal():
    """A short causal prompt against many keys: 3 query tiles of 2 heads leave SMs idle, so each
    tile's keys are split (a split of the first tiles may hold none)."""
    q, k, v = _inputs("few rows", 1, 2, 1, 150, 9000, "float16")
    got, lse = wide_head.attention(q, k, v, causal=True, return_lse=True, out=torch.full_like(q, float("nan")))
    _check(got, lse, *_reference(q, k, v, True), "float16")


def test_fagen_attention_takes_head_dim_512_in_flash_attention_s_layout_with_a_scale():
    q, k, v = _inputs("bshd", 2, 8, 2, 257, 700, "bfloat16", layout="bshd")
    out, lse = fagen.attention(q, k, v, causal=True, scale=0.03, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, lse, *_reference(q, k, v, True, scale=0.03), "bfloat16")


def test_no_keys_give_zeros_and_an_lse_of_minus_infinity():
    q, k, v = _inputs("empty", 1, 2, 1, 5, 0, "float16")
    out, lse = wide_head.attention(q, k, v, return_lse=True, out=torch.full_like(q, float("nan")))
    assert (out == 0).all() and (lse == -float("inf")).all()


def test_what_head_dim_512_does_not_run_yet_is_refused_by_name():
    q, k, v = _inputs("refused", 1, 2, 1, 64, 64, "bfloat16")
    with pytest.raises(ValueError, match=r"softcap: head_dim 512 runs no score modifier"):
        fagen.attention(q, k, v, softcap=30.0)
    with pytest.raises(ValueError, match=r"mask: kind 'sliding_window'.*head_dim 512 runs no mask but causal"):
        fagen.attention(q, k, v, mask={"kind": "sliding_window", "window_left": 8})
    with pytest.raises(ValueError, match=r"deterministic: head_dim 512's backward adds dQ atomically"):
        fagen.attention(q.requires_grad_(), k, v, deterministic=True)
    torch.use_deterministic_algorithms(True)
    try:  # PyTorch's global switch, as its own kernels honour it
        with pytest.raises(ValueError, match=r"deterministic: head_dim 512's backward adds dQ atomically"):
            fagen.attention(q, k, v)
    finally:
        torch.use_deterministic_algorithms(False)
    with pytest.raises(ValueError, match=r"dtypes bfloat16, float16, bfloat16"):
        wide_head.attention(q.detach(), k.half(), v)
    with pytest.raises(ValueError, match=r"Hq must be a multiple of Hkv"):
        wide_head.attention(torch.cat([q.detach()] * 3, 1)[:, :3], k[:, :1].repeat(1, 2, 1, 1), v[:, :1].repeat(1, 2, 1, 1))


def _backward_reference(q, k, v, dout, causal, scale=None):
    return oracle.attention_backward(*(to_numpy(x).astype(np.float64) for x in (q, k, v, dout)), causal=causal,
                                     scale=scale)


# (B, Hq, Hkv, Nq, Nk): ragged tiles both ways; GQA with more keys than queries; more queries than
# keys (causal: the first rows see none); one query (63 of its tile's rows padding); one partial
# key tile; many tiles of each
BACKWARD_SHAPES = [(2, 4, 2, 300, 300), (1, 4, 1, 77, 513), (1, 2, 2, 200, 100), (3, 2, 1, 1, 1000),
                   (1, 2, 1, 100, 40), (1, 2, 1, 1024, 1024)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", BACKWARD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_head_dim_512_backward_matches_the_oracle(dtype, causal, shape):
    """dq, dk, dv (every buffer the backward allocates NaN-filled) against the float64 oracle."""
    from fagen.bench_backward import nan_filled_empties

    q, k, v = _inputs(f"bwd{dtype}{causal}{shape}", *shape, dtype)
    dout = _inputs(f"dout{dtype}{causal}{shape}", *shape, dtype)[0]
    out, lse = wide_head.attention(q, k, v, causal=causal, return_lse=True)
    with nan_filled_empties() as filled:
        dq, dk, dv = wide_head.backward(dout, q, k, v, out, lse, causal=causal)
    assert filled
    ref = _backward_reference(q, k, v, dout, causal)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert got.shape == ref[name].shape and got.dtype == q.dtype
        assert relative_error(to_numpy(got), ref[name]) < OUT_TOLERANCE[dtype], name


def test_fagen_attention_trains_at_head_dim_512_in_flash_attention_s_layout():
    """Autograd through fagen.attention: [B, N, H, d] views, GQA, a scale, causal; the gradients
    against the oracle's."""
    q, k, v = _inputs("train", 2, 4, 2, 257, 700, "bfloat16", layout="bshd")
    dout = _inputs("train dout", 2, 4, 2, 257, 700, "bfloat16", layout="bshd")[0]
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fagen.attention(*leaves, causal=True, scale=0.03)
    out.backward(dout)
    ref = _backward_reference(q, k, v, dout, True, scale=0.03)
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        assert leaf.grad.shape == leaf.shape
        assert relative_error(to_numpy(leaf.grad), ref[name]) < OUT_TOLERANCE["bfloat16"], name


def test_a_nan_score_reaches_out_and_the_lse():
    """A NaN in K makes every row's scores NaN: O and the LSE say so (an LSE of -inf would pass
    for a row that saw no key, and a merge of LSEs would drop it)."""
    q, k, v = _inputs("nan", 1, 2, 1, 64, 100, "bfloat16")
    k[0, 0, 7, 3] = float("nan")
    out, lse = wide_head.attention(q, k, v, return_lse=True)
    assert torch.isnan(out).any(dim=-1).all() and torch.isnan(lse).all()


def test_sinks_given_as_a_list_are_refused_by_name_with_grad_mode_on():
    q, k, v = _inputs("list-sinks", 1, 2, 1, 64, 64, "bfloat16")
    with pytest.raises(ValueError, match=r"sinks: head_dim 512 runs no score modifier"):
        fagen.attention(q, k, v, sinks=[0.5, 0.5])


def test_a_pooled_loss_hands_the_backward_a_broadcast_gradient():
    """out.sum(dim=2) gives the backward a dout of stride 0 along the queries (no TMA map takes
    it): copied, not refused; the gradients against the oracle's of the broadcast dout."""
    q, k, v = _inputs("pooled", 1, 2, 1, 130, 200, "bfloat16")
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    weights = _inputs("pooled w", 1, 2, 1, 1, 200, "bfloat16")[0]
    (fagen.attention(*leaves).sum(dim=2, keepdim=True) * weights).sum().backward()
    ref = _backward_reference(q, k, v, weights.expand_as(q), False)
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        assert relative_error(to_numpy(leaf.grad), ref[name]) < OUT_TOLERANCE["bfloat16"], name


def test_a_compiled_layer_trains_at_head_dim_512_through_the_ops():
    """torch.compile(fullgraph=True) of a layer calling fagen.attention at head_dim 512: its
    forward and backward are fagen's ops; the gradients against the oracle's."""
    q, k, v = _inputs("compiled", 1, 4, 2, 200, 300, "bfloat16")
    dout = _inputs("compiled dout", 1, 4, 2, 200, 300, "bfloat16")[0]
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    @torch.compile(fullgraph=True)
    def layer(q, k, v):
        return fagen.attention(q, k, v, causal=True) * 2

    layer(*leaves).backward(dout)
    ref = _backward_reference(q, k, v, 2 * dout.double(), True)
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        assert relative_error(to_numpy(leaf.grad), ref[name]) < OUT_TOLERANCE["bfloat16"], name
