"""The programmatic dependent launch without a GPU: the ctypes launch structures match cuda.h's
(compiled against the toolkit's header with nvcc), and only decode kernels wait in the kernel."""

import ctypes
import subprocess

import pytest

from fagen import dependent_launch, variants
from fagen.load import SPECS, load_spec
from fagen.nvcc import find_nvcc
from fagen.rendering import render

LAYOUT = r"""
#include <cuda.h>
#include <cstddef>
#include <cstdio>
int main() {
  std::printf("%zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
              sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),
              offsetof(CUlaunchConfig, numAttrs), (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
}
"""


def test_the_launch_structures_match_cuda_h(tmp_path):
    source, binary = tmp_path / "layout.cpp", tmp_path / "layout"
    source.write_text(LAYOUT)
    subprocess.run([find_nvcc(), "-x", "c++", str(source), "-o", str(binary)], check=True, capture_output=True)
    header = [int(x) for x in subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split()]
    config = dependent_launch._Config
    ours = [ctypes.sizeof(dependent_launch._Attribute), dependent_launch._Attribute.value.offset, ctypes.sizeof(config),
            config.stream.offset, config.attrs.offset, config.num_attrs.offset,
            dependent_launch.PROGRAMMATIC_STREAM_SERIALIZATION]
    assert ours == header


@pytest.mark.parametrize("path", sorted(SPECS.glob("decode_*.yaml")), ids=lambda p: p.stem)
def test_decode_kernels_wait_before_any_access_and_let_the_next_launch_after_their_keys(path):
    spec = load_spec(path)
    for kernel in (spec, variants.merged_variant(spec), variants.unsplit_variant(spec)):
        source = render(kernel)
        body = source[source.index(") {", source.index('extern "C" __global__')):]
        wait, launch = body.index("griddepcontrol.wait;"), body.index("griddepcontrol.launch_dependents;")
        assert wait < body.index("smem_chunks[]")  # before anything else
        assert body.index("kv.wait(") < launch < body.index("write_output(o_acc")  # after the main loop
        assert "__CUDA_ARCH__ >= 900" in body[:wait]  # sm_80 and sm_86 builds have no griddepcontrol


def test_other_kernels_launch_as_usual():
    for name in ("attn_f16_d128", "attn_f16_d128_h200", "attn_bf16_d64_causal"):
        assert "griddepcontrol" not in render(load_spec(SPECS / f"{name}.yaml"))
