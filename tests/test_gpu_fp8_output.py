"""The FP8 forward's e4m3 output on the GPU (marked `gpu`; Hopper only): o = e4m3(O * scale_o),
saturated, and amax_o = max |O|, cuDNN's FP8 output.

Two bars. Against the same kernel writing float16 (the same main loop, so the same f32 O): each
e4m3 value is that O times scale_o rounded to nearest even and saturated, up to one e4m3 step
where float16's own rounding moved O across a midpoint (1 in 2^7 of an e4m3 step wide, so about
1% of values at most), and amax_o is max |O| to float16's rounding. Against the float64 oracle
that rounds P and the output as the kernel does: within twice that oracle's error against exact
attention of the FP8 values (tests/test_gpu_fp8.py's bar, with the output's rounding in it)."""

import numpy as np
import pytest

from fagen import oracle, variants
from fagen.check import in_a_cuda_graph, relative_error, to_numpy
from fagen.element_types import ELEMENT_TYPES
from fagen.runtime import compile_kernel
from fagen.spec import Mask, ScoreMod
from tests.test_gpu_fp8 import quantized

pytestmark = pytest.mark.gpu

E4M3 = ELEMENT_TYPES["float8_e4m3"]
NAN_BYTE = 0x7F  # e4m3fn's NaN: what the outputs are poisoned with before a launch


def poisoned(torch, shape):
    return torch.full(shape, NAN_BYTE, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)


def e4m3_step(x: np.ndarray) -> np.ndarray:
    """The distance from |x| to the next e4m3 value up: 2^(exponent - 3), normals and subnormals."""
    exponent = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** E4M3.min_exponent)))
    return np.exp2(exponent - E4M3.mantissa_bits)


CASES = [  # (dtype, head_dim, mask, score_mod, B, Hq, Hkv, Nq, Nk, scale_o: None for 448 / amax)
    ("float8_e4m3", 128, Mask(), ScoreMod(), 2, 4, 2, 384, 384, None),
    ("float8_e4m3", 128, Mask(kind="causal"), ScoreMod(), 1, 4, 2, 200, 333, None),  # rows past the last tile
    ("float8_e4m3", 128, Mask(kind="causal"), ScoreMod(softcap=30.0, sinks=True), 1, 4, 1, 700, 700, 1.0),
    # most values saturated at 448
    ("float8_e4m3", 128, Mask(kind="sliding_window", window_left=100), ScoreMod(), 1, 2, 2, 600, 600, 4000.0),
    ("float8_e5m2", 128, Mask(), ScoreMod(), 1, 4, 2, 512, 640, None),
    ("float8_e4m3", 256, Mask(kind="causal"), ScoreMod(), 2, 2, 2, 300, 300, None),
]


@pytest.mark.parametrize("dtype,d,mask,score_mod,b,hq,hkv,nq,nk,scale_o", CASES)
def test_an_fp8_output_is_the_scaled_output_rounded_and_amax_its_largest_magnitude(dtype, d, mask, score_mod, b, hq,
                                                                                   hkv, nq, nk, scale_o):
    torch = pytest.importorskip("torch")
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the FP8 kernel needs a Hopper GPU")
    plain = variants.fp8_spec(dtype, d, mask, score_mod)
    half = compile_kernel(variants.output_type_variant(plain, "float16"))
    scaled = compile_kernel(variants.output_type_variant(plain, "float8_e4m3"))
    rng = np.random.default_rng([d, b, hq, nq, nk])
    q8, qd = quantized(rng, (b, hq, nq, d), hkv, torch, scale=1.5, dtype=dtype)
    k8, kd = quantized(rng, (b, hkv, nk, d), hkv, torch, scale=1.5, dtype=dtype)
    v8, vd = quantized(rng, (b, hkv, nk, d), hkv, torch, scale=3.0, dtype=dtype)
    sinks = torch.from_numpy(rng.uniform(-2.0, 8.0, hq).astype(np.float32)).cuda() if score_mod.sinks else None
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd, sinks=sinks)
    reference = half(q8, k8, v8, out=torch.full((b, hq, nq, d), float("nan"), dtype=torch.float16, device="cuda"),
                     **descales)
    o = to_numpy(reference.float()).astype(np.float64)
    amax_ref = np.abs(o).max()
    scale_o = 448.0 / amax_ref if scale_o is None else scale_o
    out, amax = poisoned(torch, (b, hq, nq, d)), torch.full((1,), float("nan"), device="cuda")
    got = scaled(q8, k8, v8, out=out, scale_o=torch.tensor([scale_o], device="cuda"), amax_o=amax, **descales)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.float8_e4m3fn
    values = to_numpy(got.float()).astype(np.float64)
    assert np.isfinite(values).all()  # every element written (no NaN byte left), none overflowed
    expected = E4M3.round_saturated(o * scale_o)
    apart = np.abs(values - expected)
    assert (apart <= e4m3_step(expected) * 1.0001).all(), f"{apart.max():.3g} off"
    assert (apart > 0).mean() <= 0.01, f"{(apart > 0).mean():.2%} of values one step off"
    assert abs(amax.item() - amax_ref) <= amax_ref * 2.0 ** -10
    # against the oracle that rounds P and O as the kernel does
    qn, kn, vn = (to_numpy(x.float()) for x in (q8, k8, v8))
    numbers = dict(q_descale=to_numpy(qd), k_descale=to_numpy(kd), v_descale=to_numpy(vd),
                   sinks=None if sinks is None else to_numpy(sinks))
    keywords = dict(mask=plain.mask, score_mod=plain.score_mod, **numbers)
    exact = oracle.attention(qn, kn, vn, **keywords)
    rounded = oracle.attention(qn, kn, vn, p_type=plain.dtype, p_scale=2.0 ** plain.element.p_log2_scale, **keywords)
    modelled, oracle_amax = oracle.scaled_output(rounded, scale_o)
    bound = relative_error(modelled / scale_o, exact)
    assert relative_error(values / scale_o, exact) <= 2 * bound
    assert abs(amax.item() - oracle_amax) <= 0.05 * oracle_amax
    # without amax_o: the same values, nothing else written
    again = scaled(q8, k8, v8, scale_o=scale_o, **descales)
    assert torch.equal(again.view(torch.uint8), got.view(torch.uint8))


def test_fagen_attention_writes_e4m3_at_scale_o_and_returns_amax():
    """fagen.attention(..., scale_o=) on FP8 q, k, v: e4m3 out, amax_o last with return_amax, the
    same bytes eagerly, compiled with fullgraph=True and replayed in a CUDA graph; refused without
    FP8 inputs and for return_amax alone."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(5)
    q8, qd = quantized(rng, (2, 4, 256, 128), 2, torch)
    k8, kd = quantized(rng, (2, 2, 256, 128), 2, torch)
    v8, vd = quantized(rng, (2, 2, 256, 128), 2, torch)
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    half = fagen.attention(q8, k8, v8, causal=True, **descales)  # bfloat16 out
    amax_ref = half.float().abs().max().item()
    scale_o = torch.tensor([448.0 / amax_ref], device="cuda")
    out, lse, amax = fagen.attention(q8, k8, v8, causal=True, scale_o=scale_o, return_lse=True, return_amax=True,
                                     **descales)
    assert out.dtype == torch.float8_e4m3fn and lse.shape == (2, 4, 256) and amax.shape == (1,)
    assert abs(amax.item() - amax_ref) <= amax_ref * 2.0 ** -7  # bfloat16's rounding of the reference
    error = relative_error(to_numpy(out.float()) / scale_o.item(), to_numpy(half.float()))
    assert error <= 0.05, f"{error:.3f} from the bfloat16 output (e4m3's rounding: ~2.5e-2)"
    # a Python float for scale_o: the same bytes
    assert torch.equal(fagen.attention(q8, k8, v8, causal=True, scale_o=scale_o.item(), **descales).view(torch.uint8),
                       out.view(torch.uint8))

    def layer(q, k, v):
        return fagen.attention(q, k, v, causal=True, scale_o=scale_o, return_amax=True, **descales)

    compiled = torch.compile(layer, fullgraph=True)
    c_out, c_amax = compiled(q8, k8, v8)
    assert torch.equal(c_out.view(torch.uint8), out.view(torch.uint8)) and torch.equal(c_amax, amax)
    graph, (replayed, replayed_amax) = in_a_cuda_graph(lambda: compiled(q8, k8, v8))
    for x in (q8, k8, v8):
        x.copy_(quantized(rng, x.shape, 2, torch)[0])
    graph.replay()
    torch.cuda.synchronize()
    fresh, fresh_amax = layer(q8, k8, v8)
    assert torch.equal(replayed.view(torch.uint8), fresh.view(torch.uint8)) and torch.equal(replayed_amax, fresh_amax)

    with pytest.raises(ValueError, match=r"scale_o: an FP8 output is the FP8 forward's"):
        fagen.attention(half, half, half, scale_o=1.0)
    with pytest.raises(ValueError, match=r"return_amax=True: .*pass scale_o"):
        fagen.attention(q8, k8, v8, return_amax=True, **descales)
    with pytest.raises(ValueError, match=r"scale_o = -1.0: must be a positive finite number"):
        fagen.attention(q8, k8, v8, scale_o=-1.0, **descales)
    with pytest.raises(ValueError, match=r"scale_o: kernel .* writes o in bfloat16"):
        fagen.compile(variants.fp8_spec("float8_e4m3", 128, Mask(), ScoreMod()))(q8, k8, v8, scale_o=1.0)


def test_a_varlen_fp8_batch_writes_e4m3_at_scale_o():
    """fagen.attention_varlen(..., scale_o=, return_amax=True) on FP8 q, k, v: e4m3 rows written over
    NaN, within e4m3's rounding of the same batch's bfloat16 output, amax its largest magnitude;
    half-type inputs refused."""
    torch = pytest.importorskip("torch")
    import fagen

    rng = np.random.default_rng(9)
    hq, hkv, d, lengths = 4, 2, 128, [300, 1, 700, 129]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), device="cuda")
    total = int(cu[-1])
    q8, k8, v8 = (torch.from_numpy(rng.standard_normal((total, h, d)).astype(np.float32) * 40).cuda()
                  .to(torch.float8_e4m3fn) for h in (hq, hkv, hkv))
    descales = dict(q_descale=1 / 40, k_descale=1 / 40, v_descale=1 / 20)
    half = fagen.attention_varlen(q8, k8, v8, cu, cu, max(lengths), max(lengths), causal=True, **descales)
    amax_ref = half.float().abs().max().item()
    out = poisoned(torch, (total, hq, d))
    got, lse, amax = fagen.attention_varlen(q8, k8, v8, cu, cu, max(lengths), max(lengths), causal=True, out=out,
                                            return_lse=True, scale_o=400.0 / amax_ref, return_amax=True, **descales)
    assert got.data_ptr() == out.data_ptr() and lse.shape == (hq, total)
    values = got.float()
    assert torch.isfinite(values).all()
    error = relative_error(to_numpy(values) * amax_ref / 400.0, to_numpy(half.float()))
    assert error <= 0.05, f"{error:.3f} from the bfloat16 output (e4m3's rounding: ~2.5e-2)"
    assert abs(amax.item() - amax_ref) <= amax_ref * 2.0 ** -7
    with pytest.raises(ValueError, match=r"scale_o: an FP8 output is the FP8 forward's"):
        kv = half[:, :hkv].contiguous()
        fagen.attention_varlen(half, kv, kv, cu, cu, max(lengths), max(lengths), scale_o=1.0)
