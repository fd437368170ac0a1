"""fagen.padding_runs: the NumPy twin of the padding-runs kernel against the definitions it
stands for, and the kernel's build (GPU runs against the twin: tests/test_gpu_torch.py)."""

import numpy as np
import pytest

from fagen import padding_runs
from fagen.nvcc import _ptxas
from fagen.rendering import padding_runs_name, shared_kernels


def masks(rng):
    """[B, n] masks of every kind the transformers integration meets: full rows, left padding,
    right padding, holes, rows without a token."""
    for _ in range(60):
        b, n = int(rng.integers(1, 9)), int(rng.integers(1, 50))
        starts = rng.integers(0, n + 1, size=b)
        left = (np.arange(n)[None] >= starts[:, None]).astype(np.int64)
        yield left  # left padding (a row of n padding slots has no token)
        yield np.ones((b, n), np.int64)
        yield left[:, ::-1].copy()  # right padding
        holed = left.copy()
        holed[int(rng.integers(0, b)), int(rng.integers(0, n))] ^= 1
        yield holed


def test_runs_flags_and_ranges_follow_their_definitions():
    rng = np.random.default_rng(11)
    seen = set()
    for mask in masks(rng):
        flags, ranges = padding_runs.runs(mask)
        b, n = mask.shape
        rows = [np.flatnonzero(row) for row in mask]
        assert ranges.dtype == np.int32 and ranges.shape == (2, b)
        assert ranges[0].tolist() == [int(r[0]) if len(r) else n for r in rows]
        assert ranges[1].tolist() == [int(r[-1]) + 1 if len(r) else 0 for r in rows]
        assert bool(flags & padding_runs.FULL) == bool(mask.all())
        one_run_to_the_end = all(len(r) and r[-1] == n - 1 and len(r) == r[-1] - r[0] + 1 for r in rows)
        assert bool(flags & padding_runs.LEFT_PADDED) == one_run_to_the_end
        seen.add(flags)
    assert seen == {0, padding_runs.LEFT_PADDED, padding_runs.FULL | padding_runs.LEFT_PADDED}


def test_runs_of_empty_windows_are_full_and_without_a_run():
    assert padding_runs.runs(np.zeros((3, 0), np.int64))[0] == padding_runs.FULL
    flags, ranges = padding_runs.runs(np.zeros((0, 5), np.int64))
    assert flags == padding_runs.FULL | padding_runs.LEFT_PADDED and ranges.shape == (2, 0)


def test_the_batch_flags_are_the_rows_flags_folded():
    rng = np.random.default_rng(12)
    for mask in masks(rng):
        row_flags = [padding_runs.runs(row[None])[0] for row in mask]  # the kernel's flags a row
        assert padding_runs.fold(row_flags) == padding_runs.runs(mask)[0]
    assert padding_runs.fold([]) == padding_runs.runs(np.zeros((0, 5), np.int64))[0]


def test_runs_reads_any_nonzero_as_a_token():
    mask = np.array([[0, 2, -1], [0, 0, 1]], np.int32)
    flags, ranges = padding_runs.runs(mask)
    assert flags == padding_runs.LEFT_PADDED and ranges.tolist() == [[1, 2], [3, 3]]


@pytest.mark.parametrize("dtype", list(padding_runs.MASK_TYPES))
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_kernel_builds_clean_for_each_mask_type(dtype, arch):
    name = f"{padding_runs_name(dtype)}.cu"
    status, log = _ptxas(name, shared_kernels()[name], arch)
    assert status == 0, log
    assert "0 bytes spill stores, 0 bytes spill loads" in log and "warning" not in log, log
