"""fagen.attention as a PyTorch op on the GPU (marked `gpu`): gradients through autograd
against the float64 oracle and a float64 PyTorch reference, torch.library.opcheck on both ops,
torch.compile(fullgraph=True), a training step captured in a CUDA graph, and a transformers
Llama trained with attention "fagen" against the same model on "sdpa".

The ops allocate their outputs with torch.empty; the `nan_empty` fixture turns on PyTorch's
deterministic mode, whose torch.empty fills with NaN, so an element no kernel writes is an
infinite error (as test_gpu.py's NaN-filled `out=`). Run with: pytest -m gpu tests/test_gpu_torch.py
"""

import numpy as np
import pytest

import fagen
from fagen import oracle
from fagen.check import LSE_TOLERANCE, OUT_TOLERANCE, random_inputs, relative_error, to_numpy

torch = pytest.importorskip("torch")
import fagen.torch_op  # noqa: E402  (registers torch.ops.fagen; needs torch)

pytestmark = pytest.mark.gpu

# ||grad - ref|| / ||ref|| against float64: the kernels round P and dS to the MMA input type
# (2^-11 float16, 2^-8 bfloat16) and accumulate in f32, dK and dV over every query of a key.
GRAD_TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2}
B, HQ, HKV = 2, 4, 2  # GQA: two query heads a KV head


@pytest.fixture
def nan_empty():
    """torch.empty fills floats with NaN while deterministic algorithms are on (warn_only: the
    float64 references' cuBLAS calls only warn)."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _side_inputs(rng, n: int, *, alibi=False, sinks=False, documents=False) -> dict:
    """NumPy side inputs: slopes, sinks (one per query head), and packed documents' ids."""
    extras = {}
    if alibi:
        extras["alibi_slopes"] = rng.uniform(0.01, 0.5, HQ).astype(np.float32)
    if sinks:
        extras["sinks"] = rng.uniform(-1.0, 3.0, HQ).astype(np.float32)
    if documents:
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(5, n - 1), replace=False))
        extras["doc_ids"] = np.broadcast_to(np.searchsorted(cuts, np.arange(n), side="right"), (B, n)).astype(np.int32)
    return extras


def _check_against_oracle(dtype, head_dim, causal, nq, nk, layout="bhnd", softcap=None, seed=0, **wanted):
    """fagen.attention's out, lse and autograd's dq, dk, dv (and dsinks) against the oracle."""
    q, k, v, _ = random_inputs("torch", dtype, B, HQ, HKV, nq, nk, head_dim, layout, seed=seed)
    dout = random_inputs("torch", dtype, B, HQ, HKV, nq, nk, head_dim, layout, seed=seed + 1)[0]
    extras = _side_inputs(np.random.default_rng(seed), nk, **wanted)
    side = {name: torch.tensor(x, device="cuda") for name, x in extras.items()}
    leaves = [x.requires_grad_() for x in (q, k, v)]
    if "sinks" in side:
        leaves.append(side["sinks"].requires_grad_())
    out, lse = fagen.attention(q, k, v, causal=causal, softcap=softcap, return_lse=True, **side)
    grads = torch.autograd.grad(out, leaves, dout)

    qn, kn, vn = (to_numpy(x) for x in (q, k, v))
    ref_out, ref_lse = oracle.attention(qn, kn, vn, causal=causal, softcap=softcap, return_lse=True, **extras)
    ref = oracle.attention_backward(qn, kn, vn, to_numpy(dout), causal=causal, softcap=softcap, **extras)
    errors = {"out": relative_error(to_numpy(out), ref_out), "lse": relative_error(to_numpy(lse), ref_lse)}
    errors.update({name: relative_error(to_numpy(g), ref[name]) for name, g in zip(("dq", "dk", "dv", "dsinks"), grads)})
    tolerance = dict.fromkeys(("dq", "dk", "dv", "dsinks"), GRAD_TOLERANCE[dtype]) | {
        "out": OUT_TOLERANCE[dtype], "lse": LSE_TOLERANCE}
    print(errors)
    assert all(errors[name] <= tolerance[name] for name in errors), (errors, tolerance)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk, layout", [(113, 203, "bhnd"), (1, 239, "bnhd")])
def test_gradients_against_the_oracle(nan_empty, dtype, head_dim, causal, nq, nk, layout):
    _check_against_oracle(dtype, head_dim, causal, nq, nk, layout)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("modifier", ["softcap", "alibi", "sinks", "documents"])
def test_gradients_with_modifiers_against_the_oracle(nan_empty, dtype, head_dim, modifier):
    """Each modifier under a causal mask; sinks require grad (dsinks checked); documents are
    packed self-attention (Nq == Nk)."""
    n = 203 if modifier == "documents" else None
    kwargs = {"softcap": 5.0} if modifier == "softcap" else {modifier: True}
    _check_against_oracle(dtype, head_dim, True, n or 113, n or 203, seed=7, **kwargs)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gradients_with_a_block_mask_against_the_oracle(nan_empty, dtype, head_dim):
    """A runtime block mask (no tensor, so autograd.Function rather than the ops): out, dq, dk,
    dv, dsinks and a learned vector bias's gradient against the oracle."""
    from fagen.check import random_block_mask

    nq, nk = 203, 300
    q, k, v, _ = random_inputs("torch", dtype, B, HQ, HKV, nq, nk, head_dim, seed=21)
    dout = random_inputs("torch", dtype, B, HQ, HKV, nq, nk, head_dim, seed=22)[0]
    rng = np.random.default_rng(23)
    block_mask = random_block_mask(rng, B, HQ, nq, nk, 32, 64)
    sinks = rng.uniform(-1.0, 3.0, HQ).astype(np.float32)
    bias = rng.standard_normal((1, HQ, nk)).astype(np.float32)
    leaves = [x.requires_grad_() for x in (q, k, v)] + [torch.tensor(x, device="cuda").requires_grad_()
                                                       for x in (sinks, bias)]
    out = fagen.attention(q, k, v, block_mask=block_mask, sinks=leaves[3], bias=leaves[4])
    grads = torch.autograd.grad(out, leaves, dout)
    qn, kn, vn = (to_numpy(x) for x in (q, k, v))
    ref_out = oracle.attention(qn, kn, vn, block_mask=block_mask, sinks=sinks, bias=bias)
    ref = oracle.attention_backward(qn, kn, vn, to_numpy(dout), block_mask=block_mask, sinks=sinks, bias=bias)
    assert relative_error(to_numpy(out), ref_out) <= OUT_TOLERANCE[dtype]
    for name, g in zip(("dq", "dk", "dv", "dsinks", "dbias"), grads):
        assert relative_error(to_numpy(g), ref[name]) <= GRAD_TOLERANCE[dtype], name


def _reference(q, k, v, *, causal: bool, scale: float, bias=None):
    """softmax(q k^T * scale + bias + mask) v in float64 PyTorch, k and v repeated over each GQA
    group; a vector bias [B|1, H|1, Nk] is every query's."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s + (bias[:, :, None, :] if bias.dim() == 3 else bias)
    if causal:  # bottom-right diagonal: query i sees keys up to i + Nk - Nq
        nq, nk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(nq, nk, dtype=torch.bool, device=s.device).tril(nk - nq), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_against_torch_float64_autograd(nan_empty, causal):
    """The same gradients from PyTorch's own autograd through a float64 reference, at a custom scale."""
    q, k, v, _ = random_inputs("torch", "float16", B, HQ, HKV, 113, 203, 128, seed=11)
    dout = random_inputs("torch", "float16", B, HQ, HKV, 113, 203, 128, seed=12)[0]
    leaves = [x.requires_grad_() for x in (q, k, v)]
    grads = torch.autograd.grad(fagen.attention(q, k, v, causal=causal, scale=0.1), leaves, dout)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = torch.autograd.grad(_reference(*ref_leaves, causal=causal, scale=0.1), ref_leaves, dout.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert relative_error(to_numpy(g), r.cpu().numpy()) <= GRAD_TOLERANCE["float16"], name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind, shape", [("matrix", (1, HQ)), ("matrix", (B, 1)), ("vector", (B, HQ)),
                                         ("vector", (1, 1))])
def test_bias_gradient_against_the_oracle_and_torch_autograd(nan_empty, dtype, head_dim, kind, shape):
    """A bias that requires grad (a learned relative-position bias, an ALiBi-like vector): its
    gradient, summed over what it broadcasts, against the float64 oracle and against PyTorch's
    autograd through a float64 reference; q, k, v's gradients too."""
    nq, nk = 113, 203
    q, k, v, _ = random_inputs("torch", dtype, B, HQ, HKV, nq, nk, head_dim, seed=51)
    dout = random_inputs("torch", dtype, B, HQ, HKV, nq, nk, head_dim, seed=52)[0]
    gen = torch.Generator(device="cuda").manual_seed(53)
    bias = torch.randn((*shape, nq, nk) if kind == "matrix" else (*shape, nk), generator=gen, device="cuda")
    leaves = [x.requires_grad_() for x in (q, k, v, bias)]
    grads = torch.autograd.grad(fagen.attention(q, k, v, causal=True, bias=bias), leaves, dout)
    ref = oracle.attention_backward(*(to_numpy(x) for x in (q, k, v, dout)), causal=True, bias=to_numpy(bias))
    for name, g in zip(("dq", "dk", "dv", "dbias"), grads):
        assert relative_error(to_numpy(g), ref[name]) <= GRAD_TOLERANCE[dtype], name
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    scale = head_dim ** -0.5
    torch_ref = torch.autograd.grad(_reference(*ref_leaves[:3], causal=True, scale=scale, bias=ref_leaves[3]),
                                    ref_leaves, dout.double())
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, torch_ref):
        assert relative_error(to_numpy(g), r.cpu().numpy()) <= GRAD_TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("huge", [-1e9, -1e30, torch.finfo(torch.float32).min], ids=["1e9", "1e30", "float32_min"])
def test_a_huge_negative_bias_masks_as_minus_infinity_does(nan_empty, dtype, head_dim, huge):
    """A user's "large negative" mask value in a bias: masked keys get no weight, as the float64
    oracle gives them, in the output and every gradient; a sequence whose keys are all masked
    comes out finite (its row max and every score then share one rounding: the fused softmax
    overflowed exp2 there, inf / inf, and the NaN rows poisoned a model's next layer)."""
    nq, nk = 97, 203
    q, k, v, _ = random_inputs("torch", dtype, 3, HQ, HKV, nq, nk, head_dim, seed=61)
    dout = random_inputs("torch", dtype, 3, HQ, HKV, nq, nk, head_dim, seed=62)[0]
    gen = torch.Generator(device="cuda").manual_seed(63)
    bias = torch.randn((3, 1, nk), generator=gen, device="cuda")
    masked = torch.rand((3, 1, nk), generator=gen, device="cuda") < 0.4
    masked[2] = True  # the third sequence: every key
    bias = bias.masked_fill(masked, huge)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = fagen.attention(q, k, v, causal=True, bias=bias)
    grads = torch.autograd.grad(out, leaves, dout)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    ref = oracle.attention_backward(*(to_numpy(x) for x in (q, k, v, dout)), causal=True, bias=to_numpy(bias))
    kept = slice(0, 2)  # the sequences with keys (the third's rows have none the float32 kernel can tell apart)
    expected = oracle.attention(*(to_numpy(x) for x in (q, k, v)), causal=True, bias=to_numpy(bias))
    assert relative_error(to_numpy(out)[kept], expected[kept]) <= OUT_TOLERANCE[dtype]
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert relative_error(to_numpy(g)[kept], ref[name][kept]) <= GRAD_TOLERANCE[dtype], name


def test_opcheck_both_ops():
    """torch.library.opcheck: schema (no mutation, no aliasing), fake tensors against the real
    kernels' shapes, dtypes and strides, the autograd registration, and AOT dispatch."""
    q, k, v, _ = random_inputs("torch", "float16", 1, HQ, HKV, 77, 77, 64, seed=21)
    dout = random_inputs("torch", "float16", 1, HQ, HKV, 77, 77, 64, seed=22)[0]
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device="cuda", requires_grad=True)
    forward, backward = torch.ops.fagen.attention_forward.default, torch.ops.fagen.attention_backward.default
    leaves = [x.requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(forward, (*leaves, None, None, None, None, None, None, "", True, None, None, False))
    torch.library.opcheck(forward, (*leaves, None, None, sinks, None, None, None, "", True, 30.0, None, True))
    q, k, v = (x.detach() for x in leaves)
    ends, starts = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in ([70], [9]))
    torch.library.opcheck(forward, (q, k, v, None, None, None, None, ends, starts, "", True, None, None, False))
    out, lse = forward(q, k, v, None, None, None, None, None, None, "", True, None, None, False)
    for deterministic in (False, True):
        torch.library.opcheck(backward, (dout, q, k, v, out, lse, None, None, None, None, "", True, None, None,
                                         deterministic, False))
    bias = torch.randn(1, HQ, 77, 77, device="cuda")
    out, lse = forward(q, k, v, bias, None, None, None, None, None, "", True, None, None, False)
    for deterministic in (False, True):  # the bias's gradient: deterministic sums a copy per KV head
        torch.library.opcheck(backward, (dout, q, k, v, out, lse, bias, None, None, None, "", True, None, None,
                                         deterministic, True))
    torch.library.opcheck(forward, (*leaves, bias.requires_grad_(), None, None, None, None, None, "", True, None, None,
                                    False))


@pytest.mark.parametrize("nq, nk, causal", [(300, 300, True), (1, 700, False)], ids=["prefill", "decode"])
def test_out_is_laid_out_as_q(nq, nk, causal):
    """A model's q, k, v are [B, N, H, d] seen as [B, H, N, d]: out comes laid out as q (as SDPA's
    and FlashAttention's), so its transpose back to [B, N, H, d] is contiguous and the model's
    reshape copies nothing; its values are the contiguous call's (within rounding: the two may
    take different kernels), eagerly, through the op (opcheck: the fake's strides are the
    kernels'), and for a call that comes again."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(B, n, h, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for n, h in ((nq, HQ), (nk, HKV), (nk, HKV)))
    want = fagen.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal)
    for _ in range(2):  # the call that packs its class, then the kept class's
        out = fagen.attention(q, k, v, causal=causal)
        assert out.transpose(1, 2).is_contiguous(), out.stride()
        assert relative_error(to_numpy(out), to_numpy(want)) < 1e-2
    forward = torch.ops.fagen.attention_forward.default
    torch.library.opcheck(forward, (q, k, v, None, None, None, None, None, None, "", causal, None, None, False))
    out, _ = forward(q, k, v, None, None, None, None, None, None, "", causal, None, None, False)
    assert out.transpose(1, 2).is_contiguous() and relative_error(to_numpy(out), to_numpy(want)) < 1e-2


def test_an_expanded_q_is_answered_as_its_copy():
    """A broadcast q (one query row expanded over the batch: stride 0) keeps head_dim innermost
    in out's layout, so no two rows of out overlap; eager, kept and prepared calls."""
    torch.manual_seed(4)
    q = torch.randn(1, HQ, 1, 64, device="cuda", dtype=torch.bfloat16).expand(B, HQ, 1, 64)
    k, v = (torch.randn(B, HKV, 700, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    want = fagen.attention(q.contiguous(), k, v)
    for _ in range(2):
        out = fagen.attention(q, k, v)
        assert out.stride()[-1] == 1 and relative_error(to_numpy(out), to_numpy(want)) < 1e-2
    prepared = fagen.prepare(q, k, v)
    assert relative_error(to_numpy(prepared(q, k, v)), to_numpy(want)) < 1e-2


@pytest.mark.parametrize("dout_of", ["transposed", "broadcast"])
def test_gradients_of_a_strided_dout_are_its_copy(nan_empty, dout_of):
    """The backward reads a model's transposed dout by its strides (no copy) and copies only what
    no kernel can read (a broadcast dout from a pooled loss): the gradients equal those of the
    contiguous dout and the oracle's."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(B, n, h, 64, device="cuda", dtype=torch.float16).transpose(1, 2).requires_grad_()
               for n, h in ((200, HQ), (200, HKV), (200, HKV)))
    out = fagen.attention(q, k, v, causal=True)
    if dout_of == "transposed":
        dout = torch.randn(B, 200, HQ, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
    else:
        dout = torch.randn(1, 1, 1, 64, device="cuda", dtype=torch.float16).expand(out.shape)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    want = torch.autograd.grad(out, (q, k, v), dout.contiguous())
    ref = oracle.attention_backward(*(to_numpy(x) for x in (q, k, v, dout)), causal=True)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert relative_error(to_numpy(g), to_numpy(w)) < 1e-3, name
        assert relative_error(to_numpy(g), ref[name]) < GRAD_TOLERANCE["float16"], name


class TinyAttention(torch.nn.Module):
    """One attention layer: fused QKV projection, fagen.attention (GQA), output projection."""

    def __init__(self, dim=256, heads=HQ, kv_heads=HKV, sinks=False, bias_len=None, **attention):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.sinks = torch.nn.Parameter(torch.zeros(heads)) if sinks else None
        # a learned score bias per head and pair (as T5's or Swin's relative-position bias)
        self.bias = torch.nn.Parameter(0.1 * torch.randn(1, heads, bias_len, bias_len)) if bias_len else None
        self.attention = attention

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, self.heads + 2 * self.kv_heads, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        out = fagen.attention(q, k, v, sinks=self.sinks, bias=self.bias, **self.attention)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


def _tiny(dtype=torch.float16, **attention):
    torch.manual_seed(0)
    model = TinyAttention(**attention).cuda()
    model.qkv.to(dtype)  # sinks stay float32, as the kernels read them
    model.proj.to(dtype)
    return model


@pytest.mark.parametrize("attention", [dict(causal=True),
                                       dict(mask={"kind": "sliding_window", "window_left": 64}, sinks=True),
                                       dict(causal=True, bias_len=300)],
                         ids=["causal", "sliding_window_sinks", "causal_learned_bias"])
def test_torch_compile_fullgraph_matches_eager(attention):
    """torch.compile sees one op each way (no graph break); forward and gradients as eager."""
    model = _tiny(**attention)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.float16)
    runs = []
    for run in (model, torch.compile(model, fullgraph=True)):
        model.zero_grad(set_to_none=True)
        y = run(x)
        y.float().square().mean().backward()
        runs.append((y.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (y_eager, g_eager), (y_compiled, g_compiled) = runs
    # the same kernels; inductor may fuse the projections' epilogues and round differently
    assert relative_error(to_numpy(y_compiled), to_numpy(y_eager)) < 1e-2
    for name in g_eager:
        assert relative_error(to_numpy(g_compiled[name]), to_numpy(g_eager[name])) < 1e-2, name


WINDOW = {"mask": {"kind": "sliding_window", "window_left": 64}}


@pytest.mark.parametrize("learned, deterministic, head_dim, mask",
                         [((), True, 64, {"causal": True}), (("sinks",), True, 64, {"causal": True}),
                          (("sinks",), False, 64, {"causal": True}), (("sinks", "bias"), True, 64, {"causal": True}),
                          ((), True, 128, WINDOW)],
                         ids=["causal", "causal_sinks", "causal_sinks_atomic", "causal_sinks_learned_bias",
                              "sliding_window_d128"])
def test_cuda_graph_of_a_training_step_replays(learned, deterministic, head_dim, mask):
    """Warm up on a side stream, capture forward + loss.backward() (with no host sync allowed),
    replay on new inputs copied into the static ones: out, loss and every gradient equal an
    eager step's bits (deterministic: true), or dQ within rounding of it (atomic dQ, sm_90a:
    the adds' order varies). A sliding window at head_dim 128 runs the dQ kernel beside the
    dK/dV kernel on sm_90a (backward_plan.concurrent_dq): the fork and join are captured too."""
    q, k, v, _ = random_inputs("torch", "float16", B, HQ, HKV, 300, 300, head_dim, seed=31)
    target = random_inputs("torch", "float16", B, HQ, HKV, 300, 300, head_dim, seed=32)[0]
    leaves = [x.requires_grad_() for x in (q, k, v)]
    shapes = {"sinks": (HQ,), "bias": (1, HQ, 300, 300)}  # a bias every batch row shares
    leaves += [torch.zeros(shapes[name], device="cuda", requires_grad=True) for name in learned]

    def step(q, k, v, *values):
        out = fagen.attention(q, k, v, deterministic=deterministic, **mask, **dict(zip(learned, values)))
        loss = (out.float() * target.float()).sum()
        loss.backward()
        return out, loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels and checks the side inputs once
        for _ in range(3):
            for t in leaves:
                t.grad = None
            step(*leaves)
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None  # gradients allocated inside the capture: the graph's own memory

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")  # after graph's own synchronize on entry
        try:
            static_out, static_loss = step(*leaves)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    gen = torch.Generator(device="cuda").manual_seed(33)
    new = [torch.randn(t.shape, generator=gen, device="cuda").to(t.dtype) for t in leaves]
    with torch.no_grad():
        for t, value in zip(leaves, new):
            t.copy_(value)
    graph.replay()
    eager = [value.clone().requires_grad_() for value in new]
    out, loss = step(*eager)
    torch.cuda.synchronize()
    assert torch.equal(static_out, out) and torch.equal(static_loss, loss)
    for i, (t, e) in enumerate(zip(leaves, eager)):
        if deterministic or i > 0:
            assert torch.equal(t.grad, e.grad)
        else:  # atomic dQ: the order of the adds, so the last bits, vary
            assert relative_error(to_numpy(t.grad), to_numpy(e.grad)) <= 1e-3


# A transformers model on fagen: fagen.transformers' attention function (packed documents from
# position_ids restarting) and its mask function, under a name of the test's.
def _register(name, function):
    pytest.importorskip("transformers")
    import fagen.transformers
    from transformers import AttentionInterface

    fagen.transformers.register(name)  # the attention and its mask function
    AttentionInterface.register(name, function)  # the test's wrapper of fagen.transformers.attention


def _llama(attn_implementation: str, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=1000, max_position_embeddings=512,
                         attn_implementation=attn_implementation)
    torch.manual_seed(0)  # random weights, no download
    return LlamaForCausalLM(config).to(device="cuda", dtype=dtype).train()


# relative norm per parameter against the sdpa model: the two attentions round differently
# (the oracle tests' gradient tolerances), and two layers carry that to every gradient
LLAMA_TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2}
LOSS_SCALE = 1024.0  # as fp16 training scales the loss (GradScaler): small gradients stay normal numbers


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed_documents"])
def test_transformers_llama_training_step_matches_sdpa(dtype, packed):
    pytest.importorskip("transformers")
    calls = []

    def counted(function):
        def attention(*args, **kwargs):
            calls.append(1)
            return function(*args, **kwargs)
        return attention

    import fagen.transformers

    name = "fagen_packed" if packed else "fagen"
    _register(name, counted(fagen.transformers.attention))
    reference = _llama("sdpa", getattr(torch, dtype))
    model = _llama(name, getattr(torch, dtype))
    model.load_state_dict(reference.state_dict())

    gen = torch.Generator(device="cuda").manual_seed(41)
    if packed:
        lengths = [50, 100, 78]
        n = sum(lengths)
        input_ids = torch.randint(0, 1000, (1, n), generator=gen, device="cuda")
        position_ids = torch.cat([torch.arange(length, device="cuda") for length in lengths])[None]
        doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))
        allowed = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
        # sdpa sees the block-diagonal causal mask itself, as an additive [B, 1, N, N] mask
        mask = torch.zeros(1, 1, n, n, device="cuda", dtype=getattr(torch, dtype))
        mask.masked_fill_(~allowed, torch.finfo(mask.dtype).min)
        runs = ((model, dict(position_ids=position_ids)),
                (reference, dict(position_ids=position_ids, attention_mask=mask)))
    else:
        input_ids = torch.randint(0, 1000, (2, 200), generator=gen, device="cuda")
        runs = ((model, {}), (reference, {}))

    losses = []
    for run, extra in runs:
        loss = run(input_ids=input_ids, labels=input_ids, **extra).loss
        (loss * LOSS_SCALE).backward()
        losses.append(loss.item())
    assert len(calls) == 2, "the model did not call fagen's attention once a layer"

    tolerance = LLAMA_TOLERANCE[dtype]
    assert abs(losses[0] - losses[1]) <= tolerance * abs(losses[1]), losses
    reference_grads = dict(reference.named_parameters())
    errors = {name: relative_error(to_numpy(p.grad), to_numpy(reference_grads[name].grad))
              for name, p in model.named_parameters()}
    print(sorted(errors.items(), key=lambda item: -item[1])[:5])
    assert all(e <= tolerance for e in errors.values()), {n: e for n, e in errors.items() if e > tolerance}


def test_transformers_llama_trains_under_autocast_on_a_padded_batch_as_sdpa():
    """A float32-master model under torch.autocast("cuda", torch.bfloat16), a left-padded batch:
    float32 q and k from the rotary embedding go in as bfloat16 (as SDPA takes them), the padding as
    the same keys' bias (key ranges have no backward). Measured on an H200, bfloat16 autocast moves
    this padded step's gradients 10-14% from the float32 model's on SDPA itself (1% unpadded), so
    fagen's loss and gradients are held to SDPA's own distance from the float32 truth."""
    pytest.importorskip("transformers")
    import fagen.transformers

    truth = _llama("sdpa", torch.float32)
    reference = _llama("sdpa", torch.float32)
    model = _llama(fagen.transformers.register(), torch.float32)
    for run in (reference, model):
        run.load_state_dict(truth.state_dict())
    gen = torch.Generator(device="cuda").manual_seed(43)
    input_ids = torch.randint(1, 1000, (3, 160), generator=gen, device="cuda")
    mask = torch.ones_like(input_ids)
    mask[1, :37], mask[2, :101] = 0, 0
    labels = input_ids.masked_fill(mask == 0, -100)
    losses = []
    for run, autocast in ((truth, False), (reference, True), (model, True)):
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss = run(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[2] - losses[0]) <= 1.25 * abs(losses[1] - losses[0]) + 1e-4 * abs(losses[0]), losses
    exact = dict(truth.named_parameters())
    sdpa = dict(reference.named_parameters())
    errors = {name: (relative_error(to_numpy(p.grad), to_numpy(exact[name].grad)),
                     relative_error(to_numpy(sdpa[name].grad), to_numpy(exact[name].grad)))
              for name, p in model.named_parameters()}
    assert all(ours <= 1.25 * theirs + 1e-3 for ours, theirs in errors.values()), \
        {n: e for n, e in errors.items() if e[0] > 1.25 * e[1] + 1e-3}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_transformers_llama_generates_the_sdpa_tokens(dtype):
    """Greedy generation, 32 new tokens with a KV cache: the prompt through the plain forward,
    each step's single query through fagen's decode path (GQA-packed split-KV), token for token
    what the same model generates on SDPA. bfloat16 keeps 8 bits of mantissa: two attentions that
    round differently may swap a near-tie, so there the tokens must agree up to a step where
    SDPA's own two candidates are within bfloat16 rounding of each other."""
    from transformers import LlamaConfig, LlamaForCausalLM

    paths = []

    import fagen.transformers

    def traced(module, query, key, value, attention_mask, **kwargs):
        paths.append(query.shape[2])
        return fagen.transformers.attention(module, query, key, value, attention_mask, **kwargs)

    _register("fagen_generate", traced)
    models = []
    for name in ("sdpa", "fagen_generate"):
        # a wider init than the default: random logits far enough apart that rounding rarely decides
        config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                             num_hidden_layers=2, vocab_size=1000, max_position_embeddings=512, initializer_range=0.08,
                             attn_implementation=name)
        torch.manual_seed(0)
        models.append(LlamaForCausalLM(config).to(device="cuda", dtype=getattr(torch, dtype)).eval())
    gen = torch.Generator(device="cuda").manual_seed(5)
    prompt = torch.randint(0, 1000, (2, 100), generator=gen, device="cuda")
    runs = [m.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0,
                       output_logits=True, return_dict_in_generate=True) for m in models]
    ref, got = (r.sequences[:, 100:] for r in runs)
    assert ref.shape == got.shape == (2, 32)
    assert paths.count(100) == 2 and paths.count(1) == 2 * 31  # prefill once a layer, then one query a step
    if dtype == "float16":
        assert torch.equal(ref, got), (ref, got)
        return
    for row in range(2):
        differ = (ref[row] != got[row]).nonzero()
        if len(differ):
            step = int(differ[0])
            logits = runs[0].logits[step][row].float()
            gap = (logits[ref[row, step]] - logits[got[row, step]]).item()
            assert gap <= 2 ** -7 * logits.abs().max().item(), (row, step, gap)


def _llama_on_sdpa_and_fagen():
    """The same fp16 Llama (2 layers, 8/2 heads of 64, random weights) on SDPA and on fagen."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import fagen.transformers

    name = fagen.transformers.register()
    models = []
    for implementation in ("sdpa", name):
        config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                             num_hidden_layers=2, vocab_size=1000, max_position_embeddings=512, initializer_range=0.08,
                             attn_implementation=implementation)
        torch.manual_seed(0)
        models.append(LlamaForCausalLM(config).to(device="cuda", dtype=torch.float16).eval())
    return models


@pytest.mark.parametrize("dtype", ["int64", "int32", "bool"])
def test_the_padding_runs_kernel_answers_as_its_numpy_twin(dtype):
    """fagen.runtime.padding_runs (one launch, one read) against fagen.padding_runs.runs, on the last
    slots of wider masks (a dynamic cache's window: rows strided; up to a 128k window at batch 1,
    which a block reads alone), every kind of row: full, left
    and right padded, holed, without a token; and transformers' mask function on the GPU gives
    what its general path gives on the host."""
    pytest.importorskip("transformers")
    import fagen.transformers
    from fagen import padding_runs
    from fagen.runtime import padding_runs as on_gpu

    rng = np.random.default_rng(17)
    seen = set()
    for b, n in ((1, 1), (3, 31), (5, 1000), (40, 4100), (2, 70000), (1, 131077)):
        starts = rng.integers(0, n + 1, size=b)
        left = np.arange(n)[None] >= starts[:, None]
        holed = left.copy()
        holed[int(rng.integers(0, b)), int(rng.integers(0, n))] ^= True
        for rows in (left, np.ones((b, n), bool), left[:, ::-1], holed):
            wide = np.concatenate([rng.integers(0, 2, size=(b, 7)).astype(bool), rows], axis=1)
            mask = torch.as_tensor(wide, device="cuda").to(getattr(torch, dtype))
            window = mask[:, -n:]
            flags, ranges = on_gpu(window)
            want_flags, want_ranges = padding_runs.runs(rows)
            assert flags == want_flags and ranges.shape == (2, 1, b)
            assert np.array_equal(ranges[:, 0].cpu().numpy(), want_ranges)
            seen.add(flags)
            got = fagen.transformers.mask(b, 1, n, q_offset=n - 1, attention_mask=mask)
            want = fagen.transformers._padding(window.cpu().bool(), n, static=False)
            assert (got is None) == (want is None)
            if want is not None:
                assert got.dtype == want.dtype and torch.equal(got.cpu(), want)
    assert seen == {0, padding_runs.LEFT_PADDED, padding_runs.FULL | padding_runs.LEFT_PADDED}


def test_transformers_llama_generates_left_padded_prompts_as_sdpa():
    """Batched greedy generation from prompts of three lengths, left-padded (transformers' way to
    serve a batch): the prompt's logits at its tokens, and the 16 tokens each row generates
    (prefill, then decode steps whose keys start past each row's padding), on the dynamic and the
    static cache, as on SDPA (fp16)."""
    models = _llama_on_sdpa_and_fagen()
    gen = torch.Generator(device="cuda").manual_seed(7)
    ids = torch.randint(1, 1000, (3, 100), generator=gen, device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :40], mask[2, :63] = 0, 0
    ids[mask == 0] = 0
    with torch.no_grad():
        ref, got = (m(input_ids=ids, attention_mask=mask).logits.float() for m in models)
    tokens = mask.bool()
    # two fp16 models' rounding through two layers; attending over a pad moves logits by O(1)
    assert relative_error(to_numpy(got[tokens]), to_numpy(ref[tokens])) < 1e-2
    for cache in ("dynamic", "static"):  # the static cache: each row's keys a range of its slots
        runs = [m.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                           pad_token_id=0, cache_implementation=cache, output_logits=True,
                           return_dict_in_generate=True) for m in models]
        _same_greedy_tokens(runs[0], runs[1], cache)


def test_transformers_llama_on_fagen_compiles_with_fullgraph_as_on_sdpa():
    """torch.compile(fullgraph=True) of a transformers Llama on fagen, where the same model on SDPA
    compiles too: a left-padded prompt (its padding as fagen's key bias under tracing) and a decode
    step on its dynamic cache, logits against the eager fagen model and against SDPA's (fp16)."""
    from transformers import DynamicCache

    models = _llama_on_sdpa_and_fagen()
    gen = torch.Generator(device="cuda").manual_seed(11)
    ids = torch.randint(1, 1000, (2, 96), generator=gen, device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    step = torch.randint(1, 1000, (2, 1), generator=gen, device="cuda")
    tokens = mask.bool()

    def run(model):
        cache = DynamicCache(config=models[1].config)
        prompt = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits.float()
        decode = model(input_ids=step, attention_mask=torch.cat([mask, torch.ones_like(step)], 1),
                       past_key_values=cache, use_cache=True).logits.float()
        return prompt[tokens], decode

    torch._dynamo.reset()
    with torch.no_grad():
        sdpa, eager = run(models[0]), run(models[1])
        compiled = run(torch.compile(models[1], fullgraph=True))
    for got, ref in ((compiled, eager), (compiled, sdpa)):
        for a, b in zip(got, ref):
            assert relative_error(to_numpy(a), to_numpy(b)) < 1e-2


# Two greedy generations agree up to rounding: where SDPA's two best logits are closer than this
# (in its own logits' units), another implementation's rounding may pick the other token
NEAR_TIE = 0.05


def _same_greedy_tokens(ref, got, what: str, tolerance: float = 1e-2, near_tie: float = NEAR_TIE) -> None:
    """Each row's tokens equal, and the logits they came from within `tolerance` (relative), up to
    a step where the reference's choice was a near tie (its margin under `near_tie`): there the
    other token may win, and the rows part (the rest of the row is then another generation)."""
    ref_logits, got_logits = torch.stack(ref.logits, 1).float(), torch.stack(got.logits, 1).float()  # [B, steps, V]
    steps = ref_logits.shape[1]
    ref_tokens, got_tokens = ref.sequences[:, -steps:], got.sequences[:, -steps:]
    for row in range(ref_tokens.shape[0]):
        differ = (ref_tokens[row] != got_tokens[row]).nonzero()
        last = int(differ[0]) if len(differ) else steps - 1  # the steps both generated from the same tokens
        assert relative_error(to_numpy(got_logits[row, :last + 1]), to_numpy(ref_logits[row, :last + 1])) < tolerance, \
            (what, row)
        if len(differ):
            chosen = ref_logits[row, last]
            margin = float(chosen[ref_tokens[row, last]] - chosen[got_tokens[row, last]])
            assert margin < near_tie, (what, row, last, margin)


def _gemma2(implementation: str, dtype):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=256, num_hidden_layers=2, vocab_size=1000, sliding_window=64,
                          attn_logit_softcapping=50.0, query_pre_attn_scalar=256, attn_implementation=implementation)
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config).to(device="cuda", dtype=dtype).eval()


def _gpt_oss(implementation: str, dtype):
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(hidden_size=512, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=64, num_hidden_layers=2, vocab_size=1000, num_local_experts=1, num_experts_per_tok=1,
                          sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                          attn_implementation=implementation)
    torch.manual_seed(0)  # one expert: with two, bfloat16 alone flips the routing (4% logit error against float32)
    model = GptOssForCausalLM(config).eval()
    for module in model.modules():
        if hasattr(module, "sinks"):  # zeros at initialisation: make them count
            torch.nn.init.normal_(module.sinks, generator=torch.Generator().manual_seed(4))
    return model.to(device="cuda", dtype=dtype)


def _more(family: str):
    """Qwen2 (q/k/v biases, a window on one layer), Qwen3 (q/k norms), Mistral (a window on each
    layer), Gemma-3 (five windowed layers to one global; head_dim 256): small random models."""
    import transformers

    def build(implementation: str, dtype):
        common = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=1000, attn_implementation=implementation)
        config = {
            "qwen2": lambda: transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=64,
                                                      max_window_layers=1,
                                                      layer_types=["full_attention", "sliding_attention"]),
            "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=128),
            "mistral": lambda: transformers.MistralConfig(**common, sliding_window=64),
            "gemma3": lambda: transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, head_dim=256,
                                                            sliding_window=64, query_pre_attn_scalar=256),
        }[family]()
        model_class = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
                       "mistral": transformers.MistralForCausalLM, "gemma3": transformers.Gemma3ForCausalLM}[family]
        torch.manual_seed(0)
        return model_class(config).to(device="cuda", dtype=dtype).eval()
    return build


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "qwen2", "qwen3", "mistral", "gemma3"])
def test_transformers_models_take_their_window_softcap_and_sinks(family):
    """fagen.transformers on Gemma-2's shape (head_dim 256, sliding window, softcap), gpt-oss's
    (sinks, window), Qwen2's, Qwen3's, Mistral's and Gemma-3's (_more), bfloat16, 300 tokens (past
    the window): teacher-forced logits against the
    same model on transformers' eager attention (which takes the softcap and the sinks), unpadded
    and padded: both rows left-padded (key ranges), then one left and one right (the score bias),
    at every token."""
    pytest.importorskip("transformers")
    import fagen.transformers

    build = {"gemma2": _gemma2, "gpt_oss": _gpt_oss}.get(family) or _more(family)
    reference = build("eager", torch.bfloat16)
    model = build(fagen.transformers.register(), torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 1000, (2, 300), generator=torch.Generator(device="cuda").manual_seed(6), device="cuda")
    with torch.no_grad():
        got, want = model(input_ids=ids).logits.float(), reference(input_ids=ids).logits.float()
        assert relative_error(to_numpy(got), to_numpy(want)) < 3e-2
        for right in (False, True):
            mask = torch.ones_like(ids)
            mask[0, :10] = 0  # left padding
            mask[1, :3] = 0
            if right:
                mask[1, :3], mask[1, 290:] = 1, 0  # right padding
            tokens = mask.bool()
            got, want = (m(input_ids=ids, attention_mask=mask).logits.float() for m in (model, reference))
            assert torch.isfinite(got).all()
            assert relative_error(to_numpy(got[tokens]), to_numpy(want[tokens])) < 3e-2, right


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_transformers_models_generate_left_padded_prompts_as_eager(family):
    """Greedy generation on Gemma-2's shape (window, softcap) and gpt-oss's (sinks, window),
    bfloat16, two prompts of 80 tokens, one left-padded by 30 (the window of 64 passed within the
    prompt): the tokens and the logits they came from as on transformers' eager attention. After
    a layer's first decode step its calls go to the C path its module kept (fagen.transformers'
    call site), which the test sees set on every layer's attention module."""
    pytest.importorskip("transformers")
    import fagen.transformers

    build = {"gemma2": _gemma2, "gpt_oss": _gpt_oss}[family]
    reference = build("eager", torch.bfloat16)
    model = build(fagen.transformers.register(), torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(1, 1000, (2, 80), generator=torch.Generator(device="cuda").manual_seed(9), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    ids[mask == 0] = 0
    runs = [m.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                       output_logits=True, return_dict_in_generate=True) for m in (reference, model)]
    # bfloat16 against eager attention: the family test's 3e-2, and ties as wide as its logits' errors
    _same_greedy_tokens(runs[0], runs[1], family, tolerance=3e-2, near_tie=0.25)
    kept = [m for m in model.modules() if m in fagen.transformers._KEPT]
    assert len(kept) == model.config.num_hidden_layers


def _deepseek_v3(implementation: str, dtype):
    """DeepSeek-V3's attention at its own widths (q and k 128 + 64 rotary = 192, v 128, MLA's
    low-rank q and kv projections), small: 2 layers, 4 heads, dense MLPs (routed experts would
    flip their top-k between two attentions' roundings), random weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=192, kv_lora_rank=128,
                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=2,
                              vocab_size=1000, max_position_embeddings=512, attn_implementation=implementation)
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).to(device="cuda", dtype=dtype).train()


def test_transformers_deepseek_v3_prefills_and_trains_as_sdpa():
    """Two head widths in a model: DeepSeek-V3 (192/128) on fagen.transformers, bfloat16, a batch
    of two 300-token rows: the prefill's logits and one training step's loss and every
    parameter's gradient against the same model on SDPA."""
    pytest.importorskip("transformers")
    import fagen.transformers

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[2].shape[-1] if len(args) > 2 else None)
        return fagen.transformers.attention(*args, **kwargs)

    _register("fagen_deepseek", counted)
    reference = _deepseek_v3("sdpa", torch.bfloat16)
    model = _deepseek_v3("fagen_deepseek", torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 1000, (2, 300), generator=torch.Generator(device="cuda").manual_seed(8), device="cuda")
    with torch.no_grad():
        got, want = model(input_ids=ids).logits.float(), reference(input_ids=ids).logits.float()
    assert relative_error(to_numpy(got), to_numpy(want)) < 3e-2
    assert calls and all(width == 192 for width in calls), calls  # q and k at 192 reached fagen
    losses = []
    for run in (model, reference):
        loss = run(input_ids=ids, labels=ids).loss
        (loss * LOSS_SCALE).backward()
        losses.append(loss.item())
    tolerance = LLAMA_TOLERANCE["bfloat16"]
    assert abs(losses[0] - losses[1]) <= tolerance * abs(losses[1]), losses
    reference_grads = dict(reference.named_parameters())
    errors = {name: relative_error(to_numpy(p.grad), to_numpy(reference_grads[name].grad))
              for name, p in model.named_parameters() if p.grad is not None}
    assert len(errors) == len([p for p in reference.parameters() if p.grad is not None])
    assert all(e <= tolerance for e in errors.values()), {n: e for n, e in errors.items() if e > tolerance}


def test_inference_takes_sinks_that_are_a_parameter():
    """Under no_grad, a float32 sinks parameter (requires_grad) reaches the kernel through its
    detached alias (PyTorch refuses the array interface of a tensor that requires grad), in a
    shape class whose key follows the parameter's in-place updates."""
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    sinks = torch.nn.Parameter(torch.randn(8, device="cuda"))
    for _ in range(2):
        with torch.no_grad():
            out = fagen.attention(q, k, v, sinks=sinks)
            want = oracle.attention(*(to_numpy(x) for x in (q, k, v)), sinks=to_numpy(sinks.detach()))
            assert relative_error(to_numpy(out), want) < OUT_TOLERANCE["float16"]
            sinks.add_(1.0)  # the next call must see the new values
