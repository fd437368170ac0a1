"""spec -> CUDA source. Deterministic: the same spec renders byte-identical text.

No CuPy here: rendering, snapshot tests and nvcc checks run on machines without a GPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable, Sequence

import jinja2
import yaml

from fagen import disk_cache, expression, fp8_inputs, padding_runs
from fagen.version import __version__
from fagen.backward_plan import backward_plan
from fagen.derivatives import read_derivatives
from fagen.element_types import ELEMENT_TYPES, FP8_KERNEL_TYPES, KERNEL_TYPES
from fagen.fp8_backward_plan import (FP8_AMAX_PARAMS, FP8_BACKWARD_OUT_TYPES, FP8_BACKWARD_PARAMS, FP8_BACKWARD_TYPES,
                                     FP8_POSTPROCESS_PARAMS, FP8_PREPROCESS_PARAMS, Fp8BackwardPlan)
from fagen.key_split_plan import KEY_SPLIT_TYPES, KeySplitBackwardPlan
from fagen.mla_plan import MLA_TYPES, MlaPlan
from fagen.wide_head_plan import (WIDE_POSTPROCESS_PARAMS, WIDE_PREPROCESS_PARAMS, WIDE_TYPES, WideBackwardPlan,
                                  WideHeadPlan)
from fagen.plan import NUMBERED_LOADS, PAGE_OUT_OF_RANGE, PAGE_ROWS, SEQLEN_OVER_TABLE, merge_plan, plan
from fagen.load import validated
from fagen.spec import AttentionSpec, Mask, SpecError

PACKAGE = Path(__file__).resolve().parent
FORWARD_TEMPLATE = "kernel/forward.cu.j2"  # one skeleton; plan.mainloop names its main-loop folder
# installed: inside the package (pyproject's package-dir); in a checkout: beside specs/ and
# generated/ (a left-over empty fagen/templates/ of an older checkout must not shadow it)
TEMPLATES = (PACKAGE / "templates" if (PACKAGE / "templates" / FORWARD_TEMPLATE).exists()
             else PACKAGE.parent / "templates")
GENERATED = PACKAGE.parent / "generated"  # the checkout's committed renders (tests compare them)
MERGE_TEMPLATE = "kernel/merge.cu.j2"
DOCUMENT_BOUNDS_TEMPLATE = "kernel/document_bounds.cu.j2"
DOCUMENT_BOUNDS = "document_bounds_kernel"  # its symbol (document_bounds is the device function)
DOCUMENT_BOUNDS_THREADS = 256
SEQUENCE_TILES_TEMPLATE = "kernel/sequence_tiles.cu.j2"
SEQUENCE_TILES = "sequence_tiles_kernel"
SEQUENCE_TILES_THREADS = 256
SEQUENCE_TILES_PARAMS = (("const int*", "cu_seqlens"), ("int", "batch"), ("int", "block_q"), ("int", "slots"),
                         ("int2*", "tiles"), ("unsigned*", "claimed"))  # its signature's, in order
PADDING_RUNS_TEMPLATE = "kernel/padding_runs.cu.j2"
APPEND_KV_TEMPLATE = "kernel/append_kv.cu.j2"
APPEND_KV = "append_kv_kernel"
APPEND_KV_THREADS = 128
MLA_TEMPLATE = "sm90/mla_decode.cu.j2"  # MLA decode and its merge (fagen.mla_plan)
WIDE_TEMPLATE = "sm90/wide_forward.cu.j2"  # the head_dim 512 forward (fagen.wide_head_plan)
WIDE_BACKWARD_TEMPLATE = "sm90/wide_backward.cu.j2"  # ... and its backward
KEY_SPLIT_TEMPLATE = "sm90/key_split_backward.cu.j2"  # the 192/128 backward (fagen.key_split_plan)
FP8_BACKWARD_TEMPLATE = "sm90/fp8_backward.cu.j2"  # the FP8 backward (fagen.fp8_backward_plan)
V_TRANSPOSE_TEMPLATE = "kernel/v_transpose.cu.j2"
V_TRANSPOSE = "v_transpose_kernel"
V_TRANSPOSE_MAX_D = 256
GRADIENT_SUM_TEMPLATE = "kernel/gradient_sum.cu.j2"
GRADIENT_SUM_THREADS = 256
GRADIENT_SUM_BATCH = 9  # shares whose loads a thread issues at once: the own block's 2 and an 8-GPU ring's 7
SEQUENCE_TILES_COUNTS = 4096  # a tile table orders sequences of up to 4095 tiles by length (262080 rows of 64-row tiles)
BACKWARD_TEMPLATE = "kernel/backward.cu.j2"


def asm_operands(outputs: int, *inputs: str) -> dict[str, str]:
    """Inline-asm operand numbers of an MMA whose `outputs` accumulator registers come first
    (%0 ..), then `inputs`, named in the order of the asm's input list: {"acc": "%0, %1, ..."
    (16 a line, continuing the asm string), name: "%<n>" for each input}."""
    lines = [", ".join(f"%{i}" for i in range(start, min(start + 16, outputs))) for start in range(0, outputs, 16)]
    acc = ',"\n        "'.join(lines)
    return {"acc": acc, **{name: f"%{outputs + i}" for i, name in enumerate(inputs)}}


# How the templates are read: what their compiled code depends on beyond their sources
ENVIRONMENT_OPTIONS = dict(undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                           keep_trailing_newline=True, autoescape=False)


class TemplateBytecodeCache(jinja2.FileSystemBytecodeCache):
    """Compiled templates on disk: Jinja2 keys each file by the template's name and checks its
    source; the directory is named by Jinja2's version and ENVIRONMENT_OPTIONS, which change the
    compiled code too. A write that fails (a read-only or full disk) leaves the template compiled
    in memory: rendering never fails for want of the cache."""

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:
            pass


def template_bytecode_cache() -> TemplateBytecodeCache | None:
    """The environment's compiled templates (fagen.disk_cache): a fresh process's first render loads
    them instead of parsing and compiling ~25 templates, 0.1-0.2 s of a first call on an H200
    host. None where the directory cannot be had."""
    options = repr((jinja2.__version__, sorted((k, repr(v)) for k, v in ENVIRONMENT_OPTIONS.items())))
    try:
        directory = disk_cache.directory() / f"templates-{hashlib.sha256(options.encode()).hexdigest()[:12]}"
        directory.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError):  # (RuntimeError: no home directory to put it under)
        return None
    return TemplateBytecodeCache(str(directory))


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), bytecode_cache=template_bytecode_cache(),
                             **ENVIRONMENT_OPTIONS)
    env.globals["asm_operands"] = asm_operands
    return env


def spec_source(spec: AttentionSpec, path: str | Path | None = None) -> str:
    """Where a render's spec came from, for a message naming two claims on one file: `path` as the
    render was given it, else the file name."""
    return Path(path).as_posix() if path is not None else f"{spec.name}.yaml"


def expression_trees(spec: AttentionSpec) -> dict[str, expression.Node]:
    """The syntax trees of a spec's expressions, by name: mask, score, score_grad."""
    score = partial(expression.score, captured=spec.score_mod.captured)
    texts = {"mask": (spec.mask.expression, expression.mask), "score": (spec.score_mod.expression, score),
             "score_grad": (spec.score_mod.expression_grad, score)}
    return {name: parse(text) for name, (text, parse) in texts.items() if text is not None}


def context(spec: AttentionSpec) -> dict:
    """Everything a template may print. Templates never compute: numbers come from the plan;
    the flags here decide what is emitted."""
    echoed = yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=True, default_flow_style=False)
    return {
        "version": __version__,
        # the spec's file name, which load_spec holds to <name>.yaml wherever it lives: the same
        # banner wherever the spec sits and from wherever it is rendered
        "source": f"{spec.name}.yaml",
        "spec_lines": echoed.rstrip("\n").splitlines(),
        "name": spec.name,
        "dtype": spec.dtype,
        "ptx_type": spec.mma_element.ptx,  # the type the MMAs read (spec.mma_element)
        "element": spec.element,
        "out_element": spec.out_element,
        "kv_element": spec.kv_element,
        "fp8_kv": spec.fp8_kv,  # a half-type q against an FP8 KV cache (spec.fp8_kv)
        "q_element": spec.q_element,
        "widens_query": spec.widens_query,  # ... or an FP8 q, widened as it lands (spec.widens_query)
        "plan": plan(spec),
        "numbered_loads": NUMBERED_LOADS,
        "swizzled": spec.smem_layout == "swizzled",
        "mask": spec.mask,
        "score_mod": spec.score_mod,
        "captured": expression.captured_names(spec.score_mod.captured),
        # printed from their syntax trees: what nvcc reads is what was validated, and what the oracle evaluates
        "expressions": {name: expression.cuda(tree) for name, tree in expression_trees(spec).items()},
        "expression_reads": {name: expression.reads(tree) for name, tree in expression_trees(spec).items()},
        "write_lse": spec.outputs.lse,
        "partial": spec.outputs.partial,
        "accumulate": spec.outputs.accumulate,
        "merge_splits": spec.outputs.merge_splits,
        "q_in_registers": spec.pipeline.q_in_registers,
        "pack_gqa": spec.tiling.pack_gqa,
        "sequences": spec.sequences,
        "paging": {"page_rows": PAGE_ROWS, "page_out_of_range": PAGE_OUT_OF_RANGE, "seqlen_over_table": SEQLEN_OVER_TABLE},
        "kv_major": False,  # the backward's dK/dV kernel walks the mask transposed
        "grads": False,  # the backward keeps the score modifiers' derivative per element
        "backward": False,
        "loaded_bias": False,  # the mma.sync backward loops load a tile's bias before its scores
    }


def render(spec: AttentionSpec) -> str:
    """The forward kernel."""
    spec = validated(spec)  # a model_copy(update=...) may carry anything: nothing unchecked renders
    return environment().get_template(FORWARD_TEMPLATE).render(context(spec))


@dataclass(frozen=True)
class CapturedGradRead:
    """One read of an array whose gradient the dK/dV kernel sums (backward.captured_grads): the
    array, its index clamped as the read clamps it, and d expression / d read, as the kernel
    prints them."""

    array: str
    index: str
    derivative: str


def captured_grad_reads(spec: AttentionSpec) -> list[CapturedGradRead]:
    arrays = backward_plan(spec).dkdv.captured_grads
    if not arrays:
        return []
    tree = expression.score(spec.score_mod.expression, spec.score_mod.captured)
    return [CapturedGradRead(read.array, f"min(max({expression.cuda(read.index)}, 0), {read.array}_size - 1)",
                             expression.cuda(grad))
            for read, grad in read_derivatives(tree, set(arrays))]


def render_backward(spec: AttentionSpec) -> str:
    """The backward kernels of a spec with a `backward:` section (fagen.backward_plan)."""
    spec = validated(spec)
    return environment().get_template(BACKWARD_TEMPLATE).render(
        {**context(spec), "bplan": backward_plan(spec), "backward": True, "grads": spec.score_mod.nonlinear,
         "captured_grad_reads": captured_grad_reads(spec)})


MERGE_DTYPES = (*KERNEL_TYPES, "float32")  # float32: a partial again, to merge further


def merge_name(out_dtype: str) -> str:
    return f"merge_partials_{out_dtype}"


def render_merge(out_dtype: str) -> str:
    """The split-KV merge kernel writing `out_dtype` (float32: a partial again, to merge further)."""
    if out_dtype not in MERGE_DTYPES:
        raise ValueError(f"merge output dtype {out_dtype!r}: one of {MERGE_DTYPES}")
    return environment().get_template(MERGE_TEMPLATE).render(
        version=__version__, name=merge_name(out_dtype), out_dtype=out_dtype, ptx_type=ELEMENT_TYPES[out_dtype].ptx,
        plan=merge_plan(out_dtype))


def render_document_bounds() -> str:
    """The kernel resolving each position's document bounds once a call (document masks)."""
    return environment().get_template(DOCUMENT_BOUNDS_TEMPLATE).render(
        version=__version__, name=DOCUMENT_BOUNDS, threads=DOCUMENT_BOUNDS_THREADS)


def render_sequence_tiles() -> str:
    """The kernel numbering a varlen batch's query tiles once a call (plan.sequence_tiles)."""
    return environment().get_template(SEQUENCE_TILES_TEMPLATE).render(
        version=__version__, name=SEQUENCE_TILES, threads=SEQUENCE_TILES_THREADS, counts=SEQUENCE_TILES_COUNTS,
        counts_per_thread=SEQUENCE_TILES_COUNTS // SEQUENCE_TILES_THREADS)


def padding_runs_name(mask_dtype: str) -> str:
    """The padding-runs kernel's symbol for a mask of this PyTorch dtype (padding_runs.MASK_TYPES)."""
    return f"padding_runs_{mask_dtype}_kernel"


def render_padding_runs(mask_dtype: str) -> str:
    """The kernel telling a padded batch's rows apart once a forward (fagen.padding_runs)."""
    return environment().get_template(PADDING_RUNS_TEMPLATE).render(
        version=__version__, name=padding_runs_name(mask_dtype), threads=padding_runs.THREADS,
        warps=padding_runs.THREADS // 32, unroll=padding_runs.UNROLL, element=padding_runs.MASK_TYPES[mask_dtype],
        full=padding_runs.FULL, left_padded=padding_runs.LEFT_PADDED)


def append_kv_name(source: str | None = None, cache: str | None = None) -> str:
    """The append kernel copying new tokens as they are, or quantizing `source` ones into a `cache` (FP8) one."""
    if source is None:
        return APPEND_KV
    return f"append_kv_{ELEMENT_TYPES[source].short}_to_{ELEMENT_TYPES[cache].short}_kernel"


def render_append_kv(source: str | None = None, cache: str | None = None) -> str:
    """The kernel writing new tokens' K and V into a paged cache (fagen.sequences.append_kv):
    copied, or quantized from `source` (a half type) into an FP8 `cache` with the descales."""
    quantize = None
    if source is not None:
        if source not in KERNEL_TYPES or not ELEMENT_TYPES[cache].is_fp8:
            raise ValueError(f"append_kv quantizes float16 or bfloat16 new tokens into an FP8 cache, not {source} "
                             f"into {cache}")
        quantize = {"source": ELEMENT_TYPES[source], "cache": ELEMENT_TYPES[cache]}
    return environment().get_template(APPEND_KV_TEMPLATE).render(
        version=__version__, name=append_kv_name(source, cache), threads=APPEND_KV_THREADS, quantize=quantize,
        paging={"page_out_of_range": PAGE_OUT_OF_RANGE, "seqlen_over_table": SEQLEN_OVER_TABLE})


def render_v_transpose() -> str:
    """The kernel writing an FP8 forward's V^T in its key order (fagen.fp8_inputs), once a call."""
    return environment().get_template(V_TRANSPOSE_TEMPLATE).render(
        version=__version__, name=V_TRANSPOSE, tile_keys=fp8_inputs.V_TILE_KEYS, max_d=V_TRANSPOSE_MAX_D)


def gradient_sum_name(dtype: str) -> str:
    return f"gradient_sum_{dtype}"


def render_gradient_sum(dtype: str) -> str:
    """The kernel summing a ring block's dK and dV shares (`dtype`) at home, in float32."""
    return environment().get_template(GRADIENT_SUM_TEMPLATE).render(
        version=__version__, name=gradient_sum_name(dtype), dtype=dtype, ptx_type=ELEMENT_TYPES[dtype].ptx,
        threads=GRADIENT_SUM_THREADS, share_batch=GRADIENT_SUM_BATCH)


def render_mla(dtype: str) -> str:
    """The MLA decode kernel reading `dtype` q and cache, writing `dtype` out."""
    if dtype not in MLA_TYPES:
        raise ValueError(f"MLA decode dtype {dtype!r}: one of {MLA_TYPES}")
    plan = MlaPlan(dtype)
    return environment().get_template(MLA_TEMPLATE).render(
        version=__version__, name=plan.name, plan=plan, dtype=dtype,
        backward=False, accumulate=False)


def render_wide(dtype: str) -> str:
    """The head_dim 512 forward reading and writing `dtype`."""
    if dtype not in WIDE_TYPES:
        raise ValueError(f"head_dim 512 forward dtype {dtype!r}: one of {WIDE_TYPES}")
    plan = WideHeadPlan(dtype)
    return environment().get_template(WIDE_TEMPLATE).render(
        version=__version__, name=plan.name, plan=plan, dtype=dtype, backward=False, accumulate=False)


def render_wide_backward(dtype: str) -> str:
    """The head_dim 512 backward (its preprocess, kernel and postprocess) for `dtype` inputs."""
    return _render_accumulated_dq(WIDE_BACKWARD_TEMPLATE, WideBackwardPlan, dtype, WIDE_TYPES, "head_dim 512")


def render_key_split_backward(dtype: str) -> str:
    """The two-width (192/128) backward (its preprocess, kernel and postprocess) for `dtype` inputs."""
    return _render_accumulated_dq(KEY_SPLIT_TEMPLATE, KeySplitBackwardPlan, dtype, KEY_SPLIT_TYPES, "192/128")


def render_fp8_backward(dtype: str, out_dtype: str, mask: Mask = Mask(), deterministic: bool = False) -> str:
    """The FP8 backward (dO's amax, the preprocess, the kernel, the postprocess) of `dtype` q, k, v
    with O, dO and the gradients in `out_dtype`, under `mask` (a kind of FP8_BACKWARD_MASKS), dQ's
    adds in key-block order where `deterministic`."""
    if dtype not in FP8_BACKWARD_TYPES or out_dtype not in FP8_BACKWARD_OUT_TYPES:
        raise ValueError(f"FP8 backward dtypes {dtype!r} / {out_dtype!r}: q, k, v one of {FP8_BACKWARD_TYPES}, "
                         f"out one of {FP8_BACKWARD_OUT_TYPES}")
    plan = Fp8BackwardPlan(dtype, out_dtype, mask=mask, deterministic=deterministic)
    return environment().get_template(FP8_BACKWARD_TEMPLATE).render(
        version=__version__, name=plan.name, plan=plan, dtype=out_dtype, backward=False, accumulate=False,
        plan_params=FP8_BACKWARD_PARAMS, amax_params=FP8_AMAX_PARAMS, preprocess_params=FP8_PREPROCESS_PARAMS,
        postprocess_params=FP8_POSTPROCESS_PARAMS)


def _render_accumulated_dq(template: str, plan_of, dtype: str, dtypes: tuple[str, ...], what: str) -> str:
    """A backward module launched through fagen.accumulated_dq: its plan's kernel beside the shared
    preprocess's and postprocess's parameters."""
    if dtype not in dtypes:
        raise ValueError(f"{what} backward dtype {dtype!r}: one of {dtypes}")
    plan = plan_of(dtype)
    return environment().get_template(template).render(
        version=__version__, name=plan.name, plan=plan, dtype=dtype, backward=False, accumulate=False,
        preprocess_params=WIDE_PREPROCESS_PARAMS, postprocess_params=WIDE_POSTPROCESS_PARAMS)


def generated_path(spec: AttentionSpec, out_dir: Path = GENERATED) -> Path:
    return Path(out_dir) / f"{spec.name}.cu"


def backward_path(spec: AttentionSpec, out_dir: Path = GENERATED) -> Path:
    return Path(out_dir) / f"{spec.name}_backward.cu"


@dataclass(frozen=True)
class Output:
    """A file a render writes: where, what it is rendered from (named when two claim one file),
    and its text, rendered only once every output of the render is known not to collide."""

    path: Path
    origin: str
    text: Callable[[], str]
    spec_file: Path | None = None  # the spec it renders, for the `fagen render` listing


def _shared_kernels() -> dict[str, tuple[str, Callable[[], str]]]:
    """The kernels no one spec owns, by file name: what each is, and its renderer."""
    return {**{f"{merge_name(dtype)}.cu": (f"fagen's split-KV merge kernel ({dtype})", lambda d=dtype: render_merge(d))
               for dtype in MERGE_DTYPES},
            **{f"{gradient_sum_name(dtype)}.cu": (f"fagen's ring gradient sum kernel ({dtype})",
                                                  lambda d=dtype: render_gradient_sum(d)) for dtype in KERNEL_TYPES},
            f"{DOCUMENT_BOUNDS}.cu": ("fagen's document bounds kernel", render_document_bounds),
            f"{SEQUENCE_TILES}.cu": ("fagen's varlen tile table kernel", render_sequence_tiles),
            **{f"{padding_runs_name(t)}.cu": (f"fagen's padding runs kernel ({t} masks)", lambda t=t: render_padding_runs(t))
               for t in padding_runs.MASK_TYPES},
            f"{APPEND_KV}.cu": ("fagen's paged cache append kernel", render_append_kv),
            **{f"{append_kv_name(source, cache)}.cu": (f"fagen's paged cache append kernel ({source} into {cache})",
                                                       lambda s=source, c=cache: render_append_kv(s, c))
               for source in KERNEL_TYPES for cache in FP8_KERNEL_TYPES},  # (the FP8 caches the decode kernels read)
            f"{V_TRANSPOSE}.cu": ("fagen's FP8 V^T kernel", render_v_transpose),
            **{f"{MlaPlan(dtype).name}.cu": (f"fagen's MLA decode kernel ({dtype})", lambda d=dtype: render_mla(d))
               for dtype in MLA_TYPES},
            **{f"{WideHeadPlan(dtype).name}.cu": (f"fagen's head_dim 512 forward ({dtype})", lambda d=dtype: render_wide(d))
               for dtype in WIDE_TYPES},
            **{f"{WideBackwardPlan(dtype).name}.cu": (f"fagen's head_dim 512 backward ({dtype})",
                                                      lambda d=dtype: render_wide_backward(d)) for dtype in WIDE_TYPES},
            **{f"{KeySplitBackwardPlan(dtype).name}.cu": (f"fagen's 192/128 backward ({dtype})",
                                                          lambda d=dtype: render_key_split_backward(d))
               for dtype in KEY_SPLIT_TYPES},
            **{f"{Fp8BackwardPlan(dtype, out).name}.cu": (f"fagen's FP8 backward ({dtype} in, {out} gradients)",
                                                          lambda d=dtype, o=out: render_fp8_backward(d, o))
               for dtype in FP8_BACKWARD_TYPES for out in FP8_BACKWARD_OUT_TYPES}}


def outputs(specs: Sequence[AttentionSpec], out_dir: Path, *, with_merge: bool,
            sources: Sequence[str | Path] | None = None) -> list[Output]:
    """Every file a render of `specs` (read from `sources`, the spec files, where known) into
    out_dir writes, with what it is rendered from: a spec's <name>.cu, its <name>_backward.cu,
    and with_merge (a whole folder of specs) the kernels no spec owns (shared_kernels). Those keep
    their names in any folder, so a spec whose file would take one is refused whether they are
    written or not. Two outputs of one path are an error naming both, raised before anything is
    rendered: the later would silently overwrite the earlier."""
    sources = list(sources) if sources is not None else [None] * len(specs)
    if len(sources) != len(specs):
        raise ValueError(f"{len(sources)} sources for {len(specs)} specs: give one spec file a spec")
    out_dir = Path(out_dir)
    shared = {out_dir / name: Output(out_dir / name, what, text) for name, (what, text) in _shared_kernels().items()}
    claimed: dict[Path, Output] = {}
    seen_files: set[Path] = set()
    for spec, source in zip(specs, sources):
        if source is not None:
            if Path(source).resolve() in seen_files:  # one file named twice renders once
                continue
            seen_files.add(Path(source).resolve())
        where = spec_source(spec, source)
        mine = [Output(generated_path(spec, out_dir), where, lambda s=spec: render(s), source)]
        if spec.backward is not None:
            mine.append(Output(backward_path(spec, out_dir), f"{where}'s backward: section",
                               lambda s=spec: render_backward(s), source))
        for output in mine:
            earlier = claimed.get(output.path) or shared.get(output.path)
            if earlier is not None:
                raise SpecError(f"{output.path} would be rendered from both {earlier.origin} and {output.origin}: "
                                f"the second would overwrite the first; rename spec {spec.name!r} (its name: and "
                                f"its file), or render the two into different folders")
            claimed[output.path] = output
    return list(claimed.values()) + (list(shared.values()) if with_merge else [])


def renders(specs: Sequence[AttentionSpec], out_dir: Path, *, with_merge: bool,
            sources: Sequence[str | Path] | None = None) -> dict[Path, str]:
    """The files a render of `specs` into out_dir writes, and their text (outputs: refused if two
    would share a file)."""
    return {o.path: o.text() for o in outputs(specs, out_dir, with_merge=with_merge, sources=sources)}


def shared_kernel(file_name: str) -> str:
    """One of shared_kernels, rendered alone."""
    return _shared_kernels()[file_name][1]()


def shared_kernels() -> dict[str, str]:
    """The kernels no one spec owns, by file name: the split-KV merges, the ring's gradient sums,
    the document bounds, the varlen tile table, the paged cache's append and FP8's V^T."""
    return {name: text() for name, (_, text) in _shared_kernels().items()}


def stale(texts: dict[Path, str], out_dir: Path, *, whole_folder: bool) -> list[tuple[Path, str]]:
    """(file, why) for each file of out_dir that a fresh render would change: 'missing', 'out of
    date', or, when out_dir is a whole folder's render, 'orphan' (no spec renders it)."""
    found = [(path, "missing" if not path.exists() else "out of date")
             for path, text in texts.items() if not path.exists() or path.read_text() != text]
    if whole_folder:
        found += [(path, "orphan") for path in sorted(Path(out_dir).glob("*.cu")) if path not in texts]
    return found
