"""fagen.tune without a GPU: the candidate space (the validator as pruner), the tuned spec
writer, and `fagen tune --dry-run`."""

from __future__ import annotations

import itertools
import math
import re

import pytest
from click.testing import CliRunner

import fagen
from fagen import device, tune
from fagen.cli import main
from fagen.plan import plan
from fagen.load import SPECS
from fagen.spec import SpecError
from fagen.load import parse_spec
from fagen.tune import QUICK_SPACE, SPACE, Candidate

BASE_PATH = SPECS / "attn_f16_d128.yaml"
D96_PATH = SPECS / "attn_f16_d96.yaml"


def _combo(spec) -> tuple:
    """A candidate's point in the space, in SPACE's key order."""
    t, p = spec.tiling, spec.pipeline
    return (t.block_q, t.warps_q, t.block_kv, (p.kv_smem, p.stages), spec.smem_layout, p.q_in_registers)


def _build(base, bq, wq, bkv, kv_smem, stages, layout, q_regs) -> dict:
    data = base.model_dump(mode="json")
    data.update(name="probe", tiling={"block_q": bq, "block_kv": bkv, "warps_q": wq},
                pipeline={"kv_smem": kv_smem, "stages": stages, "q_in_registers": q_regs}, smem_layout=layout)
    return data


@pytest.fixture(scope="module")
def base():
    return fagen.load_spec(BASE_PATH)


@pytest.fixture(scope="module")
def full(base):
    return tune.candidates(base)


@pytest.fixture(scope="module")
def quick(base):
    return tune.candidates(base, quick=True)


# ---- the full space ------------------------------------------------------------------------


def test_space_keys_are_in_the_order_candidates_unpacks():
    assert list(SPACE) == ["block_q", "warps_q", "block_kv", "pipeline", "smem_layout", "q_in_registers"]
    assert list(QUICK_SPACE) == list(SPACE)


def test_every_candidate_is_a_valid_spec(full):
    specs, _ = full
    assert specs
    for s in specs:
        assert parse_spec(s.model_dump(mode="json"), s.name) == s


def test_candidates_fit_smem_and_registers(full):
    for s in full[0]:
        p = plan(s)
        assert p.smem_bytes <= p.smem_limit, s.name
        assert p.seed_budget_bytes <= p.smem_limit, s.name
        assert p.predicted_registers <= 255, s.name


def test_candidate_names_are_unique_and_say_the_point(full, base):
    specs, _ = full
    names = [s.name for s in specs]
    assert len(set(names)) == len(names)
    assert len({_combo(s) for s in specs}) == len(specs)
    for s in specs:
        bq, wq, bkv, (kv_smem, stages), layout, q_regs = _combo(s)
        assert s.name == f"{base.name}_q{bq}w{wq}kv{bkv}_{kv_smem}{stages}_{layout[0]}{'_qreg' if q_regs else ''}"


def test_candidates_keep_everything_else_of_the_base(full, base):
    for s in full[0]:
        assert (s.dtype, s.head_dim, s.mask, s.score_mod, s.outputs, s.arch) == \
               (base.dtype, base.head_dim, base.mask, base.score_mod, base.outputs, base.arch)
        assert s.tiling.warps_kv == 1


def test_kept_plus_refused_is_the_whole_space(full):
    specs, refused = full
    size = math.prod(len(v) for v in SPACE.values())
    assert size == 2 * 2 * 3 * 5 * 2 * 2
    assert len(specs) + refused == size
    assert len(specs) > 0 and refused > 0


def test_what_is_refused_is_really_invalid(full, base):
    """Every point of the space not kept is one parse_spec refuses: nothing silently dropped."""
    specs, refused = full
    kept = {_combo(s) for s in specs}
    missing = [c for c in itertools.product(*SPACE.values()) if c not in kept]
    assert len(missing) == refused
    for bq, wq, bkv, (kv_smem, stages), layout, q_regs in missing:
        with pytest.raises(SpecError):
            parse_spec(_build(base, bq, wq, bkv, kv_smem, stages, layout, q_regs))


def test_known_invalid_combinations_are_absent(full, base):
    combos = {_combo(s) for s in full[0]}
    # block_q 64 over 8 warps is 8 rows a warp: under one m16 fragment
    assert not any(bq == 64 and wq == 8 for bq, wq, *_ in combos)
    with pytest.raises(SpecError, match="16, 32, 48 or 64 whole rows"):
        parse_spec(_build(base, 64, 8, 64, "separate", 1, "padded", False))
    # 128 rows over 4 warps with a 64-key tile: 128 (O) + 64 (S) fragments + 64 + 28 = 284 registers
    assert (128, 4, 64, ("separate", 1), "padded", False) not in combos
    with pytest.raises(SpecError, match="registers"):
        parse_spec(_build(base, 128, 4, 64, "separate", 1, "padded", False))
    # ... while a 32-key tile (160 fragments, 248 predicted) just fits and is explored
    assert (128, 4, 32, ("separate", 1), "padded", False) in combos
    # Q tile + 4 KV tiles of 128 x 136 padded halves = 174080 bytes > sm_80's 166912; swizzled (128 x 128) fits
    assert (128, 8, 128, ("separate", 2), "padded", False) not in combos
    with pytest.raises(SpecError, match="shared memory"):
        parse_spec(_build(base, 128, 8, 128, "separate", 2, "padded", False))
    assert (128, 8, 128, ("separate", 2), "swizzled", False) in combos


def test_swizzled_and_q_in_registers_are_explored_for_d128(full):
    combos = {_combo(s) for s in full[0]}
    assert any(layout == "swizzled" for *_, layout, _q in combos)
    assert any(layout == "padded" for *_, layout, _q in combos)
    assert any(q for *_, q in combos)
    assert {(bq, wq) for bq, wq, *_ in combos} == {(64, 4), (128, 4), (128, 8)}


def test_the_shipped_tuned_spec_is_a_candidate():
    """Retuning a tuned sm_90a spec searches a space that holds it."""
    tuned = fagen.load_spec(SPECS / "attn_f16_d128_h200.yaml")
    specs, _ = tune.candidates(tuned)
    assert _combo(tuned) in {_combo(s) for s in specs}


def test_head_dim_96_has_no_swizzled_candidate():
    base = fagen.load_spec(D96_PATH)
    specs, refused = tune.candidates(base)
    assert specs
    assert all(s.smem_layout == "padded" for s in specs)
    assert len(specs) + refused == math.prod(len(v) for v in SPACE.values())
    assert refused >= math.prod(len(v) for v in SPACE.values()) // 2  # every swizzled point at least


# ---- the quick space -----------------------------------------------------------------------


def test_quick_candidates_have_16_rows_a_warp(quick):
    specs, refused = quick
    assert specs
    for s in specs:
        assert s.tiling.block_q == 16 * s.tiling.warps_q, s.name
        assert s.smem_layout == "swizzled" and not s.pipeline.q_in_registers and s.pipeline.kv_smem == "separate"
    # the quick filter (16 rows a warp, swizzled for d128) is not the validator: only points
    # that pass it are kept or refused
    points = [c for c in itertools.product(*QUICK_SPACE.values()) if c[0] == 16 * c[1] and c[4] == "swizzled"]
    assert len(specs) + refused == len(points) == 18


def test_quick_is_a_subset_of_the_full_space(quick, full):
    assert {s.name for s in quick[0]} <= {s.name for s in full[0]}


# ---- write_tuned ---------------------------------------------------------------------------


@pytest.fixture
def best(full):
    spec = next(s for s in full[0] if _combo(s) == (128, 8, 128, ("separate", 2), "swizzled", False))
    return Candidate(spec, ms=1.856, tflops=296.3)


def test_write_tuned_writes_a_loadable_spec(best, base, tmp_path):
    path = tune.write_tuned(best, base, (4, 16, 4096, 4096), tmp_path, "h200")
    assert path == tmp_path / "attn_f16_d128_h200.yaml"
    assert [p.name for p in tmp_path.iterdir()] == ["attn_f16_d128_h200.yaml"]
    loaded = fagen.load_spec(path)  # the name matches the file's stem
    assert loaded.name == "attn_f16_d128_h200"
    assert loaded.model_copy(update={"name": best.spec.name}) == best.spec


def test_write_tuned_first_line_records_shape_and_speed(best, base, tmp_path):
    path = tune.write_tuned(best, base, (4, 16, 4096, 2048), tmp_path, "h200")
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ")
    assert "h200" in first
    assert "B=4 H=16 Nq=4096 Nk=2048" in first
    assert "1.856 ms" in first and "296.3 TFLOP/s" in first


CHOSEN_BY_AB = re.compile(r"^# chosen by A/B on [a-z0-9]+ against (\w+_long_[a-z0-9]+) \(CUDA graphs, [^)]+\): N=\d+: ")
HEADER = re.compile(r"^# tuned by `fagen tune` on [a-z0-9]+: B=\d+ H=\d+ Nq=\d+ Nk=\d+: "
                    r"\d+\.\d{3} ms, \d+\.\d TFLOP/s \(checked against the oracle first\)$")


def test_write_tuned_header_has_the_shipped_format(best, base, tmp_path):
    """The header of a written spec reads like those of the shipped tuned specs."""
    path = tune.write_tuned(best, base, (4, 16, 4096, 4096), tmp_path, "h200")
    assert HEADER.match(path.read_text().splitlines()[0])
    # (split-KV *_partial_h200 specs are chosen by hand, and their header says how; so does a
    # short class chosen by A/B against its long class, naming it)
    shipped = sorted(f for f in SPECS.glob("*_h200.yaml") if "_partial_" not in f.name)
    assert shipped
    for f in shipped:
        first = f.read_text().splitlines()[0]
        by_hand = CHOSEN_BY_AB.match(first)
        assert HEADER.match(first) or (by_hand and (SPECS / f"{by_hand.group(1)}.yaml").exists()), f


def test_write_tuned_names_the_file_after_the_gpu(best, base, tmp_path):
    path = tune.write_tuned(best, base, (1, 1, 128, 128), tmp_path, "h100")
    assert path.name == "attn_f16_d128_h100.yaml"
    assert fagen.load_spec(path).name == "attn_f16_d128_h100"


# ---- fagen tune --dry-run (no GPU) ---------------------------------------------------------


@pytest.fixture
def no_gpu(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("tune --dry-run must not time or probe the GPU")
    monkeypatch.setattr(tune, "tune", refuse)
    monkeypatch.setattr(device, "gpu_slug", refuse)
    monkeypatch.setattr(tune, "write_tuned", refuse)


@pytest.mark.parametrize("quick_flag", [False, True])
def test_cli_tune_dry_run_counts_without_a_gpu(quick_flag, full, quick, tmp_path, no_gpu):
    specs, refused = quick if quick_flag else full
    args = ["tune", str(BASE_PATH), "--dry-run", "-o", str(tmp_path)] + (["--quick"] if quick_flag else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    lines = result.output.splitlines()
    assert lines[0].startswith(f"{len(specs)} candidates ({refused} refused by the validator")
    assert [ln.strip() for ln in lines[1:]] == [s.name for s in specs]
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_cli_tune_dry_run_d96(no_gpu):
    result = CliRunner().invoke(main, ["tune", str(D96_PATH), "--dry-run"])
    assert result.exit_code == 0, result.output
    specs, refused = tune.candidates(fagen.load_spec(D96_PATH))
    assert result.output.splitlines()[0].startswith(f"{len(specs)} candidates ({refused} refused")
    assert "_s\n" not in result.output and "_s_qreg" not in result.output


def test_tune_refuses_before_any_candidate_without_a_gpu(base, monkeypatch):
    import sys

    from fagen import bench

    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(bench, "time_spec", lambda *a, **k: pytest.fail("timed a candidate"))
    monkeypatch.setattr(tune, "_spills", lambda *a, **k: pytest.fail("compiled a candidate"))
    seen = []
    with pytest.raises(RuntimeError, match="CuPy is not installed"):
        tune.tune(base, 1, 1, 64, 64, quick=True, progress=seen.append)
    assert seen == []


# ---- the tile scheduler -------------------------------------------------------------------------


def _timer(rates: dict):
    """A stand-in for bench.time_spec: TFLOP/s by (persistent, N), recording what it timed."""
    seen = []

    def time(spec, b, h, nq, nk, check):
        seen.append((spec.pipeline.warp_specialized.persistent, b, h, nq, nk, check))
        return type("Timing", (), {"tflops": rates[spec.pipeline.warp_specialized.persistent][nq]})()
    return time, seen


def test_the_scheduler_is_chosen_by_geometric_mean_over_the_lengths():
    ws = fagen.load_spec(SPECS / "attn_f16_d128_h200.yaml")
    lengths = tune.SCHEDULER_LENGTHS
    # persistent: far faster at short N, a little slower at long N: wins the geometric mean ...
    time, seen = _timer({False: dict(zip(lengths, (250, 320, 380, 410))), True: dict(zip(lengths, (330, 380, 365, 400)))})
    choice = tune.choose_scheduler(ws, time)
    assert choice.spec.pipeline.warp_specialized.persistent and choice.persistent == (330, 380, 365, 400)
    assert {(b * n, h * ws.head_dim) for _, b, h, n, _, _ in seen} == {(tune.TOKENS, tune.HIDDEN)}
    assert len(seen) == 2 * len(lengths) * tune.SCHEDULER_ROUNDS
    assert [p for p, *_, check in seen if check] == [False, True]  # each kernel checked once, first
    assert [p for p, *_ in seen[::len(lengths)]] == [False, True, True, False, False, True]  # alternating rounds
    assert "scheduler: persistent" in choice.summary()
    # ... where the arithmetic mean would not pick it
    time, _ = _timer({False: dict(zip(lengths, (100, 100, 900, 900))), True: dict(zip(lengths, (160, 160, 600, 600)))})
    assert tune.choose_scheduler(ws, time).spec.pipeline.warp_specialized.persistent
    time, _ = _timer({False: dict(zip(lengths, (400, 450, 570, 570))), True: dict(zip(lengths, (400, 450, 500, 560)))})
    choice = tune.choose_scheduler(ws, time)
    assert not choice.spec.pipeline.warp_specialized.persistent and choice.spec.name == ws.name
    # ahead, but by less than SCHEDULER_MARGIN: a block a tile stays
    time, _ = _timer({False: dict(zip(lengths, (400, 400, 400, 400))), True: dict(zip(lengths, (410, 410, 410, 410)))})
    assert 1.0 < 410 / 400 < tune.SCHEDULER_MARGIN
    assert not tune.choose_scheduler(ws, time).spec.pipeline.warp_specialized.persistent


def test_cli_tune_chooses_the_scheduler_of_a_warp_specialized_winner(monkeypatch, tmp_path):
    """`fagen tune` on an sm_90a spec: the sweep's winner, if warp-specialised, goes through
    choose_scheduler, and its summary lands in the written spec's comments."""
    ws = fagen.load_spec(SPECS / "attn_f16_d128_h200.yaml")
    grid = tune.with_scheduler(ws, False)
    monkeypatch.setattr("fagen.cli._need_gpu", lambda torch=False: None)
    monkeypatch.setattr(device, "gpu_slug", lambda: "h200")
    monkeypatch.setattr(tune, "tune", lambda *a, **k: [Candidate(grid, 1.0, 500.0)])
    rates = (300.0, 400.0, 500.0, 550.0)
    monkeypatch.setattr(tune, "choose_scheduler", lambda spec, lengths: tune.SchedulerChoice(
        tune.with_scheduler(spec, True), rates, tuple(r * 1.2 for r in rates), lengths))
    result = CliRunner().invoke(main, ["tune", str(SPECS / "attn_f16_d128_h200.yaml"), "--quick", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    text = (tmp_path / "attn_f16_d128_h200.yaml").read_text()
    assert text.splitlines()[1].startswith("# scheduler: persistent (TFLOP/s a block a tile / persistent")
    assert "N=512: 300 / 360" in text.splitlines()[1]
    assert fagen.load_spec(tmp_path / "attn_f16_d128_h200.yaml").pipeline.warp_specialized.persistent


def test_cli_tune_long_writes_the_long_class_chosen_over_long_lengths(monkeypatch, tmp_path):
    """--long: `<name>_long_<gpu>.yaml`, its scheduler chosen over the lengths from LONG_KEYS on,
    which fagen.attention then takes for that many keys (fagen.variants.shipped_spec)."""
    ws = fagen.load_spec(SPECS / "attn_f16_d128_h200.yaml")
    monkeypatch.setattr("fagen.cli._need_gpu", lambda torch=False: None)
    monkeypatch.setattr(device, "gpu_slug", lambda: "h200")
    monkeypatch.setattr(tune, "tune", lambda *a, **k: [Candidate(tune.with_scheduler(ws, False), 1.0, 500.0)])
    seen = []

    def choose(spec, lengths):
        seen.append(lengths)
        return tune.SchedulerChoice(spec, (500.0,) * len(lengths), (490.0,) * len(lengths), lengths)

    monkeypatch.setattr(tune, "choose_scheduler", choose)
    args = ["tune", str(SPECS / "attn_f16_d128_h200.yaml"), "--quick", "--long", "-o", str(tmp_path)]
    refused = CliRunner().invoke(main, args + ["--shape", "4,16,1024,1024"])
    assert refused.exit_code == 2 and "--long times at 2048 or more" in refused.output
    result = CliRunner().invoke(main, args + ["--shape", "2,16,8192,8192"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert seen == [(4096, 16384)] and tune.scheduler_lengths(False) == tune.SCHEDULER_LENGTHS
    path = tmp_path / "attn_f16_d128_long_h200.yaml"
    head = path.read_text().splitlines()
    assert "shape class: long sequences" in head[1] and "N=4096: 500 / 490" in head[2]
    assert fagen.load_spec(path).name == "attn_f16_d128_long_h200"
