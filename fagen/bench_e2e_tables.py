"""The end-to-end benchmark's cases, rows, JSON and tables (fagen.bench_e2e runs them): apart
from the runner so that `fagen bench` redraws BENCHMARKS.md from the JSON where there is no
torch or transformers."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

IMPLEMENTATIONS = ("sdpa", "sdpa_cudnn", "sdpa_flash", "fagen")
ROUNDS = 5  # timed rounds a case, implementations interleaved; the best of them is the row
JSON = "bench_e2e.json"  # beside fagen bench's JSON, whose BENCHMARKS.md takes its tables
STATIC_CACHE_LEN = 16384  # a static cache's slots (SDPA's decode step reads them all, fagen each row's tokens)


@dataclass(frozen=True)
class E2ECase:
    model: str  # llama or gemma2
    batch: int
    prompt: int  # tokens (padded: the longest prompt)
    new_tokens: int
    padded: bool = False  # left-padded prompts of lengths in [shortest, prompt]
    static: bool = False  # a static cache of STATIC_CACHE_LEN slots: generate compiles the decode steps (CUDA graphs)
    shortest_prompt: int = 0  # padded: the shortest length drawn (0: a quarter of the longest)

    @property
    def shortest(self) -> int:
        return (self.shortest_prompt or self.prompt // 4) if self.padded else self.prompt

    @property
    def key(self) -> str:
        lengths = f"{self.shortest}-{self.prompt} left-padded" if self.padded else str(self.prompt)
        cache = f", static cache {STATIC_CACHE_LEN // 1024}k" if self.static else ""
        return f"{self.model} B{self.batch} prompt {lengths} +{self.new_tokens}{cache}"

    @property
    def section(self) -> str:
        return "static" if self.static else "padded" if self.padded else "equal"


@dataclass
class E2ERow:
    case: str
    impl: str
    prefill_ms: float | None
    decode_tok_s: float | None
    note: str = ""
    attention_host_us: float | None = None  # a decode step's host time in the attention and mask functions


def cases(quick: bool = False) -> list[E2ECase]:
    """Both models on one grid: equal lengths (batch 1, 8, 32; prompts 1k and 4k), the issue's mixed
    lengths left-padded (256 to 4k tokens a prompt; batch 8 and 32), the static cache (batch 8 and 32)."""
    def grid(model: str) -> list[E2ECase]:
        equal = [E2ECase(model, b, n, t) for b, n, t in ((1, 1024, 64), (8, 1024, 64), (32, 1024, 32), (1, 4096, 32),
                                                          (8, 4096, 32), (32, 4096, 32))]
        padded = [E2ECase(model, b, 4096, t, padded=True, shortest_prompt=256) for b, t in ((8, 64), (32, 32))]
        static = [E2ECase(model, b, 4096, 32, padded=True, static=True) for b in (8, 32)]
        return equal + padded + static

    llama, gemma = grid("llama"), grid("gemma2")
    if quick:
        return [llama[0], llama[1], llama[6], gemma[0]]
    return llama + gemma


def prompts(case: E2ECase, seed: int = 0, device: str = "cuda"):
    """input_ids [B, prompt] and attention_mask: equal lengths, or left-padded lengths in
    [case.shortest, prompt] (the first row the longest)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(1, 32000, (case.batch, case.prompt), generator=gen, device=device)
    mask = torch.ones_like(ids)
    if case.padded:
        lengths = torch.randint(case.shortest, case.prompt + 1, (case.batch,), generator=gen, device=device)
        lengths[0] = case.prompt
        mask = (torch.arange(case.prompt, device=device)[None] >= case.prompt - lengths[:, None]).long()
        ids = ids * mask
    return ids, mask


def decode_rate(case: E2ECase, steps_s: list[float]) -> float:
    """Tokens a second of the decode steps: the batch over the median step (the periods between the
    tokens after the first, which the prefill produces). A median, not generate's whole time less
    a prefill timed apart: a shared host's pause lands on a step or two of a round, and the prefill
    inside generate is not the one timed apart (it computes the last position's logits alone)."""
    return case.batch / statistics.median(steps_s)


def whole_decode_rate(case: E2ECase, generate_s: float, prefill_s: float) -> float:
    """The decode steps' tokens a second by generate's time less the prefill timed apart (the
    rows' rate before 2026-12-01, kept in their notes)."""
    return case.batch * (case.new_tokens - 1) / (generate_s - prefill_s)


def shown(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def markdown(rows: list[E2ERow], meta: dict | None = None) -> list[str]:
    """BENCHMARKS.md's end-to-end section: two tables (equal-length and padded prompts), prefill
    ms and decode tokens/s per implementation and fagen's ratio to SDPA's default (above 1:
    fagen is faster), then how each fagen run agreed with SDPA's and its rounds' spread."""
    by_case: dict[str, dict[str, E2ERow]] = {}
    for row in rows:
        by_case.setdefault(row.case, {})[row.impl] = row
    impls = [i for i in IMPLEMENTATIONS if any(i in r for r in by_case.values())]
    head = " / ".join(impls)
    out = ["## End to end: transformers generation", "",
           "Written by `python3 -m fagen.bench_e2e` (its JSON kept beside this report's). Random-weight bf16 models "
           "(Llama: 16 layers, hidden 2048, 32/8 heads of 64; Gemma-2: 8 layers, 8/4 heads of 256, a 4096-key "
           "window on alternate layers, softcaps), greedy generate on the dynamic cache or a static one; prefill ms of a "
           "forward over the prompt, decode tokens/s of the steps after the first token (the batch over a round's median step); the best of "
           f"{ROUNDS} rounds with the implementations taking turns (a shared host's interference only adds time); attention host µs a decode step: the host time "
           "a decode step spends in the attention and mask functions transformers calls (all layers; what the "
           "implementation itself costs where generation is host-bound; n/a for a compiled static cache and for "
           "runs before it was measured). fagen's result is compared with SDPA's before "
           "it is timed (random weights in bfloat16 make greedy tokens diverge early: SDPA's own FA2 backend "
           "differs from its default as much).", ""]
    if meta:
        out += [", ".join(f"{k}: {v}" for k, v in sorted(meta.items())), ""]
    titles = {"equal": "Equal-length prompts (dynamic cache)", "padded": "Left-padded prompts of mixed lengths (dynamic cache)",
              "static": f"Static cache ({STATIC_CACHE_LEN // 1024}k slots; generate compiles the decode steps: CUDA graphs)"}
    for section, title in titles.items():
        chosen = {k: v for k, v in by_case.items() if _section(k) == section}
        if not chosen:
            continue
        out += [f"### {title}", "",
                f"| case | prefill ms: {head} | decode tok/s: {head} | fagen / SDPA prefill, decode | attention host "
                f"µs a decode step: {head} |",
                "| --- | --- | --- | --- | --- |"]
        for case, got in chosen.items():
            prefill = " / ".join(shown(got[i].prefill_ms) if i in got else "n/a" for i in impls)
            decode = " / ".join(shown(got[i].decode_tok_s) if i in got else "n/a" for i in impls)
            f, s = got.get("fagen"), got.get("sdpa")
            ratio = "n/a" if not f or not s or None in (f.prefill_ms, s.prefill_ms, f.decode_tok_s, s.decode_tok_s) \
                else f"{s.prefill_ms / f.prefill_ms:.2f}, {f.decode_tok_s / s.decode_tok_s:.2f}"
            host = " / ".join(shown(got[i].attention_host_us) if i in got else "n/a" for i in impls)
            out.append(f"| {case} | {prefill} | {decode} | {ratio} | {host} |")
        notes = [f"- {case}: {got['fagen'].note}" for case, got in chosen.items() if "fagen" in got and got["fagen"].note]
        out += [""] + notes + [""]
    return out


def _section(key: str) -> str:
    """A case's table, from its key (E2ECase.section, for rows that keep the key alone)."""
    return "static" if "static cache" in key else "padded" if "left-padded" in key else "equal"


def write_json(rows: list[E2ERow], meta: dict, path: Path) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))


def read_json(path: Path) -> tuple[list[E2ERow], dict]:
    """The rows and meta of a bench_e2e.json; ValueError (one line) for a file that is not one."""
    try:
        data = json.loads(Path(path).read_text())
        return [E2ERow(**r) for r in data["rows"]], dict(data["meta"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a bench_e2e.json ({error}); run python3 -m fagen.bench_e2e") from None
