"""MLA decode's kernel plan, render and build, without a GPU (fagen.mla_plan, fagen.tensor_maps)."""

import re

import pytest

from fagen import nvcc, tensor_maps
from fagen.mla_plan import HEAD_DIM, HEAD_DIM_V, MLA_TYPES, PAGE_SIZE, MlaPlan
from fagen.rendering import render_mla

SM90A_SMEM = 227 * 1024  # the most dynamic shared memory a block may take on sm_90a


@pytest.mark.parametrize("dtype", MLA_TYPES)
def test_the_plan_fits_q_two_pages_and_p_in_shared_memory(dtype):
    plan = MlaPlan(dtype)
    assert plan.tile_bytes == plan.block_rows * HEAD_DIM * 2 == PAGE_SIZE * HEAD_DIM * 2
    assert plan.p_at == (1 + plan.kv_stages) * plan.tile_bytes  # Q, then the ring, then P
    assert plan.smem_bytes <= SM90A_SMEM
    # a third page would not fit: two stages is the most the tile allows
    assert plan.smem_bytes + plan.tile_bytes > SM90A_SMEM
    # each consumer warpgroup holds half of O: 128 f32 registers a thread
    assert plan.o_n_frags * 4 == plan.block_rows * HEAD_DIM_V // 2 // 128 == 128
    assert plan.v_half_bytes == (HEAD_DIM_V // 2 // plan.atom_columns) * plan.atom_bytes
    # every 1024-byte swizzle atom starts aligned: Q, each slot, P
    for at in (0, plan.ring_at, plan.ring_at + plan.tile_bytes, plan.p_at):
        assert at % plan.smem_align == 0


def test_the_merge_takes_the_splits_in_one_batch_a_thread():
    plan = MlaPlan("bfloat16")
    for splits in (2, 8, 33, 132, 1000):
        lanes = plan.merge_split_lanes(splits)
        assert 1 <= lanes <= plan.merge_max_split_lanes
        assert lanes * plan.merge_batch >= min(splits, plan.merge_max_split_lanes * plan.merge_batch)
        assert plan.merge_threads(splits) == lanes * plan.merge_columns // 4 <= 1024
    assert HEAD_DIM_V % plan.merge_columns == 0


@pytest.mark.parametrize("dtype", MLA_TYPES)
def test_the_kernel_and_its_merge_build_for_sm90a_without_spills(dtype):
    source = render_mla(dtype)
    plan = MlaPlan(dtype)
    code, log = nvcc._ptxas(f"{plan.name}.cu", source, "sm_90a")
    assert code == 0, log
    for name in (plan.name, plan.merge_name):
        entry = log.split(f"Compiling entry function '{name}'")[1]
        assert re.search(r"0 bytes spill stores, 0 bytes spill loads", entry.split("Compile time")[0]), entry
    # wgmma issued on paths ptxas does not fence one by one
    assert "wgmma.mma_async instructions are serialized" not in log


def test_the_paged_latent_map_covers_whole_pages_of_one_head():
    pages = 10
    layout = tensor_maps.paged_latent((pages, PAGE_SIZE, 1, HEAD_DIM), (PAGE_SIZE * HEAD_DIM, HEAD_DIM, HEAD_DIM, 1), 2,
                                      PAGE_SIZE)
    assert layout.dims == (HEAD_DIM, PAGE_SIZE, pages)
    assert layout.strides == (HEAD_DIM * 2, PAGE_SIZE * HEAD_DIM * 2)
    assert layout.box == (64, PAGE_SIZE, 1)
    with pytest.raises(ValueError, match=r"kv_cache: shape .* pages of 64 rows of one head"):
        tensor_maps.paged_latent((pages, PAGE_SIZE, 2, HEAD_DIM), (2 * PAGE_SIZE * HEAD_DIM, 2 * HEAD_DIM, HEAD_DIM, 1),
                                 2, PAGE_SIZE)
    with pytest.raises(ValueError, match=r"kv_cache: row stride 1154 bytes"):
        tensor_maps.paged_latent((pages, PAGE_SIZE, 1, HEAD_DIM), (PAGE_SIZE * 577, 577, 577, 1), 2, PAGE_SIZE)


def test_render_refuses_an_unknown_dtype_by_name():
    with pytest.raises(ValueError, match=r"MLA decode dtype 'float8_e4m3fn'"):
        render_mla("float8_e4m3fn")
