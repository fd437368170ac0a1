"""Two outputs of one render never share a file: a spec's <name>_backward.cu beside a spec named
<name>_backward, a spec named like a kernel no spec owns (the merges, gradient sums, document
bounds, varlen tile table), two spec files of one name. Refused before anything is written,
naming both sources, and `render --check` never calls such a folder current."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import fagen
from fagen.cli import main
from fagen.load import SPECS
from fagen.rendering import outputs, renders, shared_kernels

SMALL = dict(dtype="float16", head_dim=32, tiling={"block_q": 64, "block_kv": 32, "warps_q": 4})


def write_spec(folder: Path, name: str, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, **SMALL, **fields}))
    return path


def run(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_refused_before_writing(result, out: Path, *sources: str) -> None:
    assert result.exit_code == 1, result.output
    assert not result.exception or isinstance(result.exception, SystemExit), result.exception
    line = result.output.strip()
    assert line.startswith("Error: ") and "\n" not in line, result.output
    for source in sources:
        assert source in line, (source, line)
    assert not out.exists() or list(out.iterdir()) == [], "nothing may be written"


def test_a_backward_beside_a_spec_of_its_name(tmp_path):
    specs = tmp_path / "specs"
    write_spec(specs, "foo", backward={})
    write_spec(specs, "foo_backward")
    out = tmp_path / "generated"
    result = run("render", specs, "-o", out)
    assert_refused_before_writing(result, out, "foo_backward.cu", "foo.yaml's backward", "foo_backward.yaml")


@pytest.mark.parametrize("name", sorted(Path(n).stem for n in shared_kernels()))
def test_a_spec_named_like_a_shared_kernel_in_a_folder_render(tmp_path, name):
    specs = tmp_path / "specs"
    write_spec(specs, "ok")
    write_spec(specs, name)
    out = tmp_path / "generated"
    assert_refused_before_writing(run("render", specs, "-o", out), out, f"{name}.yaml", "fagen's")


def test_a_spec_named_like_a_shared_kernel_rendered_alone(tmp_path):
    """The shared kernels keep their file names in any folder: a lone spec may not take one (it
    would replace the kernel in generated/, which the next folder render puts back)."""
    path = write_spec(tmp_path / "specs", "merge_partials_float16")
    out = tmp_path / "generated"
    assert_refused_before_writing(run("render", path, "-o", out), out, "merge_partials_float16.yaml", "merge kernel")


def test_two_spec_files_of_one_name(tmp_path):
    a, b = write_spec(tmp_path / "a", "x"), write_spec(tmp_path / "b", "x", head_dim=64,
                                                         tiling={"block_q": 64, "block_kv": 64, "warps_q": 4})
    out = tmp_path / "generated"
    assert_refused_before_writing(run("render", a, b, "-o", out), out, "a/x.yaml", "b/x.yaml")


def test_check_does_not_call_a_colliding_folder_current(tmp_path):
    """The folder as the colliding render would have left it (the later spec's text in foo_backward.cu)
    is not current: the check lists the same outputs, and refuses."""
    specs = tmp_path / "specs"
    write_spec(specs, "foo", backward={})
    write_spec(specs, "foo_backward")
    out = tmp_path / "generated"
    out.mkdir()
    for name, text in shared_kernels().items():
        (out / name).write_text(text)
    foo = fagen.load_spec(specs / "foo.yaml")
    (out / "foo.cu").write_text(fagen.render(foo))
    (out / "foo_backward.cu").write_text(fagen.render(fagen.load_spec(specs / "foo_backward.yaml")))
    result = run("render", "--check", specs, "-o", out)
    assert result.exit_code == 1 and "current" not in result.output, result.output
    assert "foo_backward.yaml" in result.output and "foo.yaml's backward" in result.output


def test_the_listing_names_every_output_with_its_source(tmp_path):
    paths = [SPECS / "attn_f16_d128.yaml", SPECS / "attn_f16_d64.yaml"]
    specs = [fagen.load_spec(p) for p in paths]
    listed = outputs(specs, tmp_path, with_merge=True, sources=paths)
    assert len({o.path for o in listed}) == len(listed)
    assert {o.path.name for o in listed} == {"attn_f16_d128.cu", "attn_f16_d64.cu", *shared_kernels()} | \
        {f"{s.name}_backward.cu" for s in specs if s.backward is not None}
    assert renders(specs, tmp_path, with_merge=False, sources=paths).keys() == \
        {o.path for o in outputs(specs, tmp_path, with_merge=False, sources=paths)}


def test_the_same_file_named_twice_renders_once(tmp_path):
    path = SPECS / "attn_f16_d64.yaml"
    result = run("render", path, path, "-o", tmp_path)
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == ["attn_f16_d64.cu"]


def test_the_api_refuses_a_collision_too(tmp_path):
    a, b = write_spec(tmp_path / "a", "x"), write_spec(tmp_path / "b", "x")
    with pytest.raises(fagen.SpecError, match="a/x.yaml.*b/x.yaml"):
        renders([fagen.load_spec(a), fagen.load_spec(b)], tmp_path / "out", with_merge=False, sources=[a, b])
