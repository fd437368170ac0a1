"""Element types: one object per type a kernel stores (float16, bfloat16, the two FP8 formats) or
accumulates in (float32), with every fact the spec, plan, templates, runtime, oracle and tests read
about it. Nothing else keeps a table of types: a new type is one entry here.

The NumPy twin of a type's storage is `round`: float64 values rounded to the nearest representable
value (ties to even), subnormals and overflow as the format has them. The oracle and the tests
read it to make inputs a kernel sees exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# CU_TENSOR_MAP_DATA_TYPE_* (cuda.h): what a TMA box moves. FP8 moves as bytes.
_TMA_UINT8, _TMA_FLOAT16, _TMA_FLOAT32, _TMA_BFLOAT16 = 0, 6, 7, 9


@dataclass(frozen=True)
class ElementType:
    name: str  # the spec's dtype, as NumPy and torch spell it (torch adds fn to e4m3: `torch_name`)
    short: str  # in kernel and file names: attn_<short>_d128
    bytes: int
    c_storage: str  # the C type holding one element's bits; arithmetic is in f32 registers
    ptx: str  # the type in cvt, mma.sync and wgmma
    # elements one MMA instruction reduces over (its k), by instruction family; absent: no such MMA
    mma_k: dict[str, int] = field(hash=False)
    tensor_map: int  # CU_TENSOR_MAP_DATA_TYPE_*
    torch_name: str
    array_carrier: str  # the NumPy/CuPy dtype of the same bytes that carries it (CuPy has no bfloat16)
    mantissa_bits: int
    min_exponent: int  # of the smallest normal
    max_finite: float
    saturates_to_nan: bool = False  # e4m3fn: no infinity, an overflow is NaN
    # ||out - ref|| / ||ref|| a forward of this input type meets against the float64 oracle (P's
    # rounding to the MMA input type plus f32 accumulation); None: no kernel takes it yet
    tolerance: float | None = None
    # what a forward of this input type writes (a half type: itself; FP8: bfloat16 or float16,
    # FlashAttention-3's outputs, and e4m3 at an output scale, cuDNN's), the first the default
    out_types: tuple[str, ...] = ()
    # P = exp2(s - max + p_log2_scale) before it is rounded to this type as the A operand of P.V
    # (FP8: 2^8 keeps P's small values normal; FlashAttention-3's Max_offset); 0 for half types
    p_log2_scale: int = 0

    @property
    def has_kernels(self) -> bool:
        return self.tolerance is not None

    @property
    def is_fp8(self) -> bool:
        return self.bytes == 1

    @property
    def in_cupy(self) -> bool:
        """CuPy (and NumPy) have the type itself, not only a carrier of its bytes."""
        return self.array_carrier == self.name

    def round(self, x) -> np.ndarray:
        """float64 `x` rounded to this type's nearest representable values, ties to even."""
        x = np.asarray(x, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            exponent = np.floor(np.log2(np.abs(x)))
            quantum = np.exp2(np.maximum(exponent, self.min_exponent) - self.mantissa_bits)
            quantum = np.where(np.isfinite(quantum) & (quantum > 0), quantum, 1.0)
            out = np.rint(x / quantum) * quantum
        too_big = np.abs(out) > self.max_finite
        overflow = np.nan if self.saturates_to_nan else np.copysign(np.inf, x)
        return np.where(too_big & np.isfinite(x), overflow, np.where(np.isfinite(x), out, x))

    def round_saturated(self, x) -> np.ndarray:
        """`round`, a value past the largest finite one becoming it (cvt's .satfinite, as FP8
        outputs are written); NaN stays NaN."""
        return self.round(np.clip(np.asarray(x, dtype=np.float64), -self.max_finite, self.max_finite))


FLOAT16 = ElementType("float16", "f16", 2, "unsigned short", "f16", {"mma.sync": 16, "wgmma": 16}, _TMA_FLOAT16,
                      "float16", "float16", mantissa_bits=10, min_exponent=-14, max_finite=65504.0,
                      tolerance=4e-3, out_types=("float16",))
BFLOAT16 = ElementType("bfloat16", "bf16", 2, "unsigned short", "bf16", {"mma.sync": 16, "wgmma": 16}, _TMA_BFLOAT16,
                       "bfloat16", "float16", mantissa_bits=7, min_exponent=-126, max_finite=3.3895313892515355e38,
                       tolerance=2e-2, out_types=("bfloat16",))
FLOAT8_E4M3 = ElementType("float8_e4m3", "e4m3", 1, "unsigned char", "e4m3", {"wgmma": 32}, _TMA_UINT8,
                          "float8_e4m3fn", "uint8", mantissa_bits=3, min_exponent=-6, max_finite=448.0,
                          saturates_to_nan=True, out_types=("bfloat16", "float16", "float8_e4m3"), p_log2_scale=8,
                          # against the oracle that rounds q, k, v and P as the kernel does (the format's
                          # own error, ~4e-2 against exact attention, is notes/fp8.md's): what is left is
                          # accumulation order, the MUFU's exp2 and the output's rounding
                          tolerance=1e-2)
FLOAT8_E5M2 = ElementType("float8_e5m2", "e5m2", 1, "unsigned char", "e5m2", {"wgmma": 32}, _TMA_UINT8,
                          "float8_e5m2", "uint8", mantissa_bits=2, min_exponent=-14, max_finite=57344.0,
                          out_types=("bfloat16", "float16", "float8_e4m3"), p_log2_scale=8, tolerance=1e-2)
# the accumulators' and split-KV partials' type: no MMA takes it as input here
FLOAT32 = ElementType("float32", "f32", 4, "float", "f32", {}, _TMA_FLOAT32, "float32", "float32",
                      mantissa_bits=23, min_exponent=-126, max_finite=3.4028234663852886e38)

ELEMENT_TYPES: dict[str, ElementType] = {t.name: t for t in (FLOAT16, BFLOAT16, FLOAT8_E4M3, FLOAT8_E5M2, FLOAT32)}
# what a kernel's q, k, v and o may be, in the order messages list them
INPUT_TYPES = tuple(t.name for t in (FLOAT16, BFLOAT16, FLOAT8_E4M3, FLOAT8_E5M2))
# the types whose kernels take q, k, v and o all of that type (the half types) ...
KERNEL_TYPES = tuple(name for name in INPUT_TYPES if ELEMENT_TYPES[name].has_kernels and not ELEMENT_TYPES[name].is_fp8)
# ... and the FP8 ones, whose forward writes o in a half type by default
FP8_KERNEL_TYPES = tuple(name for name in INPUT_TYPES if ELEMENT_TYPES[name].has_kernels and ELEMENT_TYPES[name].is_fp8)


def element_type(name: str) -> ElementType:
    """The type called `name` (a spec's, a tensor's dtype string or torch's spelling)."""
    for t in ELEMENT_TYPES.values():
        if name in (t.name, t.torch_name):
            return t
    raise ValueError(f"dtype {name!r}: fagen knows {', '.join(ELEMENT_TYPES)}")


def fp8_element(dtype: str) -> ElementType | None:
    """The FP8 element type called `dtype` (fagen's or torch's name), else None (a half type, or
    a dtype fagen does not know: the caller's own check names it)."""
    for t in ELEMENT_TYPES.values():
        if t.is_fp8 and dtype in (t.name, t.torch_name):
            return t
    return None


def itemsize(dtype: str) -> int:
    """Bytes an element of `dtype` takes: an element type's (by fagen's or torch's name), else
    NumPy's (int32, float64)."""
    for t in ELEMENT_TYPES.values():
        if dtype in (t.name, t.torch_name):
            return t.bytes
    return np.dtype(dtype).itemsize
