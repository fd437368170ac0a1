"""Derivatives of expression trees (fagen.expression's nodes), as trees: the chain rule's pieces
that tracing a score_mod (fagen.mod_tracing: d value / d score, forward mode) and a captured
tensor's gradient (d expression / d one of its reads: fagen.captured_grads, and the backward
kernel's in-kernel sum, backward.captured_grads) share. None stands for a derivative of 0."""

from __future__ import annotations

import math

from fagen.expression import (BOOL, FLOAT, Binary, Call, Cast, Conditional, Load, Name, Node, Number, Unary, constant,
                              int_bounds, loads)

LN2 = 0.6931471805599453
ZERO, ONE = Number("0.0f", FLOAT), Number("1.0f", FLOAT)


def as_float(node: Node) -> Node:
    return node if node.type == FLOAT else Cast(FLOAT, node)


def sum_grads(op: str, a: Node | None, b: Node | None) -> Node | None:
    """a + b or a - b of two derivatives."""
    if b is None:
        return a
    if a is None:
        return b if op == "+" else Unary("-", b, FLOAT)
    return Binary(op, a, b, FLOAT)


def scaled_grad(grad: Node | None, factor: Node) -> Node | None:
    """factor times a derivative, the factor cast to float."""
    if grad is None:
        return None
    return as_float(factor) if grad == ONE else Binary("*", as_float(factor), grad, FLOAT)


def load_derivative(node: Node, read: Load) -> Node | None:
    """d node / d read (every occurrence of that array element, the others held), a float tree.
    Comparisons, ints and rounding have none."""
    if node == read:
        return ONE
    if node.type != FLOAT or isinstance(node, (Number, Name, Load)):
        return None
    if isinstance(node, Cast):
        return load_derivative(node.operand, read) if node.operand.type == FLOAT else None
    if isinstance(node, Unary):
        inner = load_derivative(node.operand, read)
        if inner is None or node.op not in ("+", "-"):
            return None
        return inner if node.op == "+" else Unary("-", inner, FLOAT)
    if isinstance(node, Conditional):
        then, other = load_derivative(node.then, read), load_derivative(node.other, read)
        if then is None and other is None:
            return None
        return Conditional(node.condition, then or ZERO, other or ZERO, FLOAT)
    if isinstance(node, Binary):
        a, b = load_derivative(node.left, read), load_derivative(node.right, read)
        if node.op in "+-":
            return sum_grads(node.op, a, b)
        if node.op == "*":
            return sum_grads("+", scaled_grad(a, node.right), scaled_grad(b, node.left))
        if node.op == "/":  # (a / b)' = a' / b - a b' / b^2
            quotient = None if a is None else Binary("/", a, node.right, FLOAT)
            square = Binary("*", node.right, node.right, FLOAT)
            return sum_grads("-", quotient, None if b is None else Binary("/", scaled_grad(b, node.left), square, FLOAT))
        return None
    if isinstance(node, Call):
        return _call_derivative(node, [load_derivative(arg, read) for arg in node.args])
    return None


def _call_derivative(node: Call, inner: list[Node | None]) -> Node | None:
    """The chain rule through one of the expression language's float functions."""
    x = node.args[0]
    if node.function in ("fminf", "fmaxf"):  # the chosen argument's derivative
        a, b = inner
        if a is None and b is None:
            return None
        # the side it returned: the first on a tie (as PyTorch's), the number beside a NaN
        return Conditional(Binary("==", node, node.args[0], BOOL), a or ZERO, b or ZERO, FLOAT)
    if inner[0] is None or node.function in ("floorf", "ceilf"):
        return None
    outer = {
        "fabsf": Conditional(Binary("<", x, ZERO, BOOL), Number("-1.0f", FLOAT),  # PyTorch's sign: 0 at 0
                             Conditional(Binary(">", x, ZERO, BOOL), ONE, ZERO, FLOAT), FLOAT),
        "expf": node,
        "exp2f": Binary("*", node, Number(f"{LN2!r}f", FLOAT), FLOAT),
        "logf": Binary("/", ONE, x, FLOAT),
        "log2f": Binary("/", ONE, Binary("*", x, Number(f"{LN2!r}f", FLOAT), FLOAT), FLOAT),
        "sqrtf": Binary("/", Number("0.5f", FLOAT), node, FLOAT),
        "tanhf": Binary("-", ONE, Binary("*", node, node, FLOAT), FLOAT),
    }[node.function]
    return scaled_grad(inner[0], outer)


def read_derivatives(tree: Node, arrays: set[str] | frozenset[str]) -> list[tuple[Load, Node]]:
    """(read, d tree / d read) for each distinct read of the named arrays whose derivative is not
    0, outermost first."""
    found = ((read, load_derivative(tree, read)) for read in dict.fromkeys(loads(tree)) if read.array in arrays)
    return [(read, grad) for read, grad in found if grad is not None]


# ---- bounds: what a derivative can reach ------------------------------------------------------

class FloatOps:
    """interval's arithmetic on Python floats (a bound past float64 is inf, not an error)."""

    minimum, maximum = staticmethod(min), staticmethod(max)

    @staticmethod
    def exp(x):
        return math.exp(x) if x <= 709.0 else math.inf

    @staticmethod
    def exp2(x):
        return 2.0 ** x if x <= 1023.0 else math.inf

    @staticmethod
    def sqrt(x):
        return math.sqrt(max(x, 0.0))


def interval(node: Node, arrays: dict, extents: dict[str, int], ops=FloatOps) -> tuple | None:
    """(lo, hi): bounds on node's value while each variable v stays in 0 .. extents[v] - 1 and
    each array's elements within arrays[name] (a pair); None where none is known (the score, a
    logarithm, a division by a non-constant). Sound, not tight (a condition is not narrowed).
    `ops` does the arithmetic: FloatOps, or a twin over tensors (fagen.captured_grads keeps the
    arrays' bounds on the device)."""
    if node.type != FLOAT:
        lo, hi = int_bounds(node, extents)
        return float(lo), float(hi)
    if isinstance(node, Number):
        value = float(node.text.rstrip("fF"))
        return value, value
    if isinstance(node, Load):
        return arrays[node.array]
    if isinstance(node, Name):
        return None  # the score
    if isinstance(node, (Cast, Unary)):
        inner = interval(node.operand, arrays, extents, ops)
        if inner is None or isinstance(node, Cast) or node.op == "+":
            return inner
        return -inner[1], -inner[0]
    parts = [interval(child, arrays, extents, ops) for child in _children(node)]
    if any(part is None for part in parts):
        return None
    if isinstance(node, Conditional):
        (a, b), (c, d) = parts[1:]
        return ops.minimum(a, c), ops.maximum(b, d)
    if isinstance(node, Binary):
        (a, b), (c, d) = parts
        if node.op == "+":
            return a + c, b + d
        if node.op == "-":
            return a - d, b - c
        if node.op == "*":
            ends = (a * c, a * d, b * c, b * d)
            return _fold(ops.minimum, ends), _fold(ops.maximum, ends)
        divisor = constant(node.right) if node.op == "/" else None
        if not divisor:
            return None
        divisor = float(divisor)  # (a float literal folds to a NumPy float32)
        return (a / divisor, b / divisor) if divisor > 0 else (b / divisor, a / divisor)
    return _call_interval(node, parts, ops)


def _call_interval(node: Call, parts: list[tuple], ops) -> tuple | None:
    (a, b), *rest = parts
    if node.function == "fabsf":  # |x|: 0 where the interval holds 0, else its nearer end
        return ops.maximum(ops.maximum(a, -b), 0.0), ops.maximum(-a, b)
    if node.function in ("fminf", "fmaxf"):
        (c, d), pick = rest[0], ops.minimum if node.function == "fminf" else ops.maximum
        return pick(a, c), pick(b, d)
    if node.function == "tanhf":
        return -1.0, 1.0
    if node.function in ("floorf", "ceilf"):
        return a - 1.0, b + 1.0
    grow = {"expf": ops.exp, "exp2f": ops.exp2, "sqrtf": ops.sqrt}.get(node.function)
    return None if grow is None else (grow(a), grow(b))


def _children(node: Node) -> list[Node]:
    if isinstance(node, Call):
        return list(node.args)
    if isinstance(node, Conditional):
        return [node.condition, node.then, node.other]
    return [node.left, node.right]


def _fold(pick, values):
    result = values[0]
    for value in values[1:]:
        result = pick(result, value)
    return result


def magnitude(bounds: tuple, ops=FloatOps):
    """The largest |value| an interval holds."""
    return ops.maximum(-bounds[0], bounds[1])
