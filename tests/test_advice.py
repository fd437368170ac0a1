"""Advice that validates: every fix a refusal offers, applied as the message states it (SpecError.fix,
the fields and values the text names), gives a spec that validates. The corpus breaks every rule
of fagen/spec.py that offers a change of fields and every resource rule of fagen/plan.py and
fagen/backward_plan.py (checked from the sources), and the type errors."""

from __future__ import annotations

import ast
import copy
import inspect
import math
import sys

import pytest
import yaml
from click.testing import CliRunner

import fagen
import fagen.backward_plan
import fagen.cli
import fagen.load
import fagen.plan
import fagen.spec
from fagen.load import SPECS, with_fix
from fagen.spec import REMOVE, SpecError
from tests.conftest import BASE

SM80 = copy.deepcopy(BASE)
SM80_BWD = {**copy.deepcopy(BASE), "head_dim": 64, "backward": {}}  # mma.sync backward
# warp-specialised, pingpong; at 128 keys a tile (its tuned 176 leaves the copying and masked
# variants below no registers to spare)
HOPPER = with_fix(yaml.safe_load((SPECS / "attn_f16_d128_h200.yaml").read_text()), {"tiling.block_kv": 128})
HOPPER_BWD = yaml.safe_load((SPECS / "attn_f16_d128_causal_h200.yaml").read_text())  # + a wgmma backward
COPYING_HOPPER = with_fix(HOPPER, {"pipeline.warp_specialized": REMOVE, "pipeline.pingpong": False})
DECODE = yaml.safe_load((SPECS / "decode_bf16_d128.yaml").read_text())  # GQA-packed split-KV, mma.sync
# 128/64 on sm_90a, a backward at 32 queries a step: its wgmma loops, or mma.sync's (backward.mma)
TWO_WIDTHS_HOPPER_BWD = with_fix(yaml.safe_load((SPECS / "value_head_f16_d128_v64_sm90a.yaml").read_text()),
                                 {"backward.block_q": 32})

CORPUS = {  # id: (a valid spec, the changes that break it)
    # types: a value every field of that type would refuse
    "float head_dim": (SM80, {"head_dim": 1.5}),
    "integral float head_dim": (SM80, {"head_dim": 128.0}),
    "bool head_dim": (SM80, {"head_dim": True}),
    "inf head_dim": (SM80, {"head_dim": math.inf}),
    "list head_dim": (SM80, {"head_dim": [128]}),
    "quoted head_dim": (SM80, {"head_dim": "128"}),
    "float block_q": (SM80, {"tiling.block_q": 64.5}),
    "bool block_kv": (SM80, {"tiling.block_kv": True}),
    "bool stages": (SM80, {"pipeline.stages": True}),
    "float consumer_registers": (HOPPER, {"pipeline.warp_specialized.consumer_registers": 240.5}),
    "list backward.warps": (HOPPER_BWD, {"backward.warps": [8]}),
    "inf window": (SM80, {"mask": {"kind": "sliding_window", "window_left": math.inf}}),
    "text for a bool": (SM80, {"pipeline.q_in_registers": "yes"}),
    "quoted softcap": (SM80, {"score_mod.softcap": "30"}),
    "dtype": (SM80, {"dtype": "float32"}),
    "e5m2 off sm_90a": (SM80, {"dtype": "float8_e5m2"}),
    "fp8 off sm_90a": (SM80, {"dtype": "float8_e4m3"}),
    "fp8 with 176-key tiles": (HOPPER, {"dtype": "float8_e4m3", "out_dtype": "bfloat16", "tiling.block_kv": 176}),
    "fp8 without out_dtype": (HOPPER, {"dtype": "float8_e4m3"}),
    "fp8 at d64": (HOPPER, {"dtype": "float8_e4m3", "out_dtype": "bfloat16", "head_dim": 64}),
    "fp8 with a narrower v": (HOPPER, {"dtype": "float8_e4m3", "out_dtype": "bfloat16", "head_dim_v": 64}),
    "fp8 packing gqa": (HOPPER, {"dtype": "float8_e4m3", "out_dtype": "bfloat16", "tiling.pack_gqa": True}),
    "fp8 partial": (HOPPER, {"dtype": "float8_e4m3", "out_dtype": "bfloat16", "outputs.partial": True}),
    "fp8 merging splits": (HOPPER, {"dtype": "float8_e4m3", "out_dtype": "bfloat16", "outputs.partial": True,
                                    "outputs.merge_splits": True}),
    "fp8 hopper spec on sm_80": (HOPPER, {"dtype": "float8_e4m3", "out_dtype": "bfloat16", "arch": "sm_80"}),
    "fp8 paged": (HOPPER, {"dtype": "float8_e4m3", "out_dtype": "bfloat16", "sequences": {"q": "varlen", "kv": "paged"}}),
    "fp8 with a backward": (HOPPER_BWD, {"dtype": "float8_e4m3", "out_dtype": "bfloat16"}),
    "kv_dtype unlike q": (SM80, {"kv_dtype": "float8_e4m3"}),
    "kv_dtype another half type": (SM80, {"kv_dtype": "bfloat16" if SM80["dtype"] == "float16" else "float16"}),
    "fp8 kv cache on sm_80": (DECODE, {"kv_dtype": "float8_e4m3"}),
    "fp8 kv cache, padded rows, q in registers": (DECODE, {"kv_dtype": "float8_e5m2", "arch": "sm_90",
                                                          "smem_layout": "padded", "pipeline.q_in_registers": True}),
    "fp8 kv cache at d96": (DECODE, {"kv_dtype": "float8_e4m3", "arch": "sm_90", "head_dim": 96}),
    "fp8 kv cache, 16-key warps": (DECODE, {"kv_dtype": "float8_e4m3", "arch": "sm_90", "tiling.block_kv": 64}),
    "fp8 kv cache with a backward": (DECODE, {"kv_dtype": "float8_e4m3", "arch": "sm_90", "backward": {}}),
    "fp8 kv cache writing f16": (DECODE, {"kv_dtype": "float8_e4m3", "arch": "sm_90", "out_dtype": "float16"}),
    "fp8 q beside a half-type cache": (DECODE, {"q_dtype": "float8_e4m3"}),
    "fp8 q of another type than the cache's": (DECODE, {"kv_dtype": "float8_e4m3", "arch": "sm_90",
                                                       "q_dtype": "float8_e5m2"}),
    "out_dtype unlike q": (HOPPER, {"out_dtype": "bfloat16"}),
    # two head widths
    "head_dim_v not a head width": (SM80, {"head_dim_v": 100}),
    "head_dim_v off the swizzle atom": (COPYING_HOPPER, {"head_dim_v": 96}),
    "head_dim_v beside a 96-wide head": (SM80, {"head_dim": 96, "head_dim_v": 64}),
    "head_dim 192 without its V": (SM80, {"head_dim": 192}),
    "head_dim_v with the dQ kernel's producer": (HOPPER_BWD, {"head_dim_v": 64, "backward.block_q": 32,
                                                            "backward.deterministic": True,
                                                            "backward.dq_warp_specialized": {"consumer_registers": 232}}),
    "head_dim_v with warps_kv on sm_90a": (COPYING_HOPPER, {"head_dim_v": 64, "tiling.warps_kv": 2}),
    "head_dim_v with split-KV partials on sm_90a": (COPYING_HOPPER, {"head_dim_v": 64, "outputs.partial": True}),
    "head_dim_v folding a running output": (SM80, {"head_dim_v": 64, "outputs.accumulate": True, "outputs.partial": True}),
    "head_dim_v under a swizzle": (SM80, {"head_dim": 32, "head_dim_v": 32, "smem_layout": "swizzled"}),
    "mask kind": (SM80, {"mask": {"kind": "casual"}}),
    "list tiling": (SM80, {"tiling": [64, 64]}),
    "unknown key": (SM80, {"foo": 1}),
    "missing tiling": (SM80, {"tiling": REMOVE}),
    "missing block_kv": (SM80, {"tiling.block_kv": REMOVE}),
    "missing dtype": (SM80, {"dtype": REMOVE}),
    "number name": (SM80, {"name": 5}),
    # Tiling
    "warps_q": (SM80, {"tiling.warps_q": 9}),
    "warps_kv": (SM80, {"tiling.warps_kv": 3}),
    "block_kv": (SM80, {"tiling.block_kv": 40}),
    "rows per warp": (SM80, {"tiling.block_q": 48}),
    "rows per warp, sm_90a": (HOPPER, {"tiling.block_q": 100}),
    "mma.sync block_q on sm_90a": (HOPPER, {"tiling.block_q": 256}),
    # register splits
    "consumer registers": (HOPPER, {"pipeline.warp_specialized.consumer_registers": 248}),
    "producer too high for any consumer split": (
        HOPPER_BWD, {"backward.deterministic": True,
                     "backward.dq_warp_specialized": {"producer_registers": 128, "consumer_registers": 232}}),
    "producer at the consumers": (HOPPER_BWD, {"backward.warp_specialized": {"producer_registers": 200,
                                                                             "consumer_registers": 200}}),
    "producer not below": (COPYING_HOPPER, {"tiling.block_kv": 64, "pipeline.warp_specialized":
                                            {"producer_registers": 160, "consumer_registers": 160}}),
    "setmaxnreg operand": (HOPPER, {"pipeline.warp_specialized.consumer_registers": 7}),
    "setmaxnreg operand in backward": (HOPPER_BWD, {"backward.warp_specialized.producer_registers": 5}),
    # Pipeline, masks, score modifiers, outputs, sequences
    "stages": (SM80, {"pipeline.stages": 4}),
    "mask expression": (SM80, {"mask": {"kind": "causal", "expression": "q_idx ++"}}),
    "score expression": (SM80, {"score_mod.expression": "score;"}),
    "expression_grad": (SM80, {"score_mod": {"expression": "score * 2.0f", "expression_grad": "{"}}),
    "field of another kind": (SM80, {"mask": {"kind": "causal", "window_left": 5}}),
    "window below 0": (SM80, {"mask": {"kind": "sliding_window", "window_left": -1}}),
    "causal refines documents": (SM80, {"mask": {"kind": "causal", "causal": True}}),
    "required window": (SM80, {"mask": {"kind": "sliding_window"}}),
    "softcap range": (SM80, {"score_mod.softcap": 1e7}),
    "grad without expression": (SM80, {"score_mod.expression_grad": "1.0f"}),
    "captured arrays": (SM80, {"score_mod": {"captured": 9, "expression": "score + captured0[q_idx]"}}),
    "captured without expression": (SM80, {"score_mod.captured": 1}),
    "partial without lse": (SM80, {"outputs": {"lse": False, "partial": True}}),
    "accumulate without partial": (SM80, {"outputs.accumulate": True}),
    "merge_splits without partial": (SM80, {"outputs.merge_splits": True}),
    "seqused_k": (SM80, {"sequences": {"seqused_k": True}}),
    # Backward fields
    "backward warps": (HOPPER_BWD, {"backward.warps": 3}),
    "backward dq_warps": (SM80_BWD, {"backward.dq_warps": 3}),
    "head_split": (SM80_BWD, {"backward.head_split": 3}),
    "backward mma not a loop": (TWO_WIDTHS_HOPPER_BWD, {"backward.mma": "wgmma"}),
    "backward mma with no wgmma loops": (SM80_BWD, {"backward.mma": "mma_sync"}),
    "backward stages": (SM80_BWD, {"backward.stages": 5}),
    "backward block_q": (SM80_BWD, {"backward.block_q": 40}),
    "head_split divides warps": (SM80_BWD, {"backward.warps": 1, "backward.block_kv": 16, "backward.block_q": 16,
                                             "backward.head_split": 2}),
    "backward rows per warp": (SM80_BWD, {"backward.block_kv": 48}),
    # AttentionSpec
    "name case": (SM80, {"name": "Flash"}),
    "name underscores": (SM80, {"name": "_a__b"}),
    "head_dim": (SM80, {"head_dim": 100}),
    "swizzle": (SM80, {"smem_layout": "swizzled", "head_dim": 96}),
    "three warpgroups off sm_90a": (SM80, {"tiling": {"block_q": 192, "block_kv": 64, "warps_q": 12}}),
    "pingpong off sm_90a": (SM80, {"pipeline.pingpong": True}),
    "producer off sm_90a": (SM80, {"pipeline.warp_specialized": {}}),
    "three warpgroups without a producer": (COPYING_HOPPER, {"tiling": {"block_q": 192, "block_kv": 128,
                                                                        "warps_q": 12}}),
    "warpgroups": (HOPPER, {"tiling": {"block_q": 96, "block_kv": 128, "warps_q": 6}}),
    "sm_90a head_dim": (COPYING_HOPPER, {"head_dim": 96}),
    "sm_90a swizzle": (HOPPER, {"smem_layout": "padded"}),
    "sm_90a pipeline": (HOPPER, {"pipeline.kv_smem": "shared"}),
    "sm_90a q_in_registers": (HOPPER, {"pipeline.q_in_registers": True}),
    "pingpong of one warpgroup": (COPYING_HOPPER, {"tiling": {"block_q": 64, "block_kv": 128, "warps_q": 4},
                                                   "pipeline.pingpong": True}),
    "producer with a paged cache": (HOPPER, {"sequences": {"q": "varlen", "kv": "paged"}, "tiling.block_kv": 64}),
    "producer beside one consumer": (HOPPER, {"tiling": {"block_q": 64, "block_kv": 128, "warps_q": 4},
                                              "pipeline.pingpong": False}),
    "pack_gqa on sm_90a": (COPYING_HOPPER, {"tiling.pack_gqa": True}),
    "pack_gqa with documents": (SM80, {"tiling.pack_gqa": True, "mask": {"kind": "document"}}),
    "pack_gqa with a bias": (SM80, {"tiling.pack_gqa": True, "score_mod.bias": "vector"}),
    "pack_gqa with a backward": (SM80_BWD, {"tiling.pack_gqa": True}),
    "warps_kv on sm_90a": (COPYING_HOPPER, {"tiling.warps_kv": 2}),
    "warps_kv share": (SM80, {"tiling.warps_kv": 8}),
    "warps_kv warps": (SM80, {"tiling": {"block_q": 64, "block_kv": 128, "warps_q": 4, "warps_kv": 4}}),
    "warps_kv with documents": (SM80, {"tiling.warps_kv": 2, "mask": {"kind": "document"}}),
    "warps_kv with a backward": (SM80_BWD, {"tiling.warps_kv": 2}),
    "accumulate packed": (SM80, {"outputs": {"partial": True, "accumulate": True}, "tiling.pack_gqa": True}),
    "accumulate varlen": (SM80, {"outputs": {"partial": True, "accumulate": True},
                                 "sequences": {"q": "varlen", "kv": "varlen"}}),
    "merge_splits varlen": (SM80, {"outputs": {"partial": True, "merge_splits": True},
                                   "sequences": {"q": "varlen", "kv": "varlen"}}),
    "merge_splits with a producer": (HOPPER, {"outputs": {"partial": True, "merge_splits": True}}),
    "varlen documents": (SM80, {"sequences": {"q": "varlen", "kv": "varlen"}, "mask": {"kind": "document"}}),
    "varlen bias": (SM80, {"sequences": {"q": "varlen", "kv": "varlen"}, "score_mod.bias": "matrix"}),
    "varlen backward": (SM80_BWD, {"sequences": {"q": "varlen", "kv": "varlen"}}),
    "expression without its derivative": (SM80_BWD, {"score_mod.expression": "score * 0.5f"}),
    "bias_grad without a bias": (SM80_BWD, {"backward.bias_grad": True}),
    "bias_grad between two nonlinear factors": (
        SM80_BWD, {"backward.bias_grad": True, "backward.block_q": 16, "score_mod": {"bias": "vector", "softcap": 30.0,
                                                             "expression": "score", "expression_grad": "1.0f"}}),
    "captured_grads past the arrays": (
        SM80_BWD, {"backward.captured_grads": [1], "score_mod": {"expression": "score + captured0[h]",
                                                                 "expression_grad": "1.0f", "captured": 1}}),
    "captured_grads of a read whose derivative is the score": (
        SM80_BWD, {"backward.captured_grads": [0], "score_mod": {"expression": "score * captured0[h]",
                                                                 "expression_grad": "captured0[h]", "captured": 1}}),
    "captured_grads of an array only compared": (
        SM80_BWD, {"backward.captured_grads": [0], "score_mod": {"expression": "captured0[h] > 0.0f ? score : 0.0f",
                                                                 "expression_grad": "captured0[h] > 0.0f ? 1.0f : 0.0f",
                                                                 "captured": 1}}),
    "captured_grads of a read with no bound": (
        SM80_BWD, {"backward.captured_grads": [0], "score_mod": {"expression": "score + logf(captured0[h])",
                                                                 "expression_grad": "1.0f", "captured": 1}}),
    "captured_grads beside bias_grad": (
        SM80_BWD, {"backward.captured_grads": [0], "backward.bias_grad": True, "backward.block_q": 16,
                   "score_mod": {"bias": "vector", "expression": "score * 0.5f + captured0[h]",
                                 "expression_grad": "0.5f", "captured": 1}}),
    "backward of partials": (SM80_BWD, {"outputs.partial": True}),
    "backward without lse": (SM80_BWD, {"outputs.lse": False}),
    "wgmma backward tiles": (HOPPER_BWD, {"backward.warps": 4}),
    "backward producer on mma.sync": (SM80_BWD, {"backward.warp_specialized": {}}),
    "wgmma backward stages": (HOPPER_BWD, {"backward.stages": 1}),
    "atomic dQ tiles": (HOPPER_BWD, {"backward.block_q": 128}),
    "wgmma dQ tiles": (HOPPER_BWD, {"backward.deterministic": True, "backward.dq_block_q": 32,
                                    "backward.dq_warps": 2}),
    "dQ producer without a dQ kernel": (HOPPER_BWD, {"backward.dq_warp_specialized": {}}),
    "persistent dQ producer": (HOPPER_BWD, {"backward.deterministic": True,
                                            "backward.dq_warp_specialized": {"consumer_registers": 232,
                                                                             "persistent": True}}),
    # the forward's resources (fagen/plan.py)
    "shared memory": (SM80, {"pipeline.stages": 3, "tiling.block_kv": 128}),
    "key warps' merge over the ring": (SM80, {"tiling.warps_kv": 2, "tiling.block_kv": 32}),
    "block-size rule": (SM80, {"head_dim": 256, "arch": "sm_86", "pipeline": {"kv_smem": "shared", "stages": 1}}),
    "registers": (SM80, {"head_dim": 256}),
    "consumer registers under the tile": (HOPPER, {"tiling.block_kv": 176,
                                                   "pipeline.warp_specialized.consumer_registers": 200}),
    # the backward's resources (fagen/backward_plan.py)
    "dQ kernel's forward tiling": (SM80_BWD, {"backward.dq_block_q": 128, "backward.dq_block_kv": 128}),
    "dQ registers": (SM80_BWD, {"score_mod.softcap": 30.0, "backward.dq_block_kv": 128}),
    "dQ shared memory": (SM80_BWD, {"arch": "sm_86", "backward.dq_block_q": 128, "backward.dq_block_kv": 128,
                                    "backward.dq_warps": 8}),
    "dK/dV shared memory": (SM80_BWD, {"arch": "sm_86", "backward.stages": 3, "backward.block_q": 128}),
    "persistent dK/dV shared memory": (HOPPER_BWD, {"backward.stages": 3,
                                                    "backward.warp_specialized": {"persistent": True}}),
    "dK/dV registers": (SM80_BWD, {"backward.block_q": 128}),
}
# Rules that parse_spec never reaches, each with a call that breaks it: (valid spec, the call)
UNPARSED = {"no backward section": (SM80, fagen.backward_plan.backward_plan)}
# The modules whose rule(...) calls the corpus must break: spec's rules, the forward's and the
# backward's resource rules (searched_rule: a rule whose fix is searched for)
RULE_MODULES = (fagen.spec, fagen.plan, fagen.backward_plan)
RULE_FUNCTIONS = ("rule", "searched_rule")


def refusal(data: dict) -> SpecError:
    with pytest.raises(SpecError) as info:
        fagen.parse_spec(data)
    return info.value


def yaml_text(value: object) -> str:
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False).strip().removesuffix("...").strip()


def test_the_bases_validate():
    for data in (SM80, SM80_BWD, HOPPER, HOPPER_BWD, COPYING_HOPPER):
        fagen.parse_spec(data)


@pytest.mark.parametrize("case", list(CORPUS))
def test_the_fix_a_message_offers_validates(case):
    valid, changes = CORPUS[case]
    err = refusal(with_fix(valid, changes))
    message = str(err)
    assert err.fix, f"no fix to apply in: {message}"
    for field, value in err.fix.items():  # what is applied is what the message says
        leaf = field.split(".")[-1]
        if value is REMOVE:
            assert ("remove" in message or "without" in message) and leaf in message, (field, message)
        else:
            assert yaml_text(value) in message or repr(value) in message, (field, value, message)
    fixed = with_fix(with_fix(valid, changes), err.fix)
    try:
        fagen.parse_spec(fixed)
    except SpecError as again:
        pytest.fail(f"{message}\n  applying {err.fix} is refused too:\n  {again}")


@pytest.mark.parametrize("case", list(UNPARSED))
def test_the_fix_of_a_rule_parse_spec_never_reaches_validates(case):
    valid, call = UNPARSED[case]
    with pytest.raises(SpecError) as info:
        call(fagen.parse_spec(valid))
    assert info.value.fix, str(info.value)
    fagen.parse_spec(with_fix(valid, info.value.fix))


def rule_calls_with_a_change(module) -> list[tuple[int, int]]:
    """The line spans of `module`'s rule(...) calls that pass a change of fields, and of its
    searched_rule(...) calls (each searches one)."""
    source = inspect.getsource(module)
    return [(node.lineno, node.end_lineno) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in RULE_FUNCTIONS
            and (node.func.id == "searched_rule" or len(node.args) >= 5 or node.keywords
                 or any(isinstance(a, ast.Starred) for a in node.args))]


def rule_calls_without_a_change(module) -> list[str]:
    """The resource modules' rule(...) calls that pass no change: advice no search backs."""
    source = inspect.getsource(module)
    return [ast.get_source_segment(source, node)[:120] for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "rule"
            and not (len(node.args) >= 5 or node.keywords or any(isinstance(a, ast.Starred) for a in node.args))]


@pytest.mark.parametrize("module", [fagen.plan, fagen.backward_plan], ids=lambda m: m.__name__)
def test_every_resource_rule_offers_a_change(module):
    assert not rule_calls_without_a_change(module)


def test_the_corpus_breaks_every_rule_that_offers_a_change(monkeypatch):
    hit: set[tuple[str, int]] = set()
    trying = []

    def recording(original):
        def record(*args, **kwargs):
            if not trying:
                caller = sys._getframe(1)
                hit.add((caller.f_globals["__name__"], caller.f_lineno))
            return original(*args, **kwargs)
        return record

    fitting = fagen.load._fitting

    def quiet(*args):  # the values a type error's message offers are tried, not refused
        trying.append(1)
        try:
            return fitting(*args)
        finally:
            trying.pop()

    def searching(first_valid):  # the specs a fix search tries break rules too: not the corpus's
        def search(*args):
            trying.append(1)
            try:
                return first_valid(*args)
            finally:
                trying.pop()
        return search

    for module in RULE_MODULES:  # each module's own name for rule and searched_rule
        for name in RULE_FUNCTIONS:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, recording(getattr(module, name)))
    monkeypatch.setattr(fagen.load, "_fitting", quiet)
    monkeypatch.setattr(fagen.plan, "first_valid", searching(fagen.plan.first_valid))
    monkeypatch.setattr(fagen.backward_plan, "first_valid", searching(fagen.backward_plan.first_valid))
    for valid, changes in CORPUS.values():
        with pytest.raises(SpecError):
            fagen.parse_spec(with_fix(valid, changes))
    for valid, call in UNPARSED.values():
        with pytest.raises(SpecError):
            call(fagen.parse_spec(valid))
    missed = []
    for module in RULE_MODULES:
        lines = inspect.getsource(module).splitlines()
        missed += [f"{module.__name__}: {lines[a - 1].strip()}" for a, b in rule_calls_with_a_change(module)
                   if not any(name == module.__name__ and a <= line <= b for name, line in hit)]
    assert not missed, "rules no corpus spec breaks:\n" + "\n".join(missed)


# ---- the particular advice the issue found refused ------------------------------------------------


@pytest.mark.parametrize("value", [1.5, True, math.inf, [128], {"d": 1}])
def test_an_integer_field_is_offered_an_integer_that_validates(value):
    err = refusal({**SM80, "head_dim": value})
    assert "head_dim: 2" not in str(err) and err.fix["head_dim"] in (32, 64, 96, 128, 256), str(err)


def test_yaml_exponents_are_numbers_but_quotes_are_text():
    text = (SPECS / "attn_f16_d128.yaml").read_text()
    assert fagen.parse_spec(text + "score_mod: {softcap: 3e1}\n").score_mod.softcap == 30.0
    assert fagen.parse_spec(text + "score_mod: {softcap: 1.5E+1}\n").score_mod.softcap == 15.0
    message = str(refusal(text + "score_mod: {softcap: 1e7}\n"))
    assert "must be a finite number in [1e-3, 1e6]" in message and "without quotes" not in message
    assert "without quotes" in str(refusal(text + "score_mod: {softcap: \"1e1\"}\n"))
    assert "without quotes" in str(refusal(text.replace("head_dim: 128", "head_dim: \"128\"")))


def test_sm90a_is_offered_only_the_rows_it_takes():
    message = str(refusal(with_fix(HOPPER, {"tiling.block_q": 100})))
    assert "block_q: 128" in message and "256" not in message and "384" not in message


def test_a_split_fix_leaves_the_producer_below_the_consumers():
    err = refusal(with_fix(HOPPER_BWD, {"backward.deterministic": True, "backward.dq_warp_specialized":
                                        {"producer_registers": 128, "consumer_registers": 232}}))
    assert "consumer_registers <= 128" not in str(err)
    assert err.fix["backward.dq_warp_specialized.producer_registers"] < \
        err.fix["backward.dq_warp_specialized.consumer_registers"]


def test_a_stem_that_is_no_name_is_told_to_rename_the_file(tmp_path):
    path = tmp_path / "bad.yaml.yaml"
    path.write_text(yaml.safe_dump({**SM80, "name": "bad"}))
    with pytest.raises(SpecError) as info:
        fagen.load_spec(path)
    assert "name: bad.yaml" not in str(info.value) and "rename the file to bad.yaml" in str(info.value)
    (tmp_path / "bad.yaml").write_text(path.read_text())
    assert fagen.load_spec(tmp_path / "bad.yaml").name == "bad"


def test_a_stem_that_is_a_name_is_offered_as_the_name(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({**SM80, "name": "other"}))
    with pytest.raises(SpecError) as info:
        fagen.load_spec(path)
    assert info.value.fix == {"name": "mine"} and "name: mine" in str(info.value)
    path.write_text(yaml.safe_dump(with_fix({**SM80, "name": "other"}, info.value.fix)))
    assert fagen.load_spec(path).name == "mine"


@pytest.mark.parametrize("out", [".png", "pics/.png"])
def test_mask_show_refuses_a_png_without_a_name(out, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pics").mkdir()
    result = CliRunner().invoke(fagen.cli.main, ["mask", "show", "causal", "-n", "256", "-o", out])
    assert result.exit_code == 2, result.output
    assert "mask.png" in result.output and "Error" in result.output
    assert not list(tmp_path.rglob("*.png"))


def test_a_kernel_names_its_spec_file_and_not_specs_wherever_it_lives(tmp_path, monkeypatch):
    """The banner names the spec's file name (load_spec holds it to <name>.yaml), so a kernel
    rendered from any folder, by any path, reads the same, and never claims specs/."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "attn_f16_d128.yaml").write_text((SPECS / "attn_f16_d128.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(fagen.cli.main, ["render", "mine/attn_f16_d128.yaml", "-o", "out"])
    assert result.exit_code == 0, result.output
    banner = (tmp_path / "out" / "attn_f16_d128.cu").read_text().splitlines()[:2]
    assert "from attn_f16_d128.yaml" in banner[0] and "fagen render attn_f16_d128.yaml" in banner[1]
    assert "specs/" not in "\n".join(banner)
    assert (tmp_path / "out" / "attn_f16_d128.cu").read_text() == fagen.render(fagen.load_spec(SPECS / "attn_f16_d128.yaml"))


@pytest.mark.parametrize("section, value", [("mask", 5), ("score_mod", 5), ("score_mod", 1e3)])
def test_an_expression_written_as_a_number_is_offered_text_that_validates(section, value):
    data = with_fix(SM80, {f"{section}.expression": value, **({"mask.kind": "causal"} if section == "mask" else {})})
    err = refusal(data)
    assert f"{section}.expression" in str(err) and isinstance(err.fix[f"{section}.expression"], str)
    fagen.parse_spec(with_fix(data, err.fix))
