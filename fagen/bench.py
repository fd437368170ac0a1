"""`fagen bench`: fagen's kernels beside PyTorch's SDPA (FlashAttention-2 and cuDNN backends),
FlexAttention and FlashAttention-4 (the flash-attn-4 package where installed; dense, causal and
sliding-window cases, in its own [B, N, H, d] layout, checked against fagen's kernel on the same
inputs before it is timed), same process, same GPU.

FLOPs: 4 * B * H * Nq * Nk * d (Q.K^T and P.V, 2 FLOPs per multiply-add), halved for causal;
for masks, 4 * B * H * d * (kept (q, k) pairs). Every fagen case is checked against the
float64 oracle before it is timed: a wrong kernel is never timed. Timing: CUDA events, warm-up,
median of 30 runs queued behind a GPU hold (fagen.check.time_ms: a call's host time is not in
it). A document mask's case times its launch packed once and its bounds resolved
each call (`documents_call`): fagen.attention's checks of doc_ids are host work that outlasts the
kernel of a 4k-token batch of short documents, and the queue of calls would time that instead
(H200: 0.20-0.37 ms a call by turns, for a kernel of 0.16 ms). The backward cases
(fagen.bench_backward) join the full run; `main` runs
either or both and writes one report: BENCHMARKS.md holds both, each part from this run or,
where it was not run, from its JSON in the output folder.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fagen import (bench_backward, bench_e2e_tables, bench_flex_tables, bench_fp8, bench_head_widths, bench_mla,
                   bench_rows, bench_serving, masks, variants)
from fagen.side_inputs import check_scale
from fagen.bench_cases import (  # noqa: F401  (the workload, also read as bench.Case, bench.kept_pairs, ...)
    FA4, FA4_MASKS, HIDDEN, MODIFIERS, N_DOCS, PREFIX, SDPA_BACKENDS, SOFTCAP, TOKENS, WINDOW, Case, case_flops,
    doc_lengths, fa4_attention, flex_block_mask, flex_score_mod, kept_pairs, mask_predicate, sink_logits, to_fa4_layout)
from fagen.bench_rows import by_case, write_json
from fagen.check import OUT_TOLERANCE, attention_flops, check_against_oracle, random_inputs, time_ms
from fagen.device import as_device_tensor, empty_like, stream_for
from fagen.dispatch import default_spec, derive_spec_for
from fagen.runtime import compile_kernel, document_bounds
from fagen.spec import AttentionSpec, Mask

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")
MASKED_LENGTHS = (4096, 16384)
MASKED_HEAD_DIMS = (64, 128)
# (mask, causal, uniform documents): every builder shape the mask bar names
MASKS = (("sliding_window", True, False), ("prefix_lm", True, False), ("documents", True, False),
         ("documents", False, False), ("documents", True, True), ("documents", False, True))
PEERS_DENSE = ("sdpa_flash", "sdpa_cudnn")


@dataclass
class Row:
    case: str
    kernel: str  # fagen spec name or peer name
    impl: str  # fagen | sdpa_flash | sdpa_cudnn | flex | fa4
    dtype: str
    head_dim: int
    n: int
    batch: int
    heads: int
    causal: bool
    mask: str
    ms: float | None
    tflops: float | None
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def cases(quick: bool = False) -> list[Case]:
    if quick:
        return [Case("float16", 128, n, c) for n in (1024, 4096) for c in (False, True)] + \
               [Case("float16", 128, 4096, True, "sliding_window")]
    dense = [Case(dt, d, n, c) for dt in DTYPES for d in HEAD_DIMS for n in LENGTHS for c in (False, True)]
    masked = [Case("float16", d, n, causal, m, uniform=uniform) for d in MASKED_HEAD_DIMS
              for m, causal, uniform in MASKS for n in MASKED_LENGTHS]
    modified = [Case("float16", d, n, True, modifier=m) for d in MASKED_HEAD_DIMS for m in MODIFIERS
                for n in MASKED_LENGTHS]
    return dense + masked + modified


def fagen_spec(case: Case) -> tuple[AttentionSpec, dict]:
    """The kernel fagen.attention would run for this case, and its side inputs (NumPy)."""
    if case.modifier != "none":  # on the causal mask (cases)
        sinks = sink_logits(case.heads) if case.modifier == "sinks" else None
        spec = derive_spec_for(case.dtype, case.head_dim, causal=case.causal, keys=case.n, sinks=sinks,
                               softcap=SOFTCAP if case.modifier == "softcap" else None)
        return spec, ({} if sinks is None else {"sinks": sinks})
    base = default_spec(case.dtype, case.head_dim, case.causal and case.mask == "none", keys=case.n)
    if case.mask == "none":
        return base, {}
    mask = {"sliding_window": Mask(kind="sliding_window", window_left=WINDOW),
            "documents": Mask(kind="document", causal=case.causal),
            "prefix_lm": Mask(kind="prefix_lm", prefix_len=PREFIX)}[case.mask]
    extras = {"doc_ids": masks.documents_of_lengths(case.doc_lengths(), case.batch)} \
        if case.mask == "documents" else {}
    return variants.variant(base, mask, base.score_mod), extras


def run_fagen(case: Case, flops: float) -> Row:
    spec, extras = fagen_spec(case)
    row = Row(case.key, spec.name, "fagen", case.dtype, case.head_dim, case.n, case.batch, case.heads,
              case.causal, case.mask_label, None, None)
    n_check = min(case.n, 1536)  # past WINDOW and PREFIX, so their edges are checked too
    # the check's batch of one and two heads: the first row of documents, the first two heads' sinks
    check_extras = {name: np.ascontiguousarray(a[:1, :n_check] if name == "doc_ids" else a[:2])
                    for name, a in extras.items()} or None
    result = check_against_oracle(spec, 1, 2, 2, n_check, n_check, framework="torch", extras=check_extras)
    if not result.passed:
        row.note = f"WRONG, not timed: {result.summary()}"
        return row
    kernel = compile_kernel(spec)
    q, k, v, out = random_inputs("torch", case.dtype, case.batch, case.heads, case.heads, case.n, case.n, case.head_dim)
    extras = _on_gpu(extras)
    row.ms = time_ms(documents_call(kernel, q, k, v, out, extras["doc_ids"]) if "doc_ids" in extras else
                     lambda: kernel(q, k, v, out=out, **extras))
    row.tflops = flops / row.ms / 1e9
    return row


def _on_gpu(extras: dict) -> dict:
    """fagen_spec's side inputs as CUDA tensors, copied once, not a call."""
    import torch

    return {name: torch.from_numpy(a).cuda() for name, a in extras.items()}


def documents_call(kernel, q, k, v, out, doc_ids):
    """A document-masked call of `kernel` as the GPU sees one: the bounds kernel, then the
    attention kernel, launched from arguments checked and packed once."""
    import cupy

    tq, tk, tv, to = (as_device_tensor(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"), (out, "out")))
    b, hq, n, d = tq.shape
    lse = empty_like(tq, (b, hq, n), "float32")
    docs = as_device_tensor(cupy.ascontiguousarray(cupy.asarray(doc_ids)), "doc_ids")
    given = dict(block_mask=None, bias=None, alibi_slopes=None, sinks=None, doc_ids=docs.obj)
    with stream_for(tq):
        args, held = kernel.extra_arguments(tq, tk, given)
        bounds = document_bounds(docs, tq)  # this call's own, re-resolved every call
        args["doc_bounds"] = as_device_tensor(bounds, "doc_bounds").ptr
        launch = kernel.launch(tq, tk, tv, to, as_device_tensor(lse, "lse"), scale=check_scale(None, d), mask_offset=0,
                               splits=1, extras=args)

    def call():
        document_bounds(docs, tq, out=bounds)
        launch(None)
    call.held = (held, docs, bounds, lse)
    return call


def run_peer(case: Case, impl: str, flops: float) -> Row:
    import torch

    row = Row(case.key, impl, impl, case.dtype, case.head_dim, case.n, case.batch, case.heads, case.causal,
              case.mask_label, None, None)
    q, k, v, _ = random_inputs("torch", case.dtype, case.batch, case.heads, case.heads, case.n, case.n, case.head_dim)
    try:
        if impl == FA4:  # checked against fagen's kernel (checked against the oracle) on the same inputs
            fa4, layout = fa4_attention(case), [to_fa4_layout(x) for x in (q, k, v)]
            error = _against_fagen(case, q, k, v, fa4(*layout).transpose(1, 2))
            if not error <= 2 * OUT_TOLERANCE[case.dtype]:
                row.note = f"WRONG, not timed: rel err {error:.2e} against fagen's kernel"
                return row
            row.ms = time_ms(lambda: fa4(*layout))
        elif impl in SDPA_BACKENDS:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            fn = torch.nn.functional.scaled_dot_product_attention
            with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[impl])):
                row.ms = time_ms(lambda: fn(q, k, v, is_causal=case.causal))
        else:
            row.ms = time_ms(flex_runner(case, q, k, v))
    except Exception as err:  # a peer that does not run this case is reported, not fatal
        row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
        return row
    row.tflops = flops / row.ms / 1e9
    return row


def _against_fagen(case: Case, q, k, v, got) -> float:
    """got's relative L2 error against fagen's kernel for the case on the same inputs."""
    import torch

    spec, extras = fagen_spec(case)
    want = compile_kernel(spec)(q, k, v, **_on_gpu(extras)).float()
    return float(torch.linalg.vector_norm(got.float() - want) / torch.linalg.vector_norm(want))


def flex_runner(case: Case, q, k, v):
    import torch

    # each masked case compiles Flex afresh (its own block mask and shapes): past dynamo's
    # recompile limit (8 graphs of one function) Flex would run eagerly, ~100x slower, without a word
    torch._dynamo.reset()
    block_mask, score_mod = flex_block_mask(case), flex_score_mod(case)
    flex = _compiled_flex()
    return lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention)
    return _FLEX


def run(case_list: list[Case], progress=None) -> list[Row]:
    rows: list[Row] = []
    for case in case_list:
        flops = case_flops(case)
        rows.append(run_fagen(case, flops))
        flex = () if case.modifier == "sinks" else ("flex",)  # (Flex has no sinks)
        peers = (flex if case.mask != "none" or case.modifier != "none" else PEERS_DENSE) + \
            ((FA4,) if case.mask in FA4_MASKS else ())
        for impl in peers:
            rows.append(run_peer(case, impl, flops))
        if progress:
            progress(case)
    return rows


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int, item=None) -> None:
        pass


def main(out: Path, md_path: Path, *, quick: bool = False, backward_only: bool = False, serving_only: bool = False,
         forward_only: bool = False, only: str | None = None, report: tuple[Part, Part] | None = None,
         progressbar=None) -> list[str]:
    """`fagen bench` once its arguments are parsed: run the cases (or take `report`, the
    (forward, backward) halves of an earlier run, from load_report) and write the report;
    the lines to print. Runs the forward sweep (cases(quick)) unless backward_only, and the
    backward cases (fagen.bench_backward.cases) in the full run or with backward_only (with
    quick: its small subset), and the serving cases (fagen.bench_serving) likewise with
    serving_only; forward_only runs the forward sweep alone. A part not run this time is kept
    from its JSON in `out`. only: a regular expression; just the cases whose key it finds run
    (pick_cases), their rows taking the place of the same cases' rows in the part's JSON in
    `out` (merge_rerun), so that a run too long for one sitting is made in several.
    progressbar(length, label): a context manager whose update(1, case) follows each case."""
    lines: list[str] = []
    if report is not None:
        forward, backward = report
    else:
        forward_cases = [] if backward_only or serving_only else cases(quick)
        backward_cases = bench_backward.cases(quick) if backward_only or not (quick or serving_only or forward_only) else []
        serving_cases = bench_serving.cases(quick) if serving_only or not (quick or backward_only or forward_only) else []
        if only is not None:
            forward_cases, backward_cases, serving_cases = pick_cases(only, forward_cases, backward_cases, serving_cases)
        env = environment_meta()
        mode = "quick" if quick else "full"
        forward = backward = serving = None
        total = len(forward_cases) + len(backward_cases) + len(serving_cases)
        with (progressbar or (lambda n, label: _NoBar()))(total, "bench") as bar:
            if forward_cases:
                rows = run(forward_cases, progress=lambda case: bar.update(1, case))
                forward = Part(rows, {**env, "cases": str(len(forward_cases)), "mode": mode}, fresh=True)
            if backward_cases:
                rows = bench_backward.run(backward_cases, progress=lambda case: bar.update(1, case))
                meta = {**env, "pass": "backward", "cases": str(len(backward_cases)), "mode": mode}
                if any(c.mask != "none" for c in backward_cases):
                    meta["masks"] = bench_backward.describe_masks()
                backward = Part(rows, meta, fresh=True)
            if serving_cases:
                rows = bench_serving.run(serving_cases, progress=lambda case: bar.update(1, case))
                meta = {**env, "pass": "serving", "cases": str(len(serving_cases)), "mode": mode}
                serving = Part(rows, meta, fresh=True)
        if only is not None:  # each part run in place of its cases' rows in the JSON kept in `out`
            forward, backward, serving = (
                part if part is None else merge_rerun(_sibling(out / name, reader), part, only)
                for part, name, reader in ((forward, "bench.json", read_json),
                                           (backward, BACKWARD_JSON, bench_backward.read_json),
                                           (serving, bench_serving.JSON, bench_serving.read_json)))
        kept = []
        if forward is None:
            forward = _sibling(out / "bench.json", read_json) or Part([], {})
            kept += [f"the forward tables from {out / 'bench.json'}"] if forward.rows else []
        if backward is None:
            backward = _sibling(out / BACKWARD_JSON, bench_backward.read_json) or Part([], {})
            kept += [f"the backward tables from {out / BACKWARD_JSON}"] if backward.rows else []
        if serving is None:
            serving = _sibling(out / bench_serving.JSON, bench_serving.read_json) or Part([], {})
            kept += [f"the serving tables from {out / bench_serving.JSON}"] if serving.rows else []
        lines += [f"kept {what} (not run this time)" for what in kept]
    if report is not None:  # redrawn from JSON: the serving part from `out`, beside the others
        serving = _sibling(out / bench_serving.JSON, bench_serving.read_json) or Part([], {})
    written = write_report(forward.rows, forward.meta, out, md_path, with_data=forward.fresh, backward=backward,
                           serving=serving)
    for r in forward.rows:
        if r.impl == "fagen":
            lines.append(f"{r.case:36} fagen {r.tflops or 0:7.1f} TFLOP/s  {r.note}")
    lines += bench_backward.summary_lines(backward.rows)
    lines += bench_serving.summary_lines(serving.rows)
    lines.append(f"wrote {', '.join(map(str, written))}")
    return lines


class CasePatternError(ValueError):
    """`fagen bench --only`'s pattern is no regular expression, or finds no case."""


def pick_cases(only: str, *parts: list) -> list[list]:
    """Each part's cases whose key the regular expression `only` finds; CasePatternError (naming
    the pattern, what is wrong and a key it could find) where it is no expression or finds none."""
    try:
        pattern = re.compile(only)
    except re.error as err:
        raise CasePatternError(f"--only {only!r} is no regular expression ({err}); e.g. --only 'd128-n4096'") from None
    picked = [[case for case in part if pattern.search(case.key)] for part in parts]
    if not any(picked):
        keys = [case.key for part in parts for case in part]
        raise CasePatternError(f"--only {only!r} finds none of the {len(keys)} cases' keys; they read like "
                               f"{keys[0]!r}" if keys else f"--only {only!r}: there are no cases to pick from")
    return picked


def merge_rerun(kept: Part | None, rerun: Part, only: str) -> Part:
    """`rerun`'s rows in place of `kept`'s rows of the same cases (a bench JSON read back), the
    rest of `kept` as it was, and its meta saying which cases were measured again, when and
    where; `rerun` itself where nothing was kept."""
    if kept is None or not kept.rows:
        return rerun
    cases = {row.case for row in rerun.rows}
    rows = [row for row in kept.rows if row.case not in cases] + rerun.rows
    note = f"{rerun.meta.get('date')} on {rerun.meta.get('gpu')}: {len(cases)} case{'s' * (len(cases) != 1)} matching {only!r}"
    remeasured = "; ".join(filter(None, (kept.meta.get("remeasured"), note)))
    return Part(rows, {**kept.meta, "remeasured": remeasured}, fresh=True)


# ---- writers (pure: unit-tested on synthetic rows) --------------------------------------------

def write_csv(rows: list, path: Path, row_type: type = Row) -> None:
    """A line per row, a column per field of row_type (Row, or bench_backward.BackwardRow)."""
    bench_rows.write_csv(rows, path, row_type)


@dataclass
class Part:
    """One half of the report, forward or backward: its rows and meta, and whether they were
    measured in this process (fresh: its JSON and CSV are written) or read from a JSON."""

    rows: list
    meta: dict
    fresh: bool = False


def write_report(rows: list[Row], meta: dict, out: Path, md_path: Path, *, with_data: bool,
                 backward: Part | None = None, serving: Part | None = None) -> list[Path]:
    """bench.json and bench.csv (with_data: a fresh run), a plot per head_dim of the dense
    cases, and the markdown table linking them; with `backward`, its section too
    (bench_backward.json and .csv where fresh, bench_backward.png); the paths written."""
    written = []
    if with_data:
        write_json(rows, out / "bench.json", meta)
        write_csv(rows, out / "bench.csv")
        written += [out / "bench.json", out / "bench.csv"]
    plots = []
    for d in sorted({r.head_dim for r in rows if r.mask == "none"}):
        plots.append(out / f"bench_d{d}.png")
        plot(rows, d, plots[-1])
    backward_plot = _write_part(backward, bench_backward, out, written)
    serving_plot = _write_part(serving, bench_serving, out, written)
    e2e = _sibling(out / bench_e2e_tables.JSON, bench_e2e_tables.read_json)  # kept: bench_e2e writes it
    flex = _sibling(out / bench_flex_tables.JSON, bench_flex_tables.read_json)  # likewise bench_flex
    fp8 = _sibling(out / bench_fp8.JSON, bench_fp8.read_json)  # and bench_fp8
    widths = _sibling(out / bench_head_widths.JSON, bench_head_widths.read_json)  # and bench_head_widths
    mla = _sibling(out / bench_mla.JSON, bench_mla.read_json)  # and bench_mla
    md_path.write_text(markdown(rows, meta, [str(p) for p in plots], md_path=md_path, backward=backward,
                                backward_plot=backward_plot, serving=serving, serving_plot=serving_plot, e2e=e2e,
                                flex=flex, fp8=fp8, widths=widths, mla=mla))
    return written + plots + [p for p in (backward_plot, serving_plot) if p] + [md_path]


def _write_part(part: Part | None, module, out: Path, written: list) -> Path | None:
    """A part beside the forward's (module: bench_backward or bench_serving): its JSON and CSV
    where fresh (added to `written`) and its plot; the plot's path, None for a part without rows."""
    if part is None or not part.rows:
        return None
    if part.fresh:
        written += module.write_data(part.rows, part.meta, out)
    path = out / module.PLOT
    module.plot(part.rows, path)
    return path


def read_json(path: Path, row_type: type = Row, fix: str = "pass a bench.json written by `fagen bench`"):
    """The rows (of row_type) and meta of a bench.json; ValueError (one line: what is wrong,
    what to pass) for a file that is not one."""
    return bench_rows.read_json(path, row_type, fix)


BACKWARD_JSON = bench_backward.JSON


def load_report(path: Path) -> tuple[Part, Part]:
    """(forward, backward) from an earlier run's JSON: `path` is a bench.json or a
    bench_backward.json (meta "pass": "backward"), and the other half is read from its folder
    where it is there. ValueError (one line) for a `path` that is neither."""
    fix = f"pass a bench.json or {BACKWARD_JSON} written by `fagen bench`"
    meta = bench_rows.read_json_object(path, fix).get("meta")
    if isinstance(meta, dict) and meta.get("pass") == "backward":
        backward = Part(*bench_backward.read_json(path, fix))
        return _sibling(Path(path).parent / "bench.json", read_json) or Part([], {}), backward
    forward = Part(*read_json(path, fix=fix))
    return forward, _sibling(Path(path).parent / BACKWARD_JSON, bench_backward.read_json) or Part([], {})


def _sibling(path: Path, reader) -> Part | None:
    """The other half of a report beside the one asked for: None where it is missing or unreadable."""
    if not path.is_file():
        return None
    try:
        return Part(*reader(path))
    except (ValueError, OSError):
        return None


def _fmt(r: Row | None) -> str:
    return "n/a" if r is None or r.tflops is None else f"{r.tflops:.0f}"


def _ratio(a: Row | None, b: Row | None) -> str:
    if a is None or b is None or a.tflops is None or b.tflops is None:
        return "n/a"
    return f"{a.tflops / b.tflops:.2f}x"


def _link(plot_path: str | Path, md_path: str | Path | None) -> str:
    """A plot's link as the markdown file at `md_path` should hold it: relative to that file's
    folder (an absolute path breaks once the repository moves), with forward slashes."""
    if md_path is None:
        return Path(plot_path).as_posix()
    md_dir = os.path.dirname(os.path.abspath(md_path))
    try:
        rel = os.path.relpath(os.path.abspath(plot_path), md_dir)
    except ValueError:  # another drive (Windows): no relative path exists
        return Path(plot_path).as_posix()
    return Path(rel).as_posix()


def markdown(rows: list[Row], meta: dict, plots: list[str], md_path: str | Path | None = None, *,
             backward: Part | None = None, backward_plot: str | Path | None = None, serving: Part | None = None,
             serving_plot: str | Path | None = None, e2e: Part | None = None, flex: Part | None = None,
             fp8: Part | None = None, widths: Part | None = None, mla: Part | None = None) -> str:
    """BENCHMARKS.md: meta, one table per head_dim (dense), one for masks, the plots; then,
    with `backward` rows, the backward section (fagen.bench_backward.markdown), the serving
    section, the end-to-end one (fagen.bench_e2e's, from its JSON), FlexAttention's API's
    (fagen.bench_flex's, likewise), FP8's (fagen.bench_fp8's), two head widths' (fagen.bench_head_widths')
    and MLA decode's (fagen.bench_mla's).
    With `md_path` (where
    the text will be written), plot links are relative to its folder."""
    out = ["# Benchmarks", ""]
    if rows or not (backward and backward.rows):
        out += _forward_markdown(rows, meta, plots, md_path)
    if backward is not None and backward.rows:
        link = None if backward_plot is None else _link(backward_plot, md_path)
        out += bench_backward.markdown(backward.rows, backward.meta, link)
    if serving is not None and serving.rows:
        out += bench_serving.markdown(serving.rows, serving.meta,
                                      None if serving_plot is None else _link(serving_plot, md_path))
    if e2e is not None and e2e.rows:
        out += bench_e2e_tables.markdown(e2e.rows, e2e.meta)
    if flex is not None and flex.rows:
        out += ["", *bench_flex_tables.markdown(flex.rows, flex.meta)]
    if fp8 is not None and fp8.rows:
        out += ["", *bench_fp8.markdown(fp8.rows, fp8.meta)]
    if widths is not None and widths.rows:
        out += ["", *bench_head_widths.markdown(widths.rows, widths.meta)]
    if mla is not None and mla.rows:
        out += ["", *bench_mla.markdown(mla.rows, mla.meta)]
    return "\n".join(out)


def _forward_markdown(rows: list[Row], meta: dict, plots: list[str], md_path: str | Path | None) -> list[str]:
    table = by_case(rows)
    out = ["Generated by `fagen bench` (do not edit; rerun it). TFLOP/s = 4·B·H·Nq·Nk·d / time, halved for "
           "causal; masked cases count kept (q, k) pairs only. B·N = 16k tokens, H·d = 2048. Every fagen "
           "kernel was checked against the float64 oracle before it was timed; median of 30 CUDA-event "
           "timings after warm-up, the calls queued behind a GPU hold so that each times its GPU work, not the "
           "host's (host time a call: the serving part's table; a document mask's fagen case: its launches "
           "packed once); peers timed the same way, in the same process.", ""]
    out += [f"- {k}: {v}" for k, v in sorted(meta.items())] + [""]
    dense = [r for r in rows if r.mask == "none" and r.impl == "fagen"]
    for d in sorted({r.head_dim for r in dense}):
        out += [f"## head_dim {d}", "", "| dtype | N | mask | fagen | SDPA FA2 | SDPA cuDNN | Flex | FA4 | fagen / FA2 "
                "| fagen / FA4 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sorted((r for r in dense if r.head_dim == d), key=lambda r: (r.dtype, r.causal, r.n)):
            t = table[r.case]
            out.append(f"| {r.dtype} | {r.n} | {'causal' if r.causal else 'none'} | {_fmt(r)} | "
                       f"{_fmt(t.get('sdpa_flash'))} | {_fmt(t.get('sdpa_cudnn'))} | {_fmt(t.get('flex'))} | "
                       f"{_fmt(t.get(FA4))} | {_ratio(r, t.get('sdpa_flash'))} | {_ratio(r, t.get(FA4))} |")
        out.append("")
    masked = [r for r in rows if r.mask != "none" and r.impl == "fagen"]
    if masked:
        out += ["## Masks (static-mask kernels, kept-work TFLOP/s)", "",
                "| dtype | d | N | mask | fagen | Flex | fagen / Flex | FA4 | fagen / FA4 |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sorted(masked, key=lambda r: (r.head_dim, r.mask, r.n)):
            t = table[r.case]
            out.append(f"| {r.dtype} | {r.head_dim} | {r.n} | {r.mask} | {_fmt(r)} | {_fmt(t.get('flex'))} | "
                       f"{_ratio(r, t.get('flex'))} | {_fmt(t.get(FA4))} | {_ratio(r, t.get(FA4))} |")
        out.append("")
    notes = [r for r in rows if r.note]
    if notes:
        out += ["## Notes", ""] + [f"- {r.case} {r.impl}: {r.note}" for r in notes] + [""]
    out += [f"![{Path(p).stem}]({_link(p, md_path)})" for p in plots] + [""]
    return out


def plot(rows: list[Row], head_dim: int, path: Path) -> None:
    """TFLOP/s against N, grouped bars per implementation, a panel per (dtype, causal): the
    FlashAttention papers' figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r.head_dim == head_dim and r.mask == "none"]
    panels = sorted({(r.dtype, r.causal) for r in sel})
    impls = [i for i in ("fagen", "sdpa_flash", "sdpa_cudnn", "flex", FA4) if any(r.impl == i for r in sel)]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.2 * max(1, len(panels)), 3.6), squeeze=False)
    for ax, (dtype, causal) in zip(axes[0], panels):
        ns = sorted({r.n for r in sel if r.dtype == dtype and r.causal == causal})
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = []
            for n in ns:
                match = [r for r in sel if (r.dtype, r.causal, r.n, r.impl) == (dtype, causal, n, impl)]
                vals.append(match[0].tflops or 0.0 if match else 0.0)
            ax.bar(np.arange(len(ns)) + i * width, vals, width, label=impl)
        ax.set_xticks(np.arange(len(ns)) + 0.4 - width / 2)
        ax.set_xticklabels([f"{n // 1024}k" if n >= 1024 else str(n) for n in ns])
        ax.set_title(f"d={head_dim} {dtype} {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment_meta() -> dict:
    import datetime

    import cupy
    import torch

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return {
        "gpu": props["name"].decode(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "cupy": cupy.__version__,
        "cuda_runtime": str(cupy.cuda.runtime.runtimeGetVersion()),
        "driver": str(cupy.cuda.runtime.driverGetVersion()),
    }


# ---- the Core issue's single timing -----------------------------------------------------------

@dataclass
class Timing:
    kernel: str
    b: int
    h: int
    n: int
    d: int
    causal: bool
    ms: float
    tflops: float


def time_spec(spec: AttentionSpec, b: int, h: int, nq: int, nk: int | None = None, *, check: bool = True) -> Timing:
    """Check `spec` against the oracle on a smaller problem (unless the caller already did:
    check=False), then time it on this one."""
    nk = nq if nk is None else nk
    result = check_against_oracle(spec, 1, 2, 2, min(nq, 777), min(nk, 777), framework="torch") if check else None
    if result is not None and not result.passed:
        raise AssertionError(f"refusing to time a wrong kernel: {result.summary()}")
    kernel = compile_kernel(spec)
    q, k, v, out = random_inputs("torch", spec.dtype, b, h, h, nq, nk, spec.head_dim)
    ms = time_ms(lambda: kernel(q, k, v, out=out), warmup=10, iters=30)
    flops = attention_flops(b, h, nq, nk, spec.head_dim, spec.causal)
    return Timing(spec.name, b, h, nq, spec.head_dim, spec.causal, ms, flops / ms / 1e9)


def time_fagen(spec: AttentionSpec, b: int, h: int, n: int) -> Timing:
    return time_spec(spec, b, h, n, n)


def time_sdpa(backend: str, dtype: str, b: int, h: int, n: int, d: int, causal: bool) -> Timing | None:
    """One of PyTorch's SDPA backends at an explicit shape; None where it does not run it."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, _ = random_inputs("torch", dtype, b, h, h, n, n, d)
    fn = torch.nn.functional.scaled_dot_product_attention
    try:
        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[backend])):
            ms = time_ms(lambda: fn(q, k, v, is_causal=causal))
    except RuntimeError:
        return None
    return Timing(backend, b, h, n, d, causal, ms, attention_flops(b, h, n, n, d, causal) / ms / 1e9)
