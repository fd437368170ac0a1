"""Every shipped spec against the float64 oracle on the GPU (marked `gpu`).

Fresh random inputs per case, output poisoned with NaN before each launch, relative error
against the per-dtype tolerance in fagen.check. Run with: pytest -m gpu
"""

import math

import numpy as np
import pytest

import fagen
from fagen import oracle
from fagen.check import OUT_TOLERANCE, check_against_oracle, random_inputs, relative_error, to_numpy
from fagen.load import SPECS

pytestmark = pytest.mark.gpu

SPEC_PATHS = sorted(SPECS.glob("*.yaml"))
# (Nq, Nk): 1, tile multiples and their neighbours, Nq != Nk both ways.
LENGTHS = [(1, 1), (17, 63), (63, 17), (64, 64), (65, 127), (127, 65), (1000, 1000), (2049, 1000),
           (1000, 2049), (1, 2049), (2049, 17)]
HEADS_KV = (6, 2, 1)  # Hq = 6: MHA, GQA, MQA


def _cases():
    for path in SPEC_PATHS:
        spec = fagen.load_spec(path)
        if spec.element.is_fp8 or spec.fp8_kv:
            continue  # descales and FP8 rounding: tests/test_gpu_fp8.py and test_gpu_fp8_kv.py check these
        for i, (nq, nk) in enumerate(LENGTHS):
            if spec.mask.kind == "document":
                nk = nq  # packed self-attention
            if spec.mask.kind == "block_mask" and nq * nk > 1_100_000:
                continue  # block masks are built in Python; the long cases live in test_block_masks
            yield pytest.param(path, nq, nk, HEADS_KV[i % 3], ("bhnd", "bnhd")[i % 2], i % 2,
                               id=f"{path.stem}-{nq}x{nk}-hkv{HEADS_KV[i % 3]}-{('bhnd', 'bnhd')[i % 2]}")


@pytest.mark.parametrize("path, nq, nk, hkv, layout, use_torch", list(_cases()))
def test_spec_against_oracle(path, nq, nk, hkv, layout, use_torch):
    spec = fagen.load_spec(path)
    framework = "torch" if (use_torch or spec.dtype == "bfloat16") else "cupy"
    result = check_against_oracle(spec, 2, 6, hkv, nq, nk, framework=framework, layout=layout)
    print(result.summary())
    assert result.passed, result.summary()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_api_with_torch(dtype, head_dim, causal):
    """fagen.attention picks a shipped kernel; PyTorch tensors in, PyTorch tensors out."""
    torch = pytest.importorskip("torch")
    q, k, v, _ = random_inputs("torch", dtype, 2, 4, 2, 300, 333, head_dim)
    out, lse = fagen.attention(q, k, v, causal=causal, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.shape == q.shape
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, return_lse=True)
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE[dtype]
    assert relative_error(to_numpy(lse), ref_lse) < 1e-4


def test_fully_masked_rows_give_zero_and_minus_inf():
    """Causal with Nq > Nk: the first Nq - Nk queries see no key at all."""
    q, k, v, _ = random_inputs("cupy", "float16", 1, 2, 2, 200, 70, 64)
    out, lse = fagen.attention(q, k, v, causal=True, return_lse=True)
    out, lse = to_numpy(out), to_numpy(lse)
    assert not np.isnan(out).any()
    assert (out[:, :, :130] == 0).all() and np.isneginf(lse[:, :, :130]).all()
    ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, return_lse=True)
    assert relative_error(out, ref) < OUT_TOLERANCE["float16"]
    assert relative_error(lse, ref_lse) < 1e-4


@pytest.mark.parametrize("head_dim", [64, 128])  # the mma.sync kernels and, on Hopper, the wgmma ones
@pytest.mark.parametrize("causal", [False, True])
def test_a_nan_query_gives_nan_output_and_lse(head_dim, causal):
    """NaN is never hidden: its row's O and LSE are NaN (as in the oracle), other rows exact."""
    q, k, v, _ = random_inputs("cupy", "float16", 1, 2, 2, 130, 130, head_dim)
    q[0, 1, 77, 5] = float("nan")
    out, lse = fagen.attention(q, k, v, causal=causal, return_lse=True)
    out, lse = to_numpy(out), to_numpy(lse)
    ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, return_lse=True)
    assert np.isnan(out[0, 1, 77]).all() and np.isnan(lse[0, 1, 77]) and np.isnan(ref_lse[0, 1, 77])
    rest = np.ones(lse.shape, bool)
    rest[0, 1, 77] = False
    assert np.isfinite(lse[rest]).all() and not np.isnan(out[rest]).any()
    assert relative_error(out[rest], ref[rest]) < OUT_TOLERANCE["float16"]


def test_custom_scale():
    spec = fagen.load_spec(SPECS / "attn_f16_d64.yaml")
    result = check_against_oracle(spec, 1, 3, 3, 129, 257, scale=0.37)
    assert result.passed, result.summary()


def test_output_types_follow_cupy_input():
    cupy = pytest.importorskip("cupy")
    q, k, v, _ = random_inputs("cupy", "float16", 1, 2, 1, 65, 65, 128)
    out = fagen.attention(q, k, v)
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16 and out.shape == q.shape


def test_kernel_is_compiled_once_per_process():
    spec = fagen.load_spec(SPECS / "flash_shared_f16_d64.yaml")
    assert fagen.compile(spec) is fagen.compile(spec)


def _bad(**change):
    cupy = pytest.importorskip("cupy")
    q, k, v, _ = random_inputs("cupy", "float16", 2, 4, 2, 64, 64, 64)
    args = dict(q=q, k=k, v=v)
    args.update({name: fn(cupy, args[name]) if callable(fn) else fn for name, fn in change.items()})
    return args


@pytest.mark.parametrize("change, message", [
    (dict(q=lambda cp, x: x.astype(cp.float32)), "dtype float32"),
    (dict(k=lambda cp, x: x[0]), "rank 3"),
    (dict(q=lambda cp, x: x[..., :32]), "head_dim 32"),
    (dict(k=lambda cp, x: cp.concatenate([x, x[:, :1]], axis=1), v=lambda cp, x: cp.concatenate([x, x[:, :1]], axis=1)),
     "multiple of Hkv"),
    (dict(v=lambda cp, x: x[:, :, :32]), r"must have the same \[B, Hkv, Nk\]"),
    (dict(k=lambda cp, x: x[:1], v=lambda cp, x: x[:1]), "batch mismatch"),
    (dict(q=lambda cp, x: cp.asfortranarray(x)), "stride"),
    (dict(q=lambda cp, x: cp.asnumpy(x)), "host"),
])
def test_bad_arguments_are_refused_before_launch(change, message):
    args = _bad(**change)
    kernel = fagen.compile(fagen.load_spec(SPECS / "attn_f16_d64.yaml"))
    with pytest.raises(ValueError, match=message):
        kernel(**args)


def test_lse_refused_when_the_spec_has_none():
    spec = fagen.parse_spec({**fagen.load_spec(SPECS / "attn_f16_d64.yaml").model_dump(),
                             "name": "no_lse_f16_d64", "outputs": {"lse": False}})
    kernel = fagen.compile(spec)
    q, k, v, _ = random_inputs("cupy", "float16", 1, 2, 2, 64, 64, 64)
    with pytest.raises(ValueError, match="outputs.lse"):
        kernel(q, k, v, return_lse=True)
    out = kernel(q, k, v)
    ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v))
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE["float16"]


def test_heavy_causal_shape_timing_is_sane():
    """A longer causal run: the same kernel over a tile count far past one wave of SMs."""
    spec = fagen.load_spec(SPECS / "attn_f16_d128_causal.yaml")
    result = check_against_oracle(spec, 1, 4, 4, 4096, 4096, time_it=True)
    assert result.passed and result.ms is not None and math.isfinite(result.ms), result.summary()


def test_timed_calls_queue_behind_the_hold():
    """time_ms enqueues every timed call while the GPU is still held, so each call's time is its
    GPU work even where the host takes longer (0.3 ms a call here, for a kernel of microseconds):
    each timed call finds the stream still busy."""
    import time

    import cupy

    from fagen.check import time_ms

    x = cupy.zeros(1024, cupy.float32)
    busy = []

    def slow_host():
        end = time.perf_counter() + 300e-6
        while time.perf_counter() < end:
            pass
        x.__iadd__(1.0)
        busy.append(not cupy.cuda.get_current_stream().done)

    iters = 20
    assert time_ms(slow_host, warmup=3, iters=iters) > 0
    assert all(busy[-iters:]), busy


def test_a_value_head_of_its_own_is_checked_and_shapes_the_output():
    """head_dim_v 128 beside head_dim 64: O comes out [B, Hq, Nq, 128]; a V as wide as Q, an out
    of q's shape, or a fagen.attention call with V wider than Q are refused before any launch."""
    torch = pytest.importorskip("torch")
    spec = fagen.load_spec(SPECS / "value_head_bf16_d64_v128.yaml")
    kernel = fagen.compile(spec)
    q, k, v, out = random_inputs("torch", "bfloat16", 1, 4, 2, 77, 130, 64, d_v=128)
    got = kernel(q, k, v)
    assert got.shape == (1, 4, 77, 128)
    ref = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v))
    assert relative_error(to_numpy(got), ref) < OUT_TOLERANCE["bfloat16"]
    with pytest.raises(ValueError, match="v: head_dim_v 64, but kernel value_head_bf16_d64_v128 is built for 128"):
        kernel(q, k, k)
    with pytest.raises(ValueError, match=r"out: .*expected a torch bfloat16 tensor \[B, Hq, Nq, head_dim_v\]"):
        kernel(q, k, v, out=torch.empty_like(q))

@pytest.mark.parametrize("d, dv", [(64, 128), (128, 64), (192, 128)])
@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_fagen_attention_takes_a_value_head_of_its_own(framework, d, dv):
    """fagen.attention with v of another width than q's (DeepSeek's 192/128 among them) derives
    the forward that takes it (fagen.dispatch) and matches the oracle, a single query row too
    (the decode kernels take equal widths only); gradients through autograd match the oracle's."""
    dtype = "bfloat16" if framework == "torch" else "float16"  # CuPy has no bfloat16
    q, k, v, _ = random_inputs(framework, dtype, 2, 8, 2, 300, 517, d, d_v=dv)
    ref, ref_lse = oracle.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, return_lse=True)
    out, lse = fagen.attention(q, k, v, causal=True, return_lse=True)
    assert tuple(out.shape) == (2, 8, 300, dv)
    assert relative_error(to_numpy(out), ref) < OUT_TOLERANCE[dtype]
    assert relative_error(to_numpy(lse), ref_lse) < 1e-4
    if framework == "torch":
        import torch

        q1 = q[:, :, :1].clone()  # one query row a head: the plain forward still (decode packs equal widths)
        assert relative_error(to_numpy(fagen.attention(q1, k, v)), oracle.attention(to_numpy(q1), to_numpy(k),
                                                                                    to_numpy(v))) < OUT_TOLERANCE["bfloat16"]
        # autograd through the op: dq and dk head_dim wide, dv head_dim_v, against the oracle's
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        dout = torch.randn(2, 8, 300, dv, device="cuda").to(q.dtype)
        fagen.attention(*leaves, causal=True).backward(dout)
        ref = oracle.attention_backward(*(to_numpy(x) for x in (q, k, v, dout)), causal=True)
        for name, x in zip(("dq", "dk", "dv"), leaves):
            assert x.grad.shape == x.shape, name
            assert relative_error(to_numpy(x.grad), ref[name]) < OUT_TOLERANCE["bfloat16"], name
