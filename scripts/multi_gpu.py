"""Every multi-GPU mode against the oracle (awkward lengths), on fagen's NCCL group and on a
torch.distributed process group; with --time, the scaling table (causal, d = 128, B = 1,
H = 16, float16) against the best one-GPU kernel in the same run.

Run: fagen launch -n 2 scripts/multi_gpu.py [--time 32768 131072]     (or torchrun)
Each line of the table is printed by rank 0 as JSON after `TIMING `.
"""

import argparse
import json
import time

import cupy
import numpy as np
import torch
import torch.distributed as tdist

from fagen import distributed as dist
from fagen import ring_link
from fagen import oracle
from fagen.check import LSE_TOLERANCE, OUT_TOLERANCE, relative_error, to_numpy

parser = argparse.ArgumentParser()
parser.add_argument("--time", type=int, nargs="*", default=[], help="sequence lengths to time")
parser.add_argument("--iters", type=int, default=10)
parser.add_argument("--rounds", type=int, default=3, help="every arm timed in turn this many times; medians")
parser.add_argument("--backward", action="store_true", help="check and time the gradients through the ring too")
args = parser.parse_args()

ours = dist.init()
rank, world = ours.rank, ours.world
torch.cuda.set_device(ours.device)
options = tdist.ProcessGroupNCCL.Options()
options.is_high_priority_stream = True  # the ring's transfers take free SMs ahead of the compute's blocks
tdist.init_process_group("nccl", device_id=torch.device("cuda", ours.device), pg_options=options)


def log(*a):
    if rank == 0:
        print(*a, flush=True)


def same_inputs(framework, dtype, b, hq, hkv, n, d, seed):
    """q, k, v identical on every rank (the seed is shared)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn((b, h, n, d), generator=gen, device="cuda").to(getattr(torch, dtype)) for h in (hq, hkv, hkv)]
    return xs if framework == "torch" else [cupy.asarray(x) for x in xs]


def check(name, out, ref, dtype):
    err = relative_error(to_numpy(out).astype(np.float32), ref)
    ok = err < OUT_TOLERANCE[dtype]
    log(f"{name:52} world={world} rel err {err:.2e} {'PASS' if ok else 'FAIL'}")
    assert ok, name


seed_arr = cupy.asarray([int(np.random.default_rng().integers(1 << 30))], cupy.int32)
ours.all_reduce(seed_arr, "max")  # every rank draws the same inputs
seed = int(seed_arr.get()[0])
# bfloat16 at d64: its causal and full masks train on different tilings of their own, so the
# ring's full steps take the causal block's (variants.trainable_alike)
cases = [("fagen", "cupy", "float16", 4, 4, 128), ("torch", "torch", "bfloat16", 4, 2, 64)]
for group_name, framework, dtype, hq, hkv, d in cases:
    group = ours if group_name == "fagen" else None  # None: torch.distributed's default group
    tag = f"[{group_name} group, {framework} {dtype} d{d}, Hq/Hkv {hq}/{hkv}]"
    for n in (1000, 777):
        q, k, v = same_inputs(framework, dtype, 2, hq, hkv, n, d, seed + n)
        qn, kn, vn = (to_numpy(x).astype(np.float64) for x in (q, k, v))
        ref_causal, ref_dense = oracle.attention(qn, kn, vn, causal=True), oracle.attention(qn, kn, vn)
        check(f"1 batch sharded N={n} {tag}", dist.batch_sharded(group, q, k, v), ref_dense, dtype)
        sinks = np.linspace(-1, 2, hq).astype(np.float32)
        check(f"2 sequence sharded causal+sinks N={n} {tag}",
              dist.sequence_sharded(group, q, dist.sharded_inputs(k, n, world, rank, "sequence"),
                                    dist.sharded_inputs(v, n, world, rank, "sequence"), n_kv=n, causal=True,
                                    sinks=sinks),
              oracle.attention(qn, kn, vn, causal=True, sinks=sinks), dtype)
        qz, kz, vz = (dist.sharded_inputs(x, n, world, rank, "zigzag") for x in (q, k, v))
        local = dist.zigzag_attention(group, qz, k, v, n=n)
        check(f"3 zigzag causal N={n} {tag}", dist.gather_sequence(group, local, n=n), ref_causal, dtype)
        local, lse = dist.zigzag_attention(group, qz[:1], k[:1], v[:1], n=n, return_lse=True)  # B 1: one launch
        check(f"3 zigzag causal B=1 N={n} {tag}", dist.gather_sequence(group, local, n=n), ref_causal[:1], dtype)
        ref_lse = oracle.attention(qn[:1], kn[:1], vn[:1], causal=True, return_lse=True)[1]
        err = relative_error(to_numpy(dist.gather_sequence(group, lse[..., None], n=n)[..., 0]), ref_lse)
        log(f"{'3 zigzag LSE B=1 N=' + str(n) + ' ' + tag:52} world={world} rel err {err:.2e} "
            f"{'PASS' if err < LSE_TOLERANCE else 'FAIL'}")
        assert err < LSE_TOLERANCE, "zigzag LSE"
        for causal, ref, transport in ((True, ref_causal, "auto"), (False, ref_dense, "auto"),
                                       (True, ref_causal, "nccl")):
            local = dist.ring_attention(group, qz, kz, vz, n=n, causal=causal, transport=transport)
            check(f"4 ring attention {'causal' if causal else 'full'} ({transport}) N={n} {tag}",
                  dist.gather_sequence(group, local, n=n), ref, dtype)
        if args.backward and n == 1000:  # gradients: every rank's rows gathered, against the float64 oracle
            dout = same_inputs(framework, dtype, 2, hq, hq, n, d, seed + 1)[0]
            doz = dist.sharded_inputs(dout, n, world, rank, "zigzag")
            want = oracle.attention_backward(qn, kn, vn, to_numpy(dout).astype(np.float64), causal=True)
            for transport in ("auto", "nccl"):
                out, lse = dist.ring_attention(group, qz, kz, vz, n=n, return_lse=True, transport=transport)
                for _ in range(2):  # twice: the copy-engine link's flags carry on from call to call
                    grads = dist.ring_attention_backward(group, doz, qz, kz, vz, out, lse, n=n, transport=transport)
                for name, g in zip(("dq", "dk", "dv"), grads):
                    check(f"4 ring backward {name} ({transport}) N={n} {tag}", dist.gather_sequence(group, g, n=n),
                          want[name], dtype)
            out, lse = dist.zigzag_attention(group, qz, k, v, n=n, return_lse=True)
            dq, dk, dv = dist.zigzag_attention_backward(group, doz, qz, k, v, out, lse, n=n)
            for name, g in (("dq", dist.gather_sequence(group, dq, n=n)), ("dk", dk), ("dv", dv)):
                check(f"3 zigzag backward {name} N={n} {tag}", g, want[name], dtype)


if world > 1:  # which link the rings took (the copy engines wherever the GPUs are peers)
    log(f"LINK {'copy_engine' if ring_link.peer_bytes() else 'nccl'} world={world}")


def time_ms(fn, iters):
    """Mean ms a call over `iters` back-to-back calls on this rank's stream (no barrier between
    them), the slowest rank's; a barrier only before the first."""
    fn()
    torch.cuda.synchronize()
    tdist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / iters], device="cuda")
    tdist.all_reduce(ms, op=tdist.ReduceOp.MAX)
    return float(ms)


def rounds_ms(arms: dict, iters: int, rounds: int) -> dict:
    """Every arm timed in turn, `rounds` times over (a one-GPU kernel and the multi-GPU modes
    meet the same clocks and neighbours); each arm's median round, and the rounds. The ranks
    meet before each arm, as a training step's collectives line them up (without it, rounds of
    the 32k ring forward+backward read 16-18 ms among rounds of 9-10, on both links)."""
    seen = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            torch.cuda.synchronize()
            tdist.barrier()
            seen[name].append(round(time_ms(fn, iters), 3))
    return {name: (float(np.median(ms)), ms) for name, ms in seen.items()}


def host_ms(fn, iters):
    """What the host spends enqueueing a call (GPU idle first)."""
    torch.cuda.synchronize()
    tdist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    spent = (time.perf_counter() - start) * 1e3 / iters
    torch.cuda.synchronize()
    return round(spent, 3)


torch_group = dist.as_group(None)
for n in args.time:
    b, h, d = 1, 16, 128
    q, k, v = same_inputs("torch", "float16", b, h, h, n, d, seed)
    flops = 4 * b * h * n * n * d / 2  # causal: half the pairs
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fagen.dispatch import default_spec
    from fagen.runtime import compile_kernel

    kernel = compile_kernel(default_spec("float16", d, True, keys=n))  # fagen.attention's kernel for n keys
    reference = kernel(q, k, v)

    def sdpa(backend):
        def call():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return call

    singles = {"fagen": lambda: kernel(q, k, v), "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
               "fa2": sdpa(SDPBackend.FLASH_ATTENTION)}
    qz, kz, vz = (dist.sharded_inputs(x, n, world, rank, "zigzag") for x in (q, k, v))
    modes = {"zigzag": lambda: dist.zigzag_attention(None, qz, k, v, n=n),
             "ring": lambda: dist.ring_attention(None, qz, kz, vz, n=n),
             "ring (fagen group)": lambda: dist.ring_attention(ours, qz, kz, vz, n=n),
             "ring (nccl link)": lambda: dist.ring_attention(None, qz, kz, vz, n=n, transport="nccl")}
    ref_rows = dist.sharded_inputs(reference, n, world, rank, "zigzag")
    for name, fn in modes.items():  # checked before timed
        err = relative_error(to_numpy(fn()).astype(np.float32), to_numpy(ref_rows).astype(np.float32))
        assert err < OUT_TOLERANCE["float16"], (name, err)
    timed = rounds_ms(singles | modes, args.iters, args.rounds)
    single = {name: timed[name][0] for name in singles}
    best = min(single.values())
    row = {"n": n, "world": world, "rounds": args.rounds, "single_ms": single,
           "best_single": min(single, key=single.get)}
    for name, fn in modes.items():
        ms, each = timed[name]
        row[name] = {"ms": round(ms, 3), "speedup": round(best / ms, 3), "tflops": round(flops / ms / 1e9, 1),
                     "host_ms": host_ms(fn, args.iters), "rounds_ms": each}
    # the copy-engine link's slots live outside torch's allocator (the torch group's, of every
    # length this run has used: an upper bound)
    row["peak_gib"] = round((torch.cuda.max_memory_allocated() + ring_link.peer_bytes(torch_group)) / 2**30, 2)
    log("TIMING " + json.dumps(row))
    if args.backward:  # forward + backward: 2.5x the forward's FLOPs on top of it
        from fagen.backward import compile_backward
        from fagen.variants import trainable

        dout = torch.randn_like(q)
        grads = compile_backward(trainable(default_spec("float16", d, True)))
        qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))

        def cudnn_step():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).backward(dout)

        doz = dist.sharded_inputs(dout, n, world, rank, "zigzag")
        torch.cuda.reset_peak_memory_stats()

        def ring_step(transport="auto"):
            out, lse = dist.ring_attention(None, qz, kz, vz, n=n, return_lse=True, transport=transport)
            return dist.ring_attention_backward(None, doz, qz, kz, vz, out, lse, n=n, transport=transport)

        def zigzag_step():  # on the torch group, as the ring's (run23's rows ran it on fagen's group)
            out, lse = dist.zigzag_attention(None, qz, k, v, n=n, return_lse=True)
            return dist.zigzag_attention_backward(None, doz, qz, k, v, out, lse, n=n)

        ring_step()
        peak = round((torch.cuda.max_memory_allocated() + ring_link.peer_bytes(torch_group)) / 2**30, 2)
        singles = {"fagen": lambda: grads(dout, q, k, v, *kernel(q, k, v, return_lse=True)), "cudnn": cudnn_step}
        modes = {"ring": ring_step, "ring (nccl link)": lambda: ring_step("nccl"), "zigzag": zigzag_step}
        timed = rounds_ms(singles | modes, args.iters, args.rounds)
        single = {name: timed[name][0] for name in singles}
        best = min(single.values())
        row = {"n": n, "world": world, "rounds": args.rounds, "forward+backward single_ms": single,
               "ring peak_gib": peak}
        for name in modes:
            ms, each = timed[name]
            row[name] = {"ms": round(ms, 3), "speedup": round(best / ms, 3),
                         "tflops": round(3.5 * flops / ms / 1e9, 1), "rounds_ms": each}
        log("TIMING_BWD " + json.dumps(row))

tdist.destroy_process_group()
