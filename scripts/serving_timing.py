"""Serving layouts against the padded kernels, GPU time per call from CUDA graphs (median of 9
replays of 10 calls: host time excluded, which decode-sized calls would otherwise measure).

paged:  decode (Nq 1) through a paged cache of shuffled pages, page sizes 16, 64, 256, against
        fagen.attention on a contiguous [B, N, H, d] cache (a cache's layout) and SDPA; K+V
        bytes / time as TB/s. Each paged output is diffed against the contiguous one first.
varlen: prefill through cu_seqlens against the padded batch of the same tokens (TF/s of real
        FLOPs: 4 N^2 d H a sequence, halved under causal); uniform lengths (the padded batch's
        exact work, diffed against it) and mixed lengths of the same total.

    python scripts/serving_timing.py [paged] [varlen]
"""
import sys

import numpy as np
import torch

import fagen
from fagen.check import random_inputs

def graph_us(fn, reps=10):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    ts = []
    for _ in range(9):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); e.record(); e.synchronize(); ts.append(a.elapsed_time(e) * 1e3 / reps)
    return float(np.median(ts))

def paged_of(k, page_size, rng):
    b, h, n, d = k.shape
    pages = n // page_size
    perm = torch.as_tensor(rng.permutation(b * pages), device="cuda")
    cache = torch.empty(b * pages, page_size, h, d, dtype=k.dtype, device="cuda")
    src = k.permute(0, 2, 1, 3).reshape(b * pages, page_size, h, d)
    cache[perm] = src
    table = perm.view(b, pages).to(torch.int32)
    return cache, table

which = sys.argv[1:] or ["paged", "varlen"]
rng = np.random.default_rng(0)
if "paged" in which:
    print("paged decode vs contiguous (fp16, Hq 32 / Hkv 8, d 128, Nq 1), GPU us per call:")
    print(f"{'B':>3} {'Nk':>7} {'page':>5} {'contig':>8} {'paged':>8} {'ratio':>6} {'TB/s paged':>10} {'sdpa':>8}")
    for b, nk in [(1, 32768), (1, 131072), (8, 8192), (8, 32768), (32, 4096), (64, 2048)]:
        for dtype, d in [("float16", 128)] + ([("bfloat16", 64)] if b in (1, 8) and nk == 32768 else []):
            q, k, v, _ = random_inputs("torch", dtype, b, 32, 8, 1, nk, d)
            contig = graph_us(lambda: fagen.attention(q, k, v))
            kt = k.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # [B, N, H, d] memory, as a cache is
            vt = v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
            contig_bnhd = graph_us(lambda: fagen.attention(q, kt, vt))
            print(f"    contiguous [B, H, N, d] {contig:.1f} us, [B, N, H, d] {contig_bnhd:.1f} us")
            contig = contig_bnhd
            sd = graph_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
            for ps in (16, 64, 256):
                kc, table = paged_of(k, ps, rng)
                vc = torch.empty_like(kc)  # V's pages at K's ids: one table
                vc[table.flatten().long()] = v.permute(0, 2, 1, 3).reshape(-1, ps, 8, d)
                lens = torch.full((b,), nk, dtype=torch.int32, device="cuda")
                out = fagen.attention_with_kvcache(q, kc, vc, lens, table)
                ref = fagen.attention(q, k, v)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < (1e-3 if dtype == "float16" else 8e-3), err  # the two kernels round apart
                st = torch.zeros(1, dtype=torch.int32, device="cuda")
                pg = graph_us(lambda: fagen.attention_with_kvcache(q, kc, vc, lens, table, validate=False, status=st))
                tb = 2 * b * 8 * nk * d * 2 / pg / 1e6
                print(f"{b:3d} {nk:7d} {ps:5d} {contig:8.1f} {pg:8.1f} {pg / contig:6.2f} {tb:10.2f} {sd:8.1f}  {dtype} d{d} err {err:.1e}")
if "varlen" in which:
    print("varlen prefill vs padded batch (causal, Hq 32 / Hkv 8 and MHA 16/16, TF/s of real FLOPs):")
    for dtype, d, hq, hkv in [("float16", 128, 32, 8), ("bfloat16", 64, 16, 16), ("float16", 128, 16, 16)]:
        for causal in (True, False):
            for b, n in [(8, 2048), (4, 4096), (16, 1024)]:
                q, k, v, _ = random_inputs("torch", dtype, b, hq, hkv, n, n, d)
                pad = graph_us(lambda: fagen.attention(q, k, v, causal=causal), reps=3)
                flops = 4 * b * hq * n * n * d / (2 if causal else 1)
                # the same tokens token-major, uniform lengths: exactly the padded work
                qt = q.permute(0, 2, 1, 3).reshape(b * n, hq, d).contiguous()
                kt = k.permute(0, 2, 1, 3).reshape(b * n, hkv, d).contiguous()
                vt = v.permute(0, 2, 1, 3).reshape(b * n, hkv, d).contiguous()
                cu = torch.arange(0, b * n + 1, n, dtype=torch.int32, device="cuda")
                same = fagen.attention_varlen(qt, kt, vt, cu, cu, n, n, causal=causal).view(b, n, hq, d).permute(0, 2, 1, 3)
                ref = fagen.attention(q, k, v, causal=causal)
                assert ((same.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-3
                vl = graph_us(lambda: fagen.attention_varlen(qt, kt, vt, cu, cu, n, n, causal=causal, validate=False), reps=3)
                # mixed lengths, same total tokens
                lens = rng.integers(n // 4, 2 * n - n // 4, b); lens = (lens * (b * n) / lens.sum()).astype(int); lens[-1] += b * n - lens.sum()
                cum = torch.as_tensor(np.cumsum([0, *lens]), dtype=torch.int32, device="cuda")
                mf = sum(4 * hq * int(x) * int(x) * d / (2 if causal else 1) for x in lens)
                vm = graph_us(lambda: fagen.attention_varlen(qt, kt, vt, cum, cum, int(lens.max()), int(lens.max()), causal=causal, validate=False), reps=3)
                print(f"{dtype} d{d} {hq}/{hkv} causal={causal!s:5} B={b:2d} N={n:5d}: padded {flops / pad / 1e6:6.1f} TF/s "
                      f"varlen uniform {flops / vl / 1e6:6.1f} ({vl / pad:5.2f}x time) mixed {mf / vm / 1e6:6.1f} TF/s ({lens.min()}..{lens.max()})")
