"""Validated specs must not spill, and `fagen compile` must say so where one does: the forward
specs that validated and spilled (issue 51, item 6) are refused with a fix that itself compiles
clean; `fagen compile` compiles every kernel a spec renders (the backward's too) and exits 1
naming the one that spills. nvcc runs here (no GPU)."""

from __future__ import annotations

import re

import pytest
import yaml
from click.testing import CliRunner

import fagen.plan
from fagen.cli import main
from fagen.load import parse_spec
from fagen.nvcc import compile_all
from fagen.spec import SpecError

S1 = {"name": "s1", "dtype": "float16", "head_dim": 256, "tiling": {"block_q": 128, "block_kv": 80, "warps_q": 8},
      "pipeline": {"kv_smem": "separate", "stages": 2, "warp_specialized": {}}, "smem_layout": "swizzled",
      "arch": "sm_90a", "outputs": {"partial": True, "accumulate": True}}
S3 = {"name": "s3", "dtype": "bfloat16", "head_dim": 128, "tiling": {"block_q": 64, "block_kv": 128, "warps_q": 4},
      "pipeline": {"kv_smem": "separate", "stages": 2}, "smem_layout": "swizzled", "arch": "sm_90a",
      "mask": "block_mask", "score_mod": {"bias": "vector"}}
S4 = {"name": "s4", "dtype": "float16", "head_dim": 64, "tiling": {"block_q": 128, "block_kv": 192, "warps_q": 8},
      "pipeline": {"kv_smem": "separate", "stages": 2, "warp_specialized": {"consumer_registers": 232}},
      "smem_layout": "swizzled", "arch": "sm_90a", "mask": {"kind": "document", "causal": True},
      "score_mod": {"softcap": 30.0}}
S2 = {"name": "s2", "dtype": "float16", "head_dim": 128, "tiling": {"block_q": 128, "block_kv": 128, "warps_q": 8},
      "pipeline": {"kv_smem": "separate", "stages": 2}, "smem_layout": "swizzled", "arch": "sm_90a",
      "backward": {"block_kv": 64, "warps": 4, "block_q": 64, "dq_warps": 4, "dq_block_q": 64, "deterministic": True}}


def _clean(spec, arch: str = "sm_90a") -> list[str]:
    """The kernels of `spec` that spill or use a stack frame, on `arch`."""
    return [k.summary() for k in compile_all(spec, arch) if not k.clean]


def _refused_or_clean(data: dict) -> None:
    """Refused with a fix (a smaller block_kv, else more consumer_registers) that validates and
    compiles clean, or compiles clean."""
    try:
        spec = parse_spec(data)
    except SpecError as err:
        block_kv = re.search(r"use block_kv: (\d+)", str(err))
        registers = re.search(r"set warp_specialized.consumer_registers: (\d+)", str(err))
        assert block_kv or registers, str(err)
        if block_kv:
            fixed = {**data, "tiling": {**data["tiling"], "block_kv": int(block_kv[1])}}
        else:
            ws = {**data["pipeline"]["warp_specialized"], "consumer_registers": int(registers[1])}
            fixed = {**data, "pipeline": {**data["pipeline"], "warp_specialized": ws}}
        assert not _clean(parse_spec(fixed)), str(err)
        return
    assert not _clean(spec), "validated and spills"


def _block_kv_fix(data: dict) -> dict:
    """`data` refused with the fix `use block_kv: N`: data so fixed."""
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    value = re.search(r"use block_kv: (\d+)", str(err.value))
    assert value, str(err.value)
    return {**data, "tiling": {**data["tiling"], "block_kv": int(value[1])}}


def _backward_fix(data: dict, field: str) -> dict:
    """`data` refused with a fix that sets backward.<field> (`use <field>: N`): data so fixed."""
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    value = re.search(rf"use {field}: (\d+)", str(err.value))
    assert value, str(err.value)
    return {**data, "backward": {**data["backward"], field: int(value[1])}}


@pytest.mark.parametrize("data", [S1, S3], ids=["s1_accumulate_d256", "s3_block_mask_bias"])
def test_forward_specs_that_spilled_are_refused_with_a_fix_that_compiles_clean(data):
    _refused_or_clean(data)


def test_a_softcap_consumer_at_232_registers_is_refused_or_compiles_clean():
    _refused_or_clean(S4)


def _consumers(head_dim: int, block_kv: int, mask, registers: int, score_mod: dict) -> dict:
    """Two warp-specialised consumer warpgroups (sm_90a, f16) at `registers`."""
    return {"name": "consumers", "dtype": "float16", "head_dim": head_dim,
            "tiling": {"block_q": 128, "block_kv": block_kv, "warps_q": 8},
            "pipeline": {"kv_smem": "separate", "stages": 2, "warp_specialized": {"consumer_registers": registers}},
            "smem_layout": "swizzled", "arch": "sm_90a", "mask": mask, "score_mod": score_mod}


@pytest.mark.parametrize("head_dim, block_kv, mask, registers", [
    (64, 192, "none", 232), (64, 176, "causal", 216), (128, 160, "causal", 232),
    (128, 144, {"kind": "sliding_window", "window_left": 256}, 224)],
    ids=["d64_kv192_232", "d64_kv176_causal_216", "d128_kv160_causal_232", "d128_kv144_window_224"])
def test_softcap_consumers_that_spilled_above_their_prediction_are_refused(head_dim, block_kv, mask, registers):
    """Each of these validated and spilled 68 to 140 bytes (the first three where 8 registers
    fewer fit): the consumers' estimate now prices softcap's per-score work past 40 S registers."""
    _refused_or_clean(_consumers(head_dim, block_kv, mask, registers, {"softcap": 30.0}))


@pytest.mark.parametrize("block_kv, mask, registers", [
    (48, {"kind": "sliding_window", "window_left": 256}, 112), (48, {"kind": "chunked", "chunk_size": 64}, 112),
    (64, "causal", 112), (64, {"kind": "prefix_lm", "prefix_len": 100}, 112)],
    ids=["kv48_window", "kv48_chunked", "kv64_causal", "kv64_prefix_lm"])
def test_masked_consumers_at_112_registers_are_refused(block_kv, mask, registers):
    """d64 consumers with 48 or 64 keys and a mask validated at 112 registers and spilled 12 to
    48 bytes (120 fits each): a mask's consumers get at least WARP_SPECIALIZED_MASKED_FLOOR."""
    _refused_or_clean(_consumers(64, block_kv, mask, registers, {}))


FUZZ_ACCUMULATE = {
    "name": "fuzz", "dtype": "bfloat16", "head_dim": 256, "tiling": {"block_q": 128, "block_kv": 48, "warps_q": 8},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": False,
                 "warp_specialized": {"consumer_registers": 240, "persistent": True}},
    "smem_layout": "swizzled", "arch": "sm_90a", "mask": {"kind": "chunked", "align": "bottom_right", "chunk_size": 1},
    "score_mod": {}, "outputs": {"lse": True, "partial": True, "accumulate": True}}


@pytest.mark.parametrize("head_dim, block_kv, registers", [(256, 48, 240), (128, 48, 144), (128, 80, 152)],
                         ids=["d256_kv48_240", "d128_kv48_144", "d128_kv80_152"])
def test_accumulating_consumers_with_an_odd_count_of_pv_steps_are_refused_or_clean(head_dim, block_kv, registers):
    """An accumulating consumer's epilogue whose last P.V takes an odd count (past one) of k16
    steps: the spec fuzz's d256 with 48 keys validated and spilled 20 bytes at 240 (64 keys fit
    there); d128 with three consumer warpgroups spilled 4 bytes at 144 with 48 keys and at 152
    with 80, where the estimate allowed each."""
    warps = 8 if head_dim == 256 else 12
    data = {**FUZZ_ACCUMULATE, "head_dim": head_dim,
            "tiling": {"block_q": 16 * warps, "block_kv": block_kv, "warps_q": warps},
            "pipeline": {**FUZZ_ACCUMULATE["pipeline"],
                         "warp_specialized": {"consumer_registers": registers, "persistent": True}}}
    _refused_or_clean(data)


def _compile(tmp_path, data: dict):
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return CliRunner().invoke(main, ["compile", str(path)])


# Two validated specs a fuzz run (seed 7777) found spilling, on mma.sync: a split-KV partial over
# a varlen cache at head_dim 96 (the forward, sm_89: 44 bytes at 255, predicted 254), and a
# one-stage dK/dV kernel at head_dim 128 (sm_80: 24 bytes at 254, predicted 235)
FUZZ_D96_PARTIAL_VARLEN = {
    "name": "fuzz", "dtype": "bfloat16", "head_dim": 96, "tiling": {"block_q": 160, "block_kv": 48, "warps_q": 5},
    "pipeline": {"kv_smem": "separate", "stages": 3, "q_in_registers": False, "pingpong": False},
    "smem_layout": "padded", "arch": "sm_89", "mask": {"kind": "none", "align": "bottom_right"}, "score_mod": {},
    "outputs": {"lse": True, "partial": True, "merge_splits": False},
    "sequences": {"q": "padded", "kv": "varlen", "seqused_k": False}}
FUZZ_ONE_STAGE_D128 = {
    "name": "fuzz", "dtype": "float16", "head_dim": 128, "tiling": {"block_q": 64, "block_kv": 64, "warps_q": 4},
    "pipeline": {"kv_smem": "shared", "stages": 2, "q_in_registers": True, "pingpong": False},
    "smem_layout": "swizzled", "arch": "sm_80", "mask": {"kind": "none", "align": "bottom_right"},
    "score_mod": {"sinks": True}, "outputs": {"lse": True},
    "backward": {"block_kv": 32, "warps": 4, "head_split": 2, "block_q": 64, "stages": 1, "dq_block_q": 64,
                 "dq_warps": 4, "dq_block_kv": 64, "deterministic": False}}


@pytest.mark.parametrize("outputs, kv", [(True, "varlen"), (True, "padded"), (False, "varlen"), (False, "padded")])
def test_a_partial_or_varlen_forward_at_the_limit_is_refused(outputs, kv):
    """REGISTER_COSTS' partial_d96 and varlen_kv_d96 (mma.sync): at head_dim 96, 160 queries and 48 keys
    (predicted 254) either spilled (16-44 bytes, ptxas -v) and is refused, with a fix that
    compiles clean. The padded, whole-output kernel fit (253-255 across sm_80-sm_90) but sits where
    a neighbour at 128 queries spilled 8 bytes at a predicted 247: rows32_d96 refuses it too now."""
    data = {**FUZZ_D96_PARTIAL_VARLEN, "outputs": {"lse": True, "partial": outputs, **({"merge_splits": False} if outputs else {})},
            "sequences": {"q": "padded", "kv": kv, "seqused_k": False}}
    assert not _clean(parse_spec(_block_kv_fix(data)), "sm_89")


def test_a_one_stage_dkdv_kernel_at_head_dim_128_is_refused():
    """REGISTER_COSTS' stages1_wide (mma.sync dK/dV): one stage of Q and dO at head_dim 128 and 64
    queries a step spilled 24 bytes at 254 (predicted 235), where two stages use 216: refused now,
    with a fix that compiles clean; the two-stage kernel still validates and compiles clean."""
    fixed = _backward_fix(FUZZ_ONE_STAGE_D128, "block_q")
    two = {**FUZZ_ONE_STAGE_D128, "backward": {**FUZZ_ONE_STAGE_D128["backward"], "stages": 2}}
    for data in (fixed, two):
        assert not _clean(parse_spec(data), "sm_80")


# ... and one more (seed 4242): the mma.sync dK/dV kernel under a top-left document mask with a
# mask expression, a matrix bias and sinks (head_dim 64, 128 keys): 12 bytes at 255, predicted 254
FUZZ_EXPRESSION_DOCUMENT = {
    "name": "fuzz", "dtype": "float16", "head_dim": 64, "tiling": {"block_q": 64, "block_kv": 64, "warps_q": 4},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": False},
    "smem_layout": "swizzled", "arch": "sm_89",
    "mask": {"kind": "document", "align": "top_left", "causal": False, "expression": "q_idx / 64 >= kv_idx / 64"},
    "score_mod": {"bias": "matrix", "sinks": True}, "outputs": {"lse": True},
    "backward": {"block_kv": 128, "warps": 8, "head_split": 2, "block_q": 32, "stages": 2, "dq_block_q": 64,
                 "dq_warps": 4, "dq_block_kv": 32, "deterministic": False}}


def test_a_mask_expression_in_the_mma_sync_dkdv_kernel_is_priced():
    """REGISTER_COSTS' mask_expression in mma.sync's dK/dV table: the expression is tested at every
    element of every step (5-26 registers, ptxas -v): refused where it spilled, with a fix that
    compiles clean; the same kernel without the expression validates and compiles clean."""
    fixed = _backward_fix(FUZZ_EXPRESSION_DOCUMENT, "block_q")
    mask = {k: v for k, v in FUZZ_EXPRESSION_DOCUMENT["mask"].items() if k != "expression"}
    plain = {**FUZZ_EXPRESSION_DOCUMENT, "mask": mask}
    for data in (fixed, plain):
        assert not _clean(parse_spec(data), "sm_90")
    # an expression that reads the query head, on one warpgroup's worth of warps: wgmma's price
    # for it is no term of mma.sync's table (a fuzz run's KeyError), which validates the spec
    head = {**fixed, "mask": {**FUZZ_EXPRESSION_DOCUMENT["mask"], "expression": "h % 2 == 0 || kv_idx < 64"},
            "backward": {**fixed["backward"], "warps": 4, "block_kv": 64}}
    parse_spec(head)


# ... and (seed 99) the producer-fed dK/dV kernel on one warpgroup with softcap, ALiBi and a vector
# bias under a two-sided window: 4 bytes at 224 consumer registers, predicted 220
FUZZ_SOFTCAP_MODIFIED = {
    "name": "fuzz", "dtype": "float16", "head_dim": 64, "tiling": {"block_q": 64, "block_kv": 32, "warps_q": 4},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": False},
    "smem_layout": "swizzled", "arch": "sm_90a",
    "mask": {"kind": "sliding_window", "align": "top_left", "window_left": 1024, "window_right": 64},
    "score_mod": {"softcap": 30.0, "alibi": "slopes", "bias": "vector"}, "outputs": {"lse": True},
    "backward": {"block_kv": 64, "warps": 4, "block_q": 64, "stages": 2, "dq_block_q": 64, "dq_warps": 4,
                 "dq_block_kv": 32, "deterministic": False,
                 "warp_specialized": {"consumer_registers": 224, "persistent": False}}}


def test_softcap_beside_another_modifier_on_one_producer_fed_warpgroup_is_priced():
    """REGISTER_COSTS' softcap_modified_one_warpgroup: refused at the consumers' 224 and 232 (it
    spilled at both), with a fix (the copying kernel) that compiles clean; at 240 it validates
    and compiles clean."""
    with pytest.raises(SpecError) as err:
        parse_spec(FUZZ_SOFTCAP_MODIFIED)
    assert "remove backward.warp_specialized" in str(err.value), str(err.value)
    bwd = {k: v for k, v in FUZZ_SOFTCAP_MODIFIED["backward"].items() if k != "warp_specialized"}
    ws = {**FUZZ_SOFTCAP_MODIFIED["backward"]["warp_specialized"], "consumer_registers": 240}
    roomy = {**FUZZ_SOFTCAP_MODIFIED, "backward": {**FUZZ_SOFTCAP_MODIFIED["backward"], "warp_specialized": ws}}
    for data in ({**FUZZ_SOFTCAP_MODIFIED, "backward": bwd}, roomy):
        assert not _clean(parse_spec(data))


# ... and (seed 1130) the mma.sync dQ kernel under a top-left causal mask with a mask expression,
# softcap and sinks (head_dim 64, 128 queries, 32 keys a step): 4 bytes at 255 on sm_90, predicted 252
FUZZ_EXPRESSION_DQ = {
    "name": "fuzz", "dtype": "bfloat16", "head_dim": 64, "tiling": {"block_q": 64, "block_kv": 128, "warps_q": 4},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": True, "pingpong": False},
    "smem_layout": "swizzled", "arch": "sm_89",
    "mask": {"kind": "causal", "align": "top_left", "expression": "q_idx / 64 >= kv_idx / 64"},
    "score_mod": {"softcap": 30.0, "sinks": True}, "outputs": {"lse": True, "partial": False},
    "backward": {"block_kv": 128, "warps": 8, "head_split": 1, "block_q": 16, "stages": 2, "dq_block_q": 128,
                 "dq_warps": 4, "dq_block_kv": 32, "deterministic": False}}


def test_a_mask_expression_in_the_mma_sync_dq_kernel_is_priced():
    """REGISTER_COSTS' mask_expression in mma.sync's dQ table: refused where it spilled, with a
    fix that compiles clean on both archs the spec runs on; without the expression it validates
    and compiles clean."""
    fixed = _backward_fix(FUZZ_EXPRESSION_DQ, "dq_block_kv")
    mask = {k: v for k, v in FUZZ_EXPRESSION_DQ["mask"].items() if k != "expression"}
    for data in (fixed, {**FUZZ_EXPRESSION_DQ, "mask": mask}):
        for arch in ("sm_89", "sm_90"):
            assert not _clean(parse_spec(data), arch)


# ... and (seed 2026) two more of it at head_dim 96 beside a bias: a bottom-right causal mask with a
# matrix bias (40 bytes at 255 on sm_86, sm_89 and sm_90, predicted 235) and a top-left prefix-LM
# with a vector bias, a score expression and sinks, deterministic (32 bytes on sm_90)
FUZZ_EXPRESSION_BIAS_DQ = [
    {"name": "fuzz", "dtype": "float16", "head_dim": 96, "tiling": {"block_q": 64, "block_kv": 64, "warps_q": 4},
     "pipeline": {"kv_smem": "shared", "stages": 2, "q_in_registers": False, "pingpong": False},
     "smem_layout": "padded", "arch": "sm_86",
     "mask": {"kind": "causal", "align": "bottom_right", "expression": "q_idx / 64 >= kv_idx / 64"},
     "score_mod": {"bias": "matrix"}, "outputs": {"lse": True},
     "backward": {"block_kv": 128, "warps": 8, "head_split": 1, "block_q": 32, "stages": 1, "dq_block_q": 64,
                  "dq_warps": 4, "dq_block_kv": 64, "deterministic": False}},
    {"name": "fuzz", "dtype": "float16", "head_dim": 96, "tiling": {"block_q": 64, "block_kv": 64, "warps_q": 4},
     "pipeline": {"kv_smem": "shared", "stages": 3, "q_in_registers": False, "pingpong": False},
     "smem_layout": "padded", "arch": "sm_86",
     "mask": {"kind": "prefix_lm", "align": "top_left", "prefix_len": 100, "expression": "kv_idx <= q_idx"},
     "score_mod": {"bias": "vector", "expression": "score + 0.5f", "expression_grad": "1.0f", "sinks": True},
     "outputs": {"lse": True, "partial": False},
     "backward": {"block_kv": 64, "warps": 4, "head_split": 1, "block_q": 32, "stages": 2, "dq_block_q": 64,
                  "dq_warps": 4, "dq_block_kv": 64, "deterministic": True}}]


@pytest.mark.parametrize("data", FUZZ_EXPRESSION_BIAS_DQ, ids=["causal_matrix", "prefix_lm_vector"])
def test_a_mask_expression_beside_a_bias_in_the_mma_sync_dq_kernel_is_priced(data):
    """REGISTER_COSTS' mask_expression_bias in mma.sync's dQ table: refused where it spilled,
    with a fix that compiles clean on sm_86 and sm_90."""
    fixed = _backward_fix(data, "dq_block_kv")
    for arch in ("sm_86", "sm_90"):
        assert not _clean(parse_spec(fixed), arch)


# ... and (seed 8675309) mma.sync's dK/dV kernel with a mask expression beside a matrix bias: head_dim
# 64 at 128 keys, head_split 2 (predicted 252) and head_dim 96 at 64 keys and queries a step under a
# prefix-LM (predicted 245), 32 bytes at 255 each on sm_89
FUZZ_EXPRESSION_BIAS_DKDV = [
    {"name": "fuzz", "dtype": "bfloat16", "head_dim": 64, "tiling": {"block_q": 128, "block_kv": 64, "warps_q": 8},
     "pipeline": {"kv_smem": "shared", "stages": 2, "q_in_registers": False, "pingpong": False},
     "smem_layout": "padded", "arch": "sm_89",
     "mask": {"kind": "none", "align": "bottom_right", "expression": "(q_idx - kv_idx) % 4 != 3"},
     "score_mod": {"bias": "matrix"}, "outputs": {"lse": True},
     "backward": {"block_kv": 128, "warps": 8, "head_split": 2, "block_q": 32, "stages": 2, "dq_block_q": 64,
                  "dq_warps": 4, "dq_block_kv": 64, "deterministic": False}},
    {"name": "fuzz", "dtype": "float16", "head_dim": 96, "tiling": {"block_q": 64, "block_kv": 32, "warps_q": 4},
     "pipeline": {"kv_smem": "shared", "stages": 3, "q_in_registers": False, "pingpong": False},
     "smem_layout": "padded", "arch": "sm_86",
     "mask": {"kind": "prefix_lm", "align": "bottom_right", "prefix_len": 4096,
              "expression": "(q_idx - kv_idx) % 4 != 3"},
     "score_mod": {"bias": "matrix"}, "outputs": {"lse": True},
     "backward": {"block_kv": 64, "warps": 8, "head_split": 2, "block_q": 64, "stages": 2, "dq_block_q": 128,
                  "dq_warps": 8, "dq_block_kv": 32, "deterministic": False}}]


@pytest.mark.parametrize("data", FUZZ_EXPRESSION_BIAS_DKDV, ids=["d64_keys128", "d96_prefix_lm"])
def test_a_mask_expression_beside_a_bias_in_the_mma_sync_dkdv_kernel_is_priced(data):
    """REGISTER_COSTS' mask_expression_bias in mma.sync's dK/dV table (per S register): refused
    where it spilled, with a fix (fewer queries a step) that compiles clean."""
    assert not _clean(parse_spec(_backward_fix(data, "block_q")), "sm_89")


# ... and (seed 777) the persistent producer-fed dK/dV kernel with a mask expression: a causal
# document, deterministic, 32 queries a step, consumers at 232: 8 bytes, predicted 212
FUZZ_PERSISTENT_EXPRESSION = {
    "name": "fuzz", "dtype": "float16", "head_dim": 128, "tiling": {"block_q": 128, "block_kv": 64, "warps_q": 8},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": True,
                 "warp_specialized": {"consumer_registers": 216, "persistent": False}},
    "smem_layout": "swizzled", "arch": "sm_90a",
    "mask": {"kind": "document", "align": "bottom_right", "causal": True, "expression": "true"},
    "score_mod": {"sinks": True}, "outputs": {"lse": True},
    "backward": {"block_kv": 128, "warps": 8, "block_q": 32, "stages": 2, "dq_block_q": 128, "dq_warps": 8,
                 "dq_block_kv": 32, "deterministic": True,
                 "warp_specialized": {"consumer_registers": 232, "persistent": True}}}


def test_a_mask_expression_in_the_persistent_dkdv_kernel_is_priced():
    """REGISTER_COSTS' persistent_mask_expression (wgmma's dK/dV table): refused where it spilled,
    with a fix that compiles clean; at the consumers' 240, or a block a tile, it validates and
    compiles clean."""
    fixed = _backward_fix(FUZZ_PERSISTENT_EXPRESSION, "block_q")
    bwd = FUZZ_PERSISTENT_EXPRESSION["backward"]
    roomy = {**FUZZ_PERSISTENT_EXPRESSION, "backward": {
        **bwd, "warp_specialized": {**bwd["warp_specialized"], "consumer_registers": 240}}}
    walked = {**FUZZ_PERSISTENT_EXPRESSION, "backward": {
        **bwd, "warp_specialized": {**bwd["warp_specialized"], "persistent": False}}}
    for data in (fixed, roomy, walked):
        assert not _clean(parse_spec(data))


# A fuzz run's finding (seed 1204): the dK/dV kernel on two warpgroups, a block mask and an
# expression reading the head, predicted 238 of the consumers' 240, spilled 8 bytes
FUZZ_BLOCK_MASK_HEAD = {
    "name": "fuzz", "dtype": "bfloat16", "head_dim": 128, "tiling": {"block_q": 64, "block_kv": 64, "warps_q": 4},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": False},
    "smem_layout": "swizzled", "arch": "sm_90a",
    "mask": {"kind": "block_mask", "align": "bottom_right", "expression": "h % 2 == 0 || kv_idx < 64"},
    "score_mod": {"sinks": True}, "outputs": {"lse": True},
    "backward": {"block_kv": 128, "warps": 8, "block_q": 64, "stages": 2, "dq_block_q": 64, "dq_warps": 4,
                 "dq_block_kv": 64, "deterministic": False,
                 "warp_specialized": {"consumer_registers": 240, "persistent": False}}}


def test_a_head_reading_expression_beside_a_block_mask_is_priced():
    """REGISTER_COSTS' mask_expression_head_block_mask (wgmma's dK/dV table): refused where it
    spilled, with a fix that compiles clean; the same expression under the causal mask, and the
    block mask with an expression that reads no head, validate and compile clean."""
    from fagen.spec import with_fix

    with pytest.raises(SpecError, match=r"predicts 241 registers .* use block_q: 32, deterministic: true") as err:
        parse_spec(FUZZ_BLOCK_MASK_HEAD)
    fixed = with_fix(FUZZ_BLOCK_MASK_HEAD, err.value.fix)  # dQ by its own kernel: the first fix that validates
    causal = {**FUZZ_BLOCK_MASK_HEAD, "mask": {**FUZZ_BLOCK_MASK_HEAD["mask"], "kind": "causal"}}
    keys_only = {**FUZZ_BLOCK_MASK_HEAD, "mask": {**FUZZ_BLOCK_MASK_HEAD["mask"], "expression": "kv_idx < 64"}}
    for data in (fixed, causal, keys_only):
        assert not _clean(parse_spec(data))


FUZZ_BLOCK_MASK_QUERY_MODIFIED = {
    "name": "fuzz", "dtype": "bfloat16", "head_dim": 64, "tiling": {"block_q": 64, "block_kv": 32, "warps_q": 4},
    "pipeline": {"kv_smem": "separate", "stages": 3, "q_in_registers": False, "pingpong": False},
    "smem_layout": "swizzled", "arch": "sm_90a",
    "mask": {"kind": "block_mask", "align": "top_left", "expression": "(q_idx - kv_idx) % 4 != 3"},
    "score_mod": {"softcap": 30.0, "alibi": "slopes", "bias": "vector", "sinks": True}, "outputs": {"lse": True},
    "backward": {"block_kv": 64, "warps": 4, "block_q": 64, "stages": 2, "dq_block_q": 128, "dq_warps": 8,
                 "dq_block_kv": 64, "deterministic": False,
                 "warp_specialized": {"consumer_registers": 240, "persistent": False}}}


def test_a_query_expression_beside_a_block_mask_alibi_and_a_bias_is_priced():
    """REGISTER_COSTS' block_mask_query_expression_modified_one_warpgroup (wgmma's dK/dV table):
    the fuzz finding (and the same without its softcap, predicted 207) refused where they spilled,
    with a fix that compiles clean; ALiBi alone, and an expression that reads no query index,
    validate and compile clean."""
    from fagen.spec import with_fix

    no_softcap = {**FUZZ_BLOCK_MASK_QUERY_MODIFIED, "score_mod": {"alibi": "slopes", "bias": "vector"}}
    fixes = []
    for data in (FUZZ_BLOCK_MASK_QUERY_MODIFIED, no_softcap):
        with pytest.raises(SpecError, match=r"the dK/dV kernel predicts 2[4-9]\d registers .* remove "
                                            r"backward.warp_specialized") as err:
            parse_spec(data)
        fixes.append(with_fix(data, err.value.fix))  # the copying kernel
    alibi_only = {**FUZZ_BLOCK_MASK_QUERY_MODIFIED, "score_mod": {"alibi": "slopes"}}
    keys_only = {**no_softcap, "mask": {**no_softcap["mask"], "expression": "kv_idx < 64"}}
    for data in (*fixes, alibi_only, keys_only):
        assert not _clean(parse_spec(data))


FUZZ_ACCUMULATE_MASKED_MODIFIED = {
    "name": "fuzz", "dtype": "float16", "head_dim": 128, "tiling": {"block_q": 128, "block_kv": 112, "warps_q": 8},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": True,
                 "warp_specialized": {"consumer_registers": 224, "persistent": False}},
    "smem_layout": "swizzled", "arch": "sm_90a", "mask": {"kind": "causal", "align": "bottom_right"},
    "score_mod": {"alibi": "geometric", "bias": "matrix"}, "outputs": {"lse": True, "partial": True, "accumulate": True}}


def test_an_accumulating_consumer_under_a_mask_with_alibi_and_a_bias_is_priced():
    """plan.ACCUMULATE_MASKED_MODIFIED: the fuzz finding (4 bytes spilled at 224, predicted 213)
    refused, and both fixes it offers (fewer keys; 240 consumer registers, where it fit) compile
    clean; no mask, ALiBi alone and no accumulate validate and compile clean."""
    from fagen.spec import with_fix

    with pytest.raises(SpecError, match=r"predicts 2\d\d registers .* over the 224 limit .* use block_kv: (\d+), or set "
                                        r"warp_specialized.consumer_registers: 240") as err:
        parse_spec(FUZZ_ACCUMULATE_MASKED_MODIFIED)
    fewer_keys = with_fix(FUZZ_ACCUMULATE_MASKED_MODIFIED, err.value.fix)
    pipeline = FUZZ_ACCUMULATE_MASKED_MODIFIED["pipeline"]
    more_registers = {**FUZZ_ACCUMULATE_MASKED_MODIFIED, "pipeline": {
        **pipeline, "warp_specialized": {**pipeline["warp_specialized"], "consumer_registers": 240}}}
    unmasked = {**FUZZ_ACCUMULATE_MASKED_MODIFIED, "mask": {"kind": "none"}}
    alibi_only = {**FUZZ_ACCUMULATE_MASKED_MODIFIED, "score_mod": {"alibi": "geometric"}}
    not_accumulating = {**FUZZ_ACCUMULATE_MASKED_MODIFIED, "outputs": {"lse": True, "partial": True}}
    for data in (fewer_keys, more_registers, unmasked, alibi_only, not_accumulating):
        assert not _clean(parse_spec(data)), data


def test_compile_reports_the_backward_kernel_that_spills(tmp_path):
    """s2's forward fits, its dK/dV kernel spilled 4 bytes, and `fagen compile` printed 0: it now
    compiles the backward's kernels too. (A backward register model that refuses s2 is as good.)"""
    try:
        parse_spec(S2)
    except SpecError:
        return
    result = _compile(tmp_path, S2)
    lines = result.output.splitlines()
    assert any("fagen_s2_bwd_dkdv" in line for line in lines), result.output  # every kernel is listed
    assert any("fagen_s2_bwd_preprocess" in line for line in lines), result.output
    if result.exit_code == 0:  # the backward model changed s2's kernels: then none may spill
        assert all("0 bytes stack frame, 0/0 bytes spilled" in line for line in lines if "fagen_s2" in line)
    else:
        assert result.exit_code == 1 and "fagen_s2_bwd_dkdv (backward dkdv)" in result.output.splitlines()[-1]


def test_compile_exits_1_on_a_forward_kernel_that_spills(tmp_path, monkeypatch):
    """s1 under the register model as it was (no accumulating epilogue): it validates, ptxas
    spills it, and `fagen compile` says which kernel and exits 1."""
    monkeypatch.setattr(fagen.plan, "accumulate_epilogue", lambda *args: 0)
    result = _compile(tmp_path, S1)
    assert result.exit_code == 1, result.output
    assert re.search(r"s1 sm_90a: fagen_s1 \(forward\): \d+ registers, \d+ bytes dynamic smem, [1-9]\d* bytes stack "
                     r"frame", result.output), result.output
    assert "fagen_s1 (forward) spill" in result.output.splitlines()[-1]


# A fuzz run's finding (seed 11300): a one-warp mma.sync forward (16 queries, 112 keys, one stage)
# under a top-left chunked mask with softcap, writing split partials: 16 bytes at 254, predicted 252
FUZZ_ONE_WARP = {
    "name": "fuzz", "dtype": "float16", "head_dim": 64, "tiling": {"block_q": 16, "block_kv": 112, "warps_q": 1},
    "pipeline": {"kv_smem": "separate", "stages": 1, "q_in_registers": False, "pingpong": False},
    "smem_layout": "swizzled", "arch": "sm_86", "mask": {"kind": "chunked", "align": "top_left", "chunk_size": 1},
    "score_mod": {"softcap": 30.0}, "outputs": {"lse": True, "partial": True}}


@pytest.mark.parametrize("mask, block_kv", [({"kind": "chunked", "align": "top_left", "chunk_size": 1}, 112),
                                            ({"kind": "none"}, 128)])
def test_a_one_warp_forward_at_many_keys_is_refused_with_a_fix_that_compiles_clean(mask, block_kv):
    """REGISTER_COSTS' one_warp (mma.sync): one-warp blocks spilled 4-76 bytes at a predicted
    246-254 (the finding, and no mask at 128 keys among them): refused now, each with a fix that
    compiles clean; the same kernel on two warps still validates and compiles clean."""
    data = {**FUZZ_ONE_WARP, "mask": mask, "tiling": {**FUZZ_ONE_WARP["tiling"], "block_kv": block_kv}}
    assert not _clean(parse_spec(_block_kv_fix(data)), "sm_86")
    two_warps = {**data, "tiling": {"block_q": 32, "block_kv": block_kv, "warps_q": 2}}
    assert not _clean(parse_spec(two_warps), "sm_86")


# ... and one more at head_dim 96 (seed 30110): a varlen cache under a top-left causal mask with
# sinks and seqused_k, 224 queries and 48 keys: 44 bytes at 255 on sm_80, predicted 254
FUZZ_D96_VARLEN_CAUSAL = {
    "name": "fuzz", "dtype": "float16", "head_dim": 96, "tiling": {"block_q": 224, "block_kv": 48, "warps_q": 7},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": False},
    "smem_layout": "padded", "arch": "sm_80", "mask": {"kind": "causal", "align": "top_left"},
    "score_mod": {"sinks": True}, "outputs": {"lse": True, "partial": False, "merge_splits": False},
    "sequences": {"q": "padded", "kv": "varlen", "seqused_k": True}}


def test_a_varlen_cache_at_head_dim_96_is_refused_with_a_fix_that_compiles_clean():
    """REGISTER_COSTS' varlen_kv_d96 at 9: the finding (its sweep's varlen kernels spilled 40-44
    bytes at a predicted 249-254) is refused with a fix that compiles clean; so is the padded
    cache's kernel at these 32 rows a warp (rows32_d96), and at 16 rows a warp the varlen
    cache's kernel validates and compiles clean."""
    data = FUZZ_D96_VARLEN_CAUSAL
    assert not _clean(parse_spec(_block_kv_fix(data)), "sm_80")
    padded = {**data, "sequences": {"q": "padded", "kv": "padded", "seqused_k": False}}
    assert not _clean(parse_spec(_block_kv_fix(padded)), "sm_80")
    sixteen = {**data, "tiling": {"block_q": 128, "block_kv": 48, "warps_q": 8}}
    assert not _clean(parse_spec(sixteen), "sm_80")


# ... and one more (seed 2718281): a block mask with a matrix bias beside shared K/V slots,
# head_dim 128, 128 x 64: 24 bytes at 255 on sm_89, predicted 246
FUZZ_BIAS_SHARED_KV = {
    "name": "fuzz", "dtype": "float16", "head_dim": 128, "tiling": {"block_q": 128, "block_kv": 64, "warps_q": 8},
    "pipeline": {"kv_smem": "shared", "stages": 2, "q_in_registers": False, "pingpong": False},
    "smem_layout": "swizzled", "arch": "sm_89", "mask": {"kind": "block_mask", "align": "top_left"},
    "score_mod": {"bias": "matrix"}, "outputs": {"lse": True}}


def test_a_bias_beside_shared_kv_slots_is_priced():
    """REGISTER_COSTS' bias_shared_kv (mma.sync): the finding is refused with a fix that compiles
    clean; beside separate slots the same kernel still validates and compiles clean."""
    data = FUZZ_BIAS_SHARED_KV
    assert not _clean(parse_spec(_block_kv_fix(data)), "sm_89")
    assert not _clean(parse_spec({**data, "pipeline": {**data["pipeline"], "kv_smem": "separate"}}), "sm_89")


# ... and one more (seed 161803): an accumulating split partial (the ring's fold) under a top-left
# block mask, head_dim 256, 128 x 32, a claimed walk's 232 consumers: 4 bytes at a predicted 232
FUZZ_ACCUMULATE_BLOCK_MASK = {
    "name": "fuzz", "dtype": "bfloat16", "head_dim": 256, "tiling": {"block_q": 128, "block_kv": 32, "warps_q": 8},
    "pipeline": {"kv_smem": "separate", "stages": 3, "q_in_registers": False, "pingpong": False,
                 "warp_specialized": {"consumer_registers": 232, "persistent": True}},
    "smem_layout": "swizzled", "arch": "sm_90a", "mask": {"kind": "block_mask", "align": "top_left"},
    "score_mod": {"sinks": True}, "outputs": {"lse": True, "partial": True, "accumulate": True, "merge_splits": False}}


def test_an_accumulating_block_mask_kernel_is_priced_with_a_fix_that_compiles_clean():
    """ACCUMULATE_BLOCK_MASK: the finding is refused, and its fix (240 consumers, a static walk)
    compiles clean; the causal twin, which fit at the same 232, still validates and compiles clean."""
    with pytest.raises(SpecError) as err:
        parse_spec(FUZZ_ACCUMULATE_BLOCK_MASK)
    _refused_or_clean(FUZZ_ACCUMULATE_BLOCK_MASK)
    assert "consumer_registers: 240" in str(err.value)
    causal = {**FUZZ_ACCUMULATE_BLOCK_MASK, "mask": {"kind": "causal", "align": "top_left"}}
    assert not _clean(parse_spec(causal))


# ... and one more (seed 1414): the warp-specialised dK/dV kernel with atomic dQ at head_dim 128,
# 128 keys, 64 queries a step, its consumers at 232: 16 bytes spilled at a predicted 231
FUZZ_ATOMIC_DKDV_232 = {
    "name": "fuzz", "dtype": "float16", "head_dim": 128, "tiling": {"block_q": 64, "block_kv": 64, "warps_q": 4},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": False},
    "smem_layout": "swizzled", "arch": "sm_90a", "mask": {"kind": "causal", "align": "bottom_right"},
    "score_mod": {}, "outputs": {"lse": True, "partial": False},
    "backward": {"block_kv": 128, "warps": 8, "block_q": 64, "stages": 2, "dq_block_q": 128, "dq_warps": 8,
                 "dq_block_kv": 64, "deterministic": False,
                 "warp_specialized": {"consumer_registers": 232, "persistent": False}}}


def test_atomic_dq_s_saving_needs_the_consumers_it_was_fitted_at():
    """ATOMIC_DQ_FITTED_CONSUMERS: at 232 consumers the finding is refused, and its fix (the copying
    kernel) compiles clean; at 240 the same kernel still validates and compiles clean."""
    with pytest.raises(SpecError) as err:
        parse_spec(FUZZ_ATOMIC_DKDV_232)
    assert "remove backward.warp_specialized" in str(err.value)
    copying = {**FUZZ_ATOMIC_DKDV_232, "backward": {k: v for k, v in FUZZ_ATOMIC_DKDV_232["backward"].items()
                                                    if k != "warp_specialized"}}
    at_240 = {**FUZZ_ATOMIC_DKDV_232, "backward": {**FUZZ_ATOMIC_DKDV_232["backward"],
                                                   "warp_specialized": {"consumer_registers": 240, "persistent": False}}}
    for data in (copying, at_240):
        assert not _clean(parse_spec(data)), data["backward"]


# ... and one more (seed 8675309): head_dim 96 at 32 rows a warp, a paged cache, split-KV merged in
# the kernel, causal: 4 bytes at 255 on sm_90, predicted 238
FUZZ_D96_ROWS32_PAGED = {
    "name": "fuzz", "dtype": "bfloat16", "head_dim": 96, "tiling": {"block_q": 96, "block_kv": 32, "warps_q": 3},
    "pipeline": {"kv_smem": "separate", "stages": 2, "q_in_registers": False, "pingpong": False},
    "smem_layout": "padded", "arch": "sm_89", "mask": {"kind": "causal", "align": "bottom_right"},
    "outputs": {"lse": True, "partial": True, "merge_splits": True},
    "sequences": {"q": "padded", "kv": "paged", "seqused_k": False}}


def test_head_dim_96_at_32_rows_a_warp_is_priced():
    """REGISTER_COSTS' rows32_d96 (mma.sync): the finding is refused with a fix that compiles clean
    on both archs it targets; at 16 rows a warp (six warps) the same tile still validates and
    compiles clean."""
    data = FUZZ_D96_ROWS32_PAGED
    fixed = parse_spec(_block_kv_fix(data))
    sixteen = parse_spec({**data, "tiling": {**data["tiling"], "warps_q": 6}})
    for spec in (fixed, sixteen):
        for arch in ("sm_89", "sm_90"):
            assert not _clean(spec, arch), (spec.tiling, arch)


FUZZ_D128_ROWS32_VARLEN = {
    "name": "fuzz", "dtype": "bfloat16", "head_dim": 128, "tiling": {"block_q": 256, "block_kv": 32, "warps_q": 8},
    "pipeline": {"kv_smem": "shared", "stages": 3, "q_in_registers": False, "pingpong": False},
    "smem_layout": "padded", "arch": "sm_89", "mask": {"kind": "causal", "align": "bottom_right"},
    "outputs": {"lse": True, "partial": False, "merge_splits": False},
    "sequences": {"q": "varlen", "kv": "padded", "seqused_k": False}}


def test_varlen_queries_at_head_dim_128_and_32_rows_a_warp_are_priced():
    """REGISTER_COSTS' varlen_q_rows32_d128 (mma.sync; a fuzz run's finding: 8 bytes spilled on
    sm_90 at a predicted 254): refused with a fix that compiles clean on both archs it targets;
    its padded twin, which fit, still validates and compiles clean."""
    data = FUZZ_D128_ROWS32_VARLEN
    fixed = parse_spec(_block_kv_fix(data))
    padded = parse_spec({**data, "sequences": {"q": "padded", "kv": "padded", "seqused_k": False}})
    for spec in (fixed, padded):
        for arch in ("sm_89", "sm_90"):
            assert not _clean(spec, arch), (spec.tiling, spec.sequences, arch)


def test_sinks_hold_no_register_through_a_warp_specialised_loop():
    """Sinks join the row sum in the epilogue: head_dim 64's long class (192 x 128 at the 160
    registers three consumer warpgroups get) keeps its tile with them (it fell back to 128 x 128,
    10-21% slower on the H200, when they were priced in the loop) and compiles clean."""
    from fagen import variants
    from fagen.spec import Mask, ScoreMod
    for dtype in ("float16", "bfloat16"):
        long = variants.shipped_spec(dtype, 64, True, gpu="h200", keys=variants.LONG_KEYS)
        with_sinks = variants.variant(long, Mask(kind="causal"), ScoreMod(sinks=True))
        assert (with_sinks.tiling, with_sinks.pipeline) == (long.tiling, long.pipeline)
        assert not _clean(with_sinks), dtype


def test_the_causal_long_class_keeps_its_tile_with_a_softcap_or_alibi():
    """fagen.plan.CONSUMERS_MEASURED_FIT: head_dim 128's causal long class (192 x 80) with a softcap,
    ALiBi slopes or both keeps its tile (the fit priced it at 169-175 of 160 and fell back to 128 x
    128, 7-11% slower with a softcap on the H200), and with both at the measured 152 registers it
    compiles clean; a bias, which the measurement did not cover, still falls back."""
    from fagen import variants
    from fagen.spec import Mask, ScoreMod
    causal = Mask(kind="causal")
    for dtype in ("float16", "bfloat16"):
        long = variants.shipped_spec(dtype, 128, True, gpu="h200", keys=variants.LONG_KEYS)
        for mod in (ScoreMod(softcap=30.0), ScoreMod(alibi="slopes"), ScoreMod(softcap=30.0, alibi="slopes", sinks=True)):
            assert variants.variant(long, causal, mod).tiling == long.tiling, (dtype, mod)
        assert variants.variant(long, causal, ScoreMod(bias="vector")).tiling.block_kv < long.tiling.block_kv
        both = variants.variant(long, causal, ScoreMod(softcap=30.0, alibi="slopes", sinks=True)).model_dump()
        ws = {**both["pipeline"]["warp_specialized"], "consumer_registers": 152}
        at_152 = parse_spec({**both, "name": both["name"] + "_r152", "pipeline": {**both["pipeline"], "warp_specialized": ws}})
        assert not _clean(at_152), dtype



def test_the_head_dim_256_fp8_forward_takes_sinks_and_compiles_clean():
    """Sinks cost a warp-specialised loop nothing, so head_dim 256's FP8 tile (128 x 128 at 240, no
    register to spare for a softcap) takes them: and compiles clean with them, causal or not."""
    from fagen.spec import Mask, ScoreMod
    from fagen.variants import fp8_spec
    for mask in (Mask(), Mask(kind="causal")):
        assert not _clean(fp8_spec("float8_e4m3", 256, mask, ScoreMod(sinks=True))), mask
