"""The head_dim 512 forward and backward without a GPU: their plans fit shared memory and
registers, the kernels build for sm_90a without spills, and what they do not run is refused by
name before any device work."""

import re

import pytest

from fagen import nvcc
from fagen.rendering import render_wide, render_wide_backward
from fagen.wide_head_plan import WIDE_TYPES, WideBackwardPlan, WideHeadPlan

SM90A_SMEM = 227 * 1024


@pytest.mark.parametrize("dtype", WIDE_TYPES)
def test_the_plan_fits_q_two_stages_of_k_and_v_and_p_in_shared_memory(dtype):
    plan = WideHeadPlan(dtype)
    assert plan.q_bytes == plan.block_rows * plan.head_dim * 2
    assert plan.stage_bytes == 2 * plan.block_kv * plan.head_dim * 2
    assert plan.p_at == plan.q_bytes + plan.kv_stages * plan.stage_bytes
    assert plan.smem_bytes <= SM90A_SMEM < plan.smem_bytes + plan.stage_bytes  # two stages, a third does not fit
    # each consumer warpgroup holds half of O: 128 f32 registers a thread
    assert plan.o_n_frags * 4 == plan.block_rows * plan.head_dim // 2 // 128 == 128
    # every 1024-byte swizzle atom starts aligned: Q's, each K and V atom of each stage, P
    for at in (0, plan.ring_at, plan.ring_at + plan.k_bytes, plan.ring_at + plan.stage_bytes, plan.p_at,
               plan.kv_atom_bytes, plan.v_half_bytes):
        assert at % plan.smem_align == 0
    assert plan.pv_k_steps * plan.mma_k == plan.block_kv <= plan.atom_columns  # P fits one atom's columns


@pytest.mark.parametrize("dtype", WIDE_TYPES)
def test_the_kernel_builds_for_sm90a_without_spills(dtype):
    plan = WideHeadPlan(dtype)
    code, log = nvcc._ptxas(f"{plan.name}.cu", render_wide(dtype), "sm_90a")
    assert code == 0, log
    entry = log.split(f"Compiling entry function '{plan.name}'")[1].split("Compile time")[0]
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", entry), entry
    assert "wgmma.mma_async instructions are serialized" not in log


def test_render_refuses_an_unknown_dtype_by_name():
    with pytest.raises(ValueError, match=r"head_dim 512 forward dtype 'float32'"):
        render_wide("float32")
    with pytest.raises(ValueError, match=r"head_dim 512 backward dtype 'float32'"):
        render_wide_backward("float32")


@pytest.mark.parametrize("dtype", WIDE_TYPES)
def test_the_backward_plan_fits_k_v_two_q_do_stages_and_the_exchange_in_shared_memory(dtype):
    plan = WideBackwardPlan(dtype)
    half = plan.block_kv * plan.head_dim // 2 * 2  # a 64-row tile's half of the columns, bf16
    assert plan.half_bytes == half and plan.stage_bytes == 2 * half
    assert plan.ring_at == 2 * half and plan.rows_at == plan.ring_at + plan.q_stages * plan.stage_bytes
    # the exchange buffers hold a 64 x 64 f32 partial each, after the row vectors
    assert plan.exchange_bytes == 64 * 64 * 4
    assert plan.s_exchange_at >= plan.rows_at + plan.q_stages * 2 * plan.row_vector_bytes
    assert plan.smem_bytes <= SM90A_SMEM < plan.smem_bytes + plan.stage_bytes  # two stages, a third does not fit
    # every swizzle atom starts aligned: K's, V's, each stage's Q and dO, dS^T's tile in dP's buffer
    for at in (plan.k_at, plan.v_at, plan.ring_at, plan.ring_at + half, plan.ring_at + plan.stage_bytes,
               plan.dp_exchange_at):
        assert at % plan.smem_align == 0
    # dK or dV of 64 keys at half the columns: 128 f32 registers a consumer thread
    assert plan.o_n_frags * 4 == plan.block_kv * plan.half_columns // 128 == 128
    assert plan.qk_k_steps * plan.mma_k == plan.half_columns
    assert plan.name == f"wide_backward_{'bf16' if dtype == 'bfloat16' else 'f16'}_d512"


@pytest.mark.parametrize("dtype", WIDE_TYPES)
def test_the_backward_kernels_build_for_sm90a_without_spills(dtype):
    plan = WideBackwardPlan(dtype)
    code, log = nvcc._ptxas(f"{plan.name}.cu", render_wide_backward(dtype), "sm_90a")
    assert code == 0, log
    for entry in (plan.name, f"{plan.name}_preprocess", f"{plan.name}_postprocess"):
        report = log.split(f"Compiling entry function '{entry}'")[1].split("Compile time")[0]
        assert re.search(r"0 bytes spill stores, 0 bytes spill loads", report), (entry, report)
    assert "wgmma.mma_async instructions are serialized" not in log


def test_a_compiled_model_calls_the_head_dim_512_forward_through_the_op(monkeypatch):
    """torch.compile(fullgraph=True) traces fagen.attention at head_dim 512 into
    fagen::attention_forward, whose implementation runs the head_dim 512 forward (stubbed: no
    GPU); what that forward does not run is refused while tracing."""
    torch = pytest.importorskip("torch")
    from fagen import api, wide_head

    calls = []

    def forward(q, k, v, *, causal=False, scale=None, return_lse=False, out=None):
        calls.append((causal, scale, return_lse))
        b, h, n, _ = q.shape
        return torch.ones_like(q), torch.zeros(b, h, n)

    monkeypatch.setattr(wide_head, "attention", forward)
    q = torch.zeros(1, 2, 64, 512, dtype=torch.bfloat16)

    @torch.compile(fullgraph=True, backend="eager")
    def layer(q, k, v):
        return api.attention(q, k, v, causal=True, scale=0.05)

    out = layer(q, q[:, :1], q[:, :1])
    assert out.shape == q.shape and (out == 1).all() and calls == [(True, 0.05, True)]

    @torch.compile(fullgraph=True, backend="eager")
    def capped(q, k, v):
        return api.attention(q, k, v, softcap=30.0)

    with pytest.raises(Exception, match="softcap: head_dim 512 runs no score modifier"):
        capped(q, q, q)


def test_decode_packs_a_group_s_heads_as_rows_only_where_they_line_up():
    """q or out [B, Hq, Nq, d] seen as [B, Hkv, group * Nq, d]: one query a head (either layout),
    or heads Nq rows apart without causal; causal rows of Nq > 1 need their own diagonals."""
    from types import SimpleNamespace

    from fagen.wide_head import _packed_rows

    def tensor(shape, strides):
        return SimpleNamespace(shape=shape, strides=strides)

    d = 512
    bhsd = tensor((2, 8, 1, d), (8 * d, d, d, 1))
    bshd = tensor((2, 8, 1, d), (8 * d, d, 8 * d, 1))  # FlashAttention's [B, 1, H, d] seen as [B, H, 1, d]
    for t in (bhsd, bshd):
        assert _packed_rows(t, 4, causal=True) == ((2, 2, 4, d), (8 * d, 4 * d, d, 1))
    rows = tensor((1, 4, 77, d), (4 * 77 * d, 77 * d, d, 1))
    assert _packed_rows(rows, 4, causal=False) == ((1, 1, 308, d), (4 * 77 * d, 4 * 77 * d, d, 1))
    assert _packed_rows(rows, 4, causal=True) is None
    assert _packed_rows(tensor((1, 4, 77, d), (77 * 4 * d, d, 4 * d, 1)), 4, causal=False) is None


def test_the_keys_split_only_where_tiles_and_heads_leave_sms_idle():
    from fagen.wide_head import default_splits

    assert default_splits(blocks=1024, kv_tiles=128, sms=132) == 1  # a prompt fills the GPU
    assert default_splits(blocks=4, kv_tiles=2048, sms=132) == 33  # decode: B 1, 4 KV heads
    assert default_splits(blocks=6, kv_tiles=3, sms=132) == 3  # at most a KV tile a split
    assert default_splits(blocks=200, kv_tiles=50, sms=132) == 1


@pytest.mark.parametrize("dtype", WIDE_TYPES)
def test_the_backward_launch_numbers_pair_blocks_and_cover_dq(dtype):
    """fagen.accumulated_dq's numbers from the head_dim 512 plan: a cluster of two blocks a 64-key
    tile, 64-row TMA boxes, a postprocess block a 64 x 64 chunk of dQ (8 a tile)."""
    plan = WideBackwardPlan(dtype)
    assert plan.grid(1000, 3, 2) == (2 * 16, 3, 2)
    assert {plan.box_rows(t) for t in ("q", "k", "v", "dout")} == {64}
    assert plan.postprocess_blocks(128) == 2 * 8 and plan.tile_rows == 64
