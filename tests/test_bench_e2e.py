"""The end-to-end benchmark without a GPU: its cases, its decode rate, its tables
(fagen.bench_e2e_tables) and the runner's order of checks and timed rounds (fagen.bench_e2e)."""

import pytest

from fagen import bench_e2e_tables as bench_e2e
from fagen.bench_e2e_tables import E2ECase, E2ERow


def test_cases_name_themselves_apart_and_cover_both_models_padding_and_the_static_cache():
    full = bench_e2e.cases()
    assert len({c.key for c in full}) == len(full)
    assert {c.model for c in full} == {"llama", "gemma2"} and any(c.padded for c in full)
    assert {c.section for c in full} == {"equal", "padded", "static"}
    assert all(bench_e2e._section(c.key) == c.section for c in full)  # the tables split rows by their keys
    assert {c.batch for c in full if c.static} == {8, 32} and all(c.prompt == 4096 and c.padded for c in full if c.static)
    assert {c.batch for c in full if not c.padded and c.model == "llama"} == {1, 8, 32}
    assert set(bench_e2e.cases(quick=True)) <= set(full)


def test_the_decode_rate_is_the_batch_over_the_median_step_and_a_pause_does_not_move_it():
    case = E2ECase("llama", 8, 1024, 6)
    assert bench_e2e.decode_rate(case, [0.02, 0.021, 0.5, 0.019, 0.02]) == pytest.approx(8 / 0.02)
    # the rate before: generate's time less the prefill, over the tokens after the first
    assert bench_e2e.whole_decode_rate(E2ECase("llama", 8, 1024, 65), generate_s=2.5, prefill_s=0.5) == \
        pytest.approx(8 * 64 / 2.0)


def test_left_padded_prompts_pad_before_their_tokens():
    torch = pytest.importorskip("torch")
    case = E2ECase("llama", 6, 700, 8, padded=True)
    ids, mask = bench_e2e.prompts(case, device="cpu")
    lengths = mask.sum(1)
    assert ids.shape == mask.shape == (6, 700) and int(lengths[0]) == 700
    assert bool(((lengths >= 700 // 4) & (lengths <= 700)).all()) and case.shortest == 175
    assert torch.equal(mask.flip(1).cummin(1).values.flip(1), mask)  # zeros only before the ones
    assert int(ids[mask == 0].abs().sum()) == 0


def test_the_padded_cases_draw_the_issue_s_lengths():
    """Left-padded Llama batches of 8 and 32 with prompts of 256 to 4096 tokens (issue 53's mixed
    lengths), named by that range."""
    padded = [c for c in bench_e2e.cases() if c.section == "padded" and c.model == "llama"]
    assert sorted(c.batch for c in padded) == [8, 32]
    assert all((c.shortest, c.prompt) == (256, 4096) and "256-4096 left-padded" in c.key for c in padded)
    assert E2ECase("llama", 8, 1000, 4, padded=True).shortest == 250  # a quarter where not given


def test_the_tables_give_fagen_against_sdpa_and_mark_what_a_backend_cannot_run():
    equal, padded = E2ECase("llama", 1, 1024, 64).key, E2ECase("llama", 8, 1024, 64, padded=True).key
    rows = [E2ERow(equal, "sdpa", 20.0, 50.0), E2ERow(equal, "fagen", 16.0, 60.0, "logits ok"),
            E2ERow(padded, "sdpa", 40.0, 300.0, attention_host_us=310.0),
            E2ERow(padded, "sdpa_flash", None, None, "n/a: no mask"), E2ERow(padded, "fagen", 32.0, 450.0, "", 120.5)]
    text = "\n".join(bench_e2e.markdown(rows))
    assert f"| {equal} | 20.0 / n/a / 16.0 | 50.0 / n/a / 60.0 | 1.25, 1.20 | n/a / n/a / n/a |" in text
    assert f"| {padded} | 40.0 / n/a / 32.0 | 300.0 / n/a / 450.0 | 1.25, 1.50 | 310.0 / n/a / 120.5 |" in text
    assert text.index("Equal-length") < text.index("Left-padded") and f"- {equal}: logits ok" in text


def test_a_case_checks_each_implementation_then_times_them_in_turns(monkeypatch):
    """run_case: SDPA checked first and the others against its result; a backend that cannot run
    the case is n/a and never timed; the rest take turns (order alternating by round), and each
    row is the best prefill and the best decode rate of its rounds."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from fagen import bench_e2e as runner

    case = E2ECase("llama", 2, 1024, 11)
    checked, order = [], []

    def check(model, case, impl, reference):
        checked.append((impl, reference))
        return ("n/a: no mask" if impl == "sdpa_flash" else "" if reference is None else "ok"), "sdpa's"

    generate = {"sdpa": iter([1.1, 2.1, 3.1]), "fagen": iter([1.1, 1.6, 0.6])}
    steps = {"sdpa": iter([[0.1, 0.3, 0.1], [0.2] * 3, [0.4] * 3]), "fagen": iter([[0.2] * 3, [0.1, 0.05, 9.0], [0.1] * 3])}
    spent = {"sdpa": iter([3e-4, 1e-4, 2e-4]), "fagen": iter([5e-5, None, 7e-5])}

    def timed(model, case, impl):
        order.append(impl)
        return 0.1, next(generate[impl]), next(steps[impl]), next(spent[impl])

    monkeypatch.setattr(runner, "check", check)
    monkeypatch.setattr(runner, "timed", timed)
    monkeypatch.setattr(runner, "ROUNDS", 3)
    rows = {r.impl: r for r in runner.run_case(None, case, ("sdpa", "sdpa_flash", "fagen"))}
    assert checked == [("sdpa", None), ("sdpa_flash", "sdpa's"), ("fagen", "sdpa's")]
    assert order == ["sdpa", "fagen", "fagen", "sdpa", "sdpa", "fagen"]
    assert rows["sdpa_flash"].decode_tok_s is None and rows["sdpa_flash"].note == "n/a: no mask"
    assert rows["fagen"].prefill_ms == pytest.approx(100.0)
    # the best round's batch over its median step: fagen 2 / 0.1 (of 10, 20, 20), SDPA 2 / 0.1 (of 20, 10, 5)
    assert rows["fagen"].decode_tok_s == pytest.approx(20.0) and rows["sdpa"].decode_tok_s == pytest.approx(20.0)
    assert rows["fagen"].note.startswith("ok; ") and "decode 10-20 tok/s" in rows["fagen"].note
    assert "(40 by generate's time less the prefill)" in rows["fagen"].note  # 2 * 10 / (0.6 - 0.1)
    # a decode step's attention host time: the least of the rounds that measured it
    assert rows["sdpa"].attention_host_us == pytest.approx(100.0) and rows["fagen"].attention_host_us == pytest.approx(50.0)
    assert rows["sdpa_flash"].attention_host_us is None


def test_the_report_keeps_the_end_to_end_tables_from_their_json(tmp_path):
    """bench_e2e's JSON round-trips, a file that is not one is refused in a line, and fagen
    bench's BENCHMARKS.md takes its section from the JSON beside its own."""
    from fagen import bench

    rows = [E2ERow(E2ECase("llama", 1, 1024, 64).key, "sdpa", 20.0, 50.0),
            E2ERow(E2ECase("llama", 1, 1024, 64).key, "fagen", 16.0, 60.0, "ok")]
    bench_e2e.write_json(rows, {"gpu": "H200"}, tmp_path / bench_e2e.JSON)
    assert bench_e2e.read_json(tmp_path / bench_e2e.JSON) == (rows, {"gpu": "H200"})
    (tmp_path / "other.json").write_text("[]")
    with pytest.raises(ValueError, match="not a bench_e2e.json"):
        bench_e2e.read_json(tmp_path / "other.json")
    text = bench.markdown([], {}, [], e2e=bench.Part(rows, {"gpu": "H200"}))
    assert "## End to end: transformers generation" in text and "gpu: H200" in text and "| 1.25, 1.20 |" in text


def test_a_static_case_generates_on_one_static_cache_a_model_emptied_each_time():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from fagen import bench_e2e as runner

    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=1, vocab_size=50))
    case = E2ECase("llama", 2, 16, 4, static=True)
    first = runner._generate_options(model, case, mask=None)["past_key_values"]
    assert first.max_cache_len == bench_e2e.STATIC_CACHE_LEN
    assert runner._generate_options(model, case, mask=None)["past_key_values"] is first  # same addresses
    assert "past_key_values" not in runner._generate_options(model, E2ECase("llama", 2, 16, 4), mask=None)
    assert runner._generate_options(model, E2ECase("llama", 3, 16, 4, static=True), None)["past_key_values"] is not first


def test_the_generation_profile_tells_attention_kernels_and_reports_a_step():
    """scripts/profile_generation.py's pure parts: which kernels are attention (fagen's, SDPA's
    backends'), and a step's wall, GPU-busy and attention times from kernel times of its steps."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("torch")
    path = Path(__file__).resolve().parents[1] / "scripts" / "profile_generation.py"
    spec = importlib.util.spec_from_file_location("profile_generation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.is_attention("fagen_decode_bf16_d64_kvranged_merged") and module.is_attention("flash_fwd_kernel")
    assert not module.is_attention("sm90_xmma_gemm_bf16bf16_bf16f32") and not module.is_attention("elementwise_kernel")
    steps = module.DECODE_STEPS
    lines = module.report("fagen", 40.0, 15.0, {"fagen_decode": steps * 30.0, "sm90_xmma_gemm": steps * 400.0}, 5)
    assert lines[0] == ("fagen: prefill 40.00 ms; decode step 15.00 ms wall, 0.430 ms GPU busy (3%), attention 0.030 ms "
                        "(7% of the GPU's)")
    assert lines[1].split() == ["0.400", "ms", "a", "step", "sm90_xmma_gemm"] and "*" in lines[2]
