"""The expression language of `mask.expression` and `score_mod.expression`.

A spec's expression is pasted into the kernel, so it is parsed here against an allow-list
before anything renders: numbers, the documented variables, a few math functions, C's
arithmetic, comparison, logical and bitwise operators, `?:`, casts to int/float/bool,
parentheses and spaces. Anything else is refused by name: preprocessor tokens and the
alternative tokens of C++ (`%:` is `#`, `<%` `%>` are braces, `<:` `:>` brackets), other
whitespace (a carriage return ends a line for the preprocessor), assignment, calls to
anything not listed. The tokenizer munches the longest operator first, as a C++ lexer does,
so what is validated is what nvcc will see; a recursive-descent parser then checks the
grammar and the operand types, so a syntax error never reaches the compiler.

Depends on nothing but the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

INT, FLOAT, BOOL = "int", "float", "bool"
INTEGRAL = (INT, BOOL)
MAX_LENGTH = 500  # characters: room for any reasonable formula, not for a program
INT_MAX = 2**31 - 1  # the kernel's positions and indices are int32

# The variables each expression may read, with their C types.
MASK_VARIABLES = {"b": INT, "h": INT, "q_idx": INT, "kv_idx": INT}
SCORE_VARIABLES = {"score": FLOAT, **MASK_VARIABLES}

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
PUNCTUATION = set(BINARY) | UNARY | {"(", ")", "?", ":", ","}

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
    "}": "a block", "[": "indexing", "]": "indexing", ".": "member access",
}
_OPERATORS = sorted(set(REFUSED) | PUNCTUATION, key=len, reverse=True)
# An f suffix needs a dot or an exponent: C++ reads 289f as a user-defined literal.
_NUMBER = re.compile(r"(?:(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?[fF]?|\d+[eE][+-]?\d+[fF]?|\d+)(?![A-Za-z0-9_.])")
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
        if ch.isdigit() or (ch == "." and text[i + 1:i + 2].isdigit()):
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


class _Parser:
    """expr := binary ('?' expr ':' expr)?; binary by precedence climbing over unary;
    unary := op unary | '(' type ')' unary | primary; primary := number | variable | literal |
    function '(' args ')' | '(' expr ')'. Each rule returns the C type of what it parsed."""

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

    def parse(self) -> str:
        kind = self.expression()
        if self.token.kind != "end":
            raise self.error("expected an operator or the end")
        return kind

    def expression(self) -> str:
        kind = self.binary(1)
        if self.token.text != "?":
            return kind
        self.take("?")
        then = self.expression()
        self.take(":")
        other = self.expression()
        return FLOAT if FLOAT in (then, other) else INT if INT in (then, other) else BOOL

    def binary(self, min_precedence: int) -> str:
        left = self.unary()
        while self.token.kind == "op" and BINARY.get(self.token.text, 0) >= min_precedence:
            op = self.take()
            right = self.binary(BINARY[op.text] + 1)
            if op.text in INTEGRAL_ONLY and FLOAT in (left, right):
                raise ExpressionError(f"{op.text!r} at position {op.pos} takes integers, not float operands "
                                      f"(cast with (int) first)")
            left = BOOL if op.text in LOGICAL else (FLOAT if FLOAT in (left, right) else INT)
        return left

    def unary(self) -> str:
        token = self.token
        if token.text in UNARY:
            self.take()
            kind = self.unary()
            if token.text == "~" and kind == FLOAT:
                raise ExpressionError(f"'~' at position {token.pos} takes an integer, not a float")
            return BOOL if token.text == "!" else kind
        if token.text == "(" and [t.text for t in self.tokens[self.i + 1:self.i + 3]] in ([c, ")"] for c in CASTS):
            self.take("(")
            kind = CASTS[self.take().text]
            self.take(")")
            self.unary()
            return kind
        return self.primary()

    def primary(self) -> str:
        token = self.take()
        if token.kind == "number":
            if not any(c in token.text for c in ".eEfF") and int(token.text) > INT_MAX:
                raise ExpressionError(f"the integer {token.text} at position {token.pos} does not fit an int "
                                      f"(at most {INT_MAX}); write it as a float, e.g. {token.text}.f")
            return FLOAT if any(c in token.text for c in ".eEfF") else INT
        if token.text == "(":
            kind = self.expression()
            self.take(")")
            return kind
        if token.kind != "name":
            self.i -= 1
            raise self.error("expected a number, a variable, a function call or '('")
        if token.text in self.variables:
            return self.variables[token.text]
        if token.text in LITERALS:
            return LITERALS[token.text]
        if token.text in FUNCTIONS:
            return self.call(token)
        raise ExpressionError(
            f"unknown name {token.text!r} at position {token.pos}: an expression may read "
            f"{', '.join(self.variables)}, use true/false, casts to int/float/bool, and call "
            f"{', '.join(FUNCTIONS)}")

    def call(self, function: Token) -> str:
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
        for kind, param in zip(args, params):
            if param == INT and kind == FLOAT:
                raise ExpressionError(f"{function.text}() at position {function.pos} takes integers; "
                                      f"use {'f' + function.text + 'f' if function.text != 'abs' else 'fabsf'} "
                                      f"for floats")
        return result


def check(text: str, variables: dict[str, str]) -> str:
    """The C type of `text` over `variables`; raises ExpressionError naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ExpressionError("an expression must be non-empty text")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"{len(text)} characters, over the limit of {MAX_LENGTH}")
    return _Parser(text, variables).parse()
