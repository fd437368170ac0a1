"""fagen.flex: FlexAttention's API. Without a GPU, the kernels are stood in for by the float64
oracle reading the traced spec fields (what the GPU tests judge the kernels by), and the whole
chain (trace, block mask, oracle) is held to PyTorch computing attention with the user's own
Python functions, output and gradients."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fagen import captured_grads, flex, masks, oracle, torch_op  # noqa: E402

B, HQ, HKV, N, D = 2, 4, 2, 96, 32

CASES = {
    "softcap_causal": (lambda s, b, h, q, k: 20.0 * torch.tanh(s / 20.0), lambda b, h, q, k: q >= k),
    "alibi_sliding_window": (lambda s, b, h, q, k: s - torch.exp2(-8.0 * (h + 1) / HQ) * (q - k).abs(),
                             lambda b, h, q, k: (q >= k) & (q - k <= 40)),
    "relative_bias_dilated": (lambda s, b, h, q, k: s + 0.05 * ((q - k) // 3),
                              lambda b, h, q, k: ((q - k) % 2 == 0) | (k < 8)),
    "per_head_mask_only": (None, lambda b, h, q, k: torch.where(h % 2 == 0, q >= k, (q // 32) == (k // 32))),
    "score_only": (lambda s, b, h, q, k: s * torch.sigmoid(s) + 0.1 * b, None),
    # a captured table (a kernel input) by head and distance, as attention-gym's relative bias
    "bias_table_causal": (lambda s, b, h, q, k: s + TABLE[h, q - k + N - 1], lambda b, h, q, k: q >= k),
    "t5_buckets_causal": (lambda s, b, h, q, k: s + T5_TABLE[h, t5_bucket(q - k, 8, 32)], lambda b, h, q, k: q >= k),
}
TABLE = torch.randn(HQ, 2 * N - 1, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
T5_TABLE = torch.randn(HQ, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)


def t5_bucket(distance, buckets: int, max_distance: int):
    """T5's relative-position bucket of a causal distance (transformers' _relative_position_bucket,
    bidirectional=False): exact below buckets / 2, log-spaced up to max_distance, clamped to the
    last bucket (the lower clamp a no-op that proves the table's index in range)."""
    exact = buckets // 2
    distance = distance.clamp(min=0)
    logarithmic = exact + (torch.log(distance.float() / exact) / np.log(max_distance / exact) * (buckets - exact))
    return torch.where(distance < exact, distance, logarithmic.int().clamp(exact, buckets - 1))


def reference_attention(q, k, v, score_mod, mask_mod):
    """Attention as PyTorch computes it with the user's functions: float64, FlexAttention's default
    scale, GQA by repeating K and V (tests/test_gpu_flex.py's reference too)."""
    q, k, v = (x.double() for x in (q, k, v))
    k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    b, h, qi, ki = (torch.arange(n, device=q.device).view(*[-1 if i == axis else 1 for i in range(4)])
                    for axis, n in enumerate(s.shape))
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, ki).expand(s.shape), float("-inf"))
    return torch.softmax(s, -1) @ v


def oracle_kernels(seen: dict):
    """torch_op's flex kernels (forward, backward) as the oracle computes them from the traced
    fields, in float64 on the CPU; `seen` records the mask they were given."""
    def fields(traced):
        return None if traced is None else {"expression": traced.expression, "expression_grad": traced.expression_grad,
                                            "captured": len(traced.captured)}

    def tables(captured):
        return [t.detach().numpy() for t in captured]

    def forward(q, k, v, traced, block_mask, scale, captured=()):
        seen.update(block_mask=block_mask, traced=traced, captured=captured)
        out, lse = oracle.attention(*(x.detach().numpy() for x in (q, k, v)), scale=scale, block_mask=block_mask,
                                    score_mod=fields(traced), return_lse=True, captured=tables(captured))
        return torch.from_numpy(out), torch.from_numpy(lse)

    def backward(dout, q, k, v, out, lse, traced, block_mask, scale, captured=(), wanted=(), inputs_wanted=True):
        got = oracle.attention_backward(*(x.detach().numpy() for x in (q, k, v, dout)), scale=scale,
                                        block_mask=block_mask, score_mod=fields(traced), captured=tables(captured))
        wanted = list(wanted) + [False] * (len(captured) - len(wanted))
        table_grads = captured_grads.captured_grads(
            dout, q, k, v, out, lse, captured_grads.score_tree(traced.expression, len(captured)), block_mask, scale,
            captured, wanted) if any(wanted) else [None] * len(captured)
        return (*(torch.from_numpy(got[name]) for name in ("dq", "dk", "dv")), table_grads)
    return forward, backward


@pytest.mark.parametrize("case", list(CASES))
def test_flex_attention_is_pytorch_s_attention_with_the_same_functions(case, monkeypatch):
    """Output and q, k, v gradients against PyTorch running the same functions (the kernels: the
    oracle on the traced fields); a causal mask_mod's blocks take the causal kernels."""
    score_mod, mask_mod = CASES[case]
    seen = {}
    forward, backward = oracle_kernels(seen)
    monkeypatch.setattr(torch_op, "flex_kernels_forward", forward)
    monkeypatch.setattr(torch_op, "flex_kernels_backward", backward)
    gen = torch.Generator().manual_seed(len(case))
    leaves = [torch.randn(B, h, N, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (HQ, HKV, HKV)]
    block_mask = None if mask_mod is None else flex.create_block_mask(mask_mod, None, HQ, N, N, device="cpu", BLOCK_SIZE=32)
    out = flex.flex_attention(*leaves, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    references = [x.detach().clone().requires_grad_() for x in leaves]
    want = reference_attention(*references, score_mod, mask_mod)
    assert torch.allclose(out, want, rtol=1e-4, atol=1e-5), (out - want).abs().max()
    assert (seen["traced"] is None) == (score_mod is None) and (seen["block_mask"] is None) == (mask_mod is None)
    dout = torch.randn(B, HQ, N, D, generator=gen, dtype=torch.float64)
    for name, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout),
                          torch.autograd.grad(want, references, dout)):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("mask", ["causal", "prefix", "window_by_head"])
def test_a_captured_table_that_requires_grad_gets_its_gradient_bitwise_repeatable(mask, monkeypatch):
    """A learned relative bias [H, 2N - 1] (requires grad): its gradient (captured_grads, the
    score's gradient pulled back through score_mod a slab of rows at a time) against PyTorch's
    autograd through the same function, and the same bits twice."""
    seen = {}
    forward, backward = oracle_kernels(seen)
    monkeypatch.setattr(torch_op, "flex_kernels_forward", forward)
    monkeypatch.setattr(torch_op, "flex_kernels_backward", backward)
    monkeypatch.setattr(captured_grads, "CHUNK_SCORES", B * HQ * N * 7)  # slabs of 7 rows: several, uneven
    table = (TABLE * 0.5).requires_grad_()
    score_mod = lambda s, b, h, q, k: s + table[h, q - k + N - 1]  # noqa: E731
    mask_mod = {"causal": lambda b, h, q, k: q >= k, "prefix": lambda b, h, q, k: (q >= k) | (k < 20),
                "window_by_head": lambda b, h, q, k: (q >= k) & (q - k <= 10 + 7 * h)}[mask]
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(B, h, N, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV, HKV))
    block_mask = flex.create_block_mask(mask_mod, None, HQ if mask == "window_by_head" else None, N, N, device="cpu",
                                        BLOCK_SIZE=32)
    dout = torch.randn(B, HQ, N, D, generator=gen, dtype=torch.float64)
    got = [torch.autograd.grad(flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                   enable_gqa=True), table, dout)[0] for _ in range(2)]
    want = torch.autograd.grad(reference_attention(q, k, v, score_mod, mask_mod), table, dout)[0]
    # float32 slabs against float64 autograd: a relative norm, as the GPU tests judge
    assert float((got[0] - want).norm() / want.norm()) < 1e-5
    assert torch.equal(got[0], got[1])


NUMPY_MASKS = {  # mask_mods both PyTorch and NumPy run: create_block_mask's blocks against from_predicate's
    "causal": lambda b, h, q, k: q >= k,
    "window_and_head": lambda b, h, q, k: (q >= k) & (q - k <= 37 + 5 * h),
    "dilated_or_prefix": lambda b, h, q, k: ((q - k) % 3 == 0) | (k < 21),
    "batch_rows": lambda b, h, q, k: (q // 16 + b) % 2 == k // 16 % 2,
    "none_seen_in_some_rows": lambda b, h, q, k: (q % 50 < 25) & (k <= q),
}


@pytest.mark.parametrize("name", list(NUMPY_MASKS))
@pytest.mark.parametrize("shape", [(None, None, 100, 120, (32, 16)), (2, 3, 77, 77, 32), (1, 2, 64, 200, (64, 32))])
def test_create_block_mask_builds_from_predicate_s_block_mask(name, shape, monkeypatch):
    """Classified in PyTorch a chunk of query blocks at a time (chunks of one block here), the
    block mask is the host builder's, array for array, and its dense form the mask_mod's."""
    b, h, n_q, n_kv, size = shape
    mask_mod = NUMPY_MASKS[name]
    monkeypatch.setattr(flex, "CHUNK_ELEMENTS", 1)
    got = flex.create_block_mask(mask_mod, b, h, n_q, n_kv, device="cpu", BLOCK_SIZE=size)
    q_block, kv_block = (size, size) if isinstance(size, int) else size
    want = masks.from_predicate(mask_mod, b or 1, h or 1, n_q, n_kv, q_block=q_block, kv_block=kv_block)
    for field in ("kv_num_blocks", "kv_indices", "block_types", "partial_index", "partial_masks"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    assert 0 < want.to_dense().mean() < 1 and want.kv_num_blocks.sum() > 0


def test_create_block_mask_reads_captured_tensors():
    """Document masking, attention-gym's way: the mask_mod indexes a captured tensor of document
    ids, which the block mask bakes in (no kernel input needed)."""
    documents = torch.tensor([0] * 40 + [1] * 25 + [2] * 35)
    mask_mod = lambda b, h, q, k: (documents[q] == documents[k]) & (q >= k)  # noqa: E731
    bm = flex.create_block_mask(mask_mod, None, None, 100, 100, device="cpu", BLOCK_SIZE=16)
    q, k = torch.arange(100)[:, None], torch.arange(100)[None, :]
    np.testing.assert_array_equal(bm.to_dense()[0, 0], mask_mod(0, 0, q, k).numpy())


def test_flex_attention_refuses_what_flexattention_refuses_and_what_it_cannot_trace():
    q, k = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flex.flex_attention(q, k, k)
    table = torch.zeros(4, 16)
    # PyTorch would wrap a negative index (or raise past the end): fagen proves each in range
    with pytest.raises(flex.TraceError, match=r"dimension 1 \(size 16\) is indexed by q_idx - kv_idx, which may be -7"):
        flex.flex_attention(q, k, k, score_mod=lambda s, b, h, qi, ki: s + table[h, qi - ki], enable_gqa=True)
    with pytest.raises(flex.TraceError, match=r"dimension 0 \(size 4\) is indexed by h \+ 4, which may be 7"):
        flex.flex_attention(q, k, k, score_mod=lambda s, b, h, qi, ki: s + table[h + 4, qi - ki + 7], enable_gqa=True)
    with pytest.raises(flex.TraceError, match=r"a bool index into a captured tensor"):
        flex.flex_attention(q, k, k, score_mod=lambda s, b, h, qi, ki: s + table[h, qi > ki], enable_gqa=True)


def test_a_traced_score_mod_derives_the_spec_fagen_runs(monkeypatch):
    """The traced fields reach the spec dispatch derives (beside a block mask), which renders;
    the backward's trainable variant keeps them."""
    from fagen import device, dispatch, variants
    from fagen.backward_plan import backward_plan

    monkeypatch.setattr(device, "gpu_slug", lambda: "h200")
    traced = flex.trace_score_mod(CASES["softcap_causal"][0])
    spec = dispatch.derive_spec_for("float16", 128, block_mask=object(),
                                    score_expression=(traced.expression, traced.expression_grad, 0))
    assert spec.mask.kind == "block_mask"
    assert (spec.score_mod.expression, spec.score_mod.expression_grad) == (traced.expression, traced.expression_grad)
    trained = variants.trainable(spec)
    assert trained.score_mod == spec.score_mod and backward_plan(trained) is not None


def test_what_flex_attention_and_create_block_mask_refuse():
    with pytest.raises(TypeError, match="must return bools"):
        flex.create_block_mask(lambda b, h, q, k: (q >= k).int(), None, None, 64, 64, device="cpu")
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(TypeError, match="neither fagen's block mask nor FlexAttention's"):
        flex.flex_attention(q, q, q, block_mask=object())


def test_a_flexattention_block_mask_is_rebuilt_once_as_fagen_s(monkeypatch):
    """Swapping flex_attention's import alone: FlexAttention's own BlockMask is rebuilt from its
    mask_mod, lengths, batch, heads and block sizes, once while it lives."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    mask_mod = NUMPY_MASKS["window_and_head"]
    theirs = torch_create_block_mask(mask_mod, None, 3, 200, 180, device="cpu", BLOCK_SIZE=(64, 32))
    used = []
    monkeypatch.setattr(torch_op, "flex_kernels_forward",
                        lambda q, k, v, traced, block_mask, *rest: used.append(block_mask) or (q, q[..., 0]))
    q = torch.zeros(1, 3, 200, 16)
    kv = torch.zeros(1, 3, 180, 16)
    flex.flex_attention(q, kv, kv, block_mask=theirs)
    flex.flex_attention(q, kv, kv, block_mask=theirs)
    ours = flex.create_block_mask(mask_mod, None, 3, 200, 180, device="cpu", BLOCK_SIZE=(64, 32))
    assert used[0] is used[1] and (used[0].q_block, used[0].kv_block) == (64, 32)
    np.testing.assert_array_equal(used[0].to_dense(), ours.to_dense())


def test_the_eager_kernels_autograd_carries_the_traced_score_mod_both_ways(monkeypatch):
    """flex_attention through torch_op._EagerKernelAttention, its kernels stubbed: the traced
    fields reach the spec the forward derives, the backward runs that spec's trainable variant
    with the block mask, and every input's gradient comes back (one a forward input)."""
    from types import SimpleNamespace

    from fagen import backward, dispatch, runtime, variants

    seen = {}

    def derive_spec(q, **kwargs):
        seen["derive"] = kwargs
        return "spec"

    def compile_kernel(spec):
        return lambda q, k, v, **kw: (q * 2, torch.zeros(q.shape[:3]))

    def compile_backward(spec):
        seen["backward"] = spec

        def run(dout, q, k, v, out, lse, **kw):
            seen["backward_kwargs"] = kw
            return SimpleNamespace(dq=dout * 2, dk=torch.ones_like(k), dv=torch.full_like(v, 3.0), dbias=None,
                                   dsinks=None)
        return run

    monkeypatch.setattr(dispatch, "derive_spec", derive_spec)
    monkeypatch.setattr(runtime, "compile_kernel", compile_kernel)
    monkeypatch.setattr(backward, "compile_backward", compile_backward)
    monkeypatch.setattr(backward, "readable", lambda dout, what="dout": dout)  # (a CUDA tensor's strides)
    monkeypatch.setattr(variants, "trainable", lambda spec, deterministic=False, bias_grad=False, captured_grads=(): (
        "trainable", spec))
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    bm = flex.create_block_mask(lambda b, h, qi, ki: (qi >= ki) & ((qi - ki) % 3 != 1), None, None, 8, 8, device="cpu",
                                BLOCK_SIZE=4)  # no mask kind's pattern: read as a block mask
    out = flex.flex_attention(q, k, v, score_mod=CASES["softcap_causal"][0], block_mask=bm, scale=0.25)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    traced = flex.trace_score_mod(CASES["softcap_causal"][0])
    assert seen["derive"]["score_expression"] == (traced.expression, traced.expression_grad, 0)
    assert seen["derive"]["block_mask"] is bm and seen["backward"] == ("trainable", "spec")
    assert seen["backward_kwargs"]["block_mask"] is bm and seen["backward_kwargs"]["scale"] == 0.25
    assert torch.equal(dq, torch.full_like(q, 2.0)) and torch.equal(dk, torch.ones_like(k)) and (dv == 3).all()


def test_int_arithmetic_that_would_wrap_in_the_kernel_s_int32_is_refused_at_the_call(monkeypatch):
    """The kernel's ints are int32 (PyTorch's int64): a score_mod whose int terms may pass 2^31 at
    the call's lengths is refused naming the term; at lengths where they cannot, it runs."""
    from fagen import dispatch, runtime

    monkeypatch.setattr(dispatch, "derive_spec", lambda q, **kwargs: "spec")  # the checks run, then no kernel
    monkeypatch.setattr(runtime, "compile_kernel", lambda spec: lambda q, k, v, **kw: (q + 1, q[..., 0]))
    cubic = lambda s, b, h, q, k: s + 1e-9 * (q - k) ** 3  # noqa: E731
    short, long = torch.zeros(1, 2, 1000, 16), torch.zeros(1, 2, 4000, 16)
    assert torch.equal(flex.flex_attention(short, short, short, score_mod=cubic), short + 1)
    with pytest.raises(flex.TraceError, match=r"\(q_idx - kv_idx\) \* \(q_idx - kv_idx\) \* \(q_idx - kv_idx\) in "
                                              r"score_mod.expression may pass int32 where b < 1, h < 2, q_idx < 4000"):
        flex.flex_attention(long, long, long, score_mod=cubic)


def test_a_model_calling_flex_attention_compiles_whole(monkeypatch):
    """torch.compile(fullgraph=True) of a model calling fagen.flex.flex_attention: the call is
    fagen::flex_forward (and its backward fagen::flex_backward), the score_mod traced and the block
    mask registered once while the model is traced, the closure's tensors the op's inputs: two
    score_mods from one factory (the same code) read their own tables. The kernels are the oracle
    here (no GPU)."""
    import torch._dynamo

    seen = {}
    forward, backward = oracle_kernels(seen)
    monkeypatch.setattr(torch_op, "flex_kernels_forward", forward)
    monkeypatch.setattr(torch_op, "flex_kernels_backward", backward)
    monkeypatch.setattr(flex, "_check_read_in_place", lambda *args: None)  # CPU tables, here
    mask_mod = lambda b, h, q, k: (q >= k) & (q - k < 40)  # noqa: E731
    block_mask = flex.create_block_mask(mask_mod, None, None, N, N, device="cpu", BLOCK_SIZE=32)

    def relative_bias(table, weight=1.0, offset=N - 1):
        return lambda s, b, h, q, k: s + table[h, q - k + offset] * weight

    wider = torch.cat([TABLE.float(), TABLE.float()[:, :2]], 1)  # another shape: its own strides and bounds
    mods = [relative_bias(TABLE.float()), relative_bias(TABLE.float() * -3), relative_bias(TABLE.float(), 2.0),
            relative_bias(TABLE.float(), 3.0), relative_bias(wider, 1.0, N)]
    graphs = []

    def backend(graph, inputs):
        graphs.append(str(graph.graph))
        return graph.forward

    def layer(q, k, v, score_mod):
        return flex.flex_attention(q * 2, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True) + 1

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, h, N, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (HQ, HKV, HKV))
    calls = len(torch_op.FLEX_CALLS)
    for score_mod in (*mods, mods[0]):
        got = compiled(q, k, v, score_mod)
        want = reference_attention(q * 2, k, v, score_mod, mask_mod) + 1
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        dout = torch.randn_like(got)
        for name, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(got, (q, k, v), dout),
                              torch.autograd.grad(want, (q, k, v), dout)):
            assert torch.allclose(g, w, rtol=1e-4, atol=1e-5), name
    assert len(torch_op.FLEX_CALLS) - calls <= 4 and all("fagen.flex_forward" in g for g in graphs)
    module_level = lambda s, b, h, q, k: s + TABLE[h, q - k + N - 1]  # noqa: E731  (a global: not the op's input)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="not in its closure"):
        torch.compile(layer, fullgraph=True, backend=backend)(q, k, v, module_level)


def test_a_learned_tensor_s_gradient_skips_the_pairs_the_mask_drops(monkeypatch):
    """A score_mod undefined on masked pairs (log of a negative distance): the kernels never
    evaluate those, and the gradient adds nothing there (not 0 x NaN): it is the gradient of the
    same function guarded by the mask (PyTorch's autograd through the unguarded one is NaN)."""
    forward, backward = oracle_kernels({})
    monkeypatch.setattr(torch_op, "flex_kernels_forward", forward)
    monkeypatch.setattr(torch_op, "flex_kernels_backward", backward)
    weight = torch.full((HQ,), 0.3, dtype=torch.float64, requires_grad=True)
    score_mod = lambda s, b, h, q, k: s - weight[h] * torch.log((q - k + 1).float())  # noqa: E731
    guarded = lambda s, b, h, q, k: s - weight[h] * torch.log((q - k + 1).clamp(min=1).float())  # noqa: E731
    mask_mod = lambda b, h, q, k: q >= k  # noqa: E731
    block_mask = flex.create_block_mask(mask_mod, None, None, N, N, device="cpu", BLOCK_SIZE=32)
    gen = torch.Generator().manual_seed(17)
    q, k, v, dout = (torch.randn(B, h, N, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ))
    got = torch.autograd.grad(flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                  enable_gqa=True), weight, dout)[0]
    want = torch.autograd.grad(reference_attention(q, k, v, guarded, mask_mod), weight, dout)[0]
    assert torch.isfinite(got).all() and float((got - want).norm() / want.norm()) < 1e-5


def test_a_learned_table_trains_under_torch_compile(monkeypatch):
    """torch.compile(fullgraph=True) with AOTAutograd (which traces the backward) of a layer whose
    score_mod reads a learned bias table: the table's gradient is fagen::flex_backward's
    (from the traced expression, no autograd), PyTorch's autograd's through the same function,
    bitwise the same twice; q, k, v's too."""
    forward, backward = oracle_kernels({})
    monkeypatch.setattr(torch_op, "flex_kernels_forward", forward)
    monkeypatch.setattr(torch_op, "flex_kernels_backward", backward)
    monkeypatch.setattr(flex, "_check_read_in_place", lambda *args: None)  # CPU tables, here
    monkeypatch.setattr(captured_grads, "CHUNK_SCORES", B * HQ * N * 13)
    table = (TABLE.float() * 0.5).requires_grad_()
    scale = torch.ones(HQ, 1, 1, dtype=torch.float32, requires_grad=True)  # a second learned tensor, nonlinear
    score_mod = lambda s, b, h, q, k: s * torch.sigmoid(scale[h, 0, 0]) + table[h, q - k + N - 1]  # noqa: E731
    mask_mod = lambda b, h, q, k: (q >= k) & (q - k < 50)  # noqa: E731
    block_mask = flex.create_block_mask(mask_mod, None, None, N, N, device="cpu", BLOCK_SIZE=32)

    def layer(q, k, v):
        return flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)

    torch.compiler.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(B, h, N, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (HQ, HKV, HKV))
    dout = torch.randn(B, HQ, N, D, generator=gen, dtype=torch.float64)
    leaves = (q, k, v, table, scale)
    got = [torch.autograd.grad(compiled(q, k, v), leaves, dout) for _ in range(2)]
    want = torch.autograd.grad(reference_attention(q, k, v, score_mod, mask_mod), leaves, dout)
    for name, g, w in zip(("dq", "dk", "dv", "table", "scale"), got[0], want):
        assert float((g.double() - w.double()).norm() / w.double().norm()) < 1e-5, name
    assert all(torch.equal(a, b) for a, b in zip(*got))


def test_a_block_mask_of_a_kind_s_pattern_runs_that_kind_and_every_mask_is_checked(monkeypatch):
    """torch_op._flex_spec: a block mask that is exactly a mask kind's pattern takes that kind's
    kernels (no list to read), another stays a block mask, either is checked against the call's
    lengths, and the spec is the one for k's length."""
    from fagen import dispatch

    seen = {}
    monkeypatch.setattr(dispatch, "derive_spec", lambda q, **kwargs: seen.update(kwargs) or "spec")
    q = torch.zeros(1, 2, 300, 16)
    build = lambda mask_mod: flex.create_block_mask(mask_mod, None, None, 300, 300, device="cpu")  # noqa: E731
    for mask_mod, kind in ((lambda b, h, qi, ki: qi >= ki, {"kind": "causal"}),
                           (lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= 50), {"kind": "sliding_window",
                                                                                "window_left": 50}),
                           (lambda b, h, qi, ki: (qi >= ki) | (ki < 70), {"kind": "prefix_lm", "prefix_len": 70})):
        assert torch_op._flex_spec(q, q, q, None, build(mask_mod)) == ("spec", None)
        assert seen["mask"].model_dump(include=set(kind)) == kind and seen["block_mask"] is None
    dilated = build(lambda b, h, qi, ki: (qi >= ki) & ((qi - ki) % 2 == 0))
    assert torch_op._flex_spec(q, q, q, None, dilated) == ("spec", dilated) and seen["mask"] is None
    assert seen["keys"] == 300  # the shape class's tiling, as fagen.attention's (long keys: more query rows a CTA)
    with pytest.raises(ValueError, match="block_mask"):  # a mask for 300 x 300 against 200 queries
        torch_op._flex_spec(torch.zeros(1, 2, 200, 16), q, q, None, dilated)


def test_a_block_mask_runs_on_its_own_blocks_where_a_shipped_tiling_matches(monkeypatch):
    """dispatch.derive_spec_for with a block mask: on the H200 at d64 (defaults 192 x 128, 192 x
    96 with a block mask) a mask of FlexAttention's 128-blocks takes a shipped 128 x 128 tiling,
    so its whole blocks stay whole tiles; blocks no shipped tiling has keep the derived spec."""
    from fagen import device, dispatch, variants
    from fagen.spec import Mask, ScoreMod

    monkeypatch.setattr(device, "gpu_slug", lambda: "h200")
    build = lambda size: flex.create_block_mask(lambda b, h, q, k: q >= k, None, None, 512, 512,  # noqa: E731
                                                device="cpu", BLOCK_SIZE=size)
    block_mask = Mask(kind="block_mask")
    derived = variants.modified_spec("float16", 64, False, block_mask, ScoreMod(), gpu="h200", keys=4096)
    assert (derived.tiling.block_q, derived.tiling.block_kv) != (128, 128)
    for dtype, d in (("float16", 64), ("bfloat16", 64), ("float16", 128)):
        aligned = dispatch.derive_spec_for(dtype, d, block_mask=build(128), keys=4096)
        assert (aligned.tiling.block_q, aligned.tiling.block_kv) == (128, 128) and aligned.mask == block_mask
    odd = dispatch.derive_spec_for("float16", 64, block_mask=build(48), keys=4096)
    assert odd == derived


def test_learned_tables_are_summed_by_the_dkdv_kernel_in_fixed_point(monkeypatch):
    """Tables whose reads' derivatives are free of the score are summed by the dK/dV kernel (the
    trainable spec it runs has backward.captured_grads): its int64 adds, emulated here over the
    scores' gradient at FixedPointSums' scales, never near 2^62, give PyTorch's gradients, bitwise
    the same twice; a table whose derivative reads the score is summed outside (captured_grads)."""
    from fagen import backward, derivatives, device, dispatch, expression

    forward, _ = oracle_kernels({})
    monkeypatch.setattr(torch_op, "flex_kernels_forward", forward)
    monkeypatch.setattr(device, "gpu_slug", lambda: "h200")
    monkeypatch.setattr(dispatch, "derive_spec", lambda q, **kw: dispatch.derive_spec_for(
        "bfloat16", 64, **{name: value for name, value in kw.items() if name != "v"}))
    seen = {}

    def compile_backward(spec):
        seen["spec"] = spec

        def run(dout, q, k, v, out, lse, scale=None, block_mask=None, captured=None, captured_sums=None):
            got = oracle.attention_backward(*(x.detach().numpy() for x in (q, k, v, dout)), scale=scale,
                                            score_mod={"expression": spec.score_mod.expression,
                                                       "expression_grad": spec.score_mod.expression_grad,
                                                       "captured": spec.score_mod.captured},
                                            captured=[t.numpy() for t in captured])
            keys, values = (x.repeat_interleave(HQ // HKV, 1) for x in (k, v))
            at = {"score": q @ keys.transpose(-1, -2) * D ** -0.5, "b": torch.arange(B).view(-1, 1, 1, 1),
                  "h": torch.arange(HQ).view(1, -1, 1, 1), "q_idx": torch.arange(N).view(1, 1, -1, 1),
                  "kv_idx": torch.arange(N).view(1, 1, 1, -1),
                  **{f"captured{i}": t.reshape(-1) for i, t in enumerate(captured)}}
            tree = expression.score(spec.score_mod.expression, spec.score_mod.captured)
            p = torch.exp(captured_grads.evaluate_torch(tree, at).double() - lse[..., None])
            ds = (p * (dout @ values.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))).float()
            sums, scales = captured_sums
            arrays = [f"captured{i}" for i in spec.backward.captured_grads]
            for read, grad in derivatives.read_derivatives(tree, set(arrays)):
                slot = arrays.index(read.array)
                index = captured_grads.evaluate_torch(read.index, at).clamp(0, sums[slot].numel() - 1)
                term = ds * captured_grads.evaluate_torch(grad, at)  # float32, then times the scale in double
                fixed = torch.round(term.double() * scales[slot]).long()  # __double2ll_rn
                sums[slot].index_add_(0, index.expand(fixed.shape).reshape(-1), fixed.reshape(-1))
            assert all(int(s.abs().max()) < 2 ** 61 for s in sums)
            return SimpleNamespace(**{name: torch.from_numpy(got[name]) for name in ("dq", "dk", "dv")})
        return run

    monkeypatch.setattr(backward, "compile_backward", compile_backward)
    monkeypatch.setattr(backward, "readable", lambda dout, what="dout": dout)  # (a CUDA tensor's strides)
    gen = torch.Generator().manual_seed(23)
    temperature, table, gain = (torch.randn(*shape, generator=gen).requires_grad_()
                                for shape in ((HQ,), (HQ, 2 * N - 1), (HQ,)))
    score_mod = lambda s, b, h, q, k: s * torch.sigmoid(temperature[h]) + table[h, q - k + N - 1] * gain[h]  # noqa: E731
    q, k, v = (torch.randn(B, h, N, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (HQ, HKV, HKV))
    dout = torch.randn(B, HQ, N, D, generator=gen, dtype=torch.float64)
    leaves = (q, k, v, temperature, table, gain)
    got = [torch.autograd.grad(flex.flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True), leaves, dout)
           for _ in range(2)]
    assert seen["spec"].backward.captured_grads == (1, 2)  # table and gain; the temperature's reads the score
    want = torch.autograd.grad(reference_attention(q, k, v, score_mod, None), leaves, dout)
    for name, g, w in zip(("dq", "dk", "dv", "temperature", "table", "gain"), got[0], want):
        assert float((g.double() - w.double()).norm() / w.double().norm()) < 1e-5, name
    assert all(torch.equal(a, b) for a, b in zip(*got))


def test_frozen_inputs_run_the_backward_kernels_only_to_sum_a_table(monkeypatch):
    """q, k and v frozen: a table summed outside the kernels launches no backward kernel (its
    gradient still PyTorch's); one the dK/dV kernel sums launches it, with that table asked."""
    from fagen import backward, variants

    forward, _ = oracle_kernels({})
    monkeypatch.setattr(torch_op, "flex_kernels_forward", forward)
    monkeypatch.setattr(torch_op, "_flex_spec", lambda q, k, v, traced, block_mask: ("spec", block_mask))
    monkeypatch.setattr(variants, "trainable", lambda spec, deterministic=False, bias_grad=False, captured_grads=():
                        captured_grads)
    launched = []

    def compile_backward(fused):
        launched.append(fused)
        return lambda dout, q, k, v, *rest, **kw: SimpleNamespace(dq=torch.zeros_like(q), dk=torch.zeros_like(k),
                                                                   dv=torch.zeros_like(v))
    monkeypatch.setattr(backward, "compile_backward", compile_backward)
    monkeypatch.setattr(backward, "readable", lambda dout, what="dout": dout)  # (a CUDA tensor's strides)
    gen = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(B, h, N, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV, HKV))
    dout = torch.randn(B, HQ, N, D, generator=gen, dtype=torch.float64)
    temperature = torch.randn(HQ, generator=gen).requires_grad_()
    warm = lambda s, b, h, qi, ki: s * torch.sigmoid(temperature[h])  # noqa: E731
    got = torch.autograd.grad(flex.flex_attention(q, k, v, score_mod=warm, enable_gqa=True), temperature, dout)[0]
    want = torch.autograd.grad(reference_attention(q, k, v, warm, None), temperature, dout)[0]
    assert launched == [] and float((got.double() - want).norm() / want.norm()) < 1e-5
    table = torch.randn(HQ, 2 * N - 1, generator=gen).requires_grad_()
    biased = lambda s, b, h, qi, ki: s + table[h, qi - ki + N - 1]  # noqa: E731
    torch.autograd.grad(flex.flex_attention(q, k, v, score_mod=biased, enable_gqa=True), table, dout)
    assert launched == [(0,)]
