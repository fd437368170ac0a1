"""head_dim_v apart from head_dim (DeepSeek-style V narrower or wider than Q and K): what the
plan and the rendered kernel take from each width, and the oracle's reference for it."""

from __future__ import annotations

import numpy as np
import pytest

import fagen
from fagen import oracle
from fagen.load import SPECS
from fagen.plan import plan
from fagen.rendering import render


def _spec(name: str):
    return fagen.load_spec(SPECS / f"{name}.yaml")


def test_each_width_feeds_its_own_product():
    """Q.K^T steps over head_dim, P.V's fragments and O's chunks over head_dim_v; the smem rows
    are as wide as the wider head (so the staged O fits Q's tile)."""
    for name, d, dv in (("value_head_f16_d128_v64", 128, 64), ("value_head_bf16_d64_v128", 64, 128),
                        ("value_head_f16_d128_v64_sm90a", 128, 64), ("value_head_bf16_d64_v128_sm90a", 64, 128),
                        ("value_head_f16_d192_v128", 192, 128), ("value_head_bf16_d192_v128_sm90a", 192, 128)):
        spec = _spec(name)
        p = plan(spec)
        assert (p.head_dim, p.head_dim_v, p.qk_k_steps, p.o_n_frags) == (d, dv, d // 16, dv // 8), name
        assert (p.chunks_per_row, p.v_chunks_per_row) == (d // 8, dv // 8), name
        assert p.out_chunks_per_warp == p.warp_rows * dv // 8, name
        text = render(spec)
        if spec.wgmma:
            assert p.atoms_per_row == max(d, dv) // 64
            assert f"m64n{dv}k16" in text and f"m64n{spec.tiling.block_kv}k16" in text
        else:
            assert p.smem_row == max(d, dv) + (8 if spec.smem_layout == "padded" else 0)
        assert f"constexpr int V_CHUNKS_PER_ROW = {dv // 8};" in text
        assert "copy_tile_async<BLOCK_KV, V_CHUNKS_PER_ROW" in text


def test_one_width_renders_as_before():
    """A spec whose V is as wide as Q emits no V-only constant."""
    text = render(_spec("attn_f16_d128"))
    assert "V_CHUNKS_PER_ROW" not in text and "copy_tile_async<BLOCK_KV>(tile, v," in text


def test_the_oracle_takes_a_value_head_of_its_own():
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((2, 4, 9, 64)), rng.standard_normal((2, 2, 13, 64))
    v = rng.standard_normal((2, 2, 13, 128))
    out, lse = oracle.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 4, 9, 128) and lse.shape == (2, 4, 9)
    kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    s = q @ kk.transpose(0, 1, 3, 2) / 8.0
    s = np.where(np.tril(np.ones((9, 13), bool), 13 - 9), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    assert np.allclose(out, (p / p.sum(-1, keepdims=True)) @ vv, rtol=0, atol=1e-12)


def test_the_varlen_oracle_writes_rows_of_the_value_width():
    """Token-major sequences at 192/128, the first without keys (O = 0, LSE = -inf): each sequence
    equals the padded oracle on its own rows."""
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((30, 4, 192)), rng.standard_normal((40, 2, 192)), rng.standard_normal((40, 2, 128))
    out, lse = oracle.attention_varlen(q, k, v, np.array([0, 10, 30]), np.array([0, 0, 40]), causal=True,
                                       return_lse=True)
    assert out.shape == (30, 4, 128) and lse.shape == (4, 30)
    assert not out[:10].any() and np.isneginf(lse[:, :10]).all()
    bhsd = lambda x: x[None].transpose(0, 2, 1, 3)  # noqa: E731
    want = oracle.attention(bhsd(q[10:]), bhsd(k), bhsd(v), causal=True)
    assert np.array_equal(out[10:], want[0].transpose(1, 0, 2))


def test_192_is_a_query_key_width_with_a_value_head_of_its_own():
    """DeepSeek's 192/128: head_dim 192 takes a narrower V; a square 192 head is refused with the
    fix that makes it DeepSeek's (which validates), and 192 is no V width."""
    from fagen.spec import SpecError

    base = _spec("value_head_f16_d192_v128").model_dump(exclude_none=True)
    with pytest.raises(SpecError, match="head_dim = 192: is a Q.K\\^T width that comes with a narrower V") as refused:
        fagen.parse_spec({**base, "head_dim_v": None})
    assert refused.value.fix == {"head_dim_v": 128}
    assert fagen.parse_spec({**base, "head_dim_v": None, **refused.value.fix}).dv == 128
    with pytest.raises(SpecError, match="head_dim_v = 192: must be one of"):
        fagen.parse_spec({**base, "head_dim": 128, "head_dim_v": 192})
    # K's 24 chunks a row do not divide the threads: K and V both copy chunk by chunk
    p = plan(_spec("value_head_f16_d192_v128"))
    assert (p.copy_rows_per_pass, p.v_copy_rows_per_pass) == (0, 0)


def test_two_widths_take_varlen_batches_and_caches(monkeypatch):
    """A varlen prefill batch at 192/128 renders (its TMA producer arms each width's boxes); so do
    caches: key ranges keep the producer, a paged cache's rows are copied (each width its own row
    chunks)."""
    from fagen import device, dispatch, variants

    monkeypatch.setattr(device, "gpu_slug", lambda: "h200")
    plain = dispatch.derive_spec_for("bfloat16", 192, causal=True, head_dim_v=128)
    varlen = variants.sequence_variant(plain, "varlen", "varlen")
    p = plan(varlen)
    assert varlen.dv == 128 and p.sequence_tiles and (p.qk_atoms, p.v_atoms) == (3, 2)
    assert "V_ATOMS = 2;" in render(varlen)
    ranged = variants.sequence_variant(plain, "padded", "ranged")
    assert ranged.dv == 128 and ranged.warp_specialized and "V_ATOMS = 2;" in render(ranged)
    paged = variants.sequence_variant(plain, "varlen", "paged")
    assert paged.dv == 128 and not paged.warp_specialized
    assert "copy_paged_tile_async<BLOCK_KV, V_CHUNKS_PER_ROW>(tile, v" in render(paged)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(("d", "dv", "wider"), [(192, 128, 256), (128, 64, 128), (64, 128, 128)])
def test_a_decode_step_at_two_widths_packs_heads_and_splits_keys(dtype, d, dv, wider):
    """A decode step of two widths runs the decode kernels (mma.sync: GQA heads packed, keys split,
    the partials merged in the launch or after it, key ranges) at the tiling of the narrowest decode
    width that holds the wider head (192/128 takes 256's); Q.K^T is head_dim wide, P.V, O and the
    merge head_dim_v. The wgmma kernels still write whole outputs: refused by name there."""
    from fagen import variants
    from fagen.spec import Mask, ScoreMod, SpecError, with_fix

    rows = max(variants.DECODE_HEAD_DIMS[wider])
    spec = variants.decode_spec(dtype, d, rows, Mask(kind="causal"), ScoreMod(softcap=30.0), dv)
    square = variants.decode_spec(dtype, wider, rows, Mask(kind="causal"), ScoreMod(softcap=30.0))
    assert (spec.head_dim, spec.dv, spec.arch) == (d, dv, square.arch)
    assert spec.tiling == square.tiling and spec.tiling.pack_gqa and spec.outputs.partial
    assert spec.name.startswith(variants.decode_spec_name(dtype, d, rows, dv))
    p = plan(spec)
    assert p.o_n_frags * 8 == dv and p.qk_k_steps * p.mma_k == d
    merged = variants.merged_variant(spec, sinks=True)
    assert plan(merged).row_quads == dv // 4
    source = render(variants.sequence_variant(merged, "padded", "ranged"))
    assert f"V_CHUNKS_PER_ROW = {dv * 2 // 16};" in source and "copy_tile_async<BLOCK_KV, V_CHUNKS_PER_ROW" in source
    # more packed rows than the wider head's largest decode kernel holds: the plain forward's
    assert variants.decode_spec(dtype, d, rows + 1, head_dim_v=dv) is None
    # the warp-specialised kernels: whole outputs, with a fix that validates
    hopper = {**_spec("value_head_f16_d128_v64_sm90a").model_dump(exclude_none=True), "backward": None}
    with pytest.raises(SpecError, match="outputs") as refused:
        fagen.parse_spec({**hopper, "outputs": {"partial": True}})
    assert not fagen.parse_spec(with_fix({**hopper, "outputs": {"partial": True}}, refused.value.fix)).outputs.partial


@pytest.mark.parametrize("gpu", ["h200", None])
def test_fagen_attention_derives_a_value_head_of_its_own(monkeypatch, gpu):
    """fagen.attention's spec for a v of another width than q's: the default for q's head (the
    next wider head's for 192) as the forward that takes two widths (its own kernel, whole outputs), with its mask; a square 192 and a width the spec refuses are refused by argument."""
    from fagen import device, dispatch
    from fagen.spec import Mask

    monkeypatch.setattr(device, "gpu_slug", lambda: gpu)
    for dtype, d, dv in (("float16", 128, 64), ("bfloat16", 64, 128), ("bfloat16", 192, 128), ("float16", 192, 128)):
        spec = dispatch.derive_spec_for(dtype, d, causal=True, head_dim_v=dv)
        assert (spec.head_dim, spec.dv, spec.dtype, spec.mask) == (d, dv, dtype, Mask(kind="causal")), spec.name
        # the default's own kernel: warp-specialised on the H200 (the producer loads each width's boxes)
        assert spec.warp_specialized == (gpu == "h200") and not spec.outputs.partial and spec.backward is None
        assert spec.name.endswith(f"_v{dv}")
        assert plan(spec).head_dim_v == dv
        if d == 192 and gpu == "h200":
            # causal: head_dim 128's long-class tile (three consumer warpgroups in ping-pong), at every
            # length, walked persistently (a causal mask's uneven tiles are claimed)
            long = dispatch.derive_spec_for(dtype, d, causal=True, head_dim_v=dv, keys=4096)
            for causal_spec in (spec, long):
                assert (causal_spec.tiling.block_q, causal_spec.tiling.block_kv) == (192, 80), causal_spec.name
                assert causal_spec.pipeline.pingpong and plan(causal_spec).claimed_walk
            assert long.name.endswith("_long_h200_d192_q192_kv80_v128")
            # dense: the same tile, its even tiles walked in order
            dense = dispatch.derive_spec_for(dtype, d, head_dim_v=dv, keys=4096)
            assert (dense.tiling.block_q, dense.tiling.block_kv) == (192, 80) and dense.pipeline.pingpong
            assert not plan(dense).claimed_walk
            # a mask it was not measured with keeps FlashAttention-3's tile for 192
            window = dispatch.derive_spec_for(dtype, d, mask={"kind": "sliding_window", "window_left": 256},
                                              head_dim_v=dv, keys=4096)
            assert (window.tiling.block_q, window.tiling.block_kv) == (128, 112), window.name
            # a modifier whose registers the three warpgroups cannot hold keeps 128 x 112
            capped = dispatch.derive_spec_for(dtype, d, causal=True, softcap=30.0, head_dim_v=dv, keys=4096)
            assert (capped.tiling.block_q, capped.tiling.block_kv) == (128, 112), capped.name
        # the same call derives the same spec (the cache keys the width)
        assert dispatch.derive_spec_for(dtype, d, causal=True, head_dim_v=dv) is spec
    assert dispatch.derive_spec_for("float16", 128, causal=True).dv == 128
    with pytest.raises(ValueError, match="q: head_dim 192 is a Q.K\\^T width that comes with a narrower v"):
        dispatch.derive_spec_for("float16", 192, causal=True)
    with pytest.raises(ValueError, match="v: head_dim 96 beside q's and k's 64"):
        dispatch.derive_spec_for("float16", 64, head_dim_v=96)


def test_each_width_feeds_its_own_product_in_the_backward():
    """The backward's plans: dK and S^T over head_dim, dV and dP^T over head_dim_v, and a TMA
    producer's expect_tx the bytes its boxes deliver (each tensor's own width, not the row's);
    the dQ kernel's "O" is dQ, head_dim wide. wgmma: one dK/dV instruction shape a width."""
    from fagen.backward_plan import backward_plan
    from fagen.rendering import render_backward

    for name, d, dv in (("value_head_f16_d192_v128", 192, 128), ("value_head_f16_d128_v64", 128, 64),
                        ("value_head_bf16_d64_v128", 64, 128), ("value_head_bf16_d192_v128_sm90a", 192, 128),
                        ("value_head_f16_d128_v64_sm90a", 128, 64)):
        spec = _spec(name)
        bp = backward_plan(spec)
        k, bwd = bp.dkdv, spec.backward
        assert (k.qk_k_steps, k.v_k_steps, bp.dq_v_k_steps) == (d // 16, dv // 16, dv // 16), name
        assert (k.d_cols, k.dv_cols) == (d // bwd.head_split, dv // bwd.head_split), name
        assert (k.chunks_per_row, k.v_chunks_per_row, bp.chunks_per_row) == (d // 8, dv // 8, dv // 8), name
        assert (k.kv_load_bytes, k.qdo_load_bytes) == (bwd.block_kv * (d + dv) * 2, bwd.block_q * (d + dv) * 2), name
        assert (bp.dq.head_dim_v, bp.dq.o_n_frags) == (d, d // 8), name  # the dQ kernel writes dQ
        text = render_backward(spec)
        if spec.wgmma_backward:
            assert f"m64n{d}k16" in text and f"m64n{dv}k16" in text, name
            assert "issue_keys_queries<V_K_STEPS>(dp[0], v_rows, do_tile)" in text, name
        else:
            assert "mma_rows_rows<M_FRAGS, S_N_FRAGS, V_K_STEPS>(dp, v_tile" in text, name


def test_the_forward_producer_arms_each_width_s_boxes(monkeypatch):
    """The warp-specialised forward with two widths: Q and K load head_dim / 64 boxes, V head_dim_v
    / 64, and each arms the bytes those boxes deliver (rows x 128 bytes a box)."""
    from fagen import device, dispatch

    monkeypatch.setattr(device, "gpu_slug", lambda: "h200")
    for d, dv in ((192, 128), (128, 64), (64, 128)):
        spec = dispatch.derive_spec_for("bfloat16", d, causal=True, head_dim_v=dv)
        p = plan(spec)
        assert spec.warp_specialized and (p.qk_atoms, p.v_atoms) == (d // 64, dv // 64)
        assert p.q_tile_bytes == p.qk_atoms * p.block_q * 128 and p.k_load_bytes == p.qk_atoms * p.block_kv * 128
        assert p.v_load_bytes == p.v_atoms * p.block_kv * 128
        text = render(spec)
        assert "load<BLOCK_KV, V_ATOMS>(v_slot(g - 1)" in text and "K_LOAD_BYTES : 0) + (g >= 1 ? V_LOAD_BYTES" in text


def test_the_dkdv_producer_arms_what_its_boxes_deliver(monkeypatch):
    """The producer-fed dK/dV kernel at 128/64 and 64/128 (trainable's pick on the H200): each tile
    arms K's and V's boxes and each step Q's and dO's, every box 8 rows of its tensor's own width
    (tensor_maps.row_groups), not the smem rows' wider one."""
    from fagen import device, dispatch, tensor_maps, variants
    from fagen.backward_plan import backward_plan
    from fagen.rendering import render_backward

    monkeypatch.setattr(device, "gpu_slug", lambda: "h200")
    for d, dv in ((128, 64), (64, 128)):
        spec = variants.trainable(dispatch.derive_spec_for("bfloat16", d, causal=True, head_dim_v=dv))
        assert spec.backward.warp_specialized is not None, spec.name
        k = backward_plan(spec).dkdv

        def box_bytes(width, rows):
            box = tensor_maps.row_groups((1, 1, 4096, width), (4096 * width, 4096 * width, width, 1), 2, "t").box
            return rows // box[1] * box[0] * box[1] * box[2] * 2

        assert k.kv_load_bytes == box_bytes(d, k.block_kv) + box_bytes(dv, k.block_kv)
        assert k.qdo_load_bytes == box_bytes(d, k.block_q) + box_bytes(dv, k.block_q)
        text = render_backward(spec)
        assert f"constexpr int KV_LOAD_BYTES = {k.kv_load_bytes};" in text
        assert "kv_bars.arm(j, KV_LOAD_BYTES)" in text and "bars.arm(step(t), QDO_LOAD_BYTES + 2 * ROW_BYTES)" in text


def test_the_paged_oracle_reads_a_cache_of_two_widths():
    """k_cache and v_cache of their own widths (DeepSeek's 192/128): each sequence's keys gathered
    from its pages equal the padded oracle over the same keys; caches that differ in more than the
    width are refused."""
    rng = np.random.default_rng(7)
    k_cache, v_cache = rng.standard_normal((6, 16, 2, 192)), rng.standard_normal((6, 16, 2, 128))
    table, lens = np.array([[4, 1, 0], [2, 5, 3]]), np.array([40, 17])
    q = rng.standard_normal((2, 4, 3, 192))
    out = oracle.attention_paged(q, k_cache, v_cache, table, lens, causal=True)
    assert out.shape == (2, 4, 3, 128)
    for b in range(2):
        keys, values = (c[table[b]].reshape(-1, 2, c.shape[-1])[:lens[b]].transpose(1, 0, 2)[None] for c in (k_cache, v_cache))
        assert np.allclose(out[b:b + 1], oracle.attention(q[b:b + 1], keys, values, causal=True))
    with pytest.raises(ValueError, match="num_pages, page_size, Hkv, d_v"):
        oracle.attention_paged(q, k_cache, v_cache[:, :8], table, lens)
