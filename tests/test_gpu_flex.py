"""fagen.flex on the GPU (marked `gpu`): flex_attention with traced score_mods and block masks
from create_block_mask, output and gradients against PyTorch computing attention with the same
Python functions in float64, fp16/bf16, d 64 and 128, GQA, lengths off the tiles.
Run with: pytest -m gpu tests/test_gpu_flex.py
"""

import pytest

from fagen.check import OUT_TOLERANCE, in_a_cuda_graph, relative_error, to_numpy

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from fagen import flex  # noqa: E402
from tests.test_flex import reference_attention, t5_bucket  # noqa: E402

GRAD_TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2}  # as tests/test_gpu_torch.py's
MODS = {
    "softcap_causal": (lambda s, b, h, q, k: 20.0 * torch.tanh(s / 20.0), lambda b, h, q, k: q >= k),
    "alibi_window": (lambda s, b, h, q, k: s - torch.exp2(-8.0 * (h + 1) / 8) * (q - k).abs(),
                     lambda b, h, q, k: (q >= k) & (q - k <= 300)),
    "dilated_relative": (lambda s, b, h, q, k: s + 0.01 * ((q - k) // 3), lambda b, h, q, k: ((q - k) % 2 == 0) | (k < 64)),
    "mask_only_per_head": (None, lambda b, h, q, k: torch.where(h % 2 == 0, q >= k, (q // 128) == (k // 128))),
    "score_only": (lambda s, b, h, q, k: s * torch.sigmoid(s), None),
    # T5's buckets (a captured table by head and bucket; exact and log-spaced distances)
    "t5_buckets_causal": (lambda s, b, h, q, k: s + T5_TABLE[h, t5_bucket(q - k, 32, 128)], lambda b, h, q, k: q >= k),
}
T5_TABLE = torch.randn(8, 32, generator=torch.Generator().manual_seed(7)).cuda() if torch.cuda.is_available() else None


@pytest.mark.parametrize("name", list(MODS))
@pytest.mark.parametrize("dtype, d", [("float16", 64), ("bfloat16", 128)])
def test_flex_attention_matches_pytorch_with_the_same_functions(name, dtype, d):
    score_mod, mask_mod = MODS[name]
    gen = torch.Generator(device="cuda").manual_seed(len(name) + d)
    # a mask built for every head is read as a block mask; one broadcast over them, a kind's
    # pattern (causal, a window) takes that kind's kernels (BlockMask.as_kind)
    assert_matches_pytorch(score_mod, mask_mod, dtype, d, 8, gen, None if name in ("softcap_causal", "alibi_window")
                           else 8)


def assert_matches_pytorch(score_mod, mask_mod, dtype: str, d: int, hq: int, gen, mask_heads: int | None = None):
    """fagen.flex's out and q, k, v gradients against PyTorch's in float64 with the same functions
    (B 2, Hq hq over 2 KV heads, 777 positions: off the tiles; the block mask for mask_heads heads,
    None: broadcast)."""
    b, hkv, n = 2, 2, 777
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=getattr(torch, dtype), generator=gen, requires_grad=True)
               for h in (hq, hkv, hkv))
    block_mask = None if mask_mod is None else flex.create_block_mask(mask_mod, None, mask_heads, n, n)
    out = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = reference_attention(*leaves, score_mod, mask_mod)
    assert relative_error(to_numpy(out), to_numpy(want)) < OUT_TOLERANCE[dtype]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, leaves, dout.double())
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want_grads):
        assert relative_error(to_numpy(got), to_numpy(ref)) < GRAD_TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype, d", [("float16", 64), ("bfloat16", 128)])
def test_flex_attention_reads_a_captured_bias_table(dtype, d):
    """attention-gym's relative position bias from a table [H, 2N - 1] (a kernel input, read as
    float32), causal: output and q, k, v gradients against PyTorch's with the same function; a
    table that may be indexed past its end is refused before a launch."""
    gen = torch.Generator(device="cuda").manual_seed(d)
    hq, n = 8, 777
    table = torch.randn(hq, 2 * n - 1, device="cuda", generator=gen)
    score_mod = lambda s, b_, h, q, k: s + table[h, q - k + n - 1]  # noqa: E731
    assert_matches_pytorch(score_mod, lambda b_, h, q, k: q >= k, dtype, d, hq, gen, hq)  # a block mask per head
    longer = torch.randn(2, hq, n + 1, d, device="cuda", dtype=getattr(torch, dtype))
    with pytest.raises(flex.TraceError, match="which may be"):
        flex.flex_attention(longer, longer, longer, score_mod=score_mod)


def test_a_compiled_layer_calling_flex_attention_captures_in_a_cuda_graph():
    """torch.compile(fullgraph=True) of a layer calling fagen.flex.flex_attention (a captured bias
    table, a block mask): forward and gradients as the eager call's; its forward captured in a
    CUDA graph and replayed after new queries and a table changed in place reads both."""
    b, hq, n, d = 2, 8, 512, 64
    gen = torch.Generator(device="cuda").manual_seed(11)
    table = torch.randn(hq, 2 * n - 1, device="cuda", generator=gen)
    score_mod = lambda s, b_, h, q, k: s + table[h, q - k + n - 1]  # noqa: E731
    # no mask kind's pattern (one would take that kind's kernels): the block mask's lists in the graph
    block_mask = flex.create_block_mask(lambda b_, h, q, k: (q >= k) & (((q - k) % 2 == 0) | (k < 16)), None, None,
                                        n, n)

    def layer(q, k, v):
        return flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask) * 2

    compiled = torch.compile(layer, fullgraph=True)
    q, k, v = (torch.randn(b, hq, n, d, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    eager_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    got, want = compiled(*leaves), layer(*eager_leaves)
    assert relative_error(to_numpy(got), to_numpy(want)) < 1e-3
    dout = torch.randn_like(got)
    for g, w in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, eager_leaves, dout)):
        assert relative_error(to_numpy(g), to_numpy(w)) < 1e-3
    with torch.no_grad():
        graph, out = in_a_cuda_graph(lambda: compiled(q, k, v))
        q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen))
        table.mul_(-2.0)
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(to_numpy(out), to_numpy(layer(q, k, v))) < 1e-3


def test_a_compiled_flex_call_takes_one_block_mask_after_another():
    """One compiled function called with three block masks in turn: each call traces anew, and a
    mask's serial (the number that names it to the traced call) that differs between traces must
    stay a constant (an int would turn symbolic: automatic dynamic shapes). Each output as the
    eager call's."""
    b, h, n, d = 1, 4, 384, 64
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    compiled = torch.compile(lambda q, k, v, mask: flex.flex_attention(q, k, v, block_mask=mask), fullgraph=True)
    for stride in (2, 3, 5):
        mask = flex.create_block_mask(lambda b_, h_, q_, k_, s=stride: (q_ >= k_) & ((q_ - k_) % s != 1), None,
                                      None, n, n)
        got, want = compiled(q, k, v, mask), flex.flex_attention(q, k, v, block_mask=mask)
        assert relative_error(to_numpy(got), to_numpy(want)) < 1e-3, stride


LEARNED_MASKS = {"prefix_lm": lambda b_, h, q, k: (q >= k) | (k < 64),  # the prefix-LM kind's kernels
                 "dilated": lambda b_, h, q, k: (q >= k) & ((q - k) % 3 != 1)}  # a block mask's


@pytest.mark.parametrize("dtype, d, mask", [("float16", 64, "prefix_lm"), ("bfloat16", 128, "prefix_lm"),
                                            ("bfloat16", 64, "dilated"), ("float16", 128, "dilated")])
def test_a_learned_bias_table_gets_its_gradient_bitwise_repeatable(dtype, d, mask):
    """A relative bias table [H, 2N - 1] that requires grad, summed by the dK/dV kernel (int64 fixed
    point, backward.captured_grads): its gradient against PyTorch's autograd through the same
    function in float64, the same bits twice, and the same bits under torch.compile(fullgraph=True)."""
    gen = torch.Generator(device="cuda").manual_seed(d + 1)
    b, hq, hkv, n = 2, 8, 2, 777
    table = (torch.randn(hq, 2 * n - 1, device="cuda", generator=gen) * 0.5).requires_grad_()
    score_mod = lambda s, b_, h, q, k: s + table[h, q - k + n - 1]  # noqa: E731
    mask_mod = LEARNED_MASKS[mask]
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=getattr(torch, dtype), generator=gen)
               for h in (hq, hkv, hkv))
    block_mask = flex.create_block_mask(mask_mod, None, None, n, n)
    dout = torch.randn(b, hq, n, d, device="cuda", dtype=q.dtype, generator=gen)
    got = [torch.autograd.grad(flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                   enable_gqa=True), table, dout)[0] for _ in range(2)]
    assert torch.equal(got[0], got[1])
    want = torch.autograd.grad(reference_attention(q.double(), k.double(), v.double(), score_mod, mask_mod), table,
                               dout.double())[0]
    assert relative_error(to_numpy(got[0]), to_numpy(want)) < GRAD_TOLERANCE[dtype]
    compiled = torch.compile(lambda q, k, v: flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                                 enable_gqa=True), fullgraph=True)
    assert torch.equal(torch.autograd.grad(compiled(q, k, v), table, dout)[0], got[0])


def test_tables_summed_in_the_kernel_and_outside_train_together():
    """A score_mod with three learned tensors: a temperature (its derivative reads the score: summed
    outside the kernels), a relative table and a per-head gain (summed by the dK/dV kernel, whose
    spec says so), each gradient and q, k, v's against PyTorch's autograd in float64."""
    from fagen import backward

    gen = torch.Generator(device="cuda").manual_seed(3)
    b, hq, hkv, n, d = 2, 4, 2, 500, 64
    temperature, table, gain = (torch.randn(*shape, device="cuda", generator=gen).requires_grad_()
                                for shape in ((hq,), (hq, 2 * n - 1), (hq,)))
    score_mod = lambda s, b_, h, q, k: s * torch.sigmoid(temperature[h]) + table[h, q - k + n - 1] * gain[h]  # noqa: E731
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, n, d, device="cuda", dtype=q.dtype, generator=gen)
    leaves = (q, k, v, temperature, table, gain)
    got, again = (torch.autograd.grad(flex.flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True), leaves, dout)
                  for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(got[3:], again[3:]))  # the tables' gradients: the same bits
    want = torch.autograd.grad(reference_attention(*(x.double() for x in (q, k, v)), score_mod, None), leaves,
                               dout.double())
    for name, g, w in zip(("dq", "dk", "dv", "temperature", "table", "gain"), got, want):
        assert relative_error(to_numpy(g), to_numpy(w)) < GRAD_TOLERANCE["bfloat16"], name
    assert any(spec.backward.captured_grads == (1, 2) for spec, _ in backward._CACHE)


def test_a_learned_table_s_training_step_replays_in_a_cuda_graph():
    """Forward and backward with a learned table (summed by the dK/dV kernel: its fixed-point
    scale computed on the device, no host sync) captured in a CUDA graph after a warm-up, then
    replayed on new q and a changed table: the table's gradient the same bits as an eager step's,
    q, k, v's within the kernels' tolerance (atomic dQ adds in any order)."""
    gen = torch.Generator(device="cuda").manual_seed(29)
    b, hq, hkv, n, d = 2, 4, 2, 384, 64
    table = (torch.randn(hq, 2 * n - 1, device="cuda", generator=gen) * 0.5).requires_grad_()
    score_mod = lambda s, b_, h, q, k: s + table[h, q - k + n - 1]  # noqa: E731
    block_mask = flex.create_block_mask(lambda b_, h, q, k: q >= k, None, None, n, n)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step():
        out = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
        return torch.autograd.grad(out, (q, k, v, table), dout)

    graph, captured = in_a_cuda_graph(step)
    with torch.no_grad():
        q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen))
        table.mul_(-2.0)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    assert torch.equal(captured[3], eager[3])
    for got, want in zip(captured[:3], eager[:3]):
        assert relative_error(to_numpy(got), to_numpy(want)) < 1e-3
