"""Varlen batches and paged KV caches on the GPU, against the float64 oracle (marked `gpu`).

Lengths are random per case, pages are shuffled, outputs are NaN-poisoned before the launch."""

import zlib

import numpy as np
import pytest

import fagen
from fagen import decode, dispatch, oracle, sequences
from fagen.check import LSE_TOLERANCE, OUT_TOLERANCE, relative_error
from fagen.spec import Mask, ScoreMod

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _randn(rng, shape, dtype):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to("cuda", TORCH_DTYPES[dtype])


def _np(x):
    return x.detach().double().cpu().numpy()


def _int32(values):
    return torch.tensor(np.asarray(values), dtype=torch.int32, device="cuda")


def _nan(shape, dtype):
    return torch.full(shape, float("nan"), dtype=TORCH_DTYPES[dtype], device="cuda")


def _varlen(rng, dtype, lens_q, lens_k, hq, hkv, d):
    cu_q, cu_k = np.cumsum([0, *lens_q]), np.cumsum([0, *lens_k])
    q = _randn(rng, (cu_q[-1], hq, d), dtype)
    k, v = _randn(rng, (cu_k[-1], hkv, d), dtype), _randn(rng, (cu_k[-1], hkv, d), dtype)
    return q, k, v, cu_q, cu_k


def _check(out, lse, ref, ref_lse, dtype):
    assert relative_error(_np(out), ref) < OUT_TOLERANCE[dtype]
    finite = np.isfinite(ref_lse)
    assert relative_error(_np(lse)[finite], ref_lse[finite]) < LSE_TOLERANCE


MASKS = [Mask(), Mask(kind="causal"), Mask(kind="sliding_window", window_left=37, window_right=5),
         Mask(kind="chunked", chunk_size=50), Mask(kind="prefix_lm", prefix_len=20)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_varlen_prefill_matches_the_oracle(dtype, d, mask):
    """Random lengths per sequence, one of them a single query."""
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{d}{mask}".encode()))
    lens_q = [int(x) for x in rng.integers(1, 300, 5)] + [1]
    lens_k = [n + int(rng.integers(0, 200)) for n in lens_q]  # keys >= queries: causal bottom right per sequence
    q, k, v, cu_q, cu_k = _varlen(rng, dtype, lens_q, lens_k, 8, 2, d)
    out = _nan(q.shape, dtype)
    got, lse = fagen.attention_varlen(q, k, v, _int32(cu_q), _int32(cu_k), max(lens_q), max(lens_k), mask=mask,
                                      return_lse=True, out=out)
    assert got is out
    ref, ref_lse = oracle.attention_varlen(_np(q), _np(k), _np(v), cu_q, cu_k, mask=mask, return_lse=True)
    _check(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("widths", [(192, 128), (128, 64), (64, 128)], ids=lambda w: f"d{w[0]}_v{w[1]}")
@pytest.mark.parametrize("mask", MASKS[:3], ids=str)
def test_varlen_prefill_with_two_head_widths_matches_the_oracle(dtype, widths, mask):
    """DeepSeek's prefill as a serving batch takes it: q and k of one width, v (and out) of
    another (head_dim_v), token-major with cu_seqlens; random lengths, one a single query."""
    d, dv = widths
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{widths}{mask}".encode()))
    lens_q = [int(x) for x in rng.integers(1, 400, 4)] + [1]
    lens_k = [n + int(rng.integers(0, 200)) for n in lens_q]
    q, k, _, cu_q, cu_k = _varlen(rng, dtype, lens_q, lens_k, 8, 2, d)
    v = _randn(rng, (k.shape[0], 2, dv), dtype)
    out = _nan((q.shape[0], 8, dv), dtype)
    got, lse = fagen.attention_varlen(q, k, v, _int32(cu_q), _int32(cu_k), max(lens_q), max(lens_k), mask=mask,
                                      return_lse=True, out=out)
    assert got is out
    ref, ref_lse = oracle.attention_varlen(_np(q), _np(k), _np(v), cu_q, cu_k, mask=mask, return_lse=True)
    _check(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("widths", [(192, 128), (64, 128)], ids=lambda w: f"d{w[0]}_v{w[1]}")
def test_a_long_varlen_batch_with_two_head_widths_matches_the_oracle(widths):
    """Sequences of 1.5k-5k keys under causal: the long shape class's persistent kernel, its
    blocks claiming the batch's tiles, at two widths."""
    d, dv = widths
    rng = np.random.default_rng(zlib.crc32(repr(widths).encode()))
    lens = [int(x) for x in rng.integers(1500, 5000, 4)]
    q, k, _, cu_q, cu_k = _varlen(rng, "bfloat16", lens, lens, 8, 2, d)
    v = _randn(rng, (k.shape[0], 2, dv), "bfloat16")
    out = _nan((q.shape[0], 8, dv), "bfloat16")
    _, lse = fagen.attention_varlen(q, k, v, _int32(cu_q), _int32(cu_k), max(lens), max(lens), causal=True,
                                    return_lse=True, out=out)
    ref, ref_lse = oracle.attention_varlen(_np(q), _np(k), _np(v), cu_q, cu_k, causal=True, return_lse=True)
    _check(out, lse, ref, ref_lse, "bfloat16")


@pytest.mark.parametrize("b", [1, 9, 300, 700])  # past one round of the kernel's 256 threads
def test_the_query_tile_table_kernel_matches_numpy(b):
    from fagen.device import as_device_tensor
    from fagen.plan import query_tile_slots
    from tests.test_sequences import assert_sequence_runs

    rng = np.random.default_rng(b)
    lengths = rng.integers(0, 900, b) * (rng.random(b) > 0.2)
    cu = _int32(np.cumsum([0, *lengths]))
    total = int(lengths.sum())
    for block_q in (64, 128, 192):
        table = sequences.query_tiles(cu.data_ptr(), b, block_q, total, as_device_tensor(cu, "cu")).cpu().numpy()
        assert table[-1, 0] == 0  # the claimed walk's count, zeroed
        table = table[:-1]
        want = sequences.query_tiles_numpy(np.cumsum([0, *lengths]), block_q, query_tile_slots(total, b, block_q))
        assert sorted(map(tuple, table)) == sorted(map(tuple, want))  # equal counts' sequences in any order
        tiles = int((want[:, 0] >= 0).sum())
        assert (table[tiles:] == [-1, 0]).all()
        assert_sequence_runs(table[:tiles], lengths, block_q)


def test_the_query_tile_table_is_never_written_past_its_end():
    """cu_seqlens go unchecked with validate=False: lengths summing past total_q fill the table
    and stop at its end (a sentinel row after it stays)."""
    from fagen.rendering import SEQUENCE_TILES
    from fagen.runtime import shared_function

    lengths = [5000, 3000, 7000, -900, 2**30]  # total_q said 100: slots for 100 rows
    cu = _int32(np.cumsum([0, *lengths]))
    slots = 4
    buffer = torch.full((slots + 1, 2), 77, dtype=torch.int32, device="cuda")
    claimed = torch.full((1,), 77, dtype=torch.int32, device="cuda")
    shared_function(SEQUENCE_TILES, 0)((1,), (256,), (np.uint64(cu.data_ptr()), np.int32(len(lengths)), np.int32(128),
                                                  np.int32(slots), np.uint64(buffer.data_ptr()),
                                                  np.uint64(claimed.data_ptr())))
    got = buffer.cpu().numpy()
    assert (got[slots] == 77).all() and set(got[:slots, 0]) <= {0, 1, 2, 4}
    assert int(claimed.item()) == 0  # the claimed walk's count, zeroed


@pytest.mark.parametrize("d", [128, 96])  # a TMA producer (wgmma); mma.sync
def test_varlen_prefill_with_empty_and_many_sequences_matches_the_oracle(d):
    """The grid walks the batch's tiles (tile table): empty sequences have none, and 40
    sequences of mixed lengths leave none out."""
    rng = np.random.default_rng(3)
    lens = [int(x) for x in rng.integers(1, 400, 40)]
    lens[3] = lens[17] = 0
    q, k, v, cu_q, cu_k = _varlen(rng, "float16", lens, lens, 4, 2, d)
    for mask in (Mask(), Mask(kind="causal")):
        out = _nan(q.shape, "float16")
        _, lse = fagen.attention_varlen(q, k, v, _int32(cu_q), _int32(cu_k), max(lens), max(lens), mask=mask,
                                        return_lse=True, out=out)
        ref, ref_lse = oracle.attention_varlen(_np(q), _np(k), _np(v), cu_q, cu_k, mask=mask, return_lse=True)
        _check(out, lse, ref, ref_lse, "float16")


@pytest.mark.parametrize("d, causal", [(128, True), (128, False), (96, True)])  # wgmma (claimed, static); mma.sync
def test_a_call_of_one_wave_numbers_its_own_tiles_with_the_table_s_results(monkeypatch, d, causal):
    """Tiles that fit one wave have no tile table: the kernel numbers them (one launch, no
    counter to claim from); forced onto the table, the same call gives the same bits. A batch of
    more tiles than SMs keeps the table."""
    rng = np.random.default_rng(31 + d + causal)
    lens = [130, 0, 1, 257, 64, 3, 190]
    q, k, v, cu_q, cu_k = _varlen(rng, "float16", lens, lens, 4, 2, d)

    def packed(q, k, v, cu_q, cu_k, lens):
        batch = sequences.varlen_batch(q, k, v, _int32(cu_q), _int32(cu_k), max(lens), max(lens))
        spec = dispatch.batch_spec(batch, causal=causal, mask=None, softcap=None, alibi_slopes=None, sinks=None)
        return sequences.pack(batch, spec)

    assert packed(q, k, v, cu_q, cu_k, lens).first is None
    many = [int(n) for n in rng.integers(100, 400, 300)]
    assert packed(*_varlen(rng, "float16", many, many, 4, 2, d), many).first is not None
    outs = []
    for wave in (True, False):
        monkeypatch.setattr(sequences, "one_wave", lambda tiles, device: wave)
        out = _nan(q.shape, "float16")
        _, lse = fagen.attention_varlen(q, k, v, _int32(cu_q), _int32(cu_k), max(lens), max(lens), causal=causal,
                                        return_lse=True, out=out)
        ref, ref_lse = oracle.attention_varlen(_np(q), _np(k), _np(v), cu_q, cu_k, causal=causal, return_lse=True)
        _check(out, lse, ref, ref_lse, "float16")
        outs.append(out)
    assert torch.equal(*outs)


@pytest.mark.parametrize("d", [128, 96])  # a TMA producer (wgmma, its tiles claimed); mma.sync
def test_varlen_with_seqused_k_lets_sequences_share_keys(d):
    """seqused_k (FlashAttention's): sequence b's keys are seqused_k[b] rows from cu_seqlens_k[b],
    overlapping other sequences' (a zigzag rank's two chunks over one K/V), and none at all."""
    rng = np.random.default_rng(11)
    lens_q, used = [300, 170, 0, 90, 1], [500, 700, 0, 650, 3]
    cu_q, cu_k = np.cumsum([0, *lens_q]), np.array([0, 0, 100, 100, 100, 800])
    q = _randn(rng, (cu_q[-1], 8, d), "float16")
    k, v = _randn(rng, (800, 2, d), "float16"), _randn(rng, (800, 2, d), "float16")
    for mask in (Mask(kind="causal"), Mask()):
        out = _nan(q.shape, "float16")
        _, lse = fagen.attention_varlen(q, k, v, _int32(cu_q), _int32(cu_k), max(lens_q), max(used), mask=mask,
                                        seqused_k=_int32(used), return_lse=True, out=out)
        ref, ref_lse = oracle.attention_varlen(_np(q), _np(k), _np(v), cu_q, cu_k, seqused_k=used, mask=mask,
                                               return_lse=True)
        _check(out, lse, ref, ref_lse, "float16")


def test_a_long_varlen_batch_matches_the_oracle_on_its_shape_class():
    """Sequences averaging LONG_KEYS keys or more take the long class where it walks
    persistently (d64 causal on an H200: sequences.class_keys)."""
    from fagen import device

    rng = np.random.default_rng(12)
    lens = [2500, 1700, 2300]
    q, k, v, cu_q, cu_k = _varlen(rng, "float16", lens, lens, 4, 2, 64)
    batch = sequences.varlen_batch(q, k, v, _int32(cu_q), _int32(cu_k), max(lens), max(lens))
    spec = dispatch.batch_spec(batch, causal=True, mask=None, softcap=None, alibi_slopes=None, sinks=None)
    if device.gpu_slug() == "h200":
        assert "_long_" in spec.name, spec.name
    out = _nan(q.shape, "float16")
    _, lse = fagen.attention_varlen(q, k, v, _int32(cu_q), _int32(cu_k), max(lens), max(lens), causal=True,
                                    return_lse=True, out=out)
    ref, ref_lse = oracle.attention_varlen(_np(q), _np(k), _np(v), cu_q, cu_k, causal=True, return_lse=True)
    _check(out, lse, ref, ref_lse, "float16")


def _lengths(rng, total: int, b: int, most: int, least: int = 0) -> list[int]:
    """b random lengths summing to `total`, each in [least, most]."""
    while True:
        cuts = np.sort(rng.integers(0, total + 1, b - 1))
        lens = np.diff([0, *cuts, total])
        if least <= lens.min() and lens.max() <= most:
            return [int(n) for n in lens]


# (Hq, Hkv, d, each sequence's queries: None for random lengths, 1 for a decode batch, the GQA
# split kernel and its merge), causal
PREPARED_VARLEN = [(8, 2, 128, None, True), (4, 4, 64, None, False), (32, 8, 128, 1, True), (8, 2, 96, None, True)]


@pytest.mark.parametrize("case", PREPARED_VARLEN, ids=lambda c: f"h{c[0]}_{c[1]}_d{c[2]}_q{c[3]}_{'causal' if c[4] else 'full'}")
def test_a_prepared_varlen_call_follows_new_lengths_from_call_to_call(case):
    """fagen.prepare_varlen: calls with new lengths of the same totals (each within the prepared
    maxima, new cu_seqlens tensors, new q, k, v) into NaN-poisoned outputs: the tile table follows
    each call's cu_seqlens_q; each call against the oracle, the C hot path bitwise equal to the
    Python path; attention_varlen(validate=False) takes the same calls through one kept class."""
    hq, hkv, d, per_q, causal = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    b, total_q = 7, 7 if per_q else 1500
    most_q, total_k, most_k = (1, 2100, 900) if per_q else (700, 1500 + 7 * 50, 750)
    mask = Mask(kind="causal") if causal else Mask()

    def batch():
        lens_q = [per_q] * b if per_q else _lengths(rng, total_q, b, most_q)
        lens_k = _lengths(rng, total_k, b, most_k, least=1) if per_q else [n + 50 for n in lens_q]
        return _varlen(rng, "float16", lens_q, lens_k, hq, hkv, d)

    q, k, v, cu_q, cu_k = batch()
    step = fagen.prepare_varlen(q, k, v, _int32(cu_q), _int32(cu_k), most_q, most_k, causal=causal)
    assert step._hot is not None
    kept = sequences.KEPT_VARLEN_CALLS._kept
    kept.clear()
    for call in range(3):
        q, k, v, cu_q, cu_k = batch()
        ref = oracle.attention_varlen(_np(q), _np(k), _np(v), cu_q, cu_k, mask=mask)
        out = _nan(q.shape, "float16")
        assert step(q, k, v, _int32(cu_q), _int32(cu_k), out=out) is out
        assert relative_error(_np(out), ref) < OUT_TOLERANCE["float16"], call
        hot, step._hot = step._hot, None  # the Python path on the same tensors
        again = step(q, k, v, _int32(cu_q), _int32(cu_k))
        step._hot = hot
        assert torch.equal(again, out), call
        got = fagen.attention_varlen(q, k, v, _int32(cu_q), _int32(cu_k), most_q, most_k, causal=causal,
                                     validate=False)
        assert relative_error(_np(got), ref) < OUT_TOLERANCE["float16"], call
    assert len(kept) == 1


def test_a_prepared_varlen_call_refuses_other_tensors_and_replays_in_a_graph():
    rng = np.random.default_rng(21)
    lens = [300, 41, 0, 500]
    q, k, v, cu_q, cu_k = _varlen(rng, "bfloat16", lens, lens, 8, 2, 128)
    used = _int32(lens)
    step = fagen.prepare_varlen(q, k, v, _int32(cu_q), _int32(cu_k), 500, 500, seqused_k=used, causal=True)
    with pytest.raises(ValueError, match="prepare again"):  # another total
        step(q[:-1], k, v, _int32(cu_q), _int32(cu_k), used)
    with pytest.raises(TypeError, match="prepared for 6 tensors"):
        step(q, k, v, _int32(cu_q), _int32(cu_k))
    cupy = pytest.importorskip("cupy")
    with pytest.raises(ValueError, match="reads its index tensors in place"):
        fagen.prepare_varlen(q, k, v, cupy.asarray(cu_q, dtype=cupy.int32), _int32(cu_k), 500, 500)
    cu_q_t, cu_k_t = _int32(cu_q), _int32(cu_k)
    out = _nan(q.shape, "bfloat16")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(q, k, v, cu_q_t, cu_k_t, used, out=out)
    assert step in decode.CAPTURED
    lens = [100, 441, 200, 100]  # new lengths, the same total, written in place
    cu = np.cumsum([0, *lens])
    q.copy_(_randn(rng, q.shape, "bfloat16"))
    cu_q_t.copy_(_int32(cu))
    cu_k_t.copy_(_int32(cu))
    used.copy_(_int32(lens))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = oracle.attention_varlen(_np(q), _np(k), _np(v), cu, cu, causal=True)
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["bfloat16"]


def test_seqused_k_past_k_is_refused_before_launch():
    q, k, v = (torch.zeros(n, 2, 64, dtype=torch.float16, device="cuda") for n in (10, 100, 100))
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 60 \(from row cu_seqlens_k\[1\] = 50\): must end within"):
        fagen.attention_varlen(q, k, v, _int32([0, 5, 10]), _int32([0, 50, 100]), 5, 60, seqused_k=_int32([40, 60]))
    with pytest.raises(ValueError, match=r"seqused_k \(3,\): \[B\] with B = 2"):
        fagen.attention_varlen(q, k, v, _int32([0, 5, 10]), _int32([0, 50, 100]), 5, 60, seqused_k=_int32([1, 2, 3]))


@pytest.mark.parametrize("mod", [ScoreMod(softcap=20.0), ScoreMod(alibi="slopes"), ScoreMod(sinks=True)],
                         ids=lambda m: m.model_dump_json(exclude_defaults=True))
@pytest.mark.parametrize("nq", [1, 200])  # decode (packed split-KV) and prefill
def test_varlen_modifiers_match_the_oracle(mod, nq):
    rng = np.random.default_rng(7 + nq)
    lens_k = [int(x) for x in rng.integers(nq, 3000, 4)]
    q, k, v, cu_q, cu_k = _varlen(rng, "float16", [nq] * 4, lens_k, 16, 4, 128)
    side = {}
    if mod.softcap:
        side["softcap"] = mod.softcap
    if mod.alibi != "none":
        side["alibi_slopes"] = torch.rand(16, device="cuda") * 0.1
    if mod.sinks:
        side["sinks"] = torch.randn(16, device="cuda")
    out = _nan(q.shape, "float16")
    fagen.attention_varlen(q, k, v, _int32(cu_q), _int32(cu_k), nq, max(lens_k), causal=True, out=out, **side)
    ref = oracle.attention_varlen(_np(q), _np(k), _np(v), cu_q, cu_k, causal=True,
                                  **{n: (x.cpu().numpy() if hasattr(x, "cpu") else x) for n, x in side.items()})
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["float16"]


def _paged_cache(rng, dtype, lens, page_size, hkv, d, spare_pages=3, d_v=None):
    """A cache with pages in shuffled order (and spare pages of garbage) and its table; V d_v wide
    where given."""
    need = [-(-n // page_size) for n in lens]
    width = max(need) + 1
    num_pages = sum(need) + spare_pages
    order = rng.permutation(num_pages)
    table = np.full((len(lens), width), -7, np.int64)  # unused entries: never read
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used:used + n]
        used += n
    k = _randn(rng, (num_pages, page_size, hkv, d), dtype)
    v = _randn(rng, (num_pages, page_size, hkv, d_v or d), dtype)
    return k, v, table.astype(np.int32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page_size", [16, 48, 256])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["gqa", "mha"])
def test_paged_decode_matches_the_oracle(dtype, page_size, heads):
    hq, hkv = heads
    rng = np.random.default_rng(page_size + hq)
    lens = [int(x) for x in rng.integers(1, 2500, 6)] + [0]  # a sequence with an empty cache
    k_cache, v_cache, table = _paged_cache(rng, dtype, lens, page_size, hkv, 128)
    q = _randn(rng, (len(lens), hq, 1, 128), dtype)
    out = _nan(q.shape, dtype)
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    _, lse = fagen.attention_with_kvcache(q, k_cache, v_cache, _int32(lens), _int32(table), causal=True,
                                          return_lse=True, out=out, status=status)
    ref, ref_lse = oracle.attention_paged(_np(q), _np(k_cache), _np(v_cache), np.maximum(table, 0), lens, causal=True,
                                          return_lse=True)
    _check(out, lse, ref, ref_lse, dtype)
    assert int(status.item()) == 0


@pytest.mark.parametrize("sinks", [False, True])
def test_a_paged_batch_that_fills_the_gpu_is_one_launch(sinks):
    """Sequences enough that the decode blocks fill the GPU unsplit: the kernel writes out and the
    LSE itself (no partials, no merge), sinks joining there; against the oracle."""
    rng = np.random.default_rng(11)
    lens = [int(x) for x in rng.integers(1, 1200, 40)]
    k_cache, v_cache, table = _paged_cache(rng, "bfloat16", lens, 64, 8, 128)
    q = _randn(rng, (len(lens), 32, 1, 128), "bfloat16")
    sink = torch.randn(32, device="cuda") if sinks else None
    batch = sequences.paged_batch(q, k_cache, v_cache, _int32(table), _int32(lens))
    spec = dispatch.batch_spec(batch, causal=True, mask=None, softcap=None, alibi_slopes=None, sinks=sink)
    assert spec.outputs.partial and dispatch.default_splits(spec, len(lens), 32, 8, 1, 1200) == 1
    out = _nan(q.shape, "bfloat16")
    _, lse = fagen.attention_with_kvcache(q, k_cache, v_cache, _int32(lens), _int32(table), causal=True, sinks=sink,
                                          return_lse=True, out=out)
    ref, ref_lse = oracle.attention_paged(_np(q), _np(k_cache), _np(v_cache), table, lens, causal=True,
                                          sinks=None if sink is None else _np(sink), return_lse=True)
    _check(out, lse, ref, ref_lse, "bfloat16")


# head_dim 64: the shipped tiles; 96: the paged copy's chunk-at-a-time path (a row's chunks do not divide the threads)
@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("mask", [Mask(kind="causal"), Mask(kind="sliding_window", window_left=100)], ids=str)
def test_paged_varlen_chunked_prefill_appends_and_attends(mask, d):
    """Chunked prefill: new tokens are written after each sequence's cached keys, and their
    queries attend to the cache plus themselves (causal bottom right per sequence)."""
    rng = np.random.default_rng(11)
    cached = [300, 0, 77, 1000]
    new = [64, 100, 1, 33]
    k_cache, v_cache, table = _paged_cache(rng, "bfloat16", [c + n for c, n in zip(cached, new)], 64, 4, d)
    cu_q = np.cumsum([0, *new])
    q = _randn(rng, (cu_q[-1], 16, d), "bfloat16")
    k_new, v_new = _randn(rng, (cu_q[-1], 4, d), "bfloat16"), _randn(rng, (cu_q[-1], 4, d), "bfloat16")
    out = _nan(q.shape, "bfloat16")
    fagen.attention_with_kvcache(q, k_cache, v_cache, _int32(cached), _int32(table), k=k_new, v=v_new,
                                 cu_seqlens_q=_int32(cu_q), max_seqlen_q=max(new), mask=mask, out=out)
    lens = [c + n for c, n in zip(cached, new)]
    kc, vc = _np(k_cache), _np(v_cache)
    for b in range(len(cached)):  # the new tokens landed after the cached ones
        rows = np.concatenate([kc[p] for p in table[b]])[cached[b]:lens[b]]
        assert np.array_equal(rows, _np(k_new)[cu_q[b]:cu_q[b + 1]])
    ref = oracle.attention_paged(_np(q), kc, vc, table, lens, cu_seqlens_q=cu_q, mask=mask)
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["bfloat16"]


@pytest.mark.parametrize("widths", [(192, 128), (128, 64)], ids=lambda w: f"d{w[0]}_v{w[1]}")
@pytest.mark.parametrize("page_size", [16, 64])
def test_a_paged_cache_of_two_widths_appends_and_attends(widths, page_size):
    """DeepSeek's 192/128 (and V narrower) in a paged cache: a decode step and a chunk of a few
    tokens a sequence append their keys and values (each its own width) and attend on the decode
    kernels, twice, against the oracle; and a chunk of more rows than the decode kernels hold, on
    the forward's kernel."""
    d, dv = widths
    rng = np.random.default_rng(page_size + d)
    cached = [300, 0, 77, 1000, 5]
    for new in ([1] * 5, [2, 3, 1, 4, 2]):
        lens = [c + n for c, n in zip(cached, new)]
        k_cache, v_cache, table = _paged_cache(rng, "bfloat16", lens, page_size, 4, d, d_v=dv)
        cu_q = np.cumsum([0, *new])
        q = _randn(rng, (cu_q[-1], 16, d), "bfloat16")
        k_new, v_new = _randn(rng, (cu_q[-1], 4, d), "bfloat16"), _randn(rng, (cu_q[-1], 4, dv), "bfloat16")
        for _ in range(2):
            out = _nan((cu_q[-1], 16, dv), "bfloat16")
            fagen.attention_with_kvcache(q, k_cache, v_cache, _int32(cached), _int32(table), k=k_new, v=v_new,
                                         cu_seqlens_q=_int32(cu_q), max_seqlen_q=max(new), causal=True, out=out)
            kc, vc = _np(k_cache), _np(v_cache)
            for b in range(len(cached)):  # the new tokens landed after the cached ones, each at its width
                for cache, rows in ((kc, k_new), (vc, v_new)):
                    landed = np.concatenate([cache[p] for p in table[b]])[cached[b]:lens[b]]
                    assert np.array_equal(landed, _np(rows)[cu_q[b]:cu_q[b + 1]])
            ref = oracle.attention_paged(_np(q), kc, vc, table, lens, cu_seqlens_q=cu_q, causal=True)
            assert relative_error(_np(out), ref) < OUT_TOLERANCE["bfloat16"]
    # a chunk of more rows than the decode kernels hold (32 tokens x 4 heads a KV head): the
    # forward's kernel over the paged cache, its rows copied at each width
    long_chunk, cu_long = _randn(rng, (160, 16, d), "bfloat16"), np.arange(0, 161, 32)
    out = _nan((160, 16, dv), "bfloat16")
    fagen.attention_with_kvcache(long_chunk, k_cache, v_cache, _int32(cached), _int32(table),
                                 cu_seqlens_q=_int32(cu_long), max_seqlen_q=32, causal=True, out=out)
    ref = oracle.attention_paged(_np(long_chunk), _np(k_cache), _np(v_cache), table, cached, cu_seqlens_q=cu_long,
                                 causal=True)
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["bfloat16"]


def test_a_paged_decode_of_two_widths_runs_the_kept_and_prepared_calls():
    """Padded q against a paged 192/128 cache, unvalidated (the kept calls' path from the second
    call on) and through prepare_with_kvcache, each into a NaN-filled out, against the oracle."""
    rng = np.random.default_rng(5)
    lens = [700, 33, 4000]
    k_cache, v_cache, table = _paged_cache(rng, "bfloat16", lens, 64, 4, 192, d_v=128)
    seqlens, pages = _int32(lens), _int32(table)
    step = None
    for _ in range(3):
        q = _randn(rng, (3, 16, 1, 192), "bfloat16")
        ref = oracle.attention_paged(_np(q), _np(k_cache), _np(v_cache), np.maximum(table, 0), lens, causal=True)
        out = _nan((3, 16, 1, 128), "bfloat16")
        fagen.attention_with_kvcache(q, k_cache, v_cache, seqlens, pages, causal=True, out=out, validate=False)
        assert relative_error(_np(out), ref) < OUT_TOLERANCE["bfloat16"]
        step = step or fagen.prepare_with_kvcache(q, k_cache, v_cache, seqlens, pages, causal=True)
        out = _nan((3, 16, 1, 128), "bfloat16")
        step(q, k_cache, v_cache, seqlens, pages, out=out)
        assert relative_error(_np(out), ref) < OUT_TOLERANCE["bfloat16"]


def test_paged_matches_contiguous_decode():
    """The same keys through a paged cache and a contiguous one give the same outputs."""
    rng = np.random.default_rng(3)
    n, page_size = 4000, 32
    k_cache, v_cache, table = _paged_cache(rng, "float16", [n], page_size, 8, 128, spare_pages=0)
    q = _randn(rng, (1, 32, 1, 128), "float16")
    paged = fagen.attention_with_kvcache(q, k_cache, v_cache, _int32([n]), _int32(table))
    idx = torch.as_tensor(table[0, :-(-n // page_size)].astype(np.int64), device="cuda")
    k = k_cache[idx].reshape(-1, 8, 128)[:n].permute(1, 0, 2)[None]
    v = v_cache[idx].reshape(-1, 8, 128)[:n].permute(1, 0, 2)[None]
    contiguous = fagen.attention(q, k.contiguous(), v.contiguous())
    assert relative_error(_np(paged), _np(contiguous)) < 1e-3


def test_a_bad_page_id_reads_nothing_and_is_flagged():
    """validate=False (a graph's path): an id past the cache loads zeros and sets the flag, and
    an over-long cache_seqlens is cut to the table; nothing faults, outputs stay finite."""
    rng = np.random.default_rng(5)
    k_cache, v_cache, table = _paged_cache(rng, "float16", [100, 100], 16, 2, 64)
    table[0, 2] = 1 << 30  # far outside: reading it would fault
    q = _randn(rng, (2, 8, 1, 64), "float16")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = fagen.attention_with_kvcache(q, k_cache, v_cache, _int32([100, 100_000]), _int32(table), status=status,
                                       validate=False)
    torch.cuda.synchronize()
    assert int(status.item()) == sequences.PAGE_OUT_OF_RANGE | sequences.SEQLEN_OVER_TABLE
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match=r"page_table\[0, 2\] = 1073741824: not a page of the cache"):
        fagen.attention_with_kvcache(q, k_cache, v_cache, _int32([100, 100]), _int32(table))
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 100000: must be in 0..128"):
        table[0, 2] = 0
        fagen.attention_with_kvcache(q, k_cache, v_cache, _int32([100, 100_000]), _int32(table))


def test_bad_varlen_inputs_are_refused_before_launch():
    rng = np.random.default_rng(9)
    q, k, v, cu_q, cu_k = _varlen(rng, "float16", [5, 9], [5, 9], 4, 4, 64)
    cases = [
        (dict(cu_seqlens_q=_int32([0, 9, 5])), "cu_seqlens_q must be non-decreasing"),
        (dict(cu_seqlens_k=_int32([0, 5, 13])), r"cu_seqlens_k\[-1\] = 13, but k has 14 rows"),
        (dict(cu_seqlens_q=_int32([1, 5, 14])), r"cu_seqlens_q\[0\] = 1: must be 0"),
        (dict(max_seqlen_q=6), "max_seqlen_q = 6, but sequence 1 has 9 rows"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 14], device="cuda")), "cu_seqlens_q: dtype int64, expected int32"),
        (dict(cu_seqlens_k=_int32([0, 14])), r"cu_seqlens_k = \[2 entries\]: must have cu_seqlens_q's length, B \+ 1 = 3"),
        (dict(q=q[None]), r"varlen takes \[total, Hq, d\]"),
    ]
    base = dict(q=q, k=k, v=v, cu_seqlens_q=_int32(cu_q), cu_seqlens_k=_int32(cu_k), max_seqlen_q=9, max_seqlen_k=9)
    for change, message in cases:
        args = {**base, **change}
        with pytest.raises(ValueError, match=message):
            fagen.attention_varlen(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cu_seqlens_q"),
                                   args.pop("cu_seqlens_k"), args.pop("max_seqlen_q"), args.pop("max_seqlen_k"))


def test_bad_paged_inputs_are_refused_before_launch():
    rng = np.random.default_rng(13)
    k_cache, v_cache, table = _paged_cache(rng, "float16", [40, 70], 16, 2, 64)
    q = _randn(rng, (2, 8, 1, 64), "float16")
    odd = _randn(rng, (8, 24, 2, 64), "float16")
    with pytest.raises(ValueError, match="page_size 24 .* multiple of 16"):
        fagen.attention_with_kvcache(q, odd, odd, _int32([4, 4]), _int32(table[:, :2]))
    with pytest.raises(ValueError, match=r"page_table \(3, \d+\) and cache_seqlens \(2,\): both need B = 2"):
        fagen.attention_with_kvcache(q, k_cache, v_cache, _int32([40, 70]), _int32(np.vstack([table, table[:1]])))
    with pytest.raises(ValueError, match="page_table: dtype int64"):
        fagen.attention_with_kvcache(q, k_cache, v_cache, _int32([40, 70]), torch.as_tensor(table, device="cuda").long())
    with pytest.raises(ValueError, match="cache_seqlens\\[1\\] = 200: must be in 0"):
        fagen.attention_with_kvcache(q, k_cache, v_cache, _int32([40, 200]), _int32(table))


def test_flashinfer_csr_converts_to_a_page_table():
    rng = np.random.default_rng(17)
    lens, page_size = [33, 16, 100], 16
    k_cache, v_cache, table = _paged_cache(rng, "float16", lens, page_size, 2, 64)
    counts = [-(-n // page_size) for n in lens]
    indptr = np.cumsum([0, *counts])
    indices = np.concatenate([table[b, :c] for b, c in enumerate(counts)])
    last = [n - (c - 1) * page_size for n, c in zip(lens, counts)]
    got_table, got_lens = sequences.from_flashinfer(_int32(indptr), _int32(indices), _int32(last), page_size)
    assert got_lens.get().tolist() == lens
    for b, c in enumerate(counts):
        assert got_table[b, :c].get().tolist() == table[b, :c].tolist()
    q = _randn(rng, (3, 8, 2, 64), "float16")
    out = fagen.attention_with_kvcache(q, k_cache, v_cache, torch.as_tensor(got_lens, device="cuda"),
                                       torch.as_tensor(got_table, device="cuda"), causal=True)
    ref = oracle.attention_paged(_np(q), _np(k_cache), _np(v_cache), np.maximum(table, 0), lens, causal=True)
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["float16"]


def test_a_paged_decode_step_replays_in_a_cuda_graph():
    """A serving step: static q, out, cache, table and lengths buffers; the step captured once,
    then replayed after new queries and longer sequences are written into the buffers."""
    rng = np.random.default_rng(21)
    lens = [700, 1500, 64]
    k_cache, v_cache, table = _paged_cache(rng, "bfloat16", [n + 40 for n in lens], 32, 8, 128)
    q = _randn(rng, (3, 32, 1, 128), "bfloat16")
    seqlens, pages = _int32(lens), _int32(table)
    out = _nan(q.shape, "bfloat16")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")

    def step():
        fagen.attention_with_kvcache(q, k_cache, v_cache, seqlens, pages, out=out, status=status, validate=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    q.copy_(_randn(rng, q.shape, "bfloat16"))
    seqlens.copy_(_int32([n + 40 for n in lens]))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = oracle.attention_paged(_np(q), _np(k_cache), _np(v_cache), np.maximum(table, 0), [n + 40 for n in lens])
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["bfloat16"] and int(status.item()) == 0


def test_a_kept_paged_call_captured_through_its_memo_replays_in_a_cuda_graph():
    """validate=False without out: the call's kept class, remembered by the stream's last call, is
    what a capture on that stream takes (its C path, the output from the graph's pool); replayed
    after new queries and longer sequences are written into the buffers."""
    rng = np.random.default_rng(22)
    lens = [300, 900]
    k_cache, v_cache, table = _paged_cache(rng, "float16", [n + 24 for n in lens], 16, 4, 128)
    q = _randn(rng, (2, 16, 1, 128), "float16")
    seqlens, pages = _int32(lens), _int32(table)
    status = torch.zeros(1, dtype=torch.int32, device="cuda")

    def step():
        return fagen.attention_with_kvcache(q, k_cache, v_cache, seqlens, pages, status=status, validate=False)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        step()  # the memo: this stream's last call and its class
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = step()
    q.copy_(_randn(rng, q.shape, "float16"))
    seqlens.copy_(_int32([n + 24 for n in lens]))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = oracle.attention_paged(_np(q), _np(k_cache), _np(v_cache), np.maximum(table, 0), [n + 24 for n in lens])
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["float16"] and int(status.item()) == 0


@pytest.mark.parametrize("shape", [(3, 32, 8, 1), (2, 16, 4, 16), (48, 32, 8, 1)],
                         ids=["merged-in-kernel", "merge-kernel", "unsplit"])
def test_a_prepared_paged_step_follows_its_tensors_from_step_to_step(shape):
    """fagen.prepare_with_kvcache: a decode loop over two layers' caches, its lengths and page
    table rewritten in place between steps (a new page at the end of one sequence), into
    NaN-poisoned outputs: each step against the oracle, the C hot path bitwise equal to the Python
    path, and the page table checked once, at prepare."""
    b, hq, hkv, nq = shape
    rng = np.random.default_rng(b * hq + nq)
    lens = [int(x) for x in rng.integers(300, 3000, b)]
    layers = [_paged_cache(rng, "float16", [n + 64 for n in lens], 64, hkv, 128) for _ in range(2)]
    table = layers[0][2]
    layers = [(k, v) for k, v, _ in layers]  # both layers' caches: one table, as an engine has
    q = _randn(rng, (b, hq, nq, 128), "float16")
    seqlens, pages = _int32(lens), _int32(table)
    step = fagen.prepare_with_kvcache(q, *layers[0], seqlens, pages, causal=True)
    assert step._hot is not None
    assert (step.merge is not None) == (nq == 16)
    for n in (0, 64):  # the second step: every sequence 64 keys longer
        seqlens.copy_(_int32([x + n for x in lens]))
        for k_cache, v_cache in layers:
            q = _randn(rng, q.shape, "float16")
            out = _nan(q.shape, "float16")
            assert step(q, k_cache, v_cache, seqlens, pages, out=out) is out
            ref = oracle.attention_paged(_np(q), _np(k_cache), _np(v_cache), np.maximum(table, 0),
                                         [x + n for x in lens], causal=True)
            assert relative_error(_np(out), ref) < OUT_TOLERANCE["float16"]
            hot, step._hot = step._hot, None  # the Python path on the same tensors
            again = step(q, k_cache, v_cache, seqlens, pages)
            step._hot = hot
            assert torch.equal(again, out)
    assert int(step.status.item()) == 0


def test_a_prepared_paged_step_refuses_other_tensors_and_replays_in_a_graph():
    rng = np.random.default_rng(8)
    lens = [900, 40]
    k_cache, v_cache, table = _paged_cache(rng, "bfloat16", [n + 16 for n in lens], 16, 2, 64)
    q = _randn(rng, (2, 8, 1, 64), "bfloat16")
    seqlens, pages = _int32(lens), _int32(table)
    with pytest.raises(ValueError, match="padded q"):
        fagen.prepare_with_kvcache(q[:, :, 0], k_cache, v_cache, seqlens, pages)
    step = fagen.prepare_with_kvcache(q, k_cache, v_cache, seqlens, pages)
    with pytest.raises(ValueError, match="prepare again"):  # a table of another width
        step(q, k_cache, v_cache, seqlens, _int32(np.pad(table, ((0, 0), (0, 1)))))
    with pytest.raises(ValueError, match="prepare again"):  # int64 lengths
        step(q, k_cache, v_cache, seqlens.long(), pages)
    with pytest.raises(TypeError, match="prepared for 5 tensors"):
        step(q, k_cache, v_cache)
    out = _nan(q.shape, "bfloat16")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(q, k_cache, v_cache, seqlens, pages, out=out)
    assert step in decode.CAPTURED
    q.copy_(_randn(rng, q.shape, "bfloat16"))
    seqlens.copy_(_int32([n + 16 for n in lens]))
    graph.replay()
    torch.cuda.synchronize()
    ref = oracle.attention_paged(_np(q), _np(k_cache), _np(v_cache), np.maximum(table, 0), [n + 16 for n in lens])
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["bfloat16"]


def _ranged_cache(rng, dtype, b, slots, hkv, d, layout):
    """k, v caches [B, slots, Hkv, d]: FlashAttention's layout, or transformers' [B, Hkv, slots, d]
    seen through a transpose (the strides the glue hands over)."""
    if layout == "bshd":
        return _randn(rng, (b, slots, hkv, d), dtype), _randn(rng, (b, slots, hkv, d), dtype)
    return tuple(_randn(rng, (b, hkv, slots, d), dtype).transpose(1, 2) for _ in range(2))


# decode (one query, GQA-packed split kernels) and prefill (every slot a query, left-padded, the
# warp-specialised prefill kernels on sm_90a)
RANGED_CASES = [(1, 32, 8, "decode"), (1, 8, 8, "decode-mha"), (None, 16, 4, "prefill")]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", RANGED_CASES, ids=lambda c: c[3])
@pytest.mark.parametrize("mask", [Mask(kind="causal"), Mask(kind="sliding_window", window_left=99), Mask()], ids=str)
def test_an_unpaged_cache_reads_each_sequence_between_its_left_pad_and_its_length(dtype, d, case, mask):
    """A left-padded batch and a static cache's empty slots: sequence b's keys are slots
    cache_leftpad[b] .. cache_seqlens[b] of its own (one of them empty, one the whole cache); the
    slots outside hold NaN, which a kernel reading them would carry into its output."""
    nq, hq, hkv, _ = case
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{d}{case}{mask}".encode()))
    b, slots = 6, 700
    ends = np.array([700, 650, 1, 700, 333, 0], np.int32)
    starts = np.array([0, 40, 1, 611, 200, 0], np.int32)
    k, v = _ranged_cache(rng, dtype, b, slots, hkv, d, "bhsd" if d == 128 else "bshd")
    for i in range(b):
        k[i, :starts[i]], k[i, ends[i]:], v[i, :starts[i]], v[i, ends[i]:] = (float("nan"),) * 4
    q = _randn(rng, (b, hq, nq or slots, d), dtype)
    out = _nan(q.shape, dtype)
    _, lse = fagen.attention_with_kvcache(q, k, v, _int32(ends), cache_leftpad=_int32(starts), mask=mask, out=out,
                                          return_lse=True)
    ref, ref_lse = oracle.attention_cache(_np(q), np.nan_to_num(_np(k)), np.nan_to_num(_np(v)), ends, starts,
                                          mask=mask, return_lse=True)
    _check(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("mod", [{"softcap": 30.0}, {"sinks": True}, {"alibi": "slopes"}], ids=str)
def test_an_unpaged_cache_takes_the_modifiers(mod):
    rng = np.random.default_rng(len(str(mod)))
    b, slots, hq, hkv, d = 4, 1500, 32, 8, 128
    ends, starts = np.array([1500, 900, 1200, 64], np.int32), np.array([0, 300, 1199, 0], np.int32)
    k, v = _ranged_cache(rng, "bfloat16", b, slots, hkv, d, "bhsd")
    q = _randn(rng, (b, hq, 1, d), "bfloat16")
    side = {}
    if "sinks" in mod:
        side["sinks"] = torch.randn(hq, device="cuda")
    if "alibi" in mod:
        side["alibi_slopes"] = torch.rand(hq, device="cuda")
    out = _nan(q.shape, "bfloat16")
    fagen.attention_with_kvcache(q, k, v, _int32(ends), cache_leftpad=_int32(starts), causal=True,
                                 softcap=mod.get("softcap"), out=out, **side)
    ref = oracle.attention_cache(_np(q), _np(k), _np(v), ends, starts, causal=True, softcap=mod.get("softcap"),
                                 **{n: _np(t) for n, t in side.items()})
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["bfloat16"]


def test_bad_key_ranges_are_refused_before_launch_and_clamped_without_validation():
    rng = np.random.default_rng(2)
    k, v = _ranged_cache(rng, "float16", 2, 64, 2, 64, "bshd")
    q = _randn(rng, (2, 4, 1, 64), "float16")
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 65: must be in 0..64"):
        fagen.attention_with_kvcache(q, k, v, _int32([64, 65]))
    with pytest.raises(ValueError, match=r"cache_leftpad\[0\] = 10: must be in 0..cache_seqlens\[b\]"):
        fagen.attention_with_kvcache(q, k, v, _int32([5, 64]), cache_leftpad=_int32([10, 0]))
    # unchecked (validate=False), the kernel clamps them to the slots: no read past the cache
    out = fagen.attention_with_kvcache(q, k, v, _int32([1 << 30, -5]), cache_leftpad=_int32([-7, 3]), validate=False)
    ref = oracle.attention_cache(_np(q), _np(k), _np(v), [64, 0], [0, 0])
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["float16"]
