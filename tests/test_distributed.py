"""fagen.distributed's schedules, simulated rank by rank in NumPy against fagen.oracle (CPU only).

Each multi-GPU mode is replayed with the same index arithmetic the GPU code uses (shard_bounds,
zigzag_rows, zigzag_chunks, ring_schedule, reshuffle), the per-rank kernels replaced by the
float64 oracle, and the merged / gathered result compared with the oracle of the whole problem.
"""

from __future__ import annotations

import numpy as np
import pytest

from fagen import oracle
from fagen.distributed import (
    causal_pairs,
    check_rank,
    imbalance,
    merge_numpy,
    own_block_pieces,
    reshuffle,
    ring_schedule,
    ring_step_work,
    share_rows,
    shard_bounds,
    work_per_rank,
    zigzag_chunks,
    zigzag_order,
    zigzag_rows,
)

B, H, D = 2, 3, 16
RINGS = (1, 2, 3, 4)
LENGTHS = (64, 61, 7, 5, 3, 1)  # divisible by 2 * ring, not, and n < 2 * ring (empty chunks)
ATOL = 1e-12


def rand(*shape, rng=None):
    rng = np.random.default_rng() if rng is None else rng
    return rng.standard_normal(shape)


def qkv(n_q, n_kv, rng=None):
    rng = np.random.default_rng() if rng is None else rng
    return rand(B, H, n_q, D, rng=rng), rand(B, H, n_kv, D, rng=rng), rand(B, H, n_kv, D, rng=rng)


def close(a, b, atol=ATOL):
    """Equal within atol, with -inf where the other has -inf."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    inf_a, inf_b = np.isneginf(a), np.isneginf(b)
    assert np.array_equal(inf_a, inf_b), f"-inf at {np.argwhere(inf_a != inf_b)[:5].tolist()}"
    assert np.all(np.isfinite(a[~inf_a])) and np.all(np.isfinite(b[~inf_b]))
    np.testing.assert_allclose(a[~inf_a], b[~inf_b], rtol=0, atol=atol)


def empty_partial(n_q):
    """What an empty shard contributes: O = 0, LSE = -inf."""
    return np.zeros((B, H, n_q, D)), np.full((B, H, n_q), -np.inf)


# ---- 1. shard_bounds -------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 16, 61, 64, 100])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5, 8, 17])
def test_shard_bounds_cover_contiguously(n, parts):
    bounds = shard_bounds(n, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (s0, e0), (s1, _) in zip(bounds, bounds[1:]):
        assert e0 == s1
    sizes = [e - s for s, e in bounds]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1 and sum(sizes) == n
    extra = n % parts
    assert sizes == [n // parts + 1] * extra + [n // parts] * (parts - extra)


@pytest.mark.parametrize("parts", [0, -1, -5])
def test_shard_bounds_refuses_no_parts(parts):
    with pytest.raises(ValueError, match="parts"):
        shard_bounds(10, parts)


# ---- 2. zigzag -------------------------------------------------------------------------------

@pytest.mark.parametrize("ring", [1, 2, 3, 4, 8])
def test_zigzag_chunks(ring):
    seen = []
    for r in range(ring):
        a, b = zigzag_chunks(r, ring)
        assert (a, b) == (r, 2 * ring - 1 - r)
        assert a < b  # the cheap early chunk first, then its expensive partner
        seen += [a, b]
    assert sorted(seen) == list(range(2 * ring))


@pytest.mark.parametrize("ring", RINGS)
@pytest.mark.parametrize("n", LENGTHS + (0, 2))
def test_zigzag_rows_and_order(n, ring):
    chunks = shard_bounds(n, 2 * ring)
    rows = []
    for r in range(ring):
        got = zigzag_rows(n, r, ring)
        assert got == [chunks[r], chunks[2 * ring - 1 - r]]
        rows += [i for s, e in got for i in range(s, e)]
    order = zigzag_order(n, ring)
    assert order.tolist() == rows
    assert sorted(order.tolist()) == list(range(n))  # a permutation of range(n)
    if ring == 1:
        assert order.tolist() == list(range(n))


@pytest.mark.parametrize("ring", RINGS)
@pytest.mark.parametrize("n", LENGTHS)
def test_reshuffle_restores_sequence_order(n, ring):
    x = rand(B, H, n, D)
    lse = rand(B, H, n)
    gathered = np.concatenate([x[:, :, s:e] for r in range(ring) for s, e in zigzag_rows(n, r, ring)], axis=2)
    np.testing.assert_array_equal(reshuffle(gathered, n, ring), x)
    np.testing.assert_array_equal(reshuffle(gathered, n, ring, axis=2), x)
    gathered_lse = np.concatenate([lse[:, :, s:e] for r in range(ring) for s, e in zigzag_rows(n, r, ring)], axis=2)
    np.testing.assert_array_equal(reshuffle(gathered_lse, n, ring, axis=-1), lse)
    if ring == 1:
        np.testing.assert_array_equal(gathered, x)


@pytest.mark.parametrize("rank, world", [(0, 0), (1, 1), (2, 2), (4, 3), (-1, 2), (0, -1), (-1, 0)])
def test_check_rank_refuses(rank, world):
    with pytest.raises(ValueError, match="rank"):
        check_rank(rank, world)
    if world >= 1:
        with pytest.raises(ValueError):
            zigzag_chunks(rank, world)


@pytest.mark.parametrize("world", [1, 2, 5])
def test_check_rank_accepts(world):
    for rank in range(world):
        check_rank(rank, world)


# ---- 3. mode 1: batch sharding ---------------------------------------------------------------

@pytest.mark.parametrize("world", RINGS)
@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_batch_sharded(world, batch, causal):
    rng = np.random.default_rng()
    n_q, n_kv = 9, 13
    q, k, v = rng.standard_normal((batch, H, n_q, D)), rng.standard_normal((batch, H, n_kv, D)), \
        rng.standard_normal((batch, H, n_kv, D))
    bounds = shard_bounds(batch, world)
    per = bounds[0][1] - bounds[0][0]
    locals_ = []
    for lo, hi in bounds:  # each rank's padded local buffer, as batch_sharded all-gathers it
        local = np.full((per, H, n_q, D), np.nan)
        if hi > lo:
            local[: hi - lo] = oracle.attention(q[lo:hi], k[lo:hi], v[lo:hi], causal=causal)
        locals_.append(local)
    gathered = np.stack(locals_)
    out = np.concatenate([gathered[r, : e - s] for r, (s, e) in enumerate(bounds)], axis=0)
    close(out, oracle.attention(q, k, v, causal=causal))


# ---- 4. mode 2: sequence sharding, deferred sync ---------------------------------------------

def sequence_partials(q, k, v, world, causal):
    """Rank r's (O_r, LSE_r) over its keys shard_bounds(n_kv, world)[r], masked in global positions."""
    n_q, n_kv = q.shape[2], k.shape[2]
    o_parts, lse_parts = [], []
    for kv0, kv1 in shard_bounds(n_kv, world):
        if kv1 == kv0:
            o, lse = empty_partial(n_q)
        else:
            mask_mod = (lambda b, h, qi, ki, kv0=kv0: (ki + kv0) <= qi + (n_kv - n_q)) if causal else None
            o, lse = oracle.attention(q, k[:, :, kv0:kv1], v[:, :, kv0:kv1], mask_mod=mask_mod, return_lse=True)
        o_parts.append(o)
        lse_parts.append(lse)
    return np.stack(o_parts), np.stack(lse_parts)


def deferred_sync(o_parts, lse_parts, sinks=None):
    """Mode 2's sync written out: m = max over ranks (and the sink), w_r = exp(LSE_r - m),
    O = sum w_r O_r / (sum w_r + exp(sink - m)), LSE = m + log(...)."""
    m = lse_parts.max(axis=0)
    sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None]
    if sink is not None:
        m = np.maximum(m, sink)
    seen = np.isfinite(m)
    m0 = np.where(seen, m, 0.0)
    w = np.exp(lse_parts - m0)
    num = (w[..., None] * o_parts).sum(axis=0)
    den = w.sum(axis=0) + (np.exp(sink - m0) if sink is not None else 0.0)
    out = np.where(seen[..., None], num / np.where(seen, den, 1.0)[..., None], 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m0 + np.log(np.where(seen, den, 1.0)), -np.inf)
    return out, lse


SEQ_SHAPES = [(64, 64), (61, 61), (7, 7), (3, 3), (5, 61), (61, 5), (7, 2), (16, 3)]


@pytest.mark.parametrize("world", RINGS)
@pytest.mark.parametrize("n_q, n_kv", SEQ_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_sequence_sharded(world, n_q, n_kv, causal, with_sinks):
    rng = np.random.default_rng()
    q, k, v = qkv(n_q, n_kv, rng)
    sinks = rng.standard_normal(H) * 2 if with_sinks else None
    o_parts, lse_parts = sequence_partials(q, k, v, world, causal)
    out, lse = merge_numpy(o_parts, lse_parts, sinks=sinks)
    ref_out, ref_lse = oracle.attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)
    close(out, ref_out)
    close(lse, ref_lse)
    d_out, d_lse = deferred_sync(o_parts, lse_parts, sinks=sinks)
    close(d_out, out, atol=1e-13)
    close(d_lse, lse, atol=1e-13)


def test_sequence_sharded_empty_shards_and_blind_rows():
    """n_kv = 2 over 4 ranks: two empty shards; Nq > Nk causal: rows that see no key at all;
    in between, rows that see no key of some non-empty shard (LSE -inf partials)."""
    rng = np.random.default_rng()
    n_q, n_kv, world = 6, 2, 4
    q, k, v = qkv(n_q, n_kv, rng)
    assert [e - s for s, e in shard_bounds(n_kv, world)] == [1, 1, 0, 0]
    o_parts, lse_parts = sequence_partials(q, k, v, world, causal=True)
    # rows 0..3 see nothing (j <= i - 4); row 4 sees key 0 only: shard 1's partial is -inf there
    assert np.all(np.isneginf(lse_parts[:, :, :, :4]))
    assert np.all(np.isneginf(lse_parts[1, :, :, 4])) and np.all(np.isfinite(lse_parts[0, :, :, 4]))
    assert np.all(np.isneginf(lse_parts[2:])) and np.all(o_parts[2:] == 0)

    out, lse = merge_numpy(o_parts, lse_parts)
    ref_out, ref_lse = oracle.attention(q, k, v, causal=True, return_lse=True)
    close(out, ref_out)
    close(lse, ref_lse)
    assert np.all(out[:, :, :4] == 0) and np.all(np.isneginf(lse[:, :, :4]))
    assert np.all(np.isfinite(out)) and not np.any(np.isnan(out))

    sinks = rng.standard_normal(H)
    out_s, lse_s = merge_numpy(o_parts, lse_parts, sinks=sinks)
    ref_out_s, ref_lse_s = oracle.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    close(out_s, ref_out_s)
    close(lse_s, ref_lse_s)
    assert np.all(out_s[:, :, :4] == 0)
    np.testing.assert_array_equal(lse_s[:, :, :4], np.broadcast_to(sinks[None, :, None], (B, H, 4)))
    d_out, d_lse = deferred_sync(o_parts, lse_parts, sinks=sinks)
    close(d_out, out_s, atol=1e-13)
    close(d_lse, lse_s, atol=1e-13)


def test_merge_numpy_single_part_is_identity_and_order_free():
    rng = np.random.default_rng()
    q, k, v = qkv(11, 17, rng)
    o, lse = oracle.attention(q, k, v, return_lse=True)
    out, lse1 = merge_numpy(o[None], lse[None])
    close(out, o, atol=1e-14)
    close(lse1, lse, atol=1e-14)
    o_parts, lse_parts = sequence_partials(q, k, v, 3, causal=False)
    perm = rng.permutation(3)
    a = merge_numpy(o_parts, lse_parts)
    b = merge_numpy(o_parts[perm], lse_parts[perm])
    close(a[0], b[0], atol=1e-13)
    close(a[1], b[1], atol=1e-13)


# ---- 5. mode 3: zigzag ring, K/V everywhere --------------------------------------------------

@pytest.mark.parametrize("world", RINGS)
@pytest.mark.parametrize("n", LENGTHS)
def test_zigzag_attention(world, n):
    rng = np.random.default_rng()
    q, k, v = qkv(n, n, rng)
    chunks = shard_bounds(n, 2 * world)
    per = chunks[0][1] - chunks[0][0]  # the largest chunk
    full_keep = oracle.causal_mask(n, n)
    locals_ = []
    for r in range(world):
        local = np.full((B, H, 2 * per, D), np.nan)
        at = 0
        for s, e in zigzag_rows(n, r, world):  # written contiguously: first chunk, then second
            assert e - s <= per
            if e > s:
                # keys past the chunk end are all masked for these rows: K/V tiles there are skipped
                assert not full_keep[s:e, e:].any()
                assert full_keep[e - 1, e - 1]  # and the last row needs every key up to its own
                got = oracle.attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e],
                                       mask_mod=lambda b, h, qi, ki, s=s: ki <= qi + s)
                # the kernel's mask_offset = s is the bottom-right causal of the [e - s, e] problem
                close(got, oracle.attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e], causal=True), atol=1e-14)
                local[:, :, at:at + e - s] = got
            at += e - s
        locals_.append(local)
    gathered = np.stack(locals_)  # [world, B, H, 2 * per, d], as all_gather lays it out
    parts = [gathered[r, :, :, : sum(e - s for s, e in zigzag_rows(n, r, world))] for r in range(world)]
    flat = np.concatenate(parts, axis=2)
    assert flat.shape[2] == n and not np.isnan(flat).any()
    out = reshuffle(flat, n, world)
    close(out, oracle.attention(q, k, v, causal=True))


# ---- 6. mode 4: ring attention ---------------------------------------------------------------

def local_rows(x, n, rank, world):
    return np.concatenate([x[:, :, s:e] for s, e in zigzag_rows(n, rank, world)], axis=2)


def positions(n, rank, world):
    """Sequence positions of a rank's local rows (its zigzag chunks, back to back)."""
    return np.concatenate([np.arange(s, e) for s, e in zigzag_rows(n, rank, world)]).astype(int)


def ring_attention_sim(q, k, v, world, causal):
    """Every rank's output rows, replaying ring_attention: ring_schedule's launches, each folded
    into the running (O, LSE) as the accumulating kernel does. Also checks that each launch's
    mask (local causal, or none) is the sequence's causal mask on its rows and keys, and that
    the launches of a rank cover every pair its rows keep exactly once."""
    n = q.shape[2]
    outputs = {}
    for rank in range(world):
        q_local, pos_q = local_rows(q, n, rank, world), positions(n, rank, world)
        running = (np.zeros(q_local.shape), np.full(q_local.shape[:3], -np.inf))
        covered = np.zeros((len(pos_q), n), int)
        steps = ring_schedule(n, rank, world, causal)
        assert [s.source for s in steps] == [(rank - i) % world for i in range(world)]
        for step in steps:
            if step.empty:
                continue
            (q0, q1), (k0, k1) = step.q, step.kv
            k_src, v_src = local_rows(k, n, step.source, world), local_rows(v, n, step.source, world)
            pos_k = positions(n, step.source, world)[k0:k1]
            keep = oracle.causal_mask(q1 - q0, k1 - k0) if step.causal else np.ones((q1 - q0, k1 - k0), bool)
            if causal:  # the launch's mask is the sequence's, on these rows and keys
                assert np.array_equal(keep, pos_k[None, :] <= pos_q[q0:q1, None])
            covered[q0:q1, pos_k] += keep
            o, lse = oracle.attention(q_local[:, :, q0:q1], k_src[:, :, k0:k1], v_src[:, :, k0:k1],
                                      causal=step.causal, return_lse=True)
            o_run, l_run = running[0].copy(), running[1].copy()
            o_run[:, :, q0:q1], l_run[:, :, q0:q1] = merge_numpy(
                np.stack([running[0][:, :, q0:q1], o]), np.stack([running[1][:, :, q0:q1], lse]))
            running = (o_run, l_run)
        want = (np.arange(n)[None, :] <= pos_q[:, None]) if causal else np.ones((len(pos_q), n), bool)
        assert np.array_equal(covered, want.astype(int))  # every kept pair once, nothing else
        outputs[rank] = running[0]
    return outputs


@pytest.mark.parametrize("world", RINGS)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention(world, n, causal):
    rng = np.random.default_rng()
    q, k, v = qkv(n, n, rng)
    outputs = ring_attention_sim(q, k, v, world, causal)
    gathered = np.concatenate([outputs[r] for r in range(world)], axis=2)
    out = reshuffle(gathered, n, world)
    close(out, oracle.attention(q, k, v, causal=causal))


def block_gradients(q, k, v, dout, lse, delta, keep, scale):
    """One launch's share of the gradients given the rows' final LSE and D = rowsum(dO * O):
    P = exp(S - LSE) is then the whole sequence's softmax on these keys."""
    p = np.where(keep, np.exp(q @ k.swapaxes(-1, -2) * scale - lse[..., None]), 0.0)
    ds = p * (dout @ v.swapaxes(-1, -2) - delta[..., None])
    return ds @ k * scale, ds.swapaxes(-1, -2) @ q * scale, p.swapaxes(-1, -2) @ dout


@pytest.mark.parametrize("world", RINGS)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_backward(world, n, causal):
    """ring_attention_backward replayed in lockstep: each rank's launches (ring_schedule, its own
    block in own_block_pieces' two) with its rows' final LSE, dQ added into its rows, each
    launch's dK/dV share written into the rows 0 .. k1 of a block of garbage (NaN), shares
    travelling behind their block as a bundle, one position a rank; after `world` steps every
    bundle is home, and the sum of the own pieces and the bundle over share_rows' rows equals
    the oracle's."""
    rng = np.random.default_rng()
    q, k, v = qkv(n, n, rng)
    dout = rand(B, H, n, D, rng=rng)
    scale = 1 / np.sqrt(D)
    out, lse = oracle.attention(q, k, v, causal=causal, return_lse=True)
    want = oracle.attention_backward(q, k, v, dout, causal=causal)
    delta = (dout * out).sum(-1)
    local = {r: {name: local_rows(x, n, r, world) for name, x in
                 (("q", q), ("k", k), ("v", v), ("dout", dout))} | {"lse": local_rows(lse[..., None], n, r, world)[..., 0],
                                                                   "delta": local_rows(delta[..., None], n, r, world)[..., 0]}
             for r in range(world)}
    most = max(local[r]["k"].shape[2] for r in range(world))
    dq = {r: np.zeros_like(local[r]["q"]) for r in range(world)}

    def launch(r, step, block):
        """The launch's share: dK and dV of `block`'s rows, NaN past the rows it covers."""
        share = np.full((2, B, H, most, D), np.nan)
        if step.empty:
            return share
        (q0, q1), (k0, k1) = step.q, step.kv
        assert k0 == 0
        mine, theirs = local[r], local[block]
        # a causal launch's diagonal at local row = local key
        keep = (np.arange(k0, k1)[None, :] <= np.arange(q0, q1)[:, None] if step.causal
                else np.ones((q1 - q0, k1 - k0), bool))
        g_q, g_k, g_v = block_gradients(mine["q"][:, :, q0:q1], theirs["k"][:, :, k0:k1], theirs["v"][:, :, k0:k1],
                                        mine["dout"][:, :, q0:q1], mine["lse"][:, :, q0:q1],
                                        mine["delta"][:, :, q0:q1], keep, scale)
        dq[r][:, :, q0:q1] += g_q
        share[0, :, :, :k1], share[1, :, :, :k1] = g_k, g_v
        return share

    own = {r: [] for r in range(world)}
    bundles = {r: None for r in range(world)}  # the bundle rank r holds, and whose block it is
    for i in range(world):
        sent = {}
        for r in range(world):
            step = ring_schedule(n, r, world, causal)[i]
            assert step.source == (r - i) % world
            if i == 0:
                first, _ = own_block_pieces(n, r, world, causal)
                assert first.source == r and first.q[0] == 0 == first.kv[0]
                own[r].append(launch(r, first, r))
                continue
            held = bundles[r]
            assert held is None if i == 1 else (held[0] == step.source and len(held[1]) == i - 1)
            sent[(r + 1) % world] = (step.source, (held[1] if held else []) + [launch(r, step, step.source)])
        bundles = sent if i else bundles  # one hop a step
    for r in range(world):
        first, last = own_block_pieces(n, r, world, causal)
        assert last.q == (first.q[1], local[r]["q"].shape[2]) and last.kv[0] == 0
        own[r].append(launch(r, last, r))
        home = bundles[r] if world > 1 else (r, [])
        assert home[0] == r and len(home[1]) == world - 1
        counts = share_rows(n, r, world, causal)
        rows = local[r]["k"].shape[2]
        total = np.zeros((2, B, H, rows, D))
        for share, count in zip(own[r] + home[1], counts, strict=True):
            assert not np.isnan(share[:, :, :, :count]).any()  # the rows it covers, it wrote
            total[:, :, :, :count] += share[:, :, :, :count]
        close(dq[r], local_rows(want["dq"], n, r, world), atol=1e-10)
        close(total[0], local_rows(want["dk"], n, r, world), atol=1e-10)
        close(total[1], local_rows(want["dv"], n, r, world), atol=1e-10)


@pytest.mark.parametrize("world", RINGS)
@pytest.mark.parametrize("n", LENGTHS)
def test_zigzag_attention_backward(world, n):
    """zigzag_attention_backward: each rank's chunks against the keys up to their end (bottom-right
    causal, as its launches), dK/dV summed over the ranks (the all-reduce) equal the oracle's."""
    rng = np.random.default_rng()
    q, k, v = qkv(n, n, rng)
    dout = rand(B, H, n, D, rng=rng)
    want = oracle.attention_backward(q, k, v, dout, causal=True)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for r in range(world):
        for s, e in zigzag_rows(n, r, world):
            if e > s:  # the chunk's own backward: its rows' softmax is whole (keys past e never count)
                got = oracle.attention_backward(q[:, :, s:e], k[:, :, :e], v[:, :, :e], dout[:, :, s:e], causal=True)
                close(got["dq"], want["dq"][:, :, s:e], atol=1e-10)
                dk[:, :, :e] += got["dk"]
                dv[:, :, :e] += got["dv"]
    close(dk, want["dk"], atol=1e-10)
    close(dv, want["dv"], atol=1e-10)


@pytest.mark.parametrize("world", RINGS)
@pytest.mark.parametrize("n", [64 * 8, 1000, 777, 32768])
def test_ring_step_work_counts_the_kept_pairs_and_stays_balanced(world, n):
    work = ring_step_work(n, world)
    assert sum(map(sum, work)) == n * (n + 1) // 2  # every kept pair of the sequence, once
    assert all(imbalance(step) < 0.02 for step in work[1:])  # lengths that do not divide: a row or so
    assert imbalance(work[0]) < 0.02
    full = ring_step_work(n, world, causal=False)
    assert sum(map(sum, full)) == n * n


@pytest.mark.parametrize("world", RINGS)
def test_ring_schedule_balances_causal_work(world):
    """Under causal masking every step but the first computes the same kept pairs on every rank
    (2 * chunk^2), and the first 2 * chunk^2 + chunk: the ring never waits on a slow rank."""
    n = 64 * 2 * world
    c = n // (2 * world)
    for rank in range(world):
        for i, step in enumerate(ring_schedule(n, rank, world, True)):
            rows, keys = step.q[1] - step.q[0], step.kv[1] - step.kv[0]
            pairs = rows * (rows + 1) // 2 if step.causal else rows * keys
            assert pairs == (2 * c * (2 * c + 1) // 2 if i == 0 else 2 * c * c)


@pytest.mark.parametrize("world", RINGS)
@pytest.mark.parametrize("n", LENGTHS)
def test_chunk_pairs_are_skipped_full_or_diagonal(world, n):
    """What ring_schedule builds on: under causal masking a query chunk sees an earlier chunk
    whole, a later one not at all, and itself as a causal square."""
    chunks = shard_bounds(n, 2 * world)
    keep = oracle.causal_mask(n, n)
    for qc in range(2 * world):
        for kc in range(2 * world):
            kind = "skip" if kc > qc else "diagonal" if kc == qc else "full"
            (qs, qe), (ks, ke) = chunks[qc], chunks[kc]
            kept = causal_pairs((qs, qe), (ks, ke))
            assert kept == int(keep[qs:qe, ks:ke].sum())
            rows, keys = qe - qs, ke - ks
            if kind == "skip":
                assert kept == 0
            elif kind == "full":
                assert kept == rows * keys
            else:
                assert rows == keys and kept == rows * (rows + 1) // 2


# ---- 7. balance ------------------------------------------------------------------------------

def brute_causal_pairs(rows, keys):
    return sum(1 for q in range(*rows) for k in range(*keys) if k <= q)


def test_causal_pairs_brute_force():
    rng = np.random.default_rng()
    for _ in range(300):
        a, b = sorted(rng.integers(0, 40, 2).tolist())
        c, d = sorted(rng.integers(0, 40, 2).tolist())
        assert causal_pairs((a, b), (c, d)) == brute_causal_pairs((a, b), (c, d))
    for n in (0, 1, 7, 30):
        assert causal_pairs((0, n), (0, n)) == n * (n + 1) // 2


@pytest.mark.parametrize("n", [1, 7, 61, 64, 4096, 4099])
@pytest.mark.parametrize("ring", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("schedule", ["zigzag", "contiguous"])
def test_work_totals(n, ring, schedule):
    work = work_per_rank(n, ring, schedule)
    assert len(work) == ring and sum(work) == n * (n + 1) // 2
    flat = work_per_rank(n, ring, schedule, causal=False)
    assert sum(flat) == n * n
    rows = ([sum(e - s for s, e in zigzag_rows(n, r, ring)) for r in range(ring)] if schedule == "zigzag"
            else [e - s for s, e in shard_bounds(n, ring)])
    assert flat == [r * n for r in rows]


@pytest.mark.parametrize("n, ring", [(4096, 8), (4096, 16), (4099, 8), (4099, 16), (4096, 32)])
def test_zigzag_balance(n, ring):
    zig = imbalance(work_per_rank(n, ring, "zigzag"))
    assert 0 <= zig <= 0.05
    if ring == 8:
        assert imbalance(work_per_rank(n, ring, "contiguous")) > 0.5


def test_work_small_exact():
    # n = 8 over 2 ranks: chunks of 2; rank 0 rows 0-1, 6-7: 1+2+7+8; rank 1 rows 2-5: 3+4+5+6
    assert work_per_rank(8, 2, "zigzag") == [18, 18]
    assert work_per_rank(8, 2, "contiguous") == [10, 26]
    assert imbalance([18, 18]) == 0.0
    assert imbalance([10, 26]) == pytest.approx(26 / 18 - 1)
    assert imbalance([0, 0]) == 0.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ring_full_steps_take_the_long_tiling_unmasked(dtype, monkeypatch):
    """Where a long class is shipped (H200, causal), the ring's full steps run its tiling with
    no mask from FOLD_LONG_KEYS keys on; below that, or where there is none, the full-mask spec."""
    from fagen import device, variants
    from fagen.distributed import FOLD_LONG_KEYS, _fold_spec

    monkeypatch.setattr(device, "gpu_slug", lambda: "h200")
    long = variants.shipped_spec(dtype, 128, True, gpu="h200", keys=1 << 20)
    full = variants.shipped_spec(dtype, 128, False, gpu="h200")
    assert long.tiling != full.tiling  # the case this covers
    spec = _fold_spec(dtype, 128, FOLD_LONG_KEYS)
    assert spec.mask.kind == "none" and spec.tiling == long.tiling
    assert _fold_spec(dtype, 128, FOLD_LONG_KEYS - 1) == full
    monkeypatch.setattr(device, "gpu_slug", lambda: "a100")  # no long class shipped for it
    assert _fold_spec(dtype, 128, 1 << 20) == variants.shipped_spec(dtype, 128, False, gpu="a100")
