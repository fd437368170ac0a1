"""Arguments a person gets wrong, on the CPU: numeric arguments of the block-mask builders,
predicates that return numbers instead of bools, side inputs (doc_ids, alibi_slopes, sinks,
bias) of the wrong shape, NaN inputs and non-finite sinks, and mask kinds named without their
array. The runtime's checks run here too: they come before anything touches the GPU."""

from __future__ import annotations

import ast
import re
import sys

import numpy as np
import pytest

from fagen import masks, oracle, runtime, side_inputs, variants
from fagen.plan import plan
from fagen.load import SPECS
from fagen.spec import Mask, ScoreMod
from fagen.load import load_spec


def refused(call, *fragments: str) -> str:
    """call() raises ValueError whose message holds every fragment; returns the message."""
    with pytest.raises(ValueError) as err:
        call()
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def inputs(batch=2, heads_q=4, heads_kv=2, n_q=8, n_kv=8, d=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, heads_q, n_q, d)), rng.standard_normal((batch, heads_kv, n_kv, d)),
            rng.standard_normal((batch, heads_kv, n_kv, d)))


def causal_keep(b, h, q, k):
    return k <= q


# ---- numeric arguments of the builders ------------------------------------------------------

BAD_ARGUMENTS = {
    "chunked chunk_size 0": (lambda: masks.chunked(64, 0), "chunk_size", 0, "must be >= 1"),
    "chunked chunk_size numpy 0": (lambda: masks.chunked(64, np.int64(0)), "chunk_size", 0, "must be >= 1"),
    "chunked chunk_size 2.5": (lambda: masks.chunked(64, 2.5), "chunk_size", 2.5, "must be an integer"),
    "sliding_window left -5": (lambda: masks.sliding_window(64, -5), "left", -5, "must be >= 0"),
    "sliding_window right -1": (lambda: masks.sliding_window(64, 8, right=-1), "right", -1, "must be >= 0"),
    "sliding_window n 0": (lambda: masks.sliding_window(0, 8), "n", 0, "must be >= 1"),
    "prefix_lm prefix_len -1": (lambda: masks.prefix_lm(64, -1), "prefix_len", -1, "must be >= 0"),
    "prefix_lm q_block 0": (lambda: masks.prefix_lm(64, 8, q_block=0), "q_block", 0, "must be >= 1"),
    "causal n_q 0": (lambda: masks.causal(0), "n_q", 0, "must be >= 1"),
    "causal n_kv 0": (lambda: masks.causal(64, 0), "n_kv", 0, "must be >= 1"),
    "causal kv_block 0": (lambda: masks.causal(64, kv_block=0), "kv_block", 0, "must be >= 1"),
    "causal kv_block True": (lambda: masks.causal(64, kv_block=True), "kv_block", True, "must be an integer"),
    "causal align": (lambda: masks.causal(64, align="bottom-right"), "align", "bottom-right",
                     "must be 'bottom_right' or 'top_left'"),
    "from_predicate b 0": (lambda: masks.from_predicate(causal_keep, 0, 1, 64, 64), "b", 0, "must be >= 1"),
    "from_predicate h 0": (lambda: masks.from_predicate(causal_keep, 1, 0, 64, 64), "h", 0, "must be >= 1"),
    "from_predicate n_kv -3": (lambda: masks.from_predicate(causal_keep, 1, 1, 64, -3), "n_kv", -3, "must be >= 1"),
    "from_predicate causal_offset 0.5": (lambda: masks.from_predicate(causal_keep, 1, 1, 64, 64, causal_offset=0.5),
                                         "causal_offset", 0.5, "must be an integer"),
    "from_dense q_block 0": (lambda: masks.from_dense(np.ones((8, 8), bool), q_block=0), "q_block", 0,
                             "must be >= 1"),
    "from_dense empty": (lambda: masks.from_dense(np.ones((0, 8), bool)), "mask.shape", [0, 8],
                         "every dimension must be >= 1"),
    "document kv_block -1": (lambda: masks.document(np.zeros((1, 8), np.int32), kv_block=-1), "kv_block", -1,
                             "must be >= 1"),
    "document empty": (lambda: masks.document(np.zeros((1, 0), np.int32)), "doc_ids.shape", [1, 0],
                       "must be [N] or [B, N] with B, N >= 1"),
    "documents_of_lengths -1": (lambda: masks.documents_of_lengths([4, -1]), "lengths[1]", -1, "must be >= 0"),
    "documents_of_lengths none": (lambda: masks.documents_of_lengths([0, 0]), "sum(lengths)", 0, "must be >= 1"),
    "documents_of_lengths batch 0": (lambda: masks.documents_of_lengths([4], batch=0), "batch", 0, "must be >= 1"),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_numeric_arguments_are_refused_with_the_rule(case):
    """`name = value: rule (why); fix`, the format of fagen.spec.rule."""
    call, name, value, rule = case
    message = refused(call, f"{name} = {value!r}: {rule}")
    assert re.search(r"\(.+\); \S", message), message  # a reason in parentheses, then a fix


SMALLEST = {  # argument: (builder at value x, smallest valid x, the dense mask it gives at that x)
    "chunk_size": (lambda x: masks.chunked(16, x, 4, 4), 1, np.eye(16, dtype=bool)),
    "left": (lambda x: masks.sliding_window(16, x, 0, 4, 4), 0, np.eye(16, dtype=bool)),
    "right": (lambda x: masks.sliding_window(16, 0, x, 4, 4), 0, np.eye(16, dtype=bool)),
    "prefix_len": (lambda x: masks.prefix_lm(16, x, 4, 4), 0, np.tri(16, dtype=bool)),
    "n": (lambda x: masks.sliding_window(x, 3, 0, 4, 4), 1, np.ones((1, 1), bool)),
    "q_block": (lambda x: masks.causal(5, q_block=x, kv_block=4), 1, np.tri(5, dtype=bool)),
}


@pytest.mark.parametrize("name", SMALLEST)
def test_smallest_valid_value_builds_and_one_less_is_refused(name):
    build, smallest, dense = SMALLEST[name]
    np.testing.assert_array_equal(build(np.int64(smallest)).to_dense()[0, 0], dense)  # NumPy integers count
    refused(lambda: build(smallest - 1), f"{name} = {smallest - 1}: must be >= {smallest}")


# ---- what a predicate returns -----------------------------------------------------------------

OTHER_NUMBERS = {
    "times 2": lambda b, h, q, k: (k <= q) * 2,
    "minus 1": lambda b, h, q, k: (k <= q).astype(int) - 1,
    "additive": lambda b, h, q, k: np.where(k <= q, 0.0, -np.inf),
    "float 0/1": lambda b, h, q, k: (k <= q).astype(np.float32),
}


@pytest.mark.parametrize("fn", OTHER_NUMBERS.values(), ids=OTHER_NUMBERS.keys())
def test_predicate_returning_other_numbers_is_refused(fn):
    """Not "nonzero = keep": a 2 is arithmetic gone wrong, a float likely an additive mask whose
    0 means keep. The builder and the oracle's mask_mod share the rule."""
    refused(lambda: masks.from_predicate(fn, 1, 1, 32, 32, 16, 16), "from_predicate", "must be bool")
    q, k, v = inputs()
    refused(lambda: oracle.attention(q, k, v, mask_mod=fn), "mask_mod", "must be bool")


def test_from_dense_refuses_an_additive_mask():
    """0 / -inf read as bools would keep exactly the masked pairs."""
    additive = np.where(np.tri(32, dtype=bool), 0.0, -np.inf)
    refused(lambda: masks.from_dense(additive, 16, 16), "from_dense: mask", "float64", "must be bool")


@pytest.mark.parametrize("as_numbers", [lambda c: c.astype(np.int8), lambda c: np.where(c, 1, 0)],
                         ids=["astype", "where"])
def test_zeros_and_ones_read_as_bool_and_twos_are_refused(as_numbers):
    """0/1 integers mean False/True, to the builders (same pairs, same block types) and to the
    oracle's mask_mod; the same predicate times 2 is refused by both."""
    want = masks.from_predicate(causal_keep, 1, 1, 64, 64, 16, 16)
    for got in (masks.from_predicate(lambda b, h, q, k: as_numbers(k <= q), 1, 1, 64, 64, 16, 16),
                masks.from_dense(as_numbers(np.tri(64, dtype=bool)), 16, 16)):
        np.testing.assert_array_equal(got.block_type_grid(), want.block_type_grid())
        np.testing.assert_array_equal(got.to_dense(), want.to_dense())
    q, k, v = inputs()
    causal = oracle.attention(q, k, v, causal=True, return_lse=True)
    got = oracle.attention(q, k, v, mask_mod=lambda b, h, qi, ki: as_numbers(ki <= qi), return_lse=True)
    np.testing.assert_array_equal(got[0], causal[0])
    np.testing.assert_array_equal(got[1], causal[1])

    def twice(b, h, qi, ki):
        return as_numbers(ki <= qi) * 2

    refused(lambda: masks.from_predicate(twice, 1, 1, 64, 64, 16, 16), "from_predicate", "holding 2")
    refused(lambda: oracle.attention(q, k, v, mask_mod=twice), "mask_mod", "holding 2")


# ---- side inputs: one shape rule for the oracle and the runtime ----------------------------------

B, HQ, HKV, N = 2, 4, 2, 8

WRONG_SHAPES = {  # side input: (its value, q length, k length, what the message must say)
    "doc_ids 1-D": ("doc_ids", np.zeros(N, np.int32), N, N,
                    "doc_ids.shape = [8]: must be [B|1, N] = [2|1, 8]"),
    "doc_ids batch 3": ("doc_ids", np.zeros((3, N), np.int32), N, N,
                        "doc_ids.shape = [3, 8]: must be [B|1, N] = [2|1, 8]"),
    "doc_ids too short": ("doc_ids", np.zeros((1, N - 3), np.int32), N, N,
                          "doc_ids.shape = [1, 5]: must be [B|1, N] = [2|1, 8]"),
    "doc_ids cross": ("doc_ids", np.zeros((1, N), np.int32), N, N + 1, "doc_ids with Nq = 8, Nk = 9"),
    "alibi_slopes per kv head": ("alibi_slopes", np.ones(HKV, np.float32), N, N,
                                 "alibi_slopes.shape = [2]: must be [Hq] = [4]"),
    "alibi_slopes 2-D": ("alibi_slopes", np.ones((1, HQ), np.float32), N, N,
                         "alibi_slopes.shape = [1, 4]: must be [Hq] = [4]"),
    "sinks scalar-like": ("sinks", np.ones(1, np.float32), N, N, "sinks.shape = [1]: must be [Hq] = [4]"),
    "sinks column": ("sinks", np.ones((HQ, 1), np.float32), N, N, "sinks.shape = [4, 1]: must be [Hq] = [4]"),
}


@pytest.mark.parametrize("case", WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
def test_shape_rule_names_the_expected_shape(case):
    name, value, nq, nk, says = case
    refused(lambda: side_inputs.check_shapes(B, HQ, nq, nk, **{name: value.shape}), says)


@pytest.mark.parametrize("case", WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
def test_oracle_refuses_wrong_shaped_side_inputs(case):
    name, value, nq, nk, says = case
    q, k, v = inputs(B, HQ, HKV, nq, nk)
    refused(lambda: oracle.attention(q, k, v, **{name: value}), says)


def test_shape_rule_accepts_what_the_kernels_take():
    ok = dict(doc_ids=(1, N), alibi_slopes=(HQ,), sinks=(HQ,))
    side_inputs.check_shapes(B, HQ, N, N, **ok)
    side_inputs.check_shapes(B, HQ, N, N, doc_ids=(B, N))
    for bias in ((1, 1, N), (B, HQ, N), (1, HQ, N, N), (B, 1, N, N)):  # vector or matrix, by rank
        side_inputs.check_shapes(B, HQ, N, N, bias=bias)
    side_inputs.check_shapes(B, HQ, N, N, bias=(B, 1, N), bias_kind="vector")
    refused(lambda: side_inputs.check_shapes(B, HQ, N, N, bias=(B, 1, N), bias_kind="matrix"),
            "bias.shape = [2, 1, 8]: must be [B|1, H|1, Nq, Nk] = [2|1, 4|1, 8, 8]")
    refused(lambda: side_inputs.check_shapes(B, HQ, N, N, bias=(B, 2, N)),
            "bias.shape = [2, 2, 8]: must be [B|1, H|1, Nk] = [2|1, 4|1, 8]")
    refused(lambda: side_inputs.check_shapes(B, HQ, N, N, bias=(N, N)), "[B|1, H|1, Nk]", "[B|1, H|1, Nq, Nk]")


def test_side_inputs_module_needs_only_the_standard_library_and_numpy():
    """Shape arithmetic on tuples, value checks on host arrays: the oracle (NumPy alone) and the
    runtime can both import it."""
    tree = ast.parse(open(side_inputs.__file__).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            assert top in ("__future__", "numpy") or top in sys.stdlib_module_names, name


def cpu_kernel(mask: Mask, score_mod: ScoreMod) -> runtime.Kernel:
    """A runtime Kernel with a spec and plan but nothing compiled: enough for the argument checks
    of extra_arguments, which must refuse bad side inputs before they reach the device."""
    kernel = object.__new__(runtime.Kernel)
    kernel.spec = variants.variant(load_spec(SPECS / "attn_f16_d64.yaml"), mask, score_mod)
    kernel.plan = plan(kernel.spec)
    return kernel


def device_tensor(shape) -> runtime.DeviceTensor:
    return runtime.DeviceTensor(None, "cupy", 0, shape, (), "float16", 0)


def extra_arguments(kernel, nq=N, nk=N, **given):
    given = {name: given.get(name) for name in ("block_mask", "bias", "alibi_slopes", "sinks", "doc_ids")}
    return kernel.extra_arguments(device_tensor((B, HQ, nq, 64)), device_tensor((B, HKV, nk, 64)), given)


@pytest.mark.parametrize("case", WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
def test_runtime_refuses_wrong_shaped_side_inputs(case):
    name, value, nq, nk, says = case
    mask = Mask(kind="document") if name == "doc_ids" else Mask(kind="none")
    kernel = cpu_kernel(mask, ScoreMod(alibi="slopes" if name == "alibi_slopes" else "none", sinks=name == "sinks"))
    refused(lambda: extra_arguments(kernel, nq, nk, **{name: value}), says)


@pytest.mark.parametrize("kind", ["vector", "matrix"])
def test_runtime_refuses_a_bias_of_the_other_kind(kind):
    kernel = cpu_kernel(Mask(kind="none"), ScoreMod(bias=kind))
    other = np.zeros((1, 1, N, N) if kind == "vector" else (1, 1, N), np.float32)
    refused(lambda: extra_arguments(kernel, bias=other), "bias.shape", "[2|1, 4|1, ")


# ---- NaN inputs and non-finite sinks ------------------------------------------------------------

@pytest.mark.parametrize("with_sinks", [False, True])
def test_nan_inputs_reach_output_and_lse(with_sinks):
    """A NaN in q poisons its row, in k every row that sees that key (O and LSE, which must not
    pass for an empty row's -inf); rows that never see it stay exact."""
    q, k, v = inputs(B, HQ, HKV, N, N)
    sinks = np.linspace(-1.0, 1.0, HQ) if with_sinks else None
    clean_out, clean_lse = oracle.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    row, key = np.zeros((B, HQ, N), bool), np.zeros((B, HQ, N), bool)
    row[0, 1, 2] = True  # q[0, 1, 2] is NaN
    key[0, :2, 3:] = True  # k / v[0, 0, 3]: query heads 0 and 1 read KV head 0; rows >= 3 see key 3
    for name, at, tainted in (("q", (0, 1, 2, 0), row), ("k", (0, 0, 3, 0), key)):
        args = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
        args[name][at] = np.nan
        out, lse = oracle.attention(**args, causal=True, sinks=sinks, return_lse=True)
        assert np.isnan(out[tainted]).all() and np.isnan(lse[tainted]).all(), name
        np.testing.assert_array_equal(out[~tainted], clean_out[~tainted])
        np.testing.assert_array_equal(lse[~tainted], clean_lse[~tainted])
    # v: O of the rows that see the value; the LSE does not read v. (0 * NaN also reaches rows
    # that mask the key out, as it does in a kernel's tile: not asserted either way.)
    v_nan = v.copy()
    v_nan[0, 0, 3, 0] = np.nan
    out, lse = oracle.attention(q, k, v_nan, causal=True, sinks=sinks, return_lse=True)
    assert np.isnan(out[key][:, 0]).all()
    np.testing.assert_array_equal(lse, clean_lse)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_sinks_are_refused(bad):
    q, k, v = inputs(B, HQ, HKV, N, N)
    sinks = np.array([0.5, bad, 0.0, 1.0])
    says = f"sinks = [0.5, {bad}, 0.0, 1.0]: must be finite"
    refused(lambda: oracle.attention(q, k, v, sinks=sinks), says, "index 1")
    refused(lambda: side_inputs.check_finite("sinks", sinks.tolist()), says)
    side_inputs.check_finite("sinks", [0.5, -1e4])


def test_device_checks_run_once_per_object():
    """The runtime reads device values (a host sync) for a check once per array object."""
    calls = []

    def check():
        calls.append(1)

    a, b = np.zeros(4), np.zeros(4)
    for _ in range(3):
        side_inputs.once_per_object("finite sinks", a, check)
    assert len(calls) == 1
    side_inputs.once_per_object("finite sinks", b, check)
    side_inputs.once_per_object("another check", a, check)
    assert len(calls) == 3

    def failing():
        calls.append(1)
        raise ValueError("bad")

    c = np.zeros(4)
    for _ in range(2):  # a failed check is not remembered
        with pytest.raises(ValueError):
            side_inputs.once_per_object("finite sinks", c, failing)
    assert len(calls) == 5


# ---- mask kinds named without their array -----------------------------------------------------

MISSING = {
    "block_mask": ({"kind": "block_mask"}, "block_mask = None: is required by mask kind 'block_mask'",
                   "fagen.masks."),
    "doc_ids": ({"kind": "document", "causal": True}, "doc_ids = None: is required by mask kind 'document'",
                "fagen.masks.documents_of_lengths"),
}


@pytest.mark.parametrize("name", MISSING)
def test_mask_kind_without_its_array_is_refused(name):
    mask, says, how = MISSING[name]
    q, k, v = inputs(B, HQ, HKV, N, N)
    refused(lambda: oracle.attention(q, k, v, mask=mask), says, how)
    refused(lambda: extra_arguments(cpu_kernel(Mask.model_validate(mask), ScoreMod())), says, how)
    refused(lambda: side_inputs.require_mask_inputs(mask["kind"], has_block_mask=False, has_doc_ids=False), says)
    side_inputs.require_mask_inputs(mask["kind"], has_block_mask=True, has_doc_ids=True)
