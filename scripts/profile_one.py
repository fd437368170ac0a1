"""Launch one shipped kernel a few times (for ncu), at the bench's shape (B*N = 16k tokens,
H*d = 2048): python3 scripts/profile_one.py SPEC N"""

import sys

import fagen
from fagen.check import random_inputs
from fagen.load import SPECS

spec = fagen.load_spec(SPECS / f"{sys.argv[1]}.yaml")
n = int(sys.argv[2])
kernel = fagen.compile(spec)
b, h = max(1, 16384 // n), 2048 // spec.head_dim
q, k, v, out = random_inputs("torch", spec.dtype, b, h, h, n, n, spec.head_dim)
for _ in range(8):
    kernel(q, k, v, out=out)
import cupy

cupy.cuda.Device().synchronize()
