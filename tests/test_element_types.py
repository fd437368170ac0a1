"""Element types (fagen.element_types): each type's NumPy rounding against an independent
rounding (NumPy's float16 cast; bfloat16's bit-level round-to-nearest-even of float32; FP8's
format limits), and the spec taking exactly the types with kernels."""

from __future__ import annotations

import numpy as np
import pytest

from fagen.element_types import (BFLOAT16, ELEMENT_TYPES, FLOAT8_E4M3, FLOAT8_E5M2, FLOAT16, FP8_KERNEL_TYPES, INPUT_TYPES,
                                 KERNEL_TYPES, element_type, itemsize)
from fagen.load import parse_spec
from fagen.spec import SpecError
from fagen.variants import shipped_spec


def _values(seed: int) -> np.ndarray:
    """Normals, subnormals and overflows of every format, and the specials."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(200_000) * 10.0 ** rng.integers(-12, 8, 200_000)
    return np.concatenate([x, [0.0, -0.0, np.inf, -np.inf, np.nan]])


def _same(a, b) -> bool:
    return bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def test_float16_rounds_as_numpy_casts():
    x = _values(1)
    with np.errstate(over="ignore"):
        assert _same(FLOAT16.round(x), x.astype(np.float16).astype(np.float64))


def test_bfloat16_rounds_as_float32_bits_round_to_nearest_even():
    x = _values(2).astype(np.float32)
    x = x[np.isfinite(x)]
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    assert _same(BFLOAT16.round(x.astype(np.float64)), rounded.astype(np.float64))


@pytest.mark.parametrize("t, cases", [
    # e4m3fn: 448 the largest, 464 the tie below it (even mantissa), 480 and past: NaN (no
    # infinity); 2^-9 the least subnormal, 2^-10 a tie to 0
    (FLOAT8_E4M3, {448.0: 448.0, 464.0: 448.0, 480.0: np.nan, -1e6: np.nan, 2.0 ** -9: 2.0 ** -9, 2.0 ** -10: 0.0,
                   1.0625: 1.0, 1.1875: 1.25}),
    # e5m2: 57344 the largest, 61440 the tie to infinity; 2^-16 the least subnormal
    (FLOAT8_E5M2, {57344.0: 57344.0, 61439.0: 57344.0, 61440.0: np.inf, 2.0 ** -16: 2.0 ** -16, 2.0 ** -17: 0.0,
                   1.125: 1.0, 1.375: 1.5}),
])
def test_fp8_formats_round_at_their_limits(t, cases):
    x = np.array(list(cases))
    assert _same(t.round(x), np.array(list(cases.values()))), t.round(x)


def test_every_value_a_format_holds_rounds_to_itself():
    for t in (FLOAT8_E4M3, FLOAT8_E5M2):  # all 256 codes, from the bit layout
        bias = 1 - t.min_exponent
        codes = np.arange(128)
        e, m = codes >> t.mantissa_bits, codes & ((1 << t.mantissa_bits) - 1)
        values = np.where(e == 0, m * 2.0 ** (t.min_exponent - t.mantissa_bits),
                          (1 + m / 2 ** t.mantissa_bits) * 2.0 ** (e - bias))
        finite = values[values <= t.max_finite]
        assert finite.size == (127 if t is FLOAT8_E4M3 else 124)  # e4m3fn: one NaN code; e5m2: 4 inf/NaN
        assert _same(t.round(finite), finite) and _same(t.round(-finite), -finite)


def test_types_are_found_by_every_spelling():
    assert element_type("float8_e4m3fn") is FLOAT8_E4M3 and element_type("bfloat16") is BFLOAT16
    assert itemsize("bfloat16") == 2 and itemsize("float8_e5m2") == 1 and itemsize("int32") == 4
    with pytest.raises(ValueError, match="fagen knows"):
        element_type("float4")


def test_the_spec_takes_exactly_the_types_with_kernels():
    base = shipped_spec("float16", 128, False, gpu=None).model_dump()
    for name in INPUT_TYPES:
        data = {**base, "dtype": name, "name": "t"}
        if name in KERNEL_TYPES:
            assert parse_spec(data, "t").element is ELEMENT_TYPES[name]
        elif name in FP8_KERNEL_TYPES:  # a kernel of its own: sm_90a's warp-specialized forward
            with pytest.raises(SpecError, match=f"arch = 'sm_80': the {name} forward runs on wgmma"):
                parse_spec(data, "t")
        else:
            with pytest.raises(SpecError, match=f"no kernel takes {name} yet.*float16 or bfloat16"):
                parse_spec(data, "t")
    assert all(ELEMENT_TYPES[n].tolerance and {"mma.sync", "wgmma"} <= set(ELEMENT_TYPES[n].mma_k) for n in KERNEL_TYPES)
