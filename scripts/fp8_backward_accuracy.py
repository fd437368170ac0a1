"""The FP8 backward's gradient error, by where it rounds (notes/fp8_backward.md's options), as the
kernel would compute it in float64 otherwise, against float64 gradients of the unrounded inputs;
beside bf16's (inputs, P and dS rounded to bf16, as fagen's bf16 backward feeds its MMAs).

Every option takes q, k, v in e4m3 with per-(batch, KV head) descales (the forward's inputs) and
dO in e4m3 with a scale per 64-row tile (the preprocess's quantisation), S and dP from those, and
P * 256 in e4m3 for dV (as the forward's P). They differ in dS, the operand of dK and dQ:
  fp8 e4m3   dS in e4m3 with a scale per (64 queries x 128 keys) tile (its amax onto 448)
  fp8 e5m2   dS in e5m2, the same scaling
  dS bf16    dS in bfloat16, Q and K exact (e4m3 values are bfloat16 values): dK, dQ at bf16 rate

    python3 scripts/fp8_backward_accuracy.py [--n 1024] [--d 128] [--heads 4]

A second table takes each rounding alone against float64 gradients of the e4m3 inputs themselves,
and the scales a kernel can pull out of its sums (`kernel's scales`: dO a head, dS for dK a
power of two a key and step, dS for dQ a tile; notes/fp8_backward.md).

No GPU: the question is which rounding the kernel can afford before it exists.
"""

from __future__ import annotations

import argparse

import numpy as np

from fagen import oracle
from fagen.element_types import ELEMENT_TYPES
from fagen.fp8_backward_rounding import BLOCK_KEYS, STEP_QUERIES, per_head, per_key_step, per_tile

E4M3, E5M2, BF16 = ELEMENT_TYPES["float8_e4m3"], ELEMENT_TYPES["float8_e5m2"], ELEMENT_TYPES["bfloat16"]
TILE_Q, TILE_K = STEP_QUERIES, BLOCK_KEYS  # a backward step's queries and a block's keys: one scale a tile of dS
P_SCALE = 2.0 ** E4M3.p_log2_scale  # P's scale before its e4m3 rounding (the forward's)


def gradients(q, k, v, dout, causal: bool, ds_round, *, p_round, dout_round, inputs_round,
              ds_round_dk=None) -> dict:
    """dq, dk, dv as a kernel computes them (float64 otherwise) from rounded inputs: P, dP, dS
    (ds_round_dk: dK's operand where it is rounded apart from dQ's)."""
    q, k, v = (inputs_round(x) for x in (q, k, v))
    do = dout_round(dout)
    forward = oracle.attention(q, k, v, causal=causal, return_lse=True)
    out, lse = forward
    scale = 1.0 / np.sqrt(q.shape[-1])
    s = (q @ k.swapaxes(-1, -2)) * scale
    if causal:
        s = np.where(oracle.causal_mask(q.shape[2], k.shape[2]), s, -np.inf)
    p = np.exp(s - lse[..., None])
    dp = do @ v.swapaxes(-1, -2)
    delta = (dout * out).sum(axis=-1, keepdims=True)  # D from the upstream dO and O (the preprocess's f32)
    ds = p * (dp - delta)
    ds_r = ds_round(ds)
    ds_k = ds_r if ds_round_dk is None else ds_round_dk(ds)
    return {"dq": scale * ds_r @ k, "dk": scale * ds_k.swapaxes(-1, -2) @ q,
            "dv": p_round(p).swapaxes(-1, -2) @ do}


def errors(q, k, v, dout, causal: bool) -> dict[str, tuple[float, float, float]]:
    """(dq, dk, dv) relative errors against float64 gradients of the unrounded inputs."""
    reference = oracle.attention_backward(q, k, v, dout, causal=causal)

    def relative(grads):
        return tuple(float(np.linalg.norm(grads[n] - reference[n]) / np.linalg.norm(reference[n]))
                     for n in ("dq", "dk", "dv"))

    fp8 = dict(p_round=lambda p: E4M3.round(p * P_SCALE) / P_SCALE,
               dout_round=lambda x: per_tile(x, E4M3, TILE_Q), inputs_round=lambda x: per_head(x, E4M3))
    return {
        "bf16": relative(gradients(q, k, v, dout, causal, BF16.round, p_round=BF16.round, dout_round=BF16.round,
                                   inputs_round=BF16.round)),
        "fp8 e4m3": relative(gradients(q, k, v, dout, causal, lambda x: per_tile(x, E4M3, TILE_Q, TILE_K), **fp8)),
        "fp8 e5m2": relative(gradients(q, k, v, dout, causal, lambda x: per_tile(x, E5M2, TILE_Q, TILE_K), **fp8)),
        "dS bf16": relative(gradients(q, k, v, dout, causal, BF16.round, **fp8)),
    }


def parts(q, k, v, dout, causal: bool) -> dict[str, tuple[float, float, float]]:
    """(dq, dk, dv) relative errors of each rounding alone and of their sums, against float64
    gradients of the e4m3 inputs themselves (what a straight-through FP8 training step means by
    the gradient): the backward's own share of the error."""
    q8, k8, v8 = (per_head(x, E4M3) for x in (q, k, v))
    reference = oracle.attention_backward(q8, k8, v8, dout, causal=causal)
    exact = lambda x: x  # noqa: E731
    p_e4m3 = lambda p: E4M3.round(p * P_SCALE) / P_SCALE  # noqa: E731
    do_e4m3 = lambda x: per_tile(x, E4M3, TILE_Q)  # noqa: E731
    cases = {  # name: (dS, P, dO)
        "dO e4m3": (exact, exact, do_e4m3),
        "P e4m3": (exact, p_e4m3, exact),
        "dS e4m3": (lambda x: per_tile(x, E4M3, TILE_Q, TILE_K), exact, exact),
        "dS e5m2": (lambda x: per_tile(x, E5M2, TILE_Q, TILE_K), exact, exact),
        "dS bf16": (BF16.round, exact, exact),
        "bf16: P, dS, dO": (BF16.round, BF16.round, BF16.round),
        "e4m3: P, dS, dO": (lambda x: per_tile(x, E4M3, TILE_Q, TILE_K), p_e4m3, do_e4m3),
        "dO e4m3 a head": (exact, exact, lambda x: per_head(x, E4M3)),
        "dS e4m3 for dK a key and step": (exact, exact, exact),
        "kernel's scales": (lambda x: per_tile(x, E4M3, TILE_Q, TILE_K), p_e4m3, lambda x: per_head(x, E4M3)),
    }
    for_dk = {"dS e4m3 for dK a key and step": lambda x: per_key_step(x, E4M3),
              "kernel's scales": lambda x: per_key_step(x, E4M3)}
    out = {}
    for name, (ds_round, p_round, dout_round) in cases.items():
        grads = gradients(q8, k8, v8, dout, causal, ds_round, p_round=p_round, dout_round=dout_round,
                          inputs_round=exact, ds_round_dk=for_dk.get(name))
        out[name] = tuple(float(np.linalg.norm(grads[n] - reference[n]) / np.linalg.norm(reference[n]))
                          for n in ("dq", "dk", "dv"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--outliers", type=int, default=4, help="channels of q and k 100x the rest")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shape = (1, args.heads, args.n, args.d)
    columns = ("bf16", "fp8 e4m3", "fp8 e5m2", "dS bf16")
    print("relative error of dq / dk / dv against float64 gradients of the unrounded inputs")
    print("| activations | mask | " + " | ".join(columns) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in columns) + " |")
    for gain in (1.0, 100.0):
        q, k, v, dout = (rng.standard_normal(shape) for _ in range(4))
        channels = rng.choice(args.d, size=args.outliers, replace=False)
        q[..., channels] *= gain
        k[..., channels] *= gain
        # scores back to unit variance: the softmax's temperature as without outliers
        norm = np.sqrt((q @ k.swapaxes(-1, -2)).var() / args.d)
        q, k = q / np.sqrt(norm), k / np.sqrt(norm)
        for causal in (False, True):
            row = errors(q, k, v, dout, causal)
            cells = " | ".join("{:.1e} / {:.1e} / {:.1e}".format(*row[c]) for c in columns)
            label = "Gaussian" if gain == 1.0 else f"{args.outliers} channels x{gain:g}"
            print(f"| {label} | {'causal' if causal else 'none'} | {cells} |", flush=True)
        if gain == 1.0:
            gaussian = (q, k, v, dout)
    print("\nthe backward's own roundings, each alone and together, against float64 gradients of the e4m3 "
          "inputs (causal, Gaussian)")
    table = parts(*gaussian, True)
    print("| rounding | dq / dk / dv |")
    print("| --- | --- |")
    for name, row in table.items():
        print(f"| {name} | " + " / ".join(f"{x:.1e}" for x in row) + " |")


if __name__ == "__main__":
    main()
