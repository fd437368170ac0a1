"""fagen.bench_flex's pure parts without a GPU: its cases, its mods (run on the CPU, and traced
by fagen.flex where fagen takes them), the kept pairs it counts FLOPs by, and its table."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fagen import bench_flex, bench_flex_tables, flex  # noqa: E402


def test_every_mod_is_benchmarked_at_both_head_dims_and_lengths():
    names = set(bench_flex.mods(4096, 16, device="cpu"))
    assert names == set(bench_flex.MOD_NAMES)
    cases = bench_flex.cases()
    assert {(c.mod, c.head_dim, c.n) for c in cases} == {(m, d, n) for m in names for d in (64, 128)
                                                         for n in (4096, 16384)}
    assert all(c.batch * c.n == 16384 and c.heads * c.head_dim == 2048 for c in cases)
    assert {c.mod for c in bench_flex.cases(quick=True)} < names


def test_fagen_takes_every_mod_and_the_masks_build():
    n, heads = 256, 4
    for name, (score_mod, mask_mod) in bench_flex.mods(n, heads, device="cpu").items():
        if score_mod is not None:
            traced = flex.trace_score_mod(score_mod)
            tables = name in ("relative_bias_table", "relative_bias_learned", "t5_bias")  # a table, a kernel input
            assert len(traced.captured) == tables, name
            assert len(bench_flex.learned(score_mod)) == (name == "relative_bias_learned"), name  # its gradient timed
            flex.check_captured(traced, dict(b=4, h=heads, q_idx=n, kv_idx=n), score_mod)
        if mask_mod is not None:
            mask_heads = heads if name in bench_flex.PER_HEAD_MASKS else None
            bm = flex.create_block_mask(mask_mod, None, mask_heads, n, n, device="cpu", BLOCK_SIZE=64)
            q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
            for h in range(heads):
                want = mask_mod(torch.tensor(0), torch.tensor(h), q, k).numpy()
                np.testing.assert_array_equal(bm.to_dense()[0, h if mask_heads else 0], want, err_msg=name)
            assert (mask_heads is None) == all(np.array_equal(mask_mod(torch.tensor(0), torch.tensor(h), q, k),
                                                              mask_mod(torch.tensor(0), torch.tensor(0), q, k))
                                               for h in range(heads)), name  # per head exactly where it differs


def test_kept_pairs_count_the_mask_by_head():
    n = 300
    causal = lambda b, h, q, k: q >= k  # noqa: E731
    per_head = lambda b, h, q, k: q - k <= h  # noqa: E731
    assert bench_flex.kept_pairs(None, n, 3, device="cpu") == 3 * n * n
    assert bench_flex.kept_pairs(causal, n, 2, device="cpu", rows=7) == 2 * n * (n + 1) // 2
    assert bench_flex.kept_pairs(per_head, n, 2, device="cpu", rows=64) == \
        sum(int((np.arange(n)[:, None] - np.arange(n)[None] <= h).sum()) for h in range(2))


def test_the_table_gives_ratios_and_says_why_a_row_was_not_timed(tmp_path):
    """The section BENCHMARKS.md takes from bench_flex.json (fagen bench redraws it beside the
    others): a case a line, the ratios, and why a row has no time."""
    from dataclasses import asdict

    from fagen import bench

    def row(case, mod, impl, fwd=None, fb=None, note=""):
        return bench_flex_tables.FlexRow(case, mod, impl, 128, 4096, 4, 16, fwd_tflops=fwd, fwd_bwd_tflops=fb,
                                         note=note)

    rows = [row("a", "softcap", "fagen", 600.0, 450.0), row("a", "softcap", "flex", 400.0, 300.0),
            row("b", "relative_bias_table", "fagen", note="TraceError: captured tensor"),
            row("b", "relative_bias_table", "flex", 300.0, 200.0)]
    lines = bench_flex_tables.markdown(rows, {"date": "2026-11-29"})
    table = lines[lines.index(next(line for line in lines if line.startswith("| mod"))):]
    assert table[2] == "| softcap | 128 | 4096 | 600 | 400 | 1.50x | 450 | 300 | 1.50x |  |"
    assert table[3] == ("| relative_bias_table | 128 | 4096 | n/a | 300 | n/a | n/a | 200 | n/a | "
                        "fagen: TraceError: captured tensor |")
    (tmp_path / bench_flex_tables.JSON).write_text(json.dumps({"meta": {}, "rows": [asdict(r) for r in rows]}))
    assert bench_flex_tables.read_json(tmp_path / bench_flex_tables.JSON)[0] == rows
    flex_part = bench._sibling(tmp_path / bench_flex_tables.JSON, bench_flex_tables.read_json)
    text = bench.markdown([], {}, [], flex=flex_part)
    assert "## FlexAttention's API" in text and table[2] in text
    with pytest.raises(ValueError, match="not a bench_flex.json"):
        bench_flex_tables.read_json(tmp_path / "missing.json")
