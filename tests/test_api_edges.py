"""The Python API's edges: the oracle refuses what the spec refuses, with the same rule text;
bad arguments to the oracle and the block-mask builders are refused with a message naming the
argument, its value, the rule and a fix; the package's documented submodules are reachable
after `import fagen`; scripts say in one line what they need when there is no GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import fagen
from fagen import masks, oracle, sequences, side_inputs
from fagen.cli import main
from fagen.load import SPECS
from tests.conftest import base, rejected

ROOT = Path(__file__).resolve().parent.parent
# `name = value: rule ...; fix`, fagen.spec.rule's format
NAMED = re.compile(r"^(?P<name>[\w.\[\], -]+?) = (?P<value>.+?): (?P<rule>.+); (?P<fix>.+)$", re.S)


def refusal(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def rule_of(message: str) -> str:
    """A message without its `name = value: ` head, and without load's `invalid spec <source>: `."""
    message = message.removeprefix("invalid spec <dict>: ")
    return message.split(": ", 1)[1]


def qkv(rng, b=1, hq=2, hkv=2, nq=8, nk=8, d=16):
    return (rng.standard_normal((b, hq, nq, d)), rng.standard_normal((b, hkv, nk, d)),
            rng.standard_normal((b, hkv, nk, d)))


# ---- one rule set: what the spec refuses, the oracle refuses, with the same rule text ----------

SAME_RULES = [  # (spec overrides, oracle keywords, the name both messages give)
    ({"score_mod": {"softcap": 0.0}}, {"softcap": 0.0}, "softcap"),
    ({"score_mod": {"softcap": -1.0}}, {"softcap": -1.0}, "softcap"),
    ({"score_mod": {"softcap": float("nan")}}, {"softcap": float("nan")}, "softcap"),
    ({"score_mod": {"softcap": 2e6}}, {"softcap": 2e6}, "softcap"),
    ({"mask": {"kind": "chunked", "chunk_size": 0}}, {"mask": {"kind": "chunked", "chunk_size": 0}}, "mask.chunk_size"),
    ({"mask": {"kind": "sliding_window", "window_left": -5}}, {"mask": {"kind": "sliding_window", "window_left": -5}},
     "mask.window_left"),
    ({"mask": {"kind": "sliding_window", "window_left": 4, "window_right": -1}},
     {"mask": {"kind": "sliding_window", "window_left": 4, "window_right": -1}}, "mask.window_right"),
    ({"mask": {"kind": "sliding_window", "window_left": 1 << 29}},
     {"mask": {"kind": "sliding_window", "window_left": 1 << 29}}, "mask.window_left"),
    ({"mask": {"kind": "prefix_lm", "prefix_len": 0}}, {"mask": {"kind": "prefix_lm", "prefix_len": 0}},
     "mask.prefix_len"),
    ({"mask": {"kind": "causal", "window_left": 4}}, {"mask": {"kind": "causal", "window_left": 4}}, "mask.window_left"),
    ({"mask": {"kind": "chunked"}}, {"mask": {"kind": "chunked"}}, "mask.chunk_size"),
    ({"mask": {"kind": "causal", "causal": True}}, {"mask": {"kind": "causal", "causal": True}}, "mask.causal"),
]


@pytest.mark.parametrize("spec_overrides, oracle_kwargs, name", SAME_RULES,
                         ids=[f"{n}-{i}" for i, (_, _, n) in enumerate(SAME_RULES)])
def test_the_oracle_refuses_what_the_spec_refuses_with_the_same_rule(spec_overrides, oracle_kwargs, name):
    spec_message = rejected(base(**spec_overrides))
    q, k, v = qkv(np.random.default_rng())
    oracle_message = refusal(oracle.attention, q, k, v, **oracle_kwargs)
    assert NAMED.match(oracle_message), oracle_message
    assert oracle_message.startswith(f"{name} = "), oracle_message
    assert name in spec_message, spec_message
    assert rule_of(oracle_message) == rule_of(spec_message)
    # and the backward reads the same arguments
    assert refusal(oracle.attention_backward, q, k, v, np.ones_like(q), **oracle_kwargs) == oracle_message


def test_the_oracle_refuses_complex_inputs():
    q, k, v = qkv(np.random.default_rng())
    for name, args in (("q", (q + 1j, k, v)), ("k", (q, k + 0j, v)), ("v", (q, k, v * 1j))):
        message = refusal(oracle.attention, *args)
        assert NAMED.match(message) and message.startswith(f"{name}.dtype = complex128: must be real")
    message = refusal(oracle.attention_varlen, q[0].transpose(1, 0, 2) + 1j, k[0].transpose(1, 0, 2),
                      v[0].transpose(1, 0, 2), [0, 8], [0, 8])
    assert message.startswith("q.dtype = complex128")


# ---- bad arguments are named: argument, value, rule, fix ---------------------------------------

def _varlen(rng, cu_q, cu_k, q_shape=None, **kwargs):
    total_q, total_k = 10, 10
    q = rng.standard_normal(q_shape or (total_q, 2, 16))
    k = rng.standard_normal((total_k, 2, 16))
    return lambda: oracle.attention_varlen(q, k, k, cu_q, cu_k, **kwargs)


def _paged(rng, table, lens=(8, 8), num_pages=4):
    q = rng.standard_normal((2, 2, 1, 16))
    cache = rng.standard_normal((num_pages, 4, 2, 16))
    return lambda: oracle.attention_paged(q, cache, cache, np.array(table), np.array(lens))


def _named_cases():
    rng = np.random.default_rng()
    q, k, v = qkv(rng)
    return {
        "causal str": (lambda: masks.causal("64"), "n_q", "'64'"),
        "causal n_kv str": (lambda: masks.causal(64, "64"), "n_kv", "'64'"),
        "documents_of_lengths int": (lambda: masks.documents_of_lengths(5), "lengths", "5"),
        "key_major 0": (lambda: masks.causal(64, q_block=16, kv_block=16).key_major(0), "group", "0"),
        "document None": (lambda: masks.document(None), "doc_ids", "None"),
        "document floats": (lambda: masks.document(np.zeros(8)), "doc_ids.dtype", "float64"),
        "oracle mask 5": (lambda: oracle.attention(q, k, v, mask=5), "mask", "5"),
        "oracle block_mask ndarray": (lambda: oracle.attention(q, k, v, block_mask=np.ones((8, 8), bool)),
                                      "block_mask", "ndarray"),
        "oracle block_mask shape": (lambda: oracle.attention(q, k, v, block_mask=masks.causal(8, 9, 4, 4)),
                                    "block_mask.shape", "[1, 1, 8, 9]"),
        "oracle softcap str": (lambda: oracle.attention(q, k, v, softcap="30"), "softcap", "'30'"),
        "oracle chunk_size str": (lambda: oracle.attention(q, k, v, mask={"kind": "chunked", "chunk_size": "4"}),
                                  "mask.chunk_size", "'4'"),
        "oracle scale array": (lambda: oracle.attention(q, k, v, scale=np.ones(3)), "scale", "array"),
        "oracle scale negative": (lambda: oracle.attention(q, k, v, scale=-0.1), "scale", "-0.1"),
        "varlen cu lengths differ": (_varlen(rng, [0, 5, 10], [0, 10]), "cu_seqlens_k", "2 entries"),
        "varlen 4-D q": (_varlen(rng, [0, 5, 10], [0, 5, 10], q_shape=(1, 2, 10, 16)), "q.shape", "[1, 2, 10, 16]"),
        "varlen decreasing": (_varlen(rng, [0, 6, 4, 10], [0, 6, 4, 10]), "cu_seqlens_q[2]", "4"),
        "varlen overlong": (_varlen(rng, [0, 6, 12], [0, 6, 10]), "cu_seqlens_q[-1]", "12"),
        "varlen not from 0": (_varlen(rng, [0, 6, 10], [1, 6, 10]), "cu_seqlens_k[0]", "1"),
        "varlen seqused_k past k": (_varlen(rng, [0, 5, 10], [0, 5, 10], seqused_k=[5, 6]), "seqused_k[1]", "6"),
        "paged page -1": (_paged(rng, [[0, -1], [2, 3]]), "page_table[0, 1]", "-1"),
        "paged page past the cache": (_paged(rng, [[0, 7], [2, 3]]), "page_table[0, 1]", "7"),
        "paged page = num_pages": (_paged(rng, [[0, 1], [4, 3]]), "page_table[1, 0]", "4"),
        "paged length past the table": (_paged(rng, [[0, 1], [2, 3]], lens=(8, 9)), "cache_seqlens[1]", "9"),
        "paged table rows": (_paged(rng, [[0, 1]]), "page_table.shape", "[1, 2]"),
    }


NAMED_CASES = _named_cases()


@pytest.mark.parametrize("case", NAMED_CASES)
def test_bad_arguments_are_named_with_a_rule_and_a_fix(case):
    call, name, value = NAMED_CASES[case]
    message = refusal(call)
    found = NAMED.match(message)
    assert found, message
    assert found["name"] == name, message
    assert value in found["value"], message


def test_unused_page_table_slots_are_not_read():
    """Slots past a sequence's length may hold anything (-1: unused, vLLM's padding); the oracle,
    like the kernels, reads only the pages the sequence's keys lie in."""
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 2, 3, 16))
    cache = rng.standard_normal((4, 4, 2, 16))
    table = np.array([[2, -1, 99]])
    got = oracle.attention_paged(q, cache, cache, table, np.array([3]))
    keys = cache[2, :3].transpose(1, 0, 2)[None]
    np.testing.assert_allclose(got, oracle.attention(q, keys, keys))


def test_the_oracle_and_the_runtime_share_the_sequence_rules():
    """fagen.sequences (the runtime's varlen and paged checks) applies side_inputs' rules, the
    ones the oracle applies: one message for one bad value."""
    for name in ("check_cu_seqlens", "check_cu_seqlens_pair", "check_seqused_k", "check_pages"):
        assert getattr(sequences, name) is getattr(side_inputs, name)
    rng = np.random.default_rng()
    message = refusal(_varlen(rng, [0, 6, 4, 10], [0, 6, 4, 10]))
    assert message == refusal(side_inputs.check_cu_seqlens, np.array([0, 6, 4, 10]), 10, 10, "q")


def test_huge_builder_masks_are_refused_quickly():
    start = time.monotonic()
    message = refusal(masks.sliding_window, 10**6, 1)
    assert time.monotonic() - start < 1.0
    assert message.startswith("n = 1000000: ") and "use n <= " in message
    fix = int(re.search(r"use n <= (\d+)", message)[1])
    masks._check_size(("n", "n"), fix, fix, 128, 128)  # the fix itself passes the guard
    # too many blocks, few pairs: the fix is larger blocks
    message = refusal(masks.causal, 100_000, 100_000, 16, 16)
    found = re.search(r"use q_block and kv_block >= (\d+)", message)
    assert message.startswith("q_block, kv_block = (16, 16): ") and found, message
    masks._check_size(("n_q", "n_kv"), 100_000, 100_000, int(found[1]), int(found[1]))


def test_show_refuses_a_folder_and_writes_nothing(tmp_path):
    pytest.importorskip("matplotlib")
    bm = masks.causal(64, q_block=16, kv_block=16)
    folder = tmp_path / "pictures"
    folder.mkdir()
    message = refusal(masks.show, bm, str(folder))
    assert message.startswith(f"path = {str(folder)!r}: is a folder") and str(folder / "mask.png") in message
    assert not list(tmp_path.rglob("*.png"))
    message = refusal(masks.show, bm, str(tmp_path / "mask.jpg"))
    assert message.startswith("path = ") and "mask.png" in message
    assert not list(tmp_path.rglob("*.*"))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_launch_timeout_must_be_finite(value, monkeypatch):
    from fagen import distributed

    monkeypatch.setattr(distributed, "launch", lambda *a, **k: pytest.fail("launched"))
    result = CliRunner().invoke(main, ["launch", "-n", "1", "--timeout", value, str(SPECS / "attn_f16_d128.yaml")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "--timeout" in result.output and "finite" in result.output


# ---- what the README says of the package and its scripts ---------------------------------------

def _readme_submodules() -> list[str]:
    """The fagen.<name> the README writes that are submodules (fagen.render, README's
    `fagen.render(spec)`, is the function the package exports)."""
    modules = {p.stem for p in (ROOT / "fagen").glob("*.py")} - {"__init__", "__main__"}
    used = set(re.findall(r"\bfagen\.([a-z_]+)\b", (ROOT / "README.md").read_text()))
    try:  # the PyTorch modules import torch (and transformers) at the top: reachable where those are
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        modules -= {"torch_op", "transformers", "bench_e2e", "flex", "bench_flex"}
    return sorted(used & modules - set(fagen.__all__))


def test_the_readme_s_submodules_are_reachable_after_import_fagen():
    names = _readme_submodules()
    assert {"oracle", "sequences", "variants"} <= set(names)
    code = ("import sys, types, fagen\n"
            f"for name in {names!r}:\n"
            "    assert isinstance(getattr(fagen, name), types.ModuleType), name\n"
            "try:\n    fagen.no_such_module\nexcept AttributeError as err:\n    print('refused', err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused" in done.stdout and "no_such_module" in done.stdout
    # the README's own examples read these as attributes
    assert callable(fagen.oracle.attention) and callable(fagen.sequences.from_flashinfer)


def test_import_fagen_loads_what_its_names_need_at_their_first_use():
    """`import fagen` is light (pydantic, Jinja2 and NumPy wait for the first name that needs
    them), and the exported names are the functions and classes, not modules."""
    code = ("import sys, types, fagen\n"
            "print(sorted(m for m in ('numpy', 'pydantic', 'jinja2', 'yaml', 'cupy', 'torch') if m in sys.modules))\n"
            "import fagen.rendering\n"  # the module of fagen.render, imported first: the name stays the function
            "assert callable(fagen.render) and not isinstance(fagen.render, types.ModuleType)\n"
            "assert fagen.render is fagen.rendering.render and fagen.SpecError is fagen.spec.SpecError\n"
            "print(fagen.AttentionSpec.__name__, fagen.load_spec.__module__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "AttentionSpec fagen.load"]


def test_core_timing_without_a_gpu_says_what_is_missing_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, whatever this machine has
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "core_timing.py")], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(r"CuPy|GPU|PyTorch", lines[0]), done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("mask, named", [(5, "mask = 5"), ({"kind": "sliding_window", "window_left": -5},
                                                            "mask.window_left = -5"),
                                          ("bogus", "mask.kind = 'bogus'")])
def test_fagen_attention_refuses_a_bad_mask_as_the_oracle_does(mask, named):
    """fagen.attention's spec derivation refuses a bad mask before it asks for a GPU, with the
    oracle's message (not pydantic's)."""
    from fagen.dispatch import derive_spec_for

    with pytest.raises(ValueError) as runtime:
        derive_spec_for("float16", 64, mask=mask)
    with pytest.raises(ValueError) as reference:
        fagen.oracle.attention(*(np.zeros((1, 1, 4, 64)),) * 3, mask=mask)
    assert named in str(runtime.value) and str(runtime.value) == str(reference.value)


class _TorchLikeDtype:
    def __init__(self, name):
        self.name, self.is_complex = name, "complex" in name

    def __str__(self):
        return f"torch.{self.name}"


class _TorchLikeScalar:
    """A 0-d torch tensor as check_scale sees it (this machine may have no torch): a shape of (),
    a dtype without NumPy's .kind, and __float__."""

    shape = ()

    def __init__(self, value, dtype):
        self.value, self.dtype = value, _TorchLikeDtype(dtype)

    def __float__(self):
        return float(self.value)


def test_a_zero_dim_torch_scale_is_a_number():
    from fagen.side_inputs import check_scale

    assert check_scale(_TorchLikeScalar(0.125, "float32"), 64) == 0.125
    assert check_scale(_TorchLikeScalar(2, "int64"), 64) == 2.0
    for refused in (_TorchLikeScalar(1, "bool"), _TorchLikeScalar(0.1, "complex64"), _TorchLikeScalar(0.0, "float32")):
        with pytest.raises(ValueError, match=r"scale = .*must be a finite number > 0"):
            check_scale(refused, 64)
