"""The head-widths benchmark's rows and table, without a GPU (fagen.bench_head_widths runs them)."""

import json

import pytest

from fagen.bench_head_widths import IMPLS, WidthRow, forward_flops, markdown, read_json


def test_flops_count_both_widths_and_halve_for_causal():
    """B * N = 16k tokens and H * d_v = 2048: at 192/128 and 4k, 4 sequences of 16 heads."""
    dense = forward_flops(192, 128, 4096, False)
    assert dense == 2 * 4 * 16 * 4096 * 4096 * (192 + 128)
    assert forward_flops(192, 128, 4096, True) == dense / 2


def test_the_table_puts_fagen_over_its_peers_and_says_why_a_cell_is_empty(tmp_path):
    rows = [WidthRow(impl, 192, 128, 4096, True, f, b, 3e-3)
            for impl, f, b in zip(IMPLS, (400.0, 600.0, 500.0, 140.0), (300.0, 400.0, 600.0, 40.0))]
    rows[3].forward_tflops = rows[3].backward_tflops = None
    rows[3].note = "not installed"
    line = markdown(rows)[-1]
    assert line.startswith("| d192/128 N4096 causal | 400 / 300 | 600 / 400 | 500 / 600 | - / - | 0.67x / 0.75x | "
                           "0.80x / 0.50x |"), line
    assert line.endswith("| SDPA efficient: not installed |"), line
    path = tmp_path / "bench_head_widths.json"
    path.write_text(json.dumps({"meta": {"date": "2026-11-29"}, "rows": [r.__dict__ for r in rows]}))
    assert read_json(path)[0] == rows
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a bench_head_widths JSON"):
        read_json(path)


def test_decode_rows_count_the_cache_read_and_sit_under_the_widths_table(tmp_path):
    """Head dim 512 decode: TB/s of K and V (B x Hkv x Nk x 512 x 2 bytes x 2) over the step's
    time; the table after the widths', fagen over SDPA; both kinds of row round-trip the JSON."""
    from fagen.bench_head_widths import DECODE_HEADS, DecodeRow

    mine, peer = DecodeRow("fagen", 4, 32768, 40.0, 2e-3), DecodeRow("sdpa_efficient", 4, 32768, 400.0, 3e-3)
    assert mine.cache_bytes == 4 * DECODE_HEADS[1] * 32768 * 512 * 2 * 2
    assert abs(mine.tbps - mine.cache_bytes / 40e-6 / 1e12) < 1e-9
    width = WidthRow("fagen", 512, 512, 4096, False, 400.0, 280.0, 2e-3)
    lines = markdown([width, mine, peer])
    assert lines.index(next(line for line in lines if line.startswith("### Head dim 512 decode"))) > 4
    assert lines[-1].startswith(f"| 4 | 32768 | 40.0 | {mine.tbps:.2f} | 400.0 | {peer.tbps:.2f} | 10.00x |"), lines[-1]
    path = tmp_path / "bench_head_widths.json"
    path.write_text(json.dumps({"meta": {}, "rows": [r.__dict__ for r in (width, mine, peer)]}))
    assert read_json(path)[0] == [width, mine, peer]


def test_the_header_dates_the_rows_kept_from_earlier_runs():
    """--append keeps other widths' rows: the header says which and when they ran (each table's
    date in meta['runs']), and nothing where every row is the last run's."""
    from fagen.bench_head_widths import markdown

    meta = {"date": "2026-12-01", "gpu": "NVIDIA H200",
            "runs": {"192/128": "2026-12-01", "512/512": "2026-11-30", "decode": "2026-11-29"}}
    header = markdown([], meta)[2]
    assert header.endswith("2026-12-01, NVIDIA H200. Rows from earlier runs: 512/512 2026-11-30, decode 2026-11-29.")
    assert "earlier" not in markdown([], {**meta, "runs": {"192/128": "2026-12-01"}})[2]
