"""An FP8 forward's e4m3 output (cuDNN's: o = e4m3(O * scale_o), saturated, and amax_o = max |O|),
without a GPU: the spec's rule, the kernel's parameters and its store layout, the oracle's
rounding, the host's checks of scale_o and amax_o, and the kernels' registers."""

import numpy as np
import pytest

from fagen import fp8_inputs, oracle, variants
from fagen.element_types import ELEMENT_TYPES, FP8_KERNEL_TYPES, KERNEL_TYPES
from fagen.load import load_spec, parse_spec
from fagen.plan import plan
from fagen.rendering import render
from fagen.spec import Mask, ScoreMod, SpecError

E4M3 = ELEMENT_TYPES["float8_e4m3"]


def test_the_element_types_name_the_fp8_output_and_keep_their_kernel_families():
    assert KERNEL_TYPES == ("float16", "bfloat16") and FP8_KERNEL_TYPES == ("float8_e4m3", "float8_e5m2")
    for name in FP8_KERNEL_TYPES:
        assert ELEMENT_TYPES[name].out_types[0] == "bfloat16" and "float8_e4m3" in ELEMENT_TYPES[name].out_types


@pytest.mark.parametrize("dtype", FP8_KERNEL_TYPES)
def test_an_fp8_forward_takes_an_e4m3_output_with_its_scale_and_amax(dtype):
    spec = variants.output_type_variant(variants.fp8_spec(dtype, 128, Mask(kind="causal"), ScoreMod()), "float8_e4m3")
    assert spec.name.endswith("_oe4m3") and spec.out_element is E4M3
    kernel = plan(spec)
    names = [name for _, name in kernel.input_params]
    assert names[-2:] == ["scale_o", "amax_o"] and not kernel.output_staged
    plain = plan(variants.fp8_spec(dtype, 128, Mask(kind="causal"), ScoreMod()))
    assert "scale_o" not in [name for _, name in plain.input_params]
    source = render(spec)
    assert "atomicMax(reinterpret_cast<unsigned*>(amax_o)" in source and "pack4_e4m3(a0 * scale_o" in source
    # o's bytes: q's own type where it is e4m3, else a byte of its own; no half-type pack is left
    assert ("typedef elem_t out_t" if dtype == "float8_e4m3" else "typedef unsigned char out_t") in source
    assert "unsigned pack2(" not in source
    # the same spec writing bfloat16 renders as before: no output scale reaches it
    assert "scale_o" not in render(variants.fp8_spec(dtype, 128, Mask(kind="causal"), ScoreMod()))


def test_an_output_type_is_named_as_fagen_or_torch_names_it():
    plain = variants.fp8_spec("float8_e4m3", 128, Mask(), ScoreMod())
    assert variants.output_type_variant(plain, "float8_e4m3fn") == variants.output_type_variant(plain, "float8_e4m3")
    assert variants.output_type_variant(plain, "bfloat16") is plain
    with pytest.raises(ValueError, match=r"dtype 'e4m3': fagen knows"):
        variants.output_type_variant(plain, "e4m3")


def test_a_half_type_forward_refuses_an_fp8_output_with_a_fix_that_validates():
    data = load_spec("specs/attn_bf16_d128.yaml").model_dump(mode="json", exclude_none=True)
    with pytest.raises(SpecError, match=r"out_dtype.*float8_e4m3.*remove out_dtype") as refused:
        parse_spec({**data, "out_dtype": "float8_e4m3"}, "test")
    fixed = {key: value for key, value in data.items() if key != "out_dtype"}
    assert parse_spec(fixed, "fixed").out_element.name == "bfloat16"
    assert "out_dtype" in str(refused.value)
    # e5m2 is no output type of the FP8 forward: the message lists those there are
    e4m3 = load_spec("specs/attn_e4m3_d128_sm90a.yaml").model_dump(mode="json", exclude_none=True)
    with pytest.raises(SpecError, match=r"writes o in bfloat16 or float16 or float8_e4m3.*use out_dtype: float8_e4m3"):
        parse_spec({**e4m3, "out_dtype": "float8_e5m2"}, "test")
    assert parse_spec({**e4m3, "out_dtype": "float8_e4m3"}, "fixed").out_element is E4M3


def quad_store(words: np.ndarray) -> np.ndarray:
    """The epilogue's FP8 store of one row's 8 fragments (64 columns), modelled: words[t, i, j] is
    byte j of lane t's word i before the quad transpose (fragments c + 2i, c + 2i + 1, their
    columns 2t, 2t + 1). Returns the 64 bytes the quad's four 16-byte stores write, in memory order."""
    # quad_transpose: lane t's word k after it is lane k's word t before
    moved = np.transpose(words, (1, 0, 2))
    row = np.zeros(64, dtype=words.dtype)
    for t in range(4):
        x = moved[t]  # [4 words, 4 bytes]

        def byte_perm(a, b, selector):  # __byte_perm: result byte n is byte (selector >> 4n) & 7 of {b:a}
            pool = np.concatenate([a, b])
            return np.array([pool[(selector >> (4 * n)) & 7] for n in range(4)])

        y = [byte_perm(x[0], x[1], 0x5410), byte_perm(x[2], x[3], 0x5410),
             byte_perm(x[0], x[1], 0x7632), byte_perm(x[2], x[3], 0x7632)]
        row[16 * t:16 * t + 16] = np.concatenate(y)  # st_global_v4 at column (c + 2t) * 8
    return row


def test_the_fp8_stores_put_each_column_where_it_belongs():
    """Lane t packs (fragment c + 2i, columns 2t, 2t + 1; fragment c + 2i + 1, the same columns)
    into word i, lowest byte first: after the transpose and the byte permutes, the quad's 64 bytes
    are the row's columns in order."""
    column = np.arange(64)
    words = np.zeros((4, 4, 4), dtype=int)
    for t in range(4):
        for i in range(4):
            a, b = 2 * i, 2 * i + 1  # the word's two fragments
            words[t, i] = [column[8 * a + 2 * t], column[8 * a + 2 * t + 1], column[8 * b + 2 * t],
                           column[8 * b + 2 * t + 1]]
    np.testing.assert_array_equal(quad_store(words), column)


def test_the_oracle_rounds_an_fp8_output_as_the_kernel_writes_it():
    out = np.array([[0.1, -1000.0, 3.3, np.nan, 1e-6, 240.0, -0.0]])
    values, amax = oracle.scaled_output(out, 2.0)
    np.testing.assert_array_equal(values[0, [1, 5]], [-448.0, 448.0])  # saturated, not NaN (cvt's .satfinite)
    assert values[0, 0] == E4M3.round(0.2) and values[0, 2] == E4M3.round(6.6) and np.isnan(values[0, 3])
    assert amax == 1000.0  # over its numbers: the kernel's fmaxf leaves a NaN out
    assert np.isnan(E4M3.round(1000.0))  # where the plain rounding (an input's: e4m3fn has no infinity) gives NaN


def test_scale_o_and_amax_o_are_checked_before_a_launch():
    like = np.zeros(1, dtype=np.float32)
    assert fp8_inputs.output_scale(None, like)[0] == 1.0
    assert fp8_inputs.output_scale(448.0 / 3, like)[0] == np.float32(448.0 / 3)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"scale_o = .*positive finite.*e\.g\. 448 / amax_o"):
            fp8_inputs.output_scale(bad, like)
    with pytest.raises(ValueError, match=r"scale_o: shape \(2,\); the output scale is one number"):
        fp8_inputs.output_scale(np.ones(2, dtype=np.float32), like)
    # host arrays and lists are numbers too: their values are checked
    assert fp8_inputs.output_scale([2.0], like)[0] == 2.0
    with pytest.raises(ValueError, match=r"scale_o = -3.0: must be a positive finite number"):
        fp8_inputs.output_scale(np.array(-3.0), like)
    amax = np.zeros(1, dtype=np.float32)
    assert fp8_inputs.output_amax(amax, like) is amax
    for bad in (np.zeros(1, dtype=np.float64), np.zeros(2, dtype=np.float32), 0.0):
        with pytest.raises(ValueError, match=r"amax_o: .*pass a float32 \[1\] tensor on q's device"):
            fp8_inputs.output_amax(bad, like)


def test_the_fp8_output_kernels_compile_without_spills():
    """What fagen.attention's scale_o runs: e4m3 and e5m2 q, k, v at head_dim 128 (dense, and
    causal with every modifier) and e4m3 at 256, and a varlen batch's kernel, writing e4m3; each
    within the registers and instructions of the same kernel writing bfloat16."""
    from fagen import nvcc

    cases = [("float8_e4m3", 128, Mask(), ScoreMod()),
             ("float8_e4m3", 128, Mask(kind="causal"),
              ScoreMod(softcap=30.0, alibi="slopes", bias="matrix", sinks=True)),
             ("float8_e5m2", 128, Mask(kind="sliding_window", window_left=100), ScoreMod()),
             ("float8_e4m3", 256, Mask(kind="causal"), ScoreMod())]
    plain = [variants.fp8_spec(*case) for case in cases]
    plain.append(variants.sequence_variant(plain[0], "varlen", "varlen", False))  # fagen.attention_varlen's
    scaled = [variants.output_type_variant(spec, "float8_e4m3") for spec in plain]
    results = nvcc.compile_many([(spec, "sm_90a") for spec in scaled + plain])
    for spec, got, before in zip(scaled, results, results[len(scaled):]):
        assert not (got.spill_stores or got.spill_loads or got.stack_frame), (spec.name, got)
        assert got.registers <= before.registers and got.instructions <= before.instructions * 1.05, (spec.name, got)
