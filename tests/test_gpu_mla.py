"""MLA decode (576/512 over a paged latent cache) on the GPU, against the float64 oracle (marked
`gpu`). Inputs are random and fresh per case; every slot of the cache a sequence does not own
(the tail of its last page, the pages no sequence uses) holds NaN, and out is NaN-poisoned
before the launch, so that a read past a sequence's keys or a row left unwritten fails."""

import math

import numpy as np
import pytest

import fagen
from fagen import oracle
from fagen.check import OUT_TOLERANCE, LSE_TOLERANCE, relative_error, to_numpy
from fagen.mla_plan import HEAD_DIM, HEAD_DIM_V, PAGE_SIZE

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def paged_case(lengths, hq, nq, dtype, *, seed, spare_pages=3):
    """q [B, Hq, Nq, 576], a NaN-filled cache whose sequences own shuffled pages, the page
    table (entries past a sequence's pages point nowhere) and the lengths, as torch tensors."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    pages = [-(-n // PAGE_SIZE) for n in lengths]
    max_pages = max(max(pages), 1) + 1
    num_pages = sum(pages) + spare_pages
    kv = np.full((num_pages, PAGE_SIZE, 1, HEAD_DIM), np.nan, np.float32)
    order = rng.permutation(num_pages)
    table = np.full((b, max_pages), -5, np.int32)  # (never read: a page id outside the cache)
    at = 0
    for i, n in enumerate(lengths):
        ids = order[at:at + pages[i]]
        at += pages[i]
        table[i, :pages[i]] = ids
        rows = rng.standard_normal((n, HEAD_DIM)).astype(np.float32)
        for page in range(pages[i]):
            chunk = rows[page * PAGE_SIZE:(page + 1) * PAGE_SIZE]
            kv[ids[page], :len(chunk), 0] = chunk
    q = rng.standard_normal((b, hq, nq, HEAD_DIM)).astype(np.float32)
    dt = getattr(torch, dtype)
    cuda = lambda x, t: torch.from_numpy(x).to(device="cuda", dtype=t)  # noqa: E731
    return (cuda(q, dt), cuda(kv, dt), cuda(table, torch.int32),
            cuda(np.asarray(lengths, np.int32), torch.int32))


def reference(q, kv, table, lengths, *, causal, scale=None):
    """(out, lse) in float64: each sequence's keys gathered from its pages, V their first 512 columns."""
    q, kv = to_numpy(q).astype(np.float64), to_numpy(kv).astype(np.float64)
    table, lengths = table.cpu().numpy(), lengths.cpu().numpy()
    outs, lses = [], []
    for b, n in enumerate(lengths):
        keys = kv[table[b, :-(-n // PAGE_SIZE)]].reshape(-1, HEAD_DIM)[:n] if n else np.zeros((0, HEAD_DIM))
        k = keys[None, None]
        if n == 0:
            out, lse = np.zeros((1, *q.shape[1:3], HEAD_DIM_V)), np.full((1, *q.shape[1:3]), -np.inf)
        else:
            out, lse = oracle.attention(q[b:b + 1], k, k[..., :HEAD_DIM_V], causal=causal, return_lse=True,
                                        scale=scale if scale is not None else 1 / math.sqrt(HEAD_DIM))
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


def check(lengths, hq, nq, dtype, *, causal=False, splits=None, seed=0):
    q, kv, table, lengths_t = paged_case(lengths, hq, nq, dtype, seed=seed)
    step = fagen.prepare_mla_decode(q, kv, table, lengths_t, causal=causal, splits=splits)
    out = torch.full((len(lengths), hq, nq, HEAD_DIM_V), float("nan"), dtype=q.dtype, device="cuda")
    got, lse = step(q, kv, table, lengths_t, out=out, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = reference(q, kv, table, lengths_t, causal=causal)
    error = relative_error(to_numpy(got), ref)
    lse_error = relative_error(to_numpy(lse)[np.isfinite(ref_lse)], ref_lse[np.isfinite(ref_lse)])
    assert got is out
    assert error <= OUT_TOLERANCE[dtype], (error, step.splits)
    assert lse_error <= LSE_TOLERANCE, (lse_error, step.splits)
    assert np.array_equal(np.isinf(to_numpy(lse)), np.isinf(ref_lse))
    return step


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("splits", [1, 3, None], ids=["one_split", "three_splits", "default_splits"])
@pytest.mark.parametrize("lengths, hq", [([8191], 16), ([1000, 64, 1], 16), ([4097, 300], 128), ([129, 65], 20),
                                         ([2000], 1)])
def test_mla_decode_matches_the_oracle(dtype, splits, lengths, hq):
    check(lengths, hq, 1, dtype, splits=splits)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("splits", [1, 4])
def test_two_query_tokens_match_the_oracle(causal, splits):
    """Nq 2 (a speculative token): rows h * 2 + n, the second token seeing one key more under causal."""
    check([777, 64, 2, 5000], 64, 2, "bfloat16", causal=causal, splits=splits, seed=1)


def test_a_sequence_without_keys_writes_zeros_and_minus_infinity():
    check([0, 300, 0], 16, 1, "bfloat16", splits=2, seed=2)


def test_a_prepared_step_follows_the_lengths_it_reads_in_place():
    """A decode loop: the same step after the engine appends a key (length and, past a page, the
    table rewritten in place); each step checked against the oracle."""
    q, kv, table, lengths = paged_case([127, 63], 16, 1, "bfloat16", seed=3, spare_pages=4)
    step = fagen.prepare_mla_decode(q, kv, table, lengths, splits=2)
    spare = sorted(set(range(kv.shape[0])) - set(table[table >= 0].cpu().tolist()))
    for _ in range(3):
        for b in range(2):  # append one key to each sequence
            n = int(lengths[b])
            if n % PAGE_SIZE == 0:
                table[b, n // PAGE_SIZE] = spare.pop()
            kv[table[b, n // PAGE_SIZE], n % PAGE_SIZE, 0] = torch.randn(HEAD_DIM, device="cuda").to(kv.dtype)
            lengths[b] += 1
        got = step(q, kv, table, lengths)
        torch.cuda.synchronize()
        ref, _ = reference(q, kv, table, lengths, causal=False)
        assert relative_error(to_numpy(got), ref) <= OUT_TOLERANCE["bfloat16"]


def test_a_prepared_step_runs_from_c_as_from_python():
    """A torch step launches from the C hot path: bitwise the Python path's output, with out
    allocated or given, a new q each step, and a new cache (its map re-encoded there); an out of
    another layout goes back to the Python path, which refuses it by name."""
    q, kv, table, lengths = paged_case([700, 65], 16, 1, "bfloat16", seed=4)
    step = fagen.prepare_mla_decode(q, kv, table, lengths, splits=3)
    assert step._hot is not None, fagen.hot_path.reason()
    for fresh_q, cache in ((q, kv), (torch.randn_like(q), kv), (q, kv.clone())):
        out = torch.full((2, 16, 1, HEAD_DIM_V), float("nan"), dtype=q.dtype, device="cuda")
        assert step(fresh_q, cache, table, lengths, out=out) is out
        assert step._hot.run(fresh_q, cache, table, lengths, None) is not NotImplemented  # the C path took it
        allocated = step(fresh_q, cache, table, lengths)
        hot, step._hot = step._hot, None
        want = step(fresh_q, cache, table, lengths)
        step._hot = hot
        assert torch.equal(out, want) and torch.equal(allocated, want)
        ref, _ = reference(fresh_q, cache, table, lengths, causal=False)
        assert relative_error(to_numpy(want), ref) <= OUT_TOLERANCE["bfloat16"]
    with pytest.raises(ValueError, match="out: "):
        step(q, kv, table, lengths, out=torch.empty((2, 16, 1, HEAD_DIM_V), dtype=torch.float16, device="cuda"))


def test_bad_inputs_are_refused_by_name():
    q, kv, table, lengths = paged_case([100], 16, 1, "bfloat16", seed=4)
    with pytest.raises(ValueError, match=r"q: shape .*\[B, Hq, Nq, 576\]"):
        fagen.mla_decode(q[..., :512], kv, table, lengths)
    with pytest.raises(ValueError, match=r"Nq = 3"):
        fagen.mla_decode(q.expand(1, 16, 3, HEAD_DIM), kv, table, lengths)
    with pytest.raises(ValueError, match=r"kv_cache: shape .*page_size 64"):
        fagen.mla_decode(q, kv.view(-1, 32, 1, HEAD_DIM), table, lengths)
    with pytest.raises(ValueError, match=r"kv_cache: dtype float16"):
        fagen.mla_decode(q, kv.half(), table, lengths)
    with pytest.raises(ValueError, match=r"page_table: int64"):
        fagen.mla_decode(q, kv, table.long(), lengths)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 1000"):
        fagen.mla_decode(q, kv, table, lengths + 900)
    bad = table.clone()
    bad[0, 0] = kv.shape[0]
    with pytest.raises(ValueError, match=r"page_table\[0, 0\]"):
        fagen.mla_decode(q, kv, bad, lengths)
    with pytest.raises(ValueError, match=r"splits = 0"):
        fagen.mla_decode(q, kv, table, lengths, splits=0)


def test_unchecked_bad_pages_read_zeros_not_out_of_bounds():
    """validate=False (a serving loop's trust): a page id outside the cache loads zeros through
    TMA, and a length past the table row is cut to it; the result is finite, nothing faults."""
    q, kv, table, lengths = paged_case([100, 70], 16, 1, "bfloat16", seed=5)
    kv = torch.nan_to_num(kv)
    bad = table.clone()
    bad[0, 1] = 10 ** 6
    out = fagen.mla_decode(q, kv, bad, lengths + 10 ** 5, validate=False)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
