"""scripts/fp8_backward_accuracy.py's model of an FP8 backward's roundings (notes/fp8_backward.md),
on a small case: what it concludes holds, so the note's choice rests on a checked computation."""

import importlib.util
from pathlib import Path

import numpy as np

from fagen import oracle

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fp8_backward_accuracy.py"


def _script():
    spec = importlib.util.spec_from_file_location("fp8_backward_accuracy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_with_no_rounding_the_kernel_model_is_the_oracle_s_backward():
    f = _script()
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((1, 2, 96, 64)) for _ in range(4))
    exact = lambda x: x  # noqa: E731
    got = f.gradients(q, k, v, dout, True, exact, p_round=exact, dout_round=exact, inputs_round=exact)
    want = oracle.attention_backward(q, k, v, dout, causal=True)
    for name in ("dq", "dk", "dv"):
        assert np.allclose(got[name], want[name], rtol=1e-10, atol=1e-12), name


def test_per_tile_rounding_keeps_each_tile_s_largest_value_and_its_relative_precision():
    """A tile's amax lands on e4m3's largest (exact); every element within half an ulp of 3
    mantissa bits, or of the subnormal step (2^-9 of the scale) below e4m3's normals."""
    f = _script()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 1, 130, 200)) * np.exp(rng.uniform(-3, 3, (1, 1, 130, 1)))
    rounded = f.per_tile(x, f.E4M3, 64, 128)
    assert rounded.shape == x.shape
    for i in range(0, 130, 64):
        for j in range(0, 200, 128):
            tile, got = x[..., i:i + 64, j:j + 128], rounded[..., i:i + 64, j:j + 128]
            scale = np.abs(tile).max() / f.E4M3.max_finite
            assert np.isclose(np.abs(got).max(), np.abs(tile).max(), rtol=1e-12)
            assert np.all(np.abs(got - tile) <= 2.0 ** -4 * np.abs(tile) + 2.0 ** -10 * scale)


def test_the_backward_s_own_roundings_rank_as_the_note_says():
    """dS in e5m2 costs more than in e4m3 (both scaled a tile); dS in bf16 is an order under
    either; P's rounding reaches dV alone; bf16's whole error is an order under FP8's."""
    f = _script()
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((1, 2, 256, 64)) for _ in range(4))
    table = f.parts(q, k, v, dout, True)
    dq = {name: row[0] for name, row in table.items()}
    assert dq["dS e5m2"] > 1.5 * dq["dS e4m3"] > 15 * dq["dS bf16"]
    assert table["P e4m3"][0] < 1e-12 < 1e-2 < table["P e4m3"][2]
    assert 10 * max(table["bf16: P, dS, dO"]) < min(table["e4m3: P, dS, dO"])


def test_the_scales_a_kernel_can_use_cost_what_the_tile_model_does():
    """dO scaled a head (dV sums every step in place) and dS for dK scaled a key and step by powers
    of two (dK's rows rescaled exactly as the scale moves): the gradients' errors stay within 20%
    of the per-tile model's, and dS's rounding for dK reaches dK alone."""
    f = _script()
    rng = np.random.default_rng(4)
    q, k, v, dout = (rng.standard_normal((1, 2, 256, 64)) for _ in range(4))
    table = f.parts(q, k, v, dout, True)
    for ideal, real in zip(table["e4m3: P, dS, dO"], table["kernel's scales"]):
        assert real < 1.2 * ideal
    assert max(table["dO e4m3 a head"]) < 1.2 * max(table["dO e4m3"])
    only_dk = table["dS e4m3 for dK a key and step"]
    assert only_dk[0] < 1e-12 and only_dk[2] < 1e-12 and 1e-2 < only_dk[1] < 1.2 * table["dS e4m3"][1]
