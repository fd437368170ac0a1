"""The gradient of a traced score_mod's captured tensors (fagen.flex: a learned bias table), from
the expression tree alone: no autograd, so it runs where autograd does not (inside the
fagen::flex_backward op, which torch.compile calls in a model's backward) as it does in an
eager call.

    d loss / d table[i] = sum over the (b, h, q, k) whose expression reads table[i] of
                          dS(b, h, q, k) * d expression / d that read,

dS = P (dP - D) the modified score's gradient, and each read's derivative its own tree
(fagen.derivatives). Two paths, both adding int64 fixed point (exact: no order can show, so the
result is bitwise the same run to run):

- the dK/dV kernel (backward.captured_grads), where each read's derivative and index are free of
  the score and bounded (`split_wanted`): it adds each term as it computes dS, into the sums
  `FixedPointSums` allocates at a scale a bound on every sum chooses;
- `captured_grads` for the others: dS recomputed a slab of query rows at a time in float32,
  each read's derivative evaluated over it by `evaluate_torch`, the slabs in order into a
  float64 total. Its cost: two of the attention's matmuls again (TF32, exact for half-precision
  inputs) and a few passes over every score.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache

from fagen import expression
from fagen.expression import BOOL, FLOAT, INT, Call, Cast, Conditional, Load, Name, Node, Number, Unary
from fagen.masks import CAUSAL, FULL, PARTIAL
from fagen.derivatives import FloatOps, interval, magnitude, read_derivatives

CHUNK_SCORES = 1 << 24  # scores recomputed at a time (64 MiB of float32, a few times over)


# ---- evaluation on torch tensors --------------------------------------------------------------

def evaluate_torch(node: Node, values: dict, device=None):
    """The expression over torch tensors (b, h, q_idx, kv_idx int64, score and the captured
    arrays float32, flattened), broadcast together, its constants on `device` (values["score"]'s
    where None): expression.evaluate's semantics where the int32 checks a call passes hold (ints
    in int64 then equal int32's; shifts in int32), floats in float32, a captured index clamped
    into its array as the kernel clamps it, x / 0 and x % 0 (undefined in C) x and 0 as the
    evaluator gives them rather than an error (both sides of ?: are evaluated)."""
    import torch

    device = values["score"].device if device is None else device
    if isinstance(node, Number):
        return torch.tensor(int(node.text) if node.type == INT else float(node.text.rstrip("fF")),
                            dtype=torch.int64 if node.type == INT else torch.float32, device=device)
    if isinstance(node, Name):
        if node.name in expression.LITERALS:
            return torch.tensor(node.name == "true", device=device)
        return _to(values[node.name], node.type)
    if isinstance(node, Load):
        array = values[node.array]
        # take, not array[i]: a 0-d index there would be read back to the host
        return torch.take(array, _to(evaluate_torch(node.index, values, device), INT).clamp(0, array.numel() - 1))
    if isinstance(node, Cast):
        return _to(evaluate_torch(node.operand, values, device), node.type)
    if isinstance(node, Call):
        args = [_to(evaluate_torch(arg, values, device), node.type) for arg in node.args]
        return _functions()[node.function](*args)
    if isinstance(node, Conditional):
        condition = _to(evaluate_torch(node.condition, values, device), BOOL)
        then, other = evaluate_torch(node.then, values, device), evaluate_torch(node.other, values, device)
        if node.type != BOOL:
            then, other = _to(then, node.type), _to(other, node.type)
        return torch.where(condition, then, other)
    if isinstance(node, Unary):
        operand = evaluate_torch(node.operand, values, device)
        if node.op == "!":
            return ~_to(operand, BOOL)
        operand = _to(operand, node.type)
        return {"-": torch.neg, "+": lambda x: x, "~": torch.bitwise_not}[node.op](operand)
    left, right = evaluate_torch(node.left, values, device), evaluate_torch(node.right, values, device)
    if node.op in ("&&", "||"):
        left, right = _to(left, BOOL), _to(right, BOOL)
        return left & right if node.op == "&&" else left | right
    common = FLOAT if FLOAT in (node.left.type, node.right.type) else INT
    left, right = _to(left, common), _to(right, common)
    if node.op in expression.LOGICAL:
        return {"==": torch.eq, "!=": torch.ne, "<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge}[
            node.op](left, right)
    if common == INT and node.op in "/%":
        zero = right == 0
        divisor = torch.where(zero, 1, right)
        if node.op == "/":
            return torch.where(zero, left, torch.div(left, divisor, rounding_mode="trunc"))
        return torch.where(zero, 0, torch.fmod(left, divisor))
    if node.op in ("<<", ">>"):  # int32, a count outside 0 .. 31 as PTX's shl / shr take it (evaluate's)
        narrow = left.to(torch.int32)
        past = (right < 0) | (right >= expression.INT_BITS)
        count = torch.where(past, 0, right).to(torch.int32)
        shifted = narrow << count if node.op == "<<" else narrow >> count
        beyond = torch.zeros_like(shifted) if node.op == "<<" else torch.where(narrow < 0, -1, 0).to(torch.int32)
        return torch.where(past, beyond, shifted).to(torch.int64)
    return {"+": torch.add, "-": torch.sub, "*": torch.mul, "/": torch.div, "%": torch.fmod, "&": torch.bitwise_and,
            "|": torch.bitwise_or, "^": torch.bitwise_xor}[node.op](left, right)


def _to(value, kind: str):
    """A C conversion: to bool (nonzero), to int (truncating toward zero; a float past int32 or
    NaN saturating as the GPU's cvt.rzi.s32 and expression.evaluate), to float32."""
    import torch

    if kind == BOOL:
        return value != 0 if value.dtype != torch.bool else value
    if kind == INT:
        if value.is_floating_point():
            value = torch.nan_to_num(value.double().trunc(), nan=0.0).clamp(expression.INT_MIN, expression.INT_MAX)
        return value.to(torch.int64) if value.dtype != torch.int64 else value
    return value.to(torch.float32) if value.dtype != torch.float32 else value


@cache
def _functions() -> dict:
    """The expression language's functions as torch's."""
    import torch

    return {"fabsf": torch.abs, "expf": torch.exp, "exp2f": torch.exp2, "logf": torch.log, "log2f": torch.log2,
            "sqrtf": torch.sqrt, "tanhf": torch.tanh, "floorf": torch.floor, "ceilf": torch.ceil,
            "fminf": torch.fmin, "fmaxf": torch.fmax, "min": torch.minimum, "max": torch.maximum, "abs": torch.abs}


@cache
def score_tree(text: str, captured: int) -> Node:
    """A traced score_mod's expression as its tree (parsed once)."""
    return expression.score(text, captured)


# ---- the gradient ------------------------------------------------------------------------------

def captured_grads(dout, q, k, v, out, lse, expression_tree: Node, block_mask, scale, tables, wanted) -> list:
    """d loss / d each captured tensor that requires one (`wanted`), None for the others, for a
    score_mod traced to `expression_tree` reading `tables` (captured0, captured1, ... in order):
    dS = P (dP - D) recomputed a slab of query rows at a time in float32 from the kernels' out
    and LSE, times each read's derivative, scattered into its table in a fixed order."""
    import torch

    b, hq, nq, d = q.shape
    group, nk = hq // k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    keys, values = (x.detach().float().repeat_interleave(group, 1) for x in (k, v))
    delta = (dout.float() * out.float()).sum(-1, keepdim=True)
    names = expression.captured_names(len(tables))
    reads = read_derivatives(expression_tree, {name for name, w in zip(names, wanted) if w})
    sums = [torch.zeros(t.numel(), dtype=torch.float64, device=q.device) if w else None for t, w in zip(tables, wanted)]
    flat = {name: t.detach().float().reshape(-1).to(q.device) for name, t in zip(names, tables)}
    bi, hi, ki = (torch.arange(n, device=q.device).view(*[-1 if i == axis else 1 for i in range(4)])
                  for axis, n in ((0, b), (1, hq), (3, nk)))
    if not reads:  # the wanted tensors are only rounded or compared
        return [None if total is None else torch.zeros_like(t) for total, t in zip(sums, tables)]
    step = max(1, CHUNK_SCORES // (b * hq * nk))
    for r0 in range(0, nq, step):
        rows = slice(r0, min(nq, r0 + step))
        qi = torch.arange(rows.start, rows.stop, device=q.device).view(1, 1, -1, 1)
        with _exact_products():
            s = (q[:, :, rows].detach().float() @ keys.transpose(-1, -2)) * scale
            dp = dout[:, :, rows].float() @ values.transpose(-1, -2)
        at = {"score": s, "b": bi, "h": hi, "q_idx": qi, "kv_idx": ki, **flat}
        modified = evaluate_torch(expression_tree, at).expand(s.shape)
        ds = torch.exp(modified - lse[:, :, rows, None].float()) * (dp - delta[:, :, rows])
        # the slab's pairs the mask keeps (never N x N of every head at once): a pair it drops adds
        # nothing, whatever its derivative (0 x inf would be NaN)
        kept = None if block_mask is None else _kept(block_mask, rows, nk, q.device)
        for read, grad in reads:
            index = _to(evaluate_torch(read.index, at), INT).clamp(0, flat[read.array].numel() - 1)
            part = ds * _to(evaluate_torch(grad, at), FLOAT)
            if kept is not None:
                part = torch.where(kept, part, 0.0)
            # added over the axes the index does not vary along first (a relative bias: the batch)
            axes = tuple(a for a in range(4) if index.dim() == 4 and index.shape[a] == 1 < part.shape[a])
            part = part.sum(axes, keepdim=True) if axes else part
            _add_exactly(sums[names.index(read.array)], index.expand(part.shape).reshape(-1), part.reshape(-1))
    return [None if total is None else total.view(t.shape).to(t.device, t.dtype) for total, t in zip(sums, tables)]


# ---- the fused gradient: the dK/dV kernel's sums (backward.captured_grads) --------------------

# A derivative whose bound, with every array within +-1, passes this at the call's lengths goes
# outside the kernels: each bit the bound has over the values it holds is a bit of the sums'
# resolution lost (a float cast to int is bounded at 2^31, whatever it holds).
LOOSEST_BOUND = 2.0 ** 20
FLOAT32_MAX = 3.4028234663852886e38


def split_wanted(tree: Node, wanted, extents: dict[str, int]) -> tuple[tuple[int, ...], list[bool]]:
    """(the wanted arrays the dK/dV kernel sums: each read's derivative and index free of the
    score, the derivative bounded (derivatives.interval) within LOOSEST_BOUND while the arrays
    hold +-1 and the variables stay within `extents`; the others, for captured_grads)."""
    names = expression.captured_names(len(wanted))
    unit = dict.fromkeys(names, (-1.0, 1.0))

    def summable(read, grad) -> bool:
        if "score" in expression.reads(grad) | expression.reads(read.index):
            return False
        bounds = interval(grad, unit, extents)
        return bounds is not None and magnitude(bounds) <= LOOSEST_BOUND

    fused = [i for i, w in enumerate(wanted) if w and (reads := read_derivatives(tree, {names[i]}))
             and all(summable(read, grad) for read, grad in reads)]
    return tuple(fused), [bool(w) and i not in fused for i, w in enumerate(wanted)]


class FixedPointSums:
    """Where the dK/dV kernel adds the gradients of backward.captured_grads's arrays: int64 fixed
    point, an element each (zeroed), times a power-of-two scale an array chosen so that no sum
    can reach 2^62 (a bound on every term's sum, below: no overflow, and integer adds are exact in
    any order). `gradients` turns them into the tables' gradients."""

    def __init__(self, dout, v, tree: Node, tables, arrays: tuple[int, ...]):
        import torch

        b, hq, nq, _ = dout.shape
        names = expression.captured_names(len(tables))
        # each array's least and largest element, on the device (no read-back): its reads' bounds
        ranges = {name: (t.detach().amin().double(), t.detach().amax().double()) for name, t in zip(names, tables)}
        extents = {"b": b, "h": hq, "q_idx": nq, "kv_idx": v.shape[2]}
        # sum over every (b, h, q, k) of |dS| <= sum over rows of 2 |dO_q| max_k |V_k| (dP = dO.V and
        # D = dO.O, O a convex mix of V's rows; P's row sums to 1), doubled for rounding
        ds_total = 4 * torch.linalg.vector_norm(dout.float(), dim=-1).double().sum() * torch.linalg.vector_norm(
            v.float(), dim=-1).amax().double()
        bounds = []
        for i in arrays:
            derivative = sum(magnitude(interval(grad, ranges, extents, TensorOps), TensorOps)
                             for _, grad in read_derivatives(tree, {names[i]}))
            bounds.append(ds_total * derivative)  # a kernel's scalar or a tensor: no copy from the host
        largest = torch.stack(bounds)
        # an array holding inf or NaN, or a term that could pass float32 (the kernel's product):
        # its gradient is NaN. (A derivative's inner products are not bounded one by one: one
        # that overflows float32 while the whole stays finite is not caught.)
        self.finite = largest < FLOAT32_MAX
        self.scales = torch.exp2(62 - torch.ceil(torch.log2(largest.nan_to_num(1.0).clamp(2.0 ** -900, 2.0 ** 900))))
        self.sums = [torch.zeros(tables[i].numel(), dtype=torch.int64, device=dout.device) for i in arrays]
        self.arrays = arrays

    def gradients(self, tables, dk) -> dict[int, object]:
        """Each summed array's gradient, by its index: float64 sums over the scale, as the table;
        NaN where a term could not be a number (dK is not finite: some dS was not; or an array's
        bound is not)."""
        import torch

        valid = self.finite & torch.isfinite(dk).all()
        return {i: torch.where(ok, total.double() / scale, torch.nan).view(tables[i].shape).to(tables[i].device,
                                                                                               tables[i].dtype)
                for i, total, scale, ok in zip(self.arrays, self.sums, self.scales, valid)}


class TensorOps(FloatOps):
    """derivatives.interval's arithmetic where a bound may be a 0-d tensor (an array's range, on
    the device): a float beside a tensor enters as a clamp, not as a copy from the host."""

    @staticmethod
    def minimum(a, b):
        return _pair(a, b, min, "minimum", "max")

    @staticmethod
    def maximum(a, b):
        return _pair(a, b, max, "maximum", "min")

    @staticmethod
    def exp(x):
        return FloatOps.exp(x) if isinstance(x, float) else x.exp()

    @staticmethod
    def exp2(x):
        return FloatOps.exp2(x) if isinstance(x, float) else x.exp2()

    @staticmethod
    def sqrt(x):
        return FloatOps.sqrt(x) if isinstance(x, float) else x.clamp(min=0.0).sqrt()


def _pair(a, b, of_floats, of_tensors: str, clamp: str):
    """min or max of two bounds: Python's of two floats, torch's of two tensors, a clamp of the
    tensor by the float."""
    import torch

    if isinstance(a, float) and isinstance(b, float):
        return of_floats(a, b)
    if isinstance(a, float) or isinstance(b, float):
        tensor, number = (b, a) if isinstance(a, float) else (a, b)
        return tensor.clamp(**{clamp: number})
    return getattr(torch, of_tensors)(a, b)


def _add_exactly(total, index, part) -> None:
    """total[index] += part, bitwise the same in any order: the slab's terms as int64 fixed point
    (a power-of-two scale, from the slab's largest term, that keeps any index's sum below 2^62),
    added by integer atomics (exact, so their order cannot show), then converted back into the
    float64 running total, slab after slab."""
    import torch

    headroom = max(1, part.numel()).bit_length() + 1  # the most terms one index may take: every one
    largest = part.abs().amax().double().clamp(min=2.0 ** -1000)
    scale = torch.exp2(62 - headroom - torch.ceil(torch.log2(largest)))  # on the device: no read-back
    fixed = torch.round(part.double() * scale).to(torch.int64)
    with _nondeterministic_allowed():  # an integer index_add is exact: its order cannot show
        sums = torch.zeros(total.shape, dtype=torch.int64, device=total.device).index_add_(0, index, fixed)
    total += sums.double() / scale


def _kept(block_mask, rows: slice, n_kv: int, device):
    """[Bm, Hm, rows, n_kv] bool: the pairs a fagen.masks.BlockMask keeps in these query rows,
    computed on `device` from its block grid and PARTIAL words (copied there once, kept on the
    mask): no host array and no copy a call, so a CUDA graph may hold it."""
    import torch

    types, partials, words = block_mask.cached(
        ("captured_grads", str(device)), lambda: tuple(torch.from_numpy(a.astype("int64")).to(device)
                                                       for a in (*block_mask.grids(), block_mask.partial_masks)))
    qi = torch.arange(rows.start, rows.stop, device=device)[:, None]
    ki = torch.arange(n_kv, device=device)[None, :]
    qb, kb = qi // block_mask.q_block, ki // block_mask.kv_block
    kind, which = types[:, :, qb, kb], partials[:, :, qb, kb]
    column = ki % block_mask.kv_block
    word = words[which.clamp(min=0), qi % block_mask.q_block, column // 32]
    return ((kind == FULL) | (kind == CAUSAL) & (ki <= qi + block_mask.causal_offset)
            | (kind == PARTIAL) & ((word >> (column % 32)) & 1 == 1))


@contextmanager
def _nondeterministic_allowed():
    """torch.use_deterministic_algorithms off for an op whose result cannot depend on order (it
    refuses atomics by op, not by type), then as it was."""
    import torch

    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


@contextmanager
def _exact_products():
    """TF32 matmuls for float32 copies of float16 / bfloat16 tensors: their products are exact in
    TF32 (10 and 7 mantissa bits), accumulated in float32 as in the kernels, on the tensor cores
    rather than at float32's SIMT rate; the setting restored after."""
    import torch

    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
