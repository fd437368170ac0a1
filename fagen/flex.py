"""FlexAttention's API on fagen's kernels: `flex_attention` and `create_block_mask` with
torch.nn.attention.flex_attention's signatures and meaning, so that swapping the import runs
fagen for the common cases.

- `create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)`: the mask_mod run as PyTorch code on the
  device, a chunk of query blocks at a time, into fagen's runtime block mask (fagen.masks: blocks
  no key of which is seen are never loaded, fully seen ones run without a per-element test, the
  rest read a bit pattern). It may read captured tensors. Reusable across calls and layers.
- `flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
  enable_gqa=False, return_lse=False)`: the score_mod traced into `score_mod.expression` and its
  derivative, the kernels of that spec run under autograd (torch_op's flex kernels: eagerly
  through _FlexAttention, under torch.compile as the ops fagen::flex_forward and flex_backward).
  A block mask that is exactly a mask kind's pattern (masks.BlockMask.as_kind) runs that kind's
  kernels.

A score_mod may read captured float tensors (a bias table indexed by head and distance): kernel
inputs, each index proven within its dimension at the call's lengths. One that requires grad
gets its gradient, bitwise repeatable (fagen.captured_grads: the score's gradient times each
read's derivative from the traced expression, added exactly in int64 fixed point by the dK/dV
kernel where the derivative allows, else recomputed in PyTorch), eagerly and under
torch.compile. Under torch.compile the
score_mod is traced and the block mask registered once while the model is traced
(_compiled_call), so a model compiles with fullgraph=True: the score_mod defined outside the
compiled function, its captured tensors in its closure (the ops' inputs). A score_mod's ints are int32 in the kernel (int64 in PyTorch): one whose int arithmetic
may pass 2^31 at the call's lengths is refused, naming the term. Not yet: a gradient through
the LSE.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from fagen import masks, torch_op
from fagen.mod_tracing import TracedScoreMod, TraceError, check_captured, check_int32, trace_mask_mod, trace_score_mod

__all__ = ["create_block_mask", "flex_attention", "trace_mask_mod", "trace_score_mod", "TraceError",
           "TracedScoreMod"]


def create_block_mask(mask_mod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, device=None,
                      BLOCK_SIZE: int | tuple[int, int] = 128) -> masks.BlockMask:
    """FlexAttention's create_block_mask: mask_mod(b, h, q_idx, kv_idx) -> bool (True: the key is
    seen) over B x H x Q_LEN x KV_LEN, B or H None broadcasting, as in FlexAttention. The
    function runs as PyTorch code on `device`, a chunk of query blocks at a time (never the
    whole Q_LEN x KV_LEN at once), so it may read captured tensors (documents' ids, a per-head
    random mask); each block is classified there (never seen: not listed; all seen: FULL; the
    causal diagonal's pattern: CAUSAL; else PARTIAL, its bits packed there), and what comes back
    to the host is a few bytes a block. `device` None: the current CUDA device (else the CPU).
    mask_mod must return bools, as FlexAttention asks."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, heads = 1 if B is None else B, 1 if H is None else H
    q_block, kv_block = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    masks.check_builder(("Q_LEN", "KV_LEN"), Q_LEN, KV_LEN, q_block, kv_block, batch, heads)
    n_qb, n_kb = -(-Q_LEN // q_block), -(-KV_LEN // kv_block)
    chunk = max(1, CHUNK_ELEMENTS // (q_block * n_kb * kv_block))  # query blocks a call of mask_mod
    k_idx = torch.arange(KV_LEN, device=device)
    types = np.zeros((batch, heads, n_qb, n_kb), np.int32)
    patterns = []  # per (b, h, query block chunk): [partials, q_block, words] uint32, in the walk's order
    for b in range(batch):
        for h in range(heads):
            for first in range(0, n_qb, chunk):
                blocks = range(first, min(first + chunk, n_qb))
                q_idx = torch.arange(first * q_block, min(blocks.stop * q_block, Q_LEN), device=device)
                keep = torch.as_tensor(mask_mod(torch.tensor(b, device=device), torch.tensor(h, device=device),
                                                q_idx[:, None], k_idx[None, :]), device=device)
                if keep.dtype != torch.bool:
                    raise TypeError(f"mask_mod {getattr(mask_mod, '__qualname__', mask_mod)} returns {keep.dtype}; "
                                    f"it must return bools (True: the key is seen), as FlexAttention's: compare it, "
                                    f"e.g. x != 0")
                kinds, bits = _classified(keep.expand(len(q_idx), KV_LEN), q_idx, k_idx, len(blocks), q_block, n_kb,
                                          kv_block)
                types[b, h, blocks.start:blocks.stop] = kinds
                patterns.append(bits)
    return masks.from_types(Q_LEN, KV_LEN, q_block, kv_block, types, np.concatenate(patterns))


CHUNK_ELEMENTS = 1 << 26  # (query, key) pairs create_block_mask evaluates a call: 64 MB of bools


def _classified(keep, q_idx, k_idx, n_blocks: int, q_block: int, n_kb: int, kv_block: int):
    """The blocks of `keep` [rows, keys] (n_blocks query blocks by n_kb key blocks; the last of
    each may be short): their types [n_blocks, n_kb] and the PARTIAL ones' bits [partials,
    q_block, words] (row-major over the blocks, as masks.from_types reads them), on the host."""
    rows, keys = keep.shape
    grid = (n_blocks * q_block, n_kb * kv_block)
    pad = lambda x, value: torch.nn.functional.pad(x, (0, grid[1] - keys, 0, grid[0] - rows), value=value)  # noqa: E731
    valid = pad(torch.ones_like(keep, dtype=torch.bool), False)
    causal = pad(k_idx[None, :] <= q_idx[:, None], False)
    keep = pad(keep, False)
    by_block = lambda x: x.view(n_blocks, q_block, n_kb, kv_block).transpose(1, 2)  # noqa: E731
    seen = by_block(keep).any(-1).any(-1)
    full = by_block(keep | ~valid).all(-1).all(-1)
    diagonal = by_block((keep == causal) | ~valid).all(-1).all(-1)
    kinds = torch.where(~seen, masks.MASKED, torch.where(full, masks.FULL, torch.where(diagonal, masks.CAUSAL,
                                                                                        masks.PARTIAL)))
    words = -(-kv_block // masks.BITS)
    partial = by_block(keep)[kinds == masks.PARTIAL]  # [partials, q_block, kv_block], row-major order
    partial = torch.nn.functional.pad(partial, (0, words * masks.BITS - kv_block)).view(-1, q_block, words, masks.BITS)
    weights = torch.bitwise_left_shift(torch.ones((), dtype=torch.int64, device=keep.device),
                                       torch.arange(masks.BITS, device=keep.device))
    bits = (partial.long() * weights).sum(-1)
    return kinds.int().cpu().numpy(), bits.cpu().numpy().astype(np.uint32)


def flex_attention(query, key, value, score_mod=None, block_mask: masks.BlockMask | None = None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: dict | None = None):
    """FlexAttention's flex_attention on fagen's kernels: query [B, Hq, Nq, d], key and value
    [B, Hkv, Nk, d] PyTorch tensors; score_mod(score, b, h, q_idx, kv_idx) changes the scaled
    score q.k * scale; block_mask from fagen.flex.create_block_mask (or fagen.masks; one of
    FlexAttention's own is rebuilt from its mask_mod once, on its device, and kept; under
    torch.compile it is refused: build it with fagen.flex.create_block_mask). Gradients
    flow to query, key and value; the LSE (return_lse) carries none. kernel_options (FlexAttention's
    Triton tiling) is accepted and not read: fagen's kernels have their own. Returns out (and the
    LSE [B, Hq, Nq])."""
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True for "
                         f"grouped-query attention (as FlexAttention asks)")
    if torch.compiler.is_compiling():  # the ops, whose call the trace registers once
        # the closure's tensors are the ops' inputs; reading its cells also has torch.compile guard
        # the other values a trace baked in (a closure from one factory shares the same code)
        cells = _closure(score_mod)
        tensors = [c for c in cells if isinstance(c, torch.Tensor)]
        if block_mask is not None and not isinstance(block_mask, masks.BlockMask):
            raise TypeError(f"block_mask: a {type(block_mask).__name__}; under torch.compile fagen.flex takes the "
                            f"block masks of fagen.flex.create_block_mask (built outside the compiled function)")
        # the mask passed by its serial (a string: an int that differs between traces would turn
        # symbolic): torch.compile hands a constant function constants, not objects
        call = _compiled_call(score_mod, None if block_mask is None else block_mask.serial)
        # what the trace baked in: the closure's numbers (in its expression) and its tensors' shapes
        # (its indices' strides and bounds). Comparing them here has torch.compile guard each, so
        # another closure of the same code is traced anew (a graph would otherwise serve it the
        # first one's call); a closure rebound since its trace is refused
        if _baked(cells) != _COMPILED_BAKED[call]:
            raise TraceError(f"score_mod {getattr(score_mod, '__qualname__', score_mod)}: its closure changed since "
                             f"torch.compile traced it; build a new score_mod rather than rebinding its variables")
        out, lse = torch.ops.fagen.flex_forward(query, key, value, tensors, call, scale)
        return (out, lse) if return_lse else out
    block_mask = _as_fagen(block_mask)
    traced = None if score_mod is None else trace_score_mod(score_mod)
    tables = () if traced is None else traced.captured
    out, lse = _FlexAttention.apply(query, key, value, (traced, block_mask, scale), *tables)
    return (out, lse) if return_lse else out


def _closure(score_mod) -> list:
    """The values a score_mod's closure holds (none for None or a function without one)."""
    return [cell.cell_contents for cell in (getattr(score_mod, "__closure__", None) or ())]


def _baked(cells: list) -> tuple:
    """A closure's numbers, and its tensors' shapes: what a trace of its function baked in."""
    return (tuple(c for c in cells if isinstance(c, (bool, int, float, str, np.generic)) or c is None),
            tuple(tuple(c.shape) for c in cells if isinstance(c, torch.Tensor)))


class _FlexAttention(torch.autograd.Function):
    """flex_attention's eager calls: torch_op's flex kernels (the ones its ops run under
    torch.compile), and the gradient of each captured tensor that requires one (captured_grads)."""

    @staticmethod
    def forward(ctx, q, k, v, call, *tables):
        traced, block_mask, scale = call
        out, lse = torch_op.flex_kernels_forward(q, k, v, traced, block_mask, scale, tables)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, *tables)
        ctx.call = call
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *tables = ctx.saved_tensors
        traced, block_mask, scale = ctx.call
        dq, dk, dv, table_grads = torch_op.flex_kernels_backward(dout, q, k, v, out, lse, traced, block_mask, scale,
                                                                 tables, ctx.needs_input_grad[4:],
                                                                 any(ctx.needs_input_grad[:3]))
        return dq, dk, dv, None, *table_grads


_COMPILED_CALLS: dict[tuple[int, str | None], int] = {}  # (id(score_mod), mask serial) -> index in torch_op.FLEX_CALLS
_COMPILED_BAKED: dict[int, tuple] = {}  # that index -> _baked of the score_mod's closure when traced


@torch.compiler.assume_constant_result
def _compiled_call(score_mod, mask_serial: str | None) -> int:
    """The index of this (score_mod, block mask) in torch_op.FLEX_CALLS, traced and registered on
    first sight: torch.compile runs this while it traces a model (its result a constant of the
    graph), so that what an op cannot carry reaches the ops as an int. The captured tensors are
    read where they live at each call (a CUDA graph replays their current values): float32,
    contiguous, on a GPU, or refused here. Kept for the process, as the graph that holds it."""
    key = (id(score_mod), mask_serial)
    if key not in _COMPILED_CALLS:
        block_mask = None if mask_serial is None else masks.live_block_mask(mask_serial)
        traced = None if score_mod is None else trace_score_mod(score_mod)
        held = [c for c in _closure(score_mod) if isinstance(c, torch.Tensor)]
        slots = []
        for i, t in enumerate(() if traced is None else traced.captured):
            _check_read_in_place(t, i, score_mod)
            name = getattr(score_mod, "__qualname__", score_mod)
            slot = next((j for j, h in enumerate(held) if h is t), None)
            if slot is None:
                raise TraceError(f"score_mod {name}: captured tensor {i} is not in its closure (a global or an "
                                 f"attribute): under torch.compile the ops take the closure's tensors; bind it in "
                                 f"a closure (def make(table): return lambda s, b, h, q, k: ...)")
            slots.append(slot)
        torch_op.FLEX_CALLS.append((traced, block_mask, tuple(slots)))
        _COMPILED_BAKED[len(torch_op.FLEX_CALLS) - 1] = _baked(_closure(score_mod))
        _COMPILED_CALLS[key] = len(torch_op.FLEX_CALLS) - 1
        _KEPT.append((score_mod, block_mask))  # its id stays its own, the mask's serial live, while the index is used
    return _COMPILED_CALLS[key]


def _as_fagen(block_mask) -> masks.BlockMask | None:
    """fagen's block mask: a FlexAttention BlockMask rebuilt (once) as one."""
    if block_mask is None or isinstance(block_mask, masks.BlockMask):
        return block_mask
    return _from_flex_block_mask(block_mask)


def _check_read_in_place(t, i: int, score_mod) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cuda:
        raise TraceError(f"score_mod {getattr(score_mod, '__qualname__', score_mod)}: captured tensor {i} is {t.dtype}, "
                         f"{'' if t.is_contiguous() else 'non-'}contiguous, on {t.device}; under torch.compile the "
                         f"kernels read it in place: keep it float32, contiguous, on the GPU")


_KEPT: list = []
_FROM_FLEX: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # FlexAttention's BlockMask -> fagen's


def _from_flex_block_mask(block_mask) -> masks.BlockMask:
    """FlexAttention's BlockMask as fagen's: its mask_mod over its lengths, batch, heads and block
    sizes, built once (create_block_mask) and kept while it lives."""
    mask_mod, lengths = getattr(block_mask, "mask_mod", None), getattr(block_mask, "seq_lengths", None)
    if mask_mod is None or lengths is None or not hasattr(block_mask, "kv_num_blocks"):
        raise TypeError(f"block_mask: a {type(block_mask).__module__}.{type(block_mask).__name__}, neither fagen's "
                        f"block mask nor FlexAttention's; build it with fagen.flex.create_block_mask")
    if block_mask not in _FROM_FLEX:
        batch, heads = block_mask.kv_num_blocks.shape[:2]
        _FROM_FLEX[block_mask] = create_block_mask(mask_mod, batch, heads, *lengths,
                                                   device=block_mask.kv_num_blocks.device,
                                                   BLOCK_SIZE=tuple(block_mask.BLOCK_SIZE))
    return _FROM_FLEX[block_mask]
