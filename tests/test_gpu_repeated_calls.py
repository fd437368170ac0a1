"""A kernel's repeated calls (fagen.runtime.RepeatedCalls: plain ones, and a ring step's
accumulating and partial ones), a QueryRows.add of a key seen before, and fagen.attention's eager
path without the op (fagen.torch_op), on the GPU: a call of a signature seen before launches the
Launch packed for the first one, re-pointed at its own tensors (and, for TMA kernels, its tensor
maps re-encoded). Fresh inputs per call, outputs poisoned with NaN, each against the float64
oracle."""

import numpy as np
import pytest

import fagen
from fagen import dispatch, oracle, runtime, variants
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
    monkeypatch.setattr(kernel, "repeated_calls", runtime.RepeatedCalls(kernel.repeated_calls.writes_given))
    return packing


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("head_dim, causal", [(64, False), (128, True), (256, True)])
def test_a_signature_seen_before_is_launched_without_packing(framework, head_dim, causal, monkeypatch):
    """New tensors of a cached signature (new addresses): no packing, and each output is its own
    inputs' (a launch still pointing at the first call's tensors, or at maps encoded for them,
    would give the first call's output)."""
    if framework == "torch":
        pytest.importorskip("torch")
    kernel = runtime.compile_kernel(dispatch.default_spec("float16", head_dim, causal, keys=SHAPE["nk"]))
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
    kernel = runtime.compile_kernel(dispatch.default_spec("float16", 128, False, keys=SHAPE["nk"]))
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
    kernel = runtime.compile_kernel(dispatch.default_spec("float16", 64, False))
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
    op_out, op_lse = torch.ops.fagen.attention_forward(q, k, v, None, None, None, None, None, None, "", causal, None, None,
                                                          False)
    assert torch.equal(out, op_out) and torch.equal(lse, op_lse)
    _check(q, k, v, out, causal, lse)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    tracked = fagen.attention(*leaves, causal=causal)
    assert tracked.grad_fn is not None and torch.equal(tracked.detach(), out)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_ring_steps_launches_are_packed_once(dtype, monkeypatch):
    """A ring's steps, call after call: the diagonal block's partial written into the running O
    and LSE (mask_offset given), other blocks folded in (two row slices of one signature). A
    second round on fresh tensors packs nothing and gives its own inputs' attention; a moved
    diagonal is a key of its own (packed, and right)."""
    torch = pytest.importorskip("torch")
    first = runtime.compile_kernel(variants.ring_start_variant(dispatch.default_spec(dtype, 128, True)))
    fold = runtime.compile_kernel(variants.accumulate_variant(dispatch.default_spec(dtype, 128, False)))
    packing = {"first": _watched(first, monkeypatch), "fold": _watched(fold, monkeypatch)}
    nq, nk, s = 384, 1024, 640  # keys s.. hold the diagonal (bottom-right: query i sees keys ..i + 640)

    held = []  # every round's tensors stay alive: a later round's lie elsewhere, so a stale address shows

    def steps(offset: int):
        q, k, v, _ = random_inputs("torch", dtype, 1, 4, 2, nq, nk, 128, seed=int(torch.randint(1 << 30, ())))
        o = torch.full((1, 4, nq, 128), float("nan"), device="cuda")
        lse = torch.full((1, 4, nq), float("nan"), device="cuda")
        assert all(x.data_ptr() != y.data_ptr() for before in held for x, y in zip((q, k, v, o, lse), before))
        held.append((q, k, v, o, lse))
        first(q, k[:, :, s:], v[:, :, s:], out=o[None], lse=lse[None], mask_offset=offset)
        for rows in (slice(0, 192), slice(192, nq)):
            got = fold(q[:, :, rows], k[:, :, :s], v[:, :, :s], out=o[:, :, rows], lse=lse[:, :, rows])
            assert got[0].data_ptr() == o[:, :, rows].data_ptr()
        seen = lambda b, h, i, j: (j < s) | (j <= i + s + offset)  # keys ..s through the fold  # noqa: E731
        ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), mask_mod=seen, return_lse=True)
        assert relative_error(to_numpy(o), ref) < OUT_TOLERANCE[dtype]
        assert relative_error(to_numpy(lse), ref_lse) < 1e-4

    steps(0)
    assert (packing["first"].calls, packing["fold"].calls) == (1, 1)
    steps(0)
    assert (packing["first"].calls, packing["fold"].calls) == (1, 1), "a ring step seen before was packed again"
    steps(-64)  # the diagonal 64 keys further left: a new key for the first launch
    assert (packing["first"].calls, packing["fold"].calls) == (2, 1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_query_rows_add_seen_before_is_launched_without_packing(dtype, monkeypatch):
    """The ring backward's own block (QueryRows.head and .tail: test_gpu_backward.ring_own_block)
    on fresh tensors twice, the first round's kept alive: the second round's adds pack no Launch
    (new rows' buffers, a new block and new dK/dV: every address re-pointed), and each round's
    gradients are its own inputs' (against the float64 oracle)."""
    torch = pytest.importorskip("torch")
    from fagen.backward import compile_backward
    from tests.test_gpu_backward import ring_own_block

    kernels = compile_backward(variants.trainable(dispatch.default_spec(dtype, 128, True)))
    if not kernels.plan.atomic_dq or not kernels.producer_threads:
        pytest.skip("adds keep their launch where dQ is atomic and the dK/dV kernel is producer-fed (sm_90a)")
    monkeypatch.setattr(kernels, "repeated_adds", runtime.KeptLaunches())
    packed = []
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda role, *a, **kw: packed.append(role) or launch(role, *a, **kw))
    held = []  # the first round's rows, inputs and dK/dV stay alive: the second's lie elsewhere
    for _ in range(2):
        q, k, v, _ = random_inputs("torch", dtype, 1, 4, 2, 320, 320, 128, seed=int(torch.randint(1 << 30, ())))
        dout = torch.randn_like(q)
        out, lse = kernels.forward(q, k, v, return_lse=True)
        rows = kernels.query_rows(dout, q, out, lse)
        written = ring_own_block(kernels, (q, k, v, dout), rows)
        addresses = [x.data_ptr() for x in (q, k, v, dout, *written)] + list(rows._buffers)
        held.append((addresses, (q, k, v, dout, rows, written)))
    assert not set(held[0][0]) & set(held[1][0]), "a buffer of the first round was reused: no address re-pointed there"
    assert packed.count("dkdv") == 2, f"dK/dV launches packed: {packed.count('dkdv')} (2 keys, two rounds)"
