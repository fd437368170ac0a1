"""The backward: section on the CPU: its validation (field, value, rule, fix), the plan's numbers
for both dQ strategies, what each renders, and the tilings fagen.variants.trainable picks."""

from __future__ import annotations

import pytest

import fagen
from fagen.spec import Mask, ScoreMod
from fagen import variants
from fagen.backward_plan import backward_plan, bias_grad_layout, dq_accum_index, kernel_symbols
from fagen.load import SPECS, load_spec, with_fix
from fagen.plan import MBARRIER_BYTES, SWIZZLE_ATOM_BYTES
from fagen.rendering import render_backward
from tests.conftest import rejected

HOPPER = fagen.load_spec(SPECS / "attn_f16_d128_causal_h200.yaml")  # wgmma backward, atomic dQ


def hopper(**backward) -> dict:
    """HOPPER's data with backward: fields changed; the copying dK/dV kernel unless warp_specialized is given."""
    data = HOPPER.model_dump()
    data["backward"] = {**data["backward"], "warp_specialized": None, **backward}
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
    # then dQ's staging for its bulk reduce, a warp's 16 x 64 floats each
    assert dkdv.dq_stage_offset == dkdv.ds_offset + 2 * dkdv.ds_tile_bytes and dkdv.dq_stage_bytes == 16 * 64 * 4
    assert dkdv.smem_bytes == dkdv.dq_stage_offset + bwd.warps * dkdv.dq_stage_bytes
    assert dkdv.dq_tiles * dkdv.dq_key_split == bwd.warps // 4
    assert dkdv.dq_key_steps * 16 * dkdv.dq_key_split == bwd.block_kv
    assert ("float* __restrict__", "dq_accum") in plan.dkdv_params
    assert kernel_symbols(plan) == {"preprocess": plan.preprocess_symbol, "dkdv": plan.dkdv_symbol,
                                    "postprocess": plan.postprocess_symbol}


def test_producer_fed_head_dim_128_hands_dq_to_the_producer_s_writer():
    """At head_dim 128 the producer warpgroup's dQ writer issues the bulk adds (DQ_WRITER_HEAD_DIMS):
    the consumers' part of a step goes to it with its destination, held where the barriers leave
    room before the dS^T buffers (no more shared memory), and they issue no bulk reduce of their own;
    at head_dim 64, and without a producer, each consumer warp issues its own."""
    fed = fagen.parse_spec(hopper(warp_specialized={"producer_registers": 24, "consumer_registers": 240}))
    dkdv = backward_plan(fed).dkdv
    warpgroups = fed.backward.warps // 4
    assert dkdv.dq_writer and dkdv.smem_bytes == dkdv.dq_stage_offset + fed.backward.warps * dkdv.dq_stage_bytes
    ring_end = 2 * dkdv.kv_tile_bytes + fed.backward.stages * dkdv.stage_bytes + 2 * (fed.backward.stages + 1) * MBARRIER_BYTES
    assert ring_end <= dkdv.dq_rows_offset and dkdv.dq_rows_offset + 8 * warpgroups <= dkdv.ds_offset
    source = render_backward(fed)
    mainloop = source[source.index("registers_claim<CONSUMER_REGISTERS>"):source.index("namespace postprocess")]
    assert "bulk_reduce_add(" not in mainloop and "named_barrier_arrive(NAMED_BARRIER_DQ_FULL" in mainloop
    assert source.count("bulk_reduce_add(rows") == 1  # the writer's
    copying = backward_plan(fagen.parse_spec(hopper())).dkdv
    assert not copying.dq_writer and copying.dq_rows_offset == 0
    d64 = variants.trainable(fagen.load_spec(SPECS / "attn_f16_d64_causal_h200.yaml"))
    assert d64.backward.warp_specialized is not None and not backward_plan(d64).dkdv.dq_writer
    assert "NAMED_BARRIER_DQ_FULL" not in render_backward(d64)


def test_deterministic_plan_has_a_dq_kernel_and_no_accumulator():
    plan = backward_plan(fagen.parse_spec(hopper(deterministic=True)))
    assert not plan.atomic_dq and plan.dkdv.ds_tile_bytes == 0
    assert "dq_accum" not in {name for _, name in plan.dkdv_params}
    assert set(kernel_symbols(plan)) == {"preprocess", "dkdv", "dq"}


# ---- rendering ---------------------------------------------------------------------------------

def test_atomic_backward_renders_a_postprocess_instead_of_the_dq_kernel():
    source = render_backward(HOPPER)
    assert "namespace postprocess" in source and "namespace dq " not in source
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in source and "issue_dq(" in source
    assert "red.global.add" not in source  # dQ's adds leave the warps as bulk reduces, not reductions a thread


@pytest.mark.parametrize("cols, block_q", [(128, 64), (64, 128), (64, 64)])
def test_dq_accum_layout_keeps_each_query_tile_whole(cols, block_q):
    # every element of two query tiles has its own float, inside its own tile's block_q x cols
    rows = 2 * block_q
    index = {(r, c): dq_accum_index(r, c, cols, block_q) for r in range(rows) for c in range(cols)}
    assert sorted(index.values()) == list(range(rows * cols))
    assert all(i // (block_q * cols) == r // block_q for (r, _), i in index.items())
    # a lane's 4 floats: rows g and g + 8 by columns 2c and 2c + 1, side by side (what the postprocess reads)
    assert [index[r, c] for r, c in ((0, 0), (0, 1), (8, 0), (8, 1), (0, 2))] == [0, 1, 2, 3, 4]
    assert index[1, 0] == 16 and index[0, 8] == 128  # the next lane's row group; the next n8 fragment


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


# ---- a bias's gradient (backward.bias_grad) ----------------------------------------------------

def test_bias_grad_needs_a_bias():
    message = rejected(hopper(bias_grad=True))
    assert "backward.bias_grad = True" in message and "score_mod.bias, which is none" in message


def test_bias_grad_refuses_softcap_and_an_expression_together():
    data = hopper(bias_grad=True, deterministic=True, block_q=32)
    data["score_mod"] = {"softcap": 30.0, "bias": "matrix", "expression": "score * 0.5f", "expression_grad": "0.5f"}
    message = rejected(data)
    assert "backward.bias_grad = True" in message and "drop softcap or the expression" in message


@pytest.mark.parametrize("bias, softcap, adds", [("matrix", None, "atomicAdd(first + dq * stride + dk"),
                                                 ("vector", None, "atomicAdd(rows + ki, sum)"),
                                                 ("matrix", 30.0, "atomicAdd(first + dq * stride + dk")])
def test_bias_grad_renders_its_adds_only_when_asked(bias, softcap, adds):
    base = variants.variant(variants.shipped_spec("float16", 64, True, gpu="h200"), Mask(kind="causal"),
                            ScoreMod(bias=bias, softcap=softcap))
    without, with_grad = variants.trainable(base), variants.trainable(base, bias_grad=True)
    assert "BiasGrad" not in render_backward(without) and "dbias" not in render_backward(without)
    source = render_backward(with_grad)
    assert adds in source and "bias_grad.add(dp, q0, warp_kv0, lane);" in source
    params = [name for _, name in backward_plan(with_grad).dkdv_params]
    at = params.index("dbias")  # (a producer-fed kernel's tensor maps follow them)
    assert params[at:at + 5] == ["dbias", "dbias_sb", "dbias_sh", "dbias_skv", "dbias_sq"]
    # softcap comes before the bias in the score: dbias is taken before softcap's factor
    assert ("dp[0][n][e] *= dsdx[0][n][e]" in source) == (softcap is not None)


def test_trainable_names_what_it_adds():
    base = variants.variant(variants.shipped_spec("float16", 128, True, gpu="h200"), Mask(kind="causal"),
                            ScoreMod(bias="vector"))
    spec = variants.trainable(base, deterministic=True, bias_grad=True)
    assert spec.name.endswith("_bwd_det_dbias") and spec.backward.bias_grad and spec.backward.deterministic
    # on mma.sync deterministic matters only for the bias's gradient
    sm80 = variants.variant(variants.shipped_spec("float16", 128, True, gpu=None), Mask(kind="causal"),
                            ScoreMod(bias="vector"))
    assert variants.trainable(sm80, deterministic=True).name.endswith("_bwd")
    assert variants.trainable(sm80, deterministic=True, bias_grad=True).backward.deterministic


@pytest.mark.parametrize("shape, batch, heads_kv, deterministic, buffer, strides, summed", [
    # each element in one block: the bias's own shape and strides, broadcast axes at stride 0
    ((2, 4, 10, 20), 2, 2, True, (2, 4, 10, 20), (800, 200, 0, 20), ()),
    ((1, 4, 10, 20), 2, 4, False, (1, 4, 10, 20), (0, 200, 0, 20), ()),
    ((2, 1, 20), 2, 2, False, (2, 1, 20), (20, 0, 0, 0), ()),
    # MQA: a head-shared bias stays in one block (its group)
    ((1, 1, 10, 20), 1, 1, True, (1, 1, 10, 20), (0, 0, 0, 20), ()),
    # deterministic, shared across blocks: a copy per batch row and KV head, summed afterwards
    ((1, 1, 10, 20), 3, 2, True, (3, 2, 10, 20), (400, 0, 200, 20), (0, 1)),
    ((1, 4, 20), 3, 2, True, (3, 4, 20), (80, 20, 0, 0), (0,)),
    ((2, 1, 20), 2, 4, True, (2, 4, 20), (80, 0, 20, 0), (1,)),
])
def test_bias_grad_layout(shape, batch, heads_kv, deterministic, buffer, strides, summed):
    layout = bias_grad_layout(shape, batch, heads_kv, deterministic)
    assert layout.buffer_shape == buffer and layout.summed_axes == summed
    assert tuple(layout.strides[k] for k in ("dbias_sb", "dbias_sh", "dbias_skv", "dbias_sq")) == strides


# ---- fagen tune --backward ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["attn_f16_d128", "attn_f16_d128_causal_h200", "attn_bf16_d64_h200"])
def test_backward_candidates_keep_the_forward_and_what_it_computes(name):
    from fagen.tune import backward_candidates

    base = fagen.load_spec(SPECS / f"{name}.yaml")
    specs, refused = backward_candidates(base)
    assert specs and refused  # the validator prunes: smem, registers, wgmma's warpgroups
    own = base.backward
    for spec in specs:
        assert (spec.tiling, spec.mask, spec.score_mod, spec.arch) == (base.tiling, base.mask, base.score_mod, base.arch)
        assert spec.backward.deterministic == (own.deterministic if own else False)
    # atomic dQ runs no dQ kernel: no two candidates differ in its tiles alone
    kernels = [(s.backward.block_kv, s.backward.warps, s.backward.head_split, s.backward.block_q, s.backward.stages)
               for s in specs if s.atomic_dq]
    assert len(kernels) == len(set(kernels))


def test_tune_backward_retimes_its_leaders_interleaved(monkeypatch):
    """A first pass in a fixed order favours later candidates (clocks ramping up): the leaders
    are timed again, alternating order, and ranked by the median."""
    from fagen import tune

    base = fagen.load_spec(SPECS / "attn_f16_d128.yaml")
    specs = tune.backward_candidates(base, quick=True)[0]
    first_pass = {s.name: 1.0 + 0.1 * (len(specs) - i) for i, s in enumerate(specs)}  # later looks faster
    steady = {s.name: 1.0 + 0.01 * i for i, s in enumerate(specs)}  # the truth: earlier is faster
    timed = []

    class Inputs:
        flops = 1e9

        def __init__(self, *a):
            pass

        def run(self, spec):
            return spec.name

    def fake_time(name, **_):
        timed.append(name)
        return (first_pass if timed.count(name) == 1 else steady)[name]

    monkeypatch.setattr(tune.device, "gpu_missing", lambda torch=False: None)
    monkeypatch.setattr(tune, "BackwardInputs", Inputs)
    monkeypatch.setattr(tune, "_backward_spills", lambda spec: None)
    monkeypatch.setattr(tune, "time_ms", fake_time)
    results = tune.tune_backward(base, 1, 1, 64, 64, quick=True)
    leaders = [s.name for s in specs[-tune.CONFIRM_LEADERS:]]
    retimed = timed[len(specs):]
    assert sorted(set(retimed)) == sorted(leaders) and len(retimed) == tune.CONFIRM_LEADERS * tune.CONFIRM_ROUNDS
    assert retimed[:tune.CONFIRM_LEADERS] != retimed[tune.CONFIRM_LEADERS:2 * tune.CONFIRM_LEADERS]  # alternating
    best = min(leaders, key=steady.get)
    assert results[0].spec.name == best and results[0].tflops == pytest.approx(1e9 / steady[best] / 1e9)


# ---- the warp-specialised dK/dV kernel (backward.warp_specialized) ---------------------------

def test_warp_specialized_backward_is_wgmma_only():
    data = fagen.load_spec(SPECS / "attn_f16_d128_causal.yaml").model_dump()  # mma.sync (sm_80)
    data["backward"] = {"warp_specialized": {}}
    assert "backward.warp_specialized" in rejected(data) and "remove backward.warp_specialized" in rejected(data)


def test_persistent_dkdv_walks_its_tiles_with_a_second_kv_slot():
    """One block an SM walks the KV blocks: the next tile's K and V load into a second slot (and
    its barriers) under this one's loop; each role builds the walk after setmaxnreg."""
    tiles = backward_plan(fagen.parse_spec(hopper(deterministic=True, stages=2, warp_specialized={})))
    spec = fagen.parse_spec(hopper(deterministic=True, stages=2, warp_specialized={"persistent": True}))
    walk = backward_plan(spec).dkdv
    assert (tiles.dkdv.kv_slots, walk.kv_slots, walk.persistent) == (1, 2, True)
    assert walk.smem_bytes == tiles.dkdv.smem_bytes + walk.kv_slot_bytes + 2 * MBARRIER_BYTES
    assert walk.kv_slot_bytes == 2 * walk.kv_tile_bytes
    source = render_backward(spec)
    assert "constexpr int KV_SLOTS = 2;" in source and "RingBarriers<KV_SLOTS, THREADS> kv_bars;" in source
    assert source.count("const TileScheduler scheduler(") == 2  # the producer's and the consumers'
    assert "t = scheduler.next(t)" in source and ("int", "batch") in backward_plan(spec).dkdv_params


def test_persistent_dkdv_must_fit_shared_memory():
    """A second K/V slot that does not fit is refused, naming persistent as the way out."""
    message = rejected(hopper(deterministic=False, stages=3, warp_specialized={"persistent": True}))
    assert "shared memory" in message and "2 pair(s) of K and V tiles" in message and "persistent" in message


def test_register_split_fits_the_registers_a_block_is_launched_with():
    """setmaxnreg redistributes a block's launch allocation (65536 / 384 threads: 168 a thread),
    not the SM's: a producer at 32 with consumers at 240 would wait for ever."""
    message = rejected(hopper(deterministic=True, warp_specialized={"producer_registers": 32}))
    assert "backward.warp_specialized" in message and "64512" in message and "consumer_registers <= 232" in message


def test_warp_specialized_plan_adds_a_producer_warpgroup_and_its_maps():
    spec = fagen.parse_spec(hopper(deterministic=True, warp_specialized={}))
    plain = backward_plan(fagen.parse_spec(hopper(deterministic=True)))
    plan = backward_plan(spec)
    dkdv = plan.dkdv
    assert dkdv.threads == plain.dkdv.threads == 256 and dkdv.block_threads == 384 and dkdv.producer_warpgroup == 2
    assert (dkdv.producer_registers, dkdv.consumer_registers) == (24, 240)
    # setmaxnreg moves registers within the block's launch budget (65536 / 384 = 168 a thread, rounded down to 8)
    assert 128 * dkdv.producer_registers + 256 * dkdv.consumer_registers <= 384 * 168
    assert dkdv.smem_bytes == plain.dkdv.smem_bytes + 2 * MBARRIER_BYTES  # K and V's ring of one slot
    # the maps, then the tile grid's batch (the walk's batch * KV heads)
    assert [name for _, name in plan.dkdv_params[-6:]] == ["q_map", "k_map", "v_map", "dout_map", "batch",
                                                        "heads_section"]
    # TMA writes the tiles as column blocks, a box each: a tile's 64 columns of every row, then the next
    assert (dkdv.row_group_bytes, plain.dkdv.row_group_bytes) == (1024, 2048)
    assert (dkdv.kv_atom_step_bytes, dkdv.q_atom_step_bytes) == (dkdv.block_kv * 128, dkdv.block_q * 128)
    assert (plain.dkdv.kv_atom_step_bytes, plain.dkdv.q_atom_step_bytes) == (1024, 1024)  # cp.async: row groups
    # the boxes deliver what the barriers expect: a box a 64-column block of each tile
    assert (dkdv.d_atoms + dkdv.dv_atoms) * dkdv.block_q * dkdv.atom_row_bytes == dkdv.qdo_load_bytes
    assert (dkdv.d_atoms + dkdv.dv_atoms) * dkdv.block_kv * dkdv.atom_row_bytes == dkdv.kv_load_bytes
    assert not dkdv.column_blocks  # smem_offset (dK and dV staged over K and V) keeps row groups


def test_warp_specialized_backward_renders_a_producer_and_no_copies_in_the_dkdv_kernel():
    source = render_backward(fagen.parse_spec(hopper(deterministic=True, warp_specialized={})))
    dkdv = source[source.index("namespace dkdv"):source.index("}  // namespace dkdv")]
    assert "cp.async.bulk.tensor.4d" in dkdv and "setmaxnreg.dec" in dkdv and "setmaxnreg.inc" in dkdv
    assert "__launch_bounds__(BLOCK_THREADS, 1)" in dkdv and "constexpr int BLOCK_THREADS = 384;" in dkdv
    assert "copy_tile_async<BLOCK_KV>(k_tile" not in dkdv and "pipe.issue(" not in dkdv
    assert "__syncthreads();" not in dkdv[dkdv.index("pipe.wait_kv(j)"):]  # the producer has left: named barriers only


# ---- the warp-specialised dQ kernel (backward.dq_warp_specialized) ---------------------------

DQ_PRODUCER = {"consumer_registers": 232}


@pytest.mark.parametrize("backward, why", [
    ({}, "without deterministic the dK/dV kernel adds dQ with atomics"),  # atomic dQ: no dQ kernel to feed
    ({"deterministic": True, "dq_warp_specialized": {**DQ_PRODUCER, "persistent": True}}, "a block a query tile"),
])
def test_dq_producer_needs_a_dq_kernel_that_runs_a_block_a_tile(backward, why):
    message = rejected(hopper(**{"dq_warp_specialized": DQ_PRODUCER, **backward}))
    assert "backward.dq_warp_specialized" in message and why in message


def test_dq_producer_is_wgmma_only():
    data = fagen.load_spec(SPECS / "attn_f16_d128_causal.yaml").model_dump()  # mma.sync (sm_80)
    data["backward"] = {"deterministic": True, "dq_warp_specialized": DQ_PRODUCER}
    message = rejected(data)
    assert "backward.dq_warp_specialized" in message and "mma.sync" in message


def test_dq_producer_registers_fit_two_blocks_an_sm():
    # one consumer warpgroup: two blocks an SM, so 2 x 128 x (24 + 240) is over the SM's 65536
    message = rejected(hopper(deterministic=True, dq_warp_specialized={}))
    assert "2 block(s) an SM" in message and "33792 registers" in message and "32768" in message and "consumer_registers <= 232" in message
    # two consumer warpgroups: one block an SM, the forward's 24 / 240 split
    two = fagen.parse_spec(hopper(deterministic=True, dq_block_q=128, dq_warps=8, dq_warp_specialized={}))
    assert backward_plan(two).dq_producer.blocks_per_sm == 1


def test_dq_producer_plan_adds_a_producer_warpgroup_a_barrier_and_the_maps():
    plain = backward_plan(fagen.parse_spec(hopper(deterministic=True)))
    plan = backward_plan(fagen.parse_spec(hopper(deterministic=True, dq_warp_specialized=DQ_PRODUCER)))
    producer = plan.dq_producer
    assert plain.dq_producer is None and plan.dq == plain.dq  # the same tiles and loop numbers
    assert (producer.block_threads, producer.producer_warpgroup, producer.blocks_per_sm) == (256, 1, 2)
    # setmaxnreg moves registers within two blocks' launch budget (65536 / 512 = 128 a thread)
    assert 2 * 128 * (producer.producer_registers + producer.consumer_registers) <= 65536
    assert plan.dq_smem_bytes == plain.dq_smem_bytes + 2 * MBARRIER_BYTES  # Q and dO's ring of one slot
    assert [name for _, name in plan.dq_params[-4:]] == ["q_map", "k_map", "v_map", "dout_map"]
    assert plan.dq_predicted_registers < plain.dq_predicted_registers  # no copy state in the consumers


def test_dq_producer_renders_tma_and_no_copies_in_the_dq_kernel():
    source = render_backward(fagen.parse_spec(hopper(deterministic=True, dq_warp_specialized=DQ_PRODUCER)))
    dq = source[source.index("namespace dq {"):source.index("}  // namespace dq")]
    assert "cp.async.bulk.tensor.5d" in dq and "setmaxnreg.dec" in dq and "setmaxnreg.inc" in dq
    assert "__launch_bounds__(BLOCK_THREADS, BLOCKS_PER_SM)" in dq and "constexpr int BLOCKS_PER_SM = 2;" in dq
    assert "constexpr int CONSUMER_REGISTERS = 232;" in dq
    assert "copy_tile_async" not in dq and "kv.issue(" not in dq and "KvRows" not in dq
    assert "__syncthreads();" not in dq[dq.index("kv.wait_qdo()"):]  # the producer has left
    # the copying dQ kernel is unchanged by it: cp.async copies, no roles
    plain = render_backward(fagen.parse_spec(hopper(deterministic=True)))
    plain_dq = plain[plain.index("namespace dq {"):plain.index("}  // namespace dq")]
    assert "kv.issue(" in plain_dq and "setmaxnreg" not in plain_dq and "__launch_bounds__(THREADS, 1)" in plain_dq


def test_trainable_takes_both_producers_at_head_dim_128_where_the_dq_kernel_runs():
    masked = variants.trainable(variants.variant(HOPPER, Mask(kind="chunked", chunk_size=256), ScoreMod()),
                                deterministic=True)
    assert masked.backward.deterministic and masked.backward.warp_specialized is not None
    assert masked.backward.dq_warp_specialized is not None
    dense = variants.trainable(HOPPER)  # one kernel, dQ added atomically, fed by the producer
    assert dense.atomic_dq and dense.backward.warp_specialized is not None and dense.backward.dq_warp_specialized is None
    d64 = fagen.load_spec(SPECS / "attn_f16_d64_causal_h200.yaml")
    assert variants.trainable(d64, deterministic=True).backward.dq_warp_specialized is None  # slower at 64
    assert variants.with_producers({"block_q": 64}) == [{"block_q": 64, "warp_specialized": {}}, {"block_q": 64}]


@pytest.mark.parametrize("mask", [Mask(), Mask(kind="causal"), Mask(kind="sliding_window", window_left=256),
                                  Mask(kind="prefix_lm", prefix_len=256), Mask(kind="document"),
                                  Mask(kind="block_mask"), Mask(kind="chunked", chunk_size=256)],
                         ids=lambda x: x.kind)
def test_trainable_adds_dq_atomically_at_head_dim_128_under_every_mask(mask):
    """Atomic dQ (one kernel, its adds a bulk reduce a warp) measured faster than the two
    deterministic kernels under every mask; deterministic=True still gives those."""
    spec = variants.trainable(variants.variant(HOPPER, mask, ScoreMod()))
    assert spec.atomic_dq and spec.backward.warp_specialized is not None
    det = variants.trainable(variants.variant(HOPPER, mask, ScoreMod()), deterministic=True)
    assert not det.atomic_dq and det.backward.deterministic


@pytest.mark.parametrize("mask, concurrent", [(Mask(kind="sliding_window", window_left=256), True),
                                              (Mask(kind="document", causal=True), True),
                                              (Mask(kind="prefix_lm", prefix_len=256), False), (Mask(), False)],
                         ids=lambda x: getattr(x, "kind", x))
def test_the_dq_kernel_runs_beside_the_dkdv_kernel_where_it_measured_faster(mask, concurrent):
    """BackwardPlan.concurrent_dq (CONCURRENT_DQ_MASKS): two kernels that only share inputs, so only
    deterministic plans (a dQ kernel) of the measured masks; atomic dQ has no dQ kernel."""
    det = backward_plan(variants.trainable(variants.variant(HOPPER, mask, ScoreMod()), deterministic=True))
    assert det.concurrent_dq == concurrent and not det.atomic_dq
    atomic = fagen.parse_spec({**variants.variant(HOPPER, mask, ScoreMod()).model_dump(), "name": "atomic",
                               "backward": {"deterministic": False, "warp_specialized": {}}})
    assert not backward_plan(atomic).concurrent_dq


def test_atomic_dq_under_the_producer_is_refused_where_it_spilled():
    """The register estimate of atomic dQ with the dK/dV kernel's producer (WARP_SPECIALIZED_ATOMIC_DQ):
    without modifiers head_dim 128's 64-query steps and head_dim 64's 128-query steps fit under
    every mask; softcap spilled at either (ptxas -v, nvcc 13.0)."""
    atomic_ws = lambda spec, block_q: {**spec.model_dump(), "name": "atomic_ws", "backward": {  # noqa: E731
        "deterministic": False, "block_q": block_q, "stages": 2, "warp_specialized": {}}}
    d64 = fagen.load_spec(SPECS / "attn_f16_d64_causal_h200.yaml")
    for mask in (Mask(), Mask(kind="causal"), Mask(kind="sliding_window", window_left=256), Mask(kind="document")):
        assert fagen.parse_spec(atomic_ws(variants.variant(HOPPER, mask, ScoreMod()), 64)).atomic_dq
        assert fagen.parse_spec(atomic_ws(variants.variant(d64, mask, ScoreMod()), 128)).atomic_dq
    bf16_d64 = fagen.load_spec(SPECS / "attn_bf16_d64_causal_h200.yaml")  # its P^T unpacking spilled
    for data in (atomic_ws(variants.variant(HOPPER, Mask(), ScoreMod(softcap=30.0)), 64),
                 atomic_ws(variants.variant(d64, Mask(), ScoreMod(softcap=30.0)), 128), atomic_ws(bf16_d64, 128)):
        message = rejected(data)
        assert "registers" in message and "warp_specialized.consumer_registers" in message, message


@pytest.mark.parametrize("block_q, early", [(64, False), (128, True)])
def test_p_is_packed_before_dp_lands_at_128_queries_a_step(block_q, early):
    """EARLY_P_PACK_S_REGS: at 128 queries a step the producer-fed kernel packs P^T to 16-bit pairs
    before dP^T is waited for, and computes dS^T from them; at 64 (where unpacking cost 3%), and
    in the copying kernel, the f32 tile is kept."""
    d64 = fagen.load_spec(SPECS / "attn_f16_d64_causal_h200.yaml")
    spec = fagen.parse_spec({**d64.model_dump(), "name": "packed", "backward": {
        "deterministic": False, "block_q": block_q, "stages": 2, "warp_specialized": {}}})
    assert backward_plan(spec).dkdv.early_p_pack == early
    source = render_backward(spec)
    loop = source[source.index("Phase 3"):source.index("Phase 5")]
    assert ("pack_a(s, p);" in loop) == early and ("unpack2(p[0]" in loop) == early
    assert ("= s[0][n][e] * (dp[0][n][e]" in loop) == (not early)
    # (unmasked: under the causal mask the copying kernel's 128-query step is refused, it spilled)
    copying = fagen.parse_spec({**spec.model_dump(), "mask": {"kind": "none"},
                                "backward": {**spec.backward.model_dump(), "warp_specialized": None}})
    assert not backward_plan(copying).dkdv.early_p_pack  # 255 registers: it keeps the f32 tile


def test_trainable_takes_the_dkdv_producer_at_head_dim_64():
    d64 = variants.trainable(variants.variant(fagen.load_spec(SPECS / "attn_f16_d64_causal_h200.yaml"),
                                              Mask(kind="sliding_window", window_left=256), ScoreMod()))
    bwd = d64.backward
    assert d64.atomic_dq and bwd.block_q == 128 and bwd.warp_specialized is not None and bwd.dq_warp_specialized is None


@pytest.mark.parametrize("head_dim, lanes", [(32, 4), (64, 8), (96, 8), (128, 8), (256, 8)])
def test_the_preprocess_reads_whole_lines_of_a_row(head_dim, lanes):
    """PREPROCESS_ROW_LANES: lanes side by side along a row of O and dO (a power of two no more
    than its chunks), their partial sums shuffled together; a block covers threads / lanes rows."""
    spec = variants.trainable(fagen.load_spec(SPECS / f"attn_f16_d{head_dim}.yaml"))
    plan = backward_plan(spec)
    assert (plan.preprocess_lanes, plan.preprocess_rows) == (lanes, plan.preprocess_threads // lanes)
    source = render_backward(spec)
    preprocess = source[source.index("namespace preprocess {"):source.index("}  // namespace preprocess")]
    assert f"constexpr int LANES = {lanes};" in preprocess and "for (int c = lane; c < CHUNKS_PER_ROW; c += LANES)" in preprocess
    assert "__shfl_xor_sync(group, d, offset)" in preprocess and "if (lane == 0) {" in preprocess


@pytest.mark.parametrize("warp_specialized", [True, False])
def test_the_preprocess_zeroes_the_accumulator_and_the_kernels_after_it_wait(warp_specialized):
    """Atomic dQ's accumulator is zeroed by the preprocess (no memset launch: a block clears its
    rows' run of it), and where the dK/dV kernel has a producer it and the postprocess launch as
    programmatic dependents (BackwardPlan.dependent_roles): each waits for the kernel before it
    (griddepcontrol.wait) first thing, and the kernel before lets it launch. A kernel launched
    plainly emits neither instruction; the dQ kernel (deterministic) is never a dependent."""
    spec = fagen.load_spec(SPECS / "attn_f16_d128_causal_h200.yaml")
    if not warp_specialized:
        spec = fagen.parse_spec(hopper())
    deterministic = variants.trainable(spec, deterministic=True)
    for s, roles in ((spec, ("dkdv", "postprocess") if warp_specialized else ()),
                     (deterministic, ("dkdv",) if deterministic.backward.warp_specialized else ())):
        plan = backward_plan(s)
        assert plan.dependent_roles == roles and plan.dkdv.warp_specialized == warp_specialized
        assert (("float* __restrict__", "dq_accum") in plan.preprocess_params) == s.atomic_dq
        source = render_backward(s)
        kernels = {role: source[source.index(f"{symbol}(\n"):] for role, symbol in kernel_symbols(plan).items()}
        for role, text in kernels.items():
            body = text[:text.index("\n}\n")]
            assert ("griddepcontrol.wait" in body) == (role in roles), (role, roles)
        preprocess = kernels["preprocess"][:kernels["preprocess"].index("\n}\n")]
        assert ("griddepcontrol.launch_dependents" in preprocess) == bool(roles)
        assert ("run[i] = make_float4(0.f, 0.f, 0.f, 0.f)" in preprocess) == s.atomic_dq


# ---- a document mask's bounds, resolved once a call (fagen.runtime.document_bounds) ------------

@pytest.mark.parametrize("causal", [True, False])
def test_the_loops_read_document_bounds_resolved_once_a_call(causal):
    """Forward and backward read each position's document [start, end) (doc_bounds), resolved
    from doc_ids by one small kernel a call: no loop searches doc_ids, and the preprocess no
    longer resolves them a second time."""
    spec = variants.trainable(variants.variant(HOPPER, Mask(kind="document", causal=causal), ScoreMod()))
    plan = backward_plan(spec)
    names = lambda params: [name for _, name in params]  # noqa: E731
    assert "doc_" not in " ".join(names(plan.preprocess_params))
    for params in (plan.dkdv_params, plan.dq_params, plan.dkdv.mask_params, plan.dq.mask_params):
        assert "doc_bounds" in names(params) and "doc_ids" not in names(params)
    for source in (render_backward(spec), fagen.render(spec)):
        assert "lower_bounds" not in source and "doc_ids" not in source and "bounds[at[i]]" in source


def test_other_masks_have_no_bounds_to_resolve():
    plan = backward_plan(variants.trainable(HOPPER))
    assert plan.mask_params == ()
    assert "doc_" not in " ".join(name for _, name in plan.preprocess_params)


# ---- registers: refusals whose fix validates, and head_dim 256 ----------------------------------

# A validated spec whose copying wgmma dK/dV kernel (one warpgroup: warps 4, block_kv 64) spilled
# 4 bytes (12 with 3 stages) while fagen compile compiled only the forward (issue 51's s2).
ONE_WARPGROUP = {"name": "s2", "dtype": "float16", "head_dim": 128,
                 "tiling": {"block_q": 128, "block_kv": 128, "warps_q": 8},
                 "pipeline": {"kv_smem": "separate", "stages": 2}, "smem_layout": "swizzled", "arch": "sm_90a",
                 "backward": {"block_kv": 64, "warps": 4, "block_q": 64, "dq_warps": 4, "dq_block_q": 64,
                              "deterministic": True}}


@pytest.mark.parametrize("stages", [2, 3])
def test_a_one_warpgroup_dkdv_kernel_that_spills_is_refused_with_a_fix_that_validates(stages):
    data = {**ONE_WARPGROUP, "backward": {**ONE_WARPGROUP["backward"], "stages": stages}}
    with pytest.raises(fagen.SpecError) as refused:
        fagen.parse_spec(data)
    message = str(refused.value)
    assert "the dK/dV kernel predicts" in message and "use block_q: 32" in message, message
    assert refused.value.fix == {"backward.block_q": 32}
    fixed = fagen.parse_spec(with_fix(data, refused.value.fix))
    assert backward_plan(fixed).dkdv.predicted_registers <= 255


# A validated spec (the long spec fuzz) whose copying wgmma dK/dV kernel spilled 4 bytes at 255
# registers: head_dim 64, 128 queries a step (S^T and dP^T in f32: the copying kernel packs no P^T
# early), atomic dQ, causal. Deterministic, or with no mask, the same tiling fits (254, 255).
CAUSAL_ATOMIC_D64 = {"name": "fuzz", "dtype": "float16", "head_dim": 64,
                     "tiling": {"block_q": 64, "block_kv": 64, "warps_q": 4},
                     "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": False},
                     "smem_layout": "swizzled", "arch": "sm_90a", "mask": {"kind": "causal", "align": "top_left"},
                     "score_mod": {}, "outputs": {"lse": True},
                     "backward": {"block_kv": 128, "warps": 8, "block_q": 128, "stages": 2, "dq_block_q": 64,
                                  "dq_warps": 4, "dq_block_kv": 64, "deterministic": False}}


def test_atomic_dq_under_a_causal_mask_at_128_queries_is_refused_with_a_fix_that_compiles_clean():
    from fagen.nvcc import compile_backward
    with pytest.raises(fagen.SpecError) as refused:
        fagen.parse_spec(CAUSAL_ATOMIC_D64)
    message = str(refused.value)
    assert "backward" in message and "the dK/dV kernel predicts" in message and "use block_q: 64" in message, message
    assert refused.value.fix == {"backward.block_q": 64}
    dkdv = compile_backward(fagen.parse_spec(with_fix(CAUSAL_ATOMIC_D64, refused.value.fix)))["dkdv"]
    assert (dkdv.spill_stores, dkdv.spill_loads, dkdv.stack_frame) == (0, 0, 0), dkdv.log
    # what fits at the same tiling still validates
    fagen.parse_spec({**CAUSAL_ATOMIC_D64, "backward": {**CAUSAL_ATOMIC_D64["backward"], "deterministic": True}})
    fagen.parse_spec({**CAUSAL_ATOMIC_D64, "mask": {"kind": "none"}})


def test_what_fagen_attention_trains_a_chunked_mask_with_compiles_clean():
    """The producer-fed dK/dV kernel at head_dim 64, 128 queries a step, under a chunked mask with
    atomic dQ spilled 20 bytes where its estimate said 238 of 240: it is refused now, and the
    backward fagen.attention takes for that mask (each float16 and bfloat16 H200 default, both dQ
    strategies) compiles with no spill."""
    from fagen.nvcc import compile_backward
    for dtype, head_dim in (("float16", 64), ("bfloat16", 64), ("float16", 128)):
        forward = variants.variant(variants.shipped_spec(dtype, head_dim, False, gpu="h200"),
                                   Mask(kind="chunked", chunk_size=512), ScoreMod())
        for deterministic in (False, True):
            spec = variants.trainable(forward, deterministic=deterministic)
            for kernel, r in compile_backward(spec).items():
                assert (r.spill_stores, r.spill_loads, r.stack_frame) == (0, 0, 0), (spec.name, kernel, r.log)


def test_the_dkdv_register_advice_validates_and_is_not_already_in_place():
    """A head_dim 256 tiling over the registers (head_split already 2, warps already 8): the
    advice is a change the spec does not have, and applying it validates."""
    forward = variants.variant(variants.shipped_spec("bfloat16", 256, False, gpu="h200"),
                               Mask(kind="sliding_window", window_left=300), ScoreMod(softcap=30.0, alibi="slopes"))
    data = {**forward.model_dump(), "name": "gemma_bwd",
            "backward": {"head_split": 2, "block_kv": 64, "block_q": 32, "warps": 8, "dq_block_kv": 16}}
    with pytest.raises(fagen.SpecError) as refused:
        fagen.parse_spec(data)
    message, fix = str(refused.value), refused.value.fix
    assert "dK/dV kernel predicts" in message and fix, message
    assert "head_split: 2" not in message and "warps: 8" not in message and "more warps" not in message, message
    for field, value in fix.items():
        assert data["backward"].get(field.removeprefix("backward.")) != value and f"{field.split('.')[-1]}: {value}" in message
    fagen.parse_spec(with_fix(data, fix))


@pytest.mark.parametrize("gpu", [None, "h200"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gemma_shape_trains(gpu, dtype, deterministic):
    """Gemma 2 and 3: head_dim 256, a sliding window, softcap (the forward has run it all along)."""
    forward = variants.variant(variants.shipped_spec(dtype, 256, False, gpu=gpu),
                               Mask(kind="sliding_window", window_left=300), ScoreMod(softcap=30.0))
    spec = variants.trainable(forward, deterministic)
    plan_ = backward_plan(spec)
    assert spec.backward.head_split == 2 and not spec.wgmma_backward
    assert plan_.dkdv.predicted_registers <= 255 and plan_.dq_predicted_registers <= 255


@pytest.mark.parametrize("bias", ["vector", "matrix"])
def test_head_dim_256_with_a_bias_validates_at_16_queries_and_keys(bias):
    """A bias at head_dim 256 (once refused: its loads spilled both kernels at every tiling) fits
    at 16 queries a dK/dV step and 16 keys a dQ tile, its gradient too."""
    forward = variants.variant(variants.shipped_spec("float16", 256, False, gpu=None), Mask(), ScoreMod(bias=bias))
    data = {**forward.model_dump(), "name": "d256_bias", "backward": {
        "head_split": 2, "block_kv": 64, "block_q": 16, "dq_block_kv": 16, "bias_grad": True}}
    plan_ = backward_plan(fagen.parse_spec(data))
    assert plan_.dkdv.predicted_registers <= 255 and plan_.dq_predicted_registers <= 255


def test_the_dkdv_walk_takes_heads_in_l2_sections_where_kv_blocks_differ_in_work(monkeypatch):
    """Causal KV blocks differ in work: as many KV heads a section as keep their Q, dO, LSE and
    D within half of L2 (each head's heaviest block first), while a head has fewer KV blocks than
    half the SMs; dense ones, even, and long heads walk one head at a time (the former order)."""
    from types import SimpleNamespace

    from fagen import backward
    from fagen.plan import l2_heads

    monkeypatch.setattr(backward, "l2_bytes", lambda device: 50 << 20)
    monkeypatch.setattr(backward, "multiprocessors", lambda device: 132)
    causal, dense = (load_spec(SPECS / f"{name}.yaml") for name in ("attn_f16_d128_causal_h200", "attn_f16_d128_h200"))
    section = lambda spec, b, hq, hkv, n, d: backward.Backward._heads_section(  # noqa: E731
        SimpleNamespace(spec=spec, plan=backward_plan(causal)), b, hq, hkv, n, n, d, 0)
    assert backward_plan(causal).dkdv.block_kv == 128
    per_head = 1024 * (2 * 128 * 2 + 8)  # one query head of 1k rows: Q and dO f16, LSE and D f32
    assert section(causal, 16, 16, 16, 1024, 128) == l2_heads(256, per_head, 50 << 20) == (25 << 20) // per_head
    assert section(causal, 16, 32, 8, 1024, 128) == (25 << 20) // (4 * per_head)  # GQA: a KV head's 4 query heads
    assert section(causal, 1, 2, 2, 1024, 128) == 2  # at most every head
    assert section(causal, 4, 16, 16, 4096, 128) == (25 << 20) // (4 * per_head)  # 32 KV blocks a head
    assert section(causal, 1, 16, 16, 8192, 128) == (25 << 20) // (8 * per_head)  # 64 blocks: under half the SMs
    assert section(causal, 1, 16, 16, 8448, 128) == 1  # 66: half of 132, one head at a time
    assert section(causal, 1, 16, 16, 16384, 128) == 1
    assert section(dense, 16, 16, 16, 1024, 128) == 1


# A fuzz run's finding (tests.spec_fuzz, seed 7): the copying wgmma dK/dV kernel at d128, 64 queries
# a step, a top-left document, a third stage: predicted 254, ptxas 255 with 8 bytes of spills
# (nvcc 13.0); at 2 stages it fits
FUZZ_THIRD_STAGE = {
    "name": "fuzz", "dtype": "bfloat16", "head_dim": 128, "tiling": {"block_q": 64, "block_kv": 32, "warps_q": 4},
    "pipeline": {"kv_smem": "separate", "stages": 3, "q_in_registers": False, "pingpong": False},
    "smem_layout": "swizzled", "arch": "sm_90a", "mask": {"kind": "document", "align": "top_left"},
    "score_mod": {"sinks": True}, "outputs": {"lse": True},
    "backward": {"block_kv": 128, "warps": 8, "block_q": 64, "stages": 3, "dq_block_q": 128, "dq_warps": 8,
                 "dq_block_kv": 64, "deterministic": True}}


def test_a_third_stage_in_the_copying_dkdv_kernel_is_priced():
    """The spec above is refused at 3 stages, naming a change that validates, and accepted at 2."""
    from fagen.load import parse_spec
    from fagen.spec import SpecError

    with pytest.raises(SpecError, match=r"the dK/dV kernel predicts 256 registers") as refused:
        parse_spec(FUZZ_THIRD_STAGE)
    assert refused.value.fix and parse_spec(with_fix(FUZZ_THIRD_STAGE, refused.value.fix))
    two = {**FUZZ_THIRD_STAGE, "backward": {**FUZZ_THIRD_STAGE["backward"], "stages": 2}}
    assert backward_plan(parse_spec(two)).dkdv.predicted_registers <= 255


# ... and another (seed 23): the mma.sync dK/dV kernel with softcap and a score expression whose
# derivative varies, both, at head_dim 64, 64 queries and keys a step: predicted 251, ptxas 255 with 4
# bytes of spills (nvcc 13.0); either alone fits there
FUZZ_TWO_NONLINEAR = {
    "name": "fuzz", "dtype": "bfloat16", "head_dim": 64, "tiling": {"block_q": 128, "block_kv": 32, "warps_q": 4},
    "pipeline": {"kv_smem": "shared", "stages": 2, "q_in_registers": False, "pingpong": False},
    "smem_layout": "padded", "arch": "sm_90", "mask": {"kind": "causal"},
    "score_mod": {"softcap": 5.0, "expression": "score * score * 0.01f", "expression_grad": "score * 0.02f"},
    "outputs": {"lse": True},
    "backward": {"block_kv": 64, "warps": 4, "head_split": 1, "block_q": 64, "stages": 2, "dq_block_q": 128,
                 "dq_warps": 4, "dq_block_kv": 32, "deterministic": True}}


def test_softcap_beside_a_nonlinear_expression_is_priced_in_the_mma_sync_dkdv_kernel():
    from fagen.load import parse_spec
    from fagen.spec import SpecError

    with pytest.raises(SpecError, match=r"the dK/dV kernel predicts 256 registers") as refused:
        parse_spec(FUZZ_TWO_NONLINEAR)
    assert refused.value.fix and parse_spec(with_fix(FUZZ_TWO_NONLINEAR, refused.value.fix))
    for score_mod in ({"softcap": 5.0}, {k: v for k, v in FUZZ_TWO_NONLINEAR["score_mod"].items() if k != "softcap"}):
        assert parse_spec({**FUZZ_TWO_NONLINEAR, "score_mod": score_mod})  # either alone: 251, fits


# ... and another (seed 20261201): the producer-fed dK/dV kernel on one warpgroup (deterministic,
# head_dim 128, 32 queries a step) under a document mask whose expression reads the step's query
# head, with softcap and sinks: predicted 217, ptxas 224 with 8 bytes of spills (nvcc 13.0); the
# same expression without `h` fits there
FUZZ_HEAD_EXPRESSION = {
    "name": "fuzz", "dtype": "bfloat16", "head_dim": 128, "tiling": {"block_q": 128, "block_kv": 64, "warps_q": 8},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": False,
                 "warp_specialized": {"consumer_registers": 232, "persistent": True}},
    "smem_layout": "swizzled", "arch": "sm_90a",
    "mask": {"kind": "document", "align": "top_left", "causal": True, "expression": "h % 2 == 0 || kv_idx < 64"},
    "score_mod": {"softcap": 5.0, "sinks": True}, "outputs": {"lse": True},
    "backward": {"block_kv": 64, "warps": 4, "block_q": 32, "stages": 2, "dq_block_q": 64, "dq_warps": 4,
                 "dq_block_kv": 64, "deterministic": True,
                 "warp_specialized": {"consumer_registers": 224, "persistent": False}}}


def test_a_mask_expression_reading_the_head_is_priced_in_the_producer_fed_dkdv_kernel():
    from fagen.load import parse_spec
    from fagen.spec import SpecError

    with pytest.raises(SpecError, match=r"the dK/dV kernel predicts 233 registers a thread") as refused:
        parse_spec(FUZZ_HEAD_EXPRESSION)
    assert refused.value.fix and parse_spec(with_fix(FUZZ_HEAD_EXPRESSION, refused.value.fix))
    without_head = {**FUZZ_HEAD_EXPRESSION, "mask": {**FUZZ_HEAD_EXPRESSION["mask"], "expression": "kv_idx < 64"}}
    assert backward_plan(parse_spec(without_head)).dkdv.predicted_registers == 220  # fits its 224
