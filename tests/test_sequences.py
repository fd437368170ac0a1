"""Varlen and paged layouts without a GPU: the spec's rules, the kernel ABI, the rendered source,
registers, the value checks and the oracle's per-sequence reading."""

import numpy as np
import pytest

from fagen import dispatch, nvcc, oracle, variants
from fagen.load import SPECS, load_spec, parse_spec
from fagen.plan import plan, query_tile_slots
from fagen.rendering import render, render_sequence_tiles
from fagen.sequences import check_cu_seqlens, check_pages, check_seqused_k, query_tiles_numpy
from fagen.spec import Mask, ScoreMod, SpecError

ATTN = load_spec(SPECS / "attn_f16_d128.yaml")
DECODE = load_spec(SPECS / "decode_f16_d128.yaml")


@pytest.mark.parametrize("changes, fix", [
    ({"mask": {"kind": "document"}}, "give each document its own sequence"),
    ({"mask": {"kind": "block_mask"}}, "give each document its own sequence"),
    ({"score_mod": {"bias": "matrix"}}, "remove the bias"),
    ({"backward": {}}, "remove backward"),
])
def test_layouts_refuse_what_is_indexed_by_padded_positions(changes, fix):
    data = {**ATTN.model_dump(), **changes, "sequences": {"q": "varlen", "kv": "paged"}}
    with pytest.raises(SpecError) as err:
        parse_spec(data, "test")
    assert "sequences = 'q varlen, kv paged'" in str(err.value) and fix in str(err.value)
    assert "use padded sequences" in str(err.value)


def test_sequence_parameters_follow_the_layouts():
    assert plan(ATTN).sequence_params == ()
    varlen = plan(variants.sequence_variant(ATTN, "varlen", "varlen"))
    assert [n for _, n in varlen.sequence_params] == ["cu_seqlens_q", "total_q", "q_tiles", "batch", "cu_seqlens_k"]
    assert varlen.sequence_tiles and not plan(ATTN).sequence_tiles
    packed = plan(variants.sequence_variant(DECODE, "varlen", "paged"))  # a few rows a sequence: its own grid
    assert not packed.sequence_tiles and "q_tiles" not in [n for _, n in packed.sequence_params]
    paged = plan(variants.sequence_variant(DECODE, "padded", "paged"))
    assert [n for _, n in paged.sequence_params] == ["page_table", "page_table_stride", "max_pages", "page_size",
                                                     "num_pages", "cache_seqlens", "status"]
    assert paged.params[-len(paged.sequence_params):] == paged.sequence_params  # last in the signature
    causal = variants.variant(ATTN, Mask(kind="causal"), ScoreMod())
    assert plan(variants.sequence_variant(causal, "varlen", "varlen")).sequence_offset
    top_left = variants.variant(ATTN, Mask(kind="causal", align="top_left"), ScoreMod())
    assert not plan(variants.sequence_variant(top_left, "varlen", "varlen")).sequence_offset


def test_a_ranged_cache_reads_its_ranges_and_moves_the_diagonal_per_sequence():
    """An unpaged cache read between each sequence's left pad and length: the two index arrays are
    the kernel's last parameters; the warp-specialised producer starts its K/V rows at the pad."""
    ranged = variants.sequence_variant(variants.variant(ATTN, Mask(kind="causal"), ScoreMod()), "padded", "ranged")
    p = plan(ranged)
    assert [n for _, n in p.sequence_params] == ["cache_seqlens", "cache_leftpad"] and p.sequence_offset
    assert ranged.name.endswith("_kvranged") and ranged.backward is None
    source = render(ranged)
    assert "kv_start = min(max(cache_leftpad[b], 0), kv_end)" in source
    assert "k += b * k_sb + (long long)kv_start * k_sn" in source
    h200 = variants.sequence_variant(load_spec(SPECS / "attn_f16_d128_causal_h200.yaml"), "padded", "ranged")
    ws = render(h200)
    assert "kv_start, b, h, h_kv" in ws
    # each tile clamps to the rows k holds, kept before the walk (a persistent block walks many
    # sequences, each narrowing n_kv to its own)
    assert "const int kv_rows = n_kv;" in ws and "min(max(cache_seqlens[b], 0), kv_rows)" in ws
    # the TMA path zeroes a last tile's V rows past the keys, one named barrier a consumer warpgroup;
    # the copying paths load zeros there already, and padded TMA maps fill them
    assert plan(h200).clears_rows_past_keys and ws.count("kv.clear_v_rows(") == 2
    assert "clear_v_rows" not in source and not plan(ranged).clears_rows_past_keys
    assert "clear_v_rows" not in render(load_spec(SPECS / "attn_f16_d128_causal_h200.yaml"))
    persistent = parse_spec({**h200.model_dump(), "name": "ranged_persistent", "pipeline": {
        **h200.pipeline.model_dump(), "warp_specialized": {**h200.pipeline.warp_specialized.model_dump(),
                                                           "persistent": True}}}, "test")
    assert plan(persistent).persistent and "const int kv_rows = n_kv;" in render(persistent)


def test_the_oracle_reads_an_unpaged_cache_per_sequence():
    """Each sequence's slots cache_leftpad[b] .. cache_seqlens[b] as its own attention, bottom right;
    an empty range gives O = 0 and LSE = -inf; the ranges' rules are the runtime's."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 4, 5, 16)), rng.standard_normal((3, 9, 2, 16)), rng.standard_normal((3, 9, 2, 16))
    ends, starts = [9, 7, 4], [0, 2, 4]
    out, lse = oracle.attention_cache(q, k, v, ends, starts, causal=True, return_lse=True)
    for b in range(2):
        keys = [x[b:b + 1, starts[b]:ends[b]].transpose(0, 2, 1, 3) for x in (k, v)]
        ref, ref_lse = oracle.attention(q[b:b + 1], *keys, causal=True, return_lse=True)
        np.testing.assert_allclose(out[b:b + 1], ref, atol=1e-12)
        np.testing.assert_allclose(lse[b:b + 1], ref_lse, atol=1e-12)
    assert not out[2].any() and np.isneginf(lse[2]).all()
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 10: must be in 0..9"):
        oracle.attention_cache(q, k, v, [10, 7, 4])
    with pytest.raises(ValueError, match=r"cache_leftpad\[1\] = 8: must be in 0..cache_seqlens\[b\]"):
        oracle.attention_cache(q, k, v, ends, [0, 8, 0])


def test_a_persistent_walk_over_uneven_tiles_claims_them():
    """Where tiles' costs differ (a varlen batch's table, a causal mask's tiles) a persistent
    kernel's blocks claim their tiles from a counter (one more parameter, one more smem word, the
    claim in the producer's loop, the counters zeroed again by the last block); even tiles, and a
    block a tile, take theirs from the grid."""
    causal = load_spec(SPECS / "attn_f16_d128_causal_h200.yaml")
    walk = variants.sequence_variant(causal, "varlen", "varlen")
    for spec in (causal, walk):
        claimed = plan(spec)
        assert claimed.claimed_walk and claimed.persistent
        assert claimed.scheduler_params[-1] == ("unsigned* __restrict__", "tiles_claimed")
        source = render(spec)
        assert "t = scheduler.claim(tiles_claimed)" in source and "kv.next_tile()" in source
        assert "scheduler.release(tiles_claimed);" in source
        assert "atomicAdd(claimed + 1, 1u) == gridDim.x - 1" in source
    static = causal.model_copy(update={"mask": Mask(kind="none")})  # the same kernel, dense
    even = plan(static)
    assert even.persistent and not even.claimed_walk  # dense: every tile costs the same
    assert "tiles_claimed" not in [n for _, n in even.params] and "scheduler.claim" not in render(static)
    assert plan(causal).smem_bytes - even.smem_bytes == 8
    dense = plan(variants.sequence_variant(load_spec(SPECS / "attn_f16_d128_h200.yaml"), "varlen", "varlen"))
    assert not dense.persistent and not dense.claimed_walk  # even tiles: a block a tile


def test_the_tile_table_zeroes_both_walk_counters():
    """The table kernel zeroes the claim count and the count of blocks done claiming, which the
    walk's last block compares against the grid."""
    assert "claimed[0] = claimed[1] = 0;" in render_sequence_tiles()


def test_seqused_k_counts_each_sequence_s_keys_from_its_row():
    """FlashAttention's seqused_k: only with varlen K/V; two more parameters, each sequence's key
    count clamped to k's rows in the kernel; the host check names the sequence and the rule."""
    with pytest.raises(SpecError, match="sequences.seqused_k = True: with kv 'paged'"):
        parse_spec({**ATTN.model_dump(), "sequences": {"q": "varlen", "kv": "paged", "seqused_k": True}}, "test")
    used = variants.sequence_variant(ATTN, "varlen", "varlen", seqused_k=True)
    assert used.name == "attn_f16_d128_qvarlen_kvvarlen_seqused"
    assert [n for _, n in plan(used).sequence_params] == ["cu_seqlens_q", "total_q", "q_tiles", "batch", "cu_seqlens_k",
                                                          "seqused_k", "total_k"]
    source = render(used)
    assert "n_kv = max(0, min(seqused_k[b], total_k - kv_start));" in source
    assert "seqused_k[b]" not in render(variants.sequence_variant(ATTN, "varlen", "varlen"))
    check_seqused_k(np.array([5, 7]), np.array([0, 0, 7]), 7, 7)  # two sequences over the same keys
    for used_k, fix in (([-1, 7], "must be >= 0"), ([5, 8], "must end within k's 7 rows"),
                        ([5, 7], "must be <= max_seqlen_k = 6")):
        with pytest.raises(ValueError, match=fix):
            check_seqused_k(np.array(used_k), np.array([0, 0, 7]), 7, 6 if "max" in fix else 7)


def test_the_oracle_reads_seqused_k_as_each_sequence_s_keys():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((9, 2, 8)), rng.standard_normal((6, 1, 8)), rng.standard_normal((6, 1, 8))
    got = oracle.attention_varlen(q, k, v, [0, 4, 9], [0, 0, 6], seqused_k=[3, 6], causal=True)
    for rows, keys in ((slice(0, 4), slice(0, 3)), (slice(4, 9), slice(0, 6))):
        one = oracle.attention(*(x[s].transpose(1, 0, 2)[None] for x, s in ((q, rows), (k, keys), (v, keys))),
                               causal=True)
        np.testing.assert_allclose(got[rows], one[0].transpose(1, 0, 2))


def test_a_varlen_batch_takes_the_long_class_where_it_walks_persistently(monkeypatch):
    """class_keys: a varlen batch's average keys pick its shape class as a padded call's keys do;
    batch_spec keeps a long class where it was measured ahead of the base class on varlen batches
    (d64 and d256 on an H200, walking persistently), not at d128 (its 192-row tiles lose at an
    average of 2k keys), nor below LONG_KEYS."""
    from fagen import device, sequences
    from fagen.device import DeviceTensor

    monkeypatch.setattr(device, "gpu_slug", lambda: "h200")

    def batch(dtype, d, b, total, kv="varlen", seqused=False):
        t = DeviceTensor(None, "torch", 0, (b, 8, total // b, d), (0, 8 * d, d, 1), dtype, 0)
        arguments = {"total_q": total, "total_k": total, **({"seqused_k": 0} if seqused else {})}
        return sequences.Batch(t, t, t, "varlen", kv, arguments, ())

    assert dispatch.class_keys(batch("float16", 64, 4, 16384)) == 4096
    assert dispatch.class_keys(batch("float16", 64, 4, 16384, kv="paged")) is None
    assert dispatch.class_keys(batch("float16", 64, 4, 16384, seqused=True)) is None
    pick = lambda *a: dispatch.batch_spec(batch(*a), causal=True, mask=None, softcap=None, alibi_slopes=None,  # noqa: E731
                                         sinks=None).name
    assert pick("bfloat16", 64, 4, 16384) == "attn_bf16_d64_causal_long_h200_qvarlen_kvvarlen"
    assert pick("bfloat16", 64, 16, 16384) == "attn_bf16_d64_causal_h200_qvarlen_kvvarlen"  # 1024 keys
    assert pick("float16", 128, 4, 16384) == "attn_f16_d128_causal_h200_qvarlen_kvvarlen"
    assert dispatch.class_keys(batch("float16", 128, 4, 16384)) is None
    assert pick("bfloat16", 256, 4, 16384) == "attn_bf16_d256_causal_long_h200_qvarlen_kvvarlen"
    assert pick("bfloat16", 256, 16, 16384) == "attn_bf16_d256_causal_h200_qvarlen_kvvarlen"  # 1024 keys


def test_variant_names_say_the_layouts():
    assert variants.sequence_variant(ATTN, "varlen", "varlen").name == "attn_f16_d128_qvarlen_kvvarlen"
    assert variants.sequence_variant(DECODE, "padded", "paged").name == "decode_f16_d128_kvpaged"
    assert variants.sequence_variant(ATTN) is ATTN


def test_sources_read_only_what_their_layout_uses():
    padded = render(ATTN)
    assert "cu_seqlens" not in padded and "PageTable" not in padded and "return;  // past" not in padded
    varlen = render(variants.sequence_variant(ATTN, "varlen", "varlen"))
    assert "n_q = cu_seqlens_q[b + 1] - q_start" in varlen and "lse + (long long)h * total_q + q_start" in varlen
    assert "PageTable" not in varlen and "if (q0 >= n_q) return;" not in varlen  # no tile past a sequence's end
    assert ("const int2 seq_tile = q_tiles != nullptr ? q_tiles[blockIdx.y] : numbered_tile(cu_seqlens_q, batch, "
            "blockIdx.y, gridDim.y);") in varlen and "if (seq_tile.x < 0) return;" in varlen
    assert "const int q0 = seq_tile.y;" in varlen and "h = blockIdx.x" in varlen and "bh / heads_q" not in varlen
    paged = render(variants.sequence_variant(DECODE, "varlen", "paged"))
    assert "struct PageTable" in paged and "copy_paged_tile_async<BLOCK_KV>" in paged
    assert "n_kv = pages.keys(cache_seqlens[b])" in paged and "if (q0 >= rows.n) return;" in paged
    # K's copy reads the thread's page id of the next tile ahead; V's reuses K's
    assert "ids, true);" in paged and "ids, false);" in paged and "if (read_ahead) ids.read_ahead(" in paged


# decode: a group of rows a thread; d64 H200 (176-192 keys): a shuffled address a group; d96: a chunk at a time
@pytest.mark.parametrize("base", ["decode_f16_d128", "attn_f16_d128_h200", "attn_f16_d64_h200", "attn_bf16_d96"])
def test_layout_variants_compile_without_spills(base):
    spec = variants.variant(load_spec(SPECS / f"{base}.yaml"), Mask(kind="sliding_window", window_left=1000),
                            ScoreMod(softcap=30.0, alibi="slopes"))
    specs = [variants.sequence_variant(spec, "varlen", "varlen"), variants.sequence_variant(spec, "varlen", "paged")]
    for s, res in zip(specs, nvcc.compile_many([(s, nvcc.archs(s)[-1]) for s in specs])):
        assert res.spill_stores == 0 and res.spill_loads == 0, (s.name, res.log)


@pytest.mark.parametrize("cu, message", [
    ([1, 5, 9], r"cu_seqlens_q\[0\] = 1: must be 0"),
    ([0, 6, 5, 9], r"non-decreasing: cu_seqlens_q\[2\] = 5 < cu_seqlens_q\[1\] = 6"),
    ([0, 5, 8], r"cu_seqlens_q\[-1\] = 8, but q has 9 rows"),
    ([0, 1, 9], "max_seqlen_q = 6, but sequence 1 has 8 rows"),
])
def test_cu_seqlens_values_are_checked(cu, message):
    with pytest.raises(ValueError, match=message):
        check_cu_seqlens(np.array(cu), 9, 6, "q")
    check_cu_seqlens(np.array([0, 4, 4, 9]), 9, 5, "q")  # an empty sequence is fine


def test_page_table_values_are_checked():
    table = np.array([[3, 1, -1], [0, 2, 9]])
    check_pages(table, np.array([32, 32]), 4, 16)  # unused entries (-1, 9) are never read
    with pytest.raises(ValueError, match=r"page_table\[1, 2\] = 9: not a page of the cache \(0..3\); sequence 1 "
                                         r"reads it for keys 32..33"):
        check_pages(table, np.array([32, 34]), 4, 16)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 49: must be in 0..48"):
        check_pages(table, np.array([49, 0]), 4, 16)


def test_the_oracle_reads_varlen_and_paged_batches_per_sequence():
    rng = np.random.default_rng(0)
    lens_q, lens_k, d = [5, 9, 1], [7, 9, 0], 16
    cu_q, cu_k = np.cumsum([0, *lens_q]), np.cumsum([0, *lens_k])
    q = rng.standard_normal((cu_q[-1], 4, d))
    k, v = rng.standard_normal((cu_k[-1], 2, d)), rng.standard_normal((cu_k[-1], 2, d))
    out, lse = oracle.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    for b in range(2):
        sq, sk, sv = (x[c[b]:c[b + 1]].transpose(1, 0, 2)[None] for x, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        ref, ref_lse = oracle.attention(sq, sk, sv, causal=True, return_lse=True)
        assert np.allclose(out[cu_q[b]:cu_q[b + 1]].transpose(1, 0, 2), ref[0]) and np.allclose(lse[:, cu_q[b]:cu_q[b + 1]], ref_lse[0])
    assert (out[cu_q[2]:] == 0).all() and np.isneginf(lse[:, cu_q[2]:]).all()  # no keys
    # a paged cache holding the same keys, pages shuffled
    pages = np.zeros((6, 16, 2, d))
    table = np.array([[4, 0], [2, 5], [1, 3]])
    for b in range(3):
        keys = np.zeros((32, 2, d))
        keys[:lens_k[b]] = k[cu_k[b]:cu_k[b + 1]]
        pages[table[b, 0]], pages[table[b, 1]] = keys[:16], keys[16:]
    assert np.allclose(oracle.attention_paged(q, pages, pages, table, lens_k, cu_seqlens_q=cu_q, causal=True),
                       oracle.attention_varlen(q, k, k, cu_q, cu_k, causal=True))


def test_the_query_tile_table_holds_every_tile_of_the_batch():
    """query_tile_slots bounds the batch's tiles; each sequence's entries lie together and cover
    its rows once, latest first; the longest sequences come first; entries past them say no tile."""
    rng = np.random.default_rng(11)
    for _ in range(300):
        b, block_q = int(rng.integers(1, 40)), int(rng.choice([64, 128, 192]))
        lengths = rng.integers(0, 700, b) * (rng.random(b) > 0.2)  # some sequences empty
        cu = np.concatenate([[0], np.cumsum(lengths)])
        slots = query_tile_slots(int(cu[-1]), b, block_q)
        table = query_tiles_numpy(cu, block_q, slots)
        tiles = sum(-(-int(n) // block_q) for n in lengths)
        assert table.shape == (slots, 2) and tiles <= slots
        assert (table[:tiles, 0] >= 0).all() and (table[tiles:] == [-1, 0]).all()
        assert_sequence_runs(table[:tiles], lengths, block_q)
    # sequences past the last count share it, in order
    capped = query_tiles_numpy(np.array([0, 640, 1280, 1408]), 64, 40, counts=4)
    assert [tuple(r) for r in capped[:22]] == [(0, q) for q in range(576, -1, -64)] + \
        [(1, q) for q in range(576, -1, -64)] + [(2, 64), (2, 0)]


def assert_sequence_runs(table: np.ndarray, lengths, block_q: int) -> None:
    """A tile table's real entries: each sequence's tiles one run, latest rows first, the runs
    from the longest sequence (also the GPU tests' check of the kernel's table)."""
    runs = []
    for b, q0 in table:
        if not runs or runs[-1][0] != b:
            runs.append((b, []))
        runs[-1][1].append(q0)
    assert len({b for b, _ in runs}) == len(runs)  # one run a sequence
    for b, rows in runs:
        assert rows == list(range(0, int(lengths[b]), block_q))[::-1]
    assert all(len(a[1]) >= len(z[1]) for a, z in zip(runs, runs[1:]))
    assert {b for b, _ in runs} == {b for b, n in enumerate(lengths) if n > 0}


def test_the_tile_table_launch_packs_the_tile_kernel_s_signature():
    """sequences.tile_table packs its launch by SEQUENCE_TILES_PARAMS: they are the rendered
    kernel's parameters, in order, with their C types."""
    import re

    from fagen.rendering import SEQUENCE_TILES, SEQUENCE_TILES_PARAMS, render_sequence_tiles

    signature = re.search(rf"{SEQUENCE_TILES}\(([^)]*)\)", render_sequence_tiles()).group(1)
    params = [p.replace("__restrict__", "").rsplit(None, 1) for p in signature.split(",")]
    assert [(" ".join(ctype.split()), name) for ctype, name in params] == list(SEQUENCE_TILES_PARAMS)
