"""The FP8 benchmark's cases, rows and table, without a GPU (fagen.bench_fp8 runs them)."""

import json

from fagen import bench_fp8
from fagen.bench_fp8 import IMPLS, Fp8Row, cases, markdown, read_json


def test_the_cases_cover_dense_and_causal_plain_and_outliers_at_4k_and_16k():
    got = cases()
    assert {(c.n, c.causal, c.activations) for c in got} == {
        (n, causal, act) for n in (4096, 16384) for causal in (False, True) for act in ("plain", "outliers")}
    assert all(c.batch * c.n == 16384 and c.heads * c.head_dim == 2048 for c in got)
    dense, causal = (next(c for c in got if c.n == 4096 and c.causal is x) for x in (False, True))
    assert dense.flops == 2 * causal.flops == 4.0 * 4 * 16 * 4096 * 4096 * 128


def test_the_table_puts_fagen_over_cudnn_and_says_why_a_cell_is_empty(tmp_path):
    case = cases()[0]
    rows = [Fp8Row(case.key, impl, case.head_dim, case.n, case.causal, case.activations, ms=1.0, tflops=t, error=e)
            for impl, t, e in zip(IMPLS, (900.0, 1000.0, 700.0), (3e-2, 4e-2, 3e-3))]
    rows[1].tflops, rows[1].note = None, "cudnn-frontend not importable"
    line = markdown(rows)[-1]
    assert "| 900 | - | - | 700 | 3.0e-02 | 4.0e-02 | - | - | - | cudnn_fp8: cudnn-frontend not importable |" in line
    rows[1].tflops = 1000.0
    assert "| 900 | 1000 | 0.90x | 700 |" in markdown(rows)[-1]
    path = tmp_path / "bench_fp8.json"
    path.write_text(json.dumps({"meta": {"date": "2026-11-29"}, "rows": [r.__dict__ for r in rows]}))
    assert read_json(path)[0] == rows


def test_the_kv_table_reads_tokens_a_second_and_bytes_and_survives_json(tmp_path):
    """A KV cache row: the FP8 step's speed over the bfloat16 one's, each cache's TB/s (bytes of K
    and V a step over its device time), kept in the JSON beside the forward's rows."""
    from fagen.bench_fp8 import KV_CASES, KvRow

    row = KvRow("kv-b8-n32768", 8, 32768, bf16_us=240.0, fp8_us=150.0, error=1.1e-3, read_us=125.0)
    assert abs(row.tbps(False) - 2 * 8 * 8 * 32768 * 128 * 2 / 240e-6 / 1e12) < 1e-9
    assert abs(row.tbps(True) - 2 * 8 * 8 * 32768 * 128 / 150e-6 / 1e12) < 1e-9
    line = markdown([row])[-1]
    # the plain read's time and the bf16 step over it: 240 / 125
    assert line.startswith("| 128 | 8 | 32768 | 240.0 |") and "| 1.60x | 125.0 | 1.92x | 1.1e-03 | - | - |" in line
    # e4m3 q too: its step's time and error beside the cache's
    with_q = KvRow("kv-b8-n32768", 8, 32768, bf16_us=240.0, fp8_us=150.0, error=1.1e-3, read_us=125.0,
                   fp8_q_us=151.5, fp8_q_error=2.2e-2)
    assert "| 1.1e-03 | 151.5 | 2.2e-02 |" in markdown([with_q])[-1]
    # another head width: its bytes (Hkv 8 heads of 256) and its column
    wide = KvRow("kv-b8-n32768-d256", 8, 32768, bf16_us=500.0, fp8_us=250.0, head_dim=256)
    assert abs(wide.tbps(True) - 2 * 8 * 8 * 32768 * 256 / 250e-6 / 1e12) < 1e-9
    assert markdown([wide])[-1].startswith("| 256 | 8 | 32768 |")
    # a row from before the plain read was measured shows none
    assert "| 1.60x | - | - | 1.1e-03 |" in markdown([KvRow("kv-b8-n32768", 8, 32768, 240.0, 150.0, 1.1e-3)])[-1]
    # a --kv-only run dates its own section; the kept ones keep the run's date
    meta = {"date": "2026-11-29", "kv_date": "2026-11-30", "gpu": "NVIDIA H200"}
    assert "2026-11-30, NVIDIA H200." in markdown([row], meta)[2]
    assert "2026-11-29, NVIDIA H200." in markdown([Fp8Row("d128-n4096-dense-plain", "fagen_fp8", 128, 4096, False,
                                                          "plain", 1.0, 900.0)], meta)[2]
    assert {(c.batch, c.keys) for c in KV_CASES} >= {(1, 32768), (32, 131072)}
    assert {c.head_dim for c in KV_CASES} == {64, 128, 256} and len({c.key for c in KV_CASES}) == len(KV_CASES)
    path = tmp_path / "bench_fp8.json"
    path.write_text(json.dumps({"meta": {}, "rows": [], "kv_rows": [row.__dict__]}))
    assert read_json(path)[0] == [row]


def test_the_backward_table_puts_fp8_over_bf16_and_keeps_a_wrong_case_untimed(tmp_path):
    """A backward row: the FP8 backward's TFLOP/s over the bfloat16 one's, both errors; a row the
    check refused shows no speed, only why; kept in the JSON beside the other sections."""
    from fagen.bench_fp8 import BACKWARD_CASES, BackwardRow

    assert {(c.n, c.causal, c.head_dim) for c in BACKWARD_CASES} == {(n, causal, 128) for n in (4096, 16384)
                                                                      for causal in (False, True)}
    good = BackwardRow("d128-n16384-dense-plain", 16384, False, fp8_tflops=650.0, bf16_tflops=500.0, error=4.1e-2,
                       bf16_error=3.0e-3)
    wrong = BackwardRow("d128-n4096-causal-plain", 4096, True, error=0.9, bf16_error=3.0e-3,
                        note="WRONG, not timed: FP8 gradients 9.0e-01 against exact (check 0.1)")
    table = markdown([good, wrong])
    assert table[0] == "## FP8 backward: fagen e4m3 against fagen bfloat16"
    assert table[-2] == "| 16384 | none | 650 | 500 | 1.30x | 4.1e-02 | 3.0e-03 |  |"
    assert table[-1].startswith("| 4096 | causal | - | - | - | 9.0e-01 | 3.0e-03 | WRONG, not timed")
    path = tmp_path / "bench_fp8.json"
    path.write_text(json.dumps({"meta": {}, "rows": [], "backward_rows": [good.__dict__, wrong.__dict__]}))
    assert read_json(path)[0] == [good, wrong]


def test_the_error_table_puts_incoherent_over_plain_and_survives_json(tmp_path):
    """An error-report row: FP8's error against the unquantized attention, plain and incoherent,
    their ratio, bfloat16's beside; dated by its own run; kept in the JSON beside the other sections."""
    from fagen.bench_fp8 import ERROR_CASES, ErrorRow

    assert {(c.head_dim, c.activations) for c in ERROR_CASES} == {(128, "plain"), (128, "outliers")}
    row = ErrorRow("d128-n4096-dense-outliers", 4096, False, "outliers", fp8_error=8.0e-2, incoherent_error=4.0e-2,
                   bf16_error=3.0e-3)
    table = markdown([row], {"date": "2026-11-29", "errors_date": "2026-11-30", "gpu": "NVIDIA H200"})
    assert table[0] == "## FP8 error against the unquantized attention: incoherent processing"
    assert "2026-11-30, NVIDIA H200." in table[2]
    assert table[-1] == "| 4096 | none | outliers | 8.0e-02 | 4.0e-02 | 0.50x | 3.0e-03 |  |"
    path = tmp_path / "bench_fp8.json"
    path.write_text(json.dumps({"meta": {}, "rows": [], "errors_rows": [row.__dict__]}))
    assert read_json(path)[0] == [row]


def test_the_chunk_table_puts_the_fp8_cache_over_the_bf16_one_and_survives_json(tmp_path):
    """A chunked-prefill row: each cache's TFLOP/s (causal queries after the cached keys, bottom
    right: 4 B Hq Nq d (Nk - Nq / 2)), e4m3 over bfloat16, the layout named; a case refused for
    its error shows no speed; the rows come back from the JSON beside the other sections'."""
    from fagen.bench_fp8 import CHUNK_CASES, ChunkCase, ChunkRow

    case = ChunkCase(4, 512, 4096, 128, paged=True)
    assert case.key == "chunk-b4-q512-n4096-d128-paged" and case.flops == 4.0 * 4 * 32 * 512 * 128 * (4096 - 256)
    row = ChunkRow(case.key, 128, 4, 512, 4096, True, bf16_tflops=281.0, fp8_tflops=192.0, error=2.5e-3)
    line = markdown([row])[-1]
    assert line.startswith("| 128 | 4 | 512 | 4096 | paged | 281 | 192 | 0.68x | 2.5e-03 |")
    refused = ChunkRow("chunk-b1-q2048-n10240-d64", 64, 1, 2048, 10240, False, error=0.3, note="off")
    assert "| padded | - | - | - | 3.0e-01 | off |" in markdown([refused])[-1]
    assert {c.paged for c in CHUNK_CASES} == {False, True} and {c.head_dim for c in CHUNK_CASES} == {64, 128}
    assert all(c.keys % c.page_size == 0 and c.queries <= c.keys for c in CHUNK_CASES)
    path = tmp_path / "bench_fp8.json"
    path.write_text(json.dumps({"meta": {}, "rows": [], "chunk_rows": [row.__dict__]}))
    assert read_json(path)[0] == [row]


def test_the_forward_table_sets_fagen_s_e4m3_output_beside_cudnn_s():
    """Each case a line: fagen FP8 (bfloat16 out) and its e4m3-out run, each over cuDNN FP8 (whose
    sm90 build writes e4m3), with their errors; a run from before the e4m3 column shows "-" there."""
    from fagen.bench_fp8 import Fp8Row, markdown

    def row(impl, tflops, error):
        return Fp8Row("d128-n4096-dense-plain", impl, 128, 4096, False, "plain", 1.0, tflops, error)

    rows = [row("fagen_fp8", 880.0, 2.5e-2), row("cudnn_fp8", 1000.0, 3.7e-2), row("fagen_bf16", 690.0, 4e-3),
            row("fagen_fp8_e4m3", 875.0, 3.6e-2)]
    lines = markdown(rows)
    assert "| fagen FP8, e4m3 out | e4m3 out / cuDNN | its error |" in lines[4]
    assert lines[-1] == ("| 128 | 4096 | none | plain | 880 | 1000 | 0.88x | 690 | 2.5e-02 | 3.7e-02 | 875 | 0.88x | "
                         "3.6e-02 |  |")
    assert markdown(rows[:3])[-1].endswith("| 3.7e-02 | - | - | - |  |")


def test_rotated_ms_warms_each_arm_before_it_is_timed_and_keeps_its_best(monkeypatch):
    """A round an arm, each starting one further on; every timing after the arm's own warm-up;
    an arm's reading is its best round (an arm timed right after another read 6-10% slow)."""
    events = []

    def fake_time_ms(fn):
        arm = fn()
        slow = events[-2:-1] == [("time", "a")] and arm == "b"  # b right after a's timing: slow
        events.append(("time", arm))
        return (2.0 if slow else 1.0) + {"a": 0.0, "b": 0.5, "c": 0.25}[arm]

    monkeypatch.setattr(bench_fp8, "time_ms", fake_time_ms)
    monkeypatch.setattr(bench_fp8, "warm_for", lambda fn, ms: events.append(("warm", fn())))
    got = bench_fp8.rotated_ms([lambda: "a", lambda: "b", lambda: "c"])
    assert got == [1.0, 1.5, 1.25]
    assert [arm for kind, arm in events if kind == "time"] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    timed_at = [i for i, (kind, _) in enumerate(events) if kind == "time"]
    assert all(events[i - 1] == ("warm", events[i][1]) for i in timed_at)
