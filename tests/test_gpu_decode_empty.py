"""Calls with no work (marked `gpu`): no query rows (Nq, B or H zero) give empty outputs, rows
without keys (Nk zero) O = 0 and LSE = -inf (or the sink), gradients to match, through
fagen.attention (PyTorch and CuPy) and the paged entry point; nothing is launched, nothing
divides by zero, and a normal call still matches the oracle afterwards."""

import numpy as np
import pytest

import fagen
from fagen import oracle
from fagen.check import OUT_TOLERANCE, relative_error
from fagen.device import cupy

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")


def _randn(framework, shape, seed=0):
    """Random float16 of `shape`, laid out as a fresh allocation of it is (strides included)."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float16)
    if framework == "torch":
        return torch.empty(shape, dtype=torch.float16, device="cuda").copy_(torch.from_numpy(x))
    out = cupy.empty(shape, dtype=cupy.float16)
    out.set(x)
    return out


def _host(x):
    return x.detach().double().cpu().numpy() if hasattr(x, "detach") else cupy.asnumpy(x).astype(np.float64)


def _a_normal_call_matches_the_oracle(framework):
    """A decode call and a plain one after the empty ones, against the oracle."""
    for nq in (1, 200):
        q = _randn(framework, (2, 8, nq, 64), nq)
        k, v = _randn(framework, (2, 2, 300, 64), nq + 1), _randn(framework, (2, 2, 300, 64), nq + 2)
        out = fagen.attention(q, k, v, causal=True)
        ref = oracle.attention(_host(q), _host(k), _host(v), causal=True)
        assert relative_error(_host(out), ref) < OUT_TOLERANCE["float16"]


# (q, k) shapes without a query row: the issue's, a decode-sized one against a long cache, B 0,
# H 0 (and Hq 0 beside Hkv 2)
NO_ROWS = [((1, 1, 0, 64), (1, 1, 5, 64)), ((2, 8, 0, 128), (2, 2, 3000, 128)), ((0, 4, 3, 64), (0, 1, 5, 64)),
           ((1, 0, 3, 64), (1, 0, 5, 64)), ((1, 0, 3, 64), (1, 2, 5, 64))]


@pytest.mark.parametrize("framework", ["torch", "cupy"])
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("shapes", NO_ROWS, ids=str)
def test_a_call_without_query_rows_returns_empty_outputs(framework, return_lse, shapes):
    q_shape, k_shape = shapes
    q, k, v = _randn(framework, q_shape), _randn(framework, k_shape), _randn(framework, k_shape)
    got = fagen.attention(q, k, v, return_lse=return_lse)
    out, lse = got if return_lse else (got, None)
    assert type(out) is type(q) and tuple(out.shape) == q_shape and out.dtype == q.dtype
    if framework == "torch":
        assert out.device == q.device
    if return_lse:
        assert type(lse) is type(q) and tuple(lse.shape) == q_shape[:3] and str(lse.dtype).endswith("float32")
    _a_normal_call_matches_the_oracle(framework)


@pytest.mark.parametrize("framework", ["torch", "cupy"])
@pytest.mark.parametrize("nq", [3, 300], ids=["decode", "plain"])
@pytest.mark.parametrize("sinks", [False, True])
def test_rows_without_keys_give_zeros_and_their_sink_or_minus_infinity(framework, nq, sinks):
    """Nk = 0: every row sees no key, as a fully masked row: O = 0, LSE = -inf or its head's sink."""
    q = _randn(framework, (2, 8, nq, 64))
    k, v = _randn(framework, (2, 2, 0, 64)), _randn(framework, (2, 2, 0, 64))
    sink = np.random.default_rng(nq).standard_normal(8).astype(np.float32) if sinks else None
    given = None if sink is None else (torch.from_numpy(sink).cuda() if framework == "torch" else cupy.asarray(sink))
    out, lse = fagen.attention(q, k, v, return_lse=True, sinks=given)
    assert tuple(out.shape) == (2, 8, nq, 64) and out.dtype == q.dtype
    assert (_host(out) == 0).all()
    expected = np.broadcast_to(-np.inf if sink is None else sink[None, :, None].astype(np.float64), (2, 8, nq))
    assert np.array_equal(_host(lse), expected)
    _a_normal_call_matches_the_oracle(framework)


@pytest.mark.parametrize("shapes", [((1, 1, 0, 64), (1, 1, 5, 64)), ((2, 8, 3, 64), (2, 2, 0, 64)),
                                    ((0, 4, 3, 64), (0, 1, 5, 64))], ids=str)
def test_a_call_without_work_trains(shapes):
    """The output is a constant (empty, or zeros): dq, dk, dv and dsinks are zeros of their
    tensors' shapes (empty where the tensor is)."""
    q_shape, k_shape = shapes
    q, k, v = (_randn("torch", s, i).requires_grad_() for i, s in enumerate((q_shape, k_shape, k_shape)))
    sinks = torch.zeros(q_shape[1], device="cuda", requires_grad=True)
    out = fagen.attention(q, k, v, sinks=sinks)
    (out.float() * torch.randn(out.shape, device="cuda")).sum().backward()
    for x in (q, k, v, sinks):
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()
    q, k, v = (_randn("torch", s, i).requires_grad_() for i, s in enumerate(((1, 4, 64, 64), (1, 2, 64, 64),
                                                                           (1, 2, 64, 64))))
    fagen.attention(q, k, v, causal=True).sum().backward()  # a normal step after
    assert all(torch.isfinite(x.grad).all() and x.grad.any() for x in (q, k, v))


def test_paged_calls_without_query_rows_return_empty_outputs():
    """attention_with_kvcache with B 0, or Nq 0 (new tokens of none), padded and varlen; the
    cache is left as it was. A prepared call refuses, naming the shape."""
    k_cache, v_cache = _randn("torch", (6, 16, 2, 64), 1), _randn("torch", (6, 16, 2, 64), 2)
    before = k_cache.clone()
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([20, 5], dtype=torch.int32, device="cuda")
    none = torch.zeros(0, dtype=torch.int32, device="cuda")
    out, lse = fagen.attention_with_kvcache(_randn("torch", (0, 8, 1, 64)), k_cache, v_cache, none,
                                            none.reshape(0, 2), return_lse=True, validate=False)
    assert out.shape == (0, 8, 1, 64) and lse.shape == (0, 8, 1)
    new = _randn("torch", (2, 2, 0, 64))
    out, lse = fagen.attention_with_kvcache(_randn("torch", (2, 8, 0, 64)), k_cache, v_cache, lens, table, k=new,
                                            v=new, return_lse=True)
    assert out.shape == (2, 8, 0, 64) and lse.shape == (2, 8, 0)
    cu = torch.tensor([0, 0, 0], dtype=torch.int32, device="cuda")
    out = fagen.attention_with_kvcache(_randn("torch", (0, 8, 64)), k_cache, v_cache, lens, table,
                                       k=_randn("torch", (0, 2, 64)), v=_randn("torch", (0, 2, 64)),
                                       cu_seqlens_q=cu, max_seqlen_q=1)
    assert out.shape == (0, 8, 64)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, before)
    with pytest.raises(ValueError, match=r"q: shape \(2, 8, 0, 64\), no query row to prepare"):
        fagen.prepare_with_kvcache(_randn("torch", (2, 8, 0, 64)), k_cache, v_cache, lens, table)
    q = _randn("torch", (2, 8, 1, 64))
    out = fagen.attention_with_kvcache(q, k_cache, v_cache, lens, table)  # a normal call after
    ref = oracle.attention_paged(_host(q), _host(k_cache), _host(v_cache), table.cpu().numpy(), [20, 5])
    assert relative_error(_host(out), ref) < OUT_TOLERANCE["float16"]


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_a_prepared_call_refuses_a_call_without_work(framework):
    q, k = _randn(framework, (1, 1, 0, 64)), _randn(framework, (1, 1, 5, 64))
    with pytest.raises(ValueError, match=r"q \(1, 1, 0, 64\), k \(1, 1, 5, 64\): no work to prepare"):
        fagen.prepare(q, k, k)
    q, k = _randn(framework, (1, 4, 1, 64)), _randn(framework, (1, 1, 0, 64))
    with pytest.raises(ValueError, match="no work to prepare"):
        fagen.prepare(q, k, k)
    _a_normal_call_matches_the_oracle(framework)
