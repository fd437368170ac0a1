"""A page id outside the cache, or a length past the page table, with validate=False (a graph's
path): no page the call does not own is written or read, in the append and in every kernel that
takes a page table (marked `gpu`).

Each case snapshots the whole cache first and compares it bitwise after: the append leaves every
slot but its own tokens' in-range ones as they were, the attention kernels leave all of it. The
status word carries the flag, the outputs match the oracle on what the kernels read (a bad page
as a page of zeros, a length cut to the table), and a healthy call afterwards proves the CUDA
context unharmed. Inputs are random per case, outputs NaN-poisoned before the launch."""

import zlib

import numpy as np
import pytest

import fagen
from fagen import oracle, sequences
from fagen.check import OUT_TOLERANCE, relative_error

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

NUM_PAGES, PAGE, HKV, D, WIDTH = 12, 16, 2, 64, 3  # the append's cache: 3 pages a sequence, 3 of nobody's
INT32_MAX = 2**31 - 1
# page ids outside a cache of n pages (-1 and n + 3 wrapped to pages n - 1 and 3 in the append)
BAD_PAGES = {"minus_one": lambda n: -1, "num_pages": lambda n: n, "num_pages_plus_3": lambda n: n + 3,
             "int32_max": lambda n: INT32_MAX}


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _randn(rng, shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to("cuda", torch.float16)


def _np(x):
    return x.detach().double().cpu().numpy()


def _int32(values):
    return torch.tensor(np.asarray(values), dtype=torch.int32, device="cuda")


def _status():
    return torch.zeros(1, dtype=torch.int32, device="cuda")


def _same_bits(a, b) -> bool:
    return torch.equal(a.detach().cpu().view(torch.int16), b.detach().cpu().view(torch.int16))


def _in_cache(page: int, num_pages: int) -> bool:
    return 0 <= page < num_pages


def _appended(before, new, table, lens, cu=None):
    """The cache as the append must leave it (CPU, bitwise): each new token of sequence b at key
    lens[b] + j in slot pos % page_size of page table[b, pos // page_size], where that position
    lies within the table row and the page within the cache; every other slot as it was."""
    cache, new = before.detach().cpu().clone(), new.detach().cpu()
    num_pages, page_size = cache.shape[:2]
    for b in range(table.shape[0]):
        rows = new[b].transpose(0, 1) if cu is None else new[cu[b]:cu[b + 1]]  # [n, Hkv, d]
        for j in range(rows.shape[0]):
            pos = int(lens[b]) + j
            if 0 <= pos < table.shape[1] * page_size and _in_cache(int(table[b, pos // page_size]), num_pages):
                cache[int(table[b, pos // page_size]), pos % page_size] = rows[j]
    return cache


def _reference(q, k_cache, v_cache, table, lens, **kwargs):
    """The oracle on what the kernels read: a page id outside the cache as a page of zeros, a
    length past the table cut to it (a negative one: no keys)."""
    kc, vc = (np.concatenate([_np(c), np.zeros((1, *c.shape[1:]))]) for c in (k_cache, v_cache))
    num_pages, page_size = k_cache.shape[:2]
    pages = np.where((table >= 0) & (table < num_pages), table, num_pages)
    keys = np.clip(np.asarray(lens, np.int64), 0, table.shape[1] * page_size)
    return oracle.attention_paged(_np(q), kc, vc, pages, keys, **kwargs)


def _a_healthy_call_matches_the_oracle():
    """After a faulty call: a fresh paged call with checked values, against the oracle (a CUDA
    error left by the faulty one would surface here, at the launch or the sync)."""
    rng = _rng("healthy")
    k_cache, v_cache = _randn(rng, (6, PAGE, HKV, D)), _randn(rng, (6, PAGE, HKV, D))
    table, lens = np.array([[4, 1], [0, 5]], np.int32), [27, 16]
    q = _randn(rng, (2, 8, 1, D))
    status = _status()
    out = fagen.attention_with_kvcache(q, k_cache, v_cache, _int32(lens), _int32(table), status=status)
    torch.cuda.synchronize()
    assert int(status.item()) == 0
    assert relative_error(_np(out), oracle.attention_paged(_np(q), _np(k_cache), _np(v_cache), table, lens)) \
        < OUT_TOLERANCE["float16"]


def _append_table(rng):
    """Three sequences on pages of their own (shuffled ids); the other pages are nobody's."""
    return rng.permutation(NUM_PAGES)[:3 * WIDTH].reshape(3, WIDTH).astype(np.int32)


def _append_and_attend(table, lens, layout, rng):
    """attention_with_kvcache with new tokens for each sequence ([B, Hkv, N, d], or token-major
    with cu_seqlens_q), q attending causally, validate=False: (caches before, caches after, new
    keys and values, status, out, q, cu_seqlens_q or None, lengths after)."""
    if layout == "varlen":
        counts = [16, 3, 9]
        cu = np.cumsum([0, *counts])
        q = _randn(rng, (cu[-1], 8, D))
        k_new, v_new = _randn(rng, (cu[-1], HKV, D)), _randn(rng, (cu[-1], HKV, D))
        extra = dict(cu_seqlens_q=_int32(cu), max_seqlen_q=max(counts))
    else:
        counts, cu, extra = [16] * 3, None, {}
        q = _randn(rng, (3, 8, 16, D))
        if layout == "padded_unaligned":  # rows 65 elements apart: not 16-byte aligned, copied first
            k_new, v_new = (_randn(rng, (3, HKV, 16, D + 1))[..., :D] for _ in range(2))
        else:
            k_new, v_new = _randn(rng, (3, HKV, 16, D)), _randn(rng, (3, HKV, 16, D))
    k_cache, v_cache = _randn(rng, (NUM_PAGES, PAGE, HKV, D)), _randn(rng, (NUM_PAGES, PAGE, HKV, D))
    before = k_cache.clone(), v_cache.clone()
    status = _status()
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    fagen.attention_with_kvcache(q, k_cache, v_cache, _int32(lens), _int32(table), k=k_new, v=v_new, causal=True,
                                 validate=False, status=status, out=out, **extra)
    torch.cuda.synchronize()
    new_lens = (np.asarray(lens, np.int64) + counts).astype(np.int32)  # int32 arithmetic, as the device's
    return before, (k_cache, v_cache), (k_new, v_new), int(status.item()), out, q, cu, new_lens


@pytest.mark.parametrize("layout", ["padded", "varlen", "padded_unaligned"])
@pytest.mark.parametrize("bad", list(BAD_PAGES))
def test_the_append_writes_no_page_outside_the_cache(bad, layout):
    """Sequence 0's new tokens run from key 20 into its third page, whose id is bad: the tokens
    bound for it are dropped (no other page changes, the wrap to page num_pages - 1 or bad %
    num_pages included), the rest land, and the status word says so."""
    rng = _rng("append", bad, layout)
    table = _append_table(rng)
    table[0, 2] = BAD_PAGES[bad](NUM_PAGES)
    lens = [20, 5, 30]
    before, after, new, status, out, q, cu, new_lens = _append_and_attend(table, lens, layout, rng)
    assert status == sequences.PAGE_OUT_OF_RANGE
    for cache, old, rows in zip(after, before, new):
        assert _same_bits(cache, _appended(old, rows, table, lens, cu))
    ref = _reference(q, *after, table, new_lens, causal=True, cu_seqlens_q=cu)
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["float16"]
    _a_healthy_call_matches_the_oracle()


@pytest.mark.parametrize("length", [40, 48, 1000, INT32_MAX - 7], ids=["into", "at", "far_past", "int32_wrap"])
def test_the_append_writes_nothing_past_the_table(length):
    """Sequence 0's length runs past its table row (3 pages of 16 keys): its tokens past the row
    are dropped, none wraps into another slot of the row or another row (INT32_MAX - 7 + j
    overflows 32 bits), and the status word says so."""
    rng = _rng("past", length)
    table = _append_table(rng)
    lens = [length, 5, 30]
    before, after, new, status, out, q, _, new_lens = _append_and_attend(table, lens, "padded", rng)
    assert status == sequences.SEQLEN_OVER_TABLE
    for cache, old, rows in zip(after, before, new):
        assert _same_bits(cache, _appended(old, rows, table, lens))
    ref = _reference(q, *after, table, new_lens, causal=True)
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["float16"]
    _a_healthy_call_matches_the_oracle()


def test_a_checked_append_refuses_a_bad_page_and_writes_nothing():
    """validate=True (the default) refuses the table on the host, before any write."""
    rng = _rng("checked")
    table = _append_table(rng)
    table[0, 2] = -1
    q = _randn(rng, (3, 8, 16, D))
    k_new, v_new = _randn(rng, (3, HKV, 16, D)), _randn(rng, (3, HKV, 16, D))
    k_cache, v_cache = _randn(rng, (NUM_PAGES, PAGE, HKV, D)), _randn(rng, (NUM_PAGES, PAGE, HKV, D))
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match=r"page_table\[0, 2\] = -1"):
        fagen.attention_with_kvcache(q, k_cache, v_cache, _int32([20, 5, 30]), _int32(table), k=k_new, v=v_new)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 56"):
        fagen.attention_with_kvcache(q, k_cache, v_cache, _int32([40, 5, 30]), _int32(table), k=k_new, v=v_new)
    torch.cuda.synchronize()
    assert _same_bits(k_cache, before[0]) and _same_bits(v_cache, before[1])


# The paged kernels: (B, Hq, Hkv, Nq) a padded q (decode: merged in the kernel, by the merge
# kernel, unsplit; many rows: the plain forward), or "varlen" (prefill through cu_seqlens_q)
KERNELS = {"decode_merged_in_kernel": (3, 32, 8, 1), "decode_merge_kernel": (2, 16, 4, 16),
           "decode_unsplit": (48, 32, 8, 1), "forward_padded": (2, 8, 2, 200), "forward_varlen": "varlen"}
FAULTS = {**{f"page_{name}": ("page", bad) for name, bad in BAD_PAGES.items()},
          "length_past_table": ("length", 100_000), "length_int32_max": ("length", INT32_MAX)}


def _kernel_case(rng, kernel):
    """A cache of shuffled 64-key pages with 3 pages nobody owns, its table, lengths and q."""
    b, hq, hkv, nq = (3, 8, 2, None) if kernel == "varlen" else kernel
    lens = [int(x) for x in rng.integers(70, 1500, b)]
    need = [-(-n // 64) for n in lens]
    width = max(need) + 1
    num_pages = sum(need) + 3
    order = rng.permutation(num_pages)
    table = np.zeros((b, width), np.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = order[used:used + n]
        table[i, n:] = order[used]  # unused entries: the sequence's own first page
        used += n
    k_cache, v_cache = _randn(rng, (num_pages, 64, hkv, 128)), _randn(rng, (num_pages, 64, hkv, 128))
    if kernel == "varlen":
        counts = [100, 1, 77]
        cu = np.cumsum([0, *counts])
        return k_cache, v_cache, table, lens, _randn(rng, (cu[-1], hq, 128)), cu
    return k_cache, v_cache, table, lens, _randn(rng, (b, hq, nq, 128)), None


def _fault(table, lens, fault: str, num_pages: int) -> int:
    """Put FAULTS[fault] into sequence 0's table row or sequence 1's length; the flag it raises."""
    kind, value = FAULTS[fault]
    if kind == "page":
        table[0, 1] = value(num_pages)  # sequence 0 has keys on its second page
        return sequences.PAGE_OUT_OF_RANGE
    lens[1] = value
    return sequences.SEQLEN_OVER_TABLE


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("kernel", list(KERNELS.values()), ids=list(KERNELS))
def test_the_paged_kernels_read_no_page_outside_the_cache(kernel, fault):
    """The kernels write no page (the cache is bitwise as it was), load a bad page's keys as
    zeros, cut a length to the table, flag it, and the other rows are the oracle's."""
    rng = _rng("kernel", kernel, fault)
    k_cache, v_cache, table, lens, q, cu = _kernel_case(rng, kernel)
    extra = {} if cu is None else dict(cu_seqlens_q=_int32(cu), max_seqlen_q=int(np.diff(cu).max()))
    flag = _fault(table, lens, fault, k_cache.shape[0])
    before = k_cache.clone(), v_cache.clone()
    status = _status()
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    fagen.attention_with_kvcache(q, k_cache, v_cache, _int32(lens), _int32(table), causal=True, validate=False,
                                 status=status, out=out, **extra)
    torch.cuda.synchronize()
    assert int(status.item()) == flag
    assert _same_bits(k_cache, before[0]) and _same_bits(v_cache, before[1])
    ref = _reference(q, k_cache, v_cache, table, lens, causal=True, cu_seqlens_q=cu)
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["float16"]
    _a_healthy_call_matches_the_oracle()


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_prepared_paged_step_reads_no_page_outside_the_cache(fault):
    """A prepared step's table and lengths are checked once, at prepare; rewritten in place
    with a bad id or length, a step reads no page outside the cache and flags its status."""
    rng = _rng("prepared", fault)
    k_cache, v_cache, table, lens, q, _ = _kernel_case(rng, (3, 32, 8, 1))
    seqlens, pages = _int32(lens), _int32(table)
    step = fagen.prepare_with_kvcache(q, k_cache, v_cache, seqlens, pages, causal=True)
    flag = _fault(table, lens, fault, k_cache.shape[0])
    seqlens.copy_(_int32(lens))
    pages.copy_(_int32(table))
    before = k_cache.clone(), v_cache.clone()
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    step(q, k_cache, v_cache, seqlens, pages, out=out)
    torch.cuda.synchronize()
    assert int(step.status.item()) == flag
    assert _same_bits(k_cache, before[0]) and _same_bits(v_cache, before[1])
    ref = _reference(q, k_cache, v_cache, table, lens, causal=True)
    assert relative_error(_np(out), ref) < OUT_TOLERANCE["float16"]
    _a_healthy_call_matches_the_oracle()


def test_unvalidated_paged_calls_of_one_layout_launch_through_one_kept_class():
    """attention_with_kvcache(validate=False) without out (a serving loop): calls of one layout
    with new caches, page tables and lengths each time (one with a page id outside the cache)
    match the oracle and flag their status as the general path does, through one kept class
    (sequences.KeptPagedCalls), packed without reading the table back."""
    kept = sequences.KEPT_PAGED_CALLS._kept
    kept.clear()  # (earlier tests' classes: none of them is this layout's, and LIMIT would clear them midway)
    rng = _rng("kept")
    k_cache, _, table, _, q, _ = _kernel_case(rng, (3, 32, 8, 1))
    status = _status()
    for call in range(4):
        k_cache, v_cache, q = (_randn(rng, t.shape) for t in (k_cache, k_cache, q))  # new values, new addresses
        pages = rng.permutation(k_cache.shape[0]).astype(np.int32)[table]  # the same pages, relabelled
        lens = [int(x) for x in rng.integers(65, table.shape[1] * 64 + 1, table.shape[0])]  # (a second page read)
        flag = _fault(pages, lens, "page_num_pages", k_cache.shape[0]) if call == 2 else 0
        status.zero_()
        out = fagen.attention_with_kvcache(q, k_cache, v_cache, _int32(lens), _int32(pages), causal=True,
                                           validate=False, status=status)
        torch.cuda.synchronize()
        assert int(status.item()) == flag, call
        ref = _reference(q, k_cache, v_cache, pages, lens, causal=True)
        assert relative_error(_np(out), ref) < OUT_TOLERANCE["float16"], call
    assert len(kept) == 1
