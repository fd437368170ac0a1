"""No spec that validates may fail to render, compile or spill: random specs near the rules' edges
(backward, pack_gqa, warps_kv, sequences, warp_specialized and outputs among them), with a fixed
seed and a bounded budget: every kernel a valid spec renders, for one of the archs it allows
(the long run, `python3 -m tests.spec_fuzz`, compiles every arch)."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

from fagen.spec import SpecError
from fagen.load import parse_spec
from tests.spec_fuzz import specs, try_spec

SEED, COUNT = 20261122, 240  # 36 of them validate (FP8 types drawn since): ~20 s of nvcc on two cores


def test_random_specs_validate_only_if_they_compile_without_spills():
    data = specs(SEED, COUNT)
    valid = []
    for d in data:
        try:
            parse_spec(d)  # anything but a SpecError here is a bug of its own
        except SpecError:
            continue
        valid.append(d)
    assert len(valid) >= 20, "the generator drifted: too few specs validate to test anything"
    with ProcessPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        outcomes = list(pool.map(try_spec, valid, [False] * len(valid)))
    findings = [(d, o.problem) for d, o in zip(valid, outcomes) if o.problem]
    assert not findings, "\n".join(f"{p}\n  {d}" for d, p in findings[:5])


def test_a_validation_that_crashes_is_a_finding_not_an_abort(monkeypatch):
    """Bad input is refused by name (SpecError), never a crash: a validation that raises anything
    else is the fuzz's finding (the run goes on), as a mma.sync dK/dV table's missing price once was."""
    import tests.spec_fuzz as fuzz

    def crash(data):
        raise KeyError("mask_expression_head_one_warpgroup")

    monkeypatch.setattr(fuzz, "parse_spec", crash)
    outcome = fuzz.try_spec(specs(SEED, 1)[0], False)
    assert not outcome.refused and outcome.problem.startswith("validation raised KeyError")
