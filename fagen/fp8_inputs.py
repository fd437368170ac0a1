"""What an FP8 forward's inputs become before its launch (issue 55).

- V, transposed. FP8 wgmma reads both operands K-major, so P.V's B is V^T: [B, Hkv, head_dim_v,
  keys], the keys padded with zeros to whole 128-key boxes (P is 0 past the last key, but an FP8
  byte of garbage may be NaN, and 0 * NaN is NaN). Within each 32 keys, column c of V^T holds key
  KEY_ORDER[c]: the order P's registers come out of the S accumulator in (templates/sm90
  mainloop: a thread holds keys 2t, 2t+1, 8+2t, 9+2t where wgmma's A operand wants k 4t..4t+3),
  so P needs no shuffle. The pass reads and writes V once (the attention reads it once per query
  tile): 23.5 us for 32 MB of V on an H200 (2.9 TB/s), ~3.5% of a dense d128 call at 4k keys.
- The descales, FlashAttention-3's convention: float32, one number or [B, Hkv] each (None: 1);
  the true q is q * q_descale[b, h_kv], likewise k and v. Each goes to the kernel as an address and
  its (sequence, KV head) strides, a device tensor read where it lies (descale_views).
- An FP8 q beside an FP8 KV cache of its type, where a decode kernel takes the call: the cache's
  kernels, which split the keys and pack GQA heads, widen it exactly as it lands (spec.q_dtype)
  and read its q_descale beside k_descale (a score is q.k x q_descale x k_descale).
"""

from __future__ import annotations

import math

import numpy as np

KEY_GROUP = 32  # keys of one k32 wgmma step: the permutation's period
V_TILE_KEYS = 128  # keys of a V^T box: one 128-byte swizzle row of FP8 (plan.swizzle_atom_columns)


def key_order() -> np.ndarray:
    """KEY_ORDER: the key each V^T column holds within a group of 32 (0, 1, 8, 9, 2, 3, 10, 11, ...)."""
    column = np.arange(KEY_GROUP)
    half, quad, pair = column // 16, column % 16 // 4, column % 4
    return half * 16 + 2 * quad + pair % 2 + 8 * (pair // 2)


KEY_ORDER = key_order()


def padded_keys(n: int) -> int:
    return -(-n // V_TILE_KEYS) * V_TILE_KEYS


def transposed_v(v):
    """V [B, Hkv, N, dv] (a torch float8 tensor, or a NumPy uint8 array of its bytes) as the
    kernel reads it: [B, Hkv, dv, padded N], contiguous, keys in KEY_ORDER by groups of 32. The
    twin of the V^T kernel (templates/kernel/v_transpose.cu.j2), which the launches use."""
    b, h, n, d = v.shape
    keys = padded_keys(n)
    if type(v).__module__.startswith("torch"):
        import torch

        raw = v.view(torch.uint8) if v.dtype != torch.uint8 else v
        out = torch.zeros((b, h, keys, d), dtype=torch.uint8, device=raw.device)
        out[:, :, :n] = raw
        order = torch.as_tensor(KEY_ORDER, device=raw.device)
        grouped = out.view(b, h, keys // KEY_GROUP, KEY_GROUP, d).index_select(3, order)
        return grouped.view(b, h, keys, d).transpose(2, 3).contiguous().view(v.dtype)
    out = np.zeros((b, h, keys, d), dtype=v.dtype)
    out[:, :, :n] = v
    grouped = out.reshape(b, h, keys // KEY_GROUP, KEY_GROUP, d)[:, :, :, KEY_ORDER]
    return np.ascontiguousarray(grouped.reshape(b, h, keys, d).transpose(0, 1, 3, 2))


DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


OUTPUT_TYPE = "float8_e4m3"  # what scale_o writes (cuDNN's FP8 output)


def check_output_request(scale_o, return_amax: bool, fp8_inputs: bool, types: str) -> bool:
    """Whether a call asks for an FP8 output (scale_o given, or return_amax); refused where its q, k
    and v (`types`, as the message names them) are not of one FP8 type, or amax is asked alone."""
    if scale_o is None and not return_amax:
        return False
    if not fp8_inputs:
        raise ValueError(f"{'scale_o' if scale_o is not None else 'return_amax'}: an FP8 output is the FP8 forward's "
                         f"(float8_e4m3fn or float8_e5m2 q, k and v of one type); {types}: drop it, or quantize q, "
                         f"k and v (fagen.fp8_inputs.quantized)")
    if scale_o is None:
        raise ValueError("return_amax=True: amax_o is an FP8 output's (max |O| before scale_o); pass scale_o "
                         "(e.g. 1.0) to have o written in float8_e4m3fn")
    return True


def output_scale(scale_o, like):
    """An FP8 output's scale (cuDNN's scale_o: o = e4m3(O * scale_o), saturated) as the kernel reads
    it: float32 [1] on like's device (None: 1), refused unless one positive finite number."""
    if scale_o is None:
        return _one(like)
    on_device = type(scale_o).__module__.split(".")[0] in ("torch", "cupy") and str(scale_o.device) != "cpu"
    if not on_device:  # a number, a host array or a CPU tensor: its value is checked here
        host = np.asarray(scale_o.cpu() if _is_torch(scale_o) else scale_o, dtype=np.float64)
        if host.shape not in ((), (1,)):
            raise ValueError(f"scale_o: shape {host.shape}; the output scale is one number (float32 [1] on q's "
                             f"GPU, or a Python float): o = e4m3(O * scale_o)")
        return _on_device(checked_output_scale(host.item()), like)
    if tuple(scale_o.shape) not in ((), (1,)):  # (a device tensor's value is read by the kernel, unchecked)
        raise ValueError(f"scale_o: shape {tuple(scale_o.shape)}; the output scale is one number (float32 [1] on "
                         f"q's GPU, or a Python float): o = e4m3(O * scale_o)")
    return _on_device(scale_o, like)


def checked_output_scale(scale_o) -> float:
    """A number given as scale_o, refused unless positive and finite."""
    try:
        value = float(scale_o)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale_o = {scale_o!r}: must be a positive finite number (o = e4m3(O * scale_o)); "
                         f"e.g. 448 / amax_o of an earlier call, or 1.0")
    return value


def output_amax(amax_o, like):
    """amax_o as the kernel writes it (max |O| over the output's real rows): a float32 [1] tensor or
    array on like's device, contiguous, written in place; refused otherwise (the kernel's
    atomic max needs the caller's memory, not a copy)."""
    kind = type(like).__module__.split(".")[0]
    dtype = str(getattr(amax_o, "dtype", type(amax_o).__name__)).removeprefix("torch.")
    shape = tuple(getattr(amax_o, "shape", (None,)))
    if type(amax_o).__module__.split(".")[0] != kind:
        on_device = False
    elif kind == "torch":
        on_device = amax_o.device == like.device
    elif kind == "cupy":
        on_device = amax_o.device.id == like.device.id
    else:
        on_device = True  # NumPy: the tests' host twin
    if not (on_device and dtype == "float32" and shape in ((1,), ())):
        where = getattr(amax_o, "device", "the host")
        raise ValueError(f"amax_o: a {type(amax_o).__module__.split('.')[0]} {type(amax_o).__name__} of {dtype}, "
                         f"shape {shape}, on {where}; pass a float32 [1] tensor on q's device (e.g. "
                         f"torch.empty(1, device=q.device)): the kernel writes max |O| into it")
    return amax_o


# 1.0 on each device, kept: a descale not given reads it (no fill a call). Made outside stream
# capture only, and waited for once (a fill recorded in a graph runs at its replays alone).
_ONES: dict = {}


def descale_views(q_descale, k_descale, v_descale, b: int, hkv: int, like,
                  names: tuple[str, ...] = DESCALE_NAMES) -> dict[str, tuple[object, int, int]]:
    """The descales `names` as a kernel reads them: name -> (a float32 array on like's device, its
    sequence and KV head strides in elements), FlashAttention-3's forms checked: None (1), one
    number, or [B, Hkv] ([1] or a 0-d tensor too; strides 0 along what it lacks). A float32 tensor
    on that device is read where it lies, any strides: a call launches nothing for it (a decode
    step's few microseconds of GPU time once went to building one [3, B, Hkv] table a call); a
    number is filled on the device a call, another dtype or device copied. like: a torch tensor
    or a CuPy array; a NumPy one for the tests (the arrays stay NumPy)."""
    views = {}
    for name, x in zip(DESCALE_NAMES, (q_descale, k_descale, v_descale)):
        shape = _descale_shape(name, x, b, hkv)
        if name not in names:
            continue
        array = _one(like) if x is None else _on_device(x, like)
        views[name] = (array, *((array.stride() if _is_torch(array) else
                                 tuple(s // 4 for s in array.strides)) if shape == (b, hkv) else (0, 0)))
    return views


def _descale_shape(name: str, x, b: int, hkv: int) -> tuple[int, ...]:
    """A descale's shape, refused unless one of FlashAttention-3's forms: () for None or a number."""
    shape = () if x is None or np.isscalar(x) else tuple(x.shape)
    if shape not in ((), (1,), (b, hkv)):
        raise ValueError(f"{name}: shape {shape}; FlashAttention-3's descales are one number or [B, Hkv] = "
                         f"[{b}, {hkv}] float32 (the true tensor is the FP8 one times its descale)")
    return shape


def widened(x):
    """An FP8 torch tensor in bfloat16, exactly (e4m3: 3 mantissa bits, exponents -9..8; e5m2: 2
    and -16..15; bfloat16 holds 7 and -133..127): FP8 new tokens as the cache's append reads them."""
    import torch

    return x.to(torch.bfloat16)


def quantized(x, heads_kv: int | None = None):
    """(x, a half-type torch tensor [B, H, N, d], in e4m3; its float32 [B, Hkv] descale, FlashAttention-3's):
    a scale a batch and KV head (for q, over its group of query heads; heads_kv None: x's own
    heads) at amax / e4m3's largest value, so that x8 * descale stands for x (1 where the amax is 0)."""
    import torch

    b, h = x.shape[:2]
    heads_kv = heads_kv or h
    amax = x.detach().abs().amax(dim=(2, 3)).float().reshape(b, heads_kv, h // heads_kv).amax(-1)
    descale = torch.where(amax > 0, amax / torch.finfo(torch.float8_e4m3fn).max, torch.ones_like(amax))
    per_head = descale.repeat_interleave(h // heads_kv, dim=1)[:, :, None, None]
    return (x.detach().float() / per_head).to(torch.float8_e4m3fn), descale


def kept_form(descales: tuple, device: int) -> tuple[tuple[str, ...], tuple, tuple]:
    """How a kept call (decode.ShapeClasses, sequences.KeptPagedCalls) takes (q_descale,
    k_descale, v_descale): (the names it re-points each call, those tensors in that order, the
    key of all three). The moving ones are float32 torch tensors on the call's GPU: the kernel
    reads them where they lie, so a call re-points them, keyed by their layout (dtype, shape,
    strides, device), and a dynamic scale (a fresh tensor each call) keeps the call's class.
    Numbers and other tensors are copied when the class is made and keyed by value, or by address
    and version (descale_key). AttributeError for what is neither a number nor a tensor."""
    moves = tuple(name for name, x in zip(DESCALE_NAMES, descales)
                  if _is_torch(x) and str(x.dtype) == "torch.float32" and x.get_device() == device)
    key = tuple((x.dtype, tuple(x.shape), tuple(x.stride()), x.get_device()) if name in moves else descale_key(x)
                for name, x in zip(DESCALE_NAMES, descales))
    return moves, tuple(x for name, x in zip(DESCALE_NAMES, descales) if name in moves), key


# a descale tensor in a kept call's options (re_pointed): the kept class's C path re-points it
RE_POINTED = object()


def re_pointed(descales: tuple, tensor: type) -> tuple[tuple | None, tuple]:
    """(q_descale, k_descale, v_descale) as a kept call's last class is tried with: (each
    `tensor` as RE_POINTED, None and Python numbers as given, or None where one is anything else,
    which that class may hold a copy of; those tensors in order). That class's C path checks
    each tensor's layout, dtype and GPU itself, so the options need not (kept_form, which reads
    them, runs where the class is looked up or made). Spelled out, no generator: a decode step's
    host time."""
    if not descales:
        return (), ()
    form, tensors = [], ()
    for x in descales:
        if type(x) is tensor:
            form.append(RE_POINTED)
            tensors = (*tensors, x)
        elif x is None or type(x) in (float, int):
            form.append(x)
        else:
            return None, tensors
    return tuple(form), tensors


def descale_key(x):
    """What a kept call's key holds of a descale it copies (not kept_form's moving): None or a number as
    itself, a torch tensor by its address, layout and version (a kept call holds a copy of its
    values, prepared_copy; a write to the tensor makes a new version, so a new key; and it holds
    the tensor, so that no other one takes its address). Such a tensor made anew each call (one
    of another dtype or device) is a new class each call: pass float32 on q's GPU. Anything else
    raises AttributeError (the kept paths then leave the call to the general one)."""
    if x is None or np.isscalar(x):
        return x
    return (x.data_ptr(), x._version, x.dtype, tuple(x.shape), tuple(x.stride()), x.get_device())


def prepared_copy(x):
    """A descale as a prepared call keeps it: its values at prepare time (an array is copied, on
    its device), which later changes to the caller's array do not reach."""
    return x.clone() if _is_torch(x) else x.copy() if hasattr(x, "copy") and not np.isscalar(x) else x


def prepared(descales: tuple, moving: tuple[str, ...]) -> tuple[dict, tuple]:
    """(q_descale, k_descale, v_descale) as a prepared call packs them: by name, the `moving`
    ones as given (each call passes its own: kept_form) and the others prepared_copy's; and the
    moving tensors, in that order (the inputs a call passes after the index tensors)."""
    named = dict(zip(DESCALE_NAMES, descales))
    return ({name: x if name in moving else prepared_copy(x) for name, x in named.items()},
            tuple(named[name] for name in moving))


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _one(like):
    """1.0 on like's device: the kept one, or under stream capture a fill of the call's own (held
    with its launch), which the graph's replays run."""
    kind = type(like).__module__.split(".")[0]
    key = (kind, str(like.device) if kind in ("torch", "cupy") else None)
    if key in _ONES:
        return _ONES[key]
    one = _on_device(1.0, like)
    if kind == "torch":
        import torch

        if torch.cuda.is_current_stream_capturing():
            return one
        torch.cuda.current_stream(like.device).synchronize()
    elif kind == "cupy":
        import cupy

        if cupy.cuda.get_current_stream().is_capturing():
            return one
        cupy.cuda.get_current_stream().synchronize()
    _ONES[key] = one
    return one


def _on_device(x, like):
    """x (a number or an array) as float32 on like's device, 1-D where it is one number; a float32
    tensor already there as it is."""
    if _is_torch(like):
        import torch

        if _is_torch(x) and x.dtype == torch.float32 and x.device == like.device:
            return x.reshape(1) if x.dim() == 0 else x
        if np.isscalar(x):  # filled on the device: a host copy would block, and capture refuses it
            return torch.full((1,), float(x), dtype=torch.float32, device=like.device)
        return torch.as_tensor(x, dtype=torch.float32, device=like.device).reshape(tuple(x.shape) or (1,))
    if type(like).__module__.startswith("cupy"):
        import cupy

        if isinstance(x, cupy.ndarray) and x.dtype == cupy.float32 and x.device.id == like.device.id:
            return x.reshape(1) if x.ndim == 0 else x
        with cupy.cuda.Device(like.device.id):  # (cupy.array copies from another device, asarray would not)
            return cupy.array(x, dtype=cupy.float32).reshape(np.shape(x) or (1,))
    return np.asarray(x, dtype=np.float32).reshape(np.shape(x) or (1,))
