"""Every multi-GPU mode against the oracle (awkward lengths), then the causal N=32k timing.

Run: fagen launch -n 2 scripts/multi_gpu.py     (ranks simulated on one GPU: -n 1)
"""

import math

import cupy
import numpy as np

from fagen import distributed as dist
from fagen import oracle
from fagen.check import OUT_TOLERANCE, relative_error, time_ms
from fagen.runtime import compile_kernel, default_spec

group = dist.init()
rank, world = group.rank, group.world


def log(*a):
    if rank == 0:
        print(*a, flush=True)


def same_inputs(b, h, n, d, seed):
    rng = cupy.random.default_rng(seed)  # identical on every rank: the seed is shared
    return [rng.standard_normal((b, h, n, d), dtype=cupy.float32).astype(cupy.float16) for _ in range(3)]


def check(name, out, ref):
    err = relative_error(cupy.asnumpy(out).astype(np.float32), ref)
    ok = err < OUT_TOLERANCE["float16"]
    log(f"{name:34} world={world} rel err {err:.2e} {'PASS' if ok else 'FAIL'}")
    assert ok, name


seed = int(np.random.default_rng().integers(1 << 30))
seed_arr = cupy.asarray([seed], cupy.int32)
group.all_reduce(seed_arr, "max")  # every rank draws the same inputs
seed = int(seed_arr.get()[0])
for n in (1000, 777):
    q, k, v = same_inputs(2, 4, n, 128, seed + n)
    qn, kn, vn = (cupy.asnumpy(x).astype(np.float32) for x in (q, k, v))
    ref_causal = oracle.attention(qn, kn, vn, causal=True)
    ref_dense = oracle.attention(qn, kn, vn)
    check(f"1 batch sharded N={n}", dist.batch_sharded(group, q, k, v), ref_dense)
    sinks = np.linspace(-1, 2, 4).astype(np.float32)
    check(f"2 sequence sharded causal+sinks N={n}",
          dist.sequence_sharded(group, q, dist.sharded_inputs(k, n, world, rank, "sequence"),
                                dist.sharded_inputs(v, n, world, rank, "sequence"), n_kv=n, causal=True, sinks=sinks),
          oracle.attention(qn, kn, vn, causal=True, sinks=sinks))
    check(f"3 ring zigzag causal N={n}", dist.ring_zigzag_causal(group, q, k, v), ref_causal)
    mine = dist.ring_attention(group, *(dist.sharded_inputs(x, n, world, rank, "zigzag") for x in (q, k, v)), n=n)
    gathered = group.all_gather(cupy.pad(mine, ((0, 0), (0, 0), (0, 2 * math.ceil(n / (2 * world)) - mine.shape[2]), (0, 0))))
    rows = [gathered[r, :, :, : sum(e - s for s, e in dist.zigzag_rows(n, r, world))] for r in range(world)]
    flat = cupy.concatenate(rows, axis=2)
    full = cupy.empty_like(flat)
    full[:, :, cupy.asarray(dist.zigzag_order(n, world))] = flat
    check(f"4 ring attention causal N={n}", full, ref_causal)

# timing: causal N = 32k, d = 128, float16, B = 1, H = 16
n = 32768
q, k, v = same_inputs(1, 16, n, 128, seed)
single = compile_kernel(default_spec("float16", 128, True))
reference = single(q, k, v)
qz, kz, vz = (dist.sharded_inputs(x, n, world, rank, "zigzag") for x in (q, k, v))
for name, fn in (("3 ring zigzag causal", lambda: dist.ring_zigzag_causal(group, q, k, v)),
                 ("4 ring attention", lambda: dist.ring_attention(group, qz, kz, vz, n=n))):
    out = fn()
    if name.startswith("3"):
        err = relative_error(cupy.asnumpy(out).astype(np.float32), cupy.asnumpy(reference).astype(np.float32))
        log(f"{name} N=32k vs one-GPU kernel: rel err {err:.2e}")
    group.barrier()
    ms = time_ms(lambda: (fn(), group.barrier()), warmup=3, iters=10)
    log(f"{name:24} N=32k world={world}: {ms:8.2f} ms")
ms1 = time_ms(lambda: single(q, k, v), warmup=3, iters=10)
log(f"{'one GPU kernel':24} N=32k: {ms1:8.2f} ms")
