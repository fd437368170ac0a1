"""fagen.plan.plan: the derived numbers, each recomputed here from its definition."""

from __future__ import annotations

import dataclasses

import pytest

import fagen
from fagen.plan import plan
from fagen.load import SPECS
from fagen.spec import SMEM_PER_BLOCK

SPEC_FILES = sorted(SPECS.glob("*.yaml"))


def make(name="k", dtype="float16", head_dim=128, block_q=64, block_kv=64, warps_q=4,
         kv_smem="separate", stages=1, q_in_registers=False, smem_layout="padded", arch="sm_80"):
    return fagen.parse_spec({
        "name": name, "dtype": dtype, "head_dim": head_dim,
        "tiling": {"block_q": block_q, "block_kv": block_kv, "warps_q": warps_q},
        "pipeline": {"kv_smem": kv_smem, "stages": stages, "q_in_registers": q_in_registers},
        "smem_layout": smem_layout, "arch": arch,
    })


def test_flash_prefetch_f16_d128_by_hand():
    p = plan(fagen.load_spec(SPECS / "attn_f16_d128.yaml"))
    assert p.name == "attn_f16_d128"
    assert (p.threads, p.warps) == (128, 4)
    assert (p.block_q, p.block_kv, p.head_dim) == (64, 64, 128)
    assert p.m_frags == 1  # 64 rows / 4 warps = 16 rows = one m16 fragment
    assert p.s_n_frags == 8  # 64 keys / n8
    assert p.o_n_frags == 16  # 128 / n8
    assert p.qk_k_steps == 8  # 128 / k16
    assert p.pv_k_steps == 4  # 64 / k16
    assert p.smem_row == 136  # 128 + 8 padding
    assert p.chunks_per_row == 16
    assert p.kv_slots == 2  # separate K and V, one stage
    assert p.q_tile_elems == 64 * 136 and p.kv_tile_elems == 64 * 136
    assert p.smem_bytes == (64 + 2 * 64) * 136 * 2 == 52224
    assert p.smem_limit == 166912
    assert p.seed_budget_bytes == (2 * 64 * 128 + 64 * 128 + 64 * 64) * 2 == 57344
    assert p.blocks_per_sm_by_smem == 166912 // 52224 == 3


def test_ring3_qreg_by_hand():
    p = plan(fagen.load_spec(SPECS / "flash_ring3_f16_d128_causal_qreg.yaml"))
    assert p.kv_slots == 3  # shared K/V ring, three stages
    assert (p.s_n_frags, p.pv_k_steps) == (4, 2)  # block_kv 32
    assert p.smem_bytes == (64 + 3 * 32) * 136 * 2


def test_prefetch2_swizzled_br128_by_hand():
    p = plan(fagen.load_spec(SPECS / "flash_prefetch2_bf16_d64_causal_br128.yaml"))
    assert p.m_frags == 2  # 128 rows / 4 warps = 32 rows
    assert p.smem_row == 64  # swizzled rows are not padded
    assert p.kv_slots == 4  # separate, two stages
    assert p.smem_bytes == (128 + 4 * 64) * 64 * 2


@pytest.mark.parametrize("warps_q, rows_per_warp", [(1, 16), (1, 64), (2, 32), (4, 48), (8, 16), (8, 32)])
def test_threads_and_fragments(warps_q, rows_per_warp):
    block_q = warps_q * rows_per_warp
    p = plan(make(head_dim=32, block_q=block_q, block_kv=16, warps_q=warps_q))
    assert p.threads == 32 * warps_q
    assert p.warps == warps_q
    assert p.m_frags == rows_per_warp // 16


@pytest.fixture
def any_registers(monkeypatch):
    """For tests of other numbers: tilings the register estimate refuses are planned too."""
    monkeypatch.setattr("fagen.plan.MAX_REGISTERS", 10**6)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("block_kv", [16, 48])
def test_mma_step_counts(head_dim, block_kv, any_registers):
    p = plan(make(head_dim=head_dim, block_kv=block_kv, kv_smem="shared", arch="sm_90"))
    assert p.s_n_frags * 8 == block_kv
    assert p.o_n_frags * 8 == head_dim
    assert p.qk_k_steps * 16 == head_dim
    assert p.pv_k_steps * 16 == block_kv
    assert p.chunks_per_row * 8 == head_dim


@pytest.mark.parametrize("layout, head_dim, row", [
    ("padded", 32, 40), ("padded", 96, 104), ("padded", 128, 136), ("padded", 256, 264),
    ("swizzled", 64, 64), ("swizzled", 128, 128), ("swizzled", 256, 256),
])
def test_smem_row(layout, head_dim, row, any_registers):
    p = plan(make(head_dim=head_dim, block_kv=32, smem_layout=layout, kv_smem="shared"))
    assert p.smem_row == row


@pytest.mark.parametrize("kv_smem, stages, slots", [
    ("shared", 1, 1), ("shared", 2, 2), ("shared", 3, 3),
    ("separate", 1, 2), ("separate", 2, 4), ("separate", 3, 6),
])
def test_kv_slots(kv_smem, stages, slots):
    p = plan(make(head_dim=64, block_kv=32, kv_smem=kv_smem, stages=stages))
    assert p.kv_slots == slots


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda f: f.stem)
def test_smem_and_seed_budget_of_every_shipped_spec(path):
    spec = fagen.load_spec(path)
    p = plan(spec)
    t, d, dv = spec.tiling, spec.head_dim, spec.dv
    width = max(d, dv)  # Q, K, V and the staged O share one row layout
    row = width + 8 if spec.smem_layout == "padded" else width
    slots = spec.pipeline.stages * (2 if spec.pipeline.kv_smem == "separate" else 1)
    # sm_90a: landed/freed mbarriers a stage, and Q's pair where a producer loads it
    barriers = 2 * (spec.pipeline.stages + spec.warp_specialized) * 8 if spec.wgmma else 0
    size, kv_size = spec.element.bytes, spec.kv_element.bytes  # (an FP8 KV cache: K and V one byte an element)
    # the FP8 forward's slots hold V^T's whole 128-key boxes
    slot_keys = -(-t.block_kv // 128) * 128 if spec.element.is_fp8 and spec.wgmma else t.block_kv
    claimed_tile = 8 * p.claimed_walk  # the word a claimed walk's producer hands its tile number in
    assert p.smem_bytes == t.block_q * row * size + slots * slot_keys * row * kv_size + barriers + claimed_tile
    assert p.seed_budget_bytes == t.block_kv * (d + dv) * kv_size + (t.block_q * d + t.block_q * t.block_kv) * size
    assert p.smem_limit == SMEM_PER_BLOCK[spec.arch]
    assert p.smem_bytes <= p.smem_limit
    assert p.seed_budget_bytes <= p.smem_limit
    assert p.predicted_registers <= 255


@pytest.mark.parametrize("kw", [
    dict(), dict(head_dim=64, block_q=128), dict(kv_smem="shared", stages=3, block_kv=32),
    dict(dtype="bfloat16", smem_layout="swizzled", stages=2), dict(head_dim=32, block_q=16, warps_q=1),
])
def test_smem_bytes_formula(kw):
    spec = make(**kw)
    p = plan(spec)
    t, d = spec.tiling, spec.head_dim
    row = d + 8 if spec.smem_layout == "padded" else d
    slots = spec.pipeline.stages * (2 if spec.pipeline.kv_smem == "separate" else 1)
    # sm_90a: landed/freed mbarriers a stage, and Q's pair where a producer loads it
    barriers = 2 * (spec.pipeline.stages + spec.warp_specialized) * 8 if spec.wgmma else 0
    assert p.smem_bytes == (t.block_q + slots * t.block_kv) * row * 2 + barriers
    assert p.q_tile_elems == t.block_q * row
    assert p.kv_tile_elems == t.block_kv * row


def test_dtype_does_not_change_the_plan_numbers():
    f16, bf16 = plan(make(dtype="float16")).as_dict(), plan(make(dtype="bfloat16")).as_dict()
    assert f16 == bf16


def test_q_in_registers_costs_registers_only():
    off, on = plan(make(q_in_registers=False)), plan(make(q_in_registers=True))
    assert on.predicted_registers > off.predicted_registers
    assert {**on.as_dict(), "predicted_registers": 0} == {**off.as_dict(), "predicted_registers": 0}


@pytest.mark.parametrize("path", SPEC_FILES[:6] + SPEC_FILES[-7:], ids=lambda f: f.stem)
def test_plan_is_deterministic(path):
    a, b = plan(fagen.load_spec(path)), plan(fagen.load_spec(path))
    assert a == b
    assert a.as_dict() == b.as_dict()
    # computed once a spec (specs are frozen, so they key the cache), and frozen itself: the shared
    # value cannot be changed by one caller under another
    assert plan(fagen.load_spec(path)) is a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.block_q = 1


def test_plan_does_not_mutate_the_spec():
    spec = make()
    before = spec.model_dump()
    plan(spec)
    plan(spec)
    assert spec.model_dump() == before


# ---- the register estimate ---------------------------------------------------------------

def derive(path, **update):
    return {**fagen.load_spec(SPECS / path).model_dump(), **update}


def refused(data) -> bool:
    try:
        fagen.parse_spec(data)
    except fagen.SpecError as err:
        assert "it would spill" in str(err), err
        return True
    return False


@pytest.mark.parametrize("case", [
    "f16_d256_swizzled", "bf16_d96_causal_two_warps", "document_d256", "d256_causal_bias", "d256_bkv64",
])
def test_specs_that_spill_are_refused(case):
    """Each compiles with spills (ptxas -v, notes/perf.md): the estimate must refuse it."""
    data = {
        "f16_d256_swizzled": derive("attn_f16_d256.yaml", smem_layout="swizzled"),  # 32 B on sm_80
        "bf16_d96_causal_two_warps": derive("attn_bf16_d96_causal.yaml",  # 32 B on sm_90
                                            tiling={"block_q": 64, "block_kv": 64, "warps_q": 2}),
        "document_d256": derive("document_bf16_d64.yaml", head_dim=256),  # 236 B on sm_80
        "d256_causal_bias": derive("attn_f16_d256_causal.yaml", score_mod={"bias": "vector"}),  # 24 B
        "d256_bkv64": derive("attn_f16_d256.yaml", tiling={"block_q": 64, "block_kv": 64, "warps_q": 4}),  # 68 B
    }[case]
    assert refused(data)


def test_masks_and_modifiers_cost_registers():
    """Adding a mask or a score modifier never lowers the estimate."""
    hopper = fagen.load_spec(SPECS / "attn_f16_d128_h200.yaml").tiling.model_dump()
    for path, update in (("attn_f16_d128.yaml", {}), ("attn_bf16_d64.yaml", {}),
                         # at 128 keys: its tuned 176 leaves the masked variants no registers to spare
                         ("attn_f16_d128_h200.yaml", {"tiling": {**hopper, "block_kv": 128}})):
        base = plan(fagen.parse_spec(derive(path, **update))).predicted_registers
        for mask in ({"kind": "sliding_window", "window_left": 100}, {"kind": "document"},
                     {"kind": "document", "causal": True}, {"kind": "block_mask"}, {"kind": "chunked", "chunk_size": 100}):
            masked = plan(fagen.parse_spec(derive(path, mask=mask, **update))).predicted_registers
            assert masked >= base, (path, mask)
            for mod in ({"softcap": 30.0}, {"alibi": "slopes"}, {"bias": "matrix"}, {"sinks": True}):
                assert plan(fagen.parse_spec(derive(path, mask=mask, score_mod=mod, **update))).predicted_registers >= masked


def test_every_shipped_spec_is_accepted_with_room_for_the_fit():
    for path in SPEC_FILES:
        assert plan(fagen.load_spec(path)).predicted_registers <= 255, path.stem


def test_variants_fall_back_to_a_tiling_the_estimate_accepts():
    """fagen.attention's variants keep the default's tiling where the estimate accepts it, else
    take a smaller block_kv (and, mma.sync, two separate stages): never a refusal."""
    from fagen.spec import Mask, ScoreMod
    from fagen.variants import fallback_tilings, variant

    h200 = fagen.load_spec(SPECS / "attn_f16_d128_h200.yaml")
    h200 = fagen.parse_spec({**h200.model_dump(), "tiling": {**h200.tiling.model_dump(), "block_kv": 128}})  # the document kind's tile
    doc = variant(h200, Mask(kind="document"), ScoreMod())
    assert doc.tiling == h200.tiling  # the document mask's kernel fix: no fallback needed
    heavy = variant(h200, Mask(kind="document"), ScoreMod(softcap=30.0, alibi="slopes", bias="matrix", sinks=True))
    assert heavy.tiling.block_kv < h200.tiling.block_kv and heavy.name.endswith(f"_kv{heavy.tiling.block_kv}")
    # the ladder's three quarters are of the largest power of two in the tile: 176 keys fall back
    # to 128, then 96, as 128 does (not 128 -> 64)
    shipped = fagen.load_spec(SPECS / "attn_f16_d128_h200.yaml")
    assert shipped.tiling.block_kv == 176
    assert [size for size, _, _ in fallback_tilings(shipped)] == [128, 96, 64, 32, 16]
    assert [size for size, _, _ in fallback_tilings(h200)] == [96, 64, 32, 16]
    for mask in (Mask(), Mask(kind="document"), Mask(kind="chunked", chunk_size=1024)):
        assert variant(shipped, mask, heavy.score_mod).tiling.block_kv == heavy.tiling.block_kv == 96, mask
    d256 = fagen.load_spec(SPECS / "attn_f16_d256_causal.yaml")
    bias = variant(d256, Mask(kind="causal"), ScoreMod(bias="vector"))
    assert plan(bias).predicted_registers <= 255
    assert (bias.tiling.block_kv, bias.pipeline.kv_smem, bias.pipeline.stages) != (32, "separate", 1)
    assert variant(d256, Mask(kind="causal"), ScoreMod(bias="vector")) is bias  # deterministic, cached


def test_masks_take_the_kinds_kv_tile():
    """A variant's KV tile is its kind's (MaskKind.kv_tile), named for it where it differs from the
    default's: documents start anywhere (at most 128 keys); windows and chunks sit at multiples of
    a power of two (a tile over 128 keys comes down to the largest power of two in it); the other
    kinds keep the default's. A default already at or under it is unchanged."""
    from fagen.mask_kinds import KINDS
    from fagen.spec import Mask, ScoreMod
    from fagen.variants import variant

    widths = (64, 80, 96, 128, 160, 176, 192, 256)
    assert [KINDS["document"].kv_tile(w) for w in widths] == [64, 80, 96, 128, 128, 128, 128, 128]
    for kind in ("sliding_window", "chunked"):
        assert [KINDS[kind].kv_tile(w) for w in widths] == [64, 80, 96, 128, 128, 128, 128, 256], kind
    for kind in ("none", "causal", "prefix_lm", "block_mask"):  # block masks: variants.block_aligned
        assert [KINDS[kind].kv_tile(w) for w in widths] == list(widths), kind

    d64 = fagen.load_spec(SPECS / "attn_f16_d64_h200.yaml")  # two consumer warpgroups, 176 keys (the old default)
    d64 = fagen.parse_spec({**d64.model_dump(), "tiling": {"block_q": 128, "block_kv": 176, "warps_q": 8},
                            "pipeline": {**d64.pipeline.model_dump(), "warp_specialized": {"persistent": True}}})
    for mask in (Mask(kind="document"), Mask(kind="document", causal=True), Mask(kind="sliding_window", window_left=100),
                 Mask(kind="chunked", chunk_size=1024)):
        derived = variant(d64, mask, ScoreMod())
        assert derived.tiling.block_kv == 128 and derived.name.endswith("_kv128"), mask
        assert derived.pipeline == d64.pipeline  # still warp-specialised and persistent
    assert variant(d64, Mask(kind="prefix_lm", prefix_len=100), ScoreMod()).tiling.block_kv == 176
    d256 = fagen.load_spec(SPECS / "attn_f16_d256_h200.yaml")  # 80 keys: every kind keeps them
    for mask in (Mask(kind="document"), Mask(kind="sliding_window", window_left=100)):
        derived = variant(d256, mask, ScoreMod())
        assert derived.tiling == d256.tiling and "_kv" not in derived.name
