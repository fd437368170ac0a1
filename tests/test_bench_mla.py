"""The MLA decode benchmark's table, without a GPU (fagen.bench_mla runs its cases)."""

from fagen.bench_mla import COMPUTE_CASES, MEMORY_CASES, MlaRow, markdown


def test_the_cases_are_the_issue_bars_shapes():
    """Memory-bound: B 1-16, Hq 16, Nq 1, 8k-64k keys; compute-bound: Hq 128, Nq 2, B 64."""
    assert {(b, hq, nq) for b, hq, nq, _ in MEMORY_CASES} == {(1, 16, 1), (4, 16, 1), (16, 16, 1)}
    assert {nk for *_, nk in MEMORY_CASES} == {8192, 32768, 65536}
    assert all((b, hq, nq) == (64, 128, 2) for b, hq, nq, _ in COMPUTE_CASES)


def test_a_timed_row_shows_its_rates_and_an_untimed_one_why():
    timed = MlaRow(4, 16, 1, 32768, 33, 47.7, 3.16, 96.0, 1.7e-3, host_us=9.04)
    failed = MlaRow(1, 16, 1, 8192, 128, error=0.5, note="error 5.00e-01 over 1.00e-02: not timed")
    failed.error = None
    lines = markdown([timed, failed]).splitlines()
    assert lines[2] == "| 4 | 16 | 1 | 32768 | 33 | 47.7 | 3.16 | 96 | 9.0 | 1.7e-03 |"
    assert lines[3] == "| 1 | 16 | 1 | 8192 | 128 | — | — | — | — | error 5.00e-01 over 1.00e-02: not timed |"
