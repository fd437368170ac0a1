"""Where a training step's attention time goes, fagen against SDPA's backends: per case, the host
time of a forward + backward through autograd (calls queued back to back, no wait), its GPU time
(the same calls held behind a blocking kernel, fagen.check.time_ms: host excluded) and Triton's
do_bench (what a user's loop sees: the larger of the two), in TF/s. A step whose host time is
above its GPU time is host-bound: a faster kernel cannot help it, a shorter Python path can.
--profile adds cProfile's heaviest functions of fagen's step.

    python3 scripts/training_host_time.py [--cases d128-1k-causal-f16 ...] [--profile] [--top 20]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import time
from typing import NamedTuple

CASES = ("d128-1k-causal-f16", "d128-1k-none-f16", "d64-1k-causal-bf16", "d128-4k-causal-f16")
TOKENS, WIDTH = 16384, 2048  # B x N and H x d of every case (the bench's convention)
FWD_BWD_FLOPS = 3.5  # forward + backward: 4 + 10 of the forward's 4 B H N^2 d


class Case(NamedTuple):
    head_dim: int
    n: int
    causal: bool
    dtype: str

    @classmethod
    def parse(cls, text: str) -> Case:
        """'d128-1k-causal-f16': head_dim, sequence length (k: 1024), mask (causal or none), dtype (f16, bf16)."""
        try:
            d, n, mask, dtype = text.split("-")
            length = int(n[:-1]) * 1024 if n.endswith("k") else int(n)
            if not d.startswith("d") or mask not in ("causal", "none") or dtype not in ("f16", "bf16"):
                raise ValueError
            return cls(int(d[1:]), length, mask == "causal", {"f16": "float16", "bf16": "bfloat16"}[dtype])
        except ValueError:
            raise ValueError(f"case {text!r}: expected d<head_dim>-<N>[k]-<causal|none>-<f16|bf16>, e.g. "
                             f"d128-1k-causal-f16") from None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return TOKENS // self.n, WIDTH // self.head_dim, self.n, self.head_dim

    def forward_flops(self) -> float:
        b, h, n, d = self.shape
        return 4 * b * h * n * n * d / (2 if self.causal else 1)


def row(case: Case, impl: str, host_ms: float, gpu_ms: float, wall_ms: float) -> str:
    """One line of the report: the three times, fwd+bwd TF/s of the wall time, and what bounds it."""
    flops = FWD_BWD_FLOPS * case.forward_flops()
    bound = "host-bound" if host_ms > gpu_ms else "GPU-bound"
    return (f"d{case.head_dim} N{case.n} {'causal' if case.causal else 'none'} {case.dtype} {impl:6s}: host "
            f"{host_ms:.3f} ms, GPU {gpu_ms:.3f} ms, do_bench {wall_ms:.3f} ms = {flops / wall_ms / 1e9:.0f} TF/s "
            f"({bound})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), type=Case.parse)
    parser.add_argument("--profile", action="store_true", help="cProfile fagen's step (the first case)")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import fagen
    from fagen.check import time_ms

    impls = {"fagen": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}
    for case in args.cases:
        q, k, v = (torch.randn(*case.shape, device="cuda", dtype=getattr(torch, case.dtype), requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        for impl, backend in impls.items():
            def step():
                out = (fagen.attention(q, k, v, causal=case.causal) if backend is None else
                       torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal))
                torch.autograd.grad(out, (q, k, v), dout)

            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(30):
                    step()
                host_ms = (time.perf_counter() - start) / 30 * 1e3
                torch.cuda.synchronize()
                print(row(case, impl, host_ms, time_ms(step), do_bench(step, warmup=25, rep=150)))
        if args.profile and case == args.cases[0]:
            def fagen_step():
                torch.autograd.grad(fagen.attention(q, k, v, causal=case.causal), (q, k, v), dout)

            profile = cProfile.Profile()
            profile.enable()
            for _ in range(30):
                fagen_step()
            profile.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
            print(text.getvalue())


if __name__ == "__main__":
    main()
