"""The 192/128 backward (fagen.key_split) without a GPU: its plan fits shared memory and registers,
its kernels build for sm_90a without spills, and what it does not run is refused by name."""

import re

import pytest

from fagen import nvcc
from fagen.key_split_plan import KEY_SPLIT_TYPES, KeySplitBackwardPlan
from fagen.rendering import render_key_split_backward

SM90A_SMEM = 227 * 1024


@pytest.mark.parametrize("dtype", KEY_SPLIT_TYPES)
def test_the_plan_fits_k_v_two_stages_the_transposed_tiles_and_dq_s_staging(dtype):
    plan = KeySplitBackwardPlan(dtype)
    assert plan.stage_bytes == plan.block_q * (plan.head_dim + plan.value_dim) * 2  # Q's rows, then dO's
    assert plan.ring_at == plan.block_kv * (plan.head_dim + plan.value_dim) * 2  # after K and V
    assert plan.smem_bytes <= SM90A_SMEM < plan.smem_bytes + plan.stage_bytes  # two stages, a third does not fit
    # every swizzle atom starts aligned: K's and V's, each stage's Q and dO atoms, P^T, dS^T, and
    # warpgroup 1's key rows within K, V, P^T and dS^T (an 8-row group)
    for at in (plan.k_at, plan.v_at, plan.ring_at, plan.ring_at + plan.q_bytes, plan.ring_at + plan.stage_bytes,
               plan.pt_at, plan.dst_at, plan.kv_atom_bytes, plan.q_atom_bytes):
        assert at % plan.smem_align == 0
    assert plan.group_keys * plan.row_bytes % plan.row_group_bytes == 0
    # dK^T and dV^T of a warpgroup's 48 keys: 120 f32 registers a thread; S and dP 24 each; dQ 48
    assert (plan.head_dim + plan.value_dim) * plan.group_keys // 128 == 4 * plan.s_n_frags * (plan.qk_atoms + plan.v_atoms) == 120
    assert 4 * (plan.dq_wide_n_frags + plan.dq_narrow_n_frags) == plan.block_q * plan.dq_columns // 128 == 48
    # dQ's staging: a warp's pieces, all of a 64-row tile across the 8 consumer warps
    assert plan.consumer_threads // 32 * plan.dq_warp_bytes == plan.dq_tile_floats * 4
    assert plan.name == f"key_split_backward_{'bf16' if dtype == 'bfloat16' else 'f16'}_d192v128"


@pytest.mark.parametrize("dtype", KEY_SPLIT_TYPES)
def test_the_kernels_build_for_sm90a_without_spills(dtype):
    plan = KeySplitBackwardPlan(dtype)
    code, log = nvcc._ptxas(f"{plan.name}.cu", render_key_split_backward(dtype), "sm_90a")
    assert code == 0, log
    for entry in (plan.name, f"{plan.name}_preprocess", f"{plan.name}_postprocess"):
        report = log.split(f"Compiling entry function '{entry}'")[1].split("Compile time")[0]
        assert re.search(r"0 bytes spill stores, 0 bytes spill loads", report), (entry, report)
    assert "wgmma.mma_async instructions are serialized" not in log


def test_render_refuses_an_unknown_dtype_or_widths_by_name():
    with pytest.raises(ValueError, match=r"192/128 backward dtype 'float32'"):
        render_key_split_backward("float32")
    with pytest.raises(AssertionError, match=r"worked out for these widths"):
        KeySplitBackwardPlan("bfloat16", head_dim=256, value_dim=128)


def test_takes_leaves_what_it_does_not_run_to_the_general_kernels():
    """Other widths, fp32, deterministic, causal aligned top left with Nq != Nk, and a batch or
    heads past the grid's 65535: False, decided before any device query."""
    from fagen.key_split import takes

    q, k, v = (2, 4, 300, 192), (2, 2, 500, 192), (2, 2, 500, 128)
    ok = dict(causal=True, align="bottom_right", deterministic=False)
    assert not takes(q, k, k, "bfloat16", 0, **ok)
    assert not takes(q, k, v, "float32", 0, **ok)
    assert not takes(q, k, v, "bfloat16", 0, **{**ok, "deterministic": True})
    assert not takes(q, k, v, "bfloat16", 0, **{**ok, "align": "top_left"})
    assert not takes((70000, 4, 300, 192), (70000, 2, 500, 192), (70000, 2, 500, 128), "bfloat16", 0, **ok)


@pytest.mark.parametrize("dtype", KEY_SPLIT_TYPES)
def test_the_launch_numbers_cover_every_key_and_every_piece_of_dq(dtype):
    """fagen.accumulated_dq's numbers from the plan: a block a 96-key tile (a partial last one),
    TMA boxes of a step's rows (q, dout) and of the block's keys (k, v), and a postprocess block
    for each 32-column piece of every 64-row tile: 6 a tile cover dQ's 192 columns."""
    plan = KeySplitBackwardPlan(dtype)
    assert plan.grid(1000, 3, 2) == (11, 3, 2) and plan.grid(96, 1, 1) == (1, 1, 1)
    assert [plan.box_rows(t) for t in ("q", "k", "v", "dout")] == [64, 96, 96, 64]
    assert plan.postprocess_blocks(256) == 4 * 6 and 6 * plan.dq_piece_columns == plan.head_dim
    assert plan.tile_rows == plan.block_q == 64
