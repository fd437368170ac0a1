"""fagen.flex against compiled FlexAttention, the same Python mods on both: attention-gym's
catalogue at the benchmark's sizes (B * N = 16k tokens, H * d = 2048; fp16; d 64 and 128; N 4k
and 16k), forward and forward + backward, GPU time by CUDA events (fagen.check.time_ms).

Each implementation's output and gradients are checked first against FlexAttention in float32
on the same inputs (relative norms, OUT_TOLERANCE and GRAD_TOLERANCE); a check that fails is a
row with the error, not a time. A mod fagen cannot take yet (a captured tensor in a score_mod)
is a row saying why. TFLOP/s count the kept (q, k) pairs: 4 * B * H * d * kept forward,
FWD_BWD_FACTOR times that forward and backward.

    python3 -m fagen.bench_flex [--quick] [--out bench/bench_flex.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
import traceback
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fagen import flex
from fagen.bench_cases import N_DOCS, PREFIX, WINDOW, SweepSize, doc_lengths
from fagen.bench_flex_tables import JSON, FlexRow, markdown
from fagen.check import relative_error, time_ms, to_numpy

HEAD_DIMS, LENGTHS = (64, 128), (4096, 16384)
DTYPE = "float16"
FWD_BWD_FACTOR = 3.5  # forward + backward FLOPs / forward FLOPs: 7 matmuls to 2
OUT_TOLERANCE, GRAD_TOLERANCE = 1e-2, 2e-2  # against FlexAttention in float32, fp16 inputs
NEIGHBOURHOOD = 8  # 2-D neighbourhood: keys within this many pixels along each axis of a square image
DILATION = 2
SOFTCAP = 20.0
IMPLS = ("fagen", "flex")
# FlexAttention's tiles where its defaults run out of shared memory (its documented kernel_options:
# forward BLOCK_M x BLOCK_N, backward BLOCK_M1/N1 and BLOCK_M2/N2)
FLEX_SMALL_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}
T5_BUCKETS, T5_MAX_DISTANCE = 32, 128  # T5's relative attention buckets (its defaults)
RANDOM_BLOCK, RANDOM_DENSITY = 128, 0.5  # per-head random masks: blocks kept at random, each head its own
PER_HEAD_MASKS = ("per_head_random",)  # their block masks hold each head's pattern
MOD_NAMES = ("causal", "sliding_window", "prefix_lm", "documents", "dilated_sliding_window", "neighbourhood_2d",
             "alibi", "softcap", "relative_bias_table", "relative_bias_learned", "t5_bias",
             "per_head_random")  # mods()'s, the tables' order


@dataclass(frozen=True)
class FlexCase(SweepSize):
    mod: str  # a name of MODS
    head_dim: int
    n: int
    dtype: str = DTYPE

    @property
    def key(self) -> str:
        return f"{self.dtype}-d{self.head_dim}-n{self.n}-{self.mod}"


def mods(n: int, heads: int, device="cuda") -> dict:
    """name -> (score_mod or None, mask_mod or None): attention-gym's mods at length n."""
    import torch

    docs = torch.as_tensor(_document_ids(n), device=device)
    side = math.isqrt(n)  # the 2-D neighbourhood's square image, side x side pixels
    gen = torch.Generator(device=device).manual_seed(n)
    table = torch.randn(heads, 2 * n - 1, device=device, generator=gen) * 0.1  # a learned relative-position bias
    learned_table = table.clone().requires_grad_()
    t5_table = torch.randn(heads, T5_BUCKETS, device=device, generator=gen) * 0.1
    blocks = -(-n // RANDOM_BLOCK)
    kept_blocks = torch.rand(heads, blocks, blocks, device=device, generator=gen) < RANDOM_DENSITY

    def causal(b, h, q, k):
        return q >= k

    return {
        "causal": (None, causal),
        "sliding_window": (None, lambda b, h, q, k: (q >= k) & (q - k <= WINDOW)),
        "prefix_lm": (None, lambda b, h, q, k: (k < PREFIX) | (q >= k)),
        "documents": (None, lambda b, h, q, k: (docs[q] == docs[k]) & (q >= k)),
        "dilated_sliding_window": (None, lambda b, h, q, k: (q >= k) & (q - k <= WINDOW) & ((q - k) % DILATION == 0)),
        "neighbourhood_2d": (None, lambda b, h, q, k: ((q % side - k % side).abs() <= NEIGHBOURHOOD)
                             & ((q // side - k // side).abs() <= NEIGHBOURHOOD)),
        "alibi": (lambda s, b, h, q, k: s - torch.exp2(-8.0 * (h + 1) / heads) * (q - k), causal),
        "softcap": (lambda s, b, h, q, k: SOFTCAP * torch.tanh(s / SOFTCAP), causal),
        "relative_bias_table": (lambda s, b, h, q, k: s + table[h, q - k + n - 1], causal),
        # the same table learned: its gradient (fagen's fagen.captured_grads, Flex's atomic adds) in the backward
        "relative_bias_learned": (lambda s, b, h, q, k: s + learned_table[h, q - k + n - 1], causal),
        "t5_bias": (lambda s, b, h, q, k: s + t5_table[h, t5_bucket(q - k)], causal),
        "per_head_random": (None, lambda b, h, q, k: kept_blocks[h, q // RANDOM_BLOCK, k // RANDOM_BLOCK]
                            | (q // RANDOM_BLOCK == k // RANDOM_BLOCK)),  # the diagonal's: no row without a key
    }


def t5_bucket(distance):
    """T5's relative-position bucket of a causal distance (transformers' _relative_position_bucket,
    bidirectional=False): exact below half the buckets, log-spaced to T5_MAX_DISTANCE, then the
    last bucket (the lower clamp, a no-op, proves the table's index in range)."""
    import torch

    exact = T5_BUCKETS // 2
    distance = distance.clamp(min=0)
    logarithmic = exact + torch.log(distance.float() / exact) / math.log(T5_MAX_DISTANCE / exact) * (T5_BUCKETS - exact)
    return torch.where(distance < exact, distance, logarithmic.int().clamp(exact, T5_BUCKETS - 1))


def _document_ids(n: int):
    return np.repeat(np.arange(N_DOCS), doc_lengths(n, N_DOCS))


def cases(quick: bool = False) -> list[FlexCase]:
    """Every mod at d 64 and 128, N 4k and 16k (quick: three mods at d 128, N 4k)."""
    if quick:
        return [FlexCase(m, 128, 4096) for m in ("causal", "documents", "softcap")]
    return [FlexCase(m, d, n) for m in MOD_NAMES for d in HEAD_DIMS for n in LENGTHS]


def kept_pairs(mask_mod, n: int, heads: int, device="cuda", rows: int = 1024) -> int:
    """(q, k) pairs the mask keeps, summed over the heads (a mask may differ by head), counted a
    slab of rows at a time on `device`."""
    import torch

    if mask_mod is None:
        return heads * n * n
    k = torch.arange(n, device=device)[None, :]
    total = 0
    for h in range(heads):
        for r0 in range(0, n, rows):
            q = torch.arange(r0, min(n, r0 + rows), device=device)[:, None]
            keep = torch.as_tensor(mask_mod(torch.tensor(0, device=device), torch.tensor(h, device=device), q, k))
            total += int(keep.expand(q.shape[0], n).sum())
    return total


def run_case(case: FlexCase) -> list[FlexRow]:
    """fagen and compiled FlexAttention on one draw of q, k, v and dout, each checked against
    FlexAttention in float32 before it is timed."""
    import torch
    from torch.nn.attention import flex_attention as torch_flex

    # Flex compiles afresh a case: past dynamo's recompile limit (new closures, dtypes, grad modes)
    # it would run eagerly without a word (as bench.py and bench_backward.py do)
    torch._dynamo.reset()
    started = time.perf_counter()
    progress = lambda step: print(f"  {case.key}: {step} at {time.perf_counter() - started:.0f} s",  # noqa: E731
                                  file=sys.stderr, flush=True)
    score_mod, mask_mod = mods(case.n, case.heads)[case.mod]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.key.encode()))
    shape = (case.batch, case.heads, case.n, case.head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=getattr(torch, case.dtype), generator=gen)
                     for _ in range(4))
    compiled = _compiled_flex()
    mask_heads = case.heads if case.mod in PER_HEAD_MASKS else None  # the others broadcast over the heads
    # a per-head mask compiled, as FlexAttention advises at length: its eager build is dense (64 GiB
    # at d64 16k: out of memory)
    torch_mask = None if mask_mod is None else torch_flex.create_block_mask(
        mask_mod, None, mask_heads, case.n, case.n, _compile=mask_heads is not None)
    progress("Flex's block mask")
    reference = _run(compiled, torch_mask, score_mod, *(x.float() for x in (q, k, v, dout)))
    progress("the float32 reference")
    flops = 4.0 * case.batch * case.head_dim * kept_pairs(mask_mod, case.n, case.heads)
    rows = []
    for impl in IMPLS:
        row = FlexRow(case.key, case.mod, impl, case.head_dim, case.n, case.batch, case.heads)
        rows.append(row)
        if impl == "fagen":
            fn, block_mask = flex.flex_attention, None if mask_mod is None else flex.create_block_mask(
                mask_mod, None, mask_heads, case.n, case.n)
        else:
            fn, block_mask = compiled, torch_mask
        try:
            try:
                _measure(row, fn, block_mask, score_mod, q, k, v, dout, reference, flops)
                progress(f"{impl} measured")
            except Exception as err:  # noqa: BLE001
                if impl != "flex" or "out of resource" not in str(err):
                    raise
                # FlexAttention's own workaround: smaller Triton tiles (its default ones, at d64
                # with a captured table, ask more shared memory than the H200 has)
                fn = functools.partial(compiled, kernel_options=FLEX_SMALL_TILES)
                _measure(row, fn, block_mask, score_mod, q, k, v, dout, reference, flops)
                tiles = "Flex: kernel_options " + ", ".join(f"{name} {size}"
                                                           for name, size in FLEX_SMALL_TILES.items())
                row.note = f"{tiles} (its default tiles exceed shared memory){'; ' + row.note if row.note else ''}"
        except Exception as err:  # noqa: BLE001 - a refused mod (flex.TraceError) or a failure is its row
            if not isinstance(err, flex.TraceError):
                traceback.print_exc(file=sys.stderr)
            row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return rows


def _measure(row: FlexRow, fn, block_mask, score_mod, q, k, v, dout, reference, flops: float) -> None:
    """fn's out and gradients against the reference, then (where they hold) its times, into row."""
    import torch

    got = _run(fn, block_mask, score_mod, q, k, v, dout)
    errors = [relative_error(to_numpy(a), to_numpy(b)) for a, b in zip(got, reference)]
    row.error = max(errors)
    if not (errors[0] <= OUT_TOLERANCE and max(errors[1:]) <= GRAD_TOLERANCE):
        row.note = (f"WRONG, not timed: relative errors of out, dq, dk, dv(, the learned tables) {', '.join(f'{e:.1e}' for e in errors)}"
                    f" against FlexAttention in float32")
        return
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def forward():
        with torch.no_grad():
            return fn(q, k, v, score_mod=score_mod, block_mask=block_mask)

    def forward_backward():
        return torch.autograd.grad(fn(*leaves, score_mod=score_mod, block_mask=block_mask),
                                   leaves + learned(score_mod), dout)

    row.fwd_ms, row.fwd_bwd_ms = time_ms(forward), time_ms(forward_backward)
    row.fwd_tflops = flops / row.fwd_ms / 1e9
    row.fwd_bwd_tflops = FWD_BWD_FACTOR * flops / row.fwd_bwd_ms / 1e9


def _run(fn, block_mask, score_mod, q, k, v, dout) -> tuple:
    """out, dq, dk, dv of fn(q, k, v, score_mod=, block_mask=) with dout."""
    import torch

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, score_mod=score_mod, block_mask=block_mask)
    return (out.detach(), *torch.autograd.grad(out, leaves + learned(score_mod), dout))


def learned(score_mod) -> list:
    """The tensors a score_mod's closure holds that require grad (a learned table): their
    gradients are checked and timed with q's, k's and v's."""
    import torch

    cells = [c.cell_contents for c in (getattr(score_mod, "__closure__", None) or ())]
    return [c for c in cells if isinstance(c, torch.Tensor) and c.requires_grad]


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three cases (d128, N 4k)")
    parser.add_argument("--mods", nargs="+", choices=MOD_NAMES, help="only these mods")
    parser.add_argument("--head-dims", nargs="+", type=int, choices=HEAD_DIMS, help="only these head dims")
    parser.add_argument("--lengths", nargs="+", type=int, choices=LENGTHS, help="only these lengths")
    parser.add_argument("--out", type=Path, default=Path("bench") / JSON)
    args = parser.parse_args(argv)
    chosen = [c for c in cases(args.quick) if (args.mods is None or c.mod in args.mods)
              and (args.head_dims is None or c.head_dim in args.head_dims) and (args.lengths is None or c.n in args.lengths)]
    rows: list[FlexRow] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for case in chosen:
        rows += run_case(case)
        print(f"{case.key}: " + ", ".join(f"{r.impl} {r.fwd_tflops}/{r.fwd_bwd_tflops} {r.note}"
                                           for r in rows[-len(IMPLS):]), file=sys.stderr, flush=True)
        # after every case: a run cut short keeps what it measured
        args.out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    print("\n".join(markdown(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
