"""Flash-decoding: split-KV + merge against the unsplit kernel on decode shapes.

B=1, Hq=32, Hkv=8 (GQA), d=128, float16; Nq = 1..16 query rows against Nk = 32k..128k keys.
Both are checked against the oracle (on a shorter Nk) before they are timed.
"""

import fagen
from fagen import oracle, splitkv
from fagen.check import OUT_TOLERANCE, random_inputs, relative_error, time_ms, to_numpy
from fagen.load import SPECS

base = fagen.load_spec(SPECS / "attn_f16_d128.yaml")
plain = fagen.compile(base)
q, k, v, _ = random_inputs("torch", "float16", 1, 32, 8, 16, 4096, 128)
ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v))
for name, fn in (("plain", lambda: plain(q, k, v)), ("split", lambda: splitkv.attention(q, k, v, spec=base))):
    assert relative_error(to_numpy(fn()), ref) < OUT_TOLERANCE["float16"], name

print(f"{'Nq':>3} {'Nk':>7} {'plain ms':>9} {'split ms':>9} {'speedup':>8}")
for nk in (32768, 65536, 131072):
    for nq in (1, 4, 16):
        q, k, v, _ = random_inputs("torch", "float16", 1, 32, 8, nq, nk, 128)
        t_plain = time_ms(lambda: plain(q, k, v), warmup=5, iters=20)
        t_split = time_ms(lambda: splitkv.attention(q, k, v, spec=base), warmup=5, iters=20)
        print(f"{nq:>3} {nk:>7} {t_plain:9.3f} {t_split:9.3f} {t_plain / t_split:7.1f}x")
