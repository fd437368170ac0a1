"""The backward: section on the CPU: its validation (field, value, rule, fix), the plan's numbers
for both dQ strategies, what each renders, and the tilings fagen.variants.trainable picks."""

from __future__ import annotations

import pytest

import fagen
from fagen.spec import Mask, ScoreMod
from fagen import variants
from fagen.backward_plan import backward_plan, kernel_symbols
from fagen.load import SPECS
from fagen.plan import MBARRIER_BYTES, SWIZZLE_ATOM_BYTES
from fagen.render import render_backward
from tests.conftest import rejected

HOPPER = fagen.load_spec(SPECS / "attn_f16_d128_causal_h200.yaml")  # wgmma backward, atomic dQ


def hopper(**backward) -> dict:
    data = HOPPER.model_dump()
    data["backward"] = {**data["backward"], **backward}
    return data


# ---- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("backward, field, fix", [
    ({"block_q": 128}, "backward.block_q = 128", "use block_q: 64, or deterministic: true"),
    ({"block_q": 32}, "backward.block_q = 32", "use block_q: 64, or deterministic: true"),
    ({"warps": 4, "block_kv": 64}, "backward.block_q = 64", "use warps: 8 and block_kv: 128, or deterministic: true"),
])
def test_atomic_dq_needs_whole_tiles_per_warpgroup(backward, field, fix):
    message = rejected(hopper(**backward))
    assert field in message and "64 x 64 tile of a step's dQ" in message and fix in message


def test_deterministic_lifts_the_atomic_rule():
    spec = fagen.parse_spec(hopper(block_q=32, deterministic=True))
    assert spec.wgmma_backward and not spec.atomic_dq


def test_head_dim_64_takes_one_or_two_query_atoms():
    data = fagen.load_spec(SPECS / "attn_bf16_d64_h200.yaml").model_dump()
    for block_q, split in ((64, 2), (128, 1)):
        data["backward"] = {**data["backward"], "block_q": block_q}
        dkdv = backward_plan(fagen.parse_spec(data)).dkdv
        assert (dkdv.dq_tiles, dkdv.dq_key_split) == (2 // split, split)  # two warpgroups either way


@pytest.mark.parametrize("backward, field", [
    ({"warps": 6}, "backward.warps = 6"),
    ({"stages": 1}, "backward.stages = 1"),
    ({"dq_warps": 2, "dq_block_q": 32, "deterministic": True}, "dq_block_q 32, dq_warps 2"),
    ({"block_kv": 256}, "block_kv 256, warps 8"),
])
def test_wgmma_backward_rules_name_the_field(backward, field):
    assert field in rejected(hopper(**backward))


def test_expression_without_derivative_is_refused_at_validation():
    data = hopper()
    data["score_mod"] = {"expression": "score * 0.5"}
    assert "score_mod.expression_grad" in rejected(data)


# ---- the plan ----------------------------------------------------------------------------------

def test_atomic_plan_lays_ds_buffers_after_the_ring():
    bwd = HOPPER.backward
    plan = backward_plan(HOPPER)
    dkdv = plan.dkdv
    ring_end = 2 * dkdv.kv_tile_bytes + bwd.stages * dkdv.stage_bytes + 2 * bwd.stages * MBARRIER_BYTES
    assert dkdv.ds_offset % SWIZZLE_ATOM_BYTES == 0 and ring_end <= dkdv.ds_offset < ring_end + SWIZZLE_ATOM_BYTES
    assert dkdv.ds_tile_bytes == bwd.block_kv * bwd.block_q * 2
    assert dkdv.smem_bytes == dkdv.ds_offset + 2 * dkdv.ds_tile_bytes
    assert dkdv.dq_tiles * dkdv.dq_key_split == bwd.warps // 4
    assert dkdv.dq_key_steps * 16 * dkdv.dq_key_split == bwd.block_kv
    assert ("float* __restrict__", "dq_accum") in plan.dkdv_params
    assert kernel_symbols(plan) == {"preprocess": plan.preprocess_symbol, "dkdv": plan.dkdv_symbol,
                                    "postprocess": plan.postprocess_symbol}


def test_deterministic_plan_has_a_dq_kernel_and_no_accumulator():
    plan = backward_plan(fagen.parse_spec(hopper(deterministic=True)))
    assert not plan.atomic_dq and plan.dkdv.ds_tile_bytes == 0
    assert "dq_accum" not in {name for _, name in plan.dkdv_params}
    assert set(kernel_symbols(plan)) == {"preprocess", "dkdv", "dq"}


# ---- rendering ---------------------------------------------------------------------------------

def test_atomic_backward_renders_a_postprocess_instead_of_the_dq_kernel():
    source = render_backward(HOPPER)
    assert "namespace postprocess" in source and "namespace dq " not in source
    assert "red.global.add.v2.f32" in source and "issue_dq(" in source


def test_deterministic_backward_renders_no_atomics():
    source = render_backward(fagen.parse_spec(hopper(deterministic=True)))
    assert "namespace dq " in source and "namespace postprocess" not in source
    assert "red.global.add" not in source and "dq_accum" not in source


def test_block_mask_backward_walks_key_major_steps():
    base = variants.shipped_spec("float16", 128, False, gpu="h200")
    spec = variants.trainable(variants.variant(base, Mask(kind="block_mask"), ScoreMod()))
    source = render_backward(spec)
    assert "idx[t] / q_tiles" in source and "mask.steps()" in source


# ---- what fagen.attention trains with ----------------------------------------------------------

@pytest.mark.parametrize("head_dim, block_q", [(64, 128), (128, 64)])
def test_trainable_hopper_defaults_take_atomic_dq(head_dim, block_q):
    spec = variants.trainable(variants.shipped_spec("float16", head_dim, False, gpu="h200"))
    assert spec.atomic_dq and spec.backward.block_q == block_q


@pytest.mark.parametrize("head_dim", [64, 128])
def test_trainable_deterministic_is_its_own_spec(head_dim):
    base = variants.shipped_spec("float16", head_dim, True, gpu="h200")
    fast, exact = variants.trainable(base), variants.trainable(base, deterministic=True)
    assert fast.atomic_dq and not exact.atomic_dq and exact.backward.deterministic
    assert fast.name != exact.name and exact.name.endswith("_det")


def test_deterministic_changes_nothing_on_mma_sync():
    base = variants.shipped_spec("float16", 128, True, gpu=None)
    assert variants.trainable(base) == variants.trainable(base, deterministic=True)
    assert not variants.trainable(base).atomic_dq


def test_modifiers_that_do_not_fit_atomic_dq_fall_back_to_the_dq_kernel():
    base = variants.shipped_spec("float16", 128, True, gpu="h200")
    spec = variants.trainable(variants.variant(base, base.mask, ScoreMod(softcap=30.0)))
    assert spec.wgmma_backward and not spec.atomic_dq
