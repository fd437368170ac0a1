"""fagen: fused attention kernels generated from a YAML spec."""

__version__ = "0.1.0"

from fagen.render import render
from fagen.load import load_spec, parse_spec
from fagen.spec import AttentionSpec, SpecError


def compile(spec):
    """Compile a spec for the current GPU (needs CuPy); returns a callable `Kernel`."""
    from fagen.runtime import compile_kernel

    return compile_kernel(spec)


def attention(q, k, v, **kwargs):
    """softmax(q k^T * scale) v with a shipped kernel for q's dtype and head_dim (needs CuPy).
    PyTorch tensors go through the fagen::attention_forward op: autograd, torch.compile and
    CUDA graphs see it (fagen.torch_op)."""
    from fagen.device import is_torch

    if is_torch(q):
        from fagen.torch_op import attention as _attention
    else:
        from fagen.runtime import attention as _attention
    return _attention(q, k, v, **kwargs)


__all__ = ["AttentionSpec", "SpecError", "__version__", "attention", "compile", "load_spec", "parse_spec", "render"]
