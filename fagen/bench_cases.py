"""The benchmark's workload, shared by the forward sweep (fagen.bench) and the backward
(fagen.bench_backward): a case is a dtype, head_dim, sequence length and mask at the
FlashAttention papers' sizes (B * N = 16k tokens, H * d = 2048); its masks' parameters and
predicates, the (q, k) pairs it keeps and its forward FLOPs; and how the peers are set up for it
(SDPA's backends, FlexAttention's block mask, FlashAttention-4's arguments)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fagen.check import attention_flops

TOKENS, HIDDEN = 16384, 2048  # the FlashAttention papers' sweep: B * N = 16k tokens, H * d = 2048
WINDOW, N_DOCS, PREFIX = 1024, 8, 1024
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}
# FlashAttention-4 (the flash-attn-4 package's CuTe-DSL kernels; on Hopper, its sm90 forward and
# backward), in its own layout [B, N, H, d], on the masks it takes natively
FA4 = "fa4"
FA4_MASKS = ("none", "sliding_window")
# Score modifiers on the causal mask, beside FlashAttention-4, which takes both (softcap= and
# learnable_sink=): Gemma-2's logit cap (its attention's 50; 30 here, Grok-1's) and gpt-oss's
# sinks, a logit a head in each row's softmax denominator
SOFTCAP = 30.0
MODIFIERS = ("softcap", "sinks")


class SweepSize:
    """A case's batch and heads at the sweep's sizes, from its `n` and `head_dim`."""

    n: int
    head_dim: int

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.n)

    @property
    def heads(self) -> int:
        return HIDDEN // self.head_dim


@dataclass(frozen=True)
class Case(SweepSize):
    dtype: str
    head_dim: int
    n: int
    causal: bool
    mask: str = "none"  # none | sliding_window | documents | prefix_lm
    docs: int = N_DOCS  # documents: how many packed documents (of doc_lengths)
    uniform: bool = False  # documents: of equal lengths, else cut at random (doc_lengths)
    modifier: str = "none"  # none | softcap (SOFTCAP) | sinks (sink_logits)

    @property
    def mask_kind(self) -> str:
        """The mask, "causal" or "dense" where there is none."""
        return self.mask if self.mask != "none" else ("causal" if self.causal else "dense")

    @property
    def key(self) -> str:
        kind = self.mask_kind
        if self.mask == "documents":
            kind += (str(self.docs) if self.docs != N_DOCS else "") + ("-uniform" if self.uniform else "") + \
                ("" if self.causal else "-noncausal")
        return f"{self.dtype}-d{self.head_dim}-n{self.n}-{kind}" + ("" if self.modifier == "none" else f"-{self.modifier}")

    @property
    def mask_label(self) -> str:
        """The mask as the tables name it: documents say how many, how cut and whether causal; a
        modifier says itself after its mask (so its rows join the masks' table, not the dense one)."""
        if self.modifier != "none":
            return f"{self.mask_kind} + " + (f"softcap {SOFTCAP:g}" if self.modifier == "softcap" else "sinks")
        if self.mask != "documents":
            return self.mask
        return f"documents ({self.docs} {'uniform' if self.uniform else 'random'}, {'causal' if self.causal else 'non-causal'})"

    def doc_lengths(self) -> list[int]:
        return doc_lengths(self.n, self.docs, uniform=self.uniform)


def doc_lengths(n: int, docs: int | None = None, seed: int = 0, uniform: bool = False) -> list[int]:
    """`docs` lengths summing to n: equal (the remainder spread over the first), or cut at random."""
    docs = N_DOCS if docs is None else docs
    if uniform:
        return [n // docs + (i < n % docs) for i in range(docs)]
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, n), docs - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [n]])).tolist()


def sink_logits(heads: int) -> np.ndarray:
    """A sinks case's logit a head (float32 [heads]): gpt-oss-like, about the scores' own size."""
    return np.random.default_rng(0).normal(0.0, 1.0, heads).astype(np.float32)


def sink_tensor(case: Case, device="cuda"):
    """The case's sink logits (sink_logits) as a float32 tensor on `device`, or None for a case
    without sinks: what FlashAttention-4 and fagen's backward both take."""
    if case.modifier != "sinks":
        return None
    import torch

    return torch.from_numpy(sink_logits(case.heads)).to(device)


def mask_predicate(case: Case):
    """The case's mask as fn(q_idx, kv_idx) -> bool over absolute positions (Nq == Nk)."""
    if case.mask == "sliding_window":
        return lambda q, k: (k <= q) & (q - k <= WINDOW)
    if case.mask == "documents":
        docs = np.repeat(np.arange(case.docs), case.doc_lengths())
        if not case.causal:
            return lambda q, k: docs[q] == docs[k]
        return lambda q, k: (docs[q] == docs[k]) & (k <= q)
    if case.mask == "prefix_lm":
        return lambda q, k: (k <= q) | (k < PREFIX)
    if case.causal:
        return lambda q, k: k <= q
    return lambda q, k: np.ones(np.broadcast_shapes(np.shape(q), np.shape(k)), bool)


def kept_pairs(case: Case, rows_per_step: int = 1024) -> int:
    """(q, k) pairs the mask keeps, counted a slab of rows at a time."""
    fn, n, total = mask_predicate(case), case.n, 0
    k = np.arange(n)[None, :]
    for r0 in range(0, n, rows_per_step):
        total += int(fn(np.arange(r0, min(n, r0 + rows_per_step))[:, None], k).sum())
    return total


def case_flops(case: Case) -> float:
    if case.mask == "none":
        return attention_flops(case.batch, case.heads, case.n, case.n, case.head_dim, case.causal)
    return 4.0 * case.batch * case.heads * case.head_dim * kept_pairs(case)


def flex_block_mask(case: Case):
    """FlexAttention's BlockMask of the case's mask (mask_predicate's, on the GPU)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    if case.mask == "documents":
        docs = torch.from_numpy(np.repeat(np.arange(case.docs), case.doc_lengths())).cuda()
        if case.causal:
            def mask_mod(b, h, qi, ki):
                return (docs[qi] == docs[ki]) & (ki <= qi)
        else:
            def mask_mod(b, h, qi, ki):
                return docs[qi] == docs[ki]
    elif case.mask == "sliding_window":
        def mask_mod(b, h, qi, ki):
            return (ki <= qi) & (qi - ki <= WINDOW)
    elif case.mask == "prefix_lm":
        def mask_mod(b, h, qi, ki):
            return (ki <= qi) | (ki < PREFIX)
    else:
        def mask_mod(b, h, qi, ki):
            return ki <= qi
    return create_block_mask(mask_mod, None, None, case.n, case.n, device="cuda")


def flex_score_mod(case: Case):
    """FlexAttention's score_mod for the case's modifier (None without one); sinks have none."""
    import torch

    if case.modifier == "softcap":
        def softcap(score, b, h, qi, ki):
            return SOFTCAP * torch.tanh(score / SOFTCAP)
        return softcap
    if case.modifier == "sinks":
        raise NotImplementedError("FlexAttention has no sinks (a logit in the softmax's denominator)")
    return None


def fa4_attention(case: Case):
    """fn(q, k, v) -> out of FlashAttention-4 for this case, q, k, v in its layout [B, N, H, d]
    (to_fa4_layout); NotImplementedError for a mask it takes only as a traced mask_mod (documents,
    prefix-LM), not a kernel of its own. Its sliding window: (WINDOW, 0) keys about the diagonal,
    the bench's mask_predicate."""
    if case.mask not in FA4_MASKS:
        raise NotImplementedError(f"FlashAttention-4 has no {case.mask} kernel of its own (a mask_mod only)")
    from flash_attn.cute import flash_attn_func

    window = (WINDOW, 0) if case.mask == "sliding_window" else (None, None)
    causal = case.causal or case.mask == "sliding_window"
    modifier = {"none": {}, "softcap": {"softcap": SOFTCAP}, "sinks": {"learnable_sink": sink_tensor(case)}}[case.modifier]
    return lambda q, k, v: flash_attn_func(q, k, v, causal=causal, window_size=window, **modifier)[0]


def to_fa4_layout(x):
    """[B, H, N, d] as FlashAttention-4's contiguous [B, N, H, d] (a copy)."""
    return x.transpose(1, 2).contiguous()
