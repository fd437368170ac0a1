"""Rendering: deterministic text, the banner, and generated/ in step with specs/."""

import re
from pathlib import Path

import fagen
from fagen import __version__
from fagen.rendering import GENERATED, MERGE_DTYPES, merge_name, render, render_merge, renders, shared_kernels, stale
from fagen.load import SPECS

SPEC_PATHS = sorted(SPECS.glob("*.yaml"))


def test_same_spec_renders_byte_identical_text():
    for path in SPEC_PATHS:
        assert render(fagen.load_spec(path)) == render(fagen.load_spec(path))


def test_compiled_templates_are_kept_on_disk_and_render_the_same_text(tmp_path, monkeypatch):
    from fagen import rendering

    spec = fagen.load_spec(SPECS / "attn_f16_d128.yaml")
    expected = render(spec)
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path))
    try:
        for _ in range(2):  # a fresh environment writes the compiled templates, the next one loads them
            rendering.environment.cache_clear()
            assert render(spec) == expected
        (directory,) = tmp_path.iterdir()  # named by Jinja2's version and the environment's options
        assert directory.name.startswith("templates-") and len(list(directory.iterdir())) >= 10
        # writes that fail (a read-only or full disk): templates compiled in memory, as before
        monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "elsewhere"))
        monkeypatch.setattr("tempfile.NamedTemporaryFile", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full")))
        rendering.environment.cache_clear()
        assert render(spec) == expected
        # no directory at all (a file where it would be)
        (tmp_path / "a file").write_text("")
        monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "a file"))
        assert rendering.template_bytecode_cache() is None
    finally:
        rendering.environment.cache_clear()  # (the next test's environment: the default directory's)


def test_banner_names_version_and_spec_and_holds_no_machine_detail():
    spec = fagen.load_spec(SPECS / "attn_f16_d128.yaml")
    text = render(spec)
    first = text.splitlines()[0]
    # the spec's file name: the same banner wherever the spec lives and wherever it is rendered from
    assert f"fagen {__version__}" in first and " attn_f16_d128.yaml" in first and "specs/" not in first
    assert "do not edit" in first
    assert "/work" not in text and "/home" not in text and "/tmp" not in text
    assert not re.search(r"\d{4}-\d{2}-\d{2}|\d\d:\d\d:\d\d", text)  # no timestamps


def test_generated_matches_a_fresh_render_of_every_spec():
    """The staleness check `fagen render --check` runs: nothing missing, out of date or orphaned."""
    assert SPEC_PATHS, "no specs shipped"
    specs = [fagen.load_spec(p) for p in SPEC_PATHS]
    texts = renders(specs, GENERATED, with_merge=True, sources=[Path("specs") / p.name for p in SPEC_PATHS])
    # a spec's forward, its backward where it has a backward: section, the shared kernels (the
    # merges, the document bounds)
    assert len(texts) == len(specs) + sum(s.backward is not None for s in specs) + len(shared_kernels())
    assert stale(texts, GENERATED, whole_folder=True) == [], "run `fagen render specs`"


def test_stale_names_each_kind_of_difference(tmp_path):
    spec = fagen.load_spec(SPECS / "attn_f16_d64.yaml")
    texts = renders([spec], tmp_path, with_merge=False)
    assert stale(texts, tmp_path, whole_folder=True) == [(tmp_path / f"{spec.name}.cu", "missing")]
    (tmp_path / f"{spec.name}.cu").write_text("old")
    (tmp_path / "gone.cu").write_text("")
    assert stale(texts, tmp_path, whole_folder=True) == [(tmp_path / f"{spec.name}.cu", "out of date"),
                                                         (tmp_path / "gone.cu", "orphan")]
    assert stale(texts, tmp_path, whole_folder=False) == [(tmp_path / f"{spec.name}.cu", "out of date")]


def test_constants_are_injected_once_and_variants_differ_only_where_they_should():
    a = render(fagen.load_spec(SPECS / "flash_shared_f16_d128.yaml"))
    b = render(fagen.load_spec(SPECS / "attn_f16_d128.yaml"))
    assert a.count("constexpr int KV_SLOTS") == 1
    assert "constexpr int KV_SLOTS = 1;" in a and "constexpr int KV_SLOTS = 2;" in b
    body = lambda t: t[t.index("---- the kernel"):].replace("flash_shared_f16_d128", "attn_f16_d128")  # noqa: E731
    assert body(a) == body(b)  # one kernel body; the pipeline is a constant


def test_dtype_selects_the_mma_type():
    f16 = render(fagen.load_spec(SPECS / "attn_f16_d64.yaml"))
    bf16 = render(fagen.load_spec(SPECS / "attn_bf16_d64.yaml"))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in f16 and ".bf16" not in f16
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in bf16


def test_no_two_specs_render_the_same_kernel():
    """One spec per kernel: examples and tuned specs do not duplicate each other's output (the
    spec echoed in the header counts: two specs that launch differently differ there)."""
    bodies = {}
    for path in SPEC_PATHS:
        spec = fagen.load_spec(path)
        body = render(spec).replace(spec.name, "NAME")
        assert body not in bodies, f"{spec.name} renders the kernel of {bodies.get(body)}"
        bodies[body] = spec.name


# ---- the template tree -----------------------------------------------------------------------
MASK_KINDS = ("none", "causal", "sliding_window", "chunked", "prefix_lm", "document", "block_mask")
SHARED = ("common", "masks", "score")  # partials every architecture renders
SKELETONS = ("kernel", "forward")  # the kernels' skeletons and the forward's roles: they reach arch hooks


# Partials only a main loop with a producer warpgroup has (pipeline.warp_specialized, sm_90a): the
# skeletons include them where the plan says a producer feeds the loop
PRODUCER_ROLES = {"tile_scheduler", "producer", "tma", "tma_ring", "qdo_producer", "dq_producer", "warp_roles"}


def _jinja(path) -> str:
    """A template's Jinja statements and expressions, without its comments and CUDA text."""
    return " ".join(re.findall(r"{[%{](.*?)[%}]}", path.read_text(), re.S))


def test_one_partial_per_mask_kind_and_one_folder_per_main_loop():
    from fagen.rendering import (FP8_BACKWARD_TEMPLATE, KEY_SPLIT_TEMPLATE, MLA_TEMPLATE, TEMPLATES,
                              WIDE_BACKWARD_TEMPLATE, WIDE_TEMPLATE)

    for kind in MASK_KINDS:
        assert (TEMPLATES / "masks" / f"{kind}.cu.j2").read_text().startswith('{% extends "common/mask.cu.j2" %}')
    folders = [p for p in TEMPLATES.iterdir() if p.is_dir() and re.fullmatch(r"sm\d+", p.name)]
    assert len(folders) >= 2
    for skeleton in ("kernel/forward", "kernel/backward", "forward/consumer"):
        text = (TEMPLATES / f"{skeleton}.cu.j2").read_text()
        hooks = set(re.findall(r'include arch ~ "/(\w+)\.cu\.j2"', text))
        assert hooks, skeleton
        for part in hooks:
            have = [folder.name for folder in folders if (folder / f"{part}.cu.j2").exists()]
            assert have == [f.name for f in folders] or part in PRODUCER_ROLES and have, (skeleton, part, have)
    # a partial one architecture has and the other has not is named outright where it is used
    # (an arch's own tile MMAs, the pieces of its PTX wrappers), or is a hook of the skeletons, or
    # is a kernel only that architecture runs (MLA decode's and the head_dim 512 forward's wgmma column
    # split, the head_dim 512 backward's cluster pair, the FP8 backward)
    named = {m for path in TEMPLATES.rglob("*.j2")
             for m in re.findall(r'(?:include|from) "(sm[89]0/[\w.]+)"', path.read_text())} | {
        MLA_TEMPLATE, WIDE_TEMPLATE, WIDE_BACKWARD_TEMPLATE, KEY_SPLIT_TEMPLATE, FP8_BACKWARD_TEMPLATE}
    hooks = {f"{part}.cu.j2" for folder in SKELETONS for path in (TEMPLATES / folder).glob("*.j2")
             for part in re.findall(r'include arch ~ "/(\w+)\.cu\.j2"', path.read_text())}
    sm80, sm90 = ({p.name for p in (TEMPLATES / arch).iterdir()} for arch in ("sm80", "sm90"))
    orphans = {f"sm80/{name}" for name in sm80 - sm90 - hooks} | {f"sm90/{name}" for name in sm90 - sm80 - hooks}
    assert orphans <= named, orphans - named


def test_skeletons_and_shared_partials_hold_no_architecture_switch():
    """What differs by architecture is in its folder, reached through `arch ~ "/hook"` or a
    template name the plan gives; the skeletons and shared partials never name an arch."""
    from fagen.rendering import TEMPLATES

    for folder in (*SHARED, *SKELETONS):
        for path in (TEMPLATES / folder).glob("*.j2"):
            jinja = _jinja(path)
            assert not re.search(r"\bsm_?\d+|arch\s*[!=]=|mainloop\s*[!=]=", jinja), path
            if folder not in SKELETONS:  # the skeletons set `arch` from the plan to reach the hooks
                assert not re.search(r"\b(mma|mainloop|wgmma|pingpong|warpgroups|kv_stages|kv_slots)\b", jinja), path


def test_templates_print_numbers_they_do_not_compute():
    """File-scope constants are the plan's (or spec's) numbers, printed; the named PTX encodings
    and math constants are the exceptions."""
    from fagen.rendering import TEMPLATES

    for path in TEMPLATES.rglob("*.j2"):
        for name, value in re.findall(r"^constexpr \w+(?: \w+)? (\w+) = ([^;]*);", path.read_text(), re.M):
            if not name.startswith(("WGMMA_", "DESC_", "KMAJOR_", "TURN_", "NAMED_BARRIER_", "BLOCK_MASKED", "LN2",
                                     "LOG2E")):
                assert re.fullmatch(r"{{ [\w.]+( or 0)? }}f?", value), (path.name, name, value)


def test_kernels_emit_only_what_they_use():
    def src(name):
        return render(fagen.load_spec(SPECS / f"{name}.yaml"))

    plain, qreg, d96 = src("attn_f16_d128"), src("flash_ring3_f16_d128_causal_qreg"), src("attn_f16_d96")
    hopper, split = src("attn_f16_d128_h200"), src("attn_f16_d128_partial_h200")
    assert "restrict_to_split" not in plain and "restrict_to_split(blockIdx.z" in split
    assert "q_frag" not in plain and "q_frag[f][ks][r]" in qreg
    assert "COPY_ROWS_PER_PASS" not in d96 and "walk the chunks" in d96 and "walk the chunks" not in plain
    assert "SMEM_ROW" not in hopper and "commit_group()" not in hopper and "ldmatrix" not in hopper
    assert "if constexpr" not in plain + qreg + hopper + split  # flags decide in the template
    assert "float sink" not in plain and "ScoreMod" not in plain


def test_the_softmax_cannot_overflow_exp2_on_huge_scores():
    """Every forward rounds the row max's product up (each exponent then <= 0, whatever the
    scores); a backward whose scores a user's values reach (a bias, an expression: -1e9 to mask a
    key; given ALiBi slopes) holds P = exp2(S - LSE) at 1; q.k, softcap and geometric ALiBi keep
    the lone FMA there."""
    from fagen.rendering import render_backward
    from fagen.spec import ScoreMod
    from fagen import variants

    base = fagen.load_spec(SPECS / "attn_f16_d128_h200.yaml")
    for mod, unbounded in [(ScoreMod(), False), (ScoreMod(softcap=30.0, alibi="geometric"), False),
                           (ScoreMod(bias="vector"), True), (ScoreMod(alibi="slopes"), True),
                           (ScoreMod(expression="score * 0.5f", expression_grad="0.5f"), True)]:
        spec = variants.variant(base, base.mask, mod)
        forward, backward = render(spec), render_backward(variants.trainable(spec, False, False))
        assert "mul_up(mx, to_log2)" in forward and "min.NaN.f32" not in forward
        assert ("min.NaN.f32" in backward) == unbounded and "exp2_shifted(s[" in backward


def test_merge_kernel_prints_its_plan():
    from fagen.plan import merge_plan
    from tests.test_spec_masks import kernel_params

    for dtype in MERGE_DTYPES:
        p, src = merge_plan(dtype), render_merge(dtype)
        assert f"constexpr int MAX_WARPS = {p.max_warps};" in src and f"SPLITS_IN_FLIGHT = {p.splits_in_flight};" in src
        assert f"__launch_bounds__(32 * MAX_WARPS)" in src  # a launch's block: 32 x merge_warps(splits)
        assert kernel_params(src, merge_name(dtype)) == list(p.params)
