"""fagen's PyTorch face without a GPU: `import fagen` and fagen.attention on arrays that are
not PyTorch tensors never load torch; where torch is installed, the ops' schemas, the mask's
JSON round trip (GPU runs: tests/test_gpu_torch.py)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fagen
from fagen.spec import Mask

ROOT = Path(__file__).resolve().parent.parent


def test_fagen_routes_arrays_without_importing_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import numpy as np
        import fagen
        q = np.zeros((1, 2, 8, 64), np.float16)
        try:
            fagen.attention(q, q, q, causal=True)
        except ValueError as err:
            assert "host" in str(err), err
        else:
            raise AssertionError("a NumPy q was accepted")
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("mask", [None, "causal", {"kind": "sliding_window", "window_left": 128},
                                  Mask(kind="document", causal=True),
                                  {"kind": "chunked", "chunk_size": 64, "expression": "(q_idx + kv_idx) % 3 != 0"}])
def test_mask_json_round_trip(mask):
    torch_op = pytest.importorskip("fagen.torch_op")  # needs torch
    text = torch_op.mask_json(mask)
    assert isinstance(text, str) and (text == "") == (mask is None)
    assert torch_op.mask_of(text) == (None if mask is None else Mask.model_validate(mask))


def test_op_schemas():
    pytest.importorskip("fagen.torch_op")
    import torch

    side = "Tensor? bias, Tensor? alibi_slopes, Tensor? sinks, Tensor? doc_ids, str mask, bool causal, " \
           "float? softcap, float? scale, bool deterministic"
    ranged = side.replace("str mask", "Tensor? cache_seqlens, Tensor? cache_leftpad, str mask")
    assert str(torch.ops.fagen.attention_forward.default._schema) == \
        f"fagen::attention_forward(Tensor q, Tensor k, Tensor v, {ranged}) -> (Tensor, Tensor)"
    assert str(torch.ops.fagen.attention_backward.default._schema) == \
        f"fagen::attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {side}, " \
        f"bool bias_grad) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    descales = "Tensor? q_descale, Tensor? k_descale, Tensor? v_descale"
    assert str(torch.ops.fagen.fp8_attention_forward.default._schema) == \
        f"fagen::fp8_attention_forward(Tensor q, Tensor k, Tensor v, {descales}, Tensor? sinks, Tensor? alibi_slopes, " \
        f"Tensor? bias, Tensor? doc_ids, str mask, bool causal, float? softcap, float? scale, Tensor? scale_o, " \
        f"bool return_amax) -> (Tensor, Tensor, Tensor)"




def test_an_eager_process_never_loads_torch_compile():
    """Importing the ops and their first calls, forward and backward through autograd, load no
    torch._dynamo (about a second of a process's first call, where the ops came from
    torch.library.custom_op); the runtime is stubbed: this checks the ops' dispatch alone."""
    pytest.importorskip("fagen.torch_op")
    code = textwrap.dedent("""
        import sys, time
        import torch
        from fagen import backward, decode, torch_op
        decode.forward = lambda plain, q, k, v, **kw: (q * 1, q.new_zeros(q.shape[:3]))
        torch_op.dispatch.derive_spec = lambda *a, **k: None
        torch_op.variants.trainable = lambda *a, **k: None
        grads = lambda dout, q, k, v, out, lse, **kw: type("G", (), dict(dq=dout * 1, dk=k * 0, dv=v * 0))
        backward.compile_backward = lambda spec: grads
        backward.readable = lambda dout: dout  # (it reads a CUDA tensor's strides: these are the CPU's)
        q = torch.randn(1, 2, 4, 64, requires_grad=True)
        start = time.perf_counter()
        out, lse = torch.ops.fagen.attention_forward(q, q, q, None, None, None, None, None, None, "", True, None, None, False)
        out.sum().backward()
        took = time.perf_counter() - start
        assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
        assert float(q.grad.sum()) == q.numel() and not lse.requires_grad
        print(took)
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) < 0.5  # 1.6 ms and 6.5 ms measured; torch._dynamo's import alone took 1 s


def test_torch_compile_traces_the_mask_as_a_constant():
    """mask_json is marked constant for torch.compile without importing it: a fullgraph trace of
    a call with a pydantic Mask does not break (pydantic is not traceable)."""
    torch_op = pytest.importorskip("fagen.torch_op")
    import torch

    mask = Mask(kind="sliding_window", window_left=5)

    @torch.compile(fullgraph=True, backend="eager")
    def length(x):
        return x + len(torch_op.mask_json(mask))

    assert float(length(torch.zeros(1))) == len(torch_op.mask_json(mask))


def test_the_op_refuses_gradients_through_key_ranges(monkeypatch):
    """Key ranges have no backward: a direct call of the op with them, on inputs that need
    gradients, is refused when autograd records it (not differentiated as if unranged). The
    kernels are stubbed: this checks the op's autograd registration alone."""
    pytest.importorskip("fagen.torch_op")
    import torch
    from fagen import decode, torch_op

    monkeypatch.setattr(decode, "forward", lambda plain, q, k, v, **kw: (q * 1, q.new_zeros(q.shape[:3])))
    monkeypatch.setattr(torch_op.dispatch, "derive_spec", lambda *a, **k: None)
    q = torch.randn(2, 2, 4, 64, requires_grad=True)
    ends = torch.tensor([4, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="key ranges are an inference layout"):
        torch.ops.fagen.attention_forward(q, q, q, None, None, None, None, ends, None, "", True, None, None, False)
    with torch.no_grad():
        out, _ = torch.ops.fagen.attention_forward(q, q, q, None, None, None, None, ends, None, "", True, None, None,
                                                   False)
    assert out.shape == q.shape


def test_an_eager_training_call_runs_the_op_s_implementation_without_its_dispatch(monkeypatch):
    """Autograd records an eager call through _EagerAttention (the op's implementation and
    formula, minus the dispatch's host time); the gradients are the formula's. Under tracing the
    op runs (the compile tests). The kernels are stubbed: out = 2 q, dq = 3 dout."""
    pytest.importorskip("fagen.torch_op")
    import torch
    from fagen import backward, decode, torch_op
    from fagen.backward import Gradients

    class Kernels:
        def __call__(self, dout, q, k, v, out, lse, **side):
            return Gradients(3 * dout, torch.zeros_like(k), torch.ones_like(v))

    monkeypatch.setattr(decode, "forward", lambda plain, q, k, v, **kw: (2 * q, q.new_zeros(q.shape[:3])))
    monkeypatch.setattr(torch_op.dispatch, "derive_spec", lambda *a, **k: None)
    monkeypatch.setattr(torch_op.variants, "trainable", lambda *a: None)
    monkeypatch.setattr(backward, "compile_backward", lambda spec: Kernels())
    monkeypatch.setattr(backward, "readable", lambda dout: dout)  # (it reads a CUDA tensor's strides)
    q, k, v = (torch.randn(2, 4, 8, 64, requires_grad=True) for _ in range(3))
    out = torch_op.attention(q, k, v, causal=True)
    assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
    assert torch.equal(out, 2 * q)
    out.backward(torch.full_like(out, 0.5))
    assert torch.equal(q.grad, torch.full_like(q, 1.5)) and not k.grad.any() and torch.equal(v.grad, torch.ones_like(v))
    ends = torch.tensor([8, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="key ranges are an inference layout"):
        torch_op.attention(q, k, v, cache_seqlens=ends)


def test_eager_calls_with_descales_reach_their_kept_class_and_fp8_q_arrives_as_it_is(monkeypatch):
    """fagen.attention's eager fast path: a call without descales goes to ShapeClasses as before
    (no descales in its arguments); an FP8 cache's descales go with the call; FP8 q, k, v arrive
    as they are beside q_descale, with or without descales (the class decides whether a decode
    step's kernels take them, and widen q as it lands); a half-type q with q_descale does not
    (the general path refuses it by name), nor does what no class takes."""
    torch = pytest.importorskip("torch")
    from fagen import decode, torch_op

    seen = []

    def classes(q, k, v, causal, mask, softcap, scale, sinks, return_lse, ranges=(), descales=()):
        seen.append((q.dtype, descales))
        return "out" if q.shape[2] == 1 else NotImplemented  # (a decode step's class; none for the FP8 forward's)

    monkeypatch.setattr(decode, "SHAPE_CLASSES", classes)
    general = []
    monkeypatch.setattr(torch_op, "_fp8_attention", lambda *a, **kw: general.append(a[0].dtype) or "general")
    q16, k16 = torch.zeros(2, 32, 1, 128, dtype=torch.bfloat16), torch.zeros(2, 8, 300, 128, dtype=torch.bfloat16)
    q8, k8 = q16.to(torch.float8_e4m3fn), k16.to(torch.float8_e4m3fn)
    assert torch_op.attention(q16, k16, k16) == "out" and seen.pop() == (torch.bfloat16, ())
    assert torch_op.attention(q16, k8, k8, k_descale=0.5, v_descale=2.0) == "out"
    assert seen.pop() == (torch.bfloat16, (None, 0.5, 2.0))
    assert torch_op.attention(q8, k8, k8, q_descale=0.25, k_descale=0.5) == "out"
    assert seen.pop() == (torch.float8_e4m3fn, (0.25, 0.5, None))  # as it is, its descale beside k's
    assert torch_op.attention(q8, k8, k8) == "out" and seen == [(torch.float8_e4m3fn, ())]
    seen.clear()
    assert torch_op.attention(q16, k8, k8, q_descale=0.25) == "general" and not seen  # refused there, by name
    assert torch_op.attention(q16, k16, k16, k_descale=0.5) == "general" and not seen  # descales of no FP8 tensor
    rows200 = torch.zeros(2, 8, 200, 128).to(torch.float8_e4m3fn)  # the FP8 forward's shapes: no class
    assert torch_op.attention(rows200, k8[:, :8], k8[:, :8], q_descale=0.25) == "general"
    assert seen == [(torch.float8_e4m3fn, (0.25, None, None))]
    assert general == [torch.bfloat16, torch.bfloat16, torch.float8_e4m3fn]
