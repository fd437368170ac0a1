"""A user error on the command line is one line on stderr, `Error: ...`, and nothing else: exit 2
for a bad option, argument or command (click's usage errors, which print the usage and a help
hint first unless told not to), 1 otherwise (a refused spec, several refused specs)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner

from fagen.cli import main
from fagen.load import SPECS

SPEC = SPECS / "attn_f16_d128.yaml"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line(result, code: int, *names: str) -> str:
    assert result.exit_code == code, result.output
    assert result.exc_info is None or result.exc_info[0] is SystemExit, result.exc_info
    assert result.stdout == "", result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.mark.parametrize(("args", "names"), [
    (["render", "--bogus"], ["--bogus"]),
    (["bogus"], ["bogus"]),
    (["compile"], ["SPEC"]),
    (["render", "nowhere.yaml"], ["nowhere.yaml"]),
    (["mask", "show", "circle"], ["circle", "causal"]),
    (["mask", "show", "causal", "-n", "many"], ["many"]),
    (["check", SPEC, "--kv-heads", "x"], ["--kv-heads", "x"]),
    (["check", SPEC, "--shape", "1,2"], ["--shape", "B,H,Nq,Nk"]),
    (["mask", "show", "causal", "-o", "picture.jpg"], ["picture.jpg", ".png"]),
    (["bench", "--from-json", SPEC, "--quick"], ["--quick", "--from-json"]),
])
def test_usage_errors_are_one_line(args, names):
    assert_one_line(run(*args), 2, *names)


def test_a_spec_breaking_several_rules_is_one_line(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump({"name": "two", "dtype": "float32", "head_dim": 100,
                                    "tiling": {"block_q": 64, "block_kv": 64}}))
    line = assert_one_line(run("render", path, "-o", tmp_path / "out"), 1, "dtype", "head_dim", str(path))
    assert "float32" in line and "100" in line


def test_several_refused_specs_are_one_line(tmp_path):
    for name, head_dim in (("a", 100), ("b", 7)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(
            {"name": name, "dtype": "float16", "head_dim": head_dim, "tiling": {"block_q": 64, "block_kv": 64}}))
    line = assert_one_line(run("render", tmp_path, "-o", tmp_path / "out"), 1, "2 of 2", "a.yaml", "b.yaml")
    assert "100" in line and "7" in line


def test_help_and_version_still_exit_0():
    assert run("--help").exit_code == 0 and "render" in run("--help").output
    assert run("--version").exit_code == 0
    assert run("render", "--help").exit_code == 0


def test_the_installed_command_prints_one_line():
    """Through the console entry point (click's standalone mode), not only the test runner."""
    done = subprocess.run([sys.executable, "-m", "fagen", "render", "--bogus"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("Error: "), done.stderr
