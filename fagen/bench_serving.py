"""Serving in `fagen bench`: decode against PyTorch SDPA, a paged KV cache against the contiguous
one, varlen prefill against the padded batch; same process, same GPU.

Decode and paged calls are a few microseconds of GPU work behind tens of host work, so every
case is timed as GPU time: a CUDA graph of REPS calls, replayed, CUDA events around each replay
(queued behind check.stream_held's hold, so that the graph's own launch is not in it), the
median of REPLAYS divided by REPS (varlen and its padded batch replay in turns,
interleaved_us). Bandwidth counts the K and V bytes a call must read,
2 * B * Hkv * Nk * d * 2 (bytes / time: TB/s); prefill counts FLOPs, 4 * Hq * d * n^2 a sequence
of n, halved for causal (TFLOP/s).

Host time (the "host" cases) is the other cost of a decode step: the enqueue time of a prepared
call (fagen.prepare), HOST_CALLS calls between clock reads with no synchronisation inside (the GPU
may lag; the queue stays far from full), the median of HOST_BATCHES batches.

Each case draws fresh random inputs shared by every implementation, and every fagen output is
checked at the timed shape before it is timed, into a NaN-poisoned output: decode and paged
against SDPA in float32 on the same inputs, varlen against the float32 reference of each sequence
(fagen.check.OUT_TOLERANCE). A case over its tolerance is reported, not timed.
"""

from __future__ import annotations

import itertools
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fagen import api, bench_rows, fp8_inputs, sequences
from fagen.check import (OUT_TOLERANCE, REPLAYS, REPS, graph_us, interleaved_us, random_inputs, relative_error,
                         to_numpy)

HOST_CALLS, HOST_BATCHES = 100, 15
GROWING = 64  # host time of a growing cache: calls cycle through this many key lengths
JSON, CSV, PLOT = "bench_serving.json", "bench_serving.csv", "bench_serving.png"
FIX = f"pass a {JSON} written by `fagen bench --serving` (or the full `fagen bench`)"
PAGE_SIZE = 64


@dataclass(frozen=True)
class ServingCase:
    section: str  # "decode", "paged", "mixed" (paged decode, lengths mixed), "varlen" or "host"
    dtype: str
    head_dim: int
    b: int
    hq: int
    hkv: int
    nq: int  # varlen: each sequence's queries (and keys) when lengths are uniform
    nk: int
    causal: bool = False
    page_size: int = 0  # paged
    mixed: bool = False  # varlen: random lengths with the same total (host: a varlen batch's)
    fp8: str = ""  # host: "cache" (k and v in e4m3, dtype q), "qkv" (q too): FlashAttention-3's descales

    @property
    def key(self) -> str:
        what = {"decode": "", "host": (f" page {self.page_size}" if self.page_size else " varlen" if self.mixed else "")
                + (f" fp8 {self.fp8}" if self.fp8 else ""),
                "paged": f" page {self.page_size}", "mixed": f" page {self.page_size}",
                "varlen": " mixed" if self.mixed else " uniform"}
        return (f"{self.section} {self.dtype} d{self.head_dim} {self.hq}/{self.hkv} B{self.b} Nq{self.nq} "
                f"Nk{self.nk}{' causal' if self.causal else ''}{what[self.section]}")


@dataclass
class ServingRow:
    section: str
    case: str
    impl: str  # fagen; sdpa (its default backend), sdpa_flash; fagen_contiguous (paged); fagen_padded (varlen);
    # fagen_out (host: out given), fagen_moved (host: out given, new q, k, v a call),
    # fagen_attention (host: fagen.attention, not prepared);
    # fagen_attention_growing, sdpa_growing (host: a new key length and strides every call);
    # fagen_attention_ranged_growing (host: the same with key ranges made a call, a padded batch's)
    dtype: str
    head_dim: int
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    us: float | None
    tb_s: float | None
    tflops: float | None
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def cases(quick: bool = False) -> list[ServingCase]:
    """fp16, d 128, GQA 32/8 unless said. decode: Nq 1 against Nk 8k, 32k, 128k; Nq 4 and 16 (GQA
    packing); MHA; B 8 and 32; bf16 d 64. paged: B 1 at 32k (page 16 and 64) and 128k, B 8 at 8k,
    B 32 at 4k. varlen: causal prefill of 16k tokens, 8 x 2048 uniform and mixed, 16 x 1024 mixed;
    bf16 d 64 MHA non-causal 4 x 4096 mixed. quick: one of each."""
    f16, gqa = dict(dtype="float16", head_dim=128), dict(hq=32, hkv=8)
    decode = [ServingCase("decode", **f16, b=1, **gqa, nq=nq, nk=nk)
              for nq, nk in ((1, 8192), (1, 32768), (1, 131072), (4, 32768), (16, 131072))]
    decode += [ServingCase("decode", **f16, b=1, hq=32, hkv=32, nq=1, nk=32768),
               ServingCase("decode", **f16, b=8, **gqa, nq=1, nk=32768),
               ServingCase("decode", **f16, b=32, **gqa, nq=1, nk=4096),
               ServingCase("decode", "bfloat16", 64, 1, 32, 8, 1, 32768)]
    paged = [ServingCase("paged", **f16, b=b, **gqa, nq=1, nk=nk, page_size=ps)
             for b, nk, ps in ((1, 32768, 16), (1, 32768, PAGE_SIZE), (1, 131072, PAGE_SIZE), (8, 8192, PAGE_SIZE),
                               (32, 4096, PAGE_SIZE))]
    # a batch of decode rows against caches of mixed lengths (a quarter to 1.75x nk): paged, one launch
    mixed = [ServingCase("mixed", **f16, b=b, **gqa, nq=1, nk=nk, page_size=PAGE_SIZE, mixed=True)
             for b, nk in ((16, 8192), (64, 2048))]
    varlen = [ServingCase("varlen", **f16, b=b, **gqa, nq=n, nk=n, causal=True, mixed=m)
              for b, n, m in ((8, 2048, False), (8, 2048, True), (16, 1024, True))]
    varlen.append(ServingCase("varlen", "bfloat16", 64, 4, 16, 16, 4096, 4096, mixed=True))
    # host time: a decode step (one launch, its last split merging), a one-launch prepared call, a
    # paged decode step (fagen.prepare_with_kvcache) and a small varlen prefill (fagen.prepare_varlen:
    # the tile table's launch and the kernel's; small enough that the GPU keeps up with the host)
    host = [ServingCase("host", **f16, b=1, **gqa, nq=1, nk=1024),
            ServingCase("host", "float16", 64, 1, 1, 1, 128, 128),
            ServingCase("host", **f16, b=8, **gqa, nq=1, nk=1024, page_size=PAGE_SIZE),
            ServingCase("host", **f16, b=4, hq=8, hkv=2, nq=32, nk=32, causal=True, mixed=True)]
    # ... and an FP8 KV cache's decode step (bfloat16 q; FP8 q, k, v), contiguous and paged
    host += [ServingCase("host", "bfloat16", 128, 8, 32, 8, 1, 4096, page_size=page, fp8=fp8)
             for fp8 in ("cache", "qkv") for page in (0, PAGE_SIZE)]
    if quick:
        return [decode[1], paged[1], mixed[0], varlen[1], host[0]]
    return decode + paged + mixed + varlen + host


def host_us(fn) -> float:
    """Host microseconds a call of fn: the enqueue time of HOST_CALLS calls (no synchronisation
    inside; each batch starts on an idle GPU), the median of HOST_BATCHES batches."""
    import time

    import torch

    for _ in range(20):
        fn()
    times = []
    for _ in range(HOST_BATCHES):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        times.append((time.perf_counter() - start) / HOST_CALLS * 1e6)
    torch.cuda.synchronize()
    return float(np.median(times))


def kv_bytes(case: ServingCase) -> float:
    return 2.0 * case.b * case.hkv * case.nk * case.head_dim * 2


def prefill_flops(lengths, case: ServingCase) -> float:
    return sum(4.0 * case.hq * case.head_dim * n * n for n in lengths) / (2 if case.causal else 1)


def _row(case: ServingCase, impl: str, us: float | None, *, tb_s=None, tflops=None, note: str = "") -> ServingRow:
    return ServingRow(case.section, case.key, impl, case.dtype, case.head_dim, case.b, case.hq, case.hkv, case.nq,
                      case.nk, us, tb_s, tflops, note)


def _checked(case, impl, out, ref, time_fn, *, tb_s=None, tflops=None, note: str = "") -> ServingRow:
    """A row timed only if out (computed into a NaN-poisoned buffer) is within tolerance of ref."""
    err = relative_error(to_numpy(out), ref)
    if not err <= OUT_TOLERANCE[case.dtype]:
        return _row(case, impl, None, note=f"FAILED check: relative error {err:.2e}")
    us = time_fn()
    return _row(case, impl, us, tb_s=None if tb_s is None else tb_s / us / 1e6,
                tflops=None if tflops is None else tflops / us / 1e6, note=f"err {err:.1e}{', ' + note if note else ''}")


def _sdpa_reference(q, k, v, causal=False):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal,
                                          enable_gqa=q.shape[1] != k.shape[1]).cpu().numpy()


def _sdpa_rows(case, q, k, v) -> list[ServingRow]:
    import torch
    import torch.nn.functional as F

    rows = []
    for impl, backend in (("sdpa", None), ("sdpa_flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION)):
        def call():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=case.hq != case.hkv)
        try:
            if backend is None:
                us = graph_us(call)
            else:
                with torch.nn.attention.sdpa_kernel(backend):
                    us = graph_us(call)
            rows.append(_row(case, impl, us, tb_s=kv_bytes(case) / us / 1e6))
        except RuntimeError as err:  # a backend that does not take the shape
            rows.append(_row(case, impl, None, note=f"unsupported: {str(err).splitlines()[0][:80]}"))
    return rows


def run_decode(case: ServingCase) -> list[ServingRow]:
    q, k, v, out = random_inputs("torch", case.dtype, case.b, case.hq, case.hkv, case.nq, case.nk, case.head_dim)
    ref = _sdpa_reference(q, k, v)
    step = api.prepare(q, k, v)
    step(q, k, v, out=out)
    row = _checked(case, "fagen", out, ref, lambda: graph_us(lambda: step(q, k, v, out=out)), tb_s=kv_bytes(case))
    return [row] + _sdpa_rows(case, q, k, v)


def run_host(case: ServingCase, rng) -> list[ServingRow]:
    """Host time of a prepared call with out allocated and with out given, of the unprepared call
    (fagen.attention; paged: attention_with_kvcache with validate=False, a graph's form) and of
    SDPA's call (paged: on the contiguous cache)."""
    import torch
    import torch.nn.functional as F

    q, k, v, out = random_inputs("torch", case.dtype, case.b, case.hq, case.hkv, case.nq, case.nk, case.head_dim)
    if case.mixed:
        return _host_varlen(case, q, k, v, rng)
    if case.fp8:
        return _host_fp8(case, q, k, v, out, rng)
    ref = _sdpa_reference(q, k, v, case.causal)
    if case.page_size:
        k_cache, v_cache, table = paged_cache(k, v, case.page_size, rng)
        lengths = torch.full((case.b,), case.nk, dtype=torch.int32, device="cuda")
        tensors = (q, k_cache, v_cache, lengths, table)
        step = api.prepare_with_kvcache(*tensors, causal=case.causal)
        status = torch.zeros(1, dtype=torch.int32, device="cuda")
        unprepared = lambda: sequences.attention_with_kvcache(*tensors, causal=case.causal,  # noqa: E731
                                                                status=status, validate=False)
    else:
        tensors = (q, k, v)
        step = api.prepare(*tensors, causal=case.causal)
        unprepared = lambda: api.attention(q, k, v, causal=case.causal)  # noqa: E731  (the kernel's cached launch)
    step(*tensors, out=out)
    rows = [_checked(case, "fagen", out, ref, lambda: host_us(lambda: step(*tensors)), note="out allocated"),
            _checked(case, "fagen_out", out, ref, lambda: host_us(lambda: step(*tensors, out=out)), note="out given")]
    rows.append(_checked(case, "fagen_attention", unprepared(), ref, lambda: host_us(unprepared),
                         note="not prepared"))
    gqa = case.hq != case.hkv
    us = host_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=gqa))
    rows.append(_row(case, "sdpa", us))
    if case.page_size or case.nq != 1:
        return rows
    # a generation loop's cache: a new length (and strides: re-allocated, as transformers' dynamic
    # cache is) every call, nk + 1 to nk + GROWING keys
    caches = [(torch.cat([k, k[:, :, :i]], 2), torch.cat([v, v[:, :, :i]], 2)) for i in range(1, GROWING + 1)]
    # ... and a padded batch's (fagen.transformers' decode step): each row's key range, made a call
    leftpad = torch.zeros(case.b, dtype=torch.int32, device="cuda")

    def ranged(kc, vc):
        ends = torch.full((case.b,), kc.shape[2], dtype=torch.int32, device="cuda")
        return api.attention(q, kc, vc, causal=case.causal, cache_seqlens=ends, cache_leftpad=leftpad)
    for impl, fn in (("fagen_attention_growing", lambda kc, vc: api.attention(q, kc, vc, causal=case.causal)),
                     ("fagen_attention_ranged_growing", ranged),
                     ("sdpa_growing", lambda kc, vc: F.scaled_dot_product_attention(q, kc, vc, is_causal=case.causal,
                                                                             enable_gqa=gqa))):
        turn = itertools.cycle(caches)
        last = fn(*caches[-1])
        if impl == "sdpa_growing":
            rows.append(_row(case, impl, host_us(lambda: fn(*next(turn))), note="keys grow a call"))
            continue
        rows.append(_checked(case, impl, last, _sdpa_reference(q, *caches[-1], case.causal),
                             lambda: host_us(lambda: fn(*next(turn))),
                             note="keys grow a call" + (", key ranges made a call" if "ranged" in impl else "")))
    return rows


def _host_fp8(case: ServingCase, q, k, v, out, rng) -> list[ServingRow]:
    """Host time of a decode step on an e4m3 KV cache (FlashAttention-3's descales a sequence and
    KV head; case.fp8 "qkv": q in e4m3 too, with its q_descale, which the cache's kernels widen as
    it lands): prepared (fagen.prepare, or prepare_with_kvcache on pages; descales copied at
    prepare time), out given, and unprepared (fagen.attention, or attention_with_kvcache with
    validate=False) with fresh descale tensors a call (a dynamic scale: four in turn); SDPA's call
    on the bfloat16 cache beside them. Each checked against float32 SDPA on the dequantized values."""
    import torch
    import torch.nn.functional as F

    group = case.hq // case.hkv
    (k8, kd), (v8, vd) = fp8_inputs.quantized(k), fp8_inputs.quantized(v)
    q8, qd = fp8_inputs.quantized(q, case.hkv) if case.fp8 == "qkv" else (q, None)
    wide = lambda x8, d, n=1: x8.float() * d.repeat_interleave(n, 1)[:, :, None, None]  # noqa: E731
    ref = _sdpa_reference(wide(q8, qd, group) if qd is not None else q, wide(k8, kd), wide(v8, vd))
    descales = {"k_descale": kd, "v_descale": vd, **({"q_descale": qd} if qd is not None else {})}
    fresh = itertools.cycle([{n: d.clone() for n, d in descales.items()} for _ in range(4)])
    if case.page_size:
        # (paged as bytes: an index copy of the FP8 values themselves)
        k_cache, v_cache, table = paged_cache(k8.view(torch.uint8), v8.view(torch.uint8), case.page_size, rng)
        k_cache, v_cache = k_cache.view(k8.dtype), v_cache.view(v8.dtype)
        lengths = torch.full((case.b,), case.nk, dtype=torch.int32, device="cuda")
        tensors = (q8, k_cache, v_cache, lengths, table)
        step = api.prepare_with_kvcache(*tensors, **descales)
        unprepared = lambda: sequences.attention_with_kvcache(*tensors, validate=False, **next(fresh))  # noqa: E731
    else:
        tensors = (q8, k8, v8)
        step = api.prepare(*tensors, **descales)
        unprepared = lambda: api.attention(*tensors, **next(fresh))  # noqa: E731
    step(*tensors, out=out)
    rows = [_checked(case, "fagen", out, ref, lambda: host_us(lambda: step(*tensors)), note="out allocated"),
            _checked(case, "fagen_out", out, ref, lambda: host_us(lambda: step(*tensors, out=out)), note="out given"),
            _checked(case, "fagen_attention", unprepared(), ref, lambda: host_us(unprepared),
                     note="not prepared, fresh descale tensors a call")]
    us = host_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=group > 1))
    return rows + [_row(case, "sdpa", us, note="the bfloat16 cache")]


def _host_varlen(case: ServingCase, qp, kp, vp, rng) -> list[ServingRow]:
    """Host time of a varlen batch of B x Nq tokens in mixed lengths: prepared (fagen.prepare_varlen),
    and attention_varlen(validate=False), whose kept class takes calls of new lengths (the same
    total) in turn; SDPA's call on the padded batch of as many tokens (qp, kp, vp)."""
    import torch
    import torch.nn.functional as F

    q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]).contiguous() for x in (qp, kp, vp))
    batches = []
    for _ in range(8):
        lengths = varlen_lengths(case, rng)
        cu = torch.as_tensor(np.cumsum([0, *lengths]), dtype=torch.int32, device="cuda")
        batches.append((cu, lengths))
    longest = max(max(lengths) for _, lengths in batches)
    cu, lengths = batches[0]
    ref = np.concatenate([_sdpa_reference(*(x[a:e].transpose(0, 1)[None] for x in (q, k, v)), case.causal)[0]
                          .transpose(1, 0, 2) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    step = api.prepare_varlen(q, k, v, cu, cu, longest, longest, causal=case.causal)
    out = torch.full_like(q, float("nan"))
    step(q, k, v, cu, cu, out=out)
    # a loop's tensors move: three copies in turn, so every call re-encodes q's, k's and v's TMA maps
    copies = itertools.cycle([(q, k, v)] + [tuple(x.clone() for x in (q, k, v)) for _ in range(2)])
    rows = [_checked(case, "fagen", out, ref, lambda: host_us(lambda: step(q, k, v, cu, cu)), note="out allocated"),
            _checked(case, "fagen_out", out, ref, lambda: host_us(lambda: step(q, k, v, cu, cu, out=out)),
                     note="out given"),
            _checked(case, "fagen_moved", out, ref, lambda: host_us(lambda: step(*next(copies), cu, cu, out=out)),
                     note="out given, new q, k, v a call (three in turn)")]
    turn = itertools.cycle(batches)

    def unprepared(cu=None):
        cu = next(turn)[0] if cu is None else cu
        return sequences.attention_varlen(q, k, v, cu, cu, longest, longest, causal=case.causal, validate=False)
    rows.append(_checked(case, "fagen_attention", unprepared(cu), ref, lambda: host_us(unprepared),
                         note="not prepared, validate=False, new lengths a call"))
    us = host_us(lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=case.causal, enable_gqa=True))
    rows.append(_row(case, "sdpa", us, note="the padded batch of as many tokens"))
    return rows


def paged_cache(k, v, page_size: int, rng):
    """k, v [B, Hkv, N, d] copied into a cache of shuffled pages [B * N / page_size, page_size, Hkv, d] and
    its page table (N a multiple of page_size)."""
    import torch

    b, h, n, d = k.shape
    pages = n // page_size
    table = torch.as_tensor(rng.permutation(b * pages), device=k.device)
    caches = []
    for x in (k, v):
        cache = torch.empty(b * pages, page_size, h, d, dtype=x.dtype, device=x.device)
        cache[table] = x.permute(0, 2, 1, 3).reshape(b * pages, page_size, h, d)
        caches.append(cache)
    return caches[0], caches[1], table.view(b, pages).to(torch.int32)


def run_paged(case: ServingCase, rng) -> list[ServingRow]:
    import torch

    q, k, v, out = random_inputs("torch", case.dtype, case.b, case.hq, case.hkv, case.nq, case.nk, case.head_dim)
    ref = _sdpa_reference(q, k, v)
    k_cache, v_cache, table = paged_cache(k, v, case.page_size, rng)
    lengths = torch.full((case.b,), case.nk, dtype=torch.int32, device="cuda")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")

    def paged():
        return sequences.attention_with_kvcache(q, k_cache, v_cache, lengths, table, out=out, status=status,
                                                validate=False)
    sequences.attention_with_kvcache(q, k_cache, v_cache, lengths, table, out=out)  # validated once
    rows = [_checked(case, "fagen", out, ref, lambda: graph_us(paged), tb_s=kv_bytes(case))]
    # the contiguous cache of the same keys, in a cache's own [B, N, Hkv, d] layout
    kt, vt = (x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for x in (k, v))
    step = api.prepare(q, kt, vt)
    out.fill_(float("nan"))
    step(q, kt, vt, out=out)
    rows.append(_checked(case, "fagen_contiguous", out, ref, lambda: graph_us(lambda: step(q, kt, vt, out=out)),
                         tb_s=kv_bytes(case)))
    return rows + _sdpa_rows(case, q, k, v)


def run_mixed(case: ServingCase, rng) -> list[ServingRow]:
    """Decode rows against paged caches of mixed lengths (varlen_lengths of nk: one Nq row each),
    against SDPA over the batch padded to the longest, a key-padding mask hiding the rest."""
    import torch
    import torch.nn.functional as F

    lengths = mixed_lengths(case.b, case.nk, rng)
    longest = -(-max(lengths) // case.page_size) * case.page_size
    q, k, v, out = random_inputs("torch", case.dtype, case.b, case.hq, case.hkv, case.nq, longest, case.head_dim)
    seen = torch.arange(longest, device="cuda")[None, :] < torch.as_tensor(lengths, device="cuda")[:, None]
    mask = seen[:, None, None, :]  # [B, 1, 1, keys]: True where a key is in its sequence
    gqa = case.hq != case.hkv
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                         enable_gqa=gqa).cpu().numpy()
    k_cache, v_cache, table = paged_cache(k, v, case.page_size, rng)
    seqlens = torch.as_tensor(lengths, dtype=torch.int32, device="cuda")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    sequences.attention_with_kvcache(q, k_cache, v_cache, seqlens, table, out=out)  # validated once
    read = 2.0 * case.hkv * case.head_dim * 2 * sum(lengths)  # the keys the sequences have
    rows = [_checked(case, "fagen", out, ref, lambda: graph_us(lambda: sequences.attention_with_kvcache(
        q, k_cache, v_cache, seqlens, table, out=out, status=status, validate=False)), tb_s=read,
        note=f"lengths {min(lengths)}-{max(lengths)}")]
    us = graph_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa))
    return rows + [_row(case, "sdpa", us, tb_s=read / us / 1e6)]  # padded to the longest, a key mask


def mixed_lengths(b: int, n: int, rng) -> list[int]:
    """b lengths between a quarter and 1.75x n, summing to b * n."""
    lengths = rng.integers(n // 4, 2 * n - n // 4, b)
    lengths = (lengths * (b * n) / lengths.sum()).astype(int)
    lengths[-1] += b * n - lengths.sum()
    return [int(x) for x in lengths]


def varlen_lengths(case: ServingCase, rng) -> list[int]:
    """case.b lengths summing to case.b * case.nq: equal, or mixed (mixed_lengths)."""
    return mixed_lengths(case.b, case.nq, rng) if case.mixed else [case.nq] * case.b


def run_varlen(case: ServingCase, rng) -> list[ServingRow]:
    import torch

    lengths = varlen_lengths(case, rng)
    total = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 31)))
    dtype = getattr(torch, case.dtype)
    q = torch.randn(total, case.hq, case.head_dim, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(total, case.hkv, case.head_dim, generator=gen, device="cuda").to(dtype) for _ in range(2))
    cu = torch.as_tensor(np.cumsum([0, *lengths]), dtype=torch.int32, device="cuda")
    ref = np.concatenate([_sdpa_reference(*(x[a:e].transpose(0, 1)[None] for x in (q, k, v)), case.causal)[0]
                          .transpose(1, 0, 2) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    out = torch.full_like(q, float("nan"))
    longest = max(lengths)
    sequences.attention_varlen(q, k, v, cu, cu, longest, longest, causal=case.causal, out=out)
    # the padded batch of the same number of tokens, equal lengths: the kernel varlen is measured
    # against, its replays taken in turns with varlen's
    n = total // case.b
    qp, kp, vp, _ = random_inputs("torch", case.dtype, case.b, case.hq, case.hkv, n, n, case.head_dim)
    padded = lambda: api.attention(qp, kp, vp, causal=case.causal)  # noqa: E731
    times: dict[str, float] = {}

    def varlen_us() -> float:
        times["varlen"], times["padded"] = interleaved_us(lambda: sequences.attention_varlen(
            q, k, v, cu, cu, longest, longest, causal=case.causal, out=out, validate=False), padded)
        return times["varlen"]

    rows = [_checked(case, "fagen", out, ref, varlen_us, tflops=prefill_flops(lengths, case))]
    us = times.get("padded") or graph_us(padded)
    rows.append(_row(case, "fagen_padded", us, tflops=prefill_flops([n] * case.b, case) / us / 1e6))
    return rows


def run(case_list: list[ServingCase], progress=None) -> list[ServingRow]:
    """Every case's rows; a case that raises is reported as a row with the error, not fatal."""
    rng = np.random.default_rng(0)
    rows: list[ServingRow] = []
    for case in case_list:
        try:
            if case.section == "decode":
                rows += run_decode(case)
            elif case.section == "paged":
                rows += run_paged(case, rng)
            elif case.section == "host":
                rows += run_host(case, rng)
            elif case.section == "mixed":
                rows += run_mixed(case, rng)
            else:
                rows += run_varlen(case, rng)
        except Exception as err:  # noqa: BLE001 - one case's failure is a row, the sweep goes on
            traceback.print_exc(file=sys.stderr)
            rows.append(_row(case, "fagen", None, note=f"ERROR {type(err).__name__}: {str(err)[:120]}"))
        if progress:
            progress(case)
    return rows


def write_data(rows: list[ServingRow], meta: dict, out: Path) -> list[Path]:
    bench_rows.write_json(rows, out / JSON, meta)
    bench_rows.write_csv(rows, out / CSV, ServingRow)
    return [out / JSON, out / CSV]


def read_json(path: Path, fix: str = FIX) -> tuple[list[ServingRow], dict]:
    return bench_rows.read_json(path, ServingRow, fix)


def _us(r: ServingRow | None) -> str:
    return "n/a" if r is None or r.us is None else f"{r.us:.1f}"


def _tb(r: ServingRow | None) -> str:
    return "n/a" if r is None or r.tb_s is None else f"{r.tb_s:.2f}"


def _times(a: ServingRow | None, b: ServingRow | None) -> str:
    """How many times faster a is than b (b's time / a's time)."""
    if a is None or b is None or a.us is None or b.us is None:
        return "n/a"
    return f"{b.us / a.us:.2f}x"


def _shape(r: ServingRow) -> str:
    return f"{r.dtype} d{r.head_dim}, {r.hq}/{r.hkv}, B {r.b}"


def _section(table: dict, section: str):
    """(case key, its rows by impl, fagen's row) for the cases of one section with a fagen row."""
    for case, impls in table.items():
        f = impls.get("fagen")
        if f is not None and f.section == section:
            yield case, impls, f


def markdown(rows: list[ServingRow], meta: dict, plot_link: str | None = None) -> list[str]:
    """BENCHMARKS.md's serving section, as lines: decode, paged and varlen tables, the plot."""
    table = bench_rows.by_case(rows)
    out = ["## Serving: decode, paged KV, varlen", "",
           "Generated by `fagen bench --serving` or the full `fagen bench` (do not edit; rerun it). GPU time a call "
           f"from CUDA graphs ({REPS} calls a graph, median of {REPLAYS} replays), so host time is not in it. **TB/s = "
           "K and V bytes / time** (2·B·Hkv·Nk·d·2); prefill **TFLOP/s = 4·Hq·d·Σn² / time**, halved for causal. "
           "Each fagen output was checked at the timed shape against float32 SDPA (varlen: per sequence) before "
           "it was timed. SDPA is PyTorch's default choice (cuDNN here), SDPA FA2 its FlashAttention-2 backend.", ""]
    out += [f"- {k}: {v}" for k, v in sorted(meta.items())] + [""]
    out += ["### Decode", "", "| shape | Nq | Nk | fagen µs | TB/s | SDPA µs | TB/s | SDPA FA2 µs | fagen vs SDPA |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for case, impls, f in _section(table, "decode"):
        s, fa = impls.get("sdpa"), impls.get("sdpa_flash")
        out.append(f"| {_shape(f)} | {f.nq} | {f.nk // 1024}k | {_us(f)} | {_tb(f)} | {_us(s)} | {_tb(s)} | {_us(fa)} "
                   f"| {_times(f, s)} |")
    out += ["", "### Paged KV cache (Nq 1, shuffled pages)", "",
            "| shape | Nk | page | paged µs | TB/s | contiguous µs | paged / contiguous time | SDPA µs |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for case, impls, f in _section(table, "paged"):
        c, s = impls.get("fagen_contiguous"), impls.get("sdpa")
        ratio = "n/a" if c is None or c.us is None or f.us is None else f"{f.us / c.us:.2f}"
        page = case.rsplit("page ", 1)[-1]
        out.append(f"| {_shape(f)} | {f.nk // 1024}k | {page} | {_us(f)} | {_tb(f)} | {_us(c)} | {ratio} | {_us(s)} |")
    out += ["", "### Paged decode, mixed lengths (Nq 1; each sequence between a quarter and 1.75x Nk keys; TB/s of the "
            "keys the sequences have; SDPA: the batch padded to the longest, a key-padding mask)", "",
            "| shape | Nk | lengths | paged µs | TB/s | SDPA µs | fagen vs SDPA |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for case, impls, f in _section(table, "mixed"):
        s = impls.get("sdpa")
        lengths = f.note.split("lengths ", 1)[-1].split(",")[0] if "lengths " in f.note else "n/a"
        out.append(f"| {_shape(f)} | {f.nk // 1024}k | {lengths} | {_us(f)} | {_tb(f)} | {_us(s)} | {_times(f, s)} |")
    out += ["", "### Varlen prefill (TFLOP/s of real tokens; the padded batch: the same tokens, equal lengths; "
            "the two graphs' replays taken in turns)", "",
            "| shape | causal | lengths | varlen TFLOP/s | padded TFLOP/s | varlen / padded |",
            "| --- | --- | --- | --- | --- | --- |"]
    for case, impls, f in _section(table, "varlen"):
        p = impls.get("fagen_padded")
        tf = "n/a" if f.tflops is None else f"{f.tflops:.0f}"
        ptf = "n/a" if p is None or p.tflops is None else f"{p.tflops:.0f}"
        ratio = "n/a" if f.tflops is None or p is None or p.tflops is None else f"{f.tflops / p.tflops:.2f}"
        lengths = ("mixed, " if case.endswith("mixed") else "") + f"{f.b} × {f.nq}"
        out.append(f"| {_shape(f)} | {'yes' if 'causal' in case else 'no'} | {lengths} | {tf} | {ptf} | {ratio} |")
    # the growing-cache columns where the run timed them (a new key length and strides every call)
    growing = ((" not prepared, keys grow a call | ... with key ranges | SDPA, keys grow |", " --- | --- | --- |")
               if any(r.impl == "fagen_attention_growing" for r in rows) else ("", ""))
    out += ["", f"### Host time a call (µs: enqueue time of {HOST_CALLS} calls, median of {HOST_BATCHES} batches; "
            "the GPU's time is not in it)", "",
            "| call | shape | prepared, out allocated | out given | ... new tensors a call | not prepared | SDPA |"
            + growing[0], "| --- | --- | --- | --- | --- | --- | --- |" + growing[1]]
    for case, impls, f in _section(table, "host"):
        fp8 = (" on an e4m3 cache" if case.endswith("fp8 cache") else ", e4m3 q, k, v" if case.endswith("fp8 qkv")
               else "")
        call = (f"paged decode step{fp8} (prepare_with_kvcache; unprepared: validate=False)" if "page" in case else
                f"decode step{fp8} (descales a sequence and KV head; unprepared: fresh ones a call)" if fp8 else
                "varlen prefill, mixed lengths (prepare_varlen; unprepared: validate=False)" if "varlen" in case else
                "decode step (the last split merges)" if f.nq * (f.hq // f.hkv) <= 64 else "one launch")
        shape = f"{_shape(f)}, Nq {f.nq}, Nk {f.nk}{', causal' if 'causal' in case else ''}"
        out.append(f"| {call} | {shape} | {_us(f)} | {_us(impls.get('fagen_out'))} | {_us(impls.get('fagen_moved'))} | "
                   f"{_us(impls.get('fagen_attention'))} | {_us(impls.get('sdpa'))} |"
                   + (f" {_us(impls.get('fagen_attention_growing'))} | "
                      f"{_us(impls.get('fagen_attention_ranged_growing'))} | {_us(impls.get('sdpa_growing'))} |"
                      if growing[0] else ""))
    notes = [r for r in rows if r.note and not r.note.startswith("err")]
    if notes:
        out += ["", "Notes:"] + [f"- {r.case} ({r.impl}): {r.note}" for r in notes]
    if plot_link:
        out += ["", f"![serving]({plot_link})"]
    return out + [""]


def summary_lines(rows: list[ServingRow]) -> list[str]:
    return [f"{r.case:52} {r.impl:17} {_us(r):>8} us  {_tb(r):>5} TB/s  {r.note}".rstrip()
            for r in rows if r.impl in ("fagen", "fagen_out", "fagen_contiguous")]


def plot(rows: list[ServingRow], path: Path) -> None:
    """Two panels: decode TB/s (fagen, SDPA, SDPA FA2) per case, and paged against contiguous."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = bench_rows.by_case(rows)
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), squeeze=False)
    for ax, section, impls in ((axes[0][0], "decode", ("fagen", "sdpa", "sdpa_flash")),
                               (axes[0][1], "paged", ("fagen", "fagen_contiguous", "sdpa"))):
        cases = [c for c, r in table.items() if any(x.section == section for x in r.values())]
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = [(table[c].get(impl).tb_s or 0.0) if table[c].get(impl) else 0.0 for c in cases]
            ax.bar(np.arange(len(cases)) + i * width, vals, width, label=impl)
        ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2)
        ax.set_xticklabels([c.split(" ", 1)[1].replace("float16 ", "").replace("bfloat16", "bf16") for c in cases],
                           rotation=30, ha="right", fontsize=6)
        ax.set_ylabel("K+V TB/s")
        ax.set_title(section, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
