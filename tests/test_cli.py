"""The fagen command line, driven in-process with click's CliRunner (no GPU)."""

from __future__ import annotations

import shutil

import pytest
import yaml
from click.testing import CliRunner

import fagen
from fagen.render import MERGE_DTYPES, merge_name
from fagen.cli import main
from fagen.plan import plan
from fagen.render import GENERATED, SPECS

SPEC = SPECS / "flash_prefetch_f16_d128.yaml"
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
    assert [p.name for p in tmp_path.iterdir()] == ["flash_prefetch_f16_d128.cu"]
    written = (tmp_path / "flash_prefetch_f16_d128.cu").read_text()
    assert written == fagen.render(fagen.load_spec(SPEC))
    assert "flash_prefetch_f16_d128.cu" in result.output


def test_render_folder_writes_one_file_per_spec(rendered):
    merges = [f"{merge_name(dt)}.cu" for dt in MERGE_DTYPES]  # the split-KV merge kernels come along
    assert sorted(p.name for p in rendered.glob("*.cu")) == sorted([f"{f.stem}.cu" for f in SPEC_FILES] + merges)
    for path in SPEC_FILES[:3]:
        assert (rendered / f"{path.stem}.cu").read_text() == fagen.render(fagen.load_spec(path))


def test_render_creates_the_output_folder(tmp_path):
    out = tmp_path / "a" / "b"
    assert run("render", SPEC, "-o", out).exit_code == 0
    assert (out / "flash_prefetch_f16_d128.cu").exists()


def test_render_is_byte_identical_twice(tmp_path):
    run("render", SPEC, "-o", tmp_path / "1")
    run("render", SPEC, "-o", tmp_path / "2")
    name = "flash_prefetch_f16_d128.cu"
    assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes()


# ---- render --check ------------------------------------------------------------------------


def test_check_passes_on_a_fresh_render(rendered):
    result = run("render", "--check", "-o", rendered)
    assert result.exit_code == 0, result.output
    assert f"{len(SPEC_FILES) + len(MERGE_DTYPES)} kernels current" in result.output


def test_check_writes_nothing(tmp_path):
    result = run("render", "--check", SPEC, "-o", tmp_path)
    assert result.exit_code == 1
    assert "missing" in result.output
    assert list(tmp_path.iterdir()) == []


def test_check_fails_after_an_edit(rendered_copy):
    target = rendered_copy / "flash_prefetch_f16_d128.cu"
    target.write_text(target.read_text().replace("BLOCK_Q", "BLOCK_Q ", 1))
    result = run("render", "--check", "-o", rendered_copy)
    assert result.exit_code != 0
    assert "flash_prefetch_f16_d128.cu is out of date" in result.output
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


def test_committed_generated_is_current():
    if not any(GENERATED.glob("*.cu")):
        pytest.skip("generated/ holds no kernels yet")
    result = run("render", "--check")
    assert result.exit_code == 0, result.output


# ---- list --------------------------------------------------------------------------------


def test_list_prints_every_spec_with_its_smem():
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
    assert lines[1].split()[0] == "flash_prefetch_f16_d128"
    assert "52224" in lines[1].split()


# ---- compile (nvcc, offline) ----------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")
def test_compile_reports_registers_and_no_stack_frame():
    result = run("compile", SPEC, "--arch", "sm_90")
    assert result.exit_code == 0, result.output
    assert "flash_prefetch_f16_d128 sm_90" in result.output
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
