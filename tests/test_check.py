"""fagen.check without a GPU: the error measure, the pass rule and the side inputs it draws."""

import math

import numpy as np
import pytest

import fagen
from fagen import side_inputs
from fagen.check import LSE_TOLERANCE, OUT_TOLERANCE, CheckResult, random_extras, relative_error
from fagen.load import SPECS


def test_relative_error_is_a_norm_ratio():
    ref = np.array([3.0, 4.0])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(ref + [0.0, 0.5], ref) == pytest.approx(0.1)


@pytest.mark.parametrize(("out", "ref"), [
    ([np.nan, 1.0], [1.0, 1.0]),  # an unwritten (NaN-poisoned) element never passes
    ([-np.inf, 1.0], [0.0, 1.0]),  # an empty row where there should be a value
    ([0.0, 1.0], [-np.inf, 1.0]),  # a value where the row should be empty
    ([np.inf, 1.0], [-np.inf, 1.0]),
])
def test_nan_and_misplaced_infinities_are_infinite_errors(out, ref):
    assert relative_error(np.array(out), np.array(ref)) == math.inf


def test_matching_infinities_compare_the_rest():
    assert relative_error(np.array([-np.inf, 2.0]), np.array([-np.inf, 2.0])) == 0.0


def test_a_result_passes_only_within_both_tolerances():
    shape = (1, 2, 2, 8, 8)
    assert CheckResult("k", shape, OUT_TOLERANCE["float16"], LSE_TOLERANCE, OUT_TOLERANCE["float16"]).passed
    assert not CheckResult("k", shape, 1.01 * OUT_TOLERANCE["float16"], 0.0, OUT_TOLERANCE["float16"]).passed
    assert not CheckResult("k", shape, 0.0, 2 * LSE_TOLERANCE, OUT_TOLERANCE["float16"]).passed
    assert "FAIL" in CheckResult("k", shape, math.inf, 0.0, 1e-3).summary()


@pytest.mark.parametrize("path", sorted(SPECS.glob("*.yaml")), ids=lambda p: p.stem)
def test_drawn_side_inputs_are_what_the_kernel_takes(path):
    """random_extras draws exactly the arrays a spec needs, in shapes the shared rules accept."""
    spec = fagen.load_spec(path)
    b, hq, n = 2, 4, 97
    extras = random_extras(spec, b, hq, n, n, seed=0)
    side_inputs.require_mask_inputs(spec.mask.kind, has_block_mask="block_mask" in extras,
                                    has_doc_ids="doc_ids" in extras)
    side_inputs.check_shapes(b, hq, n, n, bias_kind=None if spec.score_mod.bias == "none" else spec.score_mod.bias,
                             **{k: np.shape(v) for k, v in extras.items() if k != "block_mask"})
    wanted = {"bias": spec.score_mod.bias != "none", "alibi_slopes": spec.score_mod.alibi == "slopes",
              "sinks": spec.score_mod.sinks, "doc_ids": spec.mask.kind == "document",
              "block_mask": spec.mask.kind == "block_mask"}
    assert set(extras) == {k for k, want in wanted.items() if want}
    if "sinks" in extras:
        side_inputs.check_finite("sinks", extras["sinks"].tolist())


def test_the_timing_hold_compiles(tmp_path):
    """The kernel time_ms queues its timed calls behind (CuPy compiles it on first use)."""
    import subprocess

    from fagen.check import HOLD
    from fagen.nvcc import find_nvcc

    source = tmp_path / "hold.cu"
    source.write_text(HOLD)
    subprocess.run([find_nvcc(), "-cubin", "-arch=sm_80", "-o", str(tmp_path / "hold.cubin"), str(source)],
                   check=True, capture_output=True)
    assert (tmp_path / "hold.cubin").stat().st_size > 0
