"""The public entry points (fagen.attention and its siblings), thin: each hands its tensors to the
module that owns the layout (the PyTorch op, decode, sequences). Their imports wait for the first
call so that `import fagen` and `fagen render` load no CuPy or PyTorch. fagen.attention_varlen and
fagen.attention_with_kvcache are fagen.sequences' own functions, bound at their first lookup
(fagen.__getattr__): a serving loop's call pays no forwarding frame."""

from __future__ import annotations


def compile(spec):
    """Compile a spec for the current GPU (needs CuPy); returns a callable `Kernel`."""
    from fagen.runtime import compile_kernel

    return compile_kernel(spec)


def attention(q, k, v, **kwargs):
    """softmax(q k^T * scale) v with a shipped kernel for q's dtype and head_dim (needs CuPy);
    a few query rows (decode) take the GQA-packed split-KV kernels (fagen.decode). PyTorch tensors go through the fagen::attention_forward op: autograd, torch.compile and
    CUDA graphs see it (fagen.torch_op)."""
    module = _MODULES.get(type(q))
    return (module or _module_for(type(q))).attention(q, k, v, **kwargs)


# array type -> the module whose `attention` takes it: a decode loop's call pays a dictionary
# lookup, not two import statements (a plain dict: torch.compile traces through this, and warns
# on functools' caches)
_MODULES: dict[type, object] = {}


def _module_for(kind: type):
    """PyTorch's tensors: fagen.torch_op; other arrays: fagen.decode (imported here, kept in _MODULES)."""
    if kind.__module__.startswith("torch") and hasattr(kind, "data_ptr"):  # fagen.device.is_torch, of the type
        from fagen import torch_op as module
    else:
        from fagen import decode as module
    _MODULES[kind] = module
    return module


def prepare(q, k, v, **kwargs):
    """fagen.attention packed once for tensors of these shapes (a decode loop): a callable
    taking (q, k, v) of the same shapes, strides and dtype, with a few microseconds of host work
    a call (fagen.decode.PreparedAttention)."""
    from fagen.decode import prepare as _prepare

    return _prepare(q, k, v, **kwargs)


def prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, **kwargs):
    """attention_varlen packed once for a batch layout that comes again: a callable taking (q, k,
    v, cu_seqlens_q, cu_seqlens_k[, seqused_k]) of the same shapes, strides and dtypes, whose
    lengths may change within max_seqlen_q and max_seqlen_k, with a few microseconds of host work
    a call (fagen.sequences.PreparedVarlen)."""
    from fagen.sequences import prepare_varlen as _prepare_varlen

    return _prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


def prepare_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, **kwargs):
    """attention_with_kvcache packed once for a decode loop over a paged cache: a callable taking
    (q, k_cache, v_cache, cache_seqlens, page_table) of the same shapes, strides and dtypes, with
    a few microseconds of host work a call (fagen.sequences.PreparedKVCache)."""
    from fagen.sequences import prepare_with_kvcache as _prepare_with_kvcache

    return _prepare_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, **kwargs)


def mla_decode(q, kv_cache, page_table, cache_seqlens, **kwargs):
    """MLA decode (DeepSeek's absorbed latent attention): q [B, Hq, Nq, 576] against a paged
    latent cache [num_pages, 64, 1, 576] whose first 512 columns are V; out [B, Hq, Nq, 512];
    fagen.mla."""
    from fagen.mla import mla_decode as _mla_decode

    return _mla_decode(q, kv_cache, page_table, cache_seqlens, **kwargs)


def prepare_mla_decode(q, kv_cache, page_table, cache_seqlens, **kwargs):
    """mla_decode packed once for a decode loop (fagen.mla.PreparedMlaDecode)."""
    from fagen.mla import prepare_mla_decode as _prepare_mla_decode

    return _prepare_mla_decode(q, kv_cache, page_table, cache_seqlens, **kwargs)
