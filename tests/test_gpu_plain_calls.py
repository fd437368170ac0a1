"""A kernel's repeated plain calls (fagen.runtime.PlainCalls) and fagen.attention's eager path
without the op (fagen.torch_op), on the GPU: a call of a signature seen before launches the
Launch packed for the first one, re-pointed at its own tensors (and, for TMA kernels, its tensor
maps re-encoded). Fresh inputs per call, outputs poisoned with NaN, each against the float64
oracle."""

import pytest

import fagen
from fagen import oracle, runtime
from fagen.check import OUT_TOLERANCE, random_inputs, relative_error, to_numpy

pytestmark = pytest.mark.gpu

SHAPE = dict(b=2, hq=4, hkv=2, nq=300, nk=333)


def _inputs(framework, dtype, head_dim, seed, layout="bhnd"):
    s = SHAPE
    return random_inputs(framework, dtype, s["b"], s["hq"], s["hkv"], s["nq"], s["nk"], head_dim, seed=seed,
                         layout=layout)


def _poisoned(out):
    out[...] = float("nan")
    return out


def _check(q, k, v, out, causal, lse=None):
    ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, return_lse=True)
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE[str(q.dtype).removeprefix("torch.")]
    if lse is not None:
        assert relative_error(to_numpy(lse), ref_lse) < 1e-4


class _Packing:
    """Stands in for Kernel.launch: counts the calls that packed a Launch."""

    def __init__(self, launch):
        self.launch, self.calls = launch, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.launch(*args, **kwargs)


def _watched(kernel, monkeypatch) -> _Packing:
    """`kernel` with no signature cached (earlier tests share it) and its packing counted."""
    packing = _Packing(kernel.launch)
    monkeypatch.setattr(kernel, "launch", packing)
    monkeypatch.setattr(kernel, "plain_calls", runtime.PlainCalls())
    return packing


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("head_dim, causal", [(64, False), (128, True), (256, True)])
def test_a_signature_seen_before_is_launched_without_packing(framework, head_dim, causal, monkeypatch):
    """New tensors of a cached signature (new addresses): no packing, and each output is its own
    inputs' (a launch still pointing at the first call's tensors, or at maps encoded for them,
    would give the first call's output)."""
    if framework == "torch":
        pytest.importorskip("torch")
    kernel = runtime.compile_kernel(runtime.default_spec("float16", head_dim, causal, keys=SHAPE["nk"]))
    packing = _watched(kernel, monkeypatch)
    q, k, v, out = _inputs(framework, "float16", head_dim, seed=1)
    kernel(q, k, v, out=_poisoned(out))
    _check(q, k, v, out, causal)
    first = packing.calls
    assert first == 1
    for seed in (2, 3):
        q, k, v, out = _inputs(framework, "float16", head_dim, seed=seed)
        kernel(q, k, v, out=_poisoned(out))
        _check(q, k, v, out, causal)
    assert packing.calls == first, "a signature seen before was packed again"
    q, k, v, _ = _inputs(framework, "float16", head_dim, seed=4)
    fresh, lse = kernel(q, k, v, return_lse=True)  # out allocated: a signature of its own, then cached
    fresh, lse = kernel(q, k, v, return_lse=True)
    _check(q, k, v, fresh, causal, lse)
    assert packing.calls == first + 1


def test_other_strides_are_checked_and_packed(monkeypatch):
    """A layout not seen before ([B, N, H, d] strides) is a new signature: checked and packed."""
    kernel = runtime.compile_kernel(runtime.default_spec("float16", 128, False, keys=SHAPE["nk"]))
    packing = _watched(kernel, monkeypatch)
    q, k, v, out = _inputs("cupy", "float16", 128, seed=5)
    kernel(q, k, v, out=_poisoned(out))
    calls = packing.calls
    q, k, v, out = _inputs("cupy", "float16", 128, seed=6, layout="bnhd")
    kernel(q, k, v, out=_poisoned(out))
    _check(q, k, v, out, False)
    assert packing.calls == calls + 1


def test_a_misaligned_address_of_a_cached_signature_is_refused(monkeypatch):
    """Shape and strides as cached, the address 2 bytes off: the checked call refuses it."""
    cupy = pytest.importorskip("cupy")
    kernel = runtime.compile_kernel(runtime.default_spec("float16", 64, False))
    packing = _watched(kernel, monkeypatch)
    q, k, v, _ = _inputs("cupy", "float16", 64, seed=7)
    kernel(q, k, v)
    kernel(q, k, v)
    assert packing.calls == 1
    flat = cupy.zeros(q.size + 8, q.dtype)
    shifted = flat[1:1 + q.size].reshape(q.shape)
    shifted[...] = q
    assert (shifted.shape, shifted.strides) == (q.shape, q.strides)
    with pytest.raises(ValueError, match="16 bytes"):
        kernel(shifted, k, v)


@pytest.mark.parametrize("causal", [False, True])
def test_eager_no_grad_attention_matches_the_op(causal):
    """Under no_grad fagen.attention skips the op: the same kernel, so the same bits; with inputs
    that require grad it goes through the op (a grad_fn, and gradients)."""
    torch = pytest.importorskip("torch")
    q, k, v, _ = _inputs("torch", "bfloat16", 128, seed=8)
    with torch.no_grad():
        out, lse = fagen.attention(q, k, v, causal=causal, return_lse=True)
    op_out, op_lse = torch.ops.fagen.attention_forward(q, k, v, None, None, None, None, "", causal, None, None, False)
    assert torch.equal(out, op_out) and torch.equal(lse, op_lse)
    _check(q, k, v, out, causal, lse)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    tracked = fagen.attention(*leaves, causal=causal)
    assert tracked.grad_fn is not None and torch.equal(tracked.detach(), out)
