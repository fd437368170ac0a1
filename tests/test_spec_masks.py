"""The spec's mask and score_mod sections: validation, the kernel parameters the plan derives
from them, and what the templates render for them."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

import fagen
from fagen.plan import plan
from fagen.load import SPECS

BASE = {  # specs/sliding_window_f16_d128.yaml
    "name": "sliding_window_f16_d128",
    "dtype": "float16",
    "head_dim": 128,
    "tiling": {"block_q": 64, "block_kv": 64, "warps_q": 4},
    "pipeline": {"kv_smem": "separate", "stages": 1},
    "smem_layout": "padded",
    "mask": {"kind": "sliding_window", "window_left": 1024, "window_right": 0},
    "arch": "sm_80",
}

FIXED_PARAMS = ["q", "k", "v", "o", "lse", "n_q", "n_kv", "mask_offset", "heads_q", "group", "q_sb", "q_sh", "q_sn",
                "k_sb", "k_sh", "k_sn", "v_sb", "v_sh", "v_sn", "o_sb", "o_sh", "o_sn", "scale", "scale_log2",
                "q_descale", "q_descale_sb", "q_descale_sh", "k_descale", "k_descale_sb", "k_descale_sh", "v_descale",
                "v_descale_sb", "v_descale_sh"]
BM_PARAMS = ["bm_num", "bm_idx", "bm_type", "bm_partial", "bm_bits", "bm_sb", "bm_sh", "bm_max", "bm_causal_offset"]
BIAS_PARAMS = ["bias", "bias_sb", "bias_sh", "bias_sq"]


def spec_dict(**overrides) -> dict:
    data = copy.deepcopy(BASE)
    data.update(copy.deepcopy(overrides))
    return data


def parse(**overrides):
    return fagen.parse_spec(spec_dict(**overrides))


def rejected(**overrides) -> str:
    with pytest.raises(fagen.SpecError) as info:
        parse(**overrides)
    return str(info.value)


def param_names(spec) -> list[str]:
    return [name for _, name in plan(spec).extra_params]


def test_base_matches_the_committed_yaml():
    committed = yaml.safe_load((SPECS / "sliding_window_f16_d128.yaml").read_text())
    assert committed.pop("backward") == {"block_q": 32}  # the forward's fields are BASE's
    assert committed == BASE


# ---- mask validation -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["none", "causal", "block_mask", "document"])
def test_mask_string_shorthand(kind):
    short = parse(mask=kind)
    long = parse(mask={"kind": kind})
    assert short.mask == long.mask and short == long
    assert short.mask.kind == kind


def test_mask_defaults():
    mask = parse(mask="causal").mask
    assert mask.align == "bottom_right" and mask.expression is None and mask.causal is False
    assert parse(mask={"kind": "sliding_window", "window_left": 3}).mask.window_right is None


@pytest.mark.parametrize("mask", ["diagonal", {"kind": "Causal"}, {"kind": "window"}])
def test_unknown_mask_kind_refused(mask):
    assert "mask.kind" in rejected(mask=mask)


def test_unknown_mask_key_refused():
    assert "mask.window" in rejected(mask={"kind": "sliding_window", "window_left": 3, "window": 4})


def test_window_left_required():
    msg = rejected(mask={"kind": "sliding_window", "window_right": 4})
    assert "mask.window_left" in msg and "required" in msg


@pytest.mark.parametrize("kind, field", [("chunked", "chunk_size"), ("prefix_lm", "prefix_len")])
def test_kind_fields_required(kind, field):
    assert f"mask.{field}" in rejected(mask={"kind": kind})


@pytest.mark.parametrize("mask, field", [
    ({"kind": "causal", "chunk_size": 64}, "chunk_size"),
    ({"kind": "causal", "window_left": 64}, "window_left"),
    ({"kind": "none", "prefix_len": 8}, "prefix_len"),
    ({"kind": "chunked", "chunk_size": 8, "window_right": 2}, "window_right"),
    ({"kind": "sliding_window", "window_left": 8, "chunk_size": 2}, "chunk_size"),
    ({"kind": "document", "prefix_len": 2}, "prefix_len"),
    ({"kind": "block_mask", "window_left": 2}, "window_left"),
])
def test_field_of_another_kind_refused(mask, field):
    msg = rejected(mask=mask)
    assert f"mask.{field}" in msg and repr(mask["kind"]) in msg


@pytest.mark.parametrize("mask, field", [
    ({"kind": "sliding_window", "window_left": -1}, "window_left"),
    ({"kind": "sliding_window", "window_left": 4, "window_right": -3}, "window_right"),
    ({"kind": "chunked", "chunk_size": 0}, "chunk_size"),
    ({"kind": "chunked", "chunk_size": -64}, "chunk_size"),
    ({"kind": "prefix_lm", "prefix_len": 0}, "prefix_len"),
])
def test_negative_or_zero_sizes_refused(mask, field):
    assert f"mask.{field}" in rejected(mask=mask)


def test_zero_windows_accepted():
    mask = parse(mask={"kind": "sliding_window", "window_left": 0, "window_right": 0}).mask
    assert (mask.window_left, mask.window_right) == (0, 0)


@pytest.mark.parametrize("kind", ["causal", "none", "sliding_window", "block_mask"])
def test_mask_causal_only_for_document(kind):
    mask = {"kind": kind, "causal": True}
    if kind == "sliding_window":
        mask["window_left"] = 8
    assert "mask.causal" in rejected(mask=mask)


def test_document_causal_accepted():
    assert parse(mask={"kind": "document", "causal": True}).mask.causal is True


@pytest.mark.parametrize("expr", [
    "q_idx > 0; return", "{ true }", "q_idx > kv_idx }", "(q_idx > kv_idx", "q_idx > kv_idx)",
    ")(", "#define x 1", "q_idx\n> 0", "", "   ",
])
def test_bad_mask_expression_refused(expr):
    assert "mask.expression" in rejected(mask={"kind": "causal", "expression": expr})


@pytest.mark.parametrize("expr", ["(q_idx + kv_idx) % 3 != 0", "((b + h) & 1) == 0 || kv_idx < 4", "true"])
def test_mask_expression_accepted(expr):
    assert parse(mask={"kind": "causal", "expression": expr}).mask.expression == expr


def test_mask_values_are_strict():
    assert "mask.window_left" in rejected(mask={"kind": "sliding_window", "window_left": "1024"})
    assert "mask.causal" in rejected(mask={"kind": "document", "causal": "yes"})


# ---- score_mod validation ------------------------------------------------------------------

@pytest.mark.parametrize("cap", [0.0, -1.0, -30.0, float("nan")])
def test_softcap_must_be_positive(cap):
    assert "score_mod.softcap" in rejected(score_mod={"softcap": cap})


def test_softcap_accepted():
    assert parse(score_mod={"softcap": 30.0}).score_mod.softcap == 30.0


@pytest.mark.parametrize("alibi", ["linear", "true", True, 1])
def test_bad_alibi_refused(alibi):
    assert "score_mod.alibi" in rejected(score_mod={"alibi": alibi})


@pytest.mark.parametrize("bias", ["tensor", "scalar", True])
def test_bad_bias_refused(bias):
    assert "score_mod.bias" in rejected(score_mod={"bias": bias})


@pytest.mark.parametrize("expr", ["score; return 0", "{score}", "(score", "#x"])
def test_bad_score_expression_refused(expr):
    assert "score_mod.expression" in rejected(score_mod={"expression": expr})


def test_unknown_score_mod_key_refused():
    assert "score_mod.temperature" in rejected(score_mod={"temperature": 2.0})


def test_changes_scores():
    assert not parse().score_mod.changes_scores
    assert not parse(score_mod={"sinks": True}).score_mod.changes_scores
    for mod in ({"softcap": 5.0}, {"alibi": "geometric"}, {"bias": "vector"}, {"expression": "score * 2.f"}):
        assert parse(score_mod=mod).score_mod.changes_scores, mod


# ---- the plan's extra kernel parameters ----------------------------------------------------

@pytest.mark.parametrize("overrides, names", [
    ({}, []),
    ({"mask": "none"}, []),
    ({"mask": "causal"}, []),
    ({"mask": {"kind": "chunked", "chunk_size": 128}}, []),
    ({"mask": {"kind": "prefix_lm", "prefix_len": 128}}, []),
    ({"mask": "document"}, ["doc_bounds", "doc_sb"]),
    ({"mask": {"kind": "document", "causal": True}}, ["doc_bounds", "doc_sb"]),  # resolved from doc_ids once a call
    ({"mask": "block_mask"}, BM_PARAMS),
    ({"mask": "causal", "score_mod": {"alibi": "slopes"}}, ["alibi_slopes"]),
    ({"mask": "causal", "score_mod": {"alibi": "geometric"}}, ["alibi_slopes"]),
    ({"score_mod": {"bias": "vector"}}, BIAS_PARAMS),
    ({"score_mod": {"bias": "matrix"}}, BIAS_PARAMS),
    ({"score_mod": {"sinks": True}}, ["sinks"]),
    ({"score_mod": {"softcap": 20.0, "expression": "score + 1.f"}}, []),
    ({"mask": "document", "score_mod": {"alibi": "slopes", "bias": "matrix", "sinks": True}},
     ["doc_bounds", "doc_sb", "alibi_slopes", *BIAS_PARAMS, "sinks"]),
    ({"mask": "block_mask", "score_mod": {"sinks": True, "bias": "vector", "alibi": "geometric", "softcap": 3.0}},
     [*BM_PARAMS, "alibi_slopes", *BIAS_PARAMS, "sinks"]),
])
def test_extra_params_in_signature_order(overrides, names):
    spec = parse(**overrides)
    p = plan(spec)
    assert param_names(spec) == names
    assert p.extra_params == p.mask_params + p.score_params + p.sink_params
    types = dict((n, t) for t, n in p.extra_params)
    for name in names:
        if name in ("doc_ids", "bm_num", "bm_idx", "bm_type", "bm_partial"):
            assert types[name].startswith("const int*")
        elif name in ("alibi_slopes", "bias", "sinks"):
            assert types[name].startswith("const float*")
        elif name == "bm_bits":
            assert types[name].startswith("const unsigned*")


def test_mask_words_of_the_plan(monkeypatch):
    monkeypatch.setattr("fagen.plan.MAX_REGISTERS", 10**6)  # 128-key tiles: refused for registers, words still count
    for block_kv, words in [(16, 1), (64, 1), (128, 1), (144, 2), (192, 2)]:  # a thread's words: 2 of 8 columns
        spec = parse(mask="block_mask", tiling={"block_q": 64, "block_kv": block_kv, "warps_q": 4})
        assert plan(spec).mask_lane_words == words


# ---- rendering -----------------------------------------------------------------------------

def kernel_params(source: str, name: str) -> list[tuple[str, str]]:
    """(type, name) of the kernel's parameters: between `symbol(` and `) {`."""
    start = source.index(f"\n{name}(") + len(name) + 2
    end = source.index(") {", start)
    params = []
    for part in " ".join(source[start:end].split()).split(","):
        part = part.strip()
        m = re.fullmatch(r"(.*?)\s*(\w+)", part)
        assert m, part
        params.append((m.group(1), m.group(2)))
    return params


def struct_body(source: str, struct: str) -> str:
    start = source.index(f"struct {struct} {{")
    return source[start:source.index("\n};", start)]


def test_sliding_window_renders_its_window():
    src = fagen.render(parse())
    assert "constexpr int WINDOW_LEFT = 1024" in src
    assert "constexpr int WINDOW_RIGHT = 0" in src
    assert "CHUNK_SIZE" not in src and "PREFIX_LEN" not in src and "MASK_WORDS" not in src


def test_chunked_and_prefix_render_their_numbers():
    src = fagen.render(parse(mask={"kind": "chunked", "chunk_size": 96}))
    assert "constexpr int CHUNK_SIZE = 96" in src and "WINDOW_LEFT" not in src
    src = fagen.render(parse(mask={"kind": "prefix_lm", "prefix_len": 77}))
    assert "constexpr int PREFIX_LEN = 77" in src and "CHUNK_SIZE" not in src


def test_block_mask_renders_mask_words():
    src = fagen.render(parse(mask="block_mask"))
    assert "constexpr int LANE_WORDS = 1" in src
    assert "BLOCK_PARTIAL" in src and "WINDOW_LEFT" not in src


def test_no_score_mod_renders_no_modifier_state():
    src = fagen.render(parse())
    # no modifier: no ScoreMod at all, and the softmax folds the scale into its exp2
    assert "struct ScoreMod" not in src and "score_mod." not in src
    assert "const float to_log2 = scale_log2;" in src and "LOG2E" not in src
    assert "float sink" not in src and "sinks[h]" not in src
    assert "SOFTCAP" not in src and "tanhf" not in src


def test_score_mods_render_their_state():
    src = fagen.render(parse(score_mod={"softcap": 30.0, "alibi": "slopes", "bias": "matrix", "sinks": True}))
    assert "const float to_log2 = LOG2E;" in src  # the modifiers apply the scale
    assert "float sink)" in src and "sinks[h])" in src  # the epilogue takes the head's sink
    assert "constexpr float SOFTCAP = 30.0f;" in src
    body = struct_body(src, "ScoreMod")
    assert "float slope;" in body and "bias_bh" in body


def test_expressions_render_verbatim():
    src = fagen.render(parse(mask={"kind": "causal", "expression": "(q_idx + kv_idx) % 3 != 0"},
                             score_mod={"expression": "score * 0.5f"}))
    assert "active = active && ((q_idx + kv_idx) % 3 != 0);" in src
    assert "s = (score * 0.5f);" in src
    assert "struct ScoreMod" in src


COMBOS = [
    {}, {"mask": "causal"}, {"mask": "document"}, {"mask": {"kind": "document", "causal": True}},
    {"mask": "block_mask"}, {"mask": {"kind": "chunked", "chunk_size": 64}},
    {"score_mod": {"alibi": "geometric"}}, {"score_mod": {"bias": "vector", "sinks": True}},
    {"mask": "block_mask", "score_mod": {"alibi": "slopes", "bias": "matrix", "sinks": True, "softcap": 5.0}},
    {"mask": "document", "score_mod": {"sinks": True, "expression": "score - 1.f"}},
]


def _specs_to_render():
    for path in sorted(SPECS.glob("*.yaml")):
        yield path.stem, lambda path=path: fagen.load_spec(path)
    for i, overrides in enumerate(COMBOS):
        yield f"combo{i}", lambda overrides=overrides: parse(**overrides)


@pytest.mark.parametrize("label, make", list(_specs_to_render()), ids=lambda x: x if isinstance(x, str) else "")
def test_kernel_signature_ends_with_the_extra_params(label, make):
    spec = make()
    src = fagen.render(spec)
    p = plan(spec)
    params = kernel_params(src, plan(spec).symbol)
    extra = [(t, n) for t, n in p.extra_params]
    inputs = [n for n in FIXED_PARAMS if n in {n for _, n in p.input_params}]
    assert [n for _, n in params] == inputs + [n for _, n in extra]
    assert params[len(inputs):] == extra  # the names in order, with the plan's C types
    assert params == list(p.params)  # the whole signature is the plan's table
    # no parameter the kernel never reads: each appears in the kernel's body
    body = src[src.index(") {", src.index(f"\n{p.symbol}(")):]
    assert [n for _, n in params if not re.search(rf"\b{n}\b", body)] == []
    # and the mask and score-mod structs receive their own parameters, in the same order
    mask_call = re.search(r"mask\.begin\(n_q, n_kv, mask_offset, b, h, q_first, q_last(.*?)\);", src).group(1)
    assert [a.strip() for a in mask_call.split(",") if a.strip()] == [n for _, n in p.mask_params]
    score_call = re.search(r"score_mod\.begin\(n_q, n_kv, b, h, scale(.*?)\);", src)
    if not spec.score_mod.changes_scores:
        assert score_call is None and not p.score_params
        return
    assert [a.strip() for a in score_call.group(1).split(",") if a.strip()] == [n for _, n in p.score_params]


# ---- values that would render a wrong kernel ----

@pytest.mark.parametrize("cap", [float("inf"), 1e300, 1e-50])
def test_softcap_must_be_a_finite_float32(cap):
    assert "score_mod.softcap" in rejected(score_mod={"softcap": cap})


@pytest.mark.parametrize("mask", [
    {"kind": "sliding_window", "window_left": 2**40},
    {"kind": "chunked", "chunk_size": 2**33},
    {"kind": "prefix_lm", "prefix_len": 2**32},
])
def test_mask_sizes_must_fit_the_kernels_int(mask):
    rejected(mask=mask)


@pytest.mark.parametrize("expr", ["0 /* ( */ ) || (1 /* ) */", "q_idx > 0 // note"])
def test_mask_expression_comments_refused(expr):
    assert "mask.expression" in rejected(mask={"kind": "causal", "expression": expr})
