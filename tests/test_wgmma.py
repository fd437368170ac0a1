"""The sm_90a (wgmma) variant without a GPU: its spec rules, plan numbers, render and tuner
space. Its GPU checks are the shipped sm_90a specs (attn_*_h200) in tests/test_gpu.py."""

from __future__ import annotations

import re

import pytest

import fagen
from fagen import dispatch
from fagen.plan import plan
from fagen.rendering import render
from fagen.load import SPECS
from fagen.tune import candidates

HOPPER = {
    "name": "wg_probe",
    "dtype": "float16",
    "head_dim": 128,
    "tiling": {"block_q": 128, "block_kv": 128, "warps_q": 8},
    "pipeline": {"kv_smem": "separate", "stages": 2},
    "smem_layout": "swizzled",
    "arch": "sm_90a",
}


def hopper(**overrides) -> dict:
    data = {**HOPPER, **{k: v for k, v in overrides.items() if not isinstance(v, dict)}}
    for k, v in overrides.items():
        if isinstance(v, dict):
            data[k] = {**HOPPER.get(k, {}), **v}
    return data


@pytest.mark.parametrize(("overrides", "field", "fix"), [
    (dict(tiling={"block_q": 96, "warps_q": 6}), "tiling.warps_q = 6", "use 8"),
    (dict(tiling={"block_q": 256, "warps_q": 8}), "tiling.block_q = 256", "block_q: 128"),
    (dict(head_dim=96, tiling={"block_kv": 64}), "head_dim = 96", "64, 128 or 256"),
    (dict(smem_layout="padded"), "smem_layout = 'padded'", "swizzled"),
    (dict(pipeline={"kv_smem": "shared", "stages": 2}), "pipeline = 'shared, stages 2'", "separate"),
    (dict(pipeline={"stages": 1}), "pipeline = 'separate, stages 1'", "stages: 2"),
    (dict(pipeline={"q_in_registers": True}), "pipeline.q_in_registers = True", "false"),
])
def test_wgmma_rules_name_field_value_and_fix(overrides, field, fix):
    with pytest.raises(fagen.SpecError) as info:
        fagen.parse_spec(hopper(**overrides))
    message = str(info.value)
    assert field in message and "sm_90a" in message and fix in message


def test_plan_numbers_for_the_swizzle_atoms():
    p = plan(fagen.parse_spec(hopper()))
    assert p.mma == "wgmma" and p.threads == 256 and p.m_frags == 1
    assert p.atoms_per_row == 2 and p.smem_row == 64  # two 64-element atoms across head_dim 128
    assert p.kv_stages == 2 and p.kv_slots == 4
    # Q (128 x 128) + 2 K + 2 V tiles (128 x 128), unpadded halves
    assert p.smem_bytes == (128 * 128 + 4 * 128 * 128) * 2 + 2 * 2 * 8  # + landed/freed mbarriers
    # S (64 f32), O (64 f32) and the previous tile's packed P (32) a thread
    assert 160 < p.predicted_registers <= 255  # those 160, and addresses and state (fagen.plan.REGISTER_COSTS)


def test_plan_refuses_what_does_not_fit():
    with pytest.raises(fagen.SpecError, match="shared memory"):  # 32 KB Q + 6 x 64 KB
        fagen.parse_spec(hopper(head_dim=256, tiling={"block_kv": 128}, pipeline={"stages": 3}))
    with pytest.raises(fagen.SpecError, match="registers"):
        fagen.parse_spec(hopper(head_dim=64, tiling={"block_kv": 256}))  # 128 S + 64 P + 32 O


def test_render_emits_only_wgmma_and_the_shapes_of_the_plan():
    src = render(fagen.parse_spec(hopper(tiling={"block_kv": 64})))
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in src  # S: 64 keys
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in src  # O: head_dim 128
    assert "fence.proxy.async.shared::cta" in src  # cp.async (generic) -> wgmma (async proxy)
    assert "ldmatrix.sync" not in src and "mma.sync.aligned" not in src
    # the S accumulator list is 64 x 64 / 128 = 32 registers, the O list 64; then the descriptors,
    # scale-d and the named immediates (scale-a, scale-b, transpose-a, transpose-b)
    qk = src[src.index("void wgmma_qk"):src.index("void wgmma_pv")]
    assert re.findall(r"%(\d+), %(\d+), p, %(\d+), %(\d+), %(\d+), %(\d+);", qk) == [("32", "33", "35", "36", "37", "38")]
    assert '"r"(accumulate), "n"(WGMMA_SCALE_A), "n"(WGMMA_SCALE_B), "n"(WGMMA_TRANS_A),' in qk
    assert "%31 }" in qk and "%32 }" not in qk
    pv = src[src.index("void wgmma_pv"):src.index("void issue_pv")]
    assert "{ %64, %65, %66, %67 }, %68, p, %70, %71, %72;" in pv and '"r"(WGMMA_ACCUMULATE)' in pv
    bf = render(fagen.parse_spec(hopper(dtype="bfloat16")))
    assert "m64n128k16.f32.bf16.bf16" in bf and ".f16.f16" not in bf


def test_mma_sync_specs_render_no_wgmma():
    src = render(fagen.load_spec(SPECS / "attn_f16_d128.yaml"))
    assert "wgmma." not in src and "mma.sync.aligned.m16n8k16" in src


def test_tuner_explores_only_valid_hopper_tilings():
    specs, refused = candidates(fagen.parse_spec(hopper()))
    assert specs and refused
    for s in specs:
        assert s.arch == "sm_90a" and s.tiling.block_q == 16 * s.tiling.warps_q
        assert s.smem_layout == "swizzled" and s.pipeline.kv_smem == "separate" and s.pipeline.stages >= 2
    shapes = {(s.tiling.block_q, s.tiling.block_kv, s.pipeline.stages) for s in specs}
    assert (128, 128, 2) in shapes and (64, 64, 3) in shapes


def test_pingpong_needs_sm_90a_and_two_warpgroups():
    with pytest.raises(fagen.SpecError, match=r"pipeline.pingpong = True: takes two or three warpgroups"):
        fagen.parse_spec(hopper(tiling={"block_q": 64, "warps_q": 4}, pipeline={"pingpong": True}))
    mma_sync = dict(HOPPER, arch="sm_90", smem_layout="padded", tiling={"block_q": 64, "block_kv": 64, "warps_q": 4},
                    pipeline={"kv_smem": "separate", "stages": 1, "pingpong": True})
    with pytest.raises(fagen.SpecError, match=r"pipeline.pingpong = True: needs arch sm_90a"):
        fagen.parse_spec(mma_sync)


def test_pingpong_renders_the_turn_taking_and_late_refill():
    on = render(fagen.parse_spec(hopper(pipeline={"stages": 3, "pingpong": True})))
    off = render(fagen.parse_spec(hopper(pipeline={"stages": 3})))
    assert "named_barrier_sync(my_turn, TURN_THREADS);" in on and "named_barrier" not in off
    assert "constexpr int WARPGROUPS = 2;" in on and "WARPGROUPS" not in off
    # the refill: after the release with ping-pong, under the MMAs without it
    assert on.index("kv.release(j);") < on.index("kv.issue(j + KV_STAGES - 1, mask);")
    assert off.index("kv.issue(j + KV_STAGES - 1, mask);") < off.index("kv.release(j);")
    assert plan(fagen.parse_spec(hopper(pipeline={"pingpong": True}))).pingpong


def test_tuner_searches_pingpong_and_the_producer_on_hopper():
    specs, _ = candidates(fagen.parse_spec(hopper(pipeline={"stages": 3, "pingpong": True})))
    assert {(s.pipeline.pingpong, s.warp_specialized) for s in specs} == {(a, b) for a in (False, True) for b in (False, True)}
    assert all(s.tiling.warps_q in (8, 12) for s in specs if s.pipeline.pingpong or s.warp_specialized)
    # three consumer warpgroups only beside a producer, at the most registers that fit them
    three = [s for s in specs if s.tiling.warps_q == 12]
    assert three and all(s.warp_specialized and s.tiling.block_q == 192 for s in three)
    assert {s.pipeline.warp_specialized.consumer_registers for s in three} == {160}
    assert {s.pipeline.warp_specialized.consumer_registers for s in specs if s.tiling.warps_q == 8 and s.warp_specialized} == {240}


def test_long_sequences_take_their_shape_class(monkeypatch):
    """From LONG_KEYS keys on, `<name>_long_<gpu>.yaml` where shipped (fagen tune --long); the
    spec for all lengths otherwise, and for split-KV partials; fagen.attention and the bench pass
    the keys."""
    import numpy as np

    from fagen import bench, device
    from fagen.bench_cases import Case
    from fagen.variants import LONG_KEYS

    monkeypatch.setattr(device, "gpu_slug", lambda: "h100")  # the H200's specs stand in
    assert dispatch.default_spec("float16", 128, True, keys=LONG_KEYS).name == "attn_f16_d128_causal_long_h200"
    assert dispatch.default_spec("bfloat16", 128, True, keys=LONG_KEYS).name == "attn_bf16_d128_causal_long_h200"
    assert dispatch.default_spec("float16", 128, True, keys=LONG_KEYS - 1).name == "attn_f16_d128_causal_h200"
    assert dispatch.default_spec("float16", 128, True).name == "attn_f16_d128_causal_h200"
    assert dispatch.default_spec("float16", 128, False, keys=16384).name == "attn_f16_d128_h200"  # none of its own
    assert dispatch.default_spec("float16", 128, True, partial=True, keys=16384).name == "attn_f16_d128_causal_partial_h200"
    assert bench.fagen_spec(Case("float16", 128, 4096, True))[0].name == "attn_f16_d128_causal_long_h200"
    assert bench.fagen_spec(Case("float16", 128, 1024, True))[0].name == "attn_f16_d128_causal_h200"
    assert dispatch.sequence_keys(np.zeros((1, 2, 3000, 128))) == 3000 and dispatch.sequence_keys(np.zeros(5)) is None
    monkeypatch.setattr(device, "gpu_slug", lambda: None)
    assert dispatch.default_spec("float16", 128, True, keys=16384).name == "attn_f16_d128_causal"


@pytest.mark.parametrize(("gpu", "expected"), [("h200", "attn_f16_d128_h200"), ("h100", "attn_f16_d128_h200"),
                                               ("a100", "attn_f16_d128")])
def test_default_spec_uses_the_tuned_hopper_kernel_on_either_hopper(monkeypatch, gpu, expected):
    from fagen import device

    monkeypatch.setattr(device, "gpu_slug", lambda: gpu)
    spec = dispatch.default_spec("float16", 128, False)
    assert spec.name == expected
    assert spec.wgmma == (expected != "attn_f16_d128")
