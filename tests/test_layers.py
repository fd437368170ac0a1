"""The import graph runs one way: each module imports only modules of lower layers, read
from the source (function-local imports included). A fagen import inside a function is
allowed only where it keeps a command's start-up free of CuPy and PyTorch (the CLI, the
package's front door), never to dodge a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fagen"

# Lowest first. A module may import the modules of any layer below its own.
LAYERS = [
    ("expression", "mask_kinds", "side_inputs", "element_types", "version", "fp8_inputs", "incoherent", "disk_cache",
     "padding_runs"),
    # leaves: standard library and NumPy (fp8_inputs, incoherent: their torch and CuPy paths import them where
    # they run); fagen's directory on disk; a padded batch's rows (the padding-runs kernel's twin)
    ("derivatives", "fp8_backward_rounding"),  # expression trees' derivatives, as trees; where an FP8
    # backward rounds (the oracle's model of it)
    ("spec", "oracle", "mod_tracing"),  # the spec's models and rules; the float64 reference (NumPy alone);
    # FlexAttention's Python mods traced into expressions
    ("plan", "masks", "column_split"),  # every derived number and the kernel ABI; runtime block masks; what
    # the kernels that split O by columns over two warpgroups (MLA decode, head_dim 512) share
    ("backward_plan", "captured_grads", "mla_plan", "wide_head_plan", "key_split_plan", "fp8_backward_plan"),
    # the backward kernels' numbers (its dQ kernel is a forward plan); a traced score_mod's captured tensors' gradients (over a block mask's
    # pairs); MLA decode's, the head_dim 512 kernels', the 192/128 backward's and the FP8 backward's numbers
    ("load",),  # YAML and mappings to validated specs (the spec's and the plan's rules)
    ("rendering", "variants"),  # spec -> CUDA; the shipped specs and the variants derived from them
    ("nvcc",),  # offline compilation and resource checks, no GPU
    ("device", "tensor_maps", "dependent_launch", "hot_path"),  # CuPy, tensor adapters, streams, GPU identity;
    # the driver: TMA tensor maps, programmatic dependent launches, a prepared call's launches from C
    ("process_group", "ring_link"),  # the ranks of a multi-GPU run (NCCL or torch.distributed); a ring hop on the copy engines
    ("runtime",),  # compile with NVRTC, check and pack arguments, launch
    ("dispatch",),  # which kernel a call runs: family, spec, split count
    ("backward",),  # the backward kernels, launched on the forward's inputs and outputs
    ("accumulated_dq",),  # the launch of the dedicated backwards that add dQ into a float32 accumulator
    ("splitkv", "mla", "wide_head", "key_split", "fp8_backward"),  # split-KV partials and the merge; MLA decode
    # (576/512 over a paged latent cache); the head_dim 512 forward and backward; the 192/128 backward; the FP8 backward
    ("decode",),  # GQA-packed split-KV for a few query rows; fagen.attention's path
    ("sequences",),  # varlen batches and paged KV caches (serving layouts)
    ("check", "distributed", "torch_op"),  # against the oracle; multi-GPU modes; the PyTorch ops
    ("transformers",),  # fagen as a transformers attention implementation
    ("api", "flex"),  # the public entry points: fagen.attention and its siblings; FlexAttention's API
    ("bench_cases", "bench_rows", "bench_e2e_tables", "bench_flex_tables"),  # the benchmark's cases, masks and FLOPs;
    # its rows' JSON and CSV
    # files; the end-to-end benchmark's cases and tables
    ("bench_backward", "bench_serving", "bench_e2e", "bench_flex", "bench_fp8", "bench_head_widths",
     "bench_mla"),  # the backward and serving layouts in
    # `fagen bench`; generation; fagen.flex against FlexAttention
    ("bench",),
    ("tune",),
    ("cli",),
    ("__main__", "__init__"),
]
LAYER = {module: i for i, names in enumerate(LAYERS) for module in names}
LAZY_ALLOWED = {"cli", "api"}  # start-up time: `fagen render` and `import fagen` load no CuPy


def fagen_imports(path: Path) -> list[tuple[str, bool]]:
    """(imported fagen module, inside a function?) for every import in the file."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module and child.module.split(".")[0] == "fagen":
                if child.module == "fagen":  # from fagen import a, b: a module, or a name of the package's own
                    found.extend((alias.name if alias.name in LAYER else "__init__", inner) for alias in child.names)
                else:
                    found.append((child.module.split(".")[1], inner))
            elif isinstance(child, ast.Import):  # import fagen.a; import fagen (the package: its __init__)
                found.extend((a.name.split(".")[1] if "." in a.name else "__init__", inner)
                             for a in child.names if a.name.split(".")[0] == "fagen")
            visit(child, inner)
    visit(tree, False)
    return found


MODULES = sorted(p.stem for p in PACKAGE.glob("*.py"))


def test_every_module_has_a_layer():
    assert set(MODULES) == set(LAYER), "place a new module in LAYERS"


@pytest.mark.parametrize("module", MODULES)
def test_imports_point_down(module):
    upward = [(m, LAYERS[LAYER[m]]) for m, _ in fagen_imports(PACKAGE / f"{module}.py")
              if m != module and LAYER[m] >= LAYER[module]]
    assert not upward, f"fagen.{module} (layer {LAYER[module]}) imports {upward}"


@pytest.mark.parametrize("module", sorted(set(MODULES) - LAZY_ALLOWED))
def test_no_function_local_fagen_imports(module):
    lazy = [m for m, inside in fagen_imports(PACKAGE / f"{module}.py") if inside]
    assert not lazy, f"fagen.{module} imports {lazy} inside a function: import at the top"


@pytest.mark.parametrize("module", ["expression", "mask_kinds", "side_inputs", "element_types", "oracle"])
def test_the_leaves_and_the_oracle_need_no_pydantic(module):
    """The oracle depends on NumPy alone; so do the leaves it reads."""
    third_party = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            third_party |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            third_party.add(node.module.split(".")[0])
    assert third_party <= {"__future__", "numpy", "fagen", "math", "re", "weakref", "collections", "dataclasses",
                           "functools", "types", "typing"}, third_party


@pytest.mark.parametrize("module", ["spec", "plan", "load", "rendering", "variants", "nvcc"])
def test_layers_below_the_device_import_no_cupy_or_torch(module):
    text = (PACKAGE / f"{module}.py").read_text()
    assert "import cupy" not in text and "import torch" not in text


def test_the_package_itself_counts_as_an_import(tmp_path):
    """`import fagen` and `from fagen import __version__` run the package's __init__ (the top
    layer): the reader sees both, in functions too, beside plain module imports."""
    source = tmp_path / "m.py"
    source.write_text("from fagen import __version__, spec\nimport fagen.plan\n\ndef f():\n    import fagen\n")
    assert fagen_imports(source) == [("__init__", False), ("spec", False), ("plan", False), ("__init__", True)]
