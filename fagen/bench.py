"""Timing fagen kernels beside PyTorch's SDPA backends, same process, same GPU.

FLOPs: 4 * B * H * Nq * Nk * d (Q.K^T and P.V, 2 FLOPs per multiply-add), halved for causal.
Every case is checked against the oracle before it is timed: a wrong kernel is never timed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fagen.check import attention_flops, check_against_oracle, random_inputs, time_ms
from fagen.spec import AttentionSpec


@dataclass
class Timing:
    kernel: str
    b: int
    h: int
    n: int
    d: int
    causal: bool
    ms: float
    tflops: float

    def as_dict(self) -> dict:
        return asdict(self)


SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}


def time_spec(spec: AttentionSpec, b: int, h: int, nq: int, nk: int | None = None) -> Timing:
    """Check `spec` against the oracle on a smaller problem, then time it on this one."""
    from fagen.runtime import compile_kernel

    nk = nq if nk is None else nk
    check = check_against_oracle(spec, 1, 2, 2, min(nq, 777), min(nk, 777), framework="torch")
    if not check.passed:
        raise AssertionError(f"refusing to time a wrong kernel: {check.summary()}")
    kernel = compile_kernel(spec)
    q, k, v, out = random_inputs("torch", spec.dtype, b, h, h, nq, nk, spec.head_dim)
    ms = time_ms(lambda: kernel(q, k, v, out=out), warmup=10, iters=30)
    flops = attention_flops(b, h, nq, nk, spec.head_dim, spec.causal)
    return Timing(spec.name, b, h, nq, spec.head_dim, spec.causal, ms, flops / ms / 1e9)


def time_fagen(spec: AttentionSpec, b: int, h: int, n: int) -> Timing:
    return time_spec(spec, b, h, n, n)


def time_sdpa(backend: str, dtype: str, b: int, h: int, n: int, d: int, causal: bool) -> Timing | None:
    """One of PyTorch's SDPA backends; None where it does not run this case."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, _ = random_inputs("torch", dtype, b, h, h, n, n, d)
    fn = torch.nn.functional.scaled_dot_product_attention
    try:
        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[backend])):
            ms = time_ms(lambda: fn(q, k, v, is_causal=causal))
    except RuntimeError:
        return None
    flops = attention_flops(b, h, n, n, d, causal)
    return Timing(backend, b, h, n, d, causal, ms, flops / ms / 1e9)
