"""The fagen command line, driven in-process with click's CliRunner (no GPU)."""

from __future__ import annotations

import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import fagen
from fagen.rendering import shared_kernels
from fagen.cli import main
from fagen.plan import plan
from fagen.rendering import GENERATED
from fagen.load import SPECS

SPEC = SPECS / "attn_f16_d128.yaml"
SPEC_FILES = sorted(SPECS.glob("*.yaml"))


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """A fresh render of the whole of specs/ into a temporary folder."""
    out = tmp_path_factory.mktemp("generated")
    result = run("render", SPECS, "-o", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def rendered_copy(rendered, tmp_path):
    """A copy a test may edit."""
    out = tmp_path / "generated"
    shutil.copytree(rendered, out)
    return out


# ---- render ------------------------------------------------------------------------------


def test_render_one_spec_writes_name_cu(tmp_path):
    result = run("render", SPEC, "-o", tmp_path)
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == ["attn_f16_d128.cu"]
    written = (tmp_path / "attn_f16_d128.cu").read_text()
    assert written == fagen.render(fagen.load_spec(SPEC))
    assert "attn_f16_d128.cu" in result.output


def test_render_folder_writes_one_file_per_spec(rendered):
    merges = list(shared_kernels())  # the split-KV merge kernels and the document bounds come along
    backwards = [f"{f.stem}_backward.cu" for f in SPEC_FILES if fagen.load_spec(f).backward is not None]
    assert sorted(p.name for p in rendered.glob("*.cu")) == sorted([f"{f.stem}.cu" for f in SPEC_FILES] + backwards + merges)
    for path in SPEC_FILES[:3]:
        assert (rendered / f"{path.stem}.cu").read_text() == fagen.render(fagen.load_spec(path))


def test_render_creates_the_output_folder(tmp_path):
    out = tmp_path / "a" / "b"
    assert run("render", SPEC, "-o", out).exit_code == 0
    assert (out / "attn_f16_d128.cu").exists()


def test_render_is_byte_identical_twice(tmp_path):
    run("render", SPEC, "-o", tmp_path / "1")
    run("render", SPEC, "-o", tmp_path / "2")
    name = "attn_f16_d128.cu"
    assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes()


# ---- render --check ------------------------------------------------------------------------


def test_check_passes_on_a_fresh_render(rendered):
    result = run("render", "--check", "-o", rendered)
    assert result.exit_code == 0, result.output
    backwards = sum(fagen.load_spec(f).backward is not None for f in SPEC_FILES)
    assert f"{len(SPEC_FILES) + backwards + len(shared_kernels())} files current" in result.output


def test_check_writes_nothing(tmp_path):
    result = run("render", "--check", SPEC, "-o", tmp_path)
    assert result.exit_code == 1
    assert "missing" in result.output
    assert list(tmp_path.iterdir()) == []


def test_check_fails_after_an_edit(rendered_copy):
    target = rendered_copy / "attn_f16_d128.cu"
    target.write_text(target.read_text().replace("BLOCK_Q", "BLOCK_Q ", 1))
    result = run("render", "--check", "-o", rendered_copy)
    assert result.exit_code != 0
    assert "attn_f16_d128.cu is out of date" in result.output
    assert "fagen render" in result.output


def test_check_fails_on_a_missing_file(rendered_copy):
    (rendered_copy / "flash_shared_f16_d64.cu").unlink()
    result = run("render", "--check", "-o", rendered_copy)
    assert result.exit_code != 0
    assert "flash_shared_f16_d64.cu is missing" in result.output


def test_check_reports_a_stray_kernel(rendered_copy):
    (rendered_copy / "stray_kernel.cu").write_text("// no spec\n")
    result = run("render", "--check", "-o", rendered_copy)
    assert result.exit_code != 0
    assert "stray_kernel.cu has no spec" in result.output


def test_check_of_one_spec_ignores_other_files(rendered_copy):
    (rendered_copy / "stray_kernel.cu").write_text("// no spec\n")
    result = run("render", "--check", SPEC, "-o", rendered_copy)
    assert result.exit_code == 0, result.output


def test_committed_generated_is_current(monkeypatch):
    if not any(GENERATED.glob("*.cu")):
        pytest.skip("generated/ holds no kernels yet")
    monkeypatch.chdir(GENERATED.parent)  # the checkout's root, where ./specs and ./generated are
    result = run("render", "--check")
    assert result.exit_code == 0, result.output


# ---- list --------------------------------------------------------------------------------


def test_list_prints_every_spec_with_its_smem(monkeypatch):
    monkeypatch.chdir(SPECS.parent)  # with no argument, list reads ./specs
    result = run("list")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:2] == ["name", "dtype"]
    assert len(lines) == 1 + len(SPEC_FILES)
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    for path in SPEC_FILES:
        p = plan(fagen.load_spec(path))
        assert path.stem in rows
        assert str(p.smem_bytes) in rows[path.stem]
        assert str(p.threads) in rows[path.stem]


def test_list_one_spec():
    result = run("list", SPEC)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 2
    assert lines[1].split()[0] == "attn_f16_d128"
    assert "52224" in lines[1].split()


# ---- compile (nvcc, offline) ----------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")
def test_compile_reports_registers_and_no_stack_frame():
    result = run("compile", SPEC, "--arch", "sm_90")
    assert result.exit_code == 0, result.output
    assert "attn_f16_d128 sm_90" in result.output
    assert "registers" in result.output
    assert "0 bytes stack frame" in result.output
    assert "52224 bytes dynamic smem" in result.output


# ---- bad specs -----------------------------------------------------------------------------


def write_spec(folder, name, **overrides):
    data = yaml.safe_load(SPEC.read_text())
    data.update(name=name, **overrides)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("command", ["render", "list", "compile"])
def test_bad_spec_exits_nonzero_naming_the_field(tmp_path, command):
    bad = write_spec(tmp_path, "bad_dim", head_dim=100)
    args = [command, bad] + (["-o", tmp_path / "out"] if command == "render" else [])
    result = run(*args)
    assert result.exit_code != 0
    assert "head_dim" in result.output and "100" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_bad_name_exits_nonzero(tmp_path):
    path = tmp_path / "renamed.yaml"
    path.write_text(SPEC.read_text())
    result = run("render", path, "-o", tmp_path / "out")
    assert result.exit_code != 0
    assert "name" in result.output and "renamed" in result.output


def test_missing_spec_path_is_a_usage_error(tmp_path):
    result = run("render", tmp_path / "nowhere.yaml", "-o", tmp_path)
    assert result.exit_code == 2
    assert "nowhere.yaml" in result.output


# ---- user errors: one line, the right exit code, never a traceback ----------------------------


ROOT = Path(__file__).resolve().parents[1]


def one_line_error(result, code: int, *names: str) -> str:
    """`result` failed with exit `code` and one `Error: ...` line naming each of `names`."""
    assert result.exit_code == code, result.output
    assert result.exc_info is None or result.exc_info[0] is SystemExit, result.exc_info  # nothing uncaught
    assert "Traceback" not in result.output
    found = re.search(r"(?m)^Error: ", result.output)
    assert found, result.output
    message = result.output[found.end():]
    assert len(message.strip().splitlines()) == 1, result.output
    for name in names:
        assert name in message, (name, message)
    return message


@pytest.fixture
def no_cupy(monkeypatch):
    """This machine without CuPy, whatever it has: `import cupy` fails."""
    monkeypatch.setitem(sys.modules, "cupy", None)


@pytest.fixture
def no_device(monkeypatch):
    """CuPy without a CUDA device (or driver)."""
    def count():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count)))
    monkeypatch.setitem(sys.modules, "cupy", fake)


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail loudly if a command gets past its checks to the GPU work."""
    from fagen import bench, check, device, tune

    def refuse(*a, **k):
        raise AssertionError("reached the GPU work")
    for module, name in ((bench, "run"), (bench, "environment_meta"), (check, "check_against_oracle"),
                         (tune, "tune"), (device, "gpu_slug")):
        monkeypatch.setattr(module, name, refuse)


@pytest.mark.parametrize("missing", ["no_cupy", "no_device"])
@pytest.mark.parametrize("command", [["check", SPEC], ["bench", "--quick"], ["tune", SPEC, "--quick"]])
def test_gpu_commands_without_a_gpu_say_what_is_missing(command, missing, request, nothing_runs, tmp_path,
                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    request.getfixturevalue(missing)
    result = run(*command)
    one_line_error(result, 1, *(["CuPy", "pip install"] if missing == "no_cupy" else ["no CUDA GPU"]))
    assert "candidates" not in result.output and "FAILED" not in result.output  # tune: before any candidate
    assert list(tmp_path.iterdir()) == []  # nothing written (bench: no bench/ folder)


def test_tune_dry_run_needs_no_gpu(no_cupy, nothing_runs, tmp_path):
    result = run("tune", SPEC, "--quick", "--dry-run", "-o", tmp_path)
    assert result.exit_code == 0, result.output
    assert "candidates" in result.output.splitlines()[0]


def test_gpu_missing_names_the_missing_piece(no_cupy):
    from fagen.device import gpu_missing

    assert "CuPy is not installed" in gpu_missing() and "cuda12" in gpu_missing()


@pytest.mark.parametrize("command", ["tune", "check"])
@pytest.mark.parametrize("shape", ["1,2", "1,2,3,4,5", "a,b,c,d", "1,2,3,4.5", "0,1,1,1", "1,1,-5,8", ""])
def test_shape_is_four_positive_integers(command, shape, nothing_runs, no_cupy):
    result = run(command, SPEC, "--shape", shape)
    message = one_line_error(result, 2, "--shape", repr(shape), "B,H,Nq,Nk")
    assert "e.g. 2,8,1024,1024" in message


def test_check_kv_heads_must_divide_the_heads(nothing_runs):
    one_line_error(run("check", SPEC, "--shape", "1,8,64,64", "--kv-heads", "3"), 2, "--kv-heads", "3", "divide")
    one_line_error(run("check", SPEC, "--kv-heads", "0"), 2, "--kv-heads", "0", "at least 1")


def test_tune_reports_failure_when_no_candidate_runs(monkeypatch, tmp_path):
    from fagen import device, tune

    def all_fail(base, *a, **k):
        return [tune.Candidate(base, error="RuntimeError: boom")]
    monkeypatch.setattr(device, "gpu_missing", lambda torch=False: None)
    monkeypatch.setattr(tune, "tune", all_fail)
    result = run("tune", SPEC, "--quick", "--shape", "1,1,64,64", "-o", tmp_path)
    assert "FAILED RuntimeError: boom" in result.output
    one_line_error(result, 1, "no candidate", "nothing written")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("n", ["0", "-1"])
def test_launch_needs_at_least_one_process(n, monkeypatch):
    from fagen import distributed

    monkeypatch.setattr(distributed, "launch", lambda *a, **k: pytest.fail("launched"))
    one_line_error(run("launch", "-n", n, SPEC), 2, "--nproc", n, "at least 1")


def test_launch_timeout_must_be_positive(monkeypatch):
    from fagen import distributed

    monkeypatch.setattr(distributed, "launch", lambda *a, **k: pytest.fail("launched"))
    one_line_error(run("launch", "-n", "1", "--timeout", "0", SPEC), 2, "--timeout", "0")


@pytest.mark.parametrize("where", ["a file", "under a file", "/proc"])
def test_render_to_a_bad_folder(where, tmp_path):
    if where == "/proc" and not Path("/proc/self").exists():
        pytest.skip("needs Linux's /proc")
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = {"a file": afile, "under a file": afile / "sub", "/proc": Path("/proc/fagen_out")}[where]
    result = run("render", SPEC, "-o", out)
    one_line_error(result, 1 if where == "/proc" else 2, str(out))
    assert afile.read_text() == "x"


@pytest.fixture
def no_mask_built(monkeypatch):
    """Fail loudly if `mask show` builds or draws a mask before refusing its options."""
    from fagen import masks

    def refuse(*a, **k):
        raise AssertionError("built a mask")
    for name in ("causal", "sliding_window", "document", "prefix_lm", "chunked", "show"):
        monkeypatch.setattr(masks, name, refuse)


@pytest.mark.parametrize(("args", "names"), [
    (["causal", "--block", "0"], ["--block", "0", "at least 1"]),
    (["document", "--docs", "0"], ["--docs", "0", "at least 1"]),
    (["document", "-n", "64", "--block", "16", "--docs", "65"], ["--docs", "65", "-n 64"]),
    (["chunked", "--chunk", "0"], ["--chunk", "0", "at least 1"]),
    (["sliding_window", "--window", "-1"], ["--window", "-1", "at least 0"]),
    (["prefix_lm", "--prefix", "-1"], ["--prefix", "-1", "at least 0"]),
    (["causal", "-n", "0"], ["--length", "0", "at least 1"]),
    (["causal", "-n", "-5"], ["--length", "-5", "at least 1"]),
    (["causal", "-n", str(10**7)], ["--length", str(10**7), "GiB", "cap of 2.0 GiB", "use -n"]),
    (["causal", "-n", "40000", "--block", str(10**5)], ["--block", str(10**5), "cap of 2.0 GiB", "--block 40000"]),
    (["causal", "-n", "4096", "--block", "2"], ["--block", "2", "1024x1024", "--block 4"]),
])
def test_mask_show_refuses_bad_options(args, names, no_mask_built, tmp_path):
    result = run("mask", "show", *args, "-o", tmp_path / "m.png")
    one_line_error(result, 2, *names)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["missing folder", "under a file", "a folder", "suffix"])
def test_mask_show_refuses_a_bad_png_path(where, no_mask_built, tmp_path):
    (tmp_path / "afile").write_text("x")
    out = {"missing folder": tmp_path / "nowhere" / "m.png", "under a file": tmp_path / "afile" / "m.png",
           "a folder": tmp_path, "suffix": tmp_path / "m.jpgx"}[where]
    message = one_line_error(run("mask", "show", "causal", "-o", out), 2, "--out", str(out))
    assert {"missing folder": "does not exist", "under a file": "not a folder", "a folder": "is a folder",
            "suffix": "must end in .png"}[where] in message


def test_mask_show_still_draws(tmp_path):
    result = run("mask", "show", "causal", "-n", "256", "--block", "64", "-o", tmp_path / "m.png")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(("text", "names"), [
    ("{}", ['no "rows"']),
    ('{"meta": {}}', ['no "rows"']),
    ("[1, 2]", ['no "rows"']),
    ("{", ["not JSON", "line 1"]),
    ('{"meta": {}, "rows": [{"case": "x"}]}', ["rows[0]"]),
])
def test_bench_from_json_refuses_a_file_that_is_not_a_bench_run(text, names, tmp_path, nothing_runs):
    src = tmp_path / "in.json"
    src.write_text(text)
    out = tmp_path / "out"
    result = run("bench", "--from-json", src, "-o", out, "--markdown", tmp_path / "B.md")
    one_line_error(result, 2, "--from-json", str(src), "fagen bench", *names)
    assert not out.exists() and not (tmp_path / "B.md").exists()


# ---- compile --arch ---------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "arch", "names"), [
    ("attn_f16_d128", "foo", ["not a target", "sm_80, sm_86, sm_89 or sm_90"]),
    ("attn_f16_d128", "sm_75", ["not a target"]),
    ("attn_f16_d128", "sm_90a", ["wgmma", "--arch sm_80"]),
    ("attn_f16_d128_h200", "sm_90", ["sm_90a only", "--arch sm_90a"]),
    ("attn_f16_d128_h200", "sm_80", ["sm_90a only", "--arch sm_90a"]),
    ("arch_sm90", "sm_80", ["below the spec's arch sm_90", "--arch sm_90"]),
    ("arch_sm90", "sm_89", ["below the spec's arch sm_90", "--arch sm_90"]),
])
def test_compile_checks_the_arch_first(spec, arch, names, tmp_path, monkeypatch):
    from fagen import nvcc

    monkeypatch.setattr(nvcc, "compile_offline", lambda *a, **k: pytest.fail("ran nvcc"))
    path = write_spec(tmp_path, spec, arch="sm_90") if spec == "arch_sm90" else SPECS / f"{spec}.yaml"
    one_line_error(run("compile", path, "--arch", arch), 2, "--arch", arch, *names)


def test_compile_refuses_an_arch_whose_smem_is_too_small(monkeypatch):
    from fagen import nvcc
    from fagen.spec import SMEM_PER_BLOCK

    big = [p for p in SPEC_FILES if (s := fagen.load_spec(p)).arch == "sm_80" and not s.wgmma
           and plan(s).smem_bytes > SMEM_PER_BLOCK["sm_86"]]
    if not big:
        pytest.skip("no shipped sm_80 spec needs more smem than sm_86 has")
    monkeypatch.setattr(nvcc, "compile_offline", lambda *a, **k: pytest.fail("ran nvcc"))
    one_line_error(run("compile", big[0], "--arch", "sm_86"), 2, "--arch", "sm_86", "shared memory",
                   "--arch sm_80 or sm_90")


def test_an_mma_sync_spec_targets_its_arch_up(tmp_path):
    from fagen.nvcc import archs, targets

    spec = fagen.load_spec(write_spec(tmp_path, "arch_sm90", arch="sm_90"))
    assert targets(spec) == archs(spec) == ("sm_90",)
    assert targets(fagen.load_spec(SPEC)) == ("sm_80", "sm_90")
    assert targets(fagen.load_spec(SPECS / "attn_f16_d128_h200.yaml")) == ("sm_90a",)


# ---- render: all or nothing, orphans, where things go -------------------------------------------


def test_check_advice_for_an_orphan_removes_it(rendered_copy):
    (rendered_copy / "stray_kernel.cu").write_text("// no spec\n")
    result = run("render", "--check", SPECS, "-o", rendered_copy)
    assert result.exit_code == 1
    stray = rendered_copy / "stray_kernel.cu"
    assert f"delete it (git rm {stray}) or add {SPECS / 'stray_kernel.yaml'}" in result.output
    assert "run `fagen render`" not in result.output  # rendering does not delete it


def test_folder_render_is_all_or_nothing(tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    write_spec(specs, "a_good")
    write_spec(specs, "b_bad", head_dim=100)
    write_spec(specs, "c_bad", tiling={"block_q": 64, "block_kv": 20, "warps_q": 4})
    out = tmp_path / "out"
    result = run("render", specs, "-o", out)
    assert result.exit_code == 1
    assert "Traceback" not in result.output and result.exc_info[0] is SystemExit
    assert "2 of 3 specs refused, nothing done" in result.output
    lines = re.split(r"(?m)^Error: ", result.output, maxsplit=1)[1].strip().splitlines()
    assert len(lines) == 1  # a user error is one line: the count, then each failing spec
    b_bad, c_bad = lines[0].split("c_bad.yaml")
    assert "b_bad" in b_bad and "head_dim" in b_bad and "block_kv" in c_bad
    assert not out.exists()


@pytest.mark.parametrize("command", ["render", "list"])
def test_an_empty_spec_folder_is_an_error(command, tmp_path):
    (tmp_path / "empty").mkdir()
    result = run(command, tmp_path / "empty", *(["-o", tmp_path / "out"] if command == "render" else []))
    one_line_error(result, 1, str(tmp_path / "empty"), "no *.yaml")
    assert not (tmp_path / "out").exists()


def test_render_defaults_to_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "specs").mkdir()
    shutil.copy(SPEC, tmp_path / "specs")
    monkeypatch.chdir(tmp_path)
    result = run("render")
    assert result.exit_code == 0, result.output
    merges = list(shared_kernels())
    assert sorted(p.name for p in (tmp_path / "generated").iterdir()) == sorted([f"{SPEC.stem}.cu"] + merges)
    assert run("render", "--check").exit_code == 0
    listed = run("list")
    assert listed.exit_code == 0 and len(listed.output.splitlines()) == 2
    assert "relative to the working directory" in " ".join(run("render", "--help").output.split())


@pytest.mark.parametrize("command", ["render", "list"])
def test_no_specs_folder_says_to_pass_one(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line_error(run(command), 1, "no specs/ folder", "pass a spec file or folder")
    assert list(tmp_path.iterdir()) == []


def test_tune_writes_to_specs_in_the_working_directory(tmp_path, monkeypatch):
    from fagen import device, tune

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(device, "gpu_missing", lambda torch=False: None)
    monkeypatch.setattr(tune, "tune", lambda base, *a, **k: [tune.Candidate(base, ms=1.0, tflops=100.0)])
    monkeypatch.setattr(device, "gpu_slug", lambda: "testgpu")
    result = run("tune", SPEC, "--quick", "--shape", "1,1,64,64")
    assert result.exit_code == 0, result.output
    written = tmp_path / "specs" / f"{SPEC.stem}_testgpu.yaml"
    assert written.exists()
    assert fagen.load_spec(written).name == f"{SPEC.stem}_testgpu"


def test_tune_backward_dry_run_lists_backward_tilings(no_cupy, nothing_runs, tmp_path):
    result = run("tune", SPEC, "--backward", "--quick", "--dry-run", "-o", tmp_path)
    assert result.exit_code == 0, result.output
    names = [line.strip() for line in result.output.splitlines()[1:]]
    assert names and all(f"{SPEC.stem}_bwd_kv" in name for name in names)


def test_tune_backward_keeps_the_forward_and_the_file_it_tunes_into(tmp_path, monkeypatch):
    """A spec already tuned for this GPU gets its backward in the same file, its forward's
    tiling and comment kept."""
    from fagen import device, tune

    tuned = tmp_path / "specs" / "attn_f16_d128_causal_testgpu.yaml"
    tuned.parent.mkdir()
    text = (fagen.load.SPECS / "attn_f16_d128_causal_h200.yaml").read_text().replace("_h200", "_testgpu")
    tuned.write_text("# the forward's measurement\n" + text)
    base = fagen.load_spec(tuned)
    best = tune.backward_candidates(base, quick=True)[0][-1]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(device, "gpu_missing", lambda torch=False: None)
    monkeypatch.setattr(tune, "tune_backward", lambda *a, **k: [tune.Candidate(best, ms=2.0, tflops=300.0)])
    monkeypatch.setattr(device, "gpu_slug", lambda: "testgpu")
    result = run("tune", str(tuned), "--backward", "--quick", "--shape", "1,1,64,64")
    assert result.exit_code == 0, result.output
    written = fagen.load_spec(tuned)
    assert written.name == base.name and written.tiling == base.tiling and written.backward == best.backward
    comments = [line for line in tuned.read_text().splitlines() if line.startswith("#")]
    assert comments[0] == "# the forward's measurement" and "fagen tune --backward" in comments[-1]
