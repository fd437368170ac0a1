"""scripts/compare_trees.py's table: medians, the slowdown either way round, and whether two
trees' runs are apart (the ratio of overlapping runs is the noise's)."""

import importlib.util
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "compare_trees.py"


@pytest.fixture(scope="module")
def compare_trees():
    spec = importlib.util.spec_from_file_location("compare_trees", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_times_compare_new_over_old_and_rates_old_over_new(compare_trees):
    old = [{("a", "fagen"): 10.0, ("b", "fagen"): 5.0}, {("a", "fagen"): 12.0, ("b", "fagen"): 5.2},
           {("a", "fagen"): 11.0, ("b", "fagen"): 5.1}]
    new = [{("a", "fagen"): 11.5, ("b", "fagen"): 6.0}, {("a", "fagen"): 9.0, ("b", "fagen"): 6.1},
           {("a", "fagen"): 12.5, ("b", "fagen"): 6.2, ("c", "fagen"): 1.0}]
    rows = {r["case"]: r for r in compare_trees.compare(old, new, higher_is_better=False)}
    assert set(rows) == {"a", "b"}  # a case one run lacks is left out
    assert rows["a"]["old"] == 11.0 and rows["a"]["new"] == 11.5 and rows["a"]["slowdown"] == pytest.approx(11.5 / 11)
    assert not rows["a"]["apart"]  # 9.0-12.5 overlaps 10-12: noise
    assert rows["b"]["apart"] and rows["b"]["slowdown"] == pytest.approx(6.1 / 5.1)
    rates = compare_trees.compare([{("a", "fagen"): 600.0}], [{("a", "fagen"): 500.0}], higher_is_better=True)
    assert rates[0]["slowdown"] == pytest.approx(1.2)  # fewer TF/s: slower, above 1 as for times


def test_the_old_tree_imports_beside_the_new_under_another_name(compare_trees, tmp_path):
    """host-one-process's copy: every `fagen` word in the old package's Python becomes fagen_old
    (imports and the torch op namespace), names that merely start with it stay, and the copy imports."""
    tree = tmp_path / "tree"
    (tree / "fagen").mkdir(parents=True)
    (tree / "specs").mkdir()
    (tree / "fagen" / "__init__.py").write_text("from fagen.ops import OP\nHOT = 'fagen_hot_path'\n")
    (tree / "fagen" / "ops.py").write_text("import fagen\nOP = 'fagen::attention_forward'\n")
    copy = compare_trees.renamed_copy(tree, tmp_path / "copy")
    assert (copy / "specs").is_dir() and not (copy / "fagen").exists()
    assert (copy / "fagen_old" / "ops.py").read_text() == "import fagen_old\nOP = 'fagen_old::attention_forward'\n"
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import fagen_old; print(fagen_old.OP, fagen_old.HOT)"], cwd=copy,
                          capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["fagen_old::attention_forward", "fagen_hot_path"]


def test_the_sass_cases_name_what_every_tree_has(compare_trees):
    """`--what sass` runs SASS_CASES in each tree: it must be Python whose fagen names exist
    (the derivation, the trainable variant, both renderers), and its cubins are counted by
    fagen.nvcc.sass_instructions here."""
    import ast
    import importlib

    from fagen.nvcc import sass_instructions

    modules = {name: importlib.import_module(f"fagen.{name}") for name in ("dispatch", "variants", "rendering")}
    tree = ast.parse(compare_trees.SASS_CASES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            assert hasattr(modules[node.value.id], node.attr), node.attr
        if isinstance(node, ast.ImportFrom) and node.module == "fagen.rendering":
            assert all(hasattr(modules["rendering"], alias.name) for alias in node.names)
    assert callable(sass_instructions)


def test_the_kernel_cases_name_what_the_tree_has(compare_trees):
    """`--what kernels-one-process` runs KERNELS_ONE_PROCESS with both packages imported: it must
    be Python whose fagen names exist with the arguments it passes (each tree's derivation,
    compile and backward entry points, the bench's backward spec and case; the timing and
    tolerances it reads from the new tree), and its cases' shapes must tile B * N = 16k tokens."""
    import ast
    import inspect

    from fagen import backward, bench_backward, bench_cases, check, dispatch, runtime

    script = compare_trees.KERNELS_ONE_PROCESS
    tree = ast.parse(script)
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for module, name in ((dispatch, "default_spec"), (runtime, "compile_kernel"), (bench_backward, "fagen_spec"),
                         (bench_cases, "Case"), (backward, "compile_backward"), (check, "time_ms"), (check, "OUT_TOLERANCE")):
        assert hasattr(module, name) and name in script, (module.__name__, name)
    assert {"default_spec", "compile_kernel"} <= attributes
    assert "keys" in inspect.signature(dispatch.default_spec).parameters
    assert list(inspect.signature(bench_backward.fagen_spec).parameters) == ["case", "q"]
    assert "return_lse" in inspect.signature(runtime.Kernel.__call__).parameters  # Backward.forward: the Kernel
    # the case lists alone (literal comprehensions), run apart from the script's torch work
    def names(node, context) -> set[str]:
        return {t.id for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, context)}

    # the statements that make and check CASES, and the key they filter by
    cases = [node for node in tree.body
             if isinstance(node, (ast.Assign, ast.AugAssign)) and "CASES" in names(node, ast.Store)
             or isinstance(node, ast.If) and "CASES" in names(node.test, ast.Load)
             or isinstance(node, ast.FunctionDef) and node.name == "case_key"]

    def picked(only: str) -> list[tuple]:
        namespace: dict = {"re": re, "sys": SimpleNamespace(argv=["-c", "rows.json", "4", only], exit=sys.exit)}
        exec(compile(ast.Module(body=cases, type_ignores=[]), "KERNELS_ONE_PROCESS", "exec"), namespace)
        return namespace["CASES"]

    every = picked("")
    assert {case[0] for case in every} == {"forward", "backward"}
    assert all(16384 % n == 0 and 2048 % d == 0 for _, _, d, n, _ in every)
    # --only: the cases whose key the pattern finds, and no others
    assert picked("forward .* d128 ") == [case for case in every if case[0] == "forward" and case[2] == 128]
    assert picked("backward float16 d64 n1024 causal") == [("backward", "float16", 64, 1024, True)]
    with pytest.raises(SystemExit, match="picks none of the cases"):
        picked("d96")
