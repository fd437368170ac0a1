"""The warp-specialised sm_90a forward (pipeline.warp_specialized): its spec rules, its plan
numbers (threads, the column-block tile layout TMA writes, the tensor-map parameters), what the
render emits, the tensor maps' layout, and the launch buffer that carries them. The kernels
themselves: tests/test_nvcc.py compiles the shipped ones, tests/test_gpu.py runs them."""

from __future__ import annotations

import re
import struct

import pytest

import fagen
from fagen import runtime, tensor_maps
from fagen.load import SPECS
from fagen.plan import TMA_MAP, UNEVEN_SECTION_TILES_Y, l2_section, plan
from fagen.spec import Mask, ScoreMod
from fagen.rendering import render
from fagen.variants import fallback_tilings, partial_variant, sequence_variant, variant
from tests.conftest import rejected

WS = {"producer_registers": 24, "consumer_registers": 240}


def ws_spec(**overrides) -> dict:
    data = dict(name="probe", dtype="float16", head_dim=128, arch="sm_90a", smem_layout="swizzled",
                tiling={"block_q": 128, "block_kv": 128, "warps_q": 8},
                pipeline={"kv_smem": "separate", "stages": 2, "pingpong": True, "warp_specialized": dict(WS)})
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    return data


# ---- spec rules ----------------------------------------------------------------------------


def test_needs_sm90a():
    msg = rejected(ws_spec(arch="sm_90", smem_layout="swizzled", pipeline={"pingpong": False}))
    assert "pipeline.warp_specialized" in msg and "sm_90a" in msg and "remove it" in msg


def test_refuses_a_paged_cache():
    msg = rejected(ws_spec(sequences={"q": "varlen", "kv": "paged"}))
    assert "pipeline.warp_specialized" in msg and "paged" in msg and "remove warp_specialized" in msg


def test_varlen_loads_rows_of_one_tensor():
    """A varlen batch's maps describe the whole [1, H, total, d] tensor: the producer adds the
    sequence's first row (cu_seqlens) and asks for batch 0; both roles read the tile's sequence
    and first row from the batch's tile table and skip an entry past its tiles (continue, not
    return: the roles' loops walk on)."""
    text = render(fagen.parse_spec(ws_spec(sequences={"q": "varlen", "kv": "varlen"}, mask={"kind": "causal"})))
    assert "kv.produce(mask, q_map, k_map, v_map, smem_q_u32, q_start + q0, 0,\n                   kv_start, 0, h, h_kv);" in text
    assert text.count("if (seq_tile.x < 0) continue;") == 2 and "return;  // past" not in text
    assert "if (q0 >= n_q)" not in text and text.count("const int2 seq_tile = q_tiles != nullptr ? q_tiles[tile.y] : numbered_tile(cu_seqlens_q, batch, tile.y, "
                                                "tiles_y);") == 2
    assert "const int diagonal = mask_offset + n_kv - n_q;" in text and "mask_offset +=" not in text
    padded = render(fagen.parse_spec(ws_spec()))
    assert "smem_q_u32, q0, b,\n                   0, b, h, h_kv);" in padded


def test_needs_two_consumer_warpgroups():
    msg = rejected(ws_spec(tiling={"block_q": 64, "warps_q": 4}, pipeline={"pingpong": False}))
    assert "warps_q 4" in msg and "warps_q: 8" in msg


THREE = {"tiling": {"block_q": 192, "block_kv": 128, "warps_q": 12}}


def three_warpgroups(consumer_registers: int = 160, **overrides) -> dict:
    """d64, three consumer warpgroups of 64 rows (FlashAttention-3's d64 shape, 192 x 128)."""
    data = ws_spec(head_dim=64, **THREE)
    data["pipeline"]["warp_specialized"]["consumer_registers"] = consumer_registers
    for key, value in overrides.items():
        data[key] = {**data[key], **value}
    return data


def test_three_consumer_warpgroups_share_what_a_512_thread_block_is_launched_with():
    # 128 x (24 + 3 x 240) = 95,232 > 512 threads x 128 = 65,536: the rule names the most that fits
    msg = rejected(three_warpgroups(240))
    assert "3 consumer warpgroup(s)" in msg and "95232" in msg and "consumer_registers <= 160" in msg
    p = plan(fagen.parse_spec(three_warpgroups()))
    assert (p.threads, p.consumer_threads, p.warpgroups, p.block_q) == (512, 384, 3, 192)
    assert (p.producer_registers, p.consumer_registers) == (24, 160)


def test_three_warpgroups_need_the_producer_and_sm90a():
    msg = rejected(three_warpgroups(pipeline={"warp_specialized": None, "pingpong": False}))
    assert "tiling.warps_q = 12" in msg and "pipeline.warp_specialized" in msg
    msg = rejected(dict(name="probe", dtype="float16", head_dim=64, arch="sm_80", **THREE))
    assert "tiling.warps_q = 12" in msg and "sm_90a" in msg
    msg = rejected(ws_spec(tiling={"block_q": 160, "warps_q": 10}))
    assert "tiling.warps_q = 10" in msg and "1..8" in msg and "or 12" in msg


def test_three_warpgroups_bound_the_tile_by_their_160_registers():
    """O (32) + S (64) + P (32) + the rest (32) of 128 keys fill 160; a modifier's few more do not
    fit, so its variant falls back to a smaller tile."""
    assert plan(fagen.parse_spec(three_warpgroups())).predicted_registers == 160
    msg = rejected(three_warpgroups(tiling={"block_kv": 144}))
    assert "over the 160 limit (consumer_registers)" in msg
    softcapped = variant(fagen.parse_spec(three_warpgroups()), Mask(), ScoreMod(softcap=30.0))
    # three quarters of the tile first (a whole number of k16 steps), then the powers of two
    assert [size for size, _, _ in fallback_tilings(fagen.parse_spec(three_warpgroups()))] == [96, 64, 32, 16]
    assert softcapped.tiling.block_kv == 96 and softcapped.tiling.warps_q == 12 and softcapped.name.endswith("_kv96")


def test_a_paged_variant_of_three_warpgroups_copies_with_two():
    """A paged cache has no tensor map, so its variant drops the producer, and the copying
    kernel's warpgroups are two (128 rows); a varlen one keeps the producer and its three."""
    base = fagen.parse_spec(three_warpgroups())
    paged = sequence_variant(base, "varlen", "paged")
    assert not paged.warp_specialized and (paged.tiling.warps_q, paged.tiling.block_q) == (8, 128)
    varlen = sequence_variant(base, "varlen", "varlen")
    assert varlen.warp_specialized and varlen.tiling == base.tiling


def test_three_warpgroups_take_turns_in_a_round():
    """Ping-pong's turn barrier is met by two warpgroups (the one waiting, its predecessor
    arriving), whatever their number; warpgroup 0's first turn comes from the last one."""
    text = render(fagen.parse_spec(three_warpgroups()))
    assert "constexpr int WARPGROUPS = 3;" in text and "constexpr int TURN_THREADS = 2 * WARPGROUP_WARPS * 32;" in text
    assert "next_turn = TURN_BARRIER + (warpgroup + 1) % WARPGROUPS" in text
    assert "if (warpgroup == WARPGROUPS - 1) named_barrier_arrive(TURN_BARRIER, TURN_THREADS);" in text
    assert not re.search(r"named_barrier_\w+\([^)]*CONSUMER_THREADS", text)


def test_a_causal_warpgroup_computes_only_the_steps_its_rows_see():
    """Under a causal mask the upper warpgroups of a tile stop their MMAs where their own rows'
    keys end: the tile's later steps keep only their turns and stages (as many turns as every
    warpgroup's, so the round goes on), freed after they land. Only where the warp index is
    warp-uniform (the causal half-type forwards from head_dim 64): elsewhere the MMAs would sit on a
    path ptxas serialises."""
    for name in ("attn_f16_d128_causal_long_h200", "attn_f16_d64_causal_h200", "attn_bf16_d64_causal_long_h200"):
        long = fagen.load_spec(SPECS / f"{name}.yaml")
        text = render(long)
        assert plan(long).trims_warpgroup_steps and plan(long).uniform_warp_index, name
        assert "mask.count_through(min(q0 + (warpgroup + 1) * WARPGROUP_WARPS * WARP_ROWS, n_q) - 1)" in text
        skipped = text[text.index("for (int j = steps + 1; j <= kv_tiles; ++j) {"):]
        skipped = skipped[:skipped.index("}")]
        assert re.findall(r"named_barrier_\w+|kv\.\w+", skipped) == [
            "named_barrier_sync", "named_barrier_arrive", "kv.wait", "kv.release"], name
        assert "wgmma" not in skipped and "if (j == steps - 1) kv.release_q();" in text
    # dense, FP8 (whose warp index stays per thread) and the mma.sync kernels keep every step
    for name in ("attn_f16_d128_h200", "attn_e4m3_d128_sm90a", "attn_f16_d64_causal"):
        other = fagen.load_spec(SPECS / f"{name}.yaml")
        assert not plan(other).trims_warpgroup_steps, name
        assert "count_through" not in render(other) and "const int steps" not in render(other), name
    # beside a bias, from head_dim 128 (the d64 long class's bias variants spilled with the trim)
    for name, trims in (("attn_f16_d64_causal_long_h200", False), ("attn_f16_d128_causal_long_h200", True)):
        biased = variant(fagen.load_spec(SPECS / f"{name}.yaml"), Mask(kind="causal"), ScoreMod(bias="matrix"))
        assert plan(biased).trims_warpgroup_steps == plan(biased).uniform_warp_index == trims, biased.name


@pytest.mark.parametrize("value", [20, 244, 264, 23])
def test_setmaxnreg_operands(value):
    msg = rejected(ws_spec(pipeline={"warp_specialized": {**WS, "consumer_registers": value}}))
    assert "pipeline.warp_specialized.consumer_registers" in msg and "multiple of 8" in msg


def test_the_register_split_fits_the_blocks_launch_allocation():
    # 128 x (56 + 2 x 240) = 68,608 > 384 threads x 168 = 64,512 (setmaxnreg moves only those)
    msg = rejected(ws_spec(pipeline={"warp_specialized": {"producer_registers": 56, "consumer_registers": 240}}))
    assert "68608" in msg and "64512" in msg and "consumer_registers <= 224" in msg


def test_the_producer_takes_fewer_registers():
    msg = rejected(ws_spec(pipeline={"warp_specialized": {"producer_registers": 128, "consumer_registers": 128}}))
    assert "producer_registers" in msg and "below consumer_registers" in msg


def test_consumer_registers_bound_the_tile():
    """The consumers' estimate (accumulators + a fixed rest) against consumer_registers, not 255."""
    msg = rejected(ws_spec(tiling={"block_kv": 176}, pipeline={"warp_specialized": {**WS, "consumer_registers": 200}}))
    assert "over the 200 limit (consumer_registers)" in msg and "set warp_specialized.consumer_registers: 240" in msg
    assert fagen.parse_spec(ws_spec(tiling={"block_kv": 176}))  # 240 holds S, P and O of 176 keys


# ---- plan ----------------------------------------------------------------------------------


def test_threads_are_the_consumers_and_a_producer_warpgroup():
    p = plan(fagen.parse_spec(ws_spec()))
    assert (p.threads, p.consumer_threads, p.warpgroups) == (384, 256, 2)
    assert (p.producer_registers, p.consumer_registers) == (24, 240)


@pytest.mark.parametrize(("head_dim", "block_kv"), [(64, 128), (128, 176), (256, 80)])
def test_tiles_are_column_blocks(head_dim, block_kv):
    """A TMA box writes one 64-column block of every row of a tile (128 bytes a row): 8 rows of
    it are an atom, and a tile's blocks are its rows x 128 bytes apart, Q's and K's each."""
    p = plan(fagen.parse_spec(ws_spec(head_dim=head_dim, tiling={"block_kv": block_kv})))
    assert p.row_group_bytes == 8 * 128 == p.atom_bytes
    assert (p.q_atom_step_bytes, p.k_atom_step_bytes, p.v_lead_bytes) == (128 * 128, block_kv * 128, block_kv * 128)
    assert p.warpgroup_q_bytes == 64 * 128 and p.v_step_bytes == 16 * 128
    assert p.kv_tile_bytes == block_kv * head_dim * 2 and p.kv_tile_bytes % 1024 == 0  # TMA's 128-byte swizzle: 1 KB aligned


def cp_async_spec():
    return fagen.parse_spec(ws_spec(head_dim=64, pipeline={"warp_specialized": None}))


def test_the_cp_async_kernel_keeps_row_groups():
    p = plan(cp_async_spec())
    assert not p.warp_specialized and p.tma_params == ()
    assert p.row_group_bytes == 1024 * (64 // 64) and p.q_atom_step_bytes == p.k_atom_step_bytes == 1024


def test_tensor_maps_are_the_last_parameters():
    p = plan(fagen.parse_spec(ws_spec(mask="causal", score_mod={"softcap": 30.0})))
    assert p.params[-3:] == ((TMA_MAP, "q_map"), (TMA_MAP, "k_map"), (TMA_MAP, "v_map"))


def test_every_warp_specialized_kernel_walks_a_tile_grid():
    """Its blocks read the tile grid from scheduler parameters (a block a tile, or persistent);
    only a persistent kernel stores O from registers, its Q tile being refilled meanwhile."""
    grid = plan(fagen.parse_spec(ws_spec()))
    walk = plan(fagen.parse_spec(ws_spec(pipeline={"warp_specialized": {**WS, "persistent": True}})))
    for p in (grid, walk):
        assert p.scheduler_params == (("int", "tiles_x"), ("int", "tiles_y"), ("int", "tiles_z"), ("int", "tiles_section"))
    assert (grid.persistent, grid.output_staged) == (False, True)
    assert (walk.persistent, walk.output_staged) == (True, False)
    assert not plan(cp_async_spec()).scheduler_params


MIB = 1 << 20


def test_even_tiles_walk_a_head_at_a_time():
    """Unmasked tiles: one head's query tiles together, whatever L2 holds."""
    assert l2_section(64, 32, 2 * MIB, 60 * MIB, True) == 1
    assert l2_section(512, 4, MIB // 4, 60 * MIB, True) == 1


def test_short_uneven_tiles_walk_as_many_heads_as_half_of_l2_holds():
    """A mask's tiles, a few a head: sections of heads whose K and V fill at most half of L2; at
    least one head, at most all."""
    l2 = 60 * MIB
    assert l2_section(512, 4, MIB // 4, l2, False) == 120
    assert l2_section(64, UNEVEN_SECTION_TILES_Y, 2 * MIB, l2, False) == 15
    assert l2_section(4, 4, MIB // 4, l2, False) == 4  # all heads fit: one section
    assert l2_section(8, 2, 64 * MIB, l2, False) == 1  # a head larger than L2: a head at a time


def test_long_uneven_tiles_walk_heaviest_first():
    """Past UNEVEN_SECTION_TILES_Y a head, x fastest over every head (one section), so every
    head's heaviest tiles go first."""
    assert l2_section(64, UNEVEN_SECTION_TILES_Y + 1, 2 * MIB, 60 * MIB, False) == 64


def test_causal_tiles_end_at_the_last_query():
    """Under a causal mask the warp-specialised kernel's tiles end at n_q, so a partial tile is
    the first (lightest), its rows before 0 never written; not where rows are packed, varlen, or
    the outputs partial."""
    causal = fagen.parse_spec(ws_spec(mask={"kind": "causal"}))
    assert plan(causal).end_aligned_tiles
    text = render(causal)
    assert "const int q0 = n_q - (tile.y + 1) * BLOCK_Q;" in text and "q_first = max(q0, 0)" in text
    assert "const OutRows at{n_q - q0, o_sn, -q0};" in text and "r >= before && r < n" in text
    assert not plan(fagen.parse_spec(ws_spec())).end_aligned_tiles
    for change in ({"sequences": {"q": "varlen", "kv": "varlen"}}, {"outputs": {"partial": True}}):
        assert not plan(fagen.parse_spec(ws_spec(mask={"kind": "causal"}, **change))).end_aligned_tiles
    assert "r >= before" not in render(fagen.parse_spec(ws_spec()))


def test_the_forward_walks_in_sections():
    """The forward kernel's scheduler reads the launch's tiles_section."""
    spec = fagen.parse_spec(ws_spec())
    assert "TileScheduler scheduler(tiles_x, tiles_y, tiles_z, tiles_section)" in render(spec)


def test_a_persistent_kernel_may_split_kv():
    """Splits are the tile grid's z."""
    spec = fagen.parse_spec(ws_spec(pipeline={"warp_specialized": {**WS, "persistent": True}},
                                    outputs={"partial": True}))
    assert plan(spec).persistent and not plan(spec).output_staged


def test_q_has_its_own_barriers():
    """The KV ring's two mbarriers a stage, and Q's pair: the next tile's Q loads once the
    consumers' last S is done."""
    spec = fagen.parse_spec(ws_spec())
    assert plan(spec).smem_bytes == 128 * 128 * 2 + 2 * 2 * 128 * 128 * 2 + 2 * (2 + 1) * 8


# ---- render --------------------------------------------------------------------------------


def test_render_emits_the_producer_and_no_thread_copies():
    text = render(fagen.parse_spec(ws_spec()))
    assert "cp.async.bulk.tensor.4d" in text and "setmaxnreg.dec.sync.aligned.u32" in text
    assert "setmaxnreg.inc.sync.aligned.u32" in text and "mbarrier.arrive.expect_tx" in text
    assert "cp.async.cg" not in text and "copy_tile_async" not in text
    assert "const __grid_constant__ TmaMap q_map" in text


def test_a_persistent_kernel_loops_over_tiles_and_stores_o_from_registers():
    walk = render(fagen.parse_spec(ws_spec(pipeline={"warp_specialized": {**WS, "persistent": True}})))
    grid = render(fagen.parse_spec(ws_spec()))
    for text in (walk, grid):  # both roles walk the scheduler's tiles, each in its own loop
        assert text.count("for (int t = scheduler.first(); t < scheduler.count; t = scheduler.next(t))") == 2
        assert "kv.release_q()" in text and "mbarrier_wait(q_empty" in text
    assert "write_output(o_acc, softmax, o_tile," in walk and "OUT_CHUNKS_PER_WARP" not in walk
    assert "write_output(o_acc, softmax, smem_q, o_tile," in grid
    assert "one block an SM walks" in walk and "A block a tile" in grid


def test_the_cp_async_kernel_has_no_producer():
    text = render(cp_async_spec())
    assert "setmaxnreg" not in text and "cp.async.bulk.tensor" not in text and "TmaMap" not in text


# ---- variants ------------------------------------------------------------------------------


def test_variants_keep_the_producer_where_it_applies():
    base = fagen.load_spec(SPECS / "attn_f16_d128_h200.yaml")
    assert base.warp_specialized
    assert variant(base, Mask(kind="sliding_window", window_left=256), ScoreMod(softcap=30.0)).warp_specialized
    assert partial_variant(base).warp_specialized
    paged = sequence_variant(base, "varlen", "paged")  # a page table, not a tensor map, places the rows
    assert not paged.warp_specialized and plan(paged).threads == 256
    varlen = sequence_variant(base, "varlen", "varlen")  # rows of one [1, H, total, d] tensor
    assert varlen.warp_specialized and not varlen.pipeline.warp_specialized.persistent  # even tiles
    causal = sequence_variant(fagen.load_spec(SPECS / "attn_f16_d128_causal_h200.yaml"), "varlen", "varlen")
    assert causal.pipeline.warp_specialized.persistent  # the tile table's order, walked statically
    assert base.pipeline.warp_specialized.persistent  # (the H200 d128 dense spec walks its tiles)


# ---- tensor maps ---------------------------------------------------------------------------


def test_map_layout_innermost_first_in_bytes():
    m = tensor_maps.layout((2, 16, 4096, 128), (16 * 4096 * 128, 4096 * 128, 128, 1), 2, 176, "k")
    assert m.dims == (128, 4096, 16, 2) and m.strides == (256, 4096 * 256, 16 * 4096 * 256)
    assert m.box == (64, 176, 1, 1)


def test_map_layout_of_a_token_major_tensor():
    """[B, N, H, d] storage seen as [B, H, N, d] (transposed strides): heads 256 bytes apart."""
    m = tensor_maps.layout((3, 8, 1000, 64), (1000 * 8 * 64, 64, 8 * 64, 1), 2, 128, "q")
    assert m.strides == (8 * 64 * 2, 64 * 2, 1000 * 8 * 64 * 2)


def test_map_layout_size_one_dimensions_get_a_valid_stride():
    m = tensor_maps.layout((1, 1, 77, 128), (0, 5, 128, 1), 2, 128, "q")  # strides of size-1 dims are never used
    assert m.strides == (256, 77 * 256, 77 * 256)


@pytest.mark.parametrize(("strides", "says"), [((8 * 64 * 128, 0, 128, 1), "head stride 0"),
                                               ((8 * 64 * 128, 64 * 128, 132, 1), "sequence stride 132")])
def test_map_layout_refuses_strides_tma_cannot_take(strides, says):
    with pytest.raises(ValueError) as info:
        tensor_maps.layout((2, 8, 64, 128), strides, 2, 128, "k")
    assert says in str(info.value) and "multiple of 16 bytes" in str(info.value) and "contiguous" in str(info.value)


def test_map_layout_refuses_a_box_past_256_rows():
    with pytest.raises(ValueError, match="1..256"):
        tensor_maps.layout((1, 1, 512, 64), (512 * 64, 512 * 64, 64, 1), 2, 320, "q")


# ---- the launch buffer ---------------------------------------------------------------------


def test_a_tensor_map_takes_16_slots():
    params = (("const elem_t* __restrict__", "q"), ("int", "n"), (TMA_MAP, "q_map"), ("float", "scale"))
    offsets, total = runtime.slot_offsets(params)
    assert offsets == (0, 1, 2, 18) and total == 19
    assert struct.calcsize(runtime.slot_format(params)) == 8 * total


def test_repointing_a_mapped_tensor_encodes_its_map_anew(monkeypatch):
    from types import SimpleNamespace

    launched = []
    fake = SimpleNamespace(cuda=SimpleNamespace(driver=SimpleNamespace(launchKernel=lambda *a: launched.append(a))))
    monkeypatch.setattr(runtime, "cupy", fake)
    monkeypatch.setattr(tensor_maps, "encode", lambda address, dtype, layout: address.to_bytes(8, "little") * 16)
    params = (("const elem_t* __restrict__", "q"), ("float* __restrict__", "o"), (TMA_MAP, "q_map"))
    layout = tensor_maps.layout((1, 1, 64, 64), (4096, 4096, 64, 1), 2, 64, "q")
    launch = runtime.Launch(SimpleNamespace(ptr=1), (1, 1, 1), 384, 0, params, dict(q=16, o=32), slots=("q", "o"),
                            maps=(runtime.TensorMap("q_map", "q", "float16", layout),))
    assert launch.values[2:18].tolist() == [16] * 16
    launch(0, 4096, 8192)
    assert launch.values[:2].tolist() == [4096, 8192] and launch.values[2:18].tolist() == [4096] * 16
    # the driver reads each parameter from its first slot
    pointers = launch._pointers.tolist()
    assert pointers[2] - pointers[0] == 16 and len(launched) == 1


def test_the_backward_keeps_its_own_tile_layout():
    """The backward's tiles are laid out for its own loads, whatever the forward's producer: column
    blocks where its dK/dV kernel has a producer of its own (a TMA box a block), else row groups."""
    from fagen.backward_plan import backward_plan
    from fagen.variants import trainable

    ws = trainable(fagen.parse_spec(ws_spec()))
    threads = trainable(fagen.parse_spec(ws_spec(pipeline={"warp_specialized": None})))
    dkdv = backward_plan(ws).dkdv
    assert dkdv == backward_plan(threads).dkdv
    assert dkdv.warp_specialized and dkdv.row_group_bytes == 1024  # 8 rows of one 64-column block
    assert dkdv.kv_atom_step_bytes == dkdv.block_kv * 128  # the next block: the tile's rows of 128 bytes on
    copying = trainable(fagen.parse_spec(ws_spec()), deterministic=True)
    copying = fagen.parse_spec({**copying.model_dump(), "name": "copying",
                                "backward": {**copying.backward.model_dump(), "warp_specialized": None}})
    assert backward_plan(copying).dkdv.row_group_bytes == 2 * 1024  # cp.async: 8 rows of two atoms side by side


def test_a_ring_step_folds_into_the_running_output_a_block_a_tile():
    """accumulate_variant: the partial kernel reading back O and LSE, never persistent (the ring's
    transfer needs free SMs while a step runs), its running LSE a slice (lse_head_stride)."""
    from fagen.variants import accumulate_variant

    spec = accumulate_variant(fagen.parse_spec(ws_spec(pipeline={"warp_specialized": {**WS, "persistent": True}})))
    assert spec.outputs.accumulate and spec.outputs.partial and spec.name.endswith("_partial_accumulate")
    assert not plan(spec).persistent
    assert ("long long", "lse_head_stride") in plan(spec).params
    source = render(spec)
    assert "Fold this launch's partial into the running O" in source and "* lse_head_stride" in source
    assert "lse_head_stride" not in render(fagen.parse_spec(ws_spec()))  # emitted only where it is used


def test_a_fold_loads_a_fragments_running_values_before_writing_any_where_registers_allow():
    """The fold's epilogue (outputs.accumulate): both rows of a fragment read back at once where
    the consumers' registers hold them (the full-mask H200 kernels, 240), one at a time where
    they are short (the long class's 160: two at once spilled), and the producer warms L2 with
    the running rows while the consumers finish the tile's keys."""
    from fagen.plan import fold_rows
    from fagen.variants import accumulate_variant, shipped_spec

    full = plan(accumulate_variant(shipped_spec("float16", 128, False, gpu="h200")))
    long = plan(accumulate_variant(shipped_spec("float16", 128, True, gpu="h200", keys=65536)))
    assert (full.consumer_registers, full.fold_rows) == (240, 2)
    assert (long.consumer_registers, long.fold_rows) == (160, 1)
    assert fold_rows(o_regs=64, head_dim=128, register_limit=192) == 2
    assert fold_rows(o_regs=64, head_dim=128, register_limit=191) == 1
    assert plan(fagen.parse_spec(ws_spec())).fold_rows == 0  # no fold
    source = render(accumulate_variant(shipped_spec("float16", 128, False, gpu="h200")))
    assert "constexpr int FOLD_ROWS = 2;" in source and "prefetch_running_rows(" in source
    assert "prefetch_running_rows" not in render(fagen.parse_spec(ws_spec()))


def test_a_ring_starts_with_a_partial_kernel_a_block_a_tile():
    """ring_start_variant: the first step writes the running O and LSE (no fill before it), a
    block a tile like the folding steps; a spec already a block a tile keeps its partial."""
    from fagen.variants import partial_variant, ring_start_variant

    persistent = fagen.parse_spec(ws_spec(pipeline={"warp_specialized": {**WS, "persistent": True}}))
    spec = ring_start_variant(persistent)
    assert spec.outputs.partial and not spec.outputs.accumulate and spec.name.endswith("_partial_tiles")
    assert plan(partial_variant(persistent)).persistent and not plan(spec).persistent
    tiles = fagen.parse_spec(ws_spec())
    assert ring_start_variant(tiles) == partial_variant(tiles)


def test_row_group_map_lands_a_box_as_one_8_row_group_of_every_column_block():
    """[B, H, N, d] with d = 128: dims (64 columns, N rows, 2 column blocks, H, B); the column
    blocks 128 bytes apart, a box of 8 rows of both: 8 x 128 bytes of block 0, then of block 1."""
    m = tensor_maps.row_groups((2, 16, 4096, 128), (16 * 4096 * 128, 4096 * 128, 128, 1), 2, "q")
    assert m.dims == (64, 4096, 2, 16, 2) and m.box == (64, 8, 2, 1, 1)
    assert m.strides == (256, 128, 4096 * 256, 16 * 4096 * 256)


def test_row_group_map_of_a_token_major_tensor_and_its_refusals():
    m = tensor_maps.row_groups((3, 8, 1000, 64), (1000 * 8 * 64, 64, 8 * 64, 1), 2, "k")
    assert m.dims == (64, 1000, 1, 8, 3) and m.strides == (8 * 64 * 2, 128, 64 * 2, 1000 * 8 * 64 * 2)
    with pytest.raises(ValueError, match="sequence stride 132"):
        tensor_maps.row_groups((2, 8, 64, 128), (8 * 64 * 128, 64 * 128, 132, 1), 2, "dout")


# A fuzz run's finding (seed 47): a split-KV partial's claimed walk over 96-key tiles, whose
# producer spilled 8 bytes at 32 registers (its split bounds divide by the tile's width)
FUZZ_PARTIAL_96 = {
    "name": "fuzz", "dtype": "bfloat16", "head_dim": 64, "tiling": {"block_q": 128, "block_kv": 96, "warps_q": 8},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": False,
                 "warp_specialized": {"consumer_registers": 232, "persistent": True}},
    "smem_layout": "swizzled", "arch": "sm_90a", "mask": {"kind": "causal", "align": "bottom_right"},
    "score_mod": {"alibi": "slopes"}, "outputs": {"lse": True, "partial": True}}


@pytest.mark.parametrize("block_kv, producer, consumers", [(96, 40, 232), (160, 40, 232), (64, 32, 232), (128, 32, 232)])
def test_a_partial_claimed_walk_over_tiles_of_no_power_of_two_width_gives_its_producer_40_registers(
        block_kv, producer, consumers):
    from fagen.plan import register_split

    spec = fagen.parse_spec({**FUZZ_PARTIAL_96, "tiling": {**FUZZ_PARTIAL_96["tiling"], "block_kv": block_kv}})
    assert plan(spec).claimed_walk and register_split(spec) == (producer, consumers)


def test_the_partial_claimed_walk_over_96_keys_compiles_without_spills():
    from fagen import nvcc

    kernels = nvcc.compile_all(fagen.parse_spec(FUZZ_PARTIAL_96), "sm_90a")
    assert kernels and all(k.clean for k in kernels), [k.summary() for k in kernels]


# A fuzz run's finding (seed 30110): a split-KV partial under a block mask at head_dim 64, whose
# claiming producer (32 registers) spilled 12 bytes with a 16-byte stack frame
FUZZ_PARTIAL_BLOCK_MASK = {
    "name": "fuzz", "dtype": "float16", "head_dim": 64, "tiling": {"block_q": 128, "block_kv": 32, "warps_q": 8},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": True,
                 "warp_specialized": {"consumer_registers": 240, "persistent": True}},
    "smem_layout": "swizzled", "arch": "sm_90a", "mask": {"kind": "block_mask", "align": "bottom_right"},
    "score_mod": {"alibi": "slopes"}, "outputs": {"lse": True, "partial": True}}


@pytest.mark.parametrize("partial, producer", [(True, 40), (False, 32)])
def test_a_block_mask_s_partial_claimed_walk_gives_its_producer_40_registers_and_compiles_clean(partial, producer):
    """The block mask's tile list, read a step ahead, beside the split's bounds: 40 registers for
    the producer of a partial (none spilled at 32-128 keys there), 32 for a whole output; both clean."""
    from fagen import nvcc
    from fagen.plan import register_split

    spec = fagen.parse_spec({**FUZZ_PARTIAL_BLOCK_MASK, "outputs": {"lse": True, "partial": partial}})
    assert plan(spec).claimed_walk and register_split(spec) == (producer, 232)
    kernels = nvcc.compile_all(spec, "sm_90a")
    assert kernels and all(k.clean for k in kernels), [k.summary() for k in kernels]
