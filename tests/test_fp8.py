"""The FP8 forward's host side and its kernel's P.V contract, without a GPU: V^T's key order
makes P.V right with P packed as the kernel packs it; V^T and the descales as the launch takes
them; the spec's FP8 rules; the rendered kernel's FP8 instructions."""

import numpy as np
import pytest

from fagen import fp8_inputs
from fagen.fp8_inputs import KEY_GROUP, KEY_ORDER, descale_views, prepared_copy, transposed_v
from fagen.load import SPECS as SPECS_DIR, load_spec, parse_spec
from fagen.rendering import render
from fagen.spec import Mask, ScoreMod, SpecError

SPEC = "specs/attn_e4m3_d128_sm90a.yaml"


def a_operand(p: np.ndarray) -> np.ndarray:
    """P [64, 32] as one k32 step's A operand reads it once the kernel packed its registers
    (templates/sm90/mainloop.cu.j2): thread (g, t) of warp w holds S accumulator columns 8f + 2t,
    8f + 2t + 1 of rows 16w + g and 16w + g + 8 (fragments f = 0..3), and packs register 0 from
    fragments 0 and 1 of row g, register 1 the same of row g + 8, registers 2 and 3 from
    fragments 2 and 3. wgmma reads register 0 as k 4t..4t+3 of row g, 1 as row g + 8, 2 and 3 as
    k 16 + 4t.. of each."""
    a = np.full_like(p, np.nan)
    for row in range(64):
        for t in range(4):
            held = [p[row, 8 * f + 2 * t + c] for f in range(4) for c in range(2)]  # the thread's accumulators
            a[row, 4 * t:4 * t + 4] = held[0:4]  # fragments 0 and 1 -> registers 0 / 1
            a[row, 16 + 4 * t:16 + 4 * t + 4] = held[4:8]  # fragments 2 and 3 -> registers 2 / 3
    return a


def test_v_transposed_in_key_order_makes_the_packed_p_v_exact():
    rng = np.random.default_rng(0)
    keys, d = 128, 16
    p = rng.standard_normal((64, keys))
    v = rng.integers(0, 256, (1, 1, keys, d)).astype(np.uint8)
    vt = transposed_v(v)[0, 0].astype(np.float64)  # [d, keys], keys in the kernel's order
    got = sum(a_operand(p[:, k0:k0 + KEY_GROUP]) @ vt[:, k0:k0 + KEY_GROUP].T for k0 in range(0, keys, KEY_GROUP))
    np.testing.assert_allclose(got, p @ v[0, 0].astype(np.float64), rtol=1e-12)


def test_the_key_order_is_a_permutation_of_each_group():
    assert sorted(KEY_ORDER) == list(range(KEY_GROUP))
    assert list(KEY_ORDER[:8]) == [0, 1, 8, 9, 2, 3, 10, 11]


def test_v_transposed_pads_the_keys_with_zeros_to_whole_tiles():
    v = np.random.default_rng(1).integers(1, 256, (2, 3, 200, 128)).astype(np.uint8)
    vt = transposed_v(v)
    assert vt.shape == (2, 3, 128, 256) and vt.flags.c_contiguous
    order = np.concatenate([g + KEY_ORDER for g in range(0, 256, KEY_GROUP)])
    padded = np.zeros((2, 3, 256, 128), np.uint8)
    padded[:, :, :200] = v
    np.testing.assert_array_equal(vt, padded[:, :, order].transpose(0, 1, 3, 2))
    assert (np.sort(vt, axis=-1)[..., :56] == 0).all()  # 56 zero keys a row, wherever the order put them


def byte_perm(x: int, y: int, selector: int) -> int:
    """CUDA's __byte_perm: byte i of the result is byte (selector's nibble i) of y:x (x low)."""
    pool = (y << 32 | x).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[selector >> 4 * i & 7] for i in range(4)), "little")


def v_transpose_kernel_model(v: np.ndarray) -> np.ndarray:
    """The V^T kernel's index math and byte permutes (templates/kernel/v_transpose.cu.j2), run
    lane by lane in NumPy: V [B, Hkv, N, d] uint8 -> V^T [B, Hkv, d, padded]."""
    b, h, n, d = v.shape
    padded = fp8_inputs.padded_keys(n)
    out = np.full((b, h, d, padded), 0xAB, np.uint8)  # poisoned: every byte must be written
    for bh in range(b * h):
        rows = v[bh // h, bh % h]
        for tile in range(padded // 128):
            for warp in range(d // 16):
                column = warp * 16
                for lane in range(32):
                    column0, key0 = tile * 128 + 4 * lane, tile * 128 + lane // 4 * 16 + 2 * (lane % 4)
                    keys = [key0 + (j & 1) + 8 * (j >> 1) for j in range(4)]
                    words = [[int.from_bytes(bytes(rows[key, column + 4 * w:column + 4 * w + 4]), "little")
                              if key < n else 0 for w in range(4)] for key in keys]
                    for w in range(4):
                        a, b_, c, d_ = (words[j][w] for j in range(4))
                        ab_lo, ab_hi = byte_perm(a, b_, 0x5140), byte_perm(a, b_, 0x7362)
                        cd_lo, cd_hi = byte_perm(c, d_, 0x5140), byte_perm(c, d_, 0x7362)
                        t = [byte_perm(ab_lo, cd_lo, 0x5410), byte_perm(ab_lo, cd_lo, 0x7632),
                             byte_perm(ab_hi, cd_hi, 0x5410), byte_perm(ab_hi, cd_hi, 0x7632)]
                        for i in range(4):
                            out[bh // h, bh % h, column + 4 * w + i, column0:column0 + 4] = list(t[i].to_bytes(4, "little"))
    return out


def test_byte_perm_model_is_cudas():
    assert byte_perm(0x03020100, 0x07060504, 0x5140) == 0x05010400
    assert byte_perm(0x03020100, 0x07060504, 0x7632) == 0x07060302


@pytest.mark.parametrize("n,d", [(130, 32), (77, 16), (256, 48)])
def test_the_v_transpose_kernel_writes_its_twins_bytes(n, d):
    """The kernel's lanes (each four keys of one 16-key group, 16 of V's columns a warp) and its
    4 x 4 byte transposes, modelled lane by lane, give fp8_inputs.transposed_v byte for byte:
    keys in P's register order, zeros past N (the GPU test runs the kernel itself)."""
    v = np.random.default_rng(n).integers(1, 256, (2, 1, n, d)).astype(np.uint8)
    np.testing.assert_array_equal(v_transpose_kernel_model(v), transposed_v(v))


def test_v_transposed_from_torch_float8_keeps_its_bytes():
    torch = pytest.importorskip("torch")
    v = torch.randn(1, 2, 70, 128).to(torch.float8_e4m3fn)
    vt = transposed_v(v)
    assert vt.dtype == torch.float8_e4m3fn and vt.shape == (1, 2, 128, 128) and vt.is_contiguous()
    np.testing.assert_array_equal(vt.view(torch.uint8).numpy(), transposed_v(v.view(torch.uint8).numpy()))


def test_each_descale_is_read_through_its_own_strides():
    """None reads a kept 1, a number one float32, a [B, Hkv] array its own elements at its own
    strides (a transposed view too): a kernel reads descale[b * sb + h * sh]."""
    b, hkv = 2, 3
    per_head = np.arange(6, dtype=np.float32).reshape(hkv, b).T  # strides (1, 2): not contiguous
    views = descale_views(None, 0.5, per_head, b, hkv, np.zeros(1))
    assert list(views) == ["q_descale", "k_descale", "v_descale"]
    assert views["q_descale"][1:] == (0, 0) and views["k_descale"][1:] == (0, 0) and views["v_descale"][1:] == (1, 2)
    assert all(array.dtype == np.float32 for array, _, _ in views.values())
    for (array, sb, sh), want in zip(views.values(), (np.ones((b, hkv)), np.full((b, hkv), 0.5), per_head)):
        flat = np.lib.stride_tricks.as_strided(array, (array.size,), (4,))  # its memory, in order
        got = [[flat[i * sb + h * sh] for h in range(hkv)] for i in range(b)]
        np.testing.assert_array_equal(got, want)
    again = descale_views(None, None, None, b, hkv, np.zeros(1), names=("k_descale", "v_descale"))
    assert list(again) == ["k_descale", "v_descale"]  # an FP8 KV cache's: q's is not built
    assert again["k_descale"][0] is views["q_descale"][0]  # one kept 1


def test_a_prepared_call_keeps_its_descales_values():
    given = np.ones((2, 3), np.float32)
    kept = prepared_copy(given)
    given[:] = 7
    assert (kept == 1).all() and prepared_copy(0.5) == 0.5 and prepared_copy(None) is None


@pytest.mark.parametrize("shape", [(3,), (2, 3, 1), (3, 2)])
def test_a_descale_of_another_shape_is_refused_by_name(shape):
    with pytest.raises(ValueError, match=r"k_descale: shape .*\[B, Hkv\] = \[2, 3\]"):
        descale_views(None, np.ones(shape, np.float32), None, 2, 3, np.zeros(1))


def test_the_fp8_kernel_reads_fp8_and_writes_its_out_dtype():
    spec = load_spec(SPEC)
    source = render(spec)
    assert spec.element.is_fp8 and spec.out_element.name == "bfloat16"
    assert source.count("wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3") == 1  # Q.K^T over 192 keys
    assert source.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 1  # P.V over head_dim
    assert "cvt.rn.satfinite.e4m3x2.f32" in source and "cvt.rn.bf16x2.f32" in source
    assert "typedef unsigned short out_t;" in source and "typedef unsigned char elem_t;" in source
    assert "m_use - P_LOG2_SCALE" in source and "- P_LOG2_SCALE) * LN2" in source  # P's 2^8, out of the LSE
    assert ("q_descale[b * q_descale_sb + h_kv * q_descale_sh] * k_descale[b * k_descale_sb + h_kv * k_descale_sh]"
            in source and "v_descale[b * v_descale_sb + h_kv * v_descale_sh]" in source)


@pytest.mark.parametrize("change,field", [
    ({"out_dtype": None}, "out_dtype"),
    ({"out_dtype": "float8_e5m2"}, "out_dtype"),  # (e4m3 is an output type: tests/test_fp8_output.py)
    ({"arch": "sm_80", "pipeline": {"kv_smem": "separate", "stages": 2}}, "arch"),
    ({"head_dim": 64}, "head_dim"),
    ({"tiling": {"block_q": 128, "block_kv": 176, "warps_q": 8, "warps_kv": 1}}, "tiling.block_kv"),
    ({"sequences": {"q": "varlen", "kv": "paged"}}, "sequences"),
    ({"sequences": {"q": "varlen", "kv": "varlen", "seqused_k": True}}, "sequences"),
    ({"sequences": {"q": "padded", "kv": "ranged"}}, "sequences"),
])
def test_what_the_fp8_forward_is_not_built_for_is_refused_by_field(change, field):
    data = load_spec(SPEC).model_dump(mode="json", exclude_none=True)
    data.update(change)
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(SpecError, match=rf"{field} = "):
        parse_spec(data, "fp8_refused")


@pytest.mark.parametrize("mask", [None, {"kind": "causal"}])
def test_a_varlen_fp8_forward_reads_v_t_a_sequence_at_a_time_and_compiles_without_spills(mask):
    """Varlen q and K/V: K's rows start at cu_seqlens_k[b] in the one [1, Hkv, total, d] map, V^T's
    at key 0 of sequence b (fagen.runtime.v_transposed pads each sequence's keys apart)."""
    from fagen import nvcc
    from fagen.dispatch import call_mask
    from fagen.plan import plan
    from fagen.variants import fp8_spec, sequence_variant

    spec = sequence_variant(fp8_spec("float8_e4m3", 128, call_mask(False, mask), ScoreMod()), "varlen", "varlen")
    source = render(spec)
    assert "smem_q_u32, q_start + q0, 0," in source
    assert "kv_start, 0, h, h_kv, b" in source  # K at the sequence's rows of batch 0, V^T at sequence b
    assert "{{" not in source and "h_kv, v_batch);" in source
    # O's bfloat16 rows are twice Q's e4m3 ones: never staged through the Q tile (a block a tile, too)
    assert not plan(spec).output_staged and "st_global_v4(out" in source
    (resources,) = nvcc.compile_many([(spec, "sm_90a")])
    assert resources.spill_stores == 0 and resources.spill_loads == 0 and not resources.wgmma_serialized


def test_a_sink_joins_the_fp8_denominator_at_p_s_scale():
    """P is 2^8 exp2(s - m) over the keys' own max; the sink's term joins l at the same scale."""
    data = load_spec(SPEC).model_dump(mode="json", exclude_none=True)
    data.update(score_mod={"sinks": True}, mask={"kind": "causal"})
    source = render(parse_spec(data, "fp8_sinks"))
    assert "fast_exp2(sink_log2 - m_new + P_LOG2_SCALE)" in source


def test_the_oracle_rounds_p_over_the_keys_max_where_a_sink_dominates():
    """FP8's P is rounded as the kernel rounds it, relative to the keys' own max, not to a larger
    sink's: a sink 30 above every score leaves P's relative rounding error as it was (rounding
    relative to the sink would flush P to zero: an error of 1)."""
    from fagen import oracle
    from fagen.check import relative_error

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 64, 128)) for _ in range(3))
    sinks = np.array([30.0, 30.0])
    exact = oracle.attention(q, k, v, sinks=sinks)
    rounded = oracle.attention(q, k, v, sinks=sinks, p_type="float8_e4m3", p_scale=256.0)
    assert 1e-3 < relative_error(rounded, exact) < 0.1


def test_padded_keys_are_whole_v_tiles():
    assert [fp8_inputs.padded_keys(n) for n in (1, 128, 129, 4096)] == [128, 128, 256, 4096]


def test_the_v_transpose_kernel_compiles_without_spills():
    from fagen.nvcc import _ptxas
    from fagen.rendering import V_TRANSPOSE, shared_kernels

    status, log = _ptxas(f"{V_TRANSPOSE}.cu", shared_kernels()[f"{V_TRANSPOSE}.cu"], "sm_90a")
    assert status == 0, log
    assert "0 bytes spill stores, 0 bytes spill loads" in log and "0 bytes stack frame" in log


@pytest.mark.parametrize("mask,score_mod", [
    (None, {}), ({"kind": "causal"}, {}), ({"kind": "sliding_window", "window_left": 256}, {}),
    ({"kind": "chunked", "chunk_size": 1024}, {}), ({"kind": "causal"}, {"softcap": 30.0}), ({"kind": "prefix_lm", "prefix_len": 100}, {"alibi": "slopes"}),
    ({"kind": "causal"}, {"sinks": True}),
    # what fagen.attention's FP8 path takes since it passes ALiBi slopes and biases: a bias (either
    # kind) and ALiBi with softcap take 128-key tiles, the register model's fit
    (None, {"bias": "vector"}), ({"kind": "causal"}, {"bias": "matrix"}), (None, {"alibi": "slopes", "softcap": 30.0}),
    # masks read from arrays: documents take 128-key tiles (MaskKind.kv_tile), as windows do;
    # block masks 192
    ({"kind": "document", "causal": True}, {"sinks": True}), ({"kind": "block_mask"}, {})])
def test_fagen_attention_s_fp8_variants_compile_without_spills(mask, score_mod):
    from fagen import nvcc
    from fagen.dispatch import call_mask
    from fagen.spec import ScoreMod
    from fagen.variants import fp8_spec

    spec = fp8_spec("float8_e4m3", 128, call_mask(False, mask), ScoreMod(**score_mod))
    # (softcap's tanh and its derivative's registers: the register estimate's fallback, 128 keys;
    # documents, windows and chunks: their kind's tile)
    narrow = "softcap" in score_mod or "bias" in score_mod or \
        (mask or {}).get("kind") in ("document", "sliding_window", "chunked")
    assert spec.element.is_fp8 and spec.tiling.block_kv == (128 if narrow else 192)
    assert spec.out_dtype == "bfloat16"
    (resources,) = nvcc.compile_many([(spec, "sm_90a")])
    assert resources.spill_stores == 0 and resources.spill_loads == 0 and not resources.wgmma_serialized


@pytest.mark.parametrize("mask", [None, {"kind": "causal"}])
def test_fagen_attention_s_d256_fp8_variants_keep_their_registers_and_compile_without_spills(mask):
    """d256's 128 x 128 tiles hold 240 registers a consumer thread: the causal variant walks its
    tiles statically (every gridDim.x-th), since a claiming producer's 32 registers would leave its
    two consumer warpgroups 232 (plan.has_claimed_walk)."""
    from fagen import nvcc
    from fagen.dispatch import call_mask
    from fagen.plan import plan
    from fagen.spec import ScoreMod
    from fagen.variants import fp8_spec

    spec = fp8_spec("float8_e4m3", 256, call_mask(False, mask), ScoreMod())
    kernel_plan = plan(spec)
    assert spec.tiling.block_kv == 128 and kernel_plan.persistent and not kernel_plan.claimed_walk
    assert (kernel_plan.producer_registers, kernel_plan.consumer_registers) == (24, 240)
    (resources,) = nvcc.compile_many([(spec, "sm_90a")])
    assert resources.spill_stores == 0 and resources.spill_loads == 0 and not resources.wgmma_serialized


@pytest.mark.parametrize("block_kv,boxes", [(160, 2), (224, 2)])  # (192, the shipped tile: compiled above)
def test_an_fp8_tile_past_one_v_t_box_loads_whole_boxes_and_compiles_without_spills(block_kv, boxes):
    """A key tile that is no whole number of V^T's 128-key boxes: S is m64n<block_kv>, V^T lands in
    whole boxes (the ring's slots as long as they), P.V steps from one box to the next."""
    from fagen import nvcc
    from fagen.plan import plan

    data = load_spec(SPEC).model_dump(mode="json", exclude_none=True)
    data["tiling"]["block_kv"] = block_kv
    spec = parse_spec(data, f"fp8_kv{block_kv}")
    kernel_plan, source = plan(spec), render(spec)
    assert kernel_plan.v_key_boxes == boxes and kernel_plan.v_load_bytes == boxes * 128 * spec.dv
    assert kernel_plan.kv_tile_bytes == max(block_kv, boxes * 128) * spec.head_dim
    assert f"m64n{block_kv}k32.f32.e4m3.e4m3" in source and f"constexpr int V_KEY_BOXES = {boxes};" in source
    (resources,) = nvcc.compile_many([(spec, "sm_90a")])
    assert resources.spill_stores == 0 and resources.spill_loads == 0


def test_fagen_attention_refuses_what_its_fp8_path_does_not_take_before_the_gpu(monkeypatch):
    torch = pytest.importorskip("torch")
    from fagen import dispatch
    from fagen.torch_op import attention

    monkeypatch.setattr(dispatch.device, "cupy", None)  # (no GPU to fill: the FP8 forward's shapes stay its own)

    q8 = torch.zeros((1, 2, 64, 128)).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="q_descale, k_descale, v_descale: for float8_e4m3fn or float8_e5m2 .* q is torch.bfloat16"):
        attention(q8.to(torch.bfloat16), q8.to(torch.bfloat16), q8.to(torch.bfloat16), q_descale=2.0)
    # (a decode step's rows, 64 a KV head or fewer, run on the FP8 cache's kernels, which take key
    # ranges, and so do more rows where the cache's chunks take them; on a GPU, more rows where the
    # forward would fill little of it: dispatch.fp8_on_cache_kernels)
    rows200 = torch.zeros((1, 2, 200, 128)).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="cache_seqlens: not with torch.float8_e4m3fn q, k, v"):  # documents: the forward's
        attention(rows200, rows200, rows200, cache_seqlens=torch.full((1,), 64, dtype=torch.int32),
                  doc_ids=torch.zeros((1, 200), dtype=torch.int32))
    with pytest.raises(ValueError, match="no backward yet"):  # a bias autograd records: the FP8 forward has none
        attention(q8, q8, q8, bias=torch.zeros(1, 2, 64, requires_grad=True))
    recorded_v = torch.zeros((1, 2, 64, 128), requires_grad=True).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"torch.float8_e4m3fn q, k, v \(the FP8 forward, a decode step\): no "
                                         r"backward yet; .* fp8=True"):  # (named as given, though q is widened)
        attention(q8, q8, recorded_v, causal=True)
    with pytest.raises(ValueError, match="head_dim 64: the FP8 forward is built for attn_e4m3_d128_sm90a, "
                                         "attn_e4m3_d256_sm90a"):
        attention(rows200[..., :64], rows200[..., :64], rows200[..., :64])


def test_fagen_attention_refuses_what_an_fp8_kv_cache_does_not_take_before_the_gpu():
    """A half-type q against FP8 k and v (an FP8 KV cache): q has no descale, there is no backward,
    k and v must share their FP8 type, and side inputs the path does not take are named."""
    torch = pytest.importorskip("torch")
    from fagen.torch_op import attention

    q = torch.zeros((1, 8, 1, 128), dtype=torch.bfloat16)
    k8 = torch.zeros((1, 2, 64, 128)).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="q_descale: q is torch.bfloat16, which has no descale"):
        attention(q, k8, k8, q_descale=2.0, k_descale=1.0)
    with pytest.raises(ValueError, match="no backward yet"):
        attention(q.clone().requires_grad_(), k8, k8)
    with pytest.raises(ValueError, match="k and v of one FP8 type"):
        attention(q, k8, k8.to(torch.float8_e5m2))
    with pytest.raises(ValueError, match="bias: not with q torch.bfloat16 against an FP8 KV cache"):
        attention(q, k8, k8, bias=torch.zeros(1, 8, 1, 64))


def stub_kernels(monkeypatch, torch, out_dtype=None) -> list:
    """runtime.compile_kernel replaced by a stub returning ones (bfloat16, or out_dtype) and a zero
    LSE; the (spec, keywords) of each launch it is asked for, in the list returned."""
    from fagen import runtime

    calls = []

    def kernel_of(spec):
        def run(q, k, v, **kw):
            calls.append((spec, kw))
            b, h, n, _ = q.shape
            out = torch.ones((b, h, n, v.shape[-1]), dtype=torch.bfloat16).to(out_dtype or torch.bfloat16)
            return out, torch.zeros((b, h, n))
        return run

    monkeypatch.setattr(runtime, "compile_kernel", kernel_of)
    return calls


def test_a_compiled_model_calls_the_fp8_forward_through_its_op(monkeypatch):
    """torch.compile(fullgraph=True) traces fagen.attention on float8 tensors into
    fagen::fp8_attention_forward (its fake gives bfloat16 out and float32 lse), and the op runs
    the FP8 spec's kernel with the mask, softcap and descales. The kernel is stubbed (no GPU)."""
    torch = pytest.importorskip("torch")
    from fagen import api

    calls = stub_kernels(monkeypatch, torch)
    q8 = torch.zeros((1, 2, 200, 128)).to(torch.float8_e4m3fn)  # (more rows than a decode step's)
    descale = torch.full((1, 2), 0.5)

    @torch.compile(fullgraph=True, backend="eager")
    def layer(q, k, v):
        return api.attention(q, k, v, causal=True, softcap=30.0, q_descale=descale, k_descale=descale, v_descale=2.0)

    out = layer(q8, q8, q8)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 2, 200, 128)
    (spec, kw), = calls
    assert spec.element.is_fp8 and spec.mask.kind == "causal" and spec.score_mod.softcap == 30.0
    assert kw["q_descale"] is not None and float(kw["v_descale"]) == 2.0 and kw["return_lse"]


def test_a_compiled_model_asks_the_fp8_forward_for_an_e4m3_output_through_its_op(monkeypatch):
    """scale_o and return_amax under torch.compile(fullgraph=True): the op's fake gives an e4m3
    out and a float32 [1] amax, and the op runs the e4m3-output variant with scale_o and the amax
    it returns. The kernel is stubbed (no GPU)."""
    torch = pytest.importorskip("torch")
    from fagen import api

    calls = stub_kernels(monkeypatch, torch, out_dtype=torch.float8_e4m3fn)
    q8 = torch.zeros((1, 2, 200, 128)).to(torch.float8_e4m3fn)
    scale_o = torch.tensor([4.0])

    @torch.compile(fullgraph=True, backend="eager")
    def layer(q, k, v):
        return api.attention(q, k, v, causal=True, q_descale=0.5, scale_o=scale_o, return_amax=True)

    out, amax = layer(q8, q8, q8)
    assert out.dtype == torch.float8_e4m3fn and amax.shape == (1,) and amax.dtype == torch.float32
    (spec, kw), = calls
    assert spec.out_element.name == "float8_e4m3" and spec.name.endswith("_oe4m3")
    assert torch.equal(kw["scale_o"], scale_o) and kw["amax_o"] is not None and kw["amax_o"].shape == (1,)
    with pytest.raises(ValueError, match=r"return_amax=True: .*pass scale_o"):
        torch.ops.fagen.fp8_attention_forward(q8, q8, q8, None, None, None, None, None, None, None, "", False,
                                              None, None, None, True)


def test_a_compiled_model_passes_doc_ids_to_the_fp8_forward_and_refuses_a_block_mask(monkeypatch):
    """doc_ids beside FP8 tensors reach fagen::fp8_attention_forward under torch.compile, which
    derives the document variant; a block_mask (no tensor: no op carries it) is refused by name
    before anything runs. The kernel is stubbed (no GPU)."""
    torch = pytest.importorskip("torch")
    from fagen import api, masks

    calls = stub_kernels(monkeypatch, torch)
    q8 = torch.zeros((1, 2, 64, 128)).to(torch.float8_e4m3fn)
    ids = torch.from_numpy(masks.documents_of_lengths([24, 40]))

    @torch.compile(fullgraph=True, backend="eager")
    def layer(q, k, v, ids):
        return api.attention(q, k, v, causal=True, doc_ids=ids)

    assert layer(q8, q8, q8, ids).dtype == torch.bfloat16
    (spec, kw), = calls
    assert spec.element.is_fp8 and (spec.mask.kind, spec.mask.causal) == ("document", True) and "doc_ids" in kw
    block_mask = masks.sliding_window(64, 16, q_block=16, kv_block=16)
    with pytest.raises(Exception, match="block_mask with FP8 q, k, v: eager calls only"):
        torch.compile(lambda q: api.attention(q, q, q, block_mask=block_mask), fullgraph=True, backend="eager")(q8)
    assert len(calls) == 1


FP8_FORWARD_MASKS = [Mask(), Mask(kind="causal"), Mask(kind="causal", align="top_left"),
                     Mask(kind="sliding_window", window_left=256, window_right=16), Mask(kind="chunked", chunk_size=512),
                     Mask(kind="prefix_lm", prefix_len=100)]


@pytest.mark.parametrize("path", sorted(SPECS_DIR.glob("attn_e*_d*_sm90a.yaml")), ids=lambda p: p.stem)
def test_every_fp8_forward_derives_the_masks_and_modifiers_it_takes_and_refuses_the_rest_by_name(path):
    """What fagen.attention derives for FP8 q, k, v (variants.fp8_spec), for each shipped FP8
    forward, every mask kind of positions and the modifiers: head_dim 128 takes them all; 256's
    128 x 128 tile (240 registers a thread) takes no mask or causal, with sinks or no modifier (sinks
    hold no register through the loop), and refuses the rest naming a fix that runs. A plan rule that refuses one more (the d256 causal variant was,
    once causal forwards claimed their tiles) is caught here, not on the GPU."""
    from fagen.variants import fp8_spec

    base = load_spec(path)
    for mask in FP8_FORWARD_MASKS:
        for score_mod in (ScoreMod(), ScoreMod(softcap=30.0), ScoreMod(sinks=True)):
            if base.head_dim == 256 and (mask.kind not in ("none", "causal") or score_mod.softcap is not None):
                with pytest.raises(ValueError, match=rf"at head_dim 256 \(128 x 128 tiles at 240 registers a thread"
                                                     rf".*Pass bfloat16 q, k and v for it"):
                    fp8_spec(base.dtype, base.head_dim, mask, score_mod)
                continue
            spec = fp8_spec(base.dtype, base.head_dim, mask, score_mod)
            assert spec.element.is_fp8 and spec.mask == mask, (path.stem, mask, score_mod)


def test_fp8_true_runs_the_fp8_forward_where_the_routing_would_take_the_cache_s_chunks(monkeypatch):
    """fagen.attention(..., fp8=True) trains through the FP8 forward and the FP8 backward, which
    models that forward's rounding of P: its forward is the FP8 forward's kernel even at a shape
    whose FP8 q, k, v would run on the cache's chunk kernels (a low fill of an H200's 132 SMs).
    The kernel is stubbed (no GPU)."""
    torch = pytest.importorskip("torch")
    from fagen import dispatch, torch_op

    monkeypatch.setattr(dispatch.device, "cupy", object())
    monkeypatch.setattr(dispatch.device, "current_device", lambda: 0)
    monkeypatch.setattr(dispatch.device, "multiprocessors", lambda device: 132)
    shapes = ((1, 4, 300, 128), (1, 2, 300, 128), (1, 2, 300, 128))
    assert dispatch.fp8_on_cache_kernels(*shapes, "float8_e4m3", causal=True)  # FP8 tensors given: the chunks
    calls = stub_kernels(monkeypatch, torch)
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16) for shape in shapes)
    out, lse = torch_op._Fp8Quantized.apply(q, k, v, Mask(kind="causal"), None, False)
    (spec, kw), = calls
    assert spec.element.is_fp8 and spec.wgmma and not spec.fp8_kv and spec.mask.kind == "causal"
    assert kw["q_descale"].shape == (1, 2) and out.dtype == torch.bfloat16
