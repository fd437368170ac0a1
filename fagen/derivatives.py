"""Derivatives of expression trees (fagen.expression's nodes), as trees: the chain rule's pieces
that tracing a score_mod (fagen.mod_tracing: d value / d score, forward mode) and a captured
tensor's gradient (d expression / d one of its reads: fagen.captured_grads, and the backward
kernel's in-kernel sum, backward.captured_grads) share. None stands for a derivative of 0."""

from __future__ import annotations

from fagen.expression import BOOL, FLOAT, Binary, Call, Cast, Conditional, Load, Name, Node, Number, Unary, loads

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
