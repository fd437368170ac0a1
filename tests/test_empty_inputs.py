"""Calls with no work, and the paged cache's append, without a GPU: the planners split nothing
without dividing by zero, fagen.attention's dispatch answers a call with no query row or no key
before any planner or kernel, and the append kernel compiles."""

import re
import subprocess
from types import SimpleNamespace

import pytest

from fagen import decode, dispatch, splitkv
from fagen.nvcc import find_nvcc
from fagen.rendering import APPEND_KV, render_append_kv, shared_kernels


@pytest.mark.parametrize("blocks, tiles", [(0, 10), (0, 0), (8, 0)])
def test_the_decode_planner_splits_nothing_where_there_is_nothing(blocks, tiles):
    assert dispatch.choose_splits(blocks, tiles, 132) == 1


@pytest.mark.parametrize("blocks, tiles", [(0, 100), (0, 0), (8, 0)])
def test_the_split_kv_planner_splits_nothing_where_there_is_nothing(blocks, tiles):
    assert splitkv.choose_splits(blocks, tiles, 132) == 1


@pytest.mark.parametrize("q, k, empty", [
    ((1, 1, 0, 64), (1, 1, 5, 64), True), ((0, 4, 3, 64), (0, 1, 5, 64), True), ((1, 0, 3, 64), (1, 0, 5, 64), True),
    ((2, 8, 3, 64), (2, 2, 0, 64), True), ((1, 1, 1, 64), (1, 1, 1, 64), False), ((2, 8, 300, 64), (2, 2, 9, 64), False)])
def test_a_call_without_a_query_row_or_a_key_has_no_work(q, k, empty):
    assert dispatch.no_work(q, k) is empty


@pytest.mark.parametrize("q, k", [((1, 1, 0, 64), (1, 1, 5, 64)), ((2, 8, 3, 64), (2, 2, 0, 64)),
                                  ((0, 4, 3, 64), (0, 1, 5, 64))])
def test_the_dispatch_answers_a_call_without_work_before_any_planner(monkeypatch, q, k):
    """decode.forward (fagen.attention's and the PyTorch op's dispatch) never reaches the decode
    kernel's choice, its split planner or a kernel for such a call."""
    def planner(*args, **kwargs):
        raise AssertionError("a call with no work reached a planner or a kernel")

    for name in ("packed_spec", "step_spec", "compile_kernel", "run"):
        monkeypatch.setattr(decode, name, planner)
    for name in ("packed_spec", "step_spec", "default_splits", "choose_splits"):
        monkeypatch.setattr(dispatch, name, planner)
    monkeypatch.setattr(decode, "answer_without_work", lambda plain, q, k, v, **kw: ("answered", q.shape, kw))
    tensor = lambda shape: SimpleNamespace(shape=shape)  # noqa: E731
    got = decode.forward("plain", tensor(q), tensor(k), tensor(k), return_lse=True, sinks=None)
    assert got == ("answered", q, {"return_lse": True, "sinks": None})


def test_the_append_kernel_is_shared_and_compiles_without_spills():
    """The paged cache's append (fagen.sequences.append_kv): rendered with the kernels no spec
    owns (generated/, fagen render), and nvcc builds it for sm_80 and sm_90 with no stack frame."""
    source = render_append_kv()
    assert shared_kernels()[f"{APPEND_KV}.cu"] == source
    for arch in ("sm_80", "sm_90"):
        run = subprocess.run([find_nvcc(), "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", "-x", "cu",
                              "-o", "/dev/null", "-"], input=source, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
        assert frame is not None and frame.groups() == ("0", "0", "0"), run.stderr
