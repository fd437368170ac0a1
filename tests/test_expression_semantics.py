"""What an expression means: refused where C would not say (non-ASCII digits, octal literals,
undefined constants, a mask that is no bool), one syntax tree printed into the kernel and
evaluated in NumPy with C's semantics, and the oracle judging a kernel by its spec's
expressions. nvcc's warnings on a kernel with an expression fail its compile."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

import fagen
from fagen import expression, oracle
from fagen.expression import (BOOL, FLOAT, INT, MASK_VARIABLES, SCORE_VARIABLES, Binary, Conditional, ExpressionError,
                              Name, Number, Unary, cuda, evaluate, parse, source)
from fagen.load import SPECS, load_spec
from fagen.spec import Mask, ScoreMod
from tests.conftest import base, rejected
from tests.spec_fuzz import expression as random_expression

CUSTOM = SPECS / "custom_expressions_f16_d64.yaml"


# ---- refused, each naming what and offering a fix that validates --------------------------

REFUSED_MASKS = [  # (expression, what the message names)
    ("q_idx > \u0663", "digit outside ASCII"),  # ARABIC-INDIC DIGIT THREE: str.isdigit says yes
    ("q_idx % 09 == 0", "C reads as octal"),
    ("q_idx % 010 == 0", "C reads as octal"),
    ("kv_idx != 00", "C reads as octal"),
    ("q_idx / 0 == 0", "'q_idx / 0' at position 0 divides by zero"),
    ("q_idx % (1 - 1) == 0", "'q_idx % (1 - 1)' at position 0 divides by zero"),
    # a constant condition or a short circuit decides the value whatever the other side is (nvcc
    # folds them and warns; a fuzz run found the first)
    ("q_idx % (36 ? 0 : kv_idx) == 0", "'q_idx % (36 ? 0 : kv_idx)' at position 0 divides by zero"),
    ("q_idx % (false && kv_idx > 3) == 0", "'q_idx % (false && kv_idx > 3)' at position 0 divides by zero"),
    ("q_idx / (0 ? kv_idx : 0) == 0", "'q_idx / (0 ? kv_idx : 0)' at position 0 divides by zero"),
    ("(q_idx << 40) == 0", "'q_idx << 40' at position 1 shifts by 40"),
    ("(kv_idx >> -1) == 0", "'kv_idx >> -1' at position 1 shifts by -1"),
    ("2147483647 + 1 > q_idx", "'2147483647 + 1' at position 0 overflows int"),
    ("65536 * 65536 == q_idx", "'65536 * 65536' at position 0 overflows int"),
    ("-(-2147483647 - 1) == q_idx", "'-(-2147483647 - 1)' at position 0 overflows int"),
    ("(-2147483647 - 1) / -1 == q_idx", "overflows int"),
    ("(-2147483647 - 1) % -1 == q_idx", "overflows int"),
    # C++17's shifts: a negative left operand, or a result the unsigned type cannot hold
    ("(-1 << 3) > q_idx", "'-1 << 3' at position 1 shifts the negative number -1 left"),
    ("(-3 << 31) > q_idx", "'-3 << 31' at position 1 shifts the negative number -3 left"),
    ("(3 << 31) > q_idx", "'3 << 31' at position 1 is 6442450944, which an unsigned int cannot hold"),
    ("(1 << 40) > q_idx", "'1 << 40' at position 1 shifts by 40"),
    ("(3 << 40) > q_idx", "'3 << 40' at position 1 shifts by 40"),
    # the fix is one the surrounding operator takes: no float inside & or %, no 0 after %
    ("(q_idx & (65536 * 32768)) == 0", "'65536 * 32768' at position 10 overflows int"),
    ("q_idx % (65536 * 65536) == 0", "'65536 * 65536' at position 9 overflows int"),
    ("q_idx < 65536 * 65536", "'65536 * 65536' at position 8 overflows int"),
    # calls with constant arguments are folded as the kernel computes them
    ("q_idx / min(0, 1) == 0", "'q_idx / min(0, 1)' at position 0 divides by zero"),
    ("q_idx % abs(0) == 0", "'q_idx % abs(0)' at position 0 divides by zero"),
    ("(q_idx << max(40, 0)) == 0", "'q_idx << max(40, 0)' at position 1 shifts by 40"),
    ("q_idx / (int)floorf(0.5f) == 0", "'q_idx / (int)floorf(0.5f)' at position 0 divides by zero"),
    ("abs(-2147483647 - 1) > q_idx", "'abs(-2147483647 - 1)' at position 0 overflows int"),
    # float constants are float32, as in the kernel: 2147483647.f is 2^31, 16777217.f is 2^24
    ("q_idx < (int)2147483647.f", "'(int)2147483647.f' at position 8 converts 2147483648 to an int"),
    ("q_idx / (int)(16777217.f - 16777216.f) > 0", "divides by zero"),
    ("(int)3e10f > q_idx", "'(int)3e10f' at position 0 converts"),
    ("(float)q_idx * 0.5f", "a mask expression must be a bool (a comparison or &&/||)"),
    ("q_idx & 1", "a mask expression must be a bool"),
    ("~(q_idx > kv_idx)", "a mask expression must be a bool"),  # ~true is -2: always "keep"
    ("q_idx >= kv_idx ? 1 : 0", "a mask expression must be a bool"),
]


def _fixed(text: str, message: str) -> str:
    """The expression with the fix a message offers applied: the sub-expression it names
    replaced by its `e.g.`, or the `e.g.` whole."""
    fix = re.search(r"e\.g\. (.+?)(\)?;| *$)", message)[1]
    named = re.search(r"(?:'(.+?)'|the integer (\S+)) at position", message)
    if "mask expression must be a bool" in message or named is None:
        return fix
    assert (named[1] or named[2]) in text, message
    return text.replace(named[1] or named[2], fix)


@pytest.mark.parametrize("text, names", REFUSED_MASKS)
def test_a_mask_expression_c_would_not_mean_is_refused_with_a_fix(text, names):
    with pytest.raises(ExpressionError) as info:
        expression.mask(text)
    message = str(info.value)
    assert names in message, message
    fixed = _fixed(text, message)
    assert expression.mask(fixed).type == BOOL, (message, fixed)
    spec_message = rejected(base(mask={"kind": "causal", "expression": text}))
    assert "mask.expression" in spec_message and names in spec_message


@pytest.mark.parametrize("text, names", [
    ("score / 0.0f", "'score / 0.0f' at position 0 divides by zero"),  # nvcc warns on it: refused first
    ("70 % (36 ? false : b + false && score)", "divides by zero"),  # a fuzz run's: nvcc warned on it
    ("score * (float)(q_idx << 32)", "'q_idx << 32' at position 16 shifts by 32"),
    ("score + (float)(2147483647 * 2)", "'2147483647 * 2' at position 16 overflows int"),
])
def test_a_score_expression_c_would_not_mean_is_refused_with_a_fix(text, names):
    with pytest.raises(ExpressionError) as info:
        expression.score(text)
    assert names in str(info.value)
    assert expression.score(_fixed(text, str(info.value)))
    assert "score_mod.expression" in rejected(base(score_mod={"expression": text}))


def test_the_digits_message_names_the_ascii_digit():
    with pytest.raises(ExpressionError, match="e.g. 3"):
        expression.mask("q_idx > \u0663")
    with pytest.raises(ExpressionError, match="e.g. 9"):
        expression.mask("q_idx % 09 == 0")


@pytest.mark.parametrize("text", [
    "q_idx != 0", "0 == kv_idx", "-2147483647 - 1 < q_idx", "(q_idx << 31) != 0", "7 % -3 == 1 && -7 / 2 == -3",
    "2147483647 > q_idx", "false && q_idx / 1 > 0", "(int)2e9f > q_idx", "(bool)(q_idx & 1)", "!(q_idx % 2)",
    "(q_idx > 3) & (kv_idx < 5)", "q_idx > 1 ? true : kv_idx == 0", "(float)q_idx * 0.5f != 0", "1.5f / 0.5f > 2.9f",
    "0.05f < 1.f", "09.5f > 1.f",  # a leading zero is decimal in a float literal
    # C++17: a non-negative left operand whose result an unsigned int holds, converted to int
    "(1 << 31) > q_idx", "(q_idx & (1 << 31)) == 0", "(3 << 30) != q_idx",
    "q_idx / (int)(16777217. - 16777216.) > 0",  # without f, double: 1
    "q_idx / max(1, 0) >= 0", "(int)ceilf(0.5f) == 1",
])
def test_defined_masks_are_accepted(text):
    assert expression.mask(text).type == BOOL


# ---- one tree, printed -------------------------------------------------------------------

def _spec_expressions() -> list[tuple[str, str]]:
    found = []
    for path in sorted(SPECS.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        mask, mod = data.get("mask"), data.get("score_mod") or {}
        if isinstance(mask, dict) and mask.get("expression"):
            found.append(("mask", mask["expression"]))
        found += [("score", mod[f]) for f in ("expression", "expression_grad") if mod.get(f)]
    return found


def test_specs_hold_expressions():
    assert {kind for kind, _ in _spec_expressions()} == {"mask", "score"}


@pytest.mark.parametrize("kind, text", _spec_expressions())
def test_shipped_expressions_print_as_written(kind, text):
    """The printer's layout is the shipped specs': their kernels are unchanged by it."""
    tree = expression.mask(text) if kind == "mask" else expression.score(text)
    assert cuda(tree) == text


# the formulas of the expression tests (tests/test_spec_hardening.py, tests/test_spec_masks.py)
FORMULAS = [
    "(q_idx + kv_idx) % 3 != 0", "((b + h) & 1) == 0 || kv_idx < 4", "true", "score * 0.5f + 0.25f * (float)(h % 2)",
    "tanhf(score / 30.f) * 30.f", "q_idx >= kv_idx ? 1 : 0", "min(q_idx, kv_idx) - abs(h)", "-.5f * score + 1e-3f",
    "fmaxf(score, (float)q_idx)", "!(q_idx < kv_idx)", "score * 2.f", "score + 1.f", "score - 1.f", "score * 0.5f",
    "score * 289.f", "h", "h != 0", "q_idx-kv_idx<128", "a - (b - c)", "(a - b) - c", "- -q_idx", "-(-q_idx)",
    "a ? b : c ? d : e", "(a ? b : c) ? d : e", "a ? b ? c : d : e", "(a ? b : c) + 1", "-(a + b) * ~c",
    "(float)-a", "(int)(float)a", "(bool)(a | b) ^ c", "a << (b >> 1)", "(a << b) >> 1", "a < b == (c < d)",
    "a & (b | c) ^ d", "!!a", "+ +a", "fminf(a > b ? 1.f : 2.f, -(float)c)",
]
LETTERS = {**SCORE_VARIABLES, **{x: INT for x in "abcde"}}


@pytest.mark.parametrize("text", FORMULAS)
def test_the_printer_round_trips(text):
    tree = parse(text, LETTERS)
    printed = source(tree)
    assert parse(printed, LETTERS) == tree, printed
    assert source(parse(printed, LETTERS)) == printed


def test_the_printer_round_trips_random_formulas():
    """The fuzz's grammar, a few hundred formulas: every one that parses prints back to itself."""
    rng, parsed = random.Random(51), 0
    for _ in range(600):
        text = random_expression(rng, SCORE_VARIABLES)
        try:
            tree = parse(text, SCORE_VARIABLES)
        except ExpressionError:
            continue
        parsed += 1
        assert parse(source(tree), SCORE_VARIABLES) == tree, (text, source(tree))
    assert parsed > 200


def test_the_printer_parenthesises_by_precedence():
    a, b, c = (Name(x, INT) for x in "abc")
    assert source(Binary("-", a, Binary("-", b, c, INT), INT)) == "a - (b - c)"
    assert source(Binary("-", Binary("-", a, b, INT), c, INT)) == "a - b - c"
    assert source(Binary("*", Binary("+", a, b, INT), c, INT)) == "(a + b) * c"
    assert source(Binary("&", a, Binary("==", b, c, BOOL), INT)) == "a & b == c"
    assert source(Binary("==", Binary("&", a, b, INT), c, BOOL)) == "(a & b) == c"
    assert source(Unary("-", Unary("-", a, INT), INT)) == "-(-a)"  # not the decrement --
    assert source(Binary("+", Conditional(a, b, c, INT), a, INT)) == "(a ? b : c) + a"
    assert source(Conditional(Conditional(a, b, c, INT), a, Number("1", INT), INT)) == "(a ? b : c) ? a : 1"


def test_the_kernel_prints_the_tree():
    """What nvcc reads is the tree's text (spaced and parenthesised by the printer), not the
    spec's characters."""
    spec = fagen.parse_spec(base(mask={"kind": "causal", "expression": "((q_idx%3))==0"},
                                 score_mod={"expression": "score*(0.5f)"}))
    src = fagen.render(spec)
    assert "active = active && (q_idx % 3 == 0);  // spec: mask.expression" in src
    assert "s = (score * 0.5f);  // spec: score_mod.expression" in src
    assert "((q_idx%3))" not in src.split("*/")[-1].split("// ---- mask")[-1]  # the spec's echo keeps the text


# ---- the NumPy evaluator against hand-written C ------------------------------------------

def _ints(*shape, low=-50, high=50, seed=0):
    return np.random.default_rng(seed).integers(low, high, shape)


def _wrap(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31


def test_int_division_and_remainder_follow_c():
    q, k = _ints(40, 1), _ints(1, 40, seed=1)
    k = np.where(k == 0, 7, k)
    divided = evaluate(parse("q_idx / kv_idx", MASK_VARIABLES), dict(q_idx=q, kv_idx=k))
    remainder = evaluate(parse("q_idx % kv_idx", MASK_VARIABLES), dict(q_idx=q, kv_idx=k))
    want_div = np.array([[int(a / b) for b in k[0]] for a in q[:, 0]])  # truncation toward zero
    want_rem = np.array([[a - int(a / b) * b for b in k[0]] for a in q[:, 0]])  # the dividend's sign
    assert divided.dtype == np.int32 and (divided == want_div).all()
    assert (remainder == want_rem).all()
    assert (remainder[q[:, 0] < 0] <= 0).all()


def test_int_arithmetic_wraps_at_32_bits():
    q = np.arange(0, 5000, 7)
    got = evaluate(parse("q_idx * 1000003 + 12345", MASK_VARIABLES), dict(q_idx=q))
    assert got.dtype == np.int32
    assert got.tolist() == [_wrap(x * 1000003 + 12345) for x in q.tolist()]


def test_shifts_and_bits_follow_c():
    q = _ints(64, seed=2)
    values = dict(q_idx=q, kv_idx=np.abs(q) % 31)
    assert evaluate(parse("q_idx >> 2", MASK_VARIABLES), values).tolist() == [x >> 2 for x in q.tolist()]  # arithmetic
    assert evaluate(parse("1 << kv_idx", MASK_VARIABLES), values).tolist() == [1 << (abs(x) % 31) for x in q.tolist()]
    assert evaluate(parse("~(q_idx > 3)", MASK_VARIABLES), values).tolist() == [-2 if x > 3 else -1 for x in q.tolist()]
    assert evaluate(parse("(q_idx & 6) ^ 5 | 8", MASK_VARIABLES), values).tolist() == [
        (x & 6) ^ 5 | 8 for x in q.tolist()]


def test_float_math_is_float32_where_c_computes_in_float():
    q = np.arange(1, 3000)
    got = evaluate(parse("(float)q_idx * 0.1f", MASK_VARIABLES), dict(q_idx=q))
    assert got.dtype == np.float32
    assert (got == q.astype(np.float32) * np.float32(0.1)).all()
    # 0.1 without f is a double: float * double is computed in double
    double = evaluate(parse("(float)q_idx * 0.1", MASK_VARIABLES), dict(q_idx=q))
    assert double.dtype == np.float64 and (double == q.astype(np.float32).astype(np.float64) * 0.1).all()
    assert (got != double).any()  # so the two are told apart
    # a comparison in float32 keeps exactly the pairs the kernel keeps
    keep = evaluate(parse("(float)q_idx * 0.1f < 30.f", MASK_VARIABLES), dict(q_idx=q))
    assert (keep == (q.astype(np.float32) * np.float32(0.1) < np.float32(30))).all()


def test_casts_conditionals_and_functions_follow_c():
    s = np.array([-2.7, -0.5, 0.0, 0.4, 2.5, np.nan, np.inf])
    values = dict(score=s, b=0, h=np.arange(7), q_idx=3, kv_idx=np.arange(7) - 3)
    f64 = dict(float_type=np.float64)
    assert evaluate(parse("(float)(int)(score * 2.f)", SCORE_VARIABLES), {**values, "score": s[:5]}, **f64).tolist() \
        == [-5.0, -1.0, 0.0, 0.0, 5.0]  # toward zero
    assert evaluate(parse("(bool)score", SCORE_VARIABLES), values).tolist() == [True, True, False, True, True, True, True]
    assert evaluate(parse("kv_idx > 0 ? score : -score", SCORE_VARIABLES), values, **f64).tolist()[:5] == \
        [2.7, 0.5, -0.0, -0.4, 2.5]  # kv_idx -3 .. 1
    assert evaluate(parse("fmaxf(score, 0.f)", SCORE_VARIABLES), values, **f64).tolist() == \
        [0.0, 0.0, 0.0, 0.4, 2.5, 0.0, np.inf]  # fmaxf(NaN, 0) is 0
    assert evaluate(parse("min(h, abs(kv_idx))", SCORE_VARIABLES), values).tolist() == \
        [min(h, abs(k)) for h, k in zip(range(7), range(-3, 4))]
    assert evaluate(parse("(int)true + (int)(h > 3)", SCORE_VARIABLES), values).tolist() == [1, 1, 1, 1, 2, 2, 2]
    assert evaluate(parse("tanhf(score / 30.f) * 30.f", SCORE_VARIABLES), {**values, "score": s[:5]}).dtype == np.float32


def test_the_custom_spec_evaluates_to_its_formula():
    spec = load_spec(CUSTOM)
    b, h, q, k = np.arange(2)[:, None, None, None], np.arange(4)[None, :, None, None], \
        np.arange(37)[None, None, :, None], np.arange(41)[None, None, None, :]
    s = np.random.default_rng(3).standard_normal((2, 4, 37, 41))
    keep = evaluate(expression.mask(spec.mask.expression), dict(b=b, h=h, q_idx=q, kv_idx=k))
    assert (keep == ((q + k) % 3 != 0)).all()
    modified = evaluate(expression.score(spec.score_mod.expression), dict(score=s, b=b, h=h, q_idx=q, kv_idx=k),
                        np.float64)
    np.testing.assert_allclose(modified, s * 0.5 + 0.25 * (h % 2), rtol=1e-15)


# ---- the oracle reads a spec's expressions -----------------------------------------------

def _by_hand(q, k, v, *, keep, score=lambda s, h: s):
    """softmax(score(q k^T / sqrt(d)) masked) v, written out."""
    h = np.arange(q.shape[1])[None, :, None, None]
    s = score(q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]), h)
    s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def _qkv(nq=37, nk=53, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, 4, nq, 64)), rng.standard_normal((2, 4, nk, 64)), rng.standard_normal((2, 4, nk, 64))


def test_the_oracle_applies_the_mask_expression():
    q, k, v = _qkv()
    spec = load_spec(CUSTOM)
    qi, ki = np.arange(37)[:, None], np.arange(53)[None, :]
    causal = ki <= qi + 53 - 37
    got = oracle.attention(q, k, v, mask=spec.mask)
    np.testing.assert_allclose(got, _by_hand(q, k, v, keep=causal & ((qi + ki) % 3 != 0)), rtol=1e-10, atol=1e-12)
    assert np.abs(got - oracle.attention(q, k, v, causal=True)).max() > 0.1  # not plain causal
    as_dict = oracle.attention(q, k, v, mask={"kind": "causal", "expression": "(q_idx + kv_idx) % 3 != 0"})
    np.testing.assert_array_equal(as_dict, got)


def test_the_oracle_applies_the_score_expression():
    q, k, v = _qkv(seed=1)
    spec = load_spec(CUSTOM)
    qi, ki = np.arange(37)[:, None], np.arange(53)[None, :]
    keep = (ki <= qi + 53 - 37) & ((qi + ki) % 3 != 0)
    got = oracle.attention(q, k, v, mask=spec.mask, score_mod=spec.score_mod)
    want = _by_hand(q, k, v, keep=keep, score=lambda s, h: s * 0.5 + 0.25 * (h % 2))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert np.abs(got - oracle.attention(q, k, v, mask=spec.mask)).max() > 0.05


def test_the_backward_oracle_applies_expression_and_expression_grad():
    q, k, v = _qkv(29, 31, seed=2)
    dout = np.random.default_rng(4).standard_normal(q.shape)
    spec = load_spec(CUSTOM)
    got = oracle.attention_backward(q, k, v, dout, mask=spec.mask, score_mod=spec.score_mod)
    want = oracle.attention_backward(q, k, v, dout, causal=True,
                                     mask_mod=lambda b, h, qi, ki: (qi + ki) % 3 != 0,
                                     score_mod=lambda s, b, h, qi, ki: s * 0.5 + 0.25 * (h % 2),
                                     score_mod_grad=lambda s, b, h, qi, ki: np.full_like(s, 0.5))
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-12)
    plain = oracle.attention_backward(q, k, v, dout, causal=True)
    assert np.abs(got["dq"] - plain["dq"]).max() > 0.05


def test_a_spec_score_mod_brings_all_its_fields():
    """softcap and geometric ALiBi from the ScoreMod itself; what it asks for must be given."""
    q, k, v = _qkv(seed=5)
    mod = ScoreMod(softcap=5.0, alibi="geometric", expression="score * 2.f", expression_grad="2.f")
    got = oracle.attention(q, k, v, score_mod=mod)
    from fagen.side_inputs import geometric_alibi_slopes
    want = oracle.attention(q, k, v, softcap=5.0, alibi_slopes=geometric_alibi_slopes(4),
                            score_mod=lambda s, b, h, qi, ki: s * 2)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    with pytest.raises(ValueError, match="bias = None: score_mod.bias = 'vector' asks for it"):
        oracle.attention(q, k, v, score_mod=ScoreMod(bias="vector"))
    with pytest.raises(ValueError, match="softcap = 30.0: score_mod has softcap 5.0"):
        oracle.attention(q, k, v, softcap=30.0, score_mod=mod)
    with pytest.raises(ValueError, match="score_mod.expression_grad = None"):
        oracle.attention_backward(q, k, v, q, score_mod={"expression": "score * 2.f"})
    with pytest.raises(ValueError, match="score_mod = 5"):
        oracle.attention(q, k, v, score_mod=5)


# ---- nvcc's warnings on an expression are errors -----------------------------------------

@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs nvcc")
def test_nvcc_warnings_on_an_expression_fail_the_compile(monkeypatch, tmp_path):
    """Were the constant checks to miss one, nvcc's warning would still fail the compile, and
    `fagen compile` would show it without -v."""
    from click.testing import CliRunner

    from fagen.cli import main
    from fagen.nvcc import compile_offline

    monkeypatch.setattr(expression, "_fold", lambda node: None)  # validation lets `q_idx / 0` through
    data = {**base(mask={"kind": "causal", "expression": "q_idx / 0 == 0"}), "name": "warned", "head_dim": 64}
    spec = fagen.parse_spec(data)
    with pytest.raises(RuntimeError, match="division by zero"):
        compile_offline(spec, "sm_80")
    path = tmp_path / "warned.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["compile", str(path), "--arch", "sm_80"])
    assert result.exit_code != 0 and "division by zero" in result.output, result.output


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs nvcc")
def test_a_score_expression_that_ignores_the_score_compiles_without_warnings():
    """The kernel declares `score` only where an expression reads it (nvcc warns of an unused
    variable); the backward declares it where expression_grad reads it."""
    from fagen.nvcc import compile_offline
    from fagen.rendering import render_backward

    spec = fagen.parse_spec({**base(score_mod={"expression": "(float)(h % 2)", "expression_grad": "0.f"}),
                             "name": "ignores_score", "head_dim": 64, "backward": {}})
    assert "const float score" not in fagen.render(spec) + render_backward(spec)
    assert "warning" not in compile_offline(spec, "sm_80").log  # the whole log, the front end's included
    reads_in_grad = spec.model_copy(update={"score_mod": ScoreMod(expression="score + 1.f", expression_grad="score")})
    assert "const float score" in fagen.render(reads_in_grad)
    assert "const float score" in render_backward(spec.model_copy(
        update={"score_mod": ScoreMod(expression="(float)h", expression_grad="score")}))


# ---- the kernel's text computes what the evaluator computes --------------------------------

@pytest.mark.parametrize("text, kernel", [
    ("q_idx * 100000 > 0", "(int)((unsigned)q_idx * (unsigned)100000) > 0"),  # nvcc may assume no overflow
    ("-(q_idx * kv_idx) < 0", "(int)(0u - (unsigned)(int)((unsigned)q_idx * (unsigned)kv_idx)) < 0"),
    ("q_idx * 2 + 1 < kv_idx", "q_idx * 2 + 1 < kv_idx"),  # indices below 2^30: fits, printed as written
    ("q_idx - kv_idx < 128", "q_idx - kv_idx < 128"),
    ("(q_idx + kv_idx) % 3 != 0", "(q_idx + kv_idx) % 3 != 0"),
    ("(q_idx % 1000) * (kv_idx % 1000) > 5", "q_idx % 1000 * (kv_idx % 1000) > 5"),
    ("(float)q_idx * 0.5f + 1.f > (float)kv_idx", "__fadd_rn(__fmul_rn((float)q_idx, 0.5f), 1.f) > (float)kv_idx"),
    ("(float)q_idx * 0.1 - 1. < 3.f", "__dsub_rn(__dmul_rn((float)q_idx, 0.1), 1.) < 3.f"),  # double, as in C
    # the MUFU approximations (expression.FAST_FUNCTIONS): the source keeps C's names
    ("logf((float)q_idx) > expf((float)kv_idx) + log2f(2.f)", "__logf((float)q_idx) > __fadd_rn(__expf((float)kv_idx), __log2f(2.f))"),
])
def test_the_kernel_text_wraps_int_overflow_and_rounds_each_float_step_of_a_mask(text, kernel):
    assert cuda(expression.mask(text)) == kernel
    assert source(expression.mask(text)) == text.replace("(q_idx % 1000) *", "q_idx % 1000 *")


def test_a_score_expression_contracts_where_no_decision_depends_on_it():
    tree = expression.score("q_idx > (int)(score * 2.f + 1.f) ? score * 2.f + 1.f : score")
    assert cuda(tree) == "q_idx > (int)__fadd_rn(__fmul_rn(score, 2.f), 1.f) ? score * 2.f + 1.f : score"


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs nvcc")
def test_the_kernel_text_costs_no_instruction_and_is_never_contracted(tmp_path):
    """PTX of the printed forms: the wrapping int form is the plain one's instructions; a mask's
    float steps are mul.rn/add.rn, never an fma."""
    import subprocess

    def ptx(body: str) -> str:
        src = tmp_path / "e.cu"
        src.write_text("__global__ void k(const int* q, const int* k, bool* o) { int q_idx = q[threadIdx.x], "
                       f"kv_idx = k[threadIdx.x]; o[threadIdx.x] = ({body}); }}\n")
        subprocess.run(["nvcc", "-ptx", "-arch=sm_80", "-o", tmp_path / "e.ptx", src], check=True)
        return "\n".join(line for line in (tmp_path / "e.ptx").read_text().splitlines() if "\t" in line)

    wrapped = cuda(expression.mask("q_idx * kv_idx + 7 * q_idx > 5"))
    assert "(unsigned)" in wrapped
    assert ptx(wrapped) == ptx("q_idx * kv_idx + 7 * q_idx > 5")
    rounded = ptx(cuda(expression.mask("(float)q_idx * 0.1f + (float)kv_idx > 3.f")))
    assert "fma" not in rounded and "mul.rn.f32" in rounded and "add.rn.f32" in rounded
    assert "fma" in ptx("(float)q_idx * 0.1f + (float)kv_idx > 3.f")  # what nvcc does to the plain text


def test_the_evaluator_converts_floats_to_int_as_the_gpu_does():
    """cvt.rzi.s32.f32 saturates and gives 0 for NaN (C leaves it undefined)."""
    s = np.array([np.nan, np.inf, -np.inf, 3e9, -3e9, 2.7, -2.7, 2147483520.0], np.float32)
    got = evaluate(parse("(int)score", SCORE_VARIABLES), dict(score=s, b=0, h=0, q_idx=0, kv_idx=0))
    assert got.tolist() == [0, 2**31 - 1, -2**31, 2**31 - 1, -2**31, 2, -2, 2147483520]


def test_the_evaluator_shifts_by_a_variable_count_as_ptx_does():
    """PTX shl/shr read the count as unsigned and clamp it at 32 (C leaves it undefined)."""
    k = np.array([-1, 0, 3, 31, 32, 33, 1000])
    shl = evaluate(parse("1 << kv_idx", MASK_VARIABLES), dict(kv_idx=k))
    assert shl.tolist() == [0, 1, 8, -2**31, 0, 0, 0]
    assert evaluate(parse("-8 >> kv_idx", MASK_VARIABLES), dict(kv_idx=k)).tolist() == [-1, -8, -1, -1, -1, -1, -1]
    assert evaluate(parse("8 >> kv_idx", MASK_VARIABLES), dict(kv_idx=k)).tolist() == [0, 8, 1, 0, 0, 0, 0]


def test_score_constants_are_folded_in_float32():
    with pytest.raises(ExpressionError, match="divides by zero"):
        expression.score("score / (float)(int)(16777217.f - 16777216.f)")
    assert expression.score("score / (float)(int)(16777217. - 16777216.)")  # in double: 1


def test_a_call_whose_indices_reach_the_printed_range_is_refused():
    """The kernel prints sums of indices as plain int arithmetic because each stays below
    INDEX_LIMIT: a call past it is refused by name (fagen's Kernel.check calls this)."""
    from fagen.expression import INDEX_LIMIT, check_indices

    check_indices(b=1, h=8, q_idx=INDEX_LIMIT, kv_idx=INDEX_LIMIT)  # indices 0 .. INDEX_LIMIT - 1
    with pytest.raises(ValueError, match=r"kv_idx runs to 1073741824: .* below 1073741824"):
        check_indices(b=1, h=8, q_idx=4, kv_idx=INDEX_LIMIT + 1)


def test_int_overflow_names_the_first_int_term_that_may_leave_int32_at_given_extents():
    """What fagen.flex refuses at a call's lengths: the first int + - * (operands first) whose
    bounds, with each variable below its extent, pass int32; none where they cannot."""
    from fagen import expression

    tree = expression.score("score + 1e-9f * (float)((q_idx - kv_idx) * (q_idx - kv_idx) * (q_idx - kv_idx))")
    assert expression.int_overflow(tree, dict(q_idx=1000, kv_idx=1000)) is None
    wraps = expression.int_overflow(tree, dict(q_idx=4000, kv_idx=4000))
    assert expression.source(wraps) == "(q_idx - kv_idx) * (q_idx - kv_idx) * (q_idx - kv_idx)"
    assert expression.int_overflow(expression.score("score * (float)(q_idx * 70000)"), dict(q_idx=40000)) is not None
    assert expression.int_overflow(expression.score("score * (float)(q_idx * 70000)"), dict(q_idx=30)) is None
