"""FlexAttention's score_mod and mask_mod, traced into fagen's expression language (fagen.flex
runs them).

FlexAttention users write `score_mod(score, b, h, q_idx, kv_idx)` and `mask_mod(b, h, q_idx,
kv_idx)` as PyTorch code. Here such a function is called once on proxies (`Traced`) that record
what it does as a tree of fagen.expression's nodes: the language `score_mod.expression` and
`mask.expression` take, whose parser then checks the printed text against its allow-list, so
what reaches a kernel is what any spec's expression may be. The derivative by the score rides
along (forward mode: each traced value carries d value / d score), which is the backward's
`score_mod.expression_grad`.

Semantics are PyTorch's, not C's, where they part: `/` divides as floats, `//` floors and `%`
takes the divisor's sign (printed as C's truncating operators where both operands are known
non-negative, as positions and heads are), `&` `|` `~` on bools are logical. A captured float
tensor indexed by traced ints (a learned bias table) becomes a kernel input, read as float32
(`captured0[...]`, its index flattened; check_captured proves each index within its dimension
at a call's lengths). Refused, naming the function's line: a Python branch on a traced value
(`if`, `and`, `or`: use torch.where and `&`, `|`), an infinity or NaN constant (mask keys with a
mask_mod), and any function outside TORCH_FUNCTIONS. (A captured tensor that requires grad gets
its gradient from fagen.captured_grads.)

Depends on fagen.expression and PyTorch (imported when a function is traced).
"""

from __future__ import annotations

import inspect
import linecache
import math
import struct
import threading
import types
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fagen import expression
from fagen.derivatives import LN2, ONE, ZERO, scaled_grad, sum_grads
from fagen.derivatives import as_float as _float
from fagen.expression import BOOL, FLOAT, INT, Binary, Call, Cast, Conditional, Load, Name, Node, Number, Unary

FLOAT32_MAX = 3.4028234663852886e38


class TraceError(ValueError):
    """A score_mod or mask_mod fagen cannot trace, with the line it stopped at."""


@dataclass(frozen=True, eq=False)
class Traced:
    """A value of the traced function: its expression tree, its derivative by the score (None:
    zero), and whether it is an int known to be >= 0 (positions, heads, their sums)."""

    node: Node
    grad: Node | None = None
    nonnegative: bool = False

    # ---- Python's operators ----------------------------------------------------------------
    def __add__(self, other):
        return _add(self, _lift(other))

    def __radd__(self, other):
        return _add(_lift(other), self)

    def __sub__(self, other):
        return _sub(self, _lift(other))

    def __rsub__(self, other):
        return _sub(_lift(other), self)

    def __mul__(self, other):
        return _mul(self, _lift(other))

    def __rmul__(self, other):
        return _mul(_lift(other), self)

    def __truediv__(self, other):
        return _div(self, _lift(other))

    def __rtruediv__(self, other):
        return _div(_lift(other), self)

    def __floordiv__(self, other):
        return _floordiv(self, _lift(other))

    def __rfloordiv__(self, other):
        return _floordiv(_lift(other), self)

    def __mod__(self, other):
        return _mod(self, _lift(other))

    def __rmod__(self, other):
        return _mod(_lift(other), self)

    def __pow__(self, other):
        return _pow(self, other)

    def __rpow__(self, other):
        raise TraceError("a traced exponent: write torch.exp(y * math.log(x)), or torch.exp2(y) for 2 ** y")

    def __neg__(self):
        return _neg(self)

    def __pos__(self):
        return self

    def __abs__(self):
        return _abs(self)

    def __lt__(self, other):
        return _compare("<", self, _lift(other))

    def __le__(self, other):
        return _compare("<=", self, _lift(other))

    def __gt__(self, other):
        return _compare(">", self, _lift(other))

    def __ge__(self, other):
        return _compare(">=", self, _lift(other))

    def __eq__(self, other):  # noqa: D105 - a traced comparison, as a tensor's
        return _compare("==", self, _lift(other))

    def __ne__(self, other):
        return _compare("!=", self, _lift(other))

    __hash__ = None

    def __and__(self, other):
        return _logical("&", self, _lift(other))

    __rand__ = __and__

    def __or__(self, other):
        return _logical("|", self, _lift(other))

    __ror__ = __or__

    def __xor__(self, other):
        return _logical("^", self, _lift(other))

    __rxor__ = __xor__

    def __invert__(self):
        if self.node.type == BOOL:
            return Traced(Unary("!", self.node, BOOL))
        return Traced(Unary("~", self.node, INT))

    def __bool__(self):
        raise TraceError("a Python branch on a traced value (if, and, or, not, a chained comparison, min() or "
                         "max()): its value is only known in the kernel; use torch.where(c, x, y), & and |, "
                         "torch.minimum and torch.maximum instead")

    def __index__(self):
        raise TraceError("a traced value used as a Python int (a list index, range, a shape): its value is only "
                         "known in the kernel")

    __int__ = __float__ = __index__

    def __getitem__(self, _):
        raise TraceError("indexing a traced value: score, b, h, q_idx and kv_idx are scalars")

    # ---- a tensor's methods ------------------------------------------------------------------
    def abs(self):
        return _abs(self)

    def tanh(self):
        return _tanh(self)

    def exp(self):
        return _exp(self)

    def exp2(self):
        return _exp2(self)

    def log(self):
        return _log(self)

    def log2(self):
        return _log2(self)

    def sqrt(self):
        return _sqrt(self)

    def sigmoid(self):
        return _sigmoid(self)

    def floor(self):
        return _rounding("floorf", self)

    def ceil(self):
        return _rounding("ceilf", self)

    def where(self, condition, other):  # x.where(c, y) is torch.where(c, x, y)
        return _where(condition, self, other)

    def clamp(self, min=None, max=None):  # noqa: A002 - torch's names
        return _clamp(self, min, max)

    clip = clamp

    def float(self):
        return _as_float(self)

    def int(self):
        return _as_int(self)

    long = int

    def bool(self):
        return self if self.node.type == BOOL else _compare("!=", self, _lift(0))

    def to(self, dtype, *args, **kwargs):
        import torch

        if dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            return _as_float(self)
        if dtype in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
            return _as_int(self)
        if dtype == torch.bool:
            return self.bool()
        raise TraceError(f".to({dtype}): traced values are float32, int32 or bool in the kernel")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in OPERATORS:  # a tensor's operator with a traced operand: the traced value's
            return getattr(_lift(args[0]), name)(*args[1:])
        if name == "__getitem__":
            return _load(*args)
        if func is getattr(_torch(), "Tensor").where:  # x.where(condition, y): torch.where(condition, x, y)
            x, condition, y = args
            return _where(condition, x, y)
        rule = TORCH_FUNCTIONS.get(name)
        if rule is None:
            raise TraceError(f"torch.{name} is not among the functions fagen traces "
                             f"({', '.join(sorted(TORCH_FUNCTIONS))})")
        return rule(*args, **(kwargs or {}))


def _torch():
    import torch

    return torch


# The captured tensors the trace in progress (on this thread) has read, and each index it read
# them at: [(slot, dim, index node, size)]
_CAPTURING = threading.local()


def _load(tensor, index) -> Traced:
    """tensor[index] of a captured tensor, every dimension indexed (traced ints or constants): an
    element of kernel input captured<slot>, its index flattened (row-major)."""
    tensors, reads = getattr(_CAPTURING, "tensors", None), getattr(_CAPTURING, "reads", None)
    if tensors is None:
        raise TraceError("a captured tensor indexed in a mask_mod traced for a spec's mask.expression: build a "
                         "block mask from the mask_mod instead (fagen.flex.create_block_mask)")
    if not hasattr(tensor, "requires_grad"):
        raise TraceError(f"indexing a {type(tensor).__name__}: fagen traces captured torch tensors")
    if not tensor.is_floating_point():
        raise TraceError(f"a captured {tensor.dtype} tensor: the kernel reads captured tensors as float32; pass a "
                         f"floating one (x.float(), exact for integers below 2^24)")
    indices = index if isinstance(index, tuple) else (index,)
    if any(i is None or i is Ellipsis or isinstance(i, slice) for i in indices) or len(indices) != tensor.dim():
        raise TraceError(f"a captured tensor of shape {tuple(tensor.shape)} indexed by {len(indices)} indices: "
                         f"index each of its {tensor.dim()} dimensions by one int (no slices)")
    slot = next((i for i, t in enumerate(tensors) if t is tensor), len(tensors))
    if slot == len(tensors):
        if slot == expression.MAX_CAPTURED:
            raise TraceError(f"more than {expression.MAX_CAPTURED} captured tensors indexed: concatenate them")
        tensors.append(tensor)
    flat, stride = None, 1
    for dim in reversed(range(tensor.dim())):
        size, i = int(tensor.shape[dim]), _lift(indices[dim])
        if i.node.type == BOOL:
            raise TraceError(f"a bool index into a captured tensor (dimension {dim}): PyTorch selects by it as a "
                             f"mask; index with an int (x.long())")
        if i.node.type == FLOAT:
            raise TraceError(f"a float index into a captured tensor (dimension {dim}): index with ints, e.g. "
                             f"x.long() or torch.floor(x).long()")
        constant = expression.int_bounds(i.node, {})
        if constant[0] == constant[1] and constant[0] < 0:  # PyTorch's negative index counts from the end
            i = _lift(constant[0] + size)
        reads.append((slot, dim, i.node, size))
        term = i if stride == 1 else _mul(i, _lift(stride))
        flat = term if flat is None else _add(term, flat)
        stride *= size
    return Traced(Load(f"captured{slot}", flat.node, FLOAT))


OPERATORS = {f"__{op}__" for op in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv",
                                    "rfloordiv", "mod", "rmod", "pow", "rpow", "neg", "abs", "lt", "le", "gt", "ge", "eq",
                                    "ne", "and", "rand", "or", "ror", "xor", "rxor", "invert")}


# ---- building the tree ----------------------------------------------------------------------

def _lift(value) -> Traced:
    """A Python number, bool or 0-d tensor without gradient as a constant; a traced value as itself."""
    if isinstance(value, Traced):
        return value
    if hasattr(value, "dim") and hasattr(value, "item"):  # a tensor
        if value.dim() != 0 or value.requires_grad:
            raise TraceError(f"a captured tensor of shape {tuple(value.shape)}: captured tensors are not kernel "
                             f"inputs yet (a 0-d constant without gradient is)")
        value = value.item()
    if isinstance(value, np.generic):  # a NumPy scalar (np.float64 is a float whose repr is no C literal)
        value = value.item()
    if isinstance(value, bool):
        return Traced(Name("true" if value else "false", BOOL))
    if isinstance(value, int):
        if not expression.INT_MIN <= value <= expression.INT_MAX:
            raise TraceError(f"the int {value} is outside int32, the kernel's integers")
        if value == expression.INT_MIN:  # (its magnitude is no int32 literal)
            return Traced(Binary("-", Unary("-", Number(str(expression.INT_MAX), INT), INT), Number("1", INT), INT))
        node = Number(str(abs(value)), INT)
        return Traced(node if value >= 0 else Unary("-", node, INT), nonnegative=value >= 0)
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            raise TraceError(f"the constant {value}: mask keys with a mask_mod (block_mask), not an infinite "
                             f"score; other constants must be finite in float32 (|x| <= {FLOAT32_MAX:.7g})")
        text = repr(abs(value))
        if "e" not in text and "." not in text:
            text += ".0"
        node = Number(text + "f", FLOAT)
        return Traced(node if value >= 0 else Unary("-", node, FLOAT))
    raise TraceError(f"a {type(value).__name__} in a traced expression: numbers, bools and the traced "
                     f"arguments only")


def _type(*values: Traced) -> str:
    return FLOAT if any(v.node.type == FLOAT for v in values) else INT


def _add(a: Traced, b: Traced) -> Traced:
    return Traced(Binary("+", a.node, b.node, _type(a, b)), sum_grads("+", a.grad, b.grad),
                  a.nonnegative and b.nonnegative)


def _sub(a: Traced, b: Traced) -> Traced:
    return Traced(Binary("-", a.node, b.node, _type(a, b)), sum_grads("-", a.grad, b.grad))


def _mul(a: Traced, b: Traced) -> Traced:
    grad = sum_grads("+", scaled_grad(a.grad, b.node), scaled_grad(b.grad, a.node))
    return Traced(Binary("*", a.node, b.node, _type(a, b)), grad, a.nonnegative and b.nonnegative)


def _div(a: Traced, b: Traced) -> Traced:
    """True division, as PyTorch's `/` (ints too): in float. By a constant, a product with its
    float32 reciprocal (within an ulp of the quotient, as Triton's own `/`, div.full): C's `/` is
    IEEE division, a dozen instructions an element (softcap's s / 30, H200: forward 181 -> 297
    TFLOP/s)."""
    divisor = _constant(b.node)
    if divisor:
        return _mul(a, _lift(struct.unpack("f", struct.pack("f", 1.0 / divisor))[0]))
    quotient = Binary("/", _float(a.node), _float(b.node), FLOAT)
    grad = sum_grads("-", None if a.grad is None else Binary("/", a.grad, _float(b.node), FLOAT),
                      None if b.grad is None else Binary("*", quotient, Binary("/", b.grad, _float(b.node), FLOAT),
                                                         FLOAT))
    return Traced(quotient, grad)


def _constant(node: Node) -> float | None:
    """A constant's value (a number, or a negated one), else None."""
    if isinstance(node, Unary) and node.op == "-":
        value = _constant(node.operand)
        return None if value is None else -value
    return float(node.text.rstrip("f")) if isinstance(node, Number) else None


def _integral(op: str, a: Traced, b: Traced) -> None:
    if a.node.type == FLOAT or b.node.type == FLOAT:
        raise TraceError(f"{op} of a float: fagen traces integer {op} (of positions and heads) only")


def _positive_constant(t: Traced) -> bool:
    return isinstance(t.node, Number) and int(t.node.text) > 0


def _floordiv(a: Traced, b: Traced) -> Traced:
    """PyTorch's `//`: floor. C's `/` truncates; they agree where both are >= 0."""
    _integral("//", a, b)
    quotient = Binary("/", a.node, b.node, INT)
    if a.nonnegative and b.nonnegative:
        return Traced(quotient, nonnegative=True)
    zero, one = Number("0", INT), Number("1", INT)
    remainder = Binary("%", a.node, b.node, INT)
    if _positive_constant(b):  # a negative dividend: minus the quotient of its magnitude, rounded up
        # (c - 1 - x) / c; each branch bounded by the dividend's bounds alone, so a bucketed index
        # is proven in range (check_captured)
        up = Binary("/", Binary("-", Number(str(int(b.node.text) - 1), INT), a.node, INT), b.node, INT)
        return Traced(Conditional(Binary(">=", a.node, zero, BOOL), quotient, Unary("-", up, INT), INT))
    signs_part = Binary("!=", Binary("<", a.node, zero, BOOL), Binary("<", b.node, zero, BOOL), BOOL)
    down = Conditional(Binary("&&", Binary("!=", remainder, zero, BOOL), signs_part, BOOL), one, zero, INT)
    return Traced(Binary("-", quotient, down, INT))


def _mod(a: Traced, b: Traced) -> Traced:
    """PyTorch's `%` (remainder): the divisor's sign. C's `%` takes the dividend's; they agree
    where both are >= 0."""
    _integral("%", a, b)
    remainder = Binary("%", a.node, b.node, INT)
    if a.nonnegative and b.nonnegative:
        return Traced(remainder, nonnegative=True)
    if _positive_constant(b):
        return Traced(Binary("%", Binary("+", remainder, b.node, INT), b.node, INT), nonnegative=True)
    zero = Number("0", INT)
    parts = Binary("&&", Binary("!=", remainder, zero, BOOL),
                   Binary("!=", Binary("<", remainder, zero, BOOL), Binary("<", b.node, zero, BOOL), BOOL), BOOL)
    return Traced(Binary("+", remainder, Conditional(parts, b.node, zero, INT), INT))


def _pow(a: Traced, exponent) -> Traced:
    if isinstance(exponent, Traced):
        raise TraceError("a traced exponent: write exp(y * log(x))")
    if exponent == 0.5:
        return _sqrt(a)
    if not (isinstance(exponent, int) and 0 <= exponent <= 8):
        raise TraceError(f"x ** {exponent!r}: whole exponents 0..8 and 0.5 are traced")
    if exponent == 0:
        return _lift(1.0 if a.node.type == FLOAT else 1)
    result = a
    for _ in range(exponent - 1):
        result = _mul(result, a)
    return result


def _neg(a: Traced) -> Traced:
    return Traced(Unary("-", a.node, a.node.type if a.node.type != BOOL else INT),
                  None if a.grad is None else Unary("-", a.grad, FLOAT))


def _abs(a: Traced) -> Traced:
    if a.node.type != FLOAT:
        return Traced(Call("abs", (a.node,), INT), nonnegative=True)
    # sign(x) x', 0 at 0 (as torch's)
    grad = None if a.grad is None else Conditional(
        Binary(">", a.node, ZERO, BOOL), a.grad,
        Conditional(Binary("<", a.node, ZERO, BOOL), Unary("-", a.grad, FLOAT), ZERO, FLOAT), FLOAT)
    return Traced(Call("fabsf", (a.node,), FLOAT), grad)


def _unary_float(function: str, a: Traced, derivative) -> Traced:
    node = Call(function, (_float(a.node),), FLOAT)
    return Traced(node, None if a.grad is None else Binary("*", derivative(node, _float(a.node)), a.grad, FLOAT))


def _tanh(a):
    return _unary_float("tanhf", _lift(a), lambda t, x: Binary("-", ONE, Binary("*", t, t, FLOAT), FLOAT))


def _exp(a):
    return _unary_float("expf", _lift(a), lambda e, x: e)


def _exp2(a):
    return _unary_float("exp2f", _lift(a), lambda e, x: Binary("*", e, Number(f"{LN2!r}f", FLOAT), FLOAT))


def _log(a):
    return _unary_float("logf", _lift(a), lambda _, x: Binary("/", ONE, x, FLOAT))


def _log2(a):
    return _unary_float("log2f", _lift(a), lambda _, x: Binary("/", ONE, Binary("*", x, Number(f"{LN2!r}f", FLOAT),
                                                                             FLOAT), FLOAT))


def _sqrt(a):
    return _unary_float("sqrtf", _lift(a), lambda r, x: Binary("/", Number("0.5f", FLOAT), r, FLOAT))


def _sigmoid(a):
    """1 / (1 + exp(-x)), its derivative s (1 - s) x' (the quotient rule's 0 * inf / inf at large -x
    would be NaN)."""
    a = _lift(a)
    x = _float(a.node)
    node = Binary("/", ONE, Binary("+", ONE, Call("expf", (Unary("-", x, FLOAT),), FLOAT), FLOAT), FLOAT)
    return Traced(node, None if a.grad is None else Binary("*", Binary("*", node, Binary("-", ONE, node, FLOAT), FLOAT),
                                                           a.grad, FLOAT))


def _rounding(function: str, a) -> Traced:
    a = _lift(a)
    return a if a.node.type != FLOAT else Traced(Call(function, (a.node,), FLOAT))


def _as_float(a) -> Traced:
    a = _lift(a)
    return a if a.node.type == FLOAT else Traced(Cast(FLOAT, a.node))


def _as_int(a) -> Traced:
    """PyTorch's float -> int conversion truncates toward zero, as C's cast does."""
    a = _lift(a)
    if a.node.type == INT:
        return a
    return Traced(Cast(INT, a.node), nonnegative=a.node.type == BOOL)


def _compare(op: str, a: Traced, b: Traced) -> Traced:
    return Traced(Binary(op, a.node, b.node, BOOL))


def _logical(op: str, a: Traced, b: Traced) -> Traced:
    """& | ^ of bools: logical, as a bool tensor's; of ints: bitwise."""
    if a.node.type == BOOL and b.node.type == BOOL:
        return Traced(Binary({"&": "&&", "|": "||", "^": "!="}[op], a.node, b.node, BOOL))
    _integral(op, a, b)
    return Traced(Binary(op, a.node, b.node, INT), nonnegative=op != "^" and a.nonnegative and b.nonnegative)


def _where(condition, x, y) -> Traced:
    c, x, y = _lift(condition), _lift(x), _lift(y)
    if c.node.type != BOOL:
        c = Traced(Binary("!=", c.node, Number("0", INT), BOOL))
    kind = BOOL if x.node.type == BOOL and y.node.type == BOOL else _type(x, y)
    grad = None if x.grad is None and y.grad is None else \
        Conditional(c.node, x.grad if x.grad is not None else ZERO, y.grad if y.grad is not None else ZERO, FLOAT)
    return Traced(Conditional(c.node, x.node, y.node, kind), grad, x.nonnegative and y.nonnegative)


def _pick(smaller: bool, a, b) -> Traced:
    """torch.minimum / maximum: the derivative follows the one picked, half each at a tie (as torch's)."""
    a, b = _lift(a), _lift(b)
    if a.node.type != FLOAT and b.node.type != FLOAT:
        return Traced(Call("min" if smaller else "max", (a.node, b.node), INT),
                      nonnegative=(a.nonnegative or b.nonnegative) if not smaller else a.nonnegative and b.nonnegative)
    x, y = _float(a.node), _float(b.node)
    node = Call("fminf" if smaller else "fmaxf", (x, y), FLOAT)
    if a.grad is None and b.grad is None:
        return Traced(node)
    ga, gb = (g if g is not None else ZERO for g in (a.grad, b.grad))
    first = "<" if smaller else ">"
    grad = Conditional(Binary(first, x, y, BOOL), ga, Conditional(
        Binary(first, y, x, BOOL), gb, Binary("*", Number("0.5f", FLOAT), Binary("+", ga, gb, FLOAT), FLOAT), FLOAT),
        FLOAT)
    return Traced(node, grad)


def _clamp(x, min=None, max=None) -> Traced:  # noqa: A002 - torch's names
    """torch.clamp: its derivative passes where min <= x <= max (the ends included, as torch's)."""
    x = _lift(x)
    bounds = [(_lift(v), ">" if side else "<") for v, side in ((min, False), (max, True)) if v is not None]
    if x.node.type != FLOAT and all(v.node.type != FLOAT for v, _ in bounds):
        for v, op in bounds:
            x = Traced(Call("max" if op == "<" else "min", (x.node, v.node), INT),
                       nonnegative=x.nonnegative or (op == "<" and v.nonnegative))
        return x
    node, outside = _float(x.node), None
    for v, op in bounds:
        node = Call("fmaxf" if op == "<" else "fminf", (node, _float(v.node)), FLOAT)
        test = Binary(op, _float(x.node), _float(v.node), BOOL)
        outside = test if outside is None else Binary("||", outside, test, BOOL)
    grad = None if x.grad is None or outside is None else Conditional(outside, ZERO, x.grad, FLOAT)
    return Traced(node, grad if outside is not None else x.grad)


# torch functions (and Tensor methods reached through __torch_function__) a traced function may call
TORCH_FUNCTIONS = {
    "where": _where, "tanh": _tanh, "exp": _exp, "exp2": _exp2, "log": _log, "log2": _log2, "sqrt": _sqrt,
    "sigmoid": _sigmoid, "abs": lambda a: abs(_lift(a)), "floor": lambda a: _rounding("floorf", a),
    "ceil": lambda a: _rounding("ceilf", a), "minimum": lambda a, b: _pick(True, a, b),
    "maximum": lambda a, b: _pick(False, a, b), "clamp": _clamp, "clip": _clamp,
    "logical_and": lambda a, b: _logical("&", _lift(a).bool(), _lift(b).bool()),
    "logical_or": lambda a, b: _logical("|", _lift(a).bool(), _lift(b).bool()),
    "logical_xor": lambda a, b: _logical("^", _lift(a).bool(), _lift(b).bool()),
    "logical_not": lambda a: ~_lift(a).bool(),
}


# ---- tracing -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TracedScoreMod:
    """A score_mod as spec fields: score_mod.expression and its derivative by the score
    (score_mod.expression_grad; "0.0f" where the result does not depend on the score), and the
    captured tensors they read (score_mod.captured of them, the call's `captured`), with each
    index read from them: (slot, dim, index, size)."""

    expression: str
    expression_grad: str
    captured: tuple = ()
    reads: tuple = ()


def trace_score_mod(score_mod) -> TracedScoreMod:
    """score_mod(score, b, h, q_idx, kv_idx) -> a float score, as fagen's expression and its
    derivative by the score; TraceError naming the line where it cannot be traced. Traced once
    for a function, its closure, defaults and the globals its code names (a call of the same
    function with the same values costs a dictionary lookup, not a trace: ~0.2 ms)."""
    return _cached(_trace_score_mod, score_mod)


def trace_mask_mod(mask_mod) -> str:
    """mask_mod(b, h, q_idx, kv_idx) -> bool (True: the key is seen), as fagen's mask.expression
    (cached as trace_score_mod is)."""
    return _cached(_trace_mask_mod, mask_mod)


TRACED_LIMIT = 256
_TRACED: dict[tuple, object] = {}


def _cached(trace, function):
    key = _cache_key(function)
    if key is None:
        return trace(function)
    key = (trace, *key)
    if key not in _TRACED:
        traced = trace(function)
        # kept where the tensors it names are exactly the kernel inputs it captured (read each call);
        # a 0-d tensor baked in as a constant, or one reached through an attribute that may be
        # rebound, is read afresh a call
        if {id(t) for t in _tensors_in(key)} != {id(t) for t in getattr(traced, "captured", ())}:
            return traced
        if len(_TRACED) >= TRACED_LIMIT:
            _TRACED.clear()
        _TRACED[key] = traced  # (holding its tensors, whose ids then stay theirs)
    return _TRACED[key]


def _tensors_in(key) -> list:
    """The tensors a cache key holds (_value_key's), nested keys included."""
    if isinstance(key, tuple):
        if len(key) == 3 and key[0] == "tensor":
            return [key[2]]
        return [t for part in key for t in _tensors_in(part)]
    return []


def _cache_key(function, depth: int = 0) -> tuple | None:
    """What a trace of `function` read, where all of it can be told by value: its code, and the
    values of its closure, defaults and the globals its code (and code nested in it) names, each
    a number, a string, None, a module or a plain function keyed the same way, or a tensor by its
    identity, shape, dtype, device and requires_grad. None otherwise (a bound method, whose
    `self` is not in its closure; a list, which may change in place; an empty cell): then the
    function is traced again (~0.2 ms)."""
    code = getattr(function, "__code__", None)
    if code is None or not isinstance(function, types.FunctionType) or depth > 4:
        return None
    try:
        cells = [cell.cell_contents for cell in function.__closure__ or ()]
    except ValueError:  # a cell not yet filled
        return None
    names = function.__globals__
    named = [(name, names[name]) for name in _names(code) if name in names]
    values = [*cells, *(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values(), *(v for _, v in named)]
    keys = [_value_key(v, depth) for v in values]
    if any(k is None for k in keys):
        return None
    return code, tuple(keys), tuple(name for name, _ in named)


def _names(code: types.CodeType) -> set[str]:
    """The global names a code object and the code nested in it read."""
    return set(code.co_names).union(*(_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def _value_key(value, depth: int) -> tuple | None:
    if isinstance(value, (bool, int, float, str, type(None))):
        return type(value), value
    if type(value).__module__.startswith("torch") and hasattr(value, "data_ptr"):  # a captured tensor: the trace
        # reads its shape, dtype, device and requires_grad, not its values (read by the kernel each call)
        return "tensor", (id(value), tuple(value.shape), str(value.dtype), str(value.device), value.requires_grad), \
            value
    if isinstance(value, types.ModuleType):
        return types.ModuleType, value.__name__
    if isinstance(value, types.FunctionType):
        inner = _cache_key(value, depth + 1)
        return None if inner is None else (types.FunctionType, inner)
    return None


def _trace_score_mod(score_mod) -> TracedScoreMod:
    args = [Traced(Name("score", FLOAT), ONE)] + [Traced(Name(v, INT), nonnegative=True) for v in ("b", "h", "q_idx",
                                                                                                   "kv_idx")]
    outer = getattr(_CAPTURING, "tensors", None), getattr(_CAPTURING, "reads", None)  # a trace inside a trace
    _CAPTURING.tensors, _CAPTURING.reads = [], []
    try:
        result = _lift(_call(score_mod, args, "score_mod"))
        captured, reads = tuple(_CAPTURING.tensors), tuple(_CAPTURING.reads)
    finally:
        _CAPTURING.tensors, _CAPTURING.reads = outer
    variables = expression.score_variables(len(captured))
    if result.node.type == BOOL:
        raise TraceError(f"score_mod {_name(score_mod)} returns a bool: a mask is a mask_mod's, a score_mod returns "
                         f"the new score")
    text = _checked(expression.source(_float(result.node)), variables, None, score_mod, "score_mod.expression")
    grad = _checked(expression.source(result.grad) if result.grad is not None else "0.0f", variables, None,
                    score_mod, "score_mod.expression_grad")
    return TracedScoreMod(text, grad, captured, reads)


def _trace_mask_mod(mask_mod) -> str:
    args = [Traced(Name(v, INT), nonnegative=True) for v in ("b", "h", "q_idx", "kv_idx")]
    result = _lift(_call(mask_mod, args, "mask_mod"))
    if result.node.type != BOOL:
        raise TraceError(f"mask_mod {_name(mask_mod)} returns a {result.node.type}, not a bool (True where the "
                         f"key is seen): compare it")
    return _checked(expression.source(result.node), expression.MASK_VARIABLES, BOOL, mask_mod, "mask.expression")


def check_int32(traced: TracedScoreMod, extents: dict[str, int], score_mod=None) -> None:
    """Refuse a traced score_mod whose int arithmetic may leave int32 while b, h, q_idx and kv_idx
    stay below `extents` (the call's B, Hq, Nq, Nk): the kernel's ints are int32 and would wrap
    where PyTorch's int64 do not."""
    for field, text in (("score_mod.expression", traced.expression),
                        ("score_mod.expression_grad", traced.expression_grad)):
        wraps = _wrapping(text, len(traced.captured), tuple(extents.items()))
        if wraps is not None:
            at = ", ".join(f"{name} < {n}" for name, n in extents.items())
            raise TraceError(f"score_mod {_name(score_mod) if score_mod is not None else ''}: "
                             f"{expression.source(wraps)} in {field} may pass int32 where {at} (the kernel's ints "
                             f"are int32, PyTorch's int64); compute it in float, e.g. (q_idx - kv_idx) * 1.0")


def check_captured(traced: TracedScoreMod, extents: dict[str, int], score_mod=None) -> None:
    """Refuse a traced score_mod whose index into a captured tensor may leave that dimension
    (0 .. size - 1) while b, h, q_idx and kv_idx stay below `extents`: PyTorch would raise, and
    a kernel must not read past an array. Interval bounds: an index they cannot prove in range
    (a clamp proves it) is refused."""
    for slot, dim, index, size, lo, hi in _outside(traced.reads, tuple(extents.items())):
            at = ", ".join(f"{name} < {n}" for name, n in extents.items())
            raise TraceError(f"score_mod {_name(score_mod) if score_mod is not None else ''}: captured tensor "
                             f"{slot}'s dimension {dim} (size {size}) is indexed by {expression.source(index)}, "
                             f"which may be {lo if lo < 0 else hi} where {at}; keep it within 0 .. {size - 1} "
                             f"(torch.clamp(i, 0, {size - 1}), or a larger table)")


@lru_cache(maxsize=256)  # a call's checks, repeated: a lookup
def _wrapping(text: str, captured: int, extents: tuple) -> Node | None:
    return expression.int_overflow(expression.score(text, captured), dict(extents))


@lru_cache(maxsize=256)
def _outside(reads: tuple, extents: tuple) -> list[tuple]:
    """The reads (slot, dim, index, size) whose index may leave 0 .. size - 1, with its bounds."""
    found = []
    for slot, dim, index, size in reads:
        lo, hi = expression.int_bounds(index, dict(extents))
        if lo < 0 or hi >= size:
            found.append((slot, dim, index, size, lo, hi))
    return found


def _name(function) -> str:
    return getattr(function, "__qualname__", repr(function))


def _call(function, args: list[Traced], what: str):
    try:
        inspect.signature(function).bind(*args)
    except TypeError:  # not callable with FlexAttention's arguments
        names = "score, b, h, q_idx, kv_idx" if what == "score_mod" else "b, h, q_idx, kv_idx"
        raise TraceError(f"{what} {_name(function)} cannot take FlexAttention's {len(args)} arguments ({names})") \
            from None
    except ValueError:  # no signature to read (a builtin): the call says
        pass
    try:
        return function(*args)
    except TraceError as error:
        raise TraceError(f"{what} {_name(function)}, {_line(function, error.__traceback__)}: {error}") from None


def _line(function, traceback) -> str:
    """'line N: <source>' of the deepest frame in the traced function's own code (or the last
    frame outside this module, for a function it called)."""
    code = getattr(function, "__code__", None)
    found = None
    while traceback is not None:
        frame = traceback.tb_frame
        if frame.f_code is code or (found is None and frame.f_code.co_filename != __file__):
            found = (frame.f_code.co_filename, traceback.tb_lineno)
        traceback = traceback.tb_next
    if found is None:
        return "line ?"
    text = linecache.getline(found[0], found[1]).strip()
    return f"line {found[1]}: {text}" if text else f"line {found[1]}"


def _checked(text: str, variables: dict[str, str], result: str | None, function, field: str) -> str:
    """The text, parsed back against the language's allow-list (what a spec's field runs)."""
    try:
        expression.parse(text, variables, result)
    except expression.ExpressionError as error:
        raise TraceError(f"{_name(function)} traced to {field} = {text!r}, which fagen's expression language "
                         f"refuses: {error}") from None
    return text
