"""The expression language of `mask.expression` and `score_mod.expression`.

A spec's expression ends up in the kernel, so it is parsed here against an allow-list
before anything renders: ASCII decimal numbers, the documented variables, a few math
functions, C's arithmetic, comparison, logical and bitwise operators, `?:`, casts to
int/float/bool, parentheses and spaces. Anything else is refused by name: preprocessor tokens
and the alternative tokens of C++ (`%:` is `#`, `<%` `%>` are braces, `<:` `:>` brackets),
other whitespace (a carriage return ends a line for the preprocessor), assignment, calls to
anything not listed. The tokenizer munches the longest operator first, as a C++ lexer does,
so what is validated is what nvcc will see; a recursive-descent parser then builds a syntax
tree with each node's C type, so a syntax error never reaches the compiler, and folds its
constant parts as the kernel computes them (float32 for f literals), refusing what C++17 leaves
undefined (division by zero, a shift count outside 0..31, a negative number shifted left,
signed overflow), on which nvcc only warns and may then drop the kernel's work.

The one tree has four readers: the type check (a mask expression is a bool), the language's
printer for messages (`source`), the CUDA printer the templates paste (`cuda`), and a NumPy evaluator with C's semantics (`evaluate`:
int32 arithmetic, truncating division, float32 where the kernel computes in float) through
which fagen.oracle judges a kernel by what its spec says.

Depends on the standard library and NumPy.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

INT, FLOAT, BOOL = "int", "float", "bool"
ARRAY = "float[]"  # a variable of this type is an array read as name[int index] (a captured tensor)
INTEGRAL = (INT, BOOL)
MAX_LENGTH = 500  # characters: room for any reasonable formula, not for a program
INT_MAX = 2**31 - 1  # the kernel's positions and indices are int32
INT_MIN = -2**31
INT_BITS = 32

# The variables each expression may read, with their C types.
MASK_VARIABLES = {"b": INT, "h": INT, "q_idx": INT, "kv_idx": INT}
SCORE_VARIABLES = {"score": FLOAT, **MASK_VARIABLES}
MAX_CAPTURED = 4  # float32 arrays a score expression may read: captured0 .. captured3


def captured_names(count: int) -> tuple[str, ...]:
    """The names of a score expression's `count` captured arrays (score_mod.captured)."""
    return tuple(f"captured{i}" for i in range(count))


def score_variables(captured: int = 0) -> dict[str, str]:
    """SCORE_VARIABLES and the captured arrays' names."""
    return {**SCORE_VARIABLES, **dict.fromkeys(captured_names(captured), ARRAY)}

# Callable functions: argument types (None: int or float, converted to float by C++) -> result.
FUNCTIONS: dict[str, tuple[tuple[str | None, ...], str]] = {
    "min": ((INT, INT), INT),
    "max": ((INT, INT), INT),
    "abs": ((INT,), INT),
    "fminf": ((None, None), FLOAT),
    "fmaxf": ((None, None), FLOAT),
    # not sinf/cosf: their range reduction of large arguments keeps a stack frame (local memory)
    **{f: ((None,), FLOAT) for f in ("fabsf", "expf", "exp2f", "logf", "log2f", "sqrtf", "tanhf", "floorf",
                                     "ceilf")},
}
CASTS = {"int": INT, "float": FLOAT, "bool": BOOL}
LITERALS = {"true": BOOL, "false": BOOL}

BINARY = {  # operator -> precedence (higher binds tighter), as in C
    "||": 1, "&&": 2, "|": 3, "^": 4, "&": 5, "==": 6, "!=": 6, "<": 7, "<=": 7, ">": 7, ">=": 7,
    "<<": 8, ">>": 8, "+": 9, "-": 9, "*": 10, "/": 10, "%": 10,
}
INTEGRAL_ONLY = {"%", "<<", ">>", "&", "|", "^", "~"}
LOGICAL = {"||", "&&", "==", "!=", "<", "<=", ">", ">="}
UNARY = {"!", "-", "+", "~"}
PUNCTUATION = set(BINARY) | UNARY | {"(", ")", "?", ":", ",", "[", "]"}  # [ ]: an array's index alone

# Operator-like tokens C++ lexes (longest first) that the language refuses, with what they are.
REFUSED = {
    "%:%:": "an alternative token for '##'", "%:": "an alternative token for '#'",
    "<%": "an alternative token for '{'", "%>": "an alternative token for '}'",
    "<:": "an alternative token for '['", ":>": "an alternative token for ']'",
    "<<=": "assignment", ">>=": "assignment", "<=>": "a three-way comparison", "->*": "member access",
    "->": "member access", "::": "scope resolution", "++": "increment", "--": "decrement",
    "+=": "assignment", "-=": "assignment", "*=": "assignment", "/=": "assignment", "%=": "assignment",
    "&=": "assignment", "|=": "assignment", "^=": "assignment", "=": "assignment", ".*": "member access",
    "##": "token pasting", "#": "a preprocessor directive", ";": "a statement end", "{": "a block",
    "}": "a block", ".": "member access",
}
_OPERATORS = sorted(set(REFUSED) | PUNCTUATION, key=len, reverse=True)
# An f suffix needs a dot or an exponent: C++ reads 289f as a user-defined literal.
_NUMBER = re.compile(r"(?:(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?[fF]?|\d+[eE][+-]?\d+[fF]?|\d+)(?![A-Za-z0-9_.])",
                     re.ASCII)  # \d alone also matches other scripts' digits, which C does not read
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ExpressionError(ValueError):
    """Why an expression is refused: the offending token and what is allowed instead."""


@dataclass(frozen=True)
class Token:
    kind: str  # "number" | "name" | "op" | "end"
    text: str
    pos: int


def tokenize(text: str) -> list[Token]:
    tokens, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch == " ":
            i += 1
            continue
        if ch.isdigit() and not ch.isascii():
            example = f", e.g. {int(ch)}" if ch.isdecimal() else ""
            raise ExpressionError(f"the character {ch!r} at position {i} is a digit outside ASCII, which C does not "
                                  f"read as a number; write numbers with the digits 0-9{example}")
        if "0" <= ch <= "9" or (ch == "." and "0" <= text[i + 1:i + 2] <= "9"):
            number = _NUMBER.match(text, i)
            if number is None:
                raise ExpressionError(f"the number at position {i} is malformed: decimal integers and "
                                      f"floats only, e.g. 3, 0.5f, 1e-3f")
            tokens.append(Token("number", number.group(), i))
            i = number.end()
            continue
        name = _IDENTIFIER.match(text, i)
        if name:
            tokens.append(Token("name", name.group(), i))
            i = name.end()
            continue
        op = next((o for o in _OPERATORS if text.startswith(o, i)), None)
        if op is None:
            raise ExpressionError(f"the character {ch!r} at position {i} is not part of the expression language "
                                  f"(only spaces separate tokens; no strings, comments or other whitespace)")
        if op in REFUSED:
            raise ExpressionError(f"{op!r} at position {i} is {REFUSED[op]}, which an expression cannot contain")
        tokens.append(Token("op", op, i))
        i += len(op)
    tokens.append(Token("end", "", len(text)))
    return tokens


# ---- the syntax tree ---------------------------------------------------------------------
# Each node carries its C type and where its text starts (not part of equality: the same
# formula spaced differently is the same tree).

@dataclass(frozen=True)
class Number:
    text: str  # as written: 3, 0.5f, 1e-3 (no f: a double, as in C)
    type: str
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Name:
    name: str  # a variable, or true / false
    type: str
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Unary:
    op: str
    operand: Node
    type: str
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Cast:
    type: str  # the type cast to
    operand: Node
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Binary:
    op: str
    left: Node
    right: Node
    type: str
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Conditional:
    condition: Node
    then: Node
    other: Node
    type: str
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Call:
    function: str
    args: tuple[Node, ...]
    type: str
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Load:
    """array[index]: an element of a captured float32 array, a kernel input."""
    array: str
    index: Node
    type: str
    pos: int = field(default=0, compare=False)


Node = Number | Name | Unary | Cast | Binary | Conditional | Call | Load


def _arithmetic(*types: str) -> str:
    """C's usual arithmetic conversions, over the language's types (bool promotes to int)."""
    return FLOAT if FLOAT in types else INT


class _Parser:
    """expr := binary ('?' expr ':' expr)?; binary by precedence climbing over unary;
    unary := op unary | '(' type ')' unary | primary; primary := number | variable | literal |
    function '(' args ')' | '(' expr ')'. Each rule returns the node it parsed, typed."""

    def __init__(self, text: str, variables: dict[str, str]):
        self.tokens = tokenize(text)
        self.i = 0
        self.variables = variables

    @property
    def token(self) -> Token:
        return self.tokens[self.i]

    def take(self, text: str | None = None) -> Token:
        token = self.token
        if text is not None and token.text != text:
            raise self.error(f"expected {text!r}")
        self.i += 1
        return token

    def error(self, what: str) -> ExpressionError:
        found = "the end" if self.token.kind == "end" else f"{self.token.text!r} at position {self.token.pos}"
        return ExpressionError(f"{what}, found {found}")

    def parse(self) -> Node:
        node = self.expression()
        if self.token.kind != "end":
            raise self.error("expected an operator or the end")
        return node

    def expression(self) -> Node:
        condition = self.binary(1)
        if self.token.text != "?":
            return condition
        self.take("?")
        then = self.expression()
        self.take(":")
        other = self.expression()
        kind = BOOL if then.type == other.type == BOOL else _arithmetic(then.type, other.type)
        return Conditional(condition, then, other, kind, condition.pos)

    def binary(self, min_precedence: int) -> Node:
        left = self.unary()
        while self.token.kind == "op" and BINARY.get(self.token.text, 0) >= min_precedence:
            op = self.take()
            right = self.binary(BINARY[op.text] + 1)
            if op.text in INTEGRAL_ONLY and FLOAT in (left.type, right.type):
                raise ExpressionError(f"{op.text!r} at position {op.pos} takes integers, not float operands "
                                      f"(cast with (int) first)")
            if op.text in LOGICAL or (op.text in "&|^" and left.type == right.type == BOOL):
                kind = BOOL  # bool & bool is an int of 0 or 1 in C: a bool's values
            else:
                kind = _arithmetic(left.type, right.type)
            left = Binary(op.text, left, right, kind, left.pos)
        return left

    def unary(self) -> Node:
        token = self.token
        if token.text in UNARY:
            self.take()
            operand = self.unary()
            if token.text == "~" and operand.type == FLOAT:
                raise ExpressionError(f"'~' at position {token.pos} takes an integer, not a float")
            # -, + and ~ promote a bool to int: ~true is -2, which is not false
            return Unary(token.text, operand, BOOL if token.text == "!" else _arithmetic(operand.type), token.pos)
        if token.text == "(" and [t.text for t in self.tokens[self.i + 1:self.i + 3]] in ([c, ")"] for c in CASTS):
            self.take("(")
            kind = CASTS[self.take().text]
            self.take(")")
            return Cast(kind, self.unary(), token.pos)
        return self.primary()

    def primary(self) -> Node:
        token = self.take()
        if token.kind == "number":
            return _number(token)
        if token.text == "(":
            node = self.expression()
            self.take(")")
            return node
        if token.kind != "name":
            self.i -= 1
            raise self.error("expected a number, a variable, a function call or '('")
        if self.variables.get(token.text) == ARRAY:
            return self.load(token)
        if token.text in self.variables:
            return Name(token.text, self.variables[token.text], token.pos)
        if token.text in LITERALS:
            return Name(token.text, LITERALS[token.text], token.pos)
        if token.text in FUNCTIONS:
            return self.call(token)
        raise ExpressionError(
            f"unknown name {token.text!r} at position {token.pos}: an expression may read "
            f"{', '.join(self.variables)}, use true/false, casts to int/float/bool, and call "
            f"{', '.join(FUNCTIONS)}")

    def load(self, array: Token) -> Node:
        if self.token.text != "[":
            raise self.error(f"{array.text} is an array: read an element, {array.text}[index]")
        self.take("[")
        index = self.expression()
        self.take("]")
        if index.type == FLOAT:
            raise ExpressionError(f"{array.text}[] at position {array.pos} takes an int index; cast it, "
                                  f"{array.text}[(int)(...)]")
        return Load(array.text, index, FLOAT, array.pos)

    def call(self, function: Token) -> Node:
        params, result = FUNCTIONS[function.text]
        self.take("(")
        args = [self.expression()]
        while self.token.text == ",":
            self.take(",")
            args.append(self.expression())
        self.take(")")
        if len(args) != len(params):
            raise ExpressionError(f"{function.text}() at position {function.pos} takes {len(params)} "
                                  f"argument{'s' * (len(params) > 1)}, got {len(args)}")
        for arg, param in zip(args, params):
            if param == INT and arg.type == FLOAT:
                raise ExpressionError(f"{function.text}() at position {function.pos} takes integers; "
                                      f"use {'f' + function.text + 'f' if function.text != 'abs' else 'fabsf'} "
                                      f"for floats")
        return Call(function.text, tuple(args), result, function.pos)


def _number(token: Token) -> Number:
    text = token.text
    if any(c in text for c in ".eEfF"):
        return Number(text, FLOAT, token.pos)
    if len(text) > 1 and text[0] == "0":
        raise ExpressionError(f"the integer {text} at position {token.pos} starts with 0, which C reads as octal "
                              f"(010 is 8, 09 no number at all); write it without leading zeros, e.g. {int(text)}")
    if int(text) > INT_MAX:
        raise ExpressionError(f"the integer {text} at position {token.pos} does not fit an int "
                              f"(at most {INT_MAX}); write it as a float, e.g. {text}.f")
    return Number(text, INT, token.pos)


# ---- constants: what C leaves undefined is refused -----------------------------------------

class _Undefined(Exception):
    """A constant part C leaves undefined: the node, what is wrong, and replacements for it
    (parse offers the first that makes the whole expression valid)."""

    def __init__(self, node: Node, what: str, advice: str, candidates: list[Node]):
        super().__init__(what)
        self.node, self.what, self.advice, self.candidates = node, what, advice, candidates


def _fold(node: Node) -> int | float | bool | None:
    """node's value if it is a constant, else None, computed as the kernel computes it: int32
    with C's truncating rules, float arithmetic in float32 (np.float32; a literal without f
    and what it touches in double), the listed functions too. Raises _Undefined where a
    constant part is undefined in C: a division or remainder by zero, a shift count outside
    0..31 or a shift C++17 leaves undefined (a negative left operand, a result the unsigned
    type cannot hold), an int result outside int32, a float converted to an int it does not
    fit. Every part is checked, evaluated or not (C would warn about a dead branch too)."""
    if isinstance(node, Number):
        return int(node.text) if node.type == INT else _as_type(float(node.text.rstrip("fF")), FLOAT, _double(node))
    if isinstance(node, Name):
        return {"true": True, "false": False}.get(node.name) if node.name in LITERALS else None
    if isinstance(node, Load):
        _fold(node.index)  # its constant parts are checked; the element is only known in the kernel
        return None
    if isinstance(node, Call):
        args = [_fold(arg) for arg in node.args]
        if any(a is None for a in args):
            return None
        if node.type == INT:
            value = {"min": min, "max": max, "abs": lambda a: abs(a)}[node.function](*(int(a) for a in args))
            return _checked(node, value)  # abs(INT_MIN) overflows
        with np.errstate(all="ignore"):
            return np.float32(_FLOAT_FUNCTIONS[node.function](*(np.float32(a) for a in args)))
    if isinstance(node, Conditional):
        condition, then, other = _fold(node.condition), _fold(node.then), _fold(node.other)
        chosen = None if condition is None else then if condition else other
        # a constant condition picks its branch whatever the other one is (as nvcc folds it: a
        # remainder by `36 ? false : score` is a remainder by zero)
        return None if chosen is None else _as_type(chosen, node.type, _double(node))
    if isinstance(node, Cast):
        value = _fold(node.operand)
        if value is None:
            return None
        if node.type == INT and isinstance(value, (float, np.floating)) and not (
                math.isfinite(value) and INT_MIN <= math.trunc(float(value)) <= INT_MAX):
            saturated = INT_MAX if value > 0 else INT_MIN  # what the GPU's conversion gives
            raise _Undefined(node, f"converts {float(value):.10g} to an int, too small to hold it",
                             "convert a value within -2147483648..2147483647 or write the int",
                             [Cast(INT, Number("1e9f", FLOAT)), _int_literal(saturated)])
        return _as_type(value, node.type, _double(node))
    if isinstance(node, Unary):
        value = _fold(node.operand)
        if value is None:
            return None
        if node.op == "!":
            return not value
        value = _as_type(value, node.type, _double(node))
        return _checked(node, {"-": -value, "+": value, "~": ~value if node.type == INT else value}[node.op])
    left, right = _fold(node.left), _fold(node.right)
    if node.op in ("/", "%") and right is not None and right == 0:
        one = Number("1" if node.right.type != FLOAT else "1.f", node.right.type)
        raise _Undefined(node, "divides by zero", "divide by a nonzero number", [_with(node, right=one)])
    if node.op in ("<<", ">>") and right is not None and not 0 <= right < INT_BITS:
        counts = range(min(max(int(right), 0), INT_BITS - 1), -1, -1)
        raise _Undefined(node, f"shifts by {int(right)}", "shift an int by 0..31",
                         [_with(node, right=Number(str(c), INT)) for c in counts])
    if node.op == "<<" and left is not None and right is not None:
        _check_left_shift(node, int(left), int(right))
    if node.op in ("&&", "||") and left is not None and bool(left) == (node.op == "||"):
        return node.op == "||"  # decided by its left operand, as C's short circuit (false && x, true || x)
    if left is None or right is None:
        return None
    if node.op in ("&&", "||"):
        return bool(left) and bool(right) if node.op == "&&" else bool(left) or bool(right)
    kind, double = _arithmetic(node.left.type, node.right.type), _double(node.left) or _double(node.right)
    a, b = _as_type(left, kind, double), _as_type(right, kind, double)
    if node.op in LOGICAL:
        return bool({"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[node.op])
    if node.op in ("/", "%") and kind == INT:
        quotient = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)
        if node.op == "%" and not INT_MIN <= quotient <= INT_MAX:  # C: a % b is undefined where a / b is
            raise _Undefined(node, f"overflows int (its quotient {quotient} is outside {INT_MIN}..{INT_MAX})",
                             "write its value", [_int_literal(a - quotient * b)])
        value = quotient if node.op == "/" else a - quotient * b
    elif node.op == "<<":
        value = _wrapped(a << b)  # C++17: the unsigned result converted to int
    else:
        with np.errstate(all="ignore"):
            value = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b,
                     ">>": lambda: a >> b, "&": lambda: a & b, "|": lambda: a | b, "^": lambda: a ^ b}[node.op]()
    return _as_type(_checked(node, value), node.type, _double(node))


def _check_left_shift(node: Binary, a: int, count: int) -> None:
    """C++17 [expr.shift]: E1 << E2 for a signed E1 is defined where E1 is non-negative and
    E1 * 2^E2 fits the unsigned type; the value is then that unsigned number converted to int."""
    if a < 0:
        raise _Undefined(node, f"shifts the negative number {a} left", "multiply instead or write its value",
                         [Binary("*", node.left, Number(str(2 ** count), INT), INT)] * (count < INT_BITS - 1) +
                         [_int_literal(_wrapped(a << count))])
    if a << count >= 2 ** INT_BITS:
        raise _Undefined(node, f"is {a << count}, which an unsigned int cannot hold", "shift less or write a value",
                         [_with(node, right=Number(str(c), INT)) for c in range(count - 1, -1, -1)
                          if a << c < 2 ** INT_BITS])


def _wrapped(value: int) -> int:
    """value modulo 2^32 as an int32: what unsigned arithmetic converted to int gives."""
    return (value + 2 ** 31) % 2 ** INT_BITS - 2 ** 31


def _int_literal(value: int) -> Node:
    """An int constant as the language writes it (-2147483648 is no literal: 2147483648 is not an int)."""
    if value == INT_MIN:
        return Binary("-", Unary("-", Number(str(INT_MAX), INT), INT), Number("1", INT), INT)
    return Unary("-", Number(str(-value), INT), INT) if value < 0 else Number(str(value), INT)


def _double(node: Node) -> bool:
    """Whether a float node is computed in double: a literal without f, or arithmetic on one
    (C's usual conversions); casts to float and the f functions are float."""
    if isinstance(node, Number):
        return node.type == FLOAT and node.text[-1] not in "fF"
    if isinstance(node, (Unary, Binary, Conditional)) and node.type == FLOAT:
        parts = {Unary: ("operand",), Binary: ("left", "right"), Conditional: ("then", "other")}[type(node)]
        return any(_double(getattr(node, p)) for p in parts)
    return False


def _as_type(value, kind: str, double: bool = False):
    if kind == BOOL:
        return bool(value)
    if kind == FLOAT:
        return np.float64(value) if double else np.float32(value)
    return int(value)


def _checked(node: Node, value):
    """An int result must fit int32: C's signed overflow is undefined."""
    if node.type == INT and not INT_MIN <= value <= INT_MAX:
        raise _Undefined(node, f"overflows int (its value {value} is outside {INT_MIN}..{INT_MAX})",
                         "compute it in float or write an int value",
                         [_in_float(node, value), _int_literal(_wrapped(value)),
                          _int_literal(INT_MAX if value > 0 else INT_MIN)])
    return value


def _replaced(tree: Node, old: Node, new: Node) -> Node:
    """tree with the node `old` (that very object) replaced by `new`."""
    if tree is old:
        return new
    if isinstance(tree, Call):
        return Call(tree.function, tuple(_replaced(a, old, new) for a in tree.args), tree.type, tree.pos)
    parts = {Unary: ("operand",), Cast: ("operand",), Binary: ("left", "right"),
             Conditional: ("condition", "then", "other"), Load: ("index",)}.get(type(tree), ())
    if not parts:
        return tree
    changes = {p: _replaced(getattr(tree, p), old, new) for p in parts}
    return type(tree)(**{**{f: getattr(tree, f) for f in tree.__dataclass_fields__}, **changes})


def _refused(tree: Node, undefined: _Undefined, variables: dict[str, str], result: str | None) -> ExpressionError:
    """The error for an undefined constant part, with the first replacement that makes the whole
    expression valid (else the first the surrounding operators accept)."""
    texts = [source(_replaced(tree, undefined.node, c)) for c in undefined.candidates]
    fix = next((c for c, t in zip(undefined.candidates, texts) if _valid(t, variables, result)), None)
    if fix is None:
        fix = next((c for c, t in zip(undefined.candidates, texts) if _typed(t, variables)), undefined.candidates[0])
    node = undefined.node
    return ExpressionError(f"{source(node)!r} at position {node.pos} {undefined.what}, which C leaves undefined "
                           f"(nvcc may then drop the kernel's work); {undefined.advice}, e.g. {source(fix)}")


def _valid(text: str, variables: dict[str, str], result: str | None) -> bool:
    try:
        parse(text, variables, result)
    except ExpressionError:
        return False
    return True


def _typed(text: str, variables: dict[str, str]) -> bool:
    try:
        _Parser(text, variables).parse()
    except ExpressionError:
        return False
    return True


def _with(node: Binary, **changes) -> Binary:
    return Binary(**{"op": node.op, "left": node.left, "right": node.right, "type": node.type, **changes})


def _in_float(node: Node, value: int) -> Node:
    """A constant int node (of `value`) computed in float: its int literals written as floats
    through + - * / and signs, any other int part (%, shifts, bits, casts) as its value."""
    if isinstance(node, Unary) and node.op in "-+":
        return Unary(node.op, _in_float(node.operand, _fold(node.operand)), FLOAT)
    if isinstance(node, Binary) and node.op in "+-*/" and node.type == INT:
        return Binary(node.op, _in_float(node.left, _fold(node.left)), _in_float(node.right, _fold(node.right)), FLOAT)
    return node if node.type == FLOAT else Number(f"{int(value)}.f", FLOAT)


# ---- the printers -------------------------------------------------------------------------
CONDITIONAL_PRECEDENCE, UNARY_PRECEDENCE, PRIMARY_PRECEDENCE = 0, 11, 12
# What the kernel's b, h, q_idx, kv_idx can be: indices, non-negative, and below 2^30 (a
# sequence of 2^30 positions is 128 GiB of 16-bit K per head at head_dim 64: no device holds
# one), so a sum or difference of two of them fits an int and is printed as written.
INDEX_LIMIT = 2**30


def check_indices(**extents: int) -> None:
    """Refuse a call whose indices (each variable's extent: B, H, Nq, Nk) could reach INDEX_LIMIT,
    where the printed int arithmetic would no longer be what the evaluator computes."""
    for name, extent in extents.items():
        if extent > INDEX_LIMIT:
            raise ValueError(f"{name} runs to {extent - 1}: an expression's {', '.join(extents)} must stay below "
                             f"{INDEX_LIMIT} (its int arithmetic is printed for that range); split the call into "
                             f"pieces of at most {INDEX_LIMIT} along that dimension")


def source(node: Node) -> str:
    """The expression language's text of a tree: binary operators spaced, parentheses only
    where C's precedence needs them, literals as written. Parses back to the same tree."""
    return _print(node, kernel=False, exact=False)[0]


# The kernel's logarithms and exponential: the MUFU approximations (CUDA's __logf: lg2.approx and
# a multiply, about 2^-21 absolute error near 1; __expf: ex2.approx, 2 + 1.16 |x| ulp), as
# FlexAttention's Triton kernels compute them. logf is some 30 instructions and a branch an
# element: T5's log-spaced buckets ran at a third of the relative-bias table's speed.
FAST_FUNCTIONS = {"logf": "__logf", "log2f": "__log2f", "expf": "__expf"}


def cuda(node: Node) -> str:
    """The C++ text the kernel pastes: `source`, except where C and the NumPy evaluator would
    part, and an array's index clamped into 0 .. <array>_size - 1 (elements past a tile's end
    reach it, to be masked after). An int + - * (or negation) that may overflow int32 is computed in unsigned and
    converted back, which wraps as the evaluator does (the same IADD/IMAD instruction; signed
    overflow would be undefined, and nvcc may assume it away). Float + - * on a path to a
    comparison, a cast to int or bool, a condition or `!` (all of a mask expression) are
    __fadd_rn/__fsub_rn/__fmul_rn (__d*_rn in double), so nvcc does not contract them into an
    FMA whose single rounding the evaluator's float32 steps do not reproduce. Elsewhere (a
    score) the text is `source`, and nvcc may contract. logf, log2f and expf print as their fast
    intrinsics (FAST_FUNCTIONS) on every path: no CUDA logarithm rounds as NumPy's does (logf
    is within 1 ulp, __logf within about 2^-21 near 1), so a decision taken on one exactly at a
    boundary may differ from the evaluator's either way. Int / and % by a non-constant divisor
    are printed as written: C leaves x / 0 and INT_MIN / -1 undefined, and the evaluator's 0
    there is no promise about the kernel."""
    return _print(node, kernel=True, exact=False)[0]


def _print(node: Node, kernel: bool, exact: bool) -> tuple[str, int]:
    """(text, precedence of its outermost operator)."""
    def operand(child: Node, precedence: int, exact_child: bool = exact) -> str:
        text, own = _print(child, kernel, exact_child)
        return f"({text})" if own < precedence else text

    if isinstance(node, Number):
        return node.text, PRIMARY_PRECEDENCE
    if isinstance(node, Name):
        return node.name, PRIMARY_PRECEDENCE
    if isinstance(node, Load):
        index = _print(node.index, kernel, exact)[0]
        if kernel:  # rows and keys past a tile's end reach the expression too (masked after): never past the array
            index = f"min(max({index}, 0), {node.array}_size - 1)"
        return f"{node.array}[{index}]", PRIMARY_PRECEDENCE
    if isinstance(node, Call):
        function = FAST_FUNCTIONS.get(node.function, node.function) if kernel else node.function
        return f"{function}({', '.join(operand(arg, 0) for arg in node.args)})", PRIMARY_PRECEDENCE
    if isinstance(node, Cast):
        return f"({node.type}){operand(node.operand, UNARY_PRECEDENCE, exact or node.type != FLOAT)}", UNARY_PRECEDENCE
    if isinstance(node, Unary):
        text = operand(node.operand, UNARY_PRECEDENCE, exact or node.op == "!")
        if kernel and node.op == "-" and node.type == INT and _overflows(node):
            return f"(int)(0u - (unsigned){text})", UNARY_PRECEDENCE
        # - -x would lex as the decrement --
        return node.op + (f"({text})" if node.op in "+-" and text.startswith(node.op) else text), UNARY_PRECEDENCE
    if isinstance(node, Binary):
        precedence = BINARY[node.op]  # left-associative: a right operand of equal precedence is grouped
        exact_operands = exact or node.op in LOGICAL
        if kernel and node.op in "+-*" and node.type == INT and _overflows(node):
            left, right = (operand(x, UNARY_PRECEDENCE, exact_operands) for x in (node.left, node.right))
            return f"(int)((unsigned){left} {node.op} (unsigned){right})", UNARY_PRECEDENCE
        if kernel and exact and node.op in "+-*" and node.type == FLOAT:
            name = {"+": "add", "-": "sub", "*": "mul"}[node.op]
            args = ", ".join(operand(x, 0) for x in (node.left, node.right))
            return f"__{'d' if _double(node) else 'f'}{name}_rn({args})", PRIMARY_PRECEDENCE
        left = operand(node.left, precedence, exact_operands)
        return f"{left} {node.op} {operand(node.right, precedence + 1, exact_operands)}", precedence
    condition = operand(node.condition, CONDITIONAL_PRECEDENCE + 1, True)
    return (f"{condition} ? {_print(node.then, kernel, exact)[0]} : {_print(node.other, kernel, exact)[0]}",
            CONDITIONAL_PRECEDENCE)


def _overflows(node: Unary | Binary, extents: dict[str, int] | None = None) -> bool:
    """Whether an int + - * or negation may leave int32, given its operands' bounds."""
    if isinstance(node, Unary):
        lo, hi = _bounds(node.operand, extents)
        return -lo > INT_MAX
    (a, b), (c, d) = _bounds(node.left, extents), _bounds(node.right, extents)
    ends = {"+": (a + c, b + d), "-": (a - d, b - c), "*": (a * c, a * d, b * c, b * d)}[node.op]
    return min(ends) < INT_MIN or max(ends) > INT_MAX


def _bounds(node: Node, extents: dict[str, int] | None = None) -> tuple[int, int]:
    """Bounds on an int or bool node's value in the kernel (int32 at worst); `extents`: a
    variable's values are 0 .. extents[name] - 1 (else as the kernel's indices bound them)."""
    full = (INT_MIN, INT_MAX)
    if node.type == BOOL:
        return 0, 1
    if node.type != INT:
        return full
    if isinstance(node, Number):
        return int(node.text), int(node.text)
    if isinstance(node, Name):
        return 0, (extents or {}).get(node.name, INDEX_LIMIT) - 1
    if isinstance(node, Cast):
        return _bounds(node.operand, extents) if node.operand.type != FLOAT else full
    if isinstance(node, Conditional):
        taken = [_narrowed(branch, node.condition, holds, _bounds(branch, extents))
                 for branch, holds in ((node.then, True), (node.other, False))]
        taken = [(lo, hi) for lo, hi in taken if lo <= hi] or [(0, 0)]  # neither: never evaluated
        return min(lo for lo, _ in taken), max(hi for _, hi in taken)
    if isinstance(node, Call):
        (a, b), *rest = [_bounds(arg, extents) for arg in node.args]
        if node.function == "abs":
            return (0 if a <= 0 <= b else min(abs(a), abs(b))), min(max(abs(a), abs(b)), INT_MAX)
        (c, d), pick = rest[0], min if node.function == "min" else max
        return pick(a, c), pick(b, d)
    if isinstance(node, Unary):
        a, b = _bounds(node.operand, extents)
        if node.op == "-":
            return full if _overflows(node, extents) else (-b, -a)
        return (~b, ~a) if node.op == "~" else (a, b)
    (a, b), (c, d) = _bounds(node.left, extents), _bounds(node.right, extents)
    if node.op in "+-*":
        if _overflows(node, extents):
            return full
        ends = {"+": (a + c, b + d), "-": (a - d, b - c), "*": (a * c, a * d, b * c, b * d)}[node.op]
        return min(ends), max(ends)
    largest = max(abs(a), abs(b))
    if node.op == "/":
        if c == d and c > 0:  # by a positive constant: C truncates toward zero, monotone in the dividend
            return int(a / c), int(b / c)
        return max(-largest, INT_MIN), min(largest, INT_MAX)
    if node.op == "%":  # |r| < |divisor| and |r| <= |dividend|, with the dividend's sign
        size = min(largest, max(abs(c), abs(d)) - 1)
        return (0 if a >= 0 else -size), (0 if b <= 0 else size)
    if node.op == ">>":
        return min(a, 0), max(b, 0)
    if node.op == "&" and (a >= 0 or c >= 0):
        return 0, min(x for x, low in ((b, a), (d, c)) if low >= 0)
    if node.op in "|^" and a >= 0 and c >= 0:
        return 0, 2 ** max(b, d).bit_length() - 1
    return full


_NEGATED = {"<": ">=", "<=": ">", ">": "<=", ">=": "<"}


def _narrowed(value: Node, condition: Node, holds: bool, bounds: tuple[int, int]) -> tuple[int, int]:
    """`value`'s bounds where `condition` is `holds`, when it compares `value` itself with a
    number (rel < 16 ? rel : ...: rel < 16 in the first branch); empty (lo > hi) where it never
    holds."""
    if not (isinstance(condition, Binary) and condition.op in _NEGATED and condition.left == value
            and isinstance(condition.right, Number) and condition.right.type == INT):
        return bounds
    op, c = condition.op if holds else _NEGATED[condition.op], int(condition.right.text)
    lo, hi = bounds
    return {"<": (lo, min(hi, c - 1)), "<=": (lo, min(hi, c)), ">": (max(lo, c + 1), hi), ">=": (max(lo, c), hi)}[op]


def int_overflow(node: Node, extents: dict[str, int]) -> Node | None:
    """The first int + - * or negation in `node` (operands before the operation) that may leave
    int32 while each named variable v stays in 0 .. extents[v] - 1: where the kernel's int32
    would wrap (its printer wraps through unsigned) and a 64-bit computation would not. None if
    there is none."""
    children = {Number: (), Name: (), Unary: ("operand",), Cast: ("operand",), Binary: ("left", "right"),
                Conditional: ("condition", "then", "other"), Load: ("index",)}.get(type(node))
    for child in node.args if isinstance(node, Call) else [getattr(node, c) for c in children]:
        found = int_overflow(child, extents)
        if found is not None:
            return found
    if isinstance(node, (Unary, Binary)) and node.type == INT and (isinstance(node, Unary) and node.op == "-"
                                                                 or isinstance(node, Binary) and node.op in "+-*"):
        return node if _overflows(node, extents) else None
    return None


def reads(node: Node) -> frozenset[str]:
    """The variables an expression reads."""
    if isinstance(node, Name):
        return frozenset() if node.name in LITERALS else frozenset((node.name,))
    if isinstance(node, Load):
        return frozenset((node.array,)) | reads(node.index)
    children = {Number: (), Unary: ("operand",), Cast: ("operand",), Binary: ("left", "right"),
                Conditional: ("condition", "then", "other")}.get(type(node))
    parts = node.args if isinstance(node, Call) else [getattr(node, c) for c in children]
    return frozenset().union(*map(reads, parts))


# ---- the NumPy evaluator -------------------------------------------------------------------
_FLOAT_FUNCTIONS = {"fabsf": np.abs, "expf": np.exp, "exp2f": np.exp2, "logf": np.log, "log2f": np.log2,
                    "sqrtf": np.sqrt, "tanhf": np.tanh, "floorf": np.floor, "ceilf": np.ceil,
                    "fminf": np.fmin, "fmaxf": np.fmax}  # fmin/fmax: a NaN argument yields the other, as in C
_INT_FUNCTIONS = {"min": np.minimum, "max": np.maximum, "abs": np.abs}


def evaluate(node: Node, values: dict, float_type=np.float32) -> np.ndarray:
    """The expression over arrays of its variables (b, h, q_idx, kv_idx ints, score float),
    broadcast together, with C's semantics: int32 arithmetic (wrapping), division truncating
    toward zero and a remainder with the dividend's sign, bool promoted to int, float math in
    `float_type` (float32 as the kernel computes; float64 for a reference of the formula's
    exact value), a literal without f a double, ?: as np.where. Both sides of && || ?: are
    evaluated (elementwise), so a division by zero a C program would skip yields an
    arbitrary number there, never an error."""
    with np.errstate(all="ignore"):
        return _eval(node, values, np.dtype(float_type))


def _eval(node: Node, values: dict, float_type: np.dtype) -> np.ndarray:
    if isinstance(node, Number):
        if node.type == INT:
            return np.asarray(int(node.text), np.int32)
        single = node.text[-1] in "fF"
        return np.asarray(float(node.text.rstrip("fF")), np.float32 if single else np.float64).astype(
            float_type if single else np.promote_types(float_type, np.float64))
    if isinstance(node, Name):
        if node.name in LITERALS:
            return np.asarray(node.name == "true")
        return _to(np.asarray(values[node.name]), node.type, float_type)
    if isinstance(node, Load):
        index = _to(np.asarray(_eval(node.index, values, float_type)), INT, float_type)
        return np.asarray(values[node.array], float_type)[index]
    if isinstance(node, Cast):
        return _to(_eval(node.operand, values, float_type), node.type, float_type)
    if isinstance(node, Call):
        args = [_eval(arg, values, float_type) for arg in node.args]
        if node.type == INT:
            return _INT_FUNCTIONS[node.function](*(_to(a, INT, float_type) for a in args)).astype(np.int32)
        return _FLOAT_FUNCTIONS[node.function](*(_to(a, FLOAT, float_type) for a in args)).astype(float_type)
    if isinstance(node, Conditional):
        condition = _to(_eval(node.condition, values, float_type), BOOL, float_type)
        then, other = _eval(node.then, values, float_type), _eval(node.other, values, float_type)
        if node.type != BOOL:
            then, other = _promoted(then, other)
        return np.where(condition, then, other)
    if isinstance(node, Unary):
        operand = _eval(node.operand, values, float_type)
        if node.op == "!":
            return ~_to(operand, BOOL, float_type)
        operand = _promoted(operand)[0]
        return {"-": np.negative, "+": np.positive, "~": np.invert}[node.op](operand)
    left, right = _eval(node.left, values, float_type), _eval(node.right, values, float_type)
    if node.op in ("&&", "||"):
        left, right = _to(left, BOOL, float_type), _to(right, BOOL, float_type)
        return left & right if node.op == "&&" else left | right
    left, right = _promoted(left, right)
    if node.op in LOGICAL:
        return {"==": np.equal, "!=": np.not_equal, "<": np.less, "<=": np.less_equal, ">": np.greater,
                ">=": np.greater_equal}[node.op](left, right)
    integral = left.dtype == np.int32
    if node.op == "/" and integral:  # truncating; x / 0 is undefined in C: 0 here
        remainder = np.fmod(left, right)
        value = (left - remainder) // np.where(right == 0, 1, right)
    elif node.op == "%":
        value = np.fmod(left, right)  # C's sign rule: the dividend's
    elif node.op in ("<<", ">>"):
        # C leaves a count outside 0..31 undefined (a constant one is refused); nvcc emits PTX
        # shl/shr for a variable count, which read it as unsigned and clamp it at 32: 0 for <<,
        # the sign for >>. NumPy's shifts by 32 give the same.
        count = np.where((right < 0) | (right > INT_BITS), INT_BITS, right)
        value = (np.left_shift if node.op == "<<" else np.right_shift)(left, count)
    else:
        value = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide, "&": np.bitwise_and,
                 "|": np.bitwise_or, "^": np.bitwise_xor}[node.op](left, right)
    value = np.asarray(value).astype(left.dtype)  # NumPy widens int32 // int32 scalars; C does not
    return value.astype(bool) if node.type == BOOL else value


def _to(value: np.ndarray, kind: str, float_type: np.dtype) -> np.ndarray:
    """A C conversion: to bool (nonzero, NaN too), to int (truncating toward zero), to float.
    A float outside int32 (or NaN) is undefined in C; the GPU's conversion (cvt.rzi.s32)
    saturates and gives 0 for NaN, and so does this."""
    if kind == BOOL:
        return value != 0
    if kind == INT:
        if value.dtype.kind != "f":
            return value.astype(np.int32)
        truncated = np.nan_to_num(np.trunc(value.astype(np.float64)), nan=0, posinf=INT_MAX, neginf=INT_MIN)
        return np.clip(truncated, INT_MIN, INT_MAX).astype(np.int32)
    return value.astype(float_type)


def _promoted(*values: np.ndarray) -> list[np.ndarray]:
    """C's usual arithmetic conversions: bool -> int; int with a float -> that float; float
    with double -> double."""
    kinds = [v.dtype for v in values]
    floats = [k for k in kinds if k.kind == "f"]
    common = max(floats, key=lambda k: k.itemsize) if floats else np.dtype(np.int32)
    return [v.astype(common) for v in values]


# ---- the checks a spec runs ----------------------------------------------------------------

def parse(text: str, variables: dict[str, str], result: str | None = None) -> Node:
    """The typed syntax tree of `text` over `variables`, its constants proven defined, of C
    type `result` if given; raises ExpressionError naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ExpressionError("an expression must be non-empty text")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"{len(text)} characters, over the limit of {MAX_LENGTH}")
    tree = _Parser(text, variables).parse()
    try:
        _fold(tree)
    except _Undefined as undefined:
        raise _refused(tree, undefined, variables, result) from None
    if result == BOOL and tree.type != BOOL:
        compared = Binary("!=", tree, Number("0", INT), BOOL)
        raise ExpressionError(f"a mask expression must be a bool (a comparison or &&/||), and {text.strip()!r} is "
                              f"{'an' if tree.type == INT else 'a'} {tree.type}; compare it, e.g. {source(compared)}")
    return tree


def check(text: str, variables: dict[str, str], result: str | None = None) -> str:
    """The C type of `text` over `variables`; raises ExpressionError naming what is wrong."""
    return parse(text, variables, result).type


def mask(text: str) -> Node:
    """A spec's mask.expression: a bool over b, h, q_idx, kv_idx."""
    return parse(text, MASK_VARIABLES, BOOL)


def score(text: str, captured: int = 0) -> Node:
    """A spec's score_mod.expression or expression_grad: a number over score, b, h, q_idx, kv_idx
    (and `captured` arrays, captured0[i] ...)."""
    return parse(text, score_variables(captured))


def loads(node: Node) -> list[Load]:
    """The array elements an expression reads, outermost first."""
    if isinstance(node, Load):
        return [node, *loads(node.index)]
    children = {Number: (), Name: (), Unary: ("operand",), Cast: ("operand",), Binary: ("left", "right"),
                Conditional: ("condition", "then", "other")}.get(type(node))
    parts = node.args if isinstance(node, Call) else [getattr(node, c) for c in children]
    return [found for part in parts for found in loads(part)]


def constant(node: Node) -> int | float | bool | None:
    """node's value where it is a constant (as the kernel computes it), else None."""
    return _fold(node)


def int_bounds(node: Node, extents: dict[str, int]) -> tuple[int, int]:
    """Bounds on an int node's value while each variable v stays in 0 .. extents[v] - 1 (interval
    arithmetic: sound, not always tight)."""
    return _bounds(node, extents)
