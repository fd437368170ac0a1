"""FlexAttention's API on fagen's kernels: `flex_attention` and `create_block_mask` with
torch.nn.attention.flex_attention's signatures and meaning, so that swapping the import runs
fagen for the common cases.

- `create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)`: the mask_mod traced into fagen's expression
  language (fagen.mod_tracing), evaluated a query block at a time on the host into fagen's runtime
  block mask (fagen.masks: blocks no key of which is seen are never loaded, fully seen ones run
  without a per-element test, the rest read a bit pattern). Reusable across calls and layers.
- `flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
  enable_gqa=False, return_lse=False)`: the score_mod traced into `score_mod.expression` and its
  derivative, the kernels of that spec run eagerly under autograd (torch_op's
  _EagerKernelAttention, as for fagen.attention's block masks).

Not yet: captured tensors (a score_mod indexing a tensor is refused, naming its line), masks
built without the host's pass over every block, and torch.compile of a model calling it (the
eager kernels break the graph).
"""

from __future__ import annotations

from fagen import expression, masks, torch_op
from fagen.mod_tracing import TracedScoreMod, TraceError, trace_mask_mod, trace_score_mod

__all__ = ["create_block_mask", "flex_attention", "trace_mask_mod", "trace_score_mod", "TraceError",
           "TracedScoreMod"]


def create_block_mask(mask_mod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, device=None,
                      BLOCK_SIZE: int | tuple[int, int] = 128) -> masks.BlockMask:
    """FlexAttention's create_block_mask: mask_mod(b, h, q_idx, kv_idx) -> bool (True: the key is
    seen) over B x H x Q_LEN x KV_LEN; B or H None broadcasts, as in FlexAttention. `device` is
    accepted for the signature's sake: the block mask goes to q's device at the call."""
    tree = expression.mask(trace_mask_mod(mask_mod))
    q_block, kv_block = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE

    def seen(b, h, q_idx, kv_idx):  # the traced tree, as the kernel would compute it (PyTorch's semantics)
        return expression.evaluate(tree, dict(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx))

    return masks.from_predicate(seen, 1 if B is None else B, 1 if H is None else H, Q_LEN, KV_LEN,
                                q_block=q_block, kv_block=kv_block)


def flex_attention(query, key, value, score_mod=None, block_mask: masks.BlockMask | None = None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False):
    """FlexAttention's flex_attention on fagen's kernels: query [B, Hq, Nq, d], key and value
    [B, Hkv, Nk, d] PyTorch tensors; score_mod(score, b, h, q_idx, kv_idx) changes the scaled
    score q.k * scale; block_mask from create_block_mask (or fagen.masks). Gradients flow to
    query, key and value. Returns out (and the LSE [B, Hq, Nq] with return_lse)."""
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True for "
                         f"grouped-query attention (as FlexAttention asks)")
    traced = None if score_mod is None else trace_score_mod(score_mod)
    out, lse = torch_op._EagerKernelAttention.apply(
        query, key, value, None, None, block_mask, False, None, None, scale, False,
        torch_op._side_inputs(None, None, None, None),
        None if traced is None else (traced.expression, traced.expression_grad))
    return (out, lse) if return_lse else out
