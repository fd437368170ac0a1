"""The paged cache's checks, without a GPU: with validate=True a call that the checks refuse
writes nothing (every value the append and the kernel read is checked before the append's
launch, the page table once), the page table's check is vectorised, a page size of 0 is refused
by name, and new rows the append cannot read 16 bytes at a time are copied to a fresh allocation.

The device is faked: NumPy arrays stand for device arrays, and the launches are recorded."""

import time
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest

from fagen import oracle, sequences, side_inputs
from fagen.device import DeviceTensor

NUM_PAGES, PAGE, HKV, D = 8, 16, 2, 64


class _Device(np.ndarray):
    """A NumPy array standing in for a CuPy one: `.data.ptr` is its address."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)


def _aligned_empty(shape, dtype, offset: int = 0):
    """A C-contiguous array starting `offset` bytes past a 256-byte boundary."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(size + 256 + offset, np.uint8)
    start = -raw.ctypes.data % 256 + offset
    return raw[start:start + size].view(dtype).reshape(shape)


def _tensor(x, what):
    x = np.asarray(x)
    item = x.dtype.itemsize
    return DeviceTensor(x, "cupy", x.ctypes.data, x.shape, tuple(s // item for s in x.strides), str(x.dtype), 0)


@pytest.fixture
def device(monkeypatch):
    """sequences' device layer on NumPy: returns the list of launches (kernel, grid) and the
    number of page table checks."""
    launches, checks = [], []
    fake_cupy = SimpleNamespace(cuda=SimpleNamespace(Device=lambda device: nullcontext()), int32=np.int32,
                                array=np.array, ascontiguousarray=np.ascontiguousarray)
    monkeypatch.setattr(sequences, "cupy", fake_cupy)
    monkeypatch.setattr(sequences, "as_device_tensor", _tensor)
    monkeypatch.setattr(sequences, "stream_for", lambda t: nullcontext())
    monkeypatch.setattr(sequences, "_host", np.asarray)
    monkeypatch.setattr(sequences, "_index_array",
                        lambda x, what, device, shape: np.ascontiguousarray(x, np.int32).view(_Device))
    monkeypatch.setattr(sequences, "zeros_like", lambda ref, shape, dtype: np.zeros(shape, dtype))
    monkeypatch.setattr(sequences, "shared_function",
                        lambda name, device: lambda grid, block, args: launches.append((name, grid)))
    monkeypatch.setattr(sequences, "batch_spec", lambda batch, **kw: "spec")
    monkeypatch.setattr(sequences, "run", lambda batch, spec, **kw: (launches.append(("attention", None)), None))
    checked = side_inputs.check_pages

    def check_pages(*args):
        checks.append(args)
        return checked(*args)
    monkeypatch.setattr(sequences, "check_pages", check_pages)
    return SimpleNamespace(launches=launches, checks=checks)


def _cache(rng, page=PAGE):
    caches = [_aligned_empty((NUM_PAGES, page, HKV, D), np.float16) for _ in range(2)]
    for c in caches:
        c[...] = rng.standard_normal(c.shape)
    return caches


def _new(rng, shape):
    x = _aligned_empty(shape, np.float16)
    x[...] = rng.standard_normal(shape)
    return x


def _table(rng, b, width=4):
    return rng.permutation(NUM_PAGES)[:b * width].reshape(b, width).astype(np.int32)


def test_a_checked_append_refuses_a_negative_cache_length_before_writing(device):
    """cache_seqlens = -3 with 5 new tokens: the new length 2 fits the table, but tokens 0-2 would
    be dropped and 3-4 written into slots 0-1."""
    rng = np.random.default_rng()
    k_cache, v_cache = _cache(rng)
    k, v = _new(rng, (2, HKV, 5, D)), _new(rng, (2, HKV, 5, D))
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = -3: must be >= 0"):
        sequences.append_kv(k_cache, v_cache, _table(rng, 2, 2), np.array([4, -3]), k, v)
    assert device.launches == []
    sequences.append_kv(k_cache, v_cache, _table(rng, 2, 2), np.array([4, 3]), k, v)
    assert [name for name, _ in device.launches] == [sequences.append_kv_name()]


def test_a_checked_append_refuses_cu_seqlens_past_the_new_rows_before_writing(device):
    """cu_seqlens_q = [0, 2, 5] with k holding 3 rows: refused against k's rows, nothing launched."""
    rng = np.random.default_rng()
    k_cache, v_cache = _cache(rng)
    k, v = _new(rng, (3, HKV, D)), _new(rng, (3, HKV, D))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 5, but k has 3 rows"):
        sequences.append_kv(k_cache, v_cache, _table(rng, 2, 2), np.array([4, 3]), k, v,
                            cu_seqlens_q=np.array([0, 2, 5]))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[2\] = 1: cu_seqlens_q must be non-decreasing"):
        sequences.append_kv(k_cache, v_cache, _table(rng, 2, 2), np.array([4, 3]), k, v,
                            cu_seqlens_q=np.array([0, 2, 1]))
    assert device.launches == []


def test_attention_with_kvcache_checks_the_whole_call_once_before_the_append(device):
    """q's cu_seqlens and max_seqlen_q are refused before the append writes; a good call checks
    the page table once (against the lengths after the append), then appends, then attends."""
    rng = np.random.default_rng()
    k_cache, v_cache = _cache(rng)
    q = _new(rng, (5, 4, D))
    k, v = _new(rng, (5, HKV, D)), _new(rng, (5, HKV, D))
    table, seqlens, cu = _table(rng, 2), np.array([7, 20], np.int32), np.array([0, 2, 5], np.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_q = 2, but sequence 1 has 3 rows"):
        sequences.attention_with_kvcache(q, k_cache, v_cache, seqlens, table, k=k, v=v, cu_seqlens_q=cu,
                                         max_seqlen_q=2)
    assert device.launches == []
    table[1, 1] = NUM_PAGES  # sequence 1's keys 16..22 after the append: the page is not the cache's
    with pytest.raises(ValueError, match=r"page_table\[1, 1\] = 8: not a page of the cache"):
        sequences.attention_with_kvcache(q, k_cache, v_cache, seqlens, table, k=k, v=v, cu_seqlens_q=cu,
                                         max_seqlen_q=3)
    assert device.launches == []
    table[1, 1] = rng.integers(NUM_PAGES)
    device.checks.clear()
    sequences.attention_with_kvcache(q, k_cache, v_cache, seqlens, table, k=k, v=v, cu_seqlens_q=cu, max_seqlen_q=3)
    assert [name for name, _ in device.launches] == [sequences.append_kv_name(), "attention"]
    assert len(device.checks) == 1 and list(device.checks[0][1]) == [9, 23]


def test_page_size_zero_is_refused_by_name(device):
    rng = np.random.default_rng()
    table, lengths = np.zeros((2, 3), np.int32), np.zeros(2, np.int32)
    with pytest.raises(ValueError, match=r"page_size = 0 \(k_cache.shape\[1\]\): must be >= 1"):
        side_inputs.check_pages(table, lengths, 4, 0)
    cache = rng.standard_normal((4, 0, 2, 16))
    with pytest.raises(ValueError, match=r"page_size = 0 \(k_cache.shape\[1\]\): must be >= 1"):
        oracle.attention_paged(rng.standard_normal((2, 2, 1, 16)), cache, cache, table, lengths)
    k_cache, v_cache = _cache(rng, page=0)
    k = _new(rng, (2, HKV, 0, D))
    with pytest.raises(ValueError, match=r"page_size = 0 \(k_cache.shape\[1\]\): must be >= 1"):
        sequences.append_kv(k_cache, v_cache, table, lengths, k, k, validate=False)
    assert device.launches == []


def _first_refusal_reference(table, lengths, num_pages, page_size):
    """check_pages' rule as a plain loop over the sequences, each one's length before its pages:
    ("length", b) or ("page", b, i) of the first value refused, None where none is."""
    for b, n in enumerate(int(n) for n in lengths):
        if not 0 <= n <= table.shape[1] * page_size:
            return "length", b
        for i in range(-(-n // page_size)):
            if not 0 <= table[b, i] < num_pages:
                return "page", b, i
    return None


@pytest.mark.parametrize("trial", range(40))
def test_the_page_check_refuses_the_first_bad_value_as_a_loop_would(trial):
    rng = np.random.default_rng()
    b, width, num_pages, page_size = rng.integers(1, 6), rng.integers(1, 6), rng.integers(1, 9), rng.integers(1, 5)
    table = rng.integers(-2, num_pages + 2, (b, width)).astype(np.int32)
    lengths = rng.integers(-2, width * page_size + 3, b).astype(np.int32)
    first = _first_refusal_reference(table, lengths, num_pages, page_size)
    if first is None:
        side_inputs.check_pages(table, lengths, num_pages, page_size)
        return
    with pytest.raises(ValueError) as refused:
        side_inputs.check_pages(table, lengths, num_pages, page_size)
    if first[0] == "length":
        row = first[1]
        assert str(refused.value) == (
            f"cache_seqlens[{row}] = {lengths[row]}: must be in 0..{width * page_size} (page_table's {width} pages "
            f"of {page_size}); widen page_table or shorten the sequence")
        return
    _, row, col = first
    keys = f"{col * page_size}..{min(int(lengths[row]), (col + 1) * page_size) - 1}"
    assert str(refused.value) == (
        f"page_table[{row}, {col}] = {table[row, col]}: not a page of the cache (0..{num_pages - 1}); sequence {row} "
        f"reads it for keys {keys}, so point it at one of the cache's pages, 0..{num_pages - 1}")


def test_the_page_check_of_a_large_table_takes_milliseconds():
    """B = 256 sequences x 2048 pages, checked twice a decode step before: a Python loop over the
    table took 20-40 ms; NumPy takes about 1. The bound sits between the two with room for a
    loaded machine (CI's two cores beside the other worker's nvcc runs read 8.5 ms at best of 5)."""
    rng = np.random.default_rng()
    table = rng.integers(0, 100_000, (256, 2048)).astype(np.int32)
    lengths = rng.integers(0, 2048 * 16 + 1, 256).astype(np.int32)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        side_inputs.check_pages(table, lengths, 100_000, 16)
        times.append(time.perf_counter() - start)
    assert min(times) < 0.015, times


def test_contiguous_but_misaligned_new_rows_are_copied_to_an_aligned_allocation(device):
    """k, v contiguous but starting 2 bytes past a 16-byte boundary: the append kernel loads 16
    bytes at a time, so it reads a fresh, aligned copy (a contiguous copy of a contiguous
    tensor is the tensor itself)."""
    rng = np.random.default_rng()
    x = _aligned_empty((2, HKV, 5, D), np.float16, offset=2)
    x[...] = rng.standard_normal(x.shape)
    t = _tensor(x, "k")
    assert t.ptr % 16 == 2 and x.flags.c_contiguous
    got = sequences._aligned(x, t, 2)
    assert got.ptr % 16 == 0 and got.ptr != t.ptr
    np.testing.assert_array_equal(got.obj, x)
    aligned = _aligned_empty((2, HKV, 5, D), np.float16)
    assert sequences._aligned(aligned, _tensor(aligned, "k"), 2).ptr == aligned.ctypes.data  # no copy needed
