"""fagen's command line: render, list, compile (nvcc, offline) and check (on the GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from fagen.plan import plan
from fagen.render import (
    GENERATED,
    MERGE_DTYPES,
    SPECS,
    generated_path,
    merge_name,
    render,
    render_merge,
)
from fagen.spec import SpecError, load_spec


def _spec_files(paths: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths or (str(SPECS),)):
        files.extend(sorted(p.glob("*.yaml")) if p.is_dir() else [p])
    return files


def _load(path: Path):
    try:
        return load_spec(path)
    except SpecError as err:
        raise click.ClickException(str(err)) from None


@click.group()
@click.version_option(package_name="fagen")
def main() -> None:
    """fagen: fused attention kernels generated from YAML specs."""


@main.command("render")
@click.argument("specs", nargs=-1, type=click.Path(exists=True))
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), default=str(GENERATED),
              show_default=True, help="where <name>.cu files go")
@click.option("--check", is_flag=True, help="write nothing; exit 1 if OUT differs from a fresh render")
def render_cmd(specs: tuple[str, ...], out_dir: str, check: bool) -> None:
    """Render SPECS (files or folders; default specs/) to OUT/<name>.cu."""
    out = Path(out_dir)
    stale = []
    names = set()
    for path in _spec_files(specs):
        spec = _load(path)
        names.add(f"{spec.name}.cu")
        target, text = generated_path(spec, out), render(spec)
        if check:
            if not target.exists() or target.read_text() != text:
                stale.append(f"{target} is {'missing' if not target.exists() else 'out of date'}")
        else:
            out.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            click.echo(f"{path} -> {target}")
    if all(Path(p).is_dir() for p in specs):  # whole folders: the merge kernels come along
        for dtype in MERGE_DTYPES:
            target, text = out / f"{merge_name(dtype)}.cu", render_merge(dtype)
            names.add(target.name)
            if check and (not target.exists() or target.read_text() != text):
                stale.append(f"{target} is {'missing' if not target.exists() else 'out of date'}")
            elif not check:
                out.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
    if check:
        if all(Path(p).is_dir() for p in specs):  # whole folders: OUT must hold nothing else
            stale += [f"{f} has no spec in specs/" for f in sorted(out.glob("*.cu")) if f.name not in names]
        if stale:
            click.echo("\n".join(stale) + "\nrun `fagen render` to regenerate", err=True)
            sys.exit(1)
        click.echo(f"{out}: {len(names)} kernels current")


@main.command("list")
@click.argument("specs", nargs=-1, type=click.Path(exists=True))
def list_cmd(specs: tuple[str, ...]) -> None:
    """Each spec with its derived launch and layout numbers."""
    head = f"{'name':40} {'dtype':9} {'d':>4} {'Br x Bc':>9} {'threads':>7} {'kv_slots':>8} {'smem':>7} {'regs~':>5}  mask"
    click.echo(head)
    for path in _spec_files(specs):
        spec = _load(path)
        p = plan(spec)
        click.echo(f"{spec.name:40} {spec.dtype:9} {p.head_dim:>4} {f'{p.block_q}x{p.block_kv}':>9} "
                   f"{p.threads:>7} {p.kv_slots:>8} {p.smem_bytes:>7} {p.predicted_registers:>5}  {spec.mask}")


@main.command("compile")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--arch", default=None, help="sm_80, sm_86, sm_89, sm_90 or sm_90a  [default: sm_90, sm_90a for "
              "an sm_90a spec]")
@click.option("-v", "--verbose", is_flag=True, help="print the whole ptxas report")
def compile_cmd(spec: str, arch: str | None, verbose: bool) -> None:
    """Compile SPEC offline with nvcc and print registers, shared memory and spills."""
    from fagen.nvcc import compile_offline, targets

    s = _load(Path(spec))
    arch = arch or targets(s)[-1]
    try:
        r = compile_offline(s, arch)
    except RuntimeError as err:
        raise click.ClickException(str(err)) from None
    if verbose:
        click.echo(r.log)
    click.echo(f"{s.name} {arch}: {r.registers} registers, {plan(s).smem_bytes} bytes dynamic smem, "
               f"{r.stack_frame} bytes stack frame, {r.spill_stores}/{r.spill_loads} bytes spilled (stores/loads)")
    if r.spill_stores or r.spill_loads or r.stack_frame:
        sys.exit(1)


@main.command("check")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--shape", default="2,8,1000,1000", show_default=True, help="B,H,Nq,Nk")
@click.option("--kv-heads", type=int, default=None, help="Hkv (default: H)")
@click.option("--seed", type=int, default=None)
def check_cmd(spec: str, shape: str, kv_heads: int | None, seed: int | None) -> None:
    """Run SPEC on the GPU against the float64 oracle; print the error and the time."""
    from fagen.check import check_against_oracle

    s = _load(Path(spec))
    try:
        b, h, nq, nk = (int(x) for x in shape.split(","))
    except ValueError:
        raise click.ClickException(f"--shape {shape!r}: expected four integers B,H,Nq,Nk") from None
    result = check_against_oracle(s, b, h, kv_heads or h, nq, nk, seed=seed, time_it=True)
    click.echo(result.summary())
    if not result.passed:
        sys.exit(1)


@main.command("tune")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--shape", default="4,16,4096,4096", show_default=True, help="B,H,Nq,Nk to time on")
@click.option("--quick", is_flag=True, help="a small part of the space")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), default=str(SPECS), show_default=True)
@click.option("--dry-run", is_flag=True, help="list the candidates the validator accepts, run nothing")
def tune_cmd(spec: str, shape: str, quick: bool, out_dir: str, dry_run: bool) -> None:
    """Sweep SPEC's tiling and pipeline; write the fastest correct one as <name>_<gpu>.yaml."""
    from fagen import tune

    base = _load(Path(spec))
    specs, refused = tune.candidates(base, quick)
    click.echo(f"{len(specs)} candidates ({refused} refused by the validator: smem, registers, tiling)")
    if dry_run:
        for s in specs:
            click.echo(f"  {s.name}")
        return
    b, h, nq, nk = (int(x) for x in shape.split(","))
    with click.progressbar(length=len(specs), label="tuning", show_pos=True) as bar:
        def progress(c):
            bar.update(1)
        results = tune.tune(base, b, h, nq, nk, quick=quick, progress=progress)
    for c in results[:10]:
        click.echo(f"{c.spec.name:60} " + (f"{c.ms:8.3f} ms {c.tflops:7.1f} TFLOP/s" if c.ms else f"FAILED {c.error}"))
    if results and results[0].ms:
        path = tune.write_tuned(results[0], base, (b, h, nq, nk), Path(out_dir), tune.gpu_slug())
        click.echo(f"best -> {path} (run `fagen render` to add it to generated/)")


@main.group("mask")
def mask_group() -> None:
    """Block masks: build one from a ready-made kind and look at it."""


@mask_group.command("show")
@click.argument("kind", type=click.Choice(["causal", "sliding_window", "document", "prefix_lm", "chunked"]))
@click.option("-n", "--length", default=4096, show_default=True, help="sequence length (Nq = Nk)")
@click.option("--block", default=128, show_default=True, help="mask block size (queries and keys)")
@click.option("--window", default=1024, show_default=True, help="sliding_window: keys before the diagonal")
@click.option("--docs", default=8, show_default=True, help="document: documents of random lengths")
@click.option("--prefix", default=1024, show_default=True, help="prefix_lm: prefix length")
@click.option("--chunk", default=1024, show_default=True, help="chunked: chunk size")
@click.option("-o", "--out", "out_path", default=None, help="PNG path (default: <kind>.png)")
def mask_show_cmd(kind, length, block, window, docs, prefix, chunk, out_path) -> None:
    """Write a PNG of a block mask's FULL / CAUSAL / PARTIAL / MASKED blocks; print its sparsity."""
    import numpy as np

    from fagen import masks

    if kind == "causal":
        bm = masks.causal(length, q_block=block, kv_block=block)
    elif kind == "sliding_window":
        bm = masks.sliding_window(length, window, 0, block, block)
    elif kind == "document":
        cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, length), docs - 1, replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [length]])).tolist()
        bm = masks.document(masks.documents_of_lengths(lengths), True, block, block)
    elif kind == "prefix_lm":
        bm = masks.prefix_lm(length, prefix, block, block)
    else:
        bm = masks.chunked(length, chunk, block, block)
    path = out_path or f"{kind}.png"
    click.echo(masks.show(bm, path))
    click.echo(f"wrote {path}")


@main.command("bench")
@click.option("--quick", is_flag=True, help="a small subset (under a minute)")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), default="bench", show_default=True,
              help="where bench.json, bench.csv and the plots go")
@click.option("--markdown", "md_path", default="BENCHMARKS.md", show_default=True, help="the table to regenerate")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False), default=None,
              help="redraw plots and the table from an earlier run's bench.json (no GPU)")
def bench_cmd(quick: bool, out_dir: str, md_path: str, from_json: str | None) -> None:
    """Check, then time fagen beside SDPA (FlashAttention-2, cuDNN) and FlexAttention."""
    from fagen import bench

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if from_json:
        rows, meta = bench.read_json(Path(from_json))
    else:
        case_list = bench.cases(quick)
        meta = {**bench.environment_meta(), "cases": str(len(case_list)), "mode": "quick" if quick else "full"}
        with click.progressbar(length=len(case_list), label="bench", show_pos=True,
                               item_show_func=lambda c: c.key if c else "") as bar:
            rows = bench.run(case_list, progress=lambda case: bar.update(1, case))
        bench.write_json(rows, out / "bench.json", meta)
        bench.write_csv(rows, out / "bench.csv")
    plots = []
    for d in sorted({r.head_dim for r in rows if r.mask == "none"}):
        path = out / f"bench_d{d}.png"
        bench.plot(rows, d, path)
        plots.append(str(path))
    Path(md_path).parent.mkdir(parents=True, exist_ok=True)
    Path(md_path).write_text(bench.markdown(rows, meta, plots, md_path=md_path))
    for r in rows:
        if r.impl == "fagen":
            click.echo(f"{r.case:36} fagen {r.tflops or 0:7.1f} TFLOP/s  {r.note}")
    data = "" if from_json else f"{out / 'bench.json'}, {out / 'bench.csv'}, "
    click.echo(f"wrote {data}{md_path} and {len(plots)} plots")


@main.command("launch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-n", "--nproc", type=int, required=True, help="processes: one per GPU")
@click.option("--timeout", type=float, default=None, help="stop every rank after this many seconds")
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch_cmd(nproc: int, timeout: float | None, script: str, args: tuple[str, ...]) -> None:
    """Run SCRIPT once per GPU with RANK / WORLD_SIZE / LOCAL_RANK set (torchrun's names);
    fagen.distributed.init() joins them. A failing rank stops the others and is reported."""
    from fagen.distributed import launch

    sys.exit(launch(nproc, [script, *args], timeout))
