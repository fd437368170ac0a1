"""The FP8 backward (fagen.fp8_backward) without a GPU: its plan fits shared memory and registers,
its kernels build for sm_90a without spills, and what it does not run is refused by name."""

import functools
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from fagen import nvcc
from fagen.fp8_backward_plan import FP8_BACKWARD_MASKS, FP8_BACKWARD_OUT_TYPES, Fp8BackwardPlan
from fagen.rendering import render_fp8_backward
from fagen.spec import Mask

SM90A_SMEM = 227 * 1024
SM90_REGISTERS = 64 * 1024


@pytest.mark.parametrize("out_dtype", FP8_BACKWARD_OUT_TYPES)
def test_the_plan_fits_k_v_k_transposed_two_stages_ds_and_dq_s_staging(out_dtype):
    plan = Fp8BackwardPlan("float8_e4m3", out_dtype)
    # a stage: Q's and dO's 64 rows, and their transposes (128 head_dim rows of 128-byte swizzle rows)
    assert plan.stage_bytes == 2 * 64 * 128 + 2 * 128 * 128 and plan.ring_at == 3 * 128 * 128
    assert plan.smem_bytes <= SM90A_SMEM < plan.smem_bytes + plan.stage_bytes  # two stages, a third does not fit
    for at in (plan.k_at, plan.v_at, plan.kt_at, plan.ring_at, plan.stage_bytes, plan.stage_do_at, plan.stage_qt_at,
               plan.stage_dot_at, plan.ds_at):
        assert at % plan.smem_align == 0
    # dV and dK of a warpgroup's 64 keys: 128 f32 registers a thread; S^T, dP^T and dQ 32 each
    assert 4 * 2 * plan.g_n_frags == 128 and 4 * plan.s_n_frags == 4 * plan.dq_n_frags == 32
    assert plan.consumer_warps * plan.dq_warp_bytes == plan.dq_tile_floats * 4  # a step's dQ tile, every warp's piece
    assert plan.producer_registers * 128 + plan.consumer_registers * plan.consumer_threads <= SM90_REGISTERS
    assert plan.name == f"fp8_backward_e4m3_d128_{'bf16' if out_dtype == 'bfloat16' else 'f16'}"


# every kind the FP8 backward walks (FP8_BACKWARD_MASKS), both aligns of the diagonal, f16 with one
MASKS = [Mask(), Mask(kind="causal"), Mask(kind="causal", align="top_left"),
         Mask(kind="sliding_window", window_left=200, window_right=30), Mask(kind="chunked", chunk_size=192),
         Mask(kind="prefix_lm", prefix_len=100, align="top_left")]


BUILDS = ([(out, Mask(), False) for out in FP8_BACKWARD_OUT_TYPES] +
          [("bfloat16", mask, False) for mask in MASKS[1:]] + [("float16", MASKS[3], False)] +
          [("bfloat16", mask, True) for mask in MASKS] + [("float16", MASKS[4], True)])


@functools.cache
def _ptxas_logs() -> dict:
    """Each build's (return code, ptxas log), compiled a core at a time on first use."""
    def build(case):
        out_dtype, mask, deterministic = case
        plan = Fp8BackwardPlan("float8_e4m3", out_dtype, mask=mask, deterministic=deterministic)
        return nvcc._ptxas(f"{plan.name}.cu", render_fp8_backward("float8_e4m3", out_dtype, mask, deterministic),
                           "sm_90a")
    with ThreadPoolExecutor(nvcc.default_jobs()) as pool:
        return dict(zip(BUILDS, pool.map(build, BUILDS)))


@pytest.mark.parametrize("out_dtype,mask,deterministic", BUILDS,
                         ids=lambda x: x if isinstance(x, str) else f"{x.kind}-{x.align}" if isinstance(x, Mask)
                         else "deterministic" if x else "")
def test_the_kernels_build_for_sm90a_without_spills(out_dtype, mask, deterministic):
    plan = Fp8BackwardPlan("float8_e4m3", out_dtype, mask=mask, deterministic=deterministic)
    code, log = _ptxas_logs()[out_dtype, mask, deterministic]
    assert code == 0, log
    for entry in (plan.name, f"{plan.name}_amax", f"{plan.name}_preprocess", f"{plan.name}_postprocess"):
        report = log.split(f"Compiling entry function '{entry}'")[1].split("Compile time")[0]
        assert re.search(r"0 bytes spill stores, 0 bytes spill loads", report), (entry, report)
    assert "wgmma.mma_async instructions are serialized" not in log


def test_render_refuses_an_unknown_dtype_or_head_dim_by_name():
    with pytest.raises(ValueError, match=r"FP8 backward dtypes 'float8_e5m2' / 'bfloat16'"):
        render_fp8_backward("float8_e5m2", "bfloat16")
    with pytest.raises(ValueError, match=r"out one of \('bfloat16', 'float16'\)"):
        render_fp8_backward("float8_e4m3", "float32")
    with pytest.raises(AssertionError, match=r"worked out for head_dim 128"):
        Fp8BackwardPlan(head_dim=256)


def test_the_masks_built_are_every_kind_of_positions_alone_and_name_their_module():
    """The kinds with no kernel parameter (a document's bounds, a block mask's lists are not read
    yet), each test tested above; a mask's module is named by its kind and fields."""
    assert {m.kind for m in MASKS} == set(FP8_BACKWARD_MASKS) == {"none", "causal", "sliding_window", "chunked",
                                                                  "prefix_lm"}
    names = {Fp8BackwardPlan(mask=m).name for m in MASKS}
    assert len(names) == len(MASKS) and Fp8BackwardPlan().name == "fp8_backward_e4m3_d128_bf16"
    assert Fp8BackwardPlan(mask=MASKS[3]).name.startswith("fp8_backward_e4m3_d128_bf16_sliding_window_")
    with pytest.raises(AssertionError):
        Fp8BackwardPlan(mask=Mask(kind="document"))


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"{m.kind}-{m.align}")
def test_a_deterministic_tile_s_turns_are_the_key_blocks_that_visit_it(mask):
    """The deterministic dQ's turns (the preprocess starts a query tile's count from the last key
    block of the forward's walk of its rows, Mask::begin; a block waits for the count of the blocks
    after it): the blocks whose key-major walk (Mask::begin_keys) visits the tile must be that
    walk's run of blocks, or a block would wait for one that never adds (or two would race). The
    kinds' NumPy twins, over tiles and blocks of both diagonals and ragged ends."""
    from fagen.mask_kinds import KINDS

    plan, kind = Fp8BackwardPlan(mask=mask), KINDS[mask.kind]
    for nq, nk in ((300, 700), (700, 300), (1000, 1000), (64, 1000), (500, 128), (1, 777), (777, 1)):
        off = nk - nq if mask.align == "bottom_right" else 0
        blocks = -(-nk // plan.block_kv)
        for t in range(-(-nq // plan.block_q)):
            q0, q1 = t * plan.block_q, min((t + 1) * plan.block_q, nq) - 1
            visitors = []
            for x in range(blocks):
                lo, hi = kind.q_range(mask, x * plan.block_kv, min((x + 1) * plan.block_kv, nk) - 1, off, nq, None)
                if hi > lo and lo // plan.block_q <= t < -(-hi // plan.block_q):
                    visitors.append(x)
            if visitors:
                lo, hi = kind.kv_range(mask, q0, q1, off, nk, None)
                walked = list(range(lo // plan.block_kv, -(-hi // plan.block_kv)))
                assert visitors == walked, (nq, nk, t, walked, visitors)


def test_the_launch_numbers_cover_every_key_and_every_half_of_dq():
    """A block a 128-key tile (a partial last one), TMA boxes of a step's rows (q, dO) and of the
    block's keys (k, v), and a postprocess block for each warpgroup's half of every 64-row tile."""
    plan = Fp8BackwardPlan()
    assert plan.grid(1000, 3, 2) == (8, 3, 2) and plan.grid(128, 1, 1) == (1, 1, 1)
    assert [plan.box_rows(t) for t in ("q", "k", "v", "do8")] == [64, 128, 128, 64]
    assert plan.postprocess_blocks(256) == 4 * 2 and 2 * plan.dq_columns == plan.head_dim


def test_the_step_tiles_transpose_lands_each_query_byte_in_key_order():
    """transpose_queries (templates/sm90/fp8_backward.cu.j2) run lane by lane in NumPy: one
    ldmatrix of four 8 x 8 b16 matrices, four byte permutes and one stmatrix .trans a warp turn, the
    addresses as the template computes them, both tiles 128-byte swizzled. Every byte of Q^T's first
    64 columns (poisoned first) is the query that fagen.fp8_inputs.KEY_ORDER puts there."""
    from fagen.fp8_inputs import KEY_GROUP, KEY_ORDER
    from tests.test_fp8 import byte_perm

    plan = Fp8BackwardPlan()
    rows, width, queries = plan.row_bytes, plan.head_dim, plan.block_q

    def swizzled(row, chunk):
        return row * rows + ((chunk ^ (row & 7)) << 4)

    q = np.random.default_rng(3).integers(0, 256, (queries, width)).astype(np.uint8)
    smem = np.full(queries * rows + width * rows, 0xAB, np.uint8)
    for r in range(queries):
        for c in range(width // 16):
            smem[swizzled(r, c):swizzled(r, c) + 16] = q[r, 16 * c:16 * c + 16]
    dst = queries * rows
    block_pairs = width // 32
    for it in range(queries // 16 * block_pairs):  # the warps' turns, in any order
        chunk = it // block_pairs
        loads, stores = [], []
        for lane in range(32):
            m, i = lane >> 3, lane & 7
            row = 2 * ((i >> 1) + 4 * (i & 1)) + (m & 1)
            column = 2 * i - (i & 1) + 2 * (m & 1)
            block = 2 * (it % block_pairs) + (m >> 1)
            loads.append(swizzled(16 * chunk + row, block))
            stores.append(dst + swizzled(16 * block + column, chunk))
        # ldmatrix: matrix m's row r is lane 8m + r's address; lane l holds 4 bytes of each matrix's row l / 4
        words = [[int.from_bytes(smem[loads[8 * m + lane // 4] + 4 * (lane % 4):][:4].tobytes(), "little")
                  for m in range(4)] for lane in range(32)]
        pairs = [[byte_perm(w[0], w[1], 0x5140), byte_perm(w[0], w[1], 0x7362),
                  byte_perm(w[2], w[3], 0x5140), byte_perm(w[2], w[3], 0x7362)] for w in words]
        # stmatrix .trans: memory row i (lane 8m + i's address) is matrix m's column i of b16 values
        for m in range(4):
            matrix = np.zeros((8, 8), np.uint16)
            for lane in range(32):
                matrix[lane // 4, 2 * (lane % 4)] = pairs[lane][m] & 0xFFFF
                matrix[lane // 4, 2 * (lane % 4) + 1] = pairs[lane][m] >> 16
            for i in range(8):
                smem[stores[8 * m + i]:stores[8 * m + i] + 16] = np.frombuffer(matrix[:, i].astype("<u2").tobytes(), np.uint8)
    order = np.concatenate([g + KEY_ORDER for g in range(0, queries, KEY_GROUP)])
    for d in range(width):
        got = np.concatenate([smem[dst + swizzled(d, c):dst + swizzled(d, c) + 16] for c in range(queries // 16)])
        np.testing.assert_array_equal(got, q[order, d])
