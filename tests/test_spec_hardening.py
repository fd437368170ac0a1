"""What may reach generated code: expressions parsed against an allow-list, kernel symbols that
cannot collide, strict types with a fix in every message, and the ways a spec is built."""

from __future__ import annotations

import re

import pytest

import fagen
from fagen.expression import MASK_VARIABLES, SCORE_VARIABLES, ExpressionError, check, tokenize
from fagen.nvcc import compile_offline
from fagen.plan import KERNEL_SYMBOL_PREFIX, plan
from fagen.load import SPECS
from fagen.spec import Mask, ScoreMod, SpecError
from fagen.load import validated
from tests.conftest import base, rejected

SMALL = dict(name="probe", dtype="float16", head_dim=32, tiling={"block_q": 64, "block_kv": 32, "warps_q": 4})


# ---- expressions: an allow-list, not a deny-list ------------------------------------------

INJECTIONS = [
    "true\r%:define fast_exp2(x) 1.0f\r",  # a carriage return ends the line for the preprocessor
    "true\r%:include </etc/hostname>\r",
    "true %:define x 1",
    "q_idx <% 1 %>",
    "kv_idx<:0:> > 1",
    "q_idx %:%: kv_idx",
    "true\f#define x 1",
    "true\v> 0",
    "q_idx\t> 0",
    "q_idx and kv_idx",  # alternative keywords are identifiers C++ turns into operators
    "n_kv > 0",  # the Mask struct's members are not part of the language
    "doc[0] == 1",
    "printf(\"x\") || true",
    "q_idx > 0 ? 1 : (kv_idx = 2)",
    "0x1F > q_idx",
    "true \\",
    "q_idx > 0 /* x */",
]


@pytest.mark.parametrize("expr", INJECTIONS)
def test_injected_mask_expressions_are_refused(expr):
    message = rejected(base(mask={"kind": "causal", "expression": expr}))
    assert "mask.expression" in message and "e.g." in message


@pytest.mark.parametrize("expr", INJECTIONS)
def test_injected_score_expressions_are_refused(expr):
    assert "score_mod.expression" in rejected(base(score_mod={"expression": expr.replace("q_idx", "score")}))


@pytest.mark.parametrize(("expr", "names"), [
    ("q_idx %: 1", "'%:'"), ("a <% b", "'<%'"), ("x %> y", "'%>'"), ("x <: y", "'<:'"), ("x :> y", "':>'"),
    ("true\r", "'\\r'"), ("foo(q_idx)", "'foo'"), ("q_idx++", "'++'"), ("score % 2", "'%'"),
    ("sinf(score)", "'sinf'"),  # a stack frame for its range reduction: not in the language
])
def test_the_offending_token_is_named(expr, names):
    with pytest.raises(ExpressionError, match=re.escape(names)):
        check(expr, SCORE_VARIABLES)


@pytest.mark.parametrize("expr", ["(q_idx > kv_idx", "q_idx >", "q_idx ? 1", "min(q_idx)", "tanhf()", "(float)",
                                  "q_idx kv_idx", "1.0ff", "99999999999 > q_idx"])
def test_syntax_errors_are_refused_at_validation(expr):
    with pytest.raises(ExpressionError):
        check(expr, MASK_VARIABLES)


@pytest.mark.parametrize(("expr", "kind"), [
    ("(q_idx + kv_idx) % 3 != 0", "bool"), ("((b + h) & 1) == 0 || kv_idx < 4", "bool"), ("true", "bool"),
    ("score * 0.5f + 0.25f * (float)(h % 2)", "float"), ("tanhf(score / 30.f) * 30.f", "float"),
    ("q_idx >= kv_idx ? 1 : 0", "int"), ("min(q_idx, kv_idx) - abs(h)", "int"), ("-.5f * score + 1e-3f", "float"),
    ("fmaxf(score, (float)q_idx)", "float"), ("!(q_idx < kv_idx)", "bool"),
])
def test_the_language_accepts_c_formulas(expr, kind):
    assert check(expr, SCORE_VARIABLES) == kind


def test_tokens_munch_like_a_cpp_lexer():
    """The longest operator wins, as in C++: `<%` is one token there, so it must be one here."""
    assert [t.text for t in tokenize("a<=b")][:3] == ["a", "<=", "b"]
    with pytest.raises(ExpressionError, match="'<%'"):
        tokenize("a<%b")


def test_model_copy_cannot_smuggle_an_expression_into_a_kernel():
    spec = fagen.parse_spec(base())
    bad = Mask.model_construct(kind="causal", expression="true\r%:define fast_exp2(x) 1.0f\r")
    with pytest.raises(SpecError, match="mask.expression"):
        fagen.render(spec.model_copy(update={"mask": bad}))
    bad_mod = ScoreMod.model_construct(expression="score;}", softcap=None, alibi="none", bias="none", sinks=False)
    with pytest.raises(SpecError, match="score_mod.expression"):
        fagen.render(spec.model_copy(update={"score_mod": bad_mod}))
    with pytest.raises(SpecError, match="name"):
        fagen.render(spec.model_copy(update={"name": "x(void){}//"}))


def test_render_refuses_what_is_not_a_spec():
    with pytest.raises(SpecError, match="parse_spec"):
        fagen.render(base())
    assert validated(fagen.parse_spec(base())) == fagen.parse_spec(base())


# ---- kernel names ------------------------------------------------------------------------

def defined_identifiers(source: str) -> set[str]:
    """Names a rendered kernel defines at file scope or in its structs."""
    patterns = [r"\bstruct\s+(?:alignas\(\d+\)\s+)?(\w+)", r"\busing\s+(\w+)\s*=", r"\btypedef\b[^;]*?\b(\w+)\s*;",
                r"\bconstexpr\s+[\w:<>]+\s+(\w+)\s*=", r"__device__[^(;{=]*?\b(\w+)\s*\(", r"#define\s+(\w+)"]
    return {m for p in patterns for m in re.findall(p, source)}


def test_no_identifier_of_a_kernel_takes_the_symbol_prefix():
    """fagen_<name> cannot collide with what the templates define, whatever the name."""
    names: set[str] = set()
    for path in sorted(SPECS.glob("*.yaml")):
        spec = fagen.load_spec(path)
        source = fagen.render(spec)
        assert f"{plan(spec).symbol}(" in source and plan(spec).symbol == KERNEL_SYMBOL_PREFIX + spec.name
        names |= defined_identifiers(source)
    assert {"elem_t", "chunk16", "Mask", "ScoreMod"} <= names  # the scan sees the templates' names
    assert not [n for n in names if n.startswith(KERNEL_SYMBOL_PREFIX)]


@pytest.mark.parametrize("name", ["printf", "uint4", "min", "max", "expf", "malloc", "memcpy", "assert", "std",
                                  "elem_t", "chunk16", "out_t", "class", "main", "threadidx"])
def test_names_that_once_broke_the_build_validate(name):
    assert fagen.parse_spec({**SMALL, "name": name}).name == name


@pytest.mark.parametrize("name", ["printf", "elem_t", "chunk16", "min"])
def test_names_that_once_broke_the_build_compile(name):
    r = compile_offline(fagen.parse_spec({**SMALL, "name": name}), "sm_80")
    assert (r.spill_stores, r.stack_frame) == (0, 0)


@pytest.mark.parametrize("name", ["_x", "a__b", "x" * 101, "caf\u00e9"])
def test_names_cpp_reserves_are_refused(name):
    assert "name" in rejected({**SMALL, "name": name})


# ---- strictness ----------------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "expected"), [
    (dict(pipeline={"stages": True}), ["pipeline.stages", "True", "whole number", "stages: 2"]),
    (dict(pipeline={"stages": 2.0}), ["pipeline.stages", "2.0", "whole number"]),
    (dict(pipeline={"stages": 4}), ["pipeline.stages", "4", "1, 2 or 3", "use 2"]),
    (dict(dtype="float32"), ["dtype", "'float32'", "'float16', 'bfloat16'", "did you mean 'float16'"]),
    (dict(dtype="bf16"), ["dtype", "'bf16'", "did you mean 'bfloat16'", "dtype: bfloat16"]),
    (dict(head_dim="128"), ["head_dim", "'128'", "without quotes", "head_dim: 128"]),
    (dict(pipeline={"q_in_registers": "yes"}), ["pipeline.q_in_registers", "true or false"]),
    (dict(tiling=[64, 64]), ["tiling", "mapping"]),
    (dict(mask={"kind": "casual"}), ["mask.kind", "did you mean 'causal'"]),
])
def test_type_errors_carry_a_fix(overrides, expected):
    message = rejected(base(**overrides))
    for part in expected:
        assert part in message, f"{part!r} not in:\n{message}"


def test_window_message_does_not_contradict_itself():
    message = rejected(base(mask={"kind": "sliding_window", "window_left": -1}))
    assert "mask.window_left = -1: must be in 0.." in message and "1.." not in message
    assert "mask.chunk_size = 0: must be in 1.." in rejected(base(mask={"kind": "chunked", "chunk_size": 0}))


def test_duplicate_yaml_keys_are_refused(tmp_path):
    text = (SPECS / "attn_f16_d128.yaml").read_text() + "head_dim: 64\n"
    path = tmp_path / "attn_f16_d128.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match="duplicate key 'head_dim'"):
        fagen.load_spec(path)
    with pytest.raises(SpecError, match="duplicate key 'block_q'"):
        fagen.parse_spec("name: k\ndtype: float16\nhead_dim: 64\ntiling: {block_q: 64, block_q: 128, block_kv: 64}\n")


# ---- building a spec: a path, a mapping, YAML text -----------------------------------------

def test_parse_spec_takes_yaml_text():
    text = (SPECS / "attn_f16_d128.yaml").read_text()
    assert fagen.parse_spec(text) == fagen.load_spec(SPECS / "attn_f16_d128.yaml")


def test_load_spec_takes_a_path_and_points_elsewhere_for_the_rest(tmp_path):
    with pytest.raises(SpecError, match="parse_spec"):
        fagen.load_spec(base())
    with pytest.raises(SpecError, match="parse_spec"):
        fagen.load_spec((SPECS / "attn_f16_d128.yaml").read_text())
    with pytest.raises(SpecError, match="load_spec"):
        fagen.parse_spec(SPECS / "attn_f16_d128.yaml")
    with pytest.raises(SpecError, match="cannot read spec"):
        fagen.load_spec(tmp_path / "missing.yaml")


def test_a_partial_with_sinks_compiles():
    """Partials leave sinks to the merge: the kernel takes no sinks and must not read them."""
    spec = fagen.parse_spec({**SMALL, "score_mod": {"sinks": True}, "outputs": {"partial": True}})
    assert not plan(spec).sink_params and "sinks" not in fagen.render(spec).split("extern \"C\"")[1].split(") {")[0]
    r = compile_offline(spec, "sm_80")
    assert (r.spill_stores, r.stack_frame) == (0, 0)


def test_an_expression_costs_registers():
    """A mask expression on the H200 default spilled (208 -> 255 registers) while the estimate
    ignored it: now it is priced, and fagen.attention's variant takes a smaller tile."""
    from fagen import variants

    base = variants.shipped_spec("float16", 128, False, gpu="h200")
    with_expression = base.model_dump() | {"name": "x", "mask": {"kind": "none", "expression": "h != 0"}}
    with pytest.raises(SpecError, match="registers"):
        fagen.parse_spec(with_expression)
    derived = variants.variant(base, Mask(kind="none", expression="h != 0"), ScoreMod())
    assert derived.tiling.block_kv < base.tiling.block_kv
    r = compile_offline(derived, "sm_90a")
    assert (r.spill_stores, r.stack_frame) == (0, 0)


def test_an_f_suffix_needs_a_dot():
    with pytest.raises(ExpressionError, match="malformed"):
        check("score * 289f", SCORE_VARIABLES)
    assert check("score * 289.f", SCORE_VARIABLES) == "float"


def test_accumulate_needs_partial_outputs():
    from conftest import base, rejected

    message = rejected(base(outputs={"lse": True, "accumulate": True}))
    assert "outputs.accumulate = True" in message and "set partial: true" in message


def test_accumulate_refuses_packed_rows_and_varlen_queries():
    from conftest import base, rejected

    outputs = {"lse": True, "partial": True, "accumulate": True}
    packed = rejected(base(outputs=outputs, tiling={"block_q": 64, "block_kv": 64, "warps_q": 4, "pack_gqa": True}))
    assert "outputs.accumulate = True" in packed and "tiling.pack_gqa" in packed
    varlen = rejected(base(outputs=outputs, sequences={"q": "varlen", "kv": "varlen"}))
    assert "outputs.accumulate = True" in varlen and "padded queries" in varlen
