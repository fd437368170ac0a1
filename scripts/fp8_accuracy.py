"""FP8 attention's error as the float64 oracle models the kernel's steps (e4m3 q, k, v with
per-(batch, KV head) descales, FlashAttention-3's convention; P rounded to e4m3 after a scale of
256), against float64 attention of the unrounded inputs, beside bf16's (inputs and P rounded to
bf16). Activations: Gaussian, and Gaussian with a few channels of q and k 100x the rest (the
outlier channels of LLM queries and keys); each also with q and k rotated by a normalised
Hadamard matrix before quantising (incoherent processing: qH (kH)^T = q k^T, so the exact
attention is unchanged while the outliers spread over every channel).

    python3 scripts/fp8_accuracy.py [--n 1024] [--d 128] [--heads 4] [--outliers 4]

No GPU: the question is what the formats and the rotation cost before a kernel exists; the
kernel's own error is measured against the same oracle on the GPU.
"""

from __future__ import annotations

import argparse

import numpy as np

from fagen import oracle
from fagen.element_types import ELEMENT_TYPES

E4M3, BF16 = ELEMENT_TYPES["float8_e4m3"], ELEMENT_TYPES["bfloat16"]


def hadamard(d: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of order d (a power of two), divided by sqrt(d): orthogonal."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def quantised(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [B, H, N, d] as e4m3 values and its descale [B, H] (amax / 448 a head: the largest
    element lands on e4m3's largest)."""
    descale = np.abs(x).max(axis=(2, 3)) / E4M3.max_finite
    return E4M3.round(x / descale[:, :, None, None]), descale


def errors(q, k, v, causal: bool) -> dict[str, float]:
    """Relative errors against float64: bf16's, fp8's, and fp8's by source (P alone rounded, q and
    k alone, q and k rotated then alone, v alone)."""
    reference = oracle.attention(q, k, v, causal=causal)

    def relative(out):
        return float(np.linalg.norm(out - reference) / np.linalg.norm(reference))

    rotation = hadamard(q.shape[-1])
    (q8, qs), (k8, ks), (v8, vs) = (quantised(x) for x in (q, k, v))
    (qr, qrs), (kr, krs) = quantised(q @ rotation), quantised(k @ rotation)
    p8 = dict(p_type="float8_e4m3", p_scale=256.0)
    return {
        "bf16": relative(oracle.attention(*(BF16.round(x) for x in (q, k, v)), causal=causal, p_type="bfloat16")),
        "fp8": relative(oracle.attention(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs, **p8)),
        "fp8 rotated": relative(oracle.attention(qr, kr, v8, causal=causal, q_descale=qrs, k_descale=krs,
                                                 v_descale=vs, **p8)),
        "P": relative(oracle.attention(q, k, v, causal=causal, **p8)),
        "q, k": relative(oracle.attention(q8, k8, v, causal=causal, q_descale=qs, k_descale=ks)),
        "q, k rotated": relative(oracle.attention(qr, kr, v, causal=causal, q_descale=qrs, k_descale=krs)),
        "v": relative(oracle.attention(q, k, v8, causal=causal, v_descale=vs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--outliers", type=int, default=4, help="channels of q and k 100x and 1000x the rest")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shape = (1, args.heads, args.n, args.d)
    columns = ("bf16", "fp8", "fp8 rotated", "P", "q, k", "q, k rotated", "v")
    print("| activations | mask | " + " | ".join(columns) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in columns) + " |")
    for gain in (1.0, 100.0, 1000.0):
        q, k, v = (rng.standard_normal(shape) for _ in range(3))
        channels = rng.choice(args.d, size=args.outliers, replace=False)
        q[..., channels] *= gain
        k[..., channels] *= gain
        q = q / (q @ k.swapaxes(-1, -2)).std()  # scores of unit variance: the same softmax temperature
        name = "Gaussian" if gain == 1.0 else f"{args.outliers} channels x{gain:g}"
        for causal in (False, True):
            e = errors(q, k, v, causal)
            print(f"| {name} | {'causal' if causal else 'none'} | " + " | ".join(f"{e[c]:.1e}" for c in columns) + " |")


if __name__ == "__main__":
    main()
