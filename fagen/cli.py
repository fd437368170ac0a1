"""fagen's command line: render, list, compile (nvcc, offline) and check (on the GPU).

Paths are the user's: with no spec arguments, `render` and `list` read ./specs, and outputs
default to ./generated (render) and ./specs (tune), relative to the working directory (in a
checkout, its root). Every user error ends in one line (click's `Error: ...`), never a traceback.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import click

from fagen.load import load_spec
from fagen.plan import plan
from fagen.rendering import outputs, stale
from fagen.spec import SpecError

SPECS_DIR = Path("specs")  # relative: the working directory's
GENERATED_DIR = Path("generated")


def _spec_paths(paths: tuple[str, ...]) -> list[Path]:
    """The spec arguments, or ./specs when there are none."""
    if paths:
        return [Path(p) for p in paths]
    if not SPECS_DIR.is_dir():
        command = click.get_current_context().info_name
        raise click.ClickException(f"no {SPECS_DIR}/ folder in {Path.cwd()}: pass a spec file or folder "
                                   f"(fagen {command} path/to/spec.yaml), or run from a checkout's root")
    return [SPECS_DIR]


def _spec_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(p.glob("*.yaml"))
            if not found:
                raise click.ClickException(f"{p}: no *.yaml spec in this folder; pass a spec file or a folder "
                                           f"of specs")
            files.extend(found)
        else:
            files.append(p)
    return files


def _load(path: Path):
    try:
        return load_spec(path)
    except SpecError as err:
        raise click.ClickException(str(err)) from None


def _load_all(files: list[Path]) -> list:
    """Every spec, or one error naming each that fails (a line each) and how many did."""
    if len(files) == 1:
        return [_load(files[0])]
    specs, errors = [], []
    for path in files:
        try:
            specs.append(load_spec(path))
        except SpecError as err:
            text = " ".join(line.strip() for line in str(err).splitlines())
            errors.append(text if str(path) in text else f"{path}: {text}")
    if errors:
        raise click.ClickException(f"{len(errors)} of {len(files)} specs refused, nothing done:\n  "
                                   + "\n  ".join(errors))
    return specs


def _check_folder(path: Path, option: str) -> None:
    """An output folder must be one, or be creatable: its nearest existing parent a writable folder."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        what = "is a file" if probe == path else f"is under the file {probe}"
        raise click.BadParameter(f"{path}: {what}, not a folder; pass a folder", param_hint=_hint(option))
    if not os.access(probe, os.W_OK):
        raise click.BadParameter(f"{path}: {probe} is not writable; pass a folder you can write to",
                                 param_hint=_hint(option))


def _hint(option: str) -> str:
    """How click names an option in its errors: '-o' / '--out'."""
    return {"-o": "'-o' / '--out'"}.get(option, f"'{option}'")


def _make_folder(path: Path, option: str) -> None:
    _check_folder(path, option)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise click.ClickException(f"cannot create the folder {path} for {option} ({err.strerror}); "
                                   f"pass a folder you can write to") from None


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as err:
        raise click.ClickException(f"cannot write {path} ({err.strerror}); pass a folder you can write to") from None


class Shape(click.ParamType):
    """B,H,Nq,Nk: four integers, each at least 1 (`fagen check` and `fagen tune`)."""

    name = "B,H,Nq,Nk"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        fix = "write B,H,Nq,Nk as four positive integers, e.g. 2,8,1024,1024"
        fields = str(value).split(",")
        if len(fields) != 4:
            self.fail(f"{value!r}: {len(fields)} field{'s' if len(fields) != 1 else ''}, expected B,H,Nq,Nk; "
                      f"{fix}", param, ctx)
        try:
            shape = tuple(int(f) for f in fields)
        except ValueError:
            self.fail(f"{value!r}: B,H,Nq,Nk must be integers; {fix}", param, ctx)
        small = [n for n, v in zip(("B", "H", "Nq", "Nk"), shape) if v < 1]
        if small:
            self.fail(f"{value!r}: {', '.join(small)} must be at least 1; {fix}", param, ctx)
        return shape


SHAPE = Shape()


def _at_least(lowest: int, fix: str):
    """A callback refusing values below `lowest`: "VALUE: must be at least LOWEST; FIX"."""
    def check(ctx, param, value):
        if value is not None and value < lowest:
            raise click.BadParameter(f"{value}: must be at least {lowest}; {fix}", ctx, param)
        return value
    return check


def _need_gpu(torch: bool = False) -> None:
    from fagen.device import gpu_missing

    why = gpu_missing(torch)
    if why:
        raise click.ClickException(why)


def one_line(message: str) -> str:
    """A message of several lines (a spec breaking several rules, several refused specs) as one:
    its lines joined by '; ' (after a line ending in ':', by a space)."""
    parts = [line.strip().removeprefix("- ") for line in message.splitlines() if line.strip()]
    text = parts[0] if parts else ""
    for part in parts[1:]:
        text += (" " if text.endswith(":") else "; ") + part
    return text


class _Commands(click.Group):
    """fagen's command group: a user error is one line on stderr, `Error: ...`, exit 2 for a bad
    option, argument or command (click would print the usage and a help hint above a usage error)
    and 1 otherwise; `--help` says the rest."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            # standalone_mode=False hands click's errors here instead of printing them; a command's
            # own sys.exit passes through
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as err:
            click.echo(f"Error: {one_line(err.format_message())}", err=True)
            sys.exit(err.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_Commands)
@click.version_option(package_name="fagen")
def main() -> None:
    """fagen: fused attention kernels generated from YAML specs."""


@main.command("render")
@click.argument("specs", nargs=-1, type=click.Path(exists=True))
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), default=str(GENERATED_DIR),
              show_default=True, help="where <name>.cu files go (relative to the working directory)")
@click.option("--check", is_flag=True, help="write nothing; exit 1 if OUT differs from a fresh render")
def render_cmd(specs: tuple[str, ...], out_dir: str, check: bool) -> None:
    """Render SPECS (files or folders; default ./specs) to OUT/<name>.cu.

    Every spec is validated first: if one fails, nothing is written."""
    out = Path(out_dir)
    paths = _spec_paths(specs)
    folders = all(p.is_dir() for p in paths)
    files = _spec_files(paths)
    specs_loaded = _load_all(files)
    try:  # two outputs of one file are refused here, before anything is written or called current
        listed = outputs(specs_loaded, out, with_merge=folders, sources=files)
    except SpecError as err:
        raise click.ClickException(str(err)) from None
    texts = {o.path: o.text() for o in listed}
    if not check:
        _make_folder(out, "-o")
        for o in listed:
            _write(o.path, texts[o.path])
            if o.spec_file is not None:
                click.echo(f"{o.spec_file} -> {o.path}")
        return
    found = stale(texts, out, whole_folder=folders)
    where = " or ".join(f"{p}/" for p in paths)
    lines = [f"{f} is {why}" for f, why in found if why != "orphan"]
    lines += ["run `fagen render` to regenerate"] if lines else []
    lines += [f"{f} has no spec in {where}: delete it (git rm {f}) or add {paths[0] / f.stem}.yaml"
              for f, why in found if why == "orphan"]
    if lines:
        click.echo("\n".join(lines), err=True)
        sys.exit(1)
    click.echo(f"{out}: {len(texts)} files current")


@main.command("list")
@click.argument("specs", nargs=-1, type=click.Path(exists=True))
def list_cmd(specs: tuple[str, ...]) -> None:
    """Each spec (files or folders; default ./specs) with its derived launch and layout numbers."""
    loaded = _load_all(_spec_files(_spec_paths(specs)))
    head = f"{'name':40} {'dtype':9} {'d':>4} {'Br x Bc':>9} {'threads':>7} {'kv_slots':>8} {'smem':>7} {'regs~':>5}  mask"
    click.echo(head)
    for spec in loaded:
        p = plan(spec)
        click.echo(f"{spec.name:40} {spec.dtype:9} {p.head_dim:>4} {f'{p.block_q}x{p.block_kv}':>9} "
                   f"{p.threads:>7} {p.kv_slots:>8} {p.smem_bytes:>7} {p.predicted_registers:>5}  {spec.mask}")


@main.command("compile")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--arch", default=None, help="sm_80, sm_86, sm_89 or sm_90 from the spec's arch up; sm_90a for an "
              "sm_90a spec  [default: sm_90, sm_90a for an sm_90a spec]")
@click.option("-v", "--verbose", is_flag=True, help="print the whole ptxas report")
def compile_cmd(spec: str, arch: str | None, verbose: bool) -> None:
    """Compile every kernel SPEC renders (the forward; with backward:, its kernels too) offline
    with nvcc and print each one's registers, stack frame, spills and SASS instructions (its
    code's size); exit 1 if any spills."""
    from fagen.nvcc import arch_error, compile_all, targets

    s = _load(Path(spec))
    arch = arch or targets(s)[-1]
    why = arch_error(s, arch)
    if why:
        raise click.BadParameter(why, param_hint="'--arch'")
    try:
        kernels = compile_all(s, arch)
    except RuntimeError as err:
        raise click.ClickException(str(err)) from None
    for k in kernels:
        if verbose:
            click.echo(k.resources.log)
        r = k.resources
        click.echo(f"{s.name} {r.arch}: {k.symbol} ({k.label}): {r.registers} registers, "
                   + (f"{plan(s).smem_bytes} bytes dynamic smem, " if k.file == "forward" else "")
                   + f"{r.stack_frame} bytes stack frame, {r.spill_stores}/{r.spill_loads} bytes spilled (stores/loads), "
                   + f"{r.instructions} SASS instructions")
    spilled = [f"{k.symbol} ({k.label})" for k in kernels if not k.clean]
    if spilled:
        click.echo(f"Error: {s.name}: {', '.join(spilled)} spill or use a stack frame on {arch}", err=True)
        sys.exit(1)


@main.command("check")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--shape", type=SHAPE, default="2,8,1000,1000", show_default=True, help="B,H,Nq,Nk")
@click.option("--kv-heads", type=int, default=None, callback=_at_least(1, "use a divisor of H"),
              help="Hkv, a divisor of H (default: H)")
@click.option("--seed", type=int, default=None)
def check_cmd(spec: str, shape: tuple[int, int, int, int], kv_heads: int | None, seed: int | None) -> None:
    """Run SPEC on the GPU against the float64 oracle; print the error and the time."""
    b, h, nq, nk = shape
    if kv_heads is not None and h % kv_heads:
        raise click.BadParameter(f"{kv_heads}: must divide H = {h} (each KV head serves H / Hkv query heads); "
                                 f"use a divisor of {h}", param_hint="'--kv-heads'")
    s = _load(Path(spec))
    _need_gpu(torch=not s.element.in_cupy)  # CuPy arrays where CuPy has the type, else PyTorch tensors
    from fagen.check import check_against_oracle

    result = check_against_oracle(s, b, h, kv_heads or h, nq, nk, seed=seed, time_it=True)
    click.echo(result.summary())
    if not result.passed:
        sys.exit(1)


@main.command("tune")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--shape", type=SHAPE, default="4,16,4096,4096", show_default=True, help="B,H,Nq,Nk to time on")
@click.option("--quick", is_flag=True, help="a small part of the space")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), default=str(SPECS_DIR), show_default=True,
              help="where <name>_<gpu>.yaml goes (relative to the working directory)")
@click.option("--dry-run", is_flag=True, help="list the candidates the validator accepts, run nothing (no GPU)")
@click.option("--backward", is_flag=True,
              help="tune the backward: section (the backward alone is timed; the forward's tiling stays SPEC's)")
@click.option("--long", "long_class", is_flag=True,
              help="tune for long sequences: write <name>_long_<gpu>.yaml, which fagen.attention takes from "
                   "2048 keys on (time at such a --shape)")
def tune_cmd(spec: str, shape: tuple[int, int, int, int], quick: bool, out_dir: str, dry_run: bool,
             backward: bool, long_class: bool) -> None:
    """Sweep SPEC's tiling and pipeline (or, --backward, its backward's); write the fastest
    correct one as <name>_<gpu>.yaml (a SPEC already named for this GPU keeps its name)."""
    from fagen import device, tune
    from fagen.variants import LONG_KEYS

    base = _load(Path(spec))
    if long_class and backward:
        raise click.BadParameter("a long class is a forward spec of its own; tune --backward without it",
                                 param_hint="'--long'")
    if long_class and min(shape[2], shape[3]) < LONG_KEYS:
        raise click.BadParameter(f"{','.join(map(str, shape))}: --long times at {LONG_KEYS} or more queries and "
                                 f"keys; use e.g. --shape 4,16,4096,4096", param_hint="'--shape'")
    if not dry_run:  # refuse before the sweep, not after it
        _need_gpu(torch=True)
        _check_folder(Path(out_dir), "-o")
    specs, refused = (tune.backward_candidates if backward else tune.candidates)(base, quick)
    click.echo(f"{len(specs)} candidates ({refused} refused by the validator: smem, registers, tiling)")
    if dry_run:
        for s in specs:
            click.echo(f"  {s.name}")
        return
    if not specs:
        raise click.ClickException(f"{base.name}: the validator refused every candidate; nothing to time")
    b, h, nq, nk = shape
    with click.progressbar(length=len(specs), label="tuning", show_pos=True) as bar:
        def progress(c):
            bar.update(1)
        results = (tune.tune_backward if backward else tune.tune)(base, b, h, nq, nk, quick=quick, progress=progress)
    for c in results[:10]:
        click.echo(f"{c.spec.name:60} " + (f"{c.ms:8.3f} ms {c.tflops:7.1f} TFLOP/s" if c.ms else f"FAILED {c.error}"))
    if not (results and results[0].ms):
        raise click.ClickException(f"no candidate of {base.name} passed the oracle check and ran; nothing written "
                                   f"(errors above)")
    notes = (f"shape class: long sequences (fagen.attention takes this spec from {LONG_KEYS} keys on)",) \
        if long_class else ()
    if not backward and results[0].spec.warp_specialized:  # a choice over the class's sequence lengths
        lengths = tune.scheduler_lengths(long_class)
        click.echo("choosing the tile scheduler over sequence lengths " + ", ".join(map(str, lengths)))
        choice = tune.choose_scheduler(results[0].spec, lengths=lengths)
        results[0].spec, notes = choice.spec, notes + (choice.summary(),)
        click.echo(choice.summary())
    try:
        path = tune.write_tuned(results[0], base, shape, Path(out_dir), device.gpu_slug(), backward=backward,
                                notes=notes, long=long_class)
    except OSError as err:
        raise click.ClickException(f"cannot write the tuned spec to {out_dir} ({err.strerror}); the best was "
                                   f"{results[0].spec.name}") from None
    click.echo(f"best -> {path} (run `fagen render` to add it to generated/)")


@main.group("mask")
def mask_group() -> None:
    """Block masks: build one from a ready-made kind and look at it."""


# `mask show` builds the mask on the host: a dense bool of the padded Nq x Nk (BlockMask.to_dense,
# for the sparsity), four int32 tables and a type grid a block, and at most a packed bit pattern
# a block row. A Python loop classifies each block, and the picture is at most ~700 pixels a side.
MASK_SHOW_MAX_BYTES = 2 << 30
MASK_SHOW_MAX_BLOCKS = 1024 * 1024


def _mask_show_bytes(n: int, block: int) -> int:
    """Host bytes `fagen mask show` needs for an n x n mask in block x block blocks (an upper bound)."""
    blocks = -(-n // block)
    padded = blocks * block
    return padded * padded + 20 * blocks * blocks + padded * blocks * 4 * -(-block // 32)


def _mask_show_max_n(block: int) -> int:
    """The largest -n (a multiple of 1024) under the cap with blocks of `block` (or of n, if smaller)."""
    n = math.isqrt(MASK_SHOW_MAX_BYTES) // 1024 * 1024
    while n > 1024 and _mask_show_bytes(n, min(block, n)) > MASK_SHOW_MAX_BYTES:
        n -= 1024
    return n


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _png_path(ctx, param, value):
    if value is None:
        return value
    path = Path(value)
    if path.is_dir():
        raise click.BadParameter(f"{value}: is a folder; name a file in it, e.g. {path / 'mask.png'}", ctx, param)
    if not path.name.lower().removesuffix(".png").strip("."):  # ".png" is a hidden file's name, not a picture's
        raise click.BadParameter(f"{value}: names no file before .png; name one, e.g. {path.parent / 'mask.png'}",
                                 ctx, param)
    if path.suffix.lower() != ".png":
        raise click.BadParameter(f"{value}: must end in .png (the picture is a PNG); use e.g. "
                                 f"{path.with_name(path.stem + '.png')}", ctx, param)
    folder = path.parent
    if not folder.exists():
        raise click.BadParameter(f"{value}: the folder {folder} does not exist; create it (mkdir -p {folder}) "
                                 f"or write elsewhere", ctx, param)
    if not folder.is_dir():
        raise click.BadParameter(f"{value}: {folder} is a file, not a folder; write elsewhere", ctx, param)
    if not os.access(folder, os.W_OK):
        raise click.BadParameter(f"{value}: the folder {folder} is not writable; write elsewhere", ctx, param)
    return value


@mask_group.command("show")
@click.argument("kind", type=click.Choice(["causal", "sliding_window", "document", "prefix_lm", "chunked"]))
@click.option("-n", "--length", default=4096, show_default=True, callback=_at_least(1, "use e.g. -n 4096"),
              help="sequence length (Nq = Nk)")
@click.option("--block", default=128, show_default=True, callback=_at_least(1, "use e.g. --block 128"),
              help="mask block size (queries and keys)")
@click.option("--window", default=1024, show_default=True, callback=_at_least(0, "use e.g. --window 1024"),
              help="sliding_window: keys before the diagonal")
@click.option("--docs", default=8, show_default=True, callback=_at_least(1, "use e.g. --docs 8"),
              help="document: documents of random lengths (at most -n)")
@click.option("--prefix", default=1024, show_default=True, callback=_at_least(0, "use e.g. --prefix 1024"),
              help="prefix_lm: prefix length")
@click.option("--chunk", default=1024, show_default=True, callback=_at_least(1, "use e.g. --chunk 1024"),
              help="chunked: chunk size")
@click.option("-o", "--out", "out_path", default=None, callback=_png_path,
              help="PNG path, in an existing folder (default: <kind>.png)")
def mask_show_cmd(kind, length, block, window, docs, prefix, chunk, out_path) -> None:
    """Write a PNG of a block mask's FULL / CAUSAL / PARTIAL / MASKED blocks; print its sparsity."""
    need = _mask_show_bytes(length, block)
    if need > MASK_SHOW_MAX_BYTES and _mask_show_bytes(length, min(block, length)) <= MASK_SHOW_MAX_BYTES:
        raise click.BadParameter(f"{block}: one block pads -n {length} to {block}x{block}, {_gib(need)} of host "
                                 f"memory, over the cap of {_gib(MASK_SHOW_MAX_BYTES)}; use --block {length} or "
                                 f"less", param_hint="'--block'")
    if need > MASK_SHOW_MAX_BYTES:
        most, padded = _mask_show_max_n(block), -(-length // block) * block
        raise click.BadParameter(f"{length}: the mask would take {_gib(need)} of host memory (a dense {padded}x"
                                 f"{padded} bool and block tables), over the cap of {_gib(MASK_SHOW_MAX_BYTES)}; "
                                 f"use -n {most} or less" + (f" with --block {most} or less" if block > most else ""),
                                 param_hint="'-n' / '--length'")
    blocks = -(-length // block)
    if blocks * blocks > MASK_SHOW_MAX_BLOCKS:
        side = int(MASK_SHOW_MAX_BLOCKS ** 0.5)
        raise click.BadParameter(f"{block}: -n {length} makes {blocks}x{blocks} blocks, over the cap of "
                                 f"{side}x{side} (each is classified in Python, and the picture cannot show "
                                 f"more); use --block {-(-length // side)} or more", param_hint="'--block'")
    if kind == "document" and docs > length:
        raise click.BadParameter(f"{docs}: more documents than positions (-n {length}); use --docs {length} or "
                                 f"fewer", param_hint="'--docs'")
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
    try:
        summary = masks.show(bm, path)
    except OSError as err:
        raise click.ClickException(f"cannot write {path} ({err.strerror}); pass -o PATH.png in a folder you can "
                                   f"write to") from None
    click.echo(summary)
    click.echo(f"wrote {path}")


@main.command("bench")
@click.option("--quick", is_flag=True, help="a small subset (under a minute); the forward only, unless --backward")
@click.option("--backward", is_flag=True, help="the backward only (fagen, SDPA FA2 and cuDNN, Flex on masks; "
              "the full run includes it); the forward tables are kept from OUT/bench.json")
@click.option("--serving", is_flag=True, help="the serving cases only (decode against SDPA, paged against contiguous, "
              "varlen against padded; the full run includes them); the other tables are kept from OUT")
@click.option("--forward", is_flag=True, help="the forward sweep only (the backward and serving tables kept from -o's JSON)")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), default="bench", show_default=True,
              help="where bench.json, bench_backward.json, bench_serving.json, their CSVs and the plots go")
@click.option("--markdown", "md_path", default="BENCHMARKS.md", show_default=True, help="the table to regenerate")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False), default=None,
              help="redraw plots and the table from an earlier run's bench.json or bench_backward.json (and the "
                   "other beside it), no GPU")
@click.option("--only", "only", default=None, metavar="REGEX",
              help="just the cases whose key (e.g. float16-d128-n4096-causal) the expression finds; their rows take "
                   "the place of the same cases' rows in -o's JSON, the rest kept: a long run made in parts")
def bench_cmd(quick: bool, backward: bool, serving: bool, forward: bool, out_dir: str, md_path: str,
              from_json: str | None, only: str | None) -> None:
    """Check, then time fagen beside SDPA (FlashAttention-2, cuDNN) and FlexAttention: the forward
    sweep, the backward cases and the serving cases (--forward, --backward, --serving: that alone)."""
    from fagen import bench

    out, md = Path(out_dir), Path(md_path)
    report = None
    if from_json:
        if quick or backward or serving or forward or only is not None:
            picked = ("--quick" if quick else "--backward" if backward else "--serving" if serving else "--forward"
                      if forward else "--only")
            raise click.UsageError(f"{picked} picks cases to run; --from-json runs none: leave one out")
        try:
            report = bench.load_report(Path(from_json))
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="'--from-json'") from None
    else:
        _need_gpu(torch=True)
    _check_folder(out, "-o")
    _check_folder(md.parent, "--markdown")
    _make_folder(out, "-o")
    _make_folder(md.parent, "--markdown")

    def progressbar(length: int, label: str):
        return click.progressbar(length=length, label=label, show_pos=True, item_show_func=lambda c: c.key if c else "")

    try:
        if forward + backward + serving > 1:
            raise click.UsageError("--forward, --backward and --serving each run their cases alone: pick one, or none "
                                   "for all")
        lines = bench.main(out, md, quick=quick, backward_only=backward, serving_only=serving, forward_only=forward,
                           only=only, report=report, progressbar=progressbar)
    except bench.CasePatternError as err:  # refused before any case runs
        raise click.BadParameter(str(err), param_hint="'--only'") from None
    except OSError as err:
        if err.filename is None:
            raise
        raise click.ClickException(f"cannot write {err.filename} ({err.strerror})") from None
    click.echo("\n".join(lines))


@main.command("launch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-n", "--nproc", type=int, required=True, callback=_at_least(1, "one process a GPU: use -n 1 or more"),
              help="processes: one per GPU")
@click.option("--timeout", type=float, default=None, help="stop every rank after this many seconds (> 0)")
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch_cmd(nproc: int, timeout: float | None, script: str, args: tuple[str, ...]) -> None:
    """Run SCRIPT once per GPU with RANK / WORLD_SIZE / LOCAL_RANK set (torchrun's names);
    fagen.distributed.init() joins them. A failing rank stops the others and is reported."""
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):  # nan and inf would never fire
        raise click.BadParameter(f"{timeout}: must be a finite number of seconds more than 0; use e.g. --timeout 600, "
                                 f"or leave it out to wait for ever", param_hint="'--timeout'")
    from fagen.process_group import launch

    sys.exit(launch(nproc, [script, *args], timeout))
