#!/usr/bin/env bash
# Tune the default kernels fagen.attention uses on this GPU (quick space), writing specs to $1.
set -u
out=${1:-specs}
for s in attn_f16_d64 attn_f16_d64_causal attn_f16_d128_causal attn_f16_d256 attn_f16_d256_causal; do
  python3 -m fagen tune specs/$s.yaml --quick --shape $([ $s = attn_f16_d64* ] && echo 8,32,2048,2048 || echo 4,16,4096,4096) -o "$out" 2>&1 | tail -4
done
