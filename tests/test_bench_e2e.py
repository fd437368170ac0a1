"""fagen.bench_e2e without a GPU: its cases, its decode rate and its tables."""

import pytest

from fagen import bench_e2e
from fagen.bench_e2e import E2ECase, E2ERow


def test_cases_name_themselves_apart_and_cover_both_models_and_padding():
    full = bench_e2e.cases()
    assert len({c.key for c in full}) == len(full)
    assert {c.model for c in full} == {"llama", "gemma2"} and any(c.padded for c in full)
    assert {c.batch for c in full if not c.padded and c.model == "llama"} == {1, 8, 32}
    assert set(bench_e2e.cases(quick=True)) <= set(full)


def test_the_decode_rate_leaves_out_the_prefill_and_its_token():
    case = E2ECase("llama", 8, 1024, 65)
    assert bench_e2e.decode_rate(case, generate_s=2.5, prefill_s=0.5) == pytest.approx(8 * 64 / 2.0)


def test_left_padded_prompts_pad_before_their_tokens():
    torch = pytest.importorskip("torch")
    case = E2ECase("llama", 6, 700, 8, padded=True)
    ids, mask = bench_e2e.prompts(case, device="cpu")
    lengths = mask.sum(1)
    assert ids.shape == mask.shape == (6, 700) and int(lengths[0]) == 700
    assert bool(((lengths >= bench_e2e.PADDED_SHORTEST) & (lengths <= 700)).all())
    assert torch.equal(mask.flip(1).cummin(1).values.flip(1), mask)  # zeros only before the ones
    assert int(ids[mask == 0].abs().sum()) == 0


def test_the_tables_give_fagen_against_sdpa_and_mark_what_a_backend_cannot_run():
    equal, padded = E2ECase("llama", 1, 1024, 64).key, E2ECase("llama", 8, 1024, 64, padded=True).key
    rows = [E2ERow(equal, "sdpa", 20.0, 50.0), E2ERow(equal, "fagen", 16.0, 60.0, "logits ok"),
            E2ERow(padded, "sdpa", 40.0, 300.0), E2ERow(padded, "sdpa_flash", None, None, "n/a: no mask"),
            E2ERow(padded, "fagen", 32.0, 450.0)]
    text = "\n".join(bench_e2e.markdown(rows))
    assert f"| {equal} | 20.0 / n/a / 16.0 | 50.0 / n/a / 60.0 | 1.25, 1.20 |" in text
    assert f"| {padded} | 40.0 / n/a / 32.0 | 300.0 / n/a / 450.0 | 1.25, 1.50 |" in text
    assert text.index("Equal-length") < text.index("Left-padded") and f"- {equal}: logits ok" in text
