"""fagen as a transformers attention implementation: `fagen.transformers.register()`, then
`from_pretrained(..., attn_implementation="fagen")`.

What each attention module says reaches the kernel: causality (`is_causal`), the scale
(`scaling`), Gemma's and gpt-oss's sliding window and softcap, gpt-oss's sinks (`s_aux`), GQA as
the module's K/V heads are (no repeat). Under autocast, float32 q, k and v (a rotary embedding
computed in float32) go in as the autocast dtype, as SDPA takes them.

The mask function registered beside it tells padding once a forward (one host read, as
transformers' own flash and SDPA paths make: on the GPU, one launch of the padding-runs kernel,
fagen.padding_runs) and hands the attention what fagen's kernels read:
each row's key range (int32 [2, 1, B]: its first token's slot and its last + 1) where the row's
tokens are one run ending at its last query, a left-padded batch and a static cache's filled
slots, whose pads and empty slots the kernels never read; otherwise (right padding under the
causal mask, holes, graphs traced by torch.compile, which cannot branch on the mask) a float32
score bias [B, 1, Nk], 0 on tokens and PAD on padding, added to every head's scores (a row that
sees only padding comes out finite). Training turns ranges into the same keys' bias (the
backward reads a bias). What fagen cannot run yet is refused by name rather than computed
wrongly: mask patterns beyond causal and sliding windows, custom 4-D masks, attention dropout.
Documents packed into one row (position_ids restarting, no mask) take the document mask.

In inference each attention module keeps the C path of the shape class its last call took (_KEPT),
and a step's call goes there directly while the options that chose it hold: a decode step's host
time is the model's Python, and this takes fagen.attention's argument handling out of each layer.
"""

from __future__ import annotations

import threading
import weakref
from functools import cache

import torch

from torch.utils.weak import WeakIdKeyDictionary

from fagen import decode, padding_runs, runtime, torch_op
from fagen.device import torch_stream_handle

NAME = "fagen"

# A padded key's score bias: far below any score (exp() of it is 0 beside a real key), finite so
# that a row seeing only padding averages its pads, and small enough that the kernels' softmax
# stays exact: it computes exp2(s * log2(e) - m) as one fused multiply-add against the rounded
# max m, whose rounding error grows with |s| (at -1e30, 2^77: exp2 of it is inf, and the row NaN).
PAD = -1e4

# gpt-oss's sinks (a parameter of the model's dtype) as the kernels take them, float32: one copy
# a parameter and version (its in-place updates), so that the runtime's once-per-object check of
# their values (a host sync) runs once, not once a call. Not where autograd records the cast.
# id(parameter) -> (a weak reference to it, its version, the copy): a plain dictionary, since a
# tensor-keyed weak one costs ~2.5 us a lookup (a layer's call).
_FLOAT32: dict[int, tuple] = {}


def _float32(t):
    if t.dtype == torch.float32 or torch.compiler.is_compiling() or torch.is_grad_enabled() and t.requires_grad:
        return t.float()
    kept = _FLOAT32.get(id(t))
    if kept is None or kept[0]() is not t or kept[1] != t._version:
        if len(_FLOAT32) >= 256:  # (copies of parameters gone: a model's sinks are a few)
            _FLOAT32.clear()
        kept = _FLOAT32[id(t)] = (weakref.ref(t), t._version, t.float())
    return kept[2]


def register(name: str = NAME) -> str:
    """Register fagen's attention and its mask function under `name` with transformers; returns
    the name to pass as `attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    return name


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, use_vmap=False, **kwargs):
    """transformers' mask function for fagen: None where no token is padding, else key ranges
    or a score bias (_padding); a static cache's slots past the tokens seen are padding too
    (static_cache_bias where they cannot be ranges). Under torch.compile, which cannot branch on
    the mask's values, the bias whenever there is a mask. Refuses by name mask patterns beyond
    causal and sliding windows (an or/and mask function, which transformers builds with vmap)."""
    from transformers.masking_utils import bidirectional_mask_function

    # torch.compile does not trace the mask function's closure: there the function is told by
    # identity alone (bidirectional, else causal); its eager calls, generate's prefill among them,
    # are checked whole
    function = kwargs.get("mask_function")
    pattern = mask_pattern(function) if not torch.compiler.is_compiling() else \
        "bidirectional" if function is bidirectional_mask_function else "causal"
    if use_vmap or pattern is None:
        raise ValueError("attn_implementation='fagen': a mask pattern beyond causal, sliding windows and packed "
                         "documents (the model's chunked, blockwise or composed mask function) is not supported yet; "
                         "use attn_implementation='sdpa'")
    if attention_mask is not None and attention_mask.dim() == 3:
        return attention_mask  # this function's own bias or ranges, made ahead (generate does for a compilable cache)
    # torch.compile's graphs cannot branch on the mask's values, nor can a CUDA graph being
    # captured read them on the host: there the bias, which masks any padding
    host_reads = not torch.compiler.is_compiling() and not _capturing()
    static = isinstance(q_offset, torch.Tensor) or kv_length > q_offset + q_length
    if pattern == "bidirectional":  # an encoder's or cross-attention's keys: all of them, but the padding
        if attention_mask is None:
            return None
        tokens = attention_mask[:, -kv_length:].bool()
        return _padding(tokens, None, static=False) if host_reads else padding_bias(tokens)
    if static:
        if host_reads:
            device = kwargs.get("device") or (attention_mask.device if attention_mask is not None else
                                              getattr(q_offset, "device", None))
            seen = torch.arange(kv_length, device=device)[None] < q_offset + q_length
            tokens = seen if attention_mask is None else seen & _tokens_of(attention_mask, kv_length)
            ranges = _padding(tokens.expand(batch_size, kv_length), (q_offset + q_length).clamp(max=kv_length)
                              if isinstance(q_offset, torch.Tensor) else min(q_offset + q_length, kv_length), static=True)
            if ranges is not None:
                return ranges
        return static_cache_bias(batch_size, q_length, kv_length, q_offset, attention_mask, kwargs.get("device"))
    if not host_reads:  # the bias (zeros without padding)
        return None if attention_mask is None else padding_bias(attention_mask[:, -kv_length:])
    if attention_mask is None:
        return None
    window = attention_mask if attention_mask.shape[-1] == kv_length else attention_mask[:, -kv_length:]
    if window.is_cuda and window.dtype in _kernel_mask_dtypes() and window.stride(-1) == 1:
        return _padding_on_gpu(window)
    return _padding(window.bool(), kv_length, static=False)


@cache
def _kernel_mask_dtypes() -> frozenset:
    """The torch dtypes of the masks the padding-runs kernel reads (padding_runs.MASK_TYPES)."""
    return frozenset(getattr(torch, name) for name in padding_runs.MASK_TYPES)


def _padding_on_gpu(window):
    """_padding's answer for a dynamic cache's mask window on its GPU (the queries the last slots'),
    by one launch and one read (fagen.padding_runs) where _padding's ops make two: None without
    padding, the key ranges of a left-padded batch, else the score bias."""
    flags, ranges = runtime.padding_runs(window)
    if flags & padding_runs.FULL:
        return None
    return ranges if flags & padding_runs.LEFT_PADDED else padding_bias(window)


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (its work cannot be read on the host);
    never before CUDA is initialised (a cheaper test than whether it is available, a call)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _padding(tokens, end, static: bool):
    """The padding of `tokens` (bool [B, Nk], True on a token) as the attention takes it, told by
    host reads (as transformers' own flash and SDPA paths read the mask once a forward): None
    without padding (but for a static cache, whose empty slots are padding too); key ranges
    (key_ranges) where each row's tokens are one run, ending at `end` under a causal mask (the
    queries are its last tokens; None: not causal); else the score bias, which masks any pattern.
    None from a static cache whose tokens are not such runs: its own bias then (static_cache_bias).
    Equal-length batches, the common case, are told by one reduction before the ranges' dozen
    small ops (a padded batch pays a second read for that)."""
    if not static and bool(tokens.all()):
        return None
    # runs to the last slot: left padding, told by fewer ops (a decode step's); an end on the device
    # (a static cache's) takes the general path, whose one read checks it
    if isinstance(end, int) and end == tokens.shape[-1]:
        ranges = left_padded_ranges(tokens)
        return ranges if ranges is not None or static else padding_bias(tokens)
    ranges, one_run, last = key_ranges(tokens)
    checks = [one_run.all()] + ([] if end is None else [(last == end).all()])
    if all(torch.stack(checks).tolist()):
        return ranges
    return None if static else padding_bias(tokens)


def key_ranges(tokens):
    """Each row's tokens (bool [B, Nk]) as fagen's key ranges: int32 [2, 1, B], row 0 the first
    token's slot (cache_leftpad), row 1 the last one's + 1 (cache_seqlens), 0 and 0 for a row
    without one; with whether each row's tokens are one run, and each row's end, on the device."""
    n = tokens.shape[-1]
    count = tokens.sum(-1)
    flags = tokens.to(torch.int8)
    some = count > 0
    first = torch.where(some, flags.argmax(-1), 0)  # argmax: the first of equal maxima
    last = torch.where(some, n - flags.flip(-1).argmax(-1), 0)
    return torch.stack([first, last]).to(torch.int32)[:, None], last - first == count, last


def left_padded_ranges(tokens):
    """key_ranges' answer where each row's tokens (bool [B, Nk]) are one run to the last slot (left
    padding: a generation's rows on the dynamic cache), else None: told by one host read and ten
    small ops, not twenty (each ~20 us of a decode step's host time on an H200 host). A row without
    a token is not such a run."""
    n = tokens.shape[-1]
    start = (n - tokens.sum(-1, dtype=torch.int32)).clamp_(max=n - 1)  # (a row without a token: never equal)
    if not torch.equal(tokens, torch.arange(n, device=tokens.device) >= start[:, None]):
        return None
    return torch.stack((start, torch.full_like(start, n)))[:, None]


# transformers' mask-function pieces fagen's masks express: the causal mask, the sliding window
# over it, the packed-documents overlay (fagen reads the documents from position_ids itself), and
# the bidirectional mask of an encoder or a cross-attention
_CAUSAL = "causal_mask_function"
_PIECES = (_CAUSAL, "sliding_window_overlay.<locals>.inner_mask", "packed_sequence_mask_function.<locals>.inner_mask")


def mask_pattern(mask_function) -> str | None:
    """'causal' for transformers' causal mask function, alone or and-ed with a sliding window or a
    packed-documents overlay; 'bidirectional' for its bidirectional one; None for anything else (a
    chunked or blockwise overlay, an or-ed mask, a model's own), which fagen cannot express yet.
    No mask function (an older caller): causal."""
    if mask_function is None:
        return "causal"
    name = getattr(mask_function, "__qualname__", "")
    if name == "bidirectional_mask_function":
        return "bidirectional"
    if name == _CAUSAL:
        return "causal"
    if name == "and_masks.<locals>.and_mask" and mask_function.__closure__:
        pieces = [getattr(f, "__qualname__", "") for cell in mask_function.__closure__
                  if isinstance(cell.cell_contents, tuple) for f in cell.cell_contents]
        if pieces and all(piece in _PIECES for piece in pieces) and any(piece == _CAUSAL for piece in pieces):
            return "causal"
    return None


def static_cache_bias(batch_size, q_length, kv_length, q_offset, attention_mask, device):
    """A static cache's keys: slots [0, max_cache_len), of which the first q_offset + q_length hold
    tokens. A decode step (one query) masks the rest on the device (PAD past the tokens seen, and
    the padding): no host read, so a CUDA graph can replay it. A prefill (several queries) reads
    the offset once and gets a bias of the tokens seen alone, whose length tells the attention to
    take that many keys (the causal diagonal then sits where a dynamic cache puts it). A
    sliding-window layer's cache is one too until its window of slots fills; then it holds the
    last tokens in order, as a dynamic cache's window would."""
    if device is None:
        device = attention_mask.device if attention_mask is not None else getattr(q_offset, "device", None)
    if q_length > 1:
        if torch.compiler.is_compiling():
            raise ValueError("attn_implementation='fagen': a prefill of several tokens into a static cache under "
                             "torch.compile (it reads the cache's length on the host); run the prefill eagerly, or "
                             "use the dynamic cache")
        seen = int(q_offset) + q_length
        tokens = torch.ones(batch_size, seen, dtype=torch.bool, device=device) if attention_mask is None else \
            _tokens_of(attention_mask, seen)
        return padding_bias(tokens)
    position = torch.arange(kv_length, device=device)
    tokens = position[None] < q_offset + q_length
    if attention_mask is not None:
        tokens = tokens & _tokens_of(attention_mask, kv_length)
    return padding_bias(tokens.expand(batch_size, kv_length))


def _tokens_of(attention_mask, length: int):
    """The 2-D attention_mask over the first `length` slots, as bool: cut, or padded with pads
    (slots it does not reach hold no token)."""
    tokens = attention_mask[:, :length].bool()
    if tokens.shape[1] < length:
        tokens = torch.nn.functional.pad(tokens, (0, length - tokens.shape[1]), value=False)
    return tokens


def padding_bias(attention_mask):
    """transformers' 2-D attention_mask [B, Nk] (1 or True: a token) as fagen's score bias [B, 1, Nk],
    float32: 0 on tokens, PAD on padding."""
    zero = torch.zeros((), dtype=torch.float32, device=attention_mask.device)
    return torch.where(attention_mask.bool(), zero, PAD)[:, None, :]


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
              s_aux=None, **kwargs):
    """transformers' attention-function contract: q [B, Hq, N, d], k and v [B, Hkv, Nk, d] in,
    ([B, N, Hq, d_v], None) out."""
    if attention_mask is not None and not (attention_mask.dim() == 3 and attention_mask.dtype in (torch.float32,
                                                                                                 torch.int32)):
        raise ValueError(f"attn_implementation='fagen': a {attention_mask.dim()}-D {attention_mask.dtype} attention "
                         f"mask is not supported (padding comes as fagen.transformers.mask's [B, 1, Nk] bias or "
                         f"[2, 1, B] key ranges); use attn_implementation='sdpa' for a custom mask")
    ranges = None
    if attention_mask is not None and attention_mask.dtype == torch.int32:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, s_aux)):
            attention_mask = ranges_bias(attention_mask, key.shape[2])  # training: ranges have no backward
        else:
            ranges, attention_mask = attention_mask, None
    if attention_mask is not None and attention_mask.shape[-1] < key.shape[2]:
        # a static cache's prefill: the bias covers the tokens seen, the slots after them hold none
        n = attention_mask.shape[-1]
        key, value = key[:, :, :n], value[:, :, :n]
    if dropout:
        raise ValueError(f"attn_implementation='fagen': attention dropout {dropout} is not supported; set the "
                         f"config's attention_dropout to 0.0, or use attn_implementation='sdpa'")
    causal = module.is_causal if is_causal is None else is_causal
    if sliding_window and not causal:
        raise ValueError(f"attn_implementation='fagen': a sliding window of {sliding_window} without the causal "
                         f"mask is not supported; use attn_implementation='sdpa' for this model")
    if query.dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
        low = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(low), key.to(low), value.to(low)
    # transformers' window of W keys: kv_idx > q_idx - W, with the causal mask
    window = {"kind": "sliding_window", "window_left": sliding_window - 1} if sliding_window else None
    doc_ids = None if attention_mask is not None or ranges is not None else packed_documents(kwargs.get("position_ids"), query, key,
                                                                        windowed=window is not None)
    if doc_ids is not None and window is not None:
        raise ValueError("attn_implementation='fagen': packed documents (position_ids restarting) with a sliding "
                         "window are not supported; use attn_implementation='sdpa' for this model")
    sinks = None if s_aux is None else _float32(s_aux)
    compiling = torch.compiler.is_compiling()
    leftpad, seqlens = (None, None) if ranges is None else _range_rows(ranges, compiling)
    site = None
    if attention_mask is None and doc_ids is None and type(query) is type(key) is type(value) is torch.Tensor \
            and query.is_cuda and not torch.is_grad_enabled() and not compiling:
        # inference: the C path this module's last call took, where everything that chose it is as then
        site = _call_site(query, causal and window is None, sliding_window if window else None, softcap, scaling,
                          sinks, ranges is not None)
        kept = _KEPT.get(module)
        if kept is not None and kept[0] == site:
            out = kept[1](query, key, value, *(() if ranges is None else (seqlens, leftpad)), None)
            if out is not NotImplemented:
                return out.transpose(1, 2), None
    taken = decode.SHAPE_CLASSES.taken
    taken.run = None
    out = torch_op.attention(query, key, value, causal=causal and window is None, mask=window, scale=scaling,
                             softcap=softcap, sinks=sinks, doc_ids=doc_ids, bias=attention_mask,
                             cache_leftpad=leftpad, cache_seqlens=seqlens)
    if site is not None and taken.run is not None:
        _KEPT[module] = (site, taken.run)
    return out.transpose(1, 2), None


# An attention module -> its last inference call's site and the C path of the shape class that
# took it (decode.ShapeClasses' `taken`); held beside the module, not in it, so that the model
# still pickles and deep-copies. Each layer calls with the same options every step, so a step's
# call goes to that C path directly (which checks q's, k's, v's and the key ranges' layouts,
# dtypes and devices itself, and declines what its class does not take: then the whole path runs
# and keeps the class it finds), without fagen.attention's argument handling and the shape
# classes' key.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # (a module's hash and == are its identity's)


def _call_site(query, causal: bool, window, softcap, scaling, sinks, ranged: bool) -> tuple:
    """What chose a call's shape class beside its tensors' layouts (decode.ShapeClasses' options
    key, less what the C path checks): the options, the sinks' identity and version, the GPU,
    its current stream and the thread (a class's workspace is one call's at a time)."""
    device = query.get_device()
    return (causal, window, softcap, scaling,
            None if sinks is None else (sinks.data_ptr(), sinks._version, sinks.dtype, sinks.shape),
            ranged, device, _current_stream(device), threading.get_ident())


_current_stream = torch_stream_handle()  # a GPU's current stream as a raw handle


# The last forward's key ranges (the one tensor all its layers get) and their rows as the attention
# takes them: indexed once a forward, not once a layer (two indexing ops, ~10 us of host time a
# layer). One pair, replaced whole: the rows are views, which hold their ranges alive.
_last_ranges: tuple = (None, None)


def _range_rows(ranges, compiling: bool):
    """(cache_leftpad, cache_seqlens): the key ranges' rows 0 and 1, [B] int32 views (`compiling`:
    under torch.compile, which traces no global state: indexed each call)."""
    global _last_ranges
    if compiling:
        return ranges[0, 0], ranges[1, 0]
    last, rows = _last_ranges
    if last is not ranges:
        rows = (ranges[0, 0], ranges[1, 0])
        _last_ranges = (ranges, rows)
    return rows


def ranges_bias(ranges, length: int):
    """Key ranges [2, 1, B] as the score bias [B, 1, length] of the same keys."""
    slots = torch.arange(length, device=ranges.device)
    return padding_bias((slots >= ranges[0, 0, :, None]) & (slots < ranges[1, 0, :, None]))


def packed_documents(position_ids, query, key, windowed: bool = False):
    """Documents packed one after another into each row (position_ids not stepping by one, as
    transformers tells them), as int32 [B|1, N] document numbers for fagen's document mask; None
    for anything else. Only a prefill or training step without padding can be packed (the
    attention asks only where there is no mask). Telling costs one host check a forward (the
    layers share its answer, kept by the position_ids tensor; decode steps, with one query, pay
    none), as transformers' own FlashAttention path makes; under torch.compile, which cannot
    branch on a tensor's values, such a step always takes the document mask (one document where
    nothing restarts: the same result, at the document kernel's speed), but for a sliding-window
    layer, which has no document form: there packing goes undetected."""
    if position_ids is None or query.shape[2] != key.shape[2] or query.shape[2] < 2 \
            or position_ids.dim() != 2 or position_ids.shape[1] != query.shape[2]:
        return None
    if torch.compiler.is_compiling():
        return None if windowed else _document_ids(position_ids)
    version, doc_ids = _DOCUMENTS.get(position_ids, (None, None))
    if version != position_ids._version:  # the forward's first layer: its one host check
        doc_ids = _document_ids(position_ids) if bool(_restarts(position_ids).any()) else None
        _DOCUMENTS[position_ids] = (position_ids._version, doc_ids)
    return doc_ids


# A forward's position_ids (the one tensor every layer gets) -> (its version, its document ids or
# None): the host check a forward makes once, not once a layer (each check waits for the GPU).
_DOCUMENTS = WeakIdKeyDictionary()


def _restarts(position_ids):
    """Where a new document starts: the position does not follow the one before by one (transformers' rule)."""
    return position_ids[:, 1:] != position_ids[:, :-1] + 1


def _document_ids(position_ids):
    """int32 [B, N] document numbers, each row's from 0 (fagen's document mask reads them per row)."""
    return torch.nn.functional.pad(_restarts(position_ids).to(torch.int32).cumsum(-1, dtype=torch.int32), (1, 0))
