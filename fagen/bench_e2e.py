"""End to end: transformers generation with fagen against SDPA's backends, in one process.

    python -m fagen.bench_e2e [--quick] [-o OUT_DIR]

Random-weight models of real shapes (a Llama of 16 layers, hidden 2048, 32 query and 8 KV heads of
64; a Gemma-2 of 8 layers, heads of 256, a 4096-key window on alternate layers, softcaps), bf16,
greedy `generate` on transformers' dynamic cache, or on a static cache of STATIC_CACHE_LEN slots
(whose decode steps generate compiles itself: torch.compile, CUDA graphs). Per case and implementation: prefill ms (one
forward over the prompt) and decode tokens/s (the batch over the median period between the
tokens after the first, stamped by a logits processor), the best of ROUNDS rounds in which the implementations take
turns (host time drifts by tens of percent between minutes on a shared host, and only ever adds),
and the host time a decode step spends in the attention and mask functions. SDPA runs as transformers calls it: its own
backend choice (`sdpa`), and pinned to cuDNN (`sdpa_cudnn`) and FlashAttention-2 (`sdpa_flash`,
which takes no mask: padded cases are n/a). Before fagen is timed, its prompt logits (at the
prompt's tokens) and its generated tokens are compared with SDPA's; the row says how they agree.
Padded cases draw each prompt's length from [shortest, prompt] (Llama: 256 to 4096 tokens, the
issue's mixed lengths; otherwise a quarter of the longest up) and left-pad the batch, as
transformers serves one.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

from transformers import LogitsProcessor, LogitsProcessorList

import fagen.transformers
from fagen.bench_e2e_tables import (IMPLEMENTATIONS, JSON, ROUNDS, STATIC_CACHE_LEN, E2ECase, E2ERow, cases,
                                    decode_rate, markdown, prompts, shown, whole_decode_rate, write_json)


def config(model: str):
    """The model's transformers config (random weights; vocabulary cut to 32000)."""
    if model == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=64, num_hidden_layers=16, vocab_size=32000, max_position_embeddings=8192,
                           initializer_range=0.08)  # logits apart enough that rounding rarely decides a token
    from transformers import Gemma2Config

    return Gemma2Config(hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=256, num_hidden_layers=8, vocab_size=32000, sliding_window=4096,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
                        max_position_embeddings=8192)


def build(model: str):
    """The model in bf16 on the GPU, its weights drawn there."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return AutoModelForCausalLM.from_config(config(model), attn_implementation="sdpa").eval()
    finally:
        torch.set_default_dtype(default)


def _backend(impl: str):
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return {"sdpa_cudnn": sdpa_kernel(SDPBackend.CUDNN_ATTENTION),
            "sdpa_flash": sdpa_kernel(SDPBackend.FLASH_ATTENTION)}.get(impl, contextlib.nullcontext())


def check(model, case: E2ECase, impl: str, reference: dict | None) -> tuple[str | None, dict]:
    """One implementation's result on a case (its warm-up too): a note saying how its prompt
    logits (at the tokens) and generated tokens agree with `reference` (SDPA's), or "n/a: why"
    where the backend cannot take the case; and the result itself, the next one's reference."""
    import torch

    model.set_attn_implementation("fagen" if impl == "fagen" else "sdpa")
    ids, mask = prompts(case)
    with torch.no_grad(), _backend(impl):
        try:
            logits = model(input_ids=ids, attention_mask=mask).logits[mask.bool()].float()
            tokens = model.generate(ids, **_generate_options(model, case, mask))[:, case.prompt:]
        except RuntimeError as error:  # a backend that cannot take the case (FA2 and a mask)
            return f"n/a: {str(error).splitlines()[0][:80]}", reference
    if reference is None:
        return "", dict(logits=logits, tokens=tokens)
    error = ((logits - reference["logits"]).norm() / reference["logits"].norm()).item()
    same = (tokens == reference["tokens"]).float().mean().item()
    return f"prompt logits rel. err {error:.1e} against SDPA, {same:.0%} of generated tokens equal", reference


def _generate_options(model, case: E2ECase, mask) -> dict:
    """generate's arguments for the case: greedy, exactly new_tokens, and for a static case the
    model's static cache (one a model, emptied for each call: its tensors keep their addresses,
    which the compiled steps' CUDA graphs hold)."""
    options = dict(attention_mask=mask, max_new_tokens=case.new_tokens, min_new_tokens=case.new_tokens,
                   do_sample=False, pad_token_id=0)
    if case.static:
        options["past_key_values"] = static_cache(model, case.batch)
    return options


def static_cache(model, batch: int):
    """The model's static cache for `batch` rows, made once and reset for each use."""
    from transformers import StaticCache

    kept = getattr(model, "_bench_static_caches", None)
    if kept is None:
        kept = model._bench_static_caches = {}
    if batch not in kept:
        kept.clear()  # one at a time: a 16k cache of 32 rows is gigabytes
        kept[batch] = StaticCache(config=model.config, max_cache_len=STATIC_CACHE_LEN)
    cache = kept[batch]
    cache.reset()
    return cache


@contextlib.contextmanager
def attention_host_time(impl: str, spent: list[float]):
    """Adds to spent[0] the host seconds `impl`'s decode steps (one query token) spend in the
    attention and mask functions transformers calls for it: its AttentionInterface and
    AttentionMaskInterface entries wrapped while the context runs, then put back. Where
    generation is host-bound, this is what the attention implementation itself costs a step."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = "fagen" if impl == "fagen" else "sdpa"
    attention, mask = AttentionInterface()[name], AttentionMaskInterface()[name]

    def timed_attention(module, query, *args, **kwargs):
        start = time.perf_counter()
        try:
            return attention(module, query, *args, **kwargs)
        finally:
            if query.shape[2] == 1:
                spent[0] += time.perf_counter() - start

    def timed_mask(*args, **kwargs):
        start = time.perf_counter()
        try:
            return mask(*args, **kwargs)
        finally:
            if kwargs.get("q_length", args[1] if len(args) > 1 else None) == 1:
                spent[0] += time.perf_counter() - start

    AttentionInterface.register(name, timed_attention)
    AttentionMaskInterface.register(name, timed_mask)
    try:
        yield
    finally:
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, mask)


class StepClock(LogitsProcessor):
    """Stamps the host's clock each time generate asks for a token's scores: the periods between
    the stamps are the decode steps (the first stamp follows the prefill)."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores

    @property
    def steps(self) -> list[float]:
        return [after - before for before, after in zip(self.stamps, self.stamps[1:])]


def timed(model, case: E2ECase, impl: str) -> tuple[float, float, list[float], float | None]:
    """(prefill seconds, generate seconds, its decode steps' seconds, host seconds a decode step
    in the attention and mask functions) of one round: a forward over the prompt, then generate.
    The last is None for a static cache, whose decode steps are compiled graphs that call no
    Python function."""
    import torch

    model.set_attn_implementation("fagen" if impl == "fagen" else "sdpa")
    ids, mask = prompts(case)
    spent, clock = [0.0], StepClock()
    timing = contextlib.nullcontext() if case.static else attention_host_time(impl, spent)
    options = dict(_generate_options(model, case, mask), logits_processor=LogitsProcessorList([clock]))
    with torch.no_grad(), _backend(impl):
        prefill = _seconds(lambda: model(input_ids=ids, attention_mask=mask, use_cache=True))
        with timing:
            generate = _seconds(lambda: model.generate(ids, **options))
    return prefill, generate, clock.steps, None if case.static else spent[0] / (case.new_tokens - 1)


def _seconds(call) -> float:
    """Wall seconds of `call` from an idle GPU to its work's end."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_case(model, case: E2ECase, implementations) -> list[E2ERow]:
    """Each implementation checked (SDPA's first, the others against it), then timed in ROUNDS
    rounds, the implementations interleaved so that the host's drift falls on all of them: each
    one's best round makes the row (what a shared host's interference adds is never negative;
    the note gives the rounds' spread)."""
    notes, reference = {}, None
    for impl in implementations:
        notes[impl], reference = check(model, case, impl, reference)
    runnable = [impl for impl in implementations if not notes[impl].startswith("n/a")]
    rounds: dict[str, list[tuple[float, float, list[float], float | None]]] = {impl: [] for impl in runnable}
    for i in range(ROUNDS):
        for impl in runnable if i % 2 == 0 else runnable[::-1]:
            rounds[impl].append(timed(model, case, impl))
    rows = []
    for impl in implementations:
        if impl not in rounds:
            rows.append(E2ERow(case.key, impl, None, None, notes[impl]))
            continue
        prefill = min(p for p, _, _, _ in rounds[impl])
        rates = [decode_rate(case, steps) for _, _, steps, _ in rounds[impl]]
        whole = max(whole_decode_rate(case, g, prefill) for _, g, _, _ in rounds[impl])
        spent = [s for _, _, _, s in rounds[impl] if s is not None]
        spread = (f"decode {min(rates):.0f}-{max(rates):.0f} tok/s over {ROUNDS} rounds "
                  f"({whole:.0f} by generate's time less the prefill)")
        rows.append(E2ERow(case.key, impl, prefill * 1e3, max(rates),
                           f"{notes[impl]}; {spread}" if notes[impl] else spread,
                           min(spent) * 1e6 if spent else None))
    return rows


def run(quick: bool = False, implementations=IMPLEMENTATIONS, only: str | None = None,
        sections: tuple[str, ...] | None = None) -> list[E2ERow]:
    import torch

    fagen.transformers.register()
    chosen = [c for c in cases(quick) if (only is None or c.model == only) and (sections is None or c.section in sections)]
    rows: list[E2ERow] = []
    for name in dict.fromkeys(c.model for c in chosen):
        model = build(name)
        for case in (c for c in chosen if c.model == name):
            for row in run_case(model, case, implementations):
                rows.append(row)
                print(f"{row.case:45} {row.impl:11} prefill {shown(row.prefill_ms)} ms  decode "
                      f"{shown(row.decode_tok_s)} tok/s  {row.note}", flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def environment() -> dict:
    import datetime

    import torch
    import transformers

    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="four cases, SDPA and fagen")
    parser.add_argument("--model", choices=("llama", "gemma2"), default=None, help="one model's cases only")
    parser.add_argument("--impl", nargs="+", choices=IMPLEMENTATIONS, default=None,
                        help="these implementations (default: all; --quick: sdpa and fagen)")
    parser.add_argument("--section", nargs="+", choices=("equal", "padded", "static"), default=None,
                        help="these sections' cases only")
    parser.add_argument("-o", "--out", type=Path, default=Path("bench"))
    args = parser.parse_args()
    impls = tuple(args.impl) if args.impl else ("sdpa", "fagen") if args.quick else IMPLEMENTATIONS
    if impls[0] != "sdpa":
        parser.error("--impl: put sdpa first (the others are checked against it)")
    rows = run(args.quick, impls, args.model, tuple(args.section) if args.section else None)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = environment()
    write_json(rows, meta, args.out / JSON)
    print("\n".join(markdown(rows, meta)))
    print(f"wrote {args.out / JSON}; `python3 -m fagen bench --from-json {args.out / 'bench.json'}` redraws "
          f"BENCHMARKS.md with it")


if __name__ == "__main__":
    main()
