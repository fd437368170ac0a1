"""Where a generation step's time goes, fagen against SDPA: one end-to-end case (fagen.bench_e2e's
models and prompts), a prefill and DECODE_STEPS decode steps of each implementation under
torch.profiler. Per implementation: wall time a step, the GPU's busy time in it (the sum of its
kernels' durations), the attention kernels' share of that, and the kernels that took the most.
What bounds fagen's ratio to SDPA is then read off: a step whose wall time is far above its GPU
time is the host's (transformers' Python), and attention's GPU share caps what a faster kernel
can give.

    python3 scripts/profile_generation.py [--model llama] [--batch 8] [--prompt 1024] [--padded] [--top 12]
"""

from __future__ import annotations

import argparse
import time

import torch

from fagen.bench_e2e import build
from fagen.bench_e2e_tables import E2ECase, prompts
import fagen.transformers

DECODE_STEPS = 16
# kernel names that are attention, fagen's or SDPA's backends' (FlashAttention-2, cuDNN, memory-efficient, math's softmax)
ATTENTION_NAMES = ("fagen_", "flash", "fmha", "cudnn", "attention", "softmax", "split_merge")


def is_attention(name: str) -> bool:
    name = name.lower()
    return any(part in name for part in ATTENTION_NAMES)


def kernel_times(profile) -> dict[str, float]:
    """Microseconds of GPU time by kernel name: the profile's device events (CUPTI's, so the
    kernels CuPy launches for fagen count too), each its span on the GPU."""
    times: dict[str, float] = {}
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.time_range.elapsed_us()
    return times


def profile_steps(model, ids, mask, implementation: str):
    """(prefill wall ms, decode wall ms a step, kernel times of the decode steps) for one implementation."""
    from transformers import DynamicCache

    model.set_attn_implementation(implementation)
    with torch.no_grad():
        for _ in range(2):  # warm-up: compiles, packs, allocator
            cache = DynamicCache(config=model.config)
            logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
        torch.cuda.synchronize()
        start = time.perf_counter()
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
        torch.cuda.synchronize()
        prefill_ms = (time.perf_counter() - start) * 1e3
        token = logits[:, -1:].argmax(-1)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            start = time.perf_counter()
            for _ in range(DECODE_STEPS):
                mask = torch.cat([mask, torch.ones_like(token)], 1)
                logits = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits
                token = logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            decode_ms = (time.perf_counter() - start) * 1e3 / DECODE_STEPS
    return prefill_ms, decode_ms, kernel_times(profile)


def report(implementation: str, prefill_ms: float, decode_ms: float, kernels: dict[str, float], top: int) -> list[str]:
    gpu_ms = sum(kernels.values()) / 1e3 / DECODE_STEPS
    attention_ms = sum(t for name, t in kernels.items() if is_attention(name)) / 1e3 / DECODE_STEPS
    lines = [f"{implementation}: prefill {prefill_ms:.2f} ms; decode step {decode_ms:.2f} ms wall, {gpu_ms:.3f} ms GPU "
             f"busy ({gpu_ms / decode_ms:.0%}), attention {attention_ms:.3f} ms "
             f"({attention_ms / gpu_ms if gpu_ms else 0:.0%} of the GPU's)"]
    for name, t in sorted(kernels.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"    {t / 1e3 / DECODE_STEPS:8.3f} ms a step  {'*' if is_attention(name) else ' '} {name[:100]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("llama", "gemma2"), default="llama")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--padded", action="store_true", help="left-padded prompts of lengths in [prompt / 4, prompt]")
    parser.add_argument("--top", type=int, default=12, help="kernels listed a implementation")
    args = parser.parse_args()
    name = fagen.transformers.register()
    case = E2ECase(args.model, args.batch, args.prompt, DECODE_STEPS + 1, padded=args.padded)
    model = build(args.model)
    ids, mask = prompts(case)
    print(case.key)
    for implementation in ("sdpa", name):
        print("\n".join(report(implementation, *profile_steps(model, ids, mask, implementation), args.top)))


if __name__ == "__main__":
    main()
