"""Masked attention at B=4, H=16, N=4096, d=128, float16: fagen's static-mask kernels and its
runtime block-mask kernel beside FlexAttention (torch.compile) on the same masks.

TFLOP/s count only kept work: 4 * B * H * d * (kept (q, k) pairs).
"""

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fagen
from fagen import masks
from fagen.check import (
    OUT_TOLERANCE,
    check_against_oracle,
    random_inputs,
    relative_error,
    time_ms,
    to_numpy,
)
from fagen.load import SPECS
from fagen.runtime import compile_kernel

B, H, N, D = 4, 16, 4096, 128
DOC_LENGTHS = [400, 700, 300, 600, 500, 800, 296, 500]  # 8 documents, 4096 tokens
doc_ids = masks.documents_of_lengths(DOC_LENGTHS, batch=1)
docs_t = torch.from_numpy(doc_ids[0]).cuda()

CASES = {  # name: (static spec, block-mask builder, FlexAttention mask_mod, dense predicate)
    "causal": ("attn_f16_d128_causal", lambda: masks.causal(N, q_block=64, kv_block=64),
               lambda b, h, q, k: q >= k, lambda q, k: k <= q),
    "sliding_window_1024": ("sliding_window_f16_d128", lambda: masks.sliding_window(N, 1024, 0, 64, 64),
                            lambda b, h, q, k: (q >= k) & (q - k <= 1024), lambda q, k: (k <= q) & (q - k <= 1024)),
    "documents_8": ("document_causal_f16_d128", lambda: masks.document(doc_ids, True, 64, 64),
                    lambda b, h, q, k: (docs_t[q] == docs_t[k]) & (q >= k),
                    lambda q, k: (doc_ids[0][q] == doc_ids[0][k]) & (k <= q)),
}

flex = torch.compile(flex_attention)
q, k, v, out = random_inputs("torch", "float16", B, H, H, N, N, D)
qi, ki = np.arange(N)[:, None], np.arange(N)[None, :]
print(f"{'mask':22} {'path':14} {'ms':>8} {'TFLOP/s':>8}  (kept-work FLOPs)")
for case, (spec_name, build, mask_mod, dense) in CASES.items():
    kept = dense(qi, ki).sum()
    flops = 4.0 * B * H * D * kept
    extras = {"doc_ids": doc_ids} if "document" in spec_name else {}
    static = fagen.load_spec(SPECS / f"{spec_name}.yaml")
    assert check_against_oracle(static, 1, 2, 2, 1024, 1024).passed  # checked before timed
    kernel = compile_kernel(static)
    docs_dev = torch.from_numpy(doc_ids).cuda() if extras else None
    run_static = (lambda: kernel(q, k, v, out=out, doc_ids=docs_dev)) if extras else (lambda: kernel(q, k, v, out=out))
    bm = build()
    omni = compile_kernel(fagen.load_spec(SPECS / "omni_prefetch_f16_d128.yaml"))
    run_omni = lambda: omni(q, k, v, out=out, block_mask=bm)
    fbm = create_block_mask(mask_mod, None, None, N, N, device="cuda")
    run_flex = lambda: flex(q, k, v, block_mask=fbm)
    # correctness of all three on the full problem, one head, against each other and the oracle
    ref = flex(q[:1, :1].float(), k[:1, :1].float(), v[:1, :1].float(), block_mask=create_block_mask(
        mask_mod, None, None, N, N, device="cuda"))
    for name, fn in (("static", run_static), ("block_mask", run_omni)):
        fn()
        err = relative_error(to_numpy(out[:1, :1]), to_numpy(ref))
        assert err < OUT_TOLERANCE["float16"], (case, name, err)
    for name, fn in (("fagen static", run_static), ("fagen block", run_omni), ("flex", run_flex)):
        ms = time_ms(fn, warmup=10, iters=50)
        print(f"{case:22} {name:14} {ms:8.3f} {flops / ms / 1e9:8.1f}")
