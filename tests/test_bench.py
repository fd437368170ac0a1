"""fagen.bench without a GPU: FLOP counting, the case list, documents, the writers (JSON, CSV,
BENCHMARKS.md, plots) on synthetic rows, and `fagen bench --from-json`."""

from __future__ import annotations

import csv
import itertools
import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fagen import bench, bench_cases, bench_serving, variants
from fagen.bench import Case, Row
from fagen.check import attention_flops
from fagen.cli import main
from fagen.mask_kinds import predicate as static_predicate
from fagen.masks import dense_from_predicate, documents_of_lengths
from fagen.spec import Mask

PNG = b"\x89PNG\r\n\x1a\n"
ROW_FIELDS = ["case", "kernel", "impl", "dtype", "head_dim", "n", "batch", "heads", "causal", "mask",
              "ms", "tflops", "note"]


# ---- FLOP counting ---------------------------------------------------------------------------


@pytest.mark.parametrize("args, expected", [
    ((1, 1, 1, 1, 1, False), 4.0),
    ((1, 1, 2, 3, 5, False), 120.0),  # 4 * 2 * 3 * 5
    ((3, 5, 7, 11, 64, False), 295_680.0),  # Nq != Nk
    ((2, 16, 1024, 1024, 128, False), 17_179_869_184.0),  # 4 * 2 * 16 * 2^20 * 128 = 2^34
    ((2, 16, 1024, 1024, 128, True), 8_589_934_592.0),  # halved
    ((8, 8, 2048, 2048, 256, True), 137_438_953_472.0),  # 4 * 64 * 2^22 * 256 / 2 = 2^37
])
def test_attention_flops_by_hand(args, expected):
    assert attention_flops(*args) == expected


def test_causal_is_exactly_half_of_dense():
    for b, h, n, d in [(1, 1, 7, 32), (4, 16, 4096, 128), (1, 8, 16384, 256)]:
        assert attention_flops(b, h, n, n, d, True) * 2 == attention_flops(b, h, n, n, d, False)


def _brute_kept(n: int, mask: str, window: int, prefix: int, lengths: list[int] | None = None) -> int:
    """Kept (q, k) pairs by a double loop over the README's definitions (Nq == Nk, offset 0)."""
    doc = [i for i, length in enumerate(lengths or [n]) for _ in range(length)]
    keep = {
        "dense": lambda q, k: True,
        "causal": lambda q, k: k <= q,
        "sliding_window": lambda q, k: q - window <= k <= q,  # window_left = W, window_right = 0
        "prefix_lm": lambda q, k: k <= q or k < prefix,
        "documents": lambda q, k: doc[q] == doc[k] and k <= q,
    }[mask]
    return sum(keep(q, k) for q in range(n) for k in range(n))


@pytest.fixture
def small_masks(monkeypatch):
    """A window and a prefix that matter at n = 64 (the shipped 1024 would cover it all), where
    the masks read them (fagen.bench_cases)."""
    monkeypatch.setattr(bench_cases, "WINDOW", 8)
    monkeypatch.setattr(bench_cases, "PREFIX", 16)
    return 8, 16


@pytest.mark.parametrize("rows_per_step", [1024, 64, 7, 1])
@pytest.mark.parametrize("mask", ["sliding_window", "prefix_lm", "documents"])
def test_kept_pairs_against_a_dense_count(small_masks, mask, rows_per_step):
    window, prefix = small_masks
    n = 64
    case = Case("float16", 64, n, True, mask)
    lengths = bench.doc_lengths(n)
    expected = _brute_kept(n, mask, window, prefix, lengths)
    assert bench.kept_pairs(case, rows_per_step=rows_per_step) == expected


def test_kept_pairs_closed_forms(small_masks):
    w, p = small_masks
    n = 64
    assert bench.kept_pairs(Case("float16", 64, n, False)) == n * n
    assert bench.kept_pairs(Case("float16", 64, n, True)) == n * (n + 1) // 2
    # row q keeps min(q, W) + 1 keys
    assert bench.kept_pairs(Case("float16", 64, n, True, "sliding_window")) == n * (w + 1) - w * (w + 1) // 2
    # causal, plus the keys k < P above the diagonal: P (P - 1) / 2 of them
    assert bench.kept_pairs(Case("float16", 64, n, True, "prefix_lm")) == n * (n + 1) // 2 + p * (p - 1) // 2
    lengths = bench.doc_lengths(n)
    assert bench.kept_pairs(Case("float16", 64, n, True, "documents")) == sum(x * (x + 1) // 2 for x in lengths)
    assert bench.kept_pairs(Case("float16", 64, n, False, "documents")) == sum(x * x for x in lengths)
    # 8 uniform documents of n / 8: each keeps its own square (non-causal) or triangle
    assert bench.kept_pairs(Case("float16", 64, n, False, "documents", uniform=True)) == 8 * (n // 8) ** 2
    assert bench.kept_pairs(Case("float16", 64, n, True, "documents", uniform=True)) == 8 * (n // 8) * (n // 8 + 1) // 2


def test_uniform_documents_spread_the_remainder():
    assert bench.doc_lengths(4099, 4, uniform=True) == [1025, 1025, 1025, 1024]


def test_sliding_window_wider_than_the_sequence_is_causal():
    n = 64  # the shipped WINDOW (1024) covers every key before the diagonal
    assert bench.kept_pairs(Case("float16", 64, n, True, "sliding_window")) == n * (n + 1) // 2


def _kernel_mask(case: Case) -> Mask:
    """The mask fagen_spec gives the kernel for a masked case (built here without a GPU)."""
    return {"sliding_window": Mask(kind="sliding_window", window_left=bench_cases.WINDOW),
            "documents": Mask(kind="document", causal=case.causal),
            "prefix_lm": Mask(kind="prefix_lm", prefix_len=bench_cases.PREFIX)}[case.mask]


@pytest.mark.parametrize("mask, causal, uniform", [("sliding_window", True, False), ("prefix_lm", True, False),
                                                   ("documents", True, False), ("documents", False, False),
                                                   ("documents", False, True)])
def test_kept_pairs_count_what_the_kernel_mask_keeps(small_masks, mask, causal, uniform):
    """The FLOPs bench credits are the pairs the rendered kernel's mask keeps (fagen.masks)."""
    case = Case("float16", 128, 64, causal, mask, uniform=uniform)
    docs = documents_of_lengths(case.doc_lengths())
    keep = dense_from_predicate(static_predicate(_kernel_mask(case), case.n, case.n, docs), 1, 1, case.n, case.n)
    assert bench.kept_pairs(case) == int(keep.sum())


def test_case_flops_dense_and_causal():
    dense, causal = Case("float16", 64, 64, False), Case("float16", 64, 64, True)
    b, h = 16384 // 64, 2048 // 64
    assert (dense.batch, dense.heads) == (b, h)
    assert bench.case_flops(dense) == attention_flops(b, h, 64, 64, 64, False) == 4.0 * b * h * 64 * 64 * 64
    assert bench.case_flops(dense) == 4.0 * b * h * 64 * bench.kept_pairs(dense)
    assert bench.case_flops(causal) == attention_flops(b, h, 64, 64, 64, True) == bench.case_flops(dense) / 2


@pytest.mark.parametrize("mask", ["sliding_window", "prefix_lm", "documents"])
def test_case_flops_masked_count_kept_pairs(small_masks, mask):
    case = Case("float16", 128, 64, True, mask)
    b, h, d = 256, 16, 128
    kept = bench.kept_pairs(case)
    assert bench.case_flops(case) == 4.0 * b * h * d * kept
    causal_kept = 64 * 65 // 2
    # sliding window and documents keep part of causal; prefix_lm keeps more than causal
    assert (kept > causal_kept) if mask == "prefix_lm" else (0 < kept < causal_kept)
    assert bench.case_flops(case) < bench.case_flops(Case("float16", 128, 64, False))


def test_case_flops_shipped_sliding_window_at_4096():
    case = Case("float16", 128, 4096, True, "sliding_window")
    n, w = 4096, bench.WINDOW
    assert (case.batch, case.heads) == (4, 16)
    assert bench.case_flops(case) == 4.0 * 4 * 16 * 128 * (n * (w + 1) - w * (w + 1) // 2)


# ---- the case list ---------------------------------------------------------------------------


def test_constants_are_the_flashattention_sweep():
    assert (bench.TOKENS, bench.HIDDEN) == (16384, 2048)
    assert bench.DTYPES == ("float16", "bfloat16")
    assert bench.HEAD_DIMS == (64, 128, 256)
    assert bench.LENGTHS == (512, 1024, 2048, 4096, 8192, 16384)
    assert bench.MASKED_LENGTHS == (4096, 16384)
    assert {m for m, _, _ in bench.MASKS} == {"sliding_window", "documents", "prefix_lm"}
    assert bench.MASKED_HEAD_DIMS == (64, 128)


def test_cases_have_every_dense_combination():
    dense = [c for c in bench.cases() if c.mask == "none" and c.modifier == "none"]
    combos = {(c.dtype, c.head_dim, c.n, c.causal) for c in dense}
    expected = set(itertools.product(bench.DTYPES, bench.HEAD_DIMS, bench.LENGTHS, (False, True)))
    assert combos == expected
    assert len(dense) == len(expected) == 2 * 3 * 6 * 2


def test_cases_have_the_masked_cases():
    masked = [c for c in bench.cases() if c.mask != "none"]
    assert {(c.mask, c.n, c.head_dim) for c in masked} == {(m, n, d) for m in ("sliding_window", "documents", "prefix_lm")
                                                           for n in (4096, 16384) for d in (64, 128)}
    # documents in every builder shape the mask bar names: random and uniform lengths, causal and not
    docs = {(c.causal, c.uniform) for c in masked if c.mask == "documents"}
    assert docs == {(True, False), (False, False), (True, True), (False, True)}
    assert len(masked) == 24 and len({c.mask_label for c in masked}) == 6


def test_every_case_has_16k_tokens_and_hidden_2048():
    for c in bench.cases():
        assert c.batch * c.n == 16384, c
        assert c.heads * c.head_dim == 2048, c


def test_case_keys_are_unique_and_readable():
    all_cases = bench.cases()
    keys = [c.key for c in all_cases]
    assert len(set(keys)) == len(keys) == 104
    assert Case("float16", 128, 4096, False).key == "float16-d128-n4096-dense"
    assert Case("bfloat16", 64, 512, True).key == "bfloat16-d64-n512-causal"
    assert Case("float16", 128, 16384, True, "prefix_lm").key == "float16-d128-n16384-prefix_lm"


def test_modifier_cases_are_causal_softcap_and_sinks_beside_fa4(monkeypatch):
    """The score modifiers FlashAttention-4 takes (softcap=, learnable_sink=), on the causal mask:
    their own keys and labels (the masks' table takes them), and the kernel fagen.attention runs
    for each with its side inputs: the sinks a head, float32."""
    from fagen import device

    monkeypatch.setattr(device, "gpu_slug", lambda: "h200")
    modified = [c for c in bench.cases() if c.modifier != "none"]
    assert {(c.modifier, c.head_dim, c.n, c.causal, c.mask) for c in modified} == {
        (m, d, n, True, "none") for m in ("softcap", "sinks") for d in (64, 128) for n in (4096, 16384)}
    case = Case("float16", 128, 4096, True, modifier="softcap")
    assert (case.key, case.mask_label) == ("float16-d128-n4096-causal-softcap", "causal + softcap 30")
    spec, extras = bench.fagen_spec(case)
    assert (spec.mask.kind, spec.score_mod.softcap, spec.score_mod.sinks, extras) == ("causal", 30.0, False, {})
    sinks = Case("float16", 64, 16384, True, modifier="sinks")
    spec, extras = bench.fagen_spec(sinks)
    assert (spec.mask.kind, spec.score_mod.softcap, spec.score_mod.sinks) == ("causal", None, True)
    assert extras["sinks"].dtype == np.float32 and extras["sinks"].shape == (sinks.heads,)
    assert np.array_equal(extras["sinks"], bench.sink_logits(sinks.heads))  # the same values FA4 is given


def test_quick_cases_are_a_small_subset_with_a_mask():
    quick = bench.cases(quick=True)
    assert 0 < len(quick) <= 6
    assert set(quick) <= set(bench.cases())
    assert len({c.key for c in quick}) == len(quick)
    assert any(c.mask != "none" for c in quick)
    assert {c.causal for c in quick if c.mask == "none"} == {False, True}


# ---- documents -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [64, 4096, 16384])
def test_doc_lengths_split_n_into_n_docs(n):
    lengths = bench.doc_lengths(n)
    assert len(lengths) == bench.N_DOCS == 8
    assert sum(lengths) == n
    assert all(isinstance(x, int) and x >= 1 for x in lengths)


def test_doc_lengths_are_deterministic_for_a_seed():
    assert bench.doc_lengths(4096) == bench.doc_lengths(4096) == bench.doc_lengths(4096, seed=0)
    assert bench.doc_lengths(4096, seed=1) == bench.doc_lengths(4096, seed=1)
    assert bench.doc_lengths(4096, seed=1) != bench.doc_lengths(4096, seed=0)


def test_doc_lengths_other_counts():
    assert len(bench.doc_lengths(100, docs=3)) == 3 and sum(bench.doc_lengths(100, docs=3)) == 100
    assert bench.doc_lengths(10, docs=10) == [1] * 10


# ---- writers on synthetic rows ---------------------------------------------------------------

HEAD_DIMS, DTYPES, NS = (64, 128), ("float16", "bfloat16"), (1024, 4096)
NOTED = Case("bfloat16", 128, 4096, True).key  # its cuDNN row failed
NOTE = "RuntimeError: No available kernel"
NO_FLEX = Case("float16", 128, 16384, True, "prefix_lm").key  # its Flex row is missing altogether


def _row(case: Case, impl: str, tflops: float | None, note: str = "") -> Row:
    kernel = f"attn_{case.dtype}_d{case.head_dim}" if impl == "fagen" else impl
    ms = None if tflops is None else 1.5
    return Row(case.key, kernel, impl, case.dtype, case.head_dim, case.n, case.batch, case.heads, case.causal,
               case.mask, ms, tflops, note)


def _dense_numbers(i: int) -> dict[str, float]:
    """fagen, FA2 and cuDNN TFLOP/s of the i-th dense case: fagen / FA2 = 1 + i / 20."""
    return {"fagen": 200.0 + 10 * i, "sdpa_flash": 200.0, "sdpa_cudnn": 300.0 - i}


DENSE_CASES = [Case(dt, d, n, c) for d in HEAD_DIMS for dt in DTYPES for c in (False, True) for n in NS]
MASKED_NUMBERS = {  # (fagen, flex) TFLOP/s
    Case("float16", 128, 4096, True, "sliding_window"): (150.0, 100.0),
    Case("float16", 128, 4096, True, "documents"): (90.0, 120.0),
    Case("float16", 128, 4096, True, "prefix_lm"): (210.0, 140.0),
    Case("float16", 128, 16384, True, "prefix_lm"): (250.0, None),
}


@pytest.fixture
def rows() -> list[Row]:
    out = []
    for i, case in enumerate(DENSE_CASES):
        for impl, tf in _dense_numbers(i).items():
            if case.key == NOTED and impl == "sdpa_cudnn":
                out.append(_row(case, impl, None, NOTE))
            else:
                out.append(_row(case, impl, tf))
    for case, (fagen_tf, flex_tf) in MASKED_NUMBERS.items():
        out.append(_row(case, "fagen", fagen_tf))
        if flex_tf is not None:
            out.append(_row(case, "flex", flex_tf))
    return out


META = {"gpu": "NVIDIA H200", "date": "2025-01-01", "torch": "2.9.0", "mode": "full", "cases": "20"}


def test_synthetic_rows_are_what_the_tests_assume(rows):
    assert len(rows) == 16 * 3 + 4 + 3
    assert len({r.case for r in rows}) == 20
    assert [r for r in rows if r.tflops is None] == [r for r in rows if r.note]


def test_json_round_trip(rows, tmp_path):
    path = tmp_path / "bench.json"
    bench.write_json(rows, path, META)
    back, meta = bench.read_json(path)
    assert back == rows
    assert meta == META
    data = json.loads(path.read_text())
    assert set(data) == {"meta", "rows"}
    assert list(data["rows"][0]) == ROW_FIELDS
    noted = [r for r in data["rows"] if r["note"]]
    assert len(noted) == 1 and noted[0]["tflops"] is None and noted[0]["ms"] is None


def test_csv_has_every_field_and_a_line_per_row(rows, tmp_path):
    path = tmp_path / "bench.csv"
    bench.write_csv(rows, path)
    lines = path.read_text().splitlines()
    assert lines[0].split(",") == ROW_FIELDS == list(Row.__dataclass_fields__)
    assert len(lines) == 1 + len(rows)
    with open(path, newline="") as f:
        read = list(csv.DictReader(f))
    assert [r["case"] for r in read] == [r.case for r in rows]
    assert [r["impl"] for r in read] == [r.impl for r in rows]
    assert [float(r["tflops"]) if r["tflops"] else None for r in read] == [r.tflops for r in rows]
    noted = [r for r in read if r["note"]]
    assert len(noted) == 1 and noted[0]["note"] == NOTE and noted[0]["tflops"] == "" and noted[0]["ms"] == ""


def _section(text: str, title: str) -> list[str]:
    """The table lines (starting with '| ' and not the header) of a '## title' section."""
    lines = text.splitlines()
    start = lines.index(title)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    table = [ln for ln in lines[start + 1:end] if ln.startswith("| ")]
    return table[1:]  # drop the column names; the '| --- |' line starts with '| -'


def test_markdown_has_a_section_per_head_dim(rows):
    text = bench.markdown(rows, META, [])
    headers = [ln for ln in text.splitlines() if ln.startswith("## head_dim")]
    assert headers == ["## head_dim 64", "## head_dim 128"]
    for d in HEAD_DIMS:
        body = [ln for ln in _section(text, f"## head_dim {d}") if not ln.startswith("| -")]
        assert len(body) == 8  # 2 dtypes x causal/non-causal x 2 Ns
    assert "- gpu: NVIDIA H200" in text and "- mode: full" in text


def test_markdown_dense_lines_and_fagen_over_fa2(rows):
    text = bench.markdown(rows, META, [])
    for i, case in enumerate(DENSE_CASES):
        num = _dense_numbers(i)
        cudnn = "n/a" if case.key == NOTED else f"{num['sdpa_cudnn']:.0f}"
        ratio = f"{num['fagen'] / num['sdpa_flash']:.2f}x"
        line = (f"| {case.dtype} | {case.n} | {'causal' if case.causal else 'none'} | {num['fagen']:.0f} | 200 | "
                f"{cudnn} | n/a | n/a | {ratio} | n/a |")
        assert line in _section(text, f"## head_dim {case.head_dim}"), line
    # by hand: d64 float16 dense 1024 is case 0 (200 / 200), bfloat16 dense 4096 is case 5 (250 / 200)
    assert DENSE_CASES[5] == Case("bfloat16", 64, 4096, False)
    d64 = _section(text, "## head_dim 64")
    assert "| float16 | 1024 | none | 200 | 200 | 300 | n/a | n/a | 1.00x | n/a |" in d64
    assert "| bfloat16 | 4096 | none | 250 | 200 | 295 | n/a | n/a | 1.25x | n/a |" in d64


def test_markdown_dense_rows_are_sorted_by_dtype_causal_n(rows):
    text = bench.markdown(rows, META, [])
    body = [ln for ln in _section(text, "## head_dim 64") if not ln.startswith("| -")]
    keys = [(ln.split(" | ")[0][2:], ln.split(" | ")[2], int(ln.split(" | ")[1])) for ln in body]
    assert keys == [("bfloat16", "none", 1024), ("bfloat16", "none", 4096),
                    ("bfloat16", "causal", 1024), ("bfloat16", "causal", 4096),
                    ("float16", "none", 1024), ("float16", "none", 4096),
                    ("float16", "causal", 1024), ("float16", "causal", 4096)]


def test_markdown_masks_table_with_fagen_over_flex(rows):
    text = bench.markdown(rows, META, [])
    masks = [ln for ln in _section(text, "## Masks (static-mask kernels, kept-work TFLOP/s)")
             if not ln.startswith("| -")]
    assert masks == [
        "| float16 | 128 | 4096 | documents | 90 | 120 | 0.75x | n/a | n/a |",
        "| float16 | 128 | 4096 | prefix_lm | 210 | 140 | 1.50x | n/a | n/a |",
        "| float16 | 128 | 16384 | prefix_lm | 250 | n/a | n/a | n/a | n/a |",  # no Flex row: n/a, no ratio
        "| float16 | 128 | 4096 | sliding_window | 150 | 100 | 1.50x | n/a | n/a |",
    ]


def test_markdown_puts_a_modifier_s_rows_in_the_masks_table_beside_fa4():
    """A modifier's case is named by its label (fagen.bench.run_fagen's Row.mask), so its rows join
    the masks' table, FA4's ratio beside Flex's, and never a dense table."""
    case = Case("float16", 128, 4096, True, modifier="softcap")
    rows = [Row(case.key, kernel, impl, case.dtype, case.head_dim, case.n, case.batch, case.heads, case.causal,
                case.mask_label, 1.0, tf) for kernel, impl, tf in (("attn", "fagen", 200.0), ("flex", "flex", 100.0),
                                                                   ("fa4", "fa4", 160.0))]
    text = bench.markdown(rows, META, [])
    assert "## head_dim" not in text
    assert "| float16 | 128 | 4096 | causal + softcap 30 | 200 | 100 | 2.00x | 160 | 1.25x |" in text


def test_markdown_notes_list_the_noted_row(rows):
    text = bench.markdown(rows, META, [])
    notes = text.split("## Notes")[1].strip().splitlines()
    assert notes[0] == f"- {NOTED} sdpa_cudnn: {NOTE}"
    assert len([ln for ln in notes if ln.startswith("- ")]) == 1


def test_markdown_without_notes_or_masks_has_neither(rows):
    dense = [r for r in rows if r.mask == "none" and not r.note]
    text = bench.markdown(dense, META, [])
    assert "## Notes" not in text and "## Masks" not in text


def test_markdown_links_plots_relative_to_its_folder(rows, tmp_path):
    plots = [str(tmp_path / "bench" / "bench_d64.png"), str(tmp_path / "bench" / "bench_d128.png")]
    text = bench.markdown(rows, META, plots, md_path=tmp_path / "BENCHMARKS.md")
    links = [ln for ln in text.splitlines() if ln.startswith("![")]
    assert links == ["![bench_d64](bench/bench_d64.png)", "![bench_d128](bench/bench_d128.png)"]
    assert str(tmp_path) not in text


def test_markdown_links_climb_out_of_a_sibling_folder(rows, tmp_path):
    text = bench.markdown(rows, META, [str(tmp_path / "bench" / "bench_d64.png")],
                          md_path=str(tmp_path / "docs" / "BENCHMARKS.md"))
    assert "![bench_d64](../bench/bench_d64.png)" in text.splitlines()


def test_markdown_links_from_relative_paths(rows, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = bench.markdown(rows, META, ["bench/bench_d64.png"], md_path="BENCHMARKS.md")
    assert "![bench_d64](bench/bench_d64.png)" in text.splitlines()
    text = bench.markdown(rows, META, ["bench/bench_d64.png"], md_path="docs/B.md")
    assert "![bench_d64](../bench/bench_d64.png)" in text.splitlines()


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_plot_writes_a_png(rows, tmp_path, d):
    path = tmp_path / f"bench_d{d}.png"
    bench.plot(rows, d, path)  # d=128 has the row without TFLOP/s
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 1000


# ---- fagen bench --from-json (no GPU) --------------------------------------------------------


@pytest.fixture
def no_gpu(monkeypatch):
    """Fail loudly if --from-json reaches for the GPU."""
    def refuse(*a, **k):
        raise AssertionError("bench --from-json must not run or probe the GPU")
    monkeypatch.setattr(bench, "run", refuse)
    monkeypatch.setattr(bench, "environment_meta", refuse)


def test_cli_bench_from_json_regenerates_table_and_plots(rows, tmp_path, no_gpu):
    src = tmp_path / "in" / "bench.json"
    src.parent.mkdir()
    bench.write_json(rows, src, META)
    out, md = tmp_path / "out", tmp_path / "B.md"
    result = CliRunner().invoke(main, ["bench", "--from-json", str(src), "-o", str(out), "--markdown", str(md)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    text = md.read_text()
    assert [ln for ln in text.splitlines() if ln.startswith("## head_dim")] == ["## head_dim 64", "## head_dim 128"]
    assert "| float16 | 1024 | none | 200 | 200 | 300 | n/a | n/a | 1.00x | n/a |" in text
    assert "| float16 | 128 | 4096 | sliding_window | 150 | 100 | 1.50x | n/a | n/a |" in text
    assert f"- {NOTED} sdpa_cudnn: {NOTE}" in text
    links = [ln for ln in text.splitlines() if ln.startswith("![")]
    assert links == ["![bench_d64](out/bench_d64.png)", "![bench_d128](out/bench_d128.png)"]
    assert str(tmp_path) not in text  # -o and --markdown were absolute: the links must not be
    for d in HEAD_DIMS:
        assert (out / f"bench_d{d}.png").read_bytes().startswith(PNG)
    assert text == bench.markdown(rows, META, [str(out / f"bench_d{d}.png") for d in HEAD_DIMS], md_path=md)
    # one line per fagen row on stdout
    assert sum(ln.split()[1:2] == ["fagen"] for ln in result.output.splitlines()) == len(DENSE_CASES) + 4


def test_cli_bench_from_json_relative_paths(rows, tmp_path, monkeypatch, no_gpu):
    monkeypatch.chdir(tmp_path)
    bench.write_json(rows, Path("bench.json"), META)
    (tmp_path / "docs").mkdir()
    result = CliRunner().invoke(main, ["bench", "--from-json", "bench.json", "-o", "bench",
                                       "--markdown", "docs/BENCHMARKS.md"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    text = (tmp_path / "docs" / "BENCHMARKS.md").read_text()
    assert "![bench_d64](../bench/bench_d64.png)" in text.splitlines()
    assert (tmp_path / "bench" / "bench_d128.png").exists()


# ---- bench.read_json: one-line reasons ------------------------------------


@pytest.mark.parametrize(("text", "why"), [("{", "not JSON"), ("{}", 'no "rows"'), ('{"rows": {}}', 'no "rows"'),
                                           ('{"rows": [], "meta": 3}', '"meta"'), ('{"rows": [7]}', "rows[0]")])
def test_read_json_refuses_what_is_not_a_bench_run(text, why, tmp_path):
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        bench.read_json(path)
    assert why in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


# ---- the backward (fagen.bench_backward): FLOPs, cases, writers, the CLI, no GPU --------------

from fagen import bench_backward  # noqa: E402
from fagen.bench_backward import BackwardRow  # noqa: E402

BACKWARD_FIELDS = ["case", "kernel", "impl", "dtype", "head_dim", "n", "batch", "heads", "causal", "mask",
                   "bwd_ms", "bwd_tflops", "fwd_bwd_ms", "fwd_bwd_tflops", "peak_mib", "error", "oracle_error",
                   "note"]


@pytest.mark.parametrize("case, expected", [
    # 10 * B * H * N^2 * d: B = 16k / N, H = 2048 / d
    (Case("float16", 128, 4096, False), 10.0 * 4 * 16 * 4096**2 * 128),  # 1.37e12
    (Case("float16", 128, 4096, True), 5.0 * 4 * 16 * 4096**2 * 128),  # halved
    (Case("float16", 64, 1024, False), 10.0 * 16 * 32 * 1024**2 * 64),
    (Case("float16", 64, 16384, True), 5.0 * 1 * 32 * 16384**2 * 64),
])
def test_backward_flops_by_hand(case, expected):
    assert bench_backward.backward_flops(case) == expected
    assert bench_backward.fwd_bwd_flops(case) == expected * 14 / 10


def test_backward_flops_are_2_5x_and_fwd_bwd_3_5x_the_forward():
    for case in bench_backward.cases():
        assert bench_backward.backward_flops(case) == 2.5 * bench.case_flops(case)
        assert bench_backward.fwd_bwd_flops(case) == 3.5 * bench.case_flops(case)


@pytest.mark.parametrize("mask", ["sliding_window", "prefix_lm", "documents"])
def test_backward_flops_masked_count_kept_pairs(small_masks, mask):
    """10 * B * H * d per kept (q, k) pair, the pairs counted by a double loop."""
    window, prefix = small_masks
    case = Case("float16", 128, 64, True, mask, docs=4)
    kept = _brute_kept(64, mask, window, prefix, bench.doc_lengths(64, 4))
    b, h = 16384 // 64, 2048 // 128
    assert bench_backward.backward_flops(case) == 10.0 * b * h * 128 * kept
    assert bench_backward.fwd_bwd_flops(case) == 14.0 * b * h * 128 * kept


def test_documents_case_packs_its_own_doc_count(small_masks):
    n = 64
    four, eight = Case("float16", 128, n, True, "documents", docs=4), Case("float16", 128, n, True, "documents")
    assert eight.docs == bench.N_DOCS == 8
    lengths = bench.doc_lengths(n, 4)
    assert len(lengths) == 4 and sum(lengths) == n
    assert bench.kept_pairs(four) == sum(x * (x + 1) // 2 for x in lengths)
    assert bench.kept_pairs(four) != bench.kept_pairs(eight)
    # the dense matrix the float32 reference masks with keeps the same pairs
    keep = bench_backward.keep_matrix(four)
    assert keep.shape == (n, n) and keep.dtype == bool and int(keep.sum()) == bench.kept_pairs(four)
    docs = documents_of_lengths(lengths)
    kernel = dense_from_predicate(static_predicate(Mask(kind="document", causal=True), n, n, docs), 1, 1, n, n)
    assert (np.asarray(kernel).reshape(n, n) == keep).all()


@pytest.mark.parametrize("mask", ["none", "causal", "sliding_window", "prefix_lm"])
def test_keep_matrix_counts_kept_pairs(small_masks, mask):
    case = Case("float16", 64, 64, mask != "none", "none" if mask in ("none", "causal") else mask)
    keep = bench_backward.keep_matrix(case)
    assert keep.shape == (64, 64) and int(keep.sum()) == bench.kept_pairs(case)


def test_backward_case_keys():
    assert Case("float16", 128, 4096, True, "documents", docs=4).key == "float16-d128-n4096-documents4"
    assert Case("float16", 128, 4096, True, "documents").key == "float16-d128-n4096-documents"  # the forward's


def test_backward_cases_are_the_brief():
    all_cases = bench_backward.cases()
    dense = [c for c in all_cases if c.mask == "none" and c.modifier == "none"]
    assert {(c.dtype, c.head_dim, c.n, c.causal) for c in dense} == set(
        itertools.product(["float16"], (64, 128), (1024, 4096, 16384), (False, True)))
    masked = [c for c in all_cases if c.mask != "none"]
    assert {(c.mask, c.n, c.head_dim, c.dtype) for c in masked} == {
        (m, 4096, 128, "float16") for m in ("sliding_window", "documents", "prefix_lm")}
    assert [c.docs for c in masked if c.mask == "documents"] == [4]
    modified = [c for c in all_cases if c.modifier != "none"]  # FlashAttention-4's own modifiers, on causal
    assert {(c.modifier, c.head_dim, c.n, c.causal, c.mask) for c in modified} == set(
        itertools.product(("softcap", "sinks"), (64, 128), (4096,), (True,), ("none",)))
    assert len(all_cases) == 19 == len({c.key for c in all_cases})
    for c in all_cases:
        assert c.batch * c.n == 16384 and c.heads * c.head_dim == 2048, c


def test_backward_quick_cases_are_a_subset_with_a_mask():
    quick = bench_backward.cases(quick=True)
    assert 0 < len(quick) <= 3 and set(quick) <= set(bench_backward.cases())
    assert any(c.mask != "none" for c in quick)


def test_every_backward_case_has_a_trainable_spec():
    """What derive_spec + trainable give on an H200 (and on a GPU without tuned specs), built
    on the CPU: the validator accepts a backward for each case."""
    for gpu in ("h200", None):
        for case in bench_backward.cases():
            base = variants.shipped_spec(case.dtype, case.head_dim, case.causal and case.mask == "none", gpu=gpu)
            mask = {"sliding_window": Mask(kind="sliding_window", window_left=bench.WINDOW),
                    "prefix_lm": Mask(kind="prefix_lm", prefix_len=bench.PREFIX),
                    "documents": Mask(kind="document", causal=True)}.get(case.mask, base.mask)
            spec = variants.trainable(variants.variant(base, mask, base.score_mod))
            assert spec.backward is not None and spec.head_dim == case.head_dim and spec.mask == mask


def test_the_backward_bench_trains_each_case_in_its_key_lengths_class(monkeypatch):
    """fagen.attention derives its spec with k's length (a shape class from LONG_KEYS on, with its
    own forward and backward tiling); the bench's fagen_spec must too, or its long cases time the
    short class's kernels."""
    asked = []

    def derive(q, **kwargs):
        asked.append(kwargs.get("keys"))
        return variants.shipped_spec(q, 128, kwargs["causal"], gpu="h200", keys=kwargs.get("keys"))

    monkeypatch.setattr(bench_backward, "derive_spec", derive)
    for case in bench_backward.cases():
        if case.mask == "documents" or case.modifier == "sinks":  # (their doc_ids, sinks go to the GPU)
            continue
        spec, _ = bench_backward.fagen_spec(case, case.dtype)
        assert asked[-1] == case.n
        assert spec.name.startswith(variants.shipped_spec(case.dtype, 128, case.causal and case.mask == "none",
                                                          gpu="h200", keys=case.n).name)


def _subsection(text: str, title: str) -> list[str]:
    """The table lines, less the column names, of a '### title' section."""
    lines = text.splitlines()
    start = lines.index(title)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("#")), len(lines))
    return [ln for ln in lines[start + 1:end] if ln.startswith("| ")][1:]


def _brow(case: Case, impl: str, bwd: float | None, fwd_bwd: float | None = None, peak: float | None = None,
          note: str = "") -> BackwardRow:
    kernel = f"attn_{case.dtype}_d{case.head_dim}_bwd" if impl == "fagen" else impl
    row = BackwardRow(case.key, kernel, impl, case.dtype, case.head_dim, case.n, case.batch, case.heads,
                      case.causal, case.mask, note=note)
    if bwd is not None:
        row.bwd_ms, row.bwd_tflops = 2.0, bwd
        row.fwd_bwd_ms, row.fwd_bwd_tflops = 3.0, fwd_bwd if fwd_bwd is not None else bwd + 50
        row.peak_mib, row.error = peak if peak is not None else 200.0, 1.5e-3
    if impl == "fagen" and bwd is not None:
        row.oracle_error = 2.5e-3
    return row


BWD_DENSE = [Case("float16", d, n, c) for d in (64, 128) for c in (False, True) for n in (1024, 16384)]
BWD_MASKED = {Case("float16", 128, 4096, True, "sliding_window"): (120.0, 80.0),
              Case("float16", 128, 4096, True, "documents", docs=4): (60.0, None),  # Flex failed
              Case("float16", 128, 4096, True, "prefix_lm"): (None, 150.0)}  # fagen refused: not timed
FLEX_NOTE = "RuntimeError: out of resource"
WRONG = "WRONG, not timed: dq/dk/dv rel err 3.00e-01 against the float64 oracle (tol 1e-02)"


@pytest.fixture
def brows() -> list[BackwardRow]:
    out = []
    for i, case in enumerate(BWD_DENSE):  # fagen 300 + 10 i, FA2 200, cuDNN 250 - i
        out += [_brow(case, "fagen", 300.0 + 10 * i, 320.0 + 10 * i, 192.0),
                _brow(case, "sdpa_flash", 200.0, 230.0, 320.0), _brow(case, "sdpa_cudnn", 250.0 - i, 280.0, 260.0)]
    for case, (fagen_tf, flex_tf) in BWD_MASKED.items():
        out.append(_brow(case, "fagen", fagen_tf, peak=190.0, note="" if fagen_tf else WRONG))
        out.append(_brow(case, "flex", flex_tf, peak=400.0, note="" if flex_tf else FLEX_NOTE))
    return out


BWD_META = {"gpu": "NVIDIA H200", "date": "2025-01-02", "torch": "2.9.0", "mode": "full", "pass": "backward",
            "cases": "11"}


def test_backward_markdown_states_the_flop_formulas(brows):
    text = "\n".join(bench_backward.markdown(brows, BWD_META))
    assert text.startswith("## Backward\n")
    assert "Backward TFLOP/s = 10·B·H·Nq·Nk·d / time" in text
    assert "10·B·H·d·kept" in text and "fwd+bwd TFLOP/s = 14·B·H·Nq·Nk·d" in text and "halved" in text
    assert "- pass: backward" in text and "- gpu: NVIDIA H200" in text


def test_backward_markdown_dense_lines(brows):
    text = "\n".join(bench_backward.markdown(brows, BWD_META))
    assert [ln for ln in text.splitlines() if ln.startswith("### ")] == [
        "### Backward, head_dim 64", "### Backward, head_dim 128", "### Backward, masks (kept-work TFLOP/s)",
        "### Backward notes"]
    d64 = [ln for ln in _subsection(text, "### Backward, head_dim 64") if not ln.startswith("| -")]
    # by hand: case 0 is d64 dense 1k (fagen 300, FA2 200, cuDNN 250), case 3 d64 causal 16k (330, 200, 247)
    assert BWD_DENSE[0] == Case("float16", 64, 1024, False) and BWD_DENSE[3] == Case("float16", 64, 16384, True)
    assert d64 == [
        "| float16 | 1024 | none | 300 | 200 | 250 | n/a | 1.50x | n/a | 320 | 230 | 280 | n/a | 192 / 320 / 260 | 2.5e-03 / 1.5e-03 |",
        "| float16 | 16384 | none | 310 | 200 | 249 | n/a | 1.55x | n/a | 330 | 230 | 280 | n/a | 192 / 320 / 260 | 2.5e-03 / 1.5e-03 |",
        "| float16 | 1024 | causal | 320 | 200 | 248 | n/a | 1.60x | n/a | 340 | 230 | 280 | n/a | 192 / 320 / 260 | 2.5e-03 / 1.5e-03 |",
        "| float16 | 16384 | causal | 330 | 200 | 247 | n/a | 1.65x | n/a | 350 | 230 | 280 | n/a | 192 / 320 / 260 | 2.5e-03 / 1.5e-03 |",
    ]
    header = [ln for ln in text.split("### Backward, head_dim 128")[1].splitlines() if ln.startswith("| dtype")][0]
    assert header.split(" | ")[3:9] == ["fagen", "SDPA FA2", "SDPA cuDNN", "FA4", "fagen / FA2", "fagen / FA4"]


def test_backward_markdown_masks_notes_and_plot(brows, tmp_path):
    text = "\n".join(bench_backward.markdown(brows, BWD_META, "bench/bench_backward.png"))
    masks = [ln for ln in _subsection(text, "### Backward, masks (kept-work TFLOP/s)") if not ln.startswith("| -")]
    assert masks == [
        "| float16 | 128 | 4096 | documents | 60 | n/a | n/a | n/a | n/a | 110 | n/a | 190 / n/a | 2.5e-03 / 1.5e-03 |",
        "| float16 | 128 | 4096 | prefix_lm | n/a | 150 | n/a | n/a | n/a | n/a | 200 | n/a / 400 | n/a / n/a |",
        "| float16 | 128 | 4096 | sliding_window | 120 | 80 | 1.50x | n/a | n/a | 170 | 130 | 190 / 400 | 2.5e-03 / 1.5e-03 |",
    ]
    notes = [ln for ln in text.split("### Backward notes")[1].splitlines() if ln.startswith("- ")]
    assert notes == [f"- float16-d128-n4096-documents4 flex: {FLEX_NOTE}",
                     f"- float16-d128-n4096-prefix_lm fagen: {WRONG}"]
    assert text.splitlines()[-1] == "![bench_backward](bench/bench_backward.png)"


def test_backward_markdown_without_masks_or_notes(brows):
    dense = [r for r in brows if r.mask == "none"]
    text = "\n".join(bench_backward.markdown(dense, BWD_META))
    assert "masks" not in text.split("- cases")[1] and "### Backward notes" not in text and "![" not in text


def test_backward_summary_lines(brows):
    lines = bench_backward.summary_lines(brows)
    assert len(lines) == len(BWD_DENSE) + 3
    assert lines[0] == f"{BWD_DENSE[0].key:36} fagen-bwd   300.0 TFLOP/s backward,   320.0 fwd+bwd"
    assert lines[-1].endswith(WRONG)


def test_backward_json_and_csv_round_trip(brows, tmp_path):
    written = bench_backward.write_data(brows, BWD_META, tmp_path)
    assert written == [tmp_path / "bench_backward.json", tmp_path / "bench_backward.csv"]
    back, meta = bench_backward.read_json(tmp_path / "bench_backward.json")
    assert back == brows and meta == BWD_META
    assert list(json.loads((tmp_path / "bench_backward.json").read_text())["rows"][0]) == BACKWARD_FIELDS
    lines = (tmp_path / "bench_backward.csv").read_text().splitlines()
    assert lines[0].split(",") == BACKWARD_FIELDS == list(BackwardRow.__dataclass_fields__)
    assert len(lines) == 1 + len(brows)


def test_backward_read_json_refuses_forward_rows(rows, tmp_path):
    bench.write_json(rows, tmp_path / "bench.json", META)
    with pytest.raises(ValueError) as err:
        bench_backward.read_json(tmp_path / "bench.json")
    assert "rows[0]" in str(err.value) and "bench_backward.json" in str(err.value) and "\n" not in str(err.value)


def test_backward_plot_writes_a_png(brows, tmp_path):
    path = tmp_path / "bench_backward.png"
    bench_backward.plot(brows, path)  # rows without numbers included
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 1000


def test_write_report_with_both_halves(rows, brows, tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    out = tmp_path / "bench"
    out.mkdir()
    written = bench.write_report(rows, META, out, md, with_data=True,
                                 backward=bench.Part(brows, BWD_META, fresh=True))
    names = {p.name for p in written}
    assert {"bench.json", "bench.csv", "bench_backward.json", "bench_backward.csv", "bench_backward.png",
            "bench_d64.png", "bench_d128.png", "BENCHMARKS.md"} == names
    text = md.read_text()
    forward_only = bench.markdown(rows, META, [str(out / "bench_d64.png"), str(out / "bench_d128.png")], md_path=md)
    assert text.startswith(forward_only.rstrip("\n"))  # the forward report, unchanged, then the backward
    assert text.index("## head_dim 64") < text.index("## Backward") < text.index("### Backward, head_dim 64")
    assert "![bench_backward](bench/bench_backward.png)" in text.splitlines()
    assert str(tmp_path) not in text


def test_write_report_backward_alone_has_no_forward_tables(brows, tmp_path):
    md = tmp_path / "B.md"
    written = bench.write_report([], {}, tmp_path, md, with_data=False, backward=bench.Part(brows, BWD_META))
    assert {p.name for p in written} == {"bench_backward.png", "B.md"}  # not fresh: no JSON rewritten
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\n## Backward\n") and "## head_dim" not in text


# ---- main (what `fagen bench` runs) and the CLI, the GPU parts stubbed --------------------------


@pytest.fixture
def fake_gpu(monkeypatch, rows, brows):
    """bench.run and bench_backward.run return the synthetic rows of the cases asked for;
    calls records what ran."""
    calls = []

    def run_forward(case_list, progress=None):
        calls.append(("forward", list(case_list)))
        for c in case_list:
            progress and progress(c)
        return rows

    def run_backward(case_list, progress=None):
        calls.append(("backward", list(case_list)))
        for c in case_list:
            progress and progress(c)
        return brows

    def run_serving(case_list, progress=None):
        calls.append(("serving", list(case_list)))
        for c in case_list:
            progress and progress(c)
        return serving_rows()

    monkeypatch.setattr(bench, "run", run_forward)
    monkeypatch.setattr(bench_backward, "run", run_backward)
    monkeypatch.setattr(bench_serving, "run", run_serving)
    monkeypatch.setattr(bench, "environment_meta", lambda: {"gpu": "NVIDIA H200", "date": "2025-01-03"})
    monkeypatch.setattr("fagen.cli._need_gpu", lambda torch=False: None)
    return calls


def test_main_full_run_is_forward_and_backward(fake_gpu, tmp_path, rows, brows):
    out, md = tmp_path / "bench", tmp_path / "BENCHMARKS.md"
    out.mkdir()
    lines = bench.main(out, md)
    assert [(what, len(c)) for what, c in fake_gpu] == [("forward", 104), ("backward", 19),
                                                         ("serving", len(bench_serving.cases()))]
    assert fake_gpu[1][1] == bench_backward.cases()
    _, meta = bench_backward.read_json(out / "bench_backward.json")
    assert meta == {"gpu": "NVIDIA H200", "date": "2025-01-03", "pass": "backward", "cases": "19", "mode": "full",
                    "masks": bench_backward.describe_masks()}
    assert "documents: 4 packed documents" in meta["masks"]
    assert bench.read_json(out / "bench.json")[1]["cases"] == "104"
    text = md.read_text()
    assert "## head_dim 64" in text and "### Backward, head_dim 64" in text and "### Paged KV cache" in text
    assert sum(ln.split()[1:2] == ["fagen"] for ln in lines) == len([r for r in rows if r.impl == "fagen"])
    assert sum(ln.split()[1:2] == ["fagen-bwd"] for ln in lines) == len([r for r in brows if r.impl == "fagen"])
    assert lines[-1].startswith("wrote ")


def test_main_backward_only_keeps_the_forward_tables(fake_gpu, tmp_path, rows):
    out, md = tmp_path / "bench", tmp_path / "BENCHMARKS.md"
    out.mkdir()
    bench.write_json(rows, out / "bench.json", META)  # an earlier forward run
    before = (out / "bench.json").read_text()
    lines = bench.main(out, md, backward_only=True)
    assert [what for what, _ in fake_gpu] == ["backward"]
    assert (out / "bench.json").read_text() == before  # kept, not rewritten
    assert lines[0] == f"kept the forward tables from {out / 'bench.json'} (not run this time)"
    text = md.read_text()
    assert "- date: 2025-01-01" in text and "- date: 2025-01-03" in text  # each half's own meta
    assert "| float16 | 1024 | none | 200 | 200 | 300 | n/a | n/a | 1.00x | n/a |" in text and "## Backward" in text


def test_main_quick_backward_runs_the_quick_backward_only(fake_gpu, tmp_path):
    out = tmp_path / "bench"
    out.mkdir()
    bench.main(out, tmp_path / "B.md", quick=True, backward_only=True)
    assert fake_gpu == [("backward", bench_backward.cases(quick=True))]
    assert not (out / "bench_serving.json").exists()
    assert json.loads((out / "bench_backward.json").read_text())["meta"]["mode"] == "quick"
    assert "## head_dim" not in (tmp_path / "B.md").read_text()  # no forward run to keep


def test_main_quick_is_the_forward_only(fake_gpu, tmp_path):
    out = tmp_path / "bench"
    out.mkdir()
    bench.main(out, tmp_path / "B.md", quick=True)
    assert fake_gpu == [("forward", bench.cases(quick=True))]
    assert not (out / "bench_backward.json").exists()


def test_main_forward_only_keeps_the_backward_and_serving_tables(fake_gpu, tmp_path, brows):
    out, md = tmp_path / "bench", tmp_path / "BENCHMARKS.md"
    out.mkdir()
    bench_backward.write_data(brows, {**META, "pass": "backward"}, out)  # an earlier backward run
    before = (out / "bench_backward.json").read_text()
    lines = bench.main(out, md, forward_only=True)
    assert [(what, len(c)) for what, c in fake_gpu] == [("forward", 104)]
    assert (out / "bench_backward.json").read_text() == before
    assert lines[0] == f"kept the backward tables from {out / 'bench_backward.json'} (not run this time)"
    assert "## Backward" in md.read_text()


@pytest.mark.parametrize("args, quick, backward_only, serving_only, forward_only", [
    ([], False, False, False, False), (["--backward"], False, True, False, False), (["--quick"], True, False, False, False),
    (["--quick", "--backward"], True, True, False, False), (["--serving"], False, False, True, False),
    (["--forward"], False, False, False, True)])
def test_cli_bench_flags_reach_main(monkeypatch, tmp_path, args, quick, backward_only, serving_only, forward_only):
    seen = {}

    def fake_main(out, md, **kw):
        seen.update(kw, out=out, md=md)
        return ["done"]

    monkeypatch.setattr(bench, "main", fake_main)
    monkeypatch.setattr("fagen.cli._need_gpu", lambda torch=False: None)
    result = CliRunner().invoke(main, ["bench", *args, "-o", str(tmp_path / "o"), "--markdown",
                                       str(tmp_path / "B.md")])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert (seen["quick"], seen["backward_only"], seen["serving_only"], seen["forward_only"], seen["report"]) == (
        quick, backward_only, serving_only, forward_only, None)
    assert (seen["out"], seen["md"]) == (tmp_path / "o", tmp_path / "B.md")
    assert result.output == "done\n"


def test_cli_bench_backward_needs_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr("fagen.cli._need_gpu", lambda torch=False: (_ for _ in ()).throw(
        __import__("click").ClickException("no CUDA GPU found")))
    monkeypatch.setattr(bench, "main", lambda *a, **k: pytest.fail("ran without a GPU"))
    result = CliRunner().invoke(main, ["bench", "--backward", "-o", str(tmp_path / "o")])
    assert result.exit_code == 1 and "no CUDA GPU found" in result.output


def test_cli_bench_help_lists_backward():
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0 and "--backward" in result.output


@pytest.mark.parametrize("flag", ["--backward", "--quick", "--serving"])
def test_cli_bench_from_json_refuses_run_flags(rows, tmp_path, no_gpu, flag):
    bench.write_json(rows, tmp_path / "bench.json", META)
    result = CliRunner().invoke(main, ["bench", "--from-json", str(tmp_path / "bench.json"), flag,
                                       "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and flag in result.output and "--from-json" in result.output


@pytest.mark.parametrize("given", ["bench.json", "bench_backward.json"])
def test_cli_bench_from_json_takes_both_halves(rows, brows, tmp_path, no_gpu, given):
    src = tmp_path / "in"
    src.mkdir()
    bench.write_json(rows, src / "bench.json", META)
    bench_backward.write_data(brows, BWD_META, src)
    out, md = tmp_path / "out", tmp_path / "B.md"
    result = CliRunner().invoke(main, ["bench", "--from-json", str(src / given), "-o", str(out), "--markdown", str(md)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    text = md.read_text()
    assert "| float16 | 1024 | none | 200 | 200 | 300 | n/a | n/a | 1.00x | n/a |" in text
    assert "| float16 | 128 | 4096 | sliding_window | 120 | 80 | 1.50x | n/a | n/a | 170 | 130 | 190 / 400 | 2.5e-03 / 1.5e-03 |" in text
    assert "![bench_backward](out/bench_backward.png)" in text.splitlines()
    assert (out / "bench_backward.png").read_bytes().startswith(PNG)
    assert not (out / "bench.json").exists() and not (out / "bench_backward.json").exists()  # redrawn, not copied
    assert sum(ln.split()[1:2] == ["fagen-bwd"] for ln in result.output.splitlines()) == len(BWD_DENSE) + 3


def test_cli_bench_from_json_backward_alone(brows, tmp_path, no_gpu):
    bench_backward.write_data(brows, BWD_META, tmp_path)
    md = tmp_path / "B.md"
    result = CliRunner().invoke(main, ["bench", "--from-json", str(tmp_path / "bench_backward.json"),
                                       "-o", str(tmp_path / "o"), "--markdown", str(md)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "## head_dim" not in md.read_text() and "### Backward, head_dim 128" in md.read_text()


# ---- the serving part (fagen.bench_serving) ---------------------------------------------------

def serving_rows() -> list:
    """Synthetic rows: a decode case with its SDPA peers, a paged case with its contiguous run,
    a varlen case with its padded batch."""
    decode, paged, mixed, varlen, host = (next(c for c in bench_serving.cases() if c.section == s)
                                          for s in ("decode", "paged", "mixed", "varlen", "host"))

    def row(case, impl, us, **kw):
        return bench_serving._row(case, impl, us, **kw)
    return [row(decode, "fagen", 30.0, tb_s=1.1), row(decode, "sdpa", 12.0, tb_s=2.9),
            row(decode, "sdpa_flash", None, note="unsupported: no"),
            row(paged, "fagen", 80.0, tb_s=1.7), row(paged, "fagen_contiguous", 60.0, tb_s=2.2),
            row(paged, "sdpa", 38.0, tb_s=3.5),
            row(varlen, "fagen", 900.0, tflops=450.0), row(varlen, "fagen_padded", 850.0, tflops=500.0),
            row(host, "fagen", 11.5), row(host, "fagen_out", 8.25), row(host, "fagen_moved", 9.0),
            row(host, "fagen_attention", 14.0), row(host, "sdpa", 18.0),
            row(host, "fagen_attention_growing", 12.5), row(host, "fagen_attention_ranged_growing", 13.5),
            row(host, "sdpa_growing", 19.0),
            row(mixed, "fagen", 100.0, tb_s=3.0, note="err 3.0e-04, lengths 2100-14000"),
            row(mixed, "sdpa", 400.0, tb_s=0.75)]


def test_serving_cases_cover_decode_paged_and_varlen():
    full = bench_serving.cases()
    assert len({c.key for c in full}) == len(full)  # keys name the cases apart
    assert {c.section for c in full} == {"decode", "paged", "mixed", "varlen", "host"}
    assert {c.section for c in bench_serving.cases(quick=True)} == {"decode", "paged", "mixed", "varlen", "host"}
    assert all(c.nk % c.page_size == 0 for c in full if c.section in ("paged", "mixed"))
    assert {c.b for c in full if c.section == "mixed"} >= {64}  # batches up to 64 sequences


def test_serving_units():
    case = bench_serving.ServingCase("decode", "float16", 128, 2, 32, 8, 1, 1024)
    assert bench_serving.kv_bytes(case) == 2 * 2 * 8 * 1024 * 128 * 2
    causal = bench_serving.ServingCase("varlen", "float16", 64, 2, 4, 4, 100, 100, causal=True, mixed=True)
    assert bench_serving.prefill_flops([100, 50], causal) == 4 * 4 * 64 * (100 ** 2 + 50 ** 2) / 2
    lengths = bench_serving.varlen_lengths(causal, np.random.default_rng(0))
    assert sum(lengths) == 200 and len(lengths) == 2 and min(lengths) > 0
    lengths = bench_serving.mixed_lengths(64, 2048, np.random.default_rng(1))
    assert sum(lengths) == 64 * 2048 and min(lengths) >= 2048 // 4 - 64 and len(set(lengths)) > 32


def test_serving_markdown_tables(tmp_path):
    text = "\n".join(bench_serving.markdown(serving_rows(), {"gpu": "NVIDIA H200"}, "bench/bench_serving.png"))
    assert "### Decode" in text and "| 30.0 | 1.10 | 12.0 | 2.90 | n/a | 0.40x |" in text
    assert "| 80.0 | 1.70 | 60.0 | 1.33 | 38.0 |" in text  # paged / contiguous time
    assert "| 450 | 500 | 0.90 |" in text and "![serving](bench/bench_serving.png)" in text
    assert "(sdpa_flash): unsupported: no" in text
    assert "| float16 d128, 32/8, B 16 | 8k | 2100-14000 | 100.0 | 3.00 | 400.0 | 4.00x |" in text
    assert ("| decode step (the last split merges) | float16 d128, 32/8, B 1, Nq 1, Nk 1024 | 11.5 | 8.2 | 9.0 | 14.0 | 18.0 "
            "| 12.5 | 13.5 | 19.0 |") in text
    bench_serving.plot(serving_rows(), tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_serving_json_round_trips(tmp_path):
    written = bench_serving.write_data(serving_rows(), {"pass": "serving"}, tmp_path)
    assert {p.name for p in written} == {"bench_serving.json", "bench_serving.csv"}
    rows, meta = bench_serving.read_json(tmp_path / "bench_serving.json")
    assert rows == serving_rows() and meta == {"pass": "serving"}


def test_main_serving_only_keeps_the_other_tables(fake_gpu, tmp_path, rows):
    out, md = tmp_path / "bench", tmp_path / "BENCHMARKS.md"
    out.mkdir()
    bench.write_json(rows, out / "bench.json", META)
    lines = bench.main(out, md, serving_only=True)
    assert [what for what, _ in fake_gpu] == ["serving"]
    assert lines[0] == f"kept the forward tables from {out / 'bench.json'} (not run this time)"
    text = md.read_text()
    assert "## head_dim" in text and "## Serving: decode, paged KV, varlen" in text
    assert json.loads((out / "bench_serving.json").read_text())["meta"]["pass"] == "serving"


def test_flash_attention_4_has_its_columns_and_ratios():
    """FlashAttention-4's rows join the dense and mask tables with fagen's ratio to them."""
    dense, window = Case("float16", 128, 4096, True), Case("float16", 128, 4096, True, mask="sliding_window")

    def row(case, impl, tflops):
        return bench.Row(case.key, impl, impl, case.dtype, case.head_dim, case.n, case.batch, case.heads,
                         case.causal, case.mask_label, 1.0, tflops)
    rows = [row(dense, "fagen", 500.0), row(dense, "fa4", 400.0), row(window, "fagen", 300.0),
            row(window, "flex", 200.0), row(window, "fa4", 250.0)]
    text = bench.markdown(rows, META, [])
    assert "| float16 | 4096 | causal | 500 | n/a | n/a | n/a | 400 | n/a | 1.25x |" in text
    assert "| float16 | 128 | 4096 | sliding_window | 300 | 200 | 1.50x | 250 | 1.20x |" in text
    assert bench_cases.fa4_attention.__doc__ and bench_cases.FA4_MASKS == ("none", "sliding_window")
    with pytest.raises(NotImplementedError, match="no documents kernel"):
        bench_cases.fa4_attention(Case("float16", 128, 4096, True, mask="documents"))


def test_the_training_host_time_script_reads_its_cases_and_tells_what_bounds_a_step():
    """scripts/training_host_time.py's pure parts: a case's name to its shape (16k tokens, H x d =
    2048), its forward FLOPs (halved for causal), a report line's TF/s of the do_bench time and
    the bound (host above GPU: host-bound); a malformed case is refused with the form to use."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "training_host_time.py"
    spec = importlib.util.spec_from_file_location("training_host_time", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    case = module.Case.parse("d128-1k-causal-f16")
    assert case == module.Case(128, 1024, True, "float16") and case.shape == (16, 16, 1024, 128)
    assert case.forward_flops() == 4 * 16 * 16 * 1024 ** 2 * 128 / 2
    assert module.Case.parse("d64-4096-none-bf16").shape == (4, 32, 4096, 64)
    line = module.row(case, "fagen", 1.0, 0.75, 0.8)
    tflops = round(3.5 * case.forward_flops() / 0.8 / 1e9)
    assert line.endswith(f"do_bench 0.800 ms = {tflops} TF/s (host-bound)") and "host 1.000 ms, GPU 0.750 ms" in line
    assert module.row(case, "cudnn", 0.2, 0.7, 0.7).endswith("(GPU-bound)")
    for bad in ("d128-1k-causal", "128-1k-causal-f16", "d128-1k-sliding-f16", "d128-1k-causal-fp8"):
        with pytest.raises(ValueError, match="expected d<head_dim>-<N>"):
            module.Case.parse(bad)


# ---- --only: a long run made in parts -------------------------------------------------------------


def test_only_picks_each_part_s_cases_by_key_and_refuses_a_pattern_that_finds_none():
    forward, backward = bench.cases(), bench_backward.cases()
    picked_forward, picked_backward = bench.pick_cases(r"d128-n4096-(dense|causal)$", forward, backward)
    assert [c.key for c in picked_forward] == ["float16-d128-n4096-dense", "float16-d128-n4096-causal",
                                               "bfloat16-d128-n4096-dense", "bfloat16-d128-n4096-causal"]
    assert [c.key for c in picked_backward] == ["float16-d128-n4096-dense", "float16-d128-n4096-causal"]
    for pattern, says in (("d512", "finds none of the 123 cases' keys; they read like 'float16-d64-n512-dense'"),
                          ("d128-(", "is no regular expression")):
        with pytest.raises(bench.CasePatternError, match=re.escape(says)):
            bench.pick_cases(pattern, forward, backward)


def test_a_rerun_takes_the_place_of_its_cases_rows_and_the_meta_says_so(rows, tmp_path, monkeypatch):
    """main(only=...) runs the picked cases alone (fagen and its peers), replaces every row of those
    cases in the JSON kept in `out`, keeps the other cases' rows and the run's meta, and notes the
    rerun in the meta; a second rerun's note follows the first's."""
    out, md = tmp_path / "bench", tmp_path / "BENCHMARKS.md"
    out.mkdir()
    bench.write_json(rows, out / "bench.json", META)  # the earlier full run
    asked = []

    def run(case_list, progress=None):  # every implementation of each case asked for, at 999 TF/s
        asked.extend(c.key for c in case_list)
        return [replace(r, tflops=999.0, note="") for r in rows if r.case in {c.key for c in case_list}]

    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(bench, "environment_meta", lambda: {"gpu": "NVIDIA H100", "date": "2025-02-01"})
    rerun = {r.case for r in rows} & {c.key for c in bench.cases()}
    target = sorted(rerun)[0]
    bench.main(out, md, forward_only=True, only=f"^{target}$")
    assert asked == [target]
    back, meta = bench.read_json(out / "bench.json")
    assert sorted((r.case, r.impl) for r in back) == sorted((r.case, r.impl) for r in rows)  # no row lost or added
    assert all((r.tflops == 999.0) == (r.case == target) for r in back)
    assert {k: v for k, v in meta.items() if k != "remeasured"} == META  # the run's own meta kept
    assert meta["remeasured"] == f"2025-02-01 on NVIDIA H100: 1 case matching '^{target}$'"
    bench.main(out, md, forward_only=True, only=f"^{target}$")
    assert bench.read_json(out / "bench.json")[1]["remeasured"].count("2025-02-01 on NVIDIA H100") == 2
    assert "- remeasured: 2025-02-01 on NVIDIA H100" in md.read_text()


def test_cli_only_refuses_a_pattern_before_running_anything(fake_gpu, tmp_path, rows):
    out = tmp_path / "bench"
    result = CliRunner().invoke(main, ["bench", "--forward", "--only", "d999", "-o", str(out),
                                       "--markdown", str(tmp_path / "B.md")])
    assert result.exit_code == 2 and "'--only'" in result.output and "finds none of the 104 cases" in result.output
    assert fake_gpu == []  # nothing ran
    src = tmp_path / "b.json"
    bench.write_json(rows, src, META)
    result = CliRunner().invoke(main, ["bench", "--from-json", str(src), "--only", "d128"])
    assert result.exit_code == 2 and "--only picks cases to run; --from-json runs none" in result.output


def test_backward_modifier_rows_join_the_masks_table_at_each_head_dim(tmp_path):
    """A modifier's rows (bench_backward._row: labelled after their mask) land in the masks table,
    one line per head_dim in head_dim order, not in the dense tables; the plot takes them too."""
    rows = []
    for d in (128, 64):
        case = Case("float16", d, 4096, True, modifier="softcap")
        for impl, tf in (("fagen", 300.0 + d), ("fa4", 200.0)):
            row = bench_backward._row(case, impl, impl)
            row.bwd_ms, row.bwd_tflops, row.fwd_bwd_ms, row.fwd_bwd_tflops = 2.0, tf, 3.0, tf
            rows.append(row)
    lines = bench_backward.markdown(rows, BWD_META)
    softcap = [ln for ln in lines if "causal + softcap 30" in ln and ln.startswith("|")]
    assert [ln.split(" | ")[1] for ln in softcap] == ["64", "128"]
    assert all("1.82x" in ln or "2.14x" in ln for ln in softcap), softcap
    assert not any(ln.startswith("### Backward, head_dim") for ln in lines)
    bench_backward.plot(rows, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes().startswith(PNG)
