"""fagen.transformers without a GPU: the attention function a transformers model calls, with
fagen's kernels stood in for by the float64 oracle, against transformers' own attention (SDPA,
eager) on small random models: what each module says (causal, scale, GQA, Gemma-2's window and
softcap, gpt-oss's sinks, padding, a static cache) reaches the kernel's arguments, and what it
cannot run yet (dropout, custom masks) is refused by name. GPU runs with the real kernels: tests/test_gpu_torch.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fagen  # noqa: E402
from fagen import oracle  # noqa: E402


@pytest.fixture
def kernels(monkeypatch):
    """fagen's attention as the float64 oracle computes it; the calls' arguments, recorded."""
    from fagen import torch_op
    import fagen.transformers  # noqa: F401

    calls = []

    def attention(q, k, v, *, causal=False, mask=None, scale=None, softcap=None, sinks=None, doc_ids=None, bias=None,
                  cache_seqlens=None, cache_leftpad=None, **kwargs):
        ranges = None if cache_seqlens is None else (cache_leftpad.tolist(), cache_seqlens.tolist())
        calls.append(dict(causal=causal, mask=mask, scale=scale, softcap=softcap, sinks=sinks, dtype=q.dtype,
                          doc_ids=doc_ids, bias=bias, ranges=ranges))
        dtype = q.dtype
        q, k, v = (t.detach().double().numpy() for t in (q, k, v))
        sinks = None if sinks is None else sinks.detach().double().numpy()
        if ranges is not None:  # the kernel's key ranges: oracle.attention_cache reads [B, slots, Hkv, d]
            assert cache_seqlens.dtype == cache_leftpad.dtype == torch.int32
            assert bias is None and doc_ids is None  # as the kernels refuse them beside ranges
            out = oracle.attention_cache(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), ranges[1], ranges[0],
                                         causal=causal, mask=mask, scale=scale, softcap=softcap, sinks=sinks)
        else:
            out = oracle.attention(q, k, v, causal=causal, mask=mask, scale=scale, softcap=softcap, sinks=sinks,
                                   doc_ids=None if doc_ids is None else doc_ids.numpy(),
                                   bias=None if bias is None else bias.numpy())
        return torch.from_numpy(np.ascontiguousarray(out)).to(dtype)

    monkeypatch.setattr(torch_op, "attention", attention)
    fagen.transformers.register()
    return calls


@pytest.fixture
def traced_op(monkeypatch):
    """The op's implementation stubbed (no kernel: what torch.compile traces is under test): the
    side inputs of each call that reaches it, recorded."""
    from fagen import decode, dispatch
    import fagen.transformers

    seen = []

    def forward(plain, q, k, v, **side):
        seen.append(side)
        return (q * 1, q.new_zeros(q.shape[:3])) if side.get("return_lse") else q * 1

    monkeypatch.setattr(decode, "forward", forward)
    for module in (dispatch, decode):  # the op's path reads dispatch's; the eager one, decode's import of it
        monkeypatch.setattr(module, "derive_spec", lambda *args, **kwargs: None)
    fagen.transformers.register()
    return seen


def _logits(model_class, config, implementation, ids, mask=None, position_ids=None):
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation=implementation).eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits


def test_a_llama_matches_sdpa(kernels):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=97)
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    got, want = _logits(LlamaForCausalLM, config, "fagen", ids), _logits(LlamaForCausalLM, config, "sdpa", ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert len(kernels) == 2 and all(c["causal"] and c["mask"] is None for c in kernels)
    assert kernels[0]["scale"] == pytest.approx(32 ** -0.5)
    # an all-ones attention_mask is no padding: the same call
    got = _logits(LlamaForCausalLM, config, "fagen", ids, mask=torch.ones_like(ids))
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_a_gemma2_window_and_softcap_reach_the_kernel(kernels):
    """Gemma-2 alternates sliding-window and global layers, with a logit softcap: transformers'
    window of W keys is fagen's window_left W - 1."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, num_hidden_layers=2, vocab_size=97, sliding_window=7,
                          attn_logit_softcapping=20.0, query_pre_attn_scalar=32)
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(2))
    got, want = _logits(Gemma2ForCausalLM, config, "fagen", ids), _logits(Gemma2ForCausalLM, config, "eager", ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    windows = [c["mask"] for c in kernels]
    assert {"kind": "sliding_window", "window_left": 6} in windows and None in windows
    assert all(c["softcap"] == 20.0 for c in kernels)


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_a_padded_batch_matches_sdpa_on_its_tokens(kernels, side):
    """Left padding reaches the kernel as each row's key range (its pads never read); padding
    elsewhere as a float32 score bias [B, 1, Nk] (0 on tokens, PAD on pads): logits at every
    token equal SDPA's (which masks with a 4-D mask), in the prompt and in a decode step on the
    cache after it; rows of pads come out finite."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=97)
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    pads = {"left": (slice(0, 5), slice(0, 2)), "right": (slice(7, 12), slice(10, 12)),
            "middle": (slice(4, 6), slice(8, 9))}[side]
    mask[0, pads[0]] = 0
    mask[1, pads[1]] = 0  # row 2 has no padding
    step = torch.randint(0, 97, (3, 1), generator=torch.Generator().manual_seed(4))
    results = {}
    for implementation in ("fagen", "sdpa"):
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(config, attn_implementation=implementation).eval()
        with torch.no_grad():
            cache = DynamicCache(config=config)
            prompt = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
            grown = torch.cat([mask, torch.ones_like(step)], 1)
            decoded = model(input_ids=step, attention_mask=grown, past_key_values=cache).logits
        results[implementation] = prompt, decoded
    tokens = mask.bool()
    assert torch.allclose(results["fagen"][0][tokens], results["sdpa"][0][tokens], atol=1e-4, rtol=1e-4)
    assert torch.allclose(results["fagen"][1], results["sdpa"][1], atol=1e-4, rtol=1e-4)
    assert torch.isfinite(results["fagen"][0]).all()
    if side == "left":  # one run of tokens a row, ending at the last key: each row's key range, no bias
        assert [c["ranges"] for c in kernels] == [([5, 2, 0], [12] * 3)] * 2 + [([5, 2, 0], [13] * 3)] * 2
        assert all(c["bias"] is None for c in kernels)
        return
    biases = [c["bias"] for c in kernels if c["bias"] is not None]
    assert len(biases) == 4  # two layers, prompt and step
    assert biases[0].shape == (3, 1, 12) and biases[0].dtype == torch.float32
    assert (biases[0][:, 0] == 0).equal(tokens) and (biases[0][~tokens[:, None, :]] == fagen.transformers.PAD).all()
    assert biases[-1].shape == (3, 1, 13)


def test_a_custom_4d_mask_is_refused_by_name(kernels):
    from fagen.transformers import attention

    q = torch.zeros(1, 2, 3, 8)
    module = type("Module", (), {"is_causal": True})()
    with pytest.raises(ValueError, match="a 4-D torch.bool attention mask is not supported"):
        attention(module, q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    assert kernels == []


def test_attention_dropout_is_refused_while_training(kernels):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=97, attention_dropout=0.1)
    model = LlamaForCausalLM._from_config(config, attn_implementation="fagen").train()
    with pytest.raises(ValueError, match="attention dropout 0.1 is not supported"):
        model(input_ids=torch.randint(0, 97, (1, 5)))


def test_gpt_oss_sinks_and_window_reach_the_kernel(kernels):
    """gpt-oss: a learned sink logit a head (s_aux: fagen's sinks, float32) and alternating
    sliding-window layers, against transformers' eager attention."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, num_hidden_layers=2, vocab_size=97, num_local_experts=2, num_experts_per_tok=1,
                          sliding_window=7, layer_types=["sliding_attention", "full_attention"])
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(3))

    def logits(implementation):
        torch.manual_seed(0)
        model = GptOssForCausalLM._from_config(config, attn_implementation=implementation).eval()
        for module in model.modules():
            if hasattr(module, "sinks"):  # zeros at initialisation: make them count
                torch.nn.init.normal_(module.sinks, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            return model(input_ids=ids).logits

    assert torch.allclose(logits("fagen"), logits("eager"), atol=1e-4, rtol=1e-4)
    assert all(c["sinks"] is not None and c["sinks"].dtype == torch.float32 for c in kernels)
    assert {"kind": "sliding_window", "window_left": 6} in [c["mask"] for c in kernels]


def test_autocast_hands_the_kernel_the_autocast_dtype(kernels):
    """Under autocast, float32 q, k, v (a rotary embedding computed in float32) go in as the
    autocast dtype, as SDPA takes them; outside it they go in as they are."""
    module = type("Attention", (), {"is_causal": True})()
    q = torch.randn(1, 4, 6, 32)
    kv = torch.randn(1, 2, 6, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = fagen.transformers.attention(module, q, kv, kv, None, scaling=0.2)
    assert kernels[-1]["dtype"] == torch.bfloat16 and out.dtype == torch.bfloat16 and weights is None
    assert out.shape == (1, 6, 4, 32)  # [B, N, H, d], as transformers' attention functions return
    fagen.transformers.attention(module, q, kv, kv, None)
    assert kernels[-1]["dtype"] == torch.float32


def test_packed_documents_attend_within_themselves(kernels):
    """Documents packed into one row, position_ids restarting at each (as transformers' data
    collators pack them): fagen's document mask gives each document's logits as the document run
    alone does (transformers' SDPA and eager paths, given no attention_mask, attend across the
    documents); an unpacked row takes the plain causal kernel."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=97)
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(5))
    lengths, starts = (7, 9, 4), (0, 7, 16)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    got = _logits(LlamaForCausalLM, config, "fagen", ids, position_ids=positions)
    alone = torch.cat([_logits(LlamaForCausalLM, config, "sdpa", ids[:, s:s + n], position_ids=torch.arange(n)[None])
                       for s, n in zip(starts, lengths)], dim=1)
    assert torch.allclose(got, alone, atol=1e-4, rtol=1e-4)
    assert kernels[-1]["doc_ids"].tolist() == [[0] * 7 + [1] * 9 + [2] * 4]
    across = _logits(LlamaForCausalLM, config, "sdpa", ids, position_ids=positions)
    assert not torch.allclose(across, alone, atol=1e-3)  # the documents made a difference
    _logits(LlamaForCausalLM, config, "fagen", ids, position_ids=torch.arange(20)[None])
    assert kernels[-1]["doc_ids"] is None


def test_a_packed_row_compiles_in_one_graph(traced_op):
    """torch.compile(fullgraph=True) cannot branch on position_ids' values: under it a row that
    could be packed always takes the document mask (one document where nothing restarts), and
    the attention traces into the op without a break. The op's implementation is stubbed: this
    checks the trace and what reaches the op."""
    import fagen.transformers

    module = type("Attention", (), {"is_causal": True})()
    q, kv = torch.randn(1, 4, 12, 64, requires_grad=True), torch.randn(1, 2, 12, 64)

    @torch.compile(fullgraph=True, backend="eager")
    def attend(q, kv, positions):
        return fagen.transformers.attention(module, q, kv, kv, None, position_ids=positions)[0]

    assert attend(q, kv, torch.cat([torch.arange(5), torch.arange(7)])[None]).shape == (1, 12, 4, 64)
    assert traced_op[-1]["doc_ids"].tolist() == [[0] * 5 + [1] * 7]
    attend(q, kv, torch.arange(12)[None])
    assert traced_op[-1]["doc_ids"].tolist() == [[0] * 12]


@pytest.mark.parametrize("padded", [False, True])
def test_a_static_cache_matches_sdpa_and_never_attends_past_its_tokens(kernels, padded):
    """A static cache's keys run to max_cache_len, past the tokens seen: each row's key range ends
    at them, prefill and decode steps alike (the slots after them never read). Logits as SDPA's
    on its own static cache, prompt and three steps, padded or not."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=97)
    ids = torch.randint(1, 97, (2, 11), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
    steps = torch.randint(1, 97, (3, 2, 1), generator=torch.Generator().manual_seed(6))
    results = {}
    for implementation in ("fagen", "sdpa"):
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(config, attn_implementation=implementation).eval()
        cache = StaticCache(config=config, max_cache_len=32)
        with torch.no_grad():
            logits = [model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits[mask.bool()]]
            grown = mask
            for step in steps:
                grown = torch.cat([grown, torch.ones_like(step)], 1)
                logits.append(model(input_ids=step, attention_mask=grown, past_key_values=cache).logits)
        results[implementation] = logits
    for got, want in zip(results["fagen"], results["sdpa"]):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    # each row's range: from its pads to the tokens seen (the prefill's 11, then 12, 13, 14)
    pads = [0, 4 if padded else 0]
    assert [c["ranges"] for c in kernels] == [(pads, [seen] * 2) for seen in (11, 12, 13, 14) for _ in range(2)]
    assert all(c["bias"] is None for c in kernels)


@pytest.mark.parametrize("prompt", [11, 4])
def test_a_gemma2_static_cache_matches_eager(kernels, prompt):
    """Gemma-2's static cache: global layers as above, sliding-window layers on their own window
    of 7 slots; a prompt longer than the window, or shorter (its slots fill during the decode
    steps), then five steps, as on eager attention."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, StaticCache

    config = Gemma2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, num_hidden_layers=2, vocab_size=97, sliding_window=7,
                          attn_logit_softcapping=20.0, query_pre_attn_scalar=32)
    ids = torch.randint(1, 97, (2, prompt), generator=torch.Generator().manual_seed(5))
    steps = torch.randint(1, 97, (5, 2, 1), generator=torch.Generator().manual_seed(6))
    results = {}
    for implementation in ("fagen", "eager"):
        torch.manual_seed(0)
        model = Gemma2ForCausalLM._from_config(config, attn_implementation=implementation).eval()
        cache = StaticCache(config=config, max_cache_len=32)
        with torch.no_grad():
            logits = [model(input_ids=ids, past_key_values=cache).logits]
            for step in steps:
                logits.append(model(input_ids=step, past_key_values=cache).logits)
        results[implementation] = logits
    for got, want in zip(results["fagen"], results["eager"]):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_the_ops_are_pt2_compliant():
    """As torch.library.custom_op tags its ops: torch.compile with only_allow_pt2_compliant_ops."""
    pytest.importorskip("fagen.torch_op")
    for op in (torch.ops.fagen.attention_forward, torch.ops.fagen.attention_backward):
        assert torch.Tag.pt2_compliant_tag in op.default.tags


def test_a_gemma2_row_compiles_in_one_graph(traced_op):
    """Gemma-2 under torch.compile(fullgraph=True), batch 1 (position_ids always reach the
    attention): its sliding-window layers trace without the document mask, its global ones with
    it. The op's implementation is stubbed: this checks the trace."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, num_hidden_layers=2, vocab_size=97, sliding_window=7,
                          attn_logit_softcapping=20.0, query_pre_attn_scalar=32)
    model = Gemma2ForCausalLM._from_config(config, attn_implementation="fagen")
    ids = torch.randint(0, 97, (1, 12))
    loss = torch.compile(model, fullgraph=True, backend="eager")(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and sorted(side.get("doc_ids") is not None for side in traced_op) == [False, True]


def test_sinks_of_another_dtype_are_cast_once_a_version(kernels):
    """gpt-oss keeps its sinks in the model's dtype; the kernels take float32. Outside autograd
    the float32 copy is kept a parameter and version (the runtime checks a sinks object's values
    once: a host sync), made anew after an in-place update; under autograd it is cast each call,
    so that its gradient reaches the parameter."""
    module = type("Attention", (), {"is_causal": True})()
    q, kv = torch.randn(1, 4, 6, 32), torch.randn(1, 2, 6, 32)
    sinks = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    with torch.no_grad():
        fagen.transformers.attention(module, q, kv, kv, None, s_aux=sinks)
        fagen.transformers.attention(module, q, kv, kv, None, s_aux=sinks)
        assert kernels[-1]["sinks"] is kernels[-2]["sinks"] and kernels[-1]["sinks"].dtype == torch.float32
        sinks.add_(1)
        fagen.transformers.attention(module, q, kv, kv, None, s_aux=sinks)
        assert kernels[-1]["sinks"] is not kernels[-2]["sinks"]
        assert torch.equal(kernels[-1]["sinks"], sinks.float())
    fagen.transformers.attention(module, q, kv, kv, None, s_aux=sinks)
    assert kernels[-1]["sinks"].requires_grad  # the cast autograd records


def test_a_forward_tells_packed_documents_once_for_all_its_layers():
    """packed_documents' host check runs once a position_ids tensor (a forward's layers share it):
    later layers get the same ids without waiting for the GPU; an in-place change asks again."""
    from fagen.transformers import packed_documents

    q = torch.zeros(1, 2, 6, 8)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2]])
    first = packed_documents(position_ids, q, q)
    assert first.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert packed_documents(position_ids, q, q) is first
    position_ids.copy_(torch.arange(6)[None])
    assert packed_documents(position_ids, q, q) is None


def test_a_padded_llama_compiles_in_one_graph(traced_op):
    """A padded batch under torch.compile(fullgraph=True): the padding bias is made inside the
    graph (no host check of the mask's values) and reaches the op as its bias. The op's
    implementation is stubbed: this checks the trace and what reaches the op."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import fagen.transformers

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=97)
    model = LlamaForCausalLM._from_config(config, attn_implementation="fagen").eval()
    ids = torch.randint(0, 97, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        logits = torch.compile(model, fullgraph=True, backend="eager")(input_ids=ids, attention_mask=mask).logits
    seen = [side["bias"] for side in traced_op]
    assert torch.isfinite(logits).all() and len(seen) == 2
    assert seen[0].shape == (2, 1, 12) and (seen[0][1, 0, :4] == fagen.transformers.PAD).all()
    assert (seen[0][0] == 0).all()


def test_generate_on_a_static_cache_gives_sdpa_s_tokens(kernels):
    """generate(cache_implementation="static"), a left-padded batch: the tokens SDPA generates."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=97, initializer_range=0.1)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    tokens = {}
    for implementation in ("fagen", "sdpa"):
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(config, attn_implementation=implementation).eval()
        tokens[implementation] = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                                do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(tokens["fagen"], tokens["sdpa"])
    # two layers a forward: the prompt's 9 tokens, then one more a step, from each row's pads
    assert [c["ranges"] for c in kernels] == [([3, 0], [seen] * 2) for seen in range(9, 15) for _ in range(2)]


def test_a_static_cache_decode_step_compiles_in_one_graph(traced_op):
    """A static cache's decode step under torch.compile(fullgraph=True), as generate compiles it:
    the empty slots' bias is made inside the graph from the cache's device counter (no host read),
    and reaches the op at the cache's full length. The op's implementation is stubbed."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=97)
    model = LlamaForCausalLM._from_config(config, attn_implementation="fagen").eval()
    cache = StaticCache(config=config, max_cache_len=32)
    ids = torch.randint(1, 97, (2, 7))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)  # the prefill, eager
        step = torch.compile(model, fullgraph=True, backend="eager")
        logits = step(input_ids=ids[:, :1], past_key_values=cache).logits
    assert torch.isfinite(logits).all()
    bias = traced_op[-1]["bias"]
    assert bias.shape == (2, 1, 32) and (bias[:, 0, :8] == 0).all() and (bias[:, 0, 8:] == fagen.transformers.PAD).all()


def _llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=2, vocab_size=97, initializer_range=0.1), **overrides})


def test_cross_attention_reads_every_encoder_key(kernels):
    """An encoder-decoder (BART): cross-attention's keys are the encoder's (more than the decoder's
    queries, yet no static cache), its padding masked; logits and generated tokens as SDPA's."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=97, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.3)
    source = torch.randint(3, 97, (2, 15), generator=torch.Generator().manual_seed(1))
    source_mask = torch.ones_like(source)
    source_mask[1, 12:] = 0
    target = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    results = {}
    for implementation in ("sdpa", "fagen"):
        torch.manual_seed(0)
        model = BartForConditionalGeneration._from_config(config, attn_implementation=implementation).eval()
        with torch.no_grad():
            logits = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=target).logits
        tokens = model.generate(source, attention_mask=source_mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        results[implementation] = logits, tokens
    assert torch.allclose(results["fagen"][0], results["sdpa"][0], atol=1e-4, rtol=1e-4)
    assert torch.equal(results["fagen"][1], results["sdpa"][1])


def test_a_chunked_mask_is_refused_not_computed_as_causal(kernels):
    """Llama-4's chunked attention is a mask pattern fagen does not express yet: refused by name
    (it would otherwise run as plain causal past the first chunk)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(hidden_size=128, intermediate_size=128, intermediate_size_mlp=256, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=97,
                              num_local_experts=2, num_experts_per_tok=1, attention_chunk_size=4, no_rope_layers=[1, 1],
                              layer_types=["chunked_attention", "chunked_attention"])
    model = Llama4ForCausalLM._from_config(config, attn_implementation="fagen").eval()
    with torch.no_grad(), pytest.raises(ValueError, match="a mask pattern beyond causal, sliding windows"):
        model(input_ids=torch.randint(1, 97, (1, 12)))
    assert kernels == []


@pytest.mark.parametrize("pads", [slice(3, 5), slice(0, 4)], ids=["gap", "left"])
def test_a_padded_row_is_not_taken_for_packed_documents(kernels, pads):
    """generate makes position_ids from the mask (pads at 0), so a padded batch of one looks packed:
    with a mask (a bias, or key ranges) there is no packing; tokens on both sides of a gap see
    each other, as in SDPA."""
    from transformers import LlamaForCausalLM

    ids = torch.randint(1, 97, (1, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, pads] = 0
    tokens = {}
    for implementation in ("sdpa", "fagen"):
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(_llama_config(), attn_implementation=implementation).eval()
        tokens[implementation] = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                                                do_sample=False, pad_token_id=0)
    assert torch.equal(tokens["fagen"], tokens["sdpa"])
    assert all(c["doc_ids"] is None for c in kernels)


def test_rows_of_packed_documents_attend_within_their_own(kernels):
    """A training batch of two rows, each packed with documents (position_ids restarting, no mask,
    no cache): per-row document ids, logits as SDPA's (which finds the documents per row)."""
    from transformers import LlamaForCausalLM

    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(8)) + list(range(4))])
    logits = {}
    for implementation in ("sdpa", "fagen"):
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(_llama_config(), attn_implementation=implementation).eval()
        with torch.no_grad():
            logits[implementation] = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert torch.allclose(logits["fagen"], logits["sdpa"], atol=1e-4, rtol=1e-4)
    assert kernels[0]["doc_ids"].tolist() == [[0] * 5 + [1] * 7, [0] * 8 + [1] * 4]


def test_key_ranges_are_each_row_s_run_of_tokens():
    """A row's first token and last + 1, 0 and 0 without one; whether its tokens are one run."""
    tokens = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]).bool()
    ranges, one_run, last = fagen.transformers.key_ranges(tokens)
    assert ranges.dtype == torch.int32 and ranges.shape == (2, 1, 5)
    assert ranges[0, 0].tolist() == [2, 0, 1, 0, 0] and ranges[1, 0].tolist() == [5, 3, 4, 0, 5]
    assert one_run.tolist() == [True, True, False, True, True] and last.tolist() == [5, 3, 4, 0, 5]
    # the same keys as a bias, for a training step (ranges have no backward)
    bias = fagen.transformers.ranges_bias(ranges, 5)
    assert bias.shape == (5, 1, 5) and ((bias[:, 0] == 0) == tokens).sum() == 24  # the holed row differs, at its hole


def test_left_padded_ranges_agree_with_key_ranges_where_rows_run_to_the_last_slot():
    """The decode step's shortcut: key_ranges' ranges where every row is one run to the last
    slot, None where a row is not (a hole, right padding, no token), as the general path refuses."""
    rng = np.random.default_rng(5)
    for _ in range(20):
        n, b = int(rng.integers(2, 40)), int(rng.integers(1, 9))
        starts = torch.tensor(rng.integers(0, n, size=b))
        tokens = torch.arange(n)[None] >= starts[:, None]
        ranges, one_run, last = fagen.transformers.key_ranges(tokens)
        assert torch.equal(fagen.transformers.left_padded_ranges(tokens), ranges)
        broken = tokens.clone()
        row, slot = int(rng.integers(0, b)), int(rng.integers(0, n))
        broken[row, slot] = not bool(broken[row, slot])
        _, one_run, last = fagen.transformers.key_ranges(broken)
        runs = bool(one_run.all()) and bool((last == n).all())
        assert (fagen.transformers.left_padded_ranges(broken) is not None) == runs
    assert fagen.transformers.left_padded_ranges(torch.zeros(2, 5, dtype=torch.bool)) is None
    assert fagen.transformers.left_padded_ranges(torch.tensor([[1, 1, 1, 0]]).bool()) is None


def test_a_left_padded_training_step_takes_the_padding_as_a_bias_and_matches_sdpa(kernels):
    """Training: the mask function's key ranges become the same keys' bias (the kernels' backward
    reads a bias), and the loss and its gradients match SDPA's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=53)
    ids = torch.randint(1, 53, (2, 10), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    losses = {}
    for implementation in ("fagen", "sdpa"):
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(config, attn_implementation=implementation).train()
        logits = model(input_ids=ids, attention_mask=mask).logits
        losses[implementation] = logits[mask.bool()].float().square().mean()
    assert torch.allclose(losses["fagen"], losses["sdpa"], atol=1e-5, rtol=1e-5)
    assert kernels and all(c["ranges"] is None and c["bias"].shape == (2, 1, 10) for c in kernels)
    assert (kernels[0]["bias"][0, 0, :3] == fagen.transformers.PAD).all() and (kernels[0]["bias"][:, 0, 3:] == 0).all()


def test_a_static_cache_after_right_padding_takes_a_bias(kernels):
    """Tokens that are not one run ending at the tokens seen (a right-padded prompt on a static
    cache) cannot be key ranges under the causal mask: the static cache's bias, as before."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=53)
    ids = torch.randint(1, 53, (2, 8), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    results = {}
    for implementation in ("fagen", "sdpa"):
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(config, attn_implementation=implementation).eval()
        with torch.no_grad():
            cache = StaticCache(config=config, max_cache_len=16)
            results[implementation] = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
    tokens = mask.bool()
    assert torch.allclose(results["fagen"][tokens], results["sdpa"][tokens], atol=1e-4, rtol=1e-4)
    assert kernels[0]["ranges"] is None and kernels[0]["bias"].shape == (2, 1, 8)


def _family(name: str):
    """A small random model of each family the issue names beside Llama, Gemma-2 and gpt-oss:
    Qwen2 (q/k/v biases, a sliding window on some layers), Qwen3 (q/k norms), Mistral (a sliding
    window on every layer), Gemma-3 (five sliding layers to one global, its own scaling)."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=61)
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=5, max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"])
    if name == "qwen3":
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common, head_dim=16)
    if name == "mistral":
        return transformers.MistralForCausalLM, transformers.MistralConfig(**common, sliding_window=5)
    return transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        **{**common, "num_hidden_layers": 6}, head_dim=16, sliding_window=5, query_pre_attn_scalar=16)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma3"])
def test_more_families_match_eager_on_left_padded_prompts_and_a_decode_step(kernels, family):
    """Each family's windows, scaling and GQA reach the kernel: a left-padded prompt longer than
    the window (key ranges), then a decode step on the dynamic cache, logits at every token as
    transformers' eager attention gives them."""
    from transformers import DynamicCache

    model_class, config = _family(family)
    ids = torch.randint(1, 61, (2, 12), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    step = torch.randint(1, 61, (2, 1), generator=torch.Generator().manual_seed(12))
    results = {}
    for implementation in ("fagen", "eager"):
        torch.manual_seed(0)
        model = model_class._from_config(config, attn_implementation=implementation).eval()
        with torch.no_grad():
            cache = DynamicCache(config=config)
            prompt = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
            grown = torch.cat([mask, torch.ones_like(step)], 1)
            decoded = model(input_ids=step, attention_mask=grown, past_key_values=cache).logits
        results[implementation] = prompt, decoded
    tokens = mask.bool()
    assert torch.allclose(results["fagen"][0][tokens], results["eager"][0][tokens], atol=1e-4, rtol=1e-4)
    assert torch.allclose(results["fagen"][1], results["eager"][1], atol=1e-4, rtol=1e-4)
    # left padding: key ranges, or nothing where a window's keys hold no pad (a decode step's last
    # window of a sliding layer); never the bias
    assert kernels and all(c["bias"] is None for c in kernels) and any(c["ranges"] is not None for c in kernels)
    windows = {None if c["mask"] is None else c["mask"]["window_left"] for c in kernels}
    assert windows == ({None} if family == "qwen3" else {None, 4} if family in ("qwen2", "gemma3") else {4})
