"""The head_dim 512 forward without a GPU: its plan fits shared memory and registers, the kernel
builds for sm_90a without spills, and what it does not run is refused by name before any
device work."""

import re

import pytest

from fagen import nvcc
from fagen.render import render_wide
from fagen.wide_head_plan import WIDE_TYPES, WideHeadPlan

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
