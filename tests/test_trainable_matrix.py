"""Every shape the forward runs also trains: each mask kind x score modifier x head_dim x dtype that
fagen.attention derives (fagen.nvcc.attention_defaults and attention_variants: the generic sm_80
specs an A100 runs and the sm_90a ones an H100/H200 runs), deterministic or not, with the bias's
gradient wherever there is a bias, gets a backward from fagen.variants.trainable; and the backward
kernels compile with no spill and no stack frame.

Which tiling a cell gets is the register estimates' choice (fagen.backward_plan: the first of
trainable's tilings they accept), and every term of an estimate grows with the mask kind's and the
modifiers' cost, so within one arch family and head_dim the cells nearest the registers' limit are
those with the costliest mask (a causal document: its bounds) and every modifier on; with a bias,
its gradient too, and both dQ strategies (wgmma: atomic or the dQ kernel). Those are compiled here,
once each distinct source (fagen.nvcc.compile_backward_many), for both families and each head_dim
(an H200's head_dim 32 and 96 are the generic specs, as the generic family's, far from the limit);
float16 stands for bfloat16 (only the MMA's type and an unpack differ) except at head_dim 256,
where the kernels sit closest to the limit and both are compiled, with Gemma 2 and 3's shape
(sliding window, softcap) and a bias (its loads once spilled both kernels there at every tiling).
ptxas is not monotone near the limit (a bias alone has spilled where a bias with softcap fit), so
the head_dim 256 rows, the ones that run there, were compiled whole: every distinct backward of
the matrix, bias included (384 with one), both families, 0 spills (nvcc 13.0).
"""

from __future__ import annotations

import pytest

from fagen.nvcc import attention_defaults, attention_variants, compile_backward_many
from fagen.spec import HEAD_DIMS, Mask, ScoreMod, SpecError
from fagen.variants import trainable, variant

FAMILIES = (None, "h200")  # the generic defaults (sm_80) and the sm_90a ones (H100, H200)
EVERY_MODIFIER = {"softcap": 30.0, "alibi": "slopes", "sinks": True}
GEMMA = (Mask(kind="sliding_window", window_left=300), ScoreMod(softcap=30.0))
# a relative table times a per-head gain; a table beside a nonlinear term (its gradient taken
# before the expression's factor: ds_before_chain)
LEARNED_TABLES = ScoreMod(expression="score + captured0[h * 8191 + q_idx - kv_idx + 4095] * captured1[h]",
                          expression_grad="1.0f", captured=2)
LEARNED_SOFTCAPPED = ScoreMod(expression="tanhf(score * 0.05f) * 20.0f + captured0[h * 8191 + q_idx - kv_idx + 4095]",
                              expression_grad="1.0f - tanhf(score * 0.05f) * tanhf(score * 0.05f)", captured=1)


def defaults(gpu, head_dim):
    return [s for s, _ in attention_defaults(gpu, classes=(None,)) if s.head_dim == head_dim]


def cells(gpu, head_dim):
    """(forward spec, deterministic, bias_grad) of every combination fagen.attention can train."""
    for base in defaults(gpu, head_dim):
        for spec in attention_variants(base):
            for deterministic in (False, True):
                for bias_grad in ((False, True) if spec.score_mod.bias != "none" else (False,)):
                    yield spec, deterministic, bias_grad


@pytest.mark.parametrize("gpu", FAMILIES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_combination_finds_a_backward(gpu, head_dim):
    refused = []
    for spec, deterministic, bias_grad in cells(gpu, head_dim):
        try:
            trained = trainable(spec, deterministic, bias_grad)
        except SpecError as error:
            refused.append(f"{spec.name} deterministic={deterministic} bias_grad={bias_grad}: {error}")
            continue
        assert trained.backward.bias_grad == bias_grad and (trained.mask, trained.score_mod) == (spec.mask, spec.score_mod)
    assert not refused, f"{len(refused)} refused, e.g.\n" + "\n".join(refused[:5])


def builds():
    out = []
    for gpu in FAMILIES:
        for head_dim in HEAD_DIMS:
            if gpu is not None and not any(s.wgmma for s in defaults(gpu, head_dim)):
                continue  # the generic spec (head_dim 32, 96), compiled for the generic family
            base = [s for s in defaults(gpu, head_dim) if not s.causal][0]
            for dtype in ("float16", "bfloat16") if head_dim == 256 else ("float16",):
                plain = [s for s in defaults(gpu, head_dim) if not s.causal and s.dtype == dtype][0]
                out.append(trainable(variant(plain, Mask(kind="document", causal=True), ScoreMod(**EVERY_MODIFIER)), True))
                if head_dim == 256:
                    out += [trainable(variant(plain, *GEMMA), deterministic) for deterministic in (False, True)]
                    # a bias, the most registers measured (a block mask, every modifier: 254), a
                    # bias alone (it spilled most before its loads were pinned) and Gemma's shape
                    out += [trainable(variant(plain, Mask(kind="block_mask"), ScoreMod(**EVERY_MODIFIER, bias=kind)), True, True)
                            for kind in ("matrix", "vector")]
                    out += [trainable(variant(plain, Mask(), ScoreMod(bias="vector")), False, bias_grad) for bias_grad in (False, True)]
                    out.append(trainable(variant(plain, GEMMA[0], ScoreMod(softcap=30.0, bias="matrix")), False, True))
            biased = variant(base, Mask(kind="document", causal=True), ScoreMod(**EVERY_MODIFIER, bias="matrix"))
            out += [trainable(biased, deterministic, True) for deterministic in (False, True)]
            vector = variant(base, Mask(kind="sliding_window", window_left=1000), ScoreMod(bias="vector"))
            out.append(trainable(vector, False, True))
            if head_dim == 128:  # learned tables summed by the dK/dV kernel (backward.captured_grads), one a loop
                out.append(trainable(variant(base, Mask(kind="causal"), LEARNED_TABLES), False, False, (0, 1))
                           if gpu else trainable(variant(base, Mask(kind="block_mask"), LEARNED_SOFTCAPPED), False,
                                                 False, (0,)))
    return list(dict.fromkeys(out))


def test_the_backward_kernels_compile_without_spills():
    specs = builds()
    for spec, kernels in zip(specs, compile_backward_many([(s, None) for s in specs])):
        for kernel, r in kernels.items():
            assert (r.stack_frame, r.spill_stores, r.spill_loads) == (0, 0, 0), f"{spec.name} {kernel}:\n{r.log}"
            assert r.registers <= 255 and r.static_smem == 0, (spec.name, kernel, r.registers)


@pytest.mark.parametrize("gpu", FAMILIES)
def test_head_dim_256_with_a_bias_trains(gpu):
    """Every head_dim 256 cell with a bias (vector or matrix, its gradient or not) trains, at the
    16-query, 16-key tiling: its loads pinned ahead of the scores' MMAs, the kernels fit there."""
    biased = [(spec, d, g) for spec, d, g in cells(gpu, 256) if spec.score_mod.bias != "none"]
    assert {(spec.dtype, spec.score_mod.bias, g) for spec, _, g in biased} == {
        (dt, kind, g) for dt in ("float16", "bfloat16") for kind in ("vector", "matrix") for g in (False, True)}
    for spec, deterministic, bias_grad in biased:
        bwd = trainable(spec, deterministic, bias_grad).backward
        assert (bwd.head_split, bwd.block_kv, bwd.block_q, bwd.dq_block_kv, bwd.bias_grad) == (2, 64, 16, 16, bias_grad)


@pytest.mark.parametrize("gpu", FAMILIES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_a_ring_full_step_lays_its_rows_out_as_the_causal_block(gpu, head_dim):
    """A ring's causal own block and its full steps add dQ into one sum (backward.QueryRows.add),
    so their backwards must lay rows out alike (row pad, dK/dV query tile, atomic dQ), though each
    mask's own choice may differ (at d64 bfloat16 the causal mask's registers refuse the full
    mask's tiling): trainable_alike trains the full step on the causal block's tiling."""
    from fagen.backward_plan import backward_plan
    from fagen.variants import shipped_spec, trainable_alike

    def rows(spec):
        plan = backward_plan(spec)
        return plan.row_pad, plan.dkdv.block_q, plan.atomic_dq

    for dtype in ("float16", "bfloat16"):
        own = trainable(shipped_spec(dtype, head_dim, True, gpu=gpu))
        full = trainable_alike(shipped_spec(dtype, head_dim, False, gpu=gpu), own)
        assert rows(full) == rows(own), (dtype, full.name)


@pytest.mark.parametrize("gpu", FAMILIES)
@pytest.mark.parametrize("d, dv", [(192, 128), (128, 64), (64, 128)])
def test_every_two_width_combination_finds_a_backward(gpu, d, dv):
    """A v of its own width (fagen.attention's value-head variant of each cell; 192 from head_dim
    256's defaults, as fagen.dispatch derives it) trains under every mask kind but block masks
    (refused with two widths) and every modifier: on the wgmma loops where registers allow, else
    on mma.sync's (192/128 with a bias's gradient: dK and dV hold 160 registers a thread)."""
    from fagen.variants import value_head_variant

    refused, loops = [], set()
    for spec, deterministic, bias_grad in cells(gpu, 256 if d == 192 else d):
        if spec.mask.kind == "block_mask":
            continue
        try:
            trained = trainable(value_head_variant(spec, dv, d), deterministic, bias_grad)
        except SpecError as error:
            refused.append(f"{spec.name} deterministic={deterministic} bias_grad={bias_grad}: {error}")
            continue
        assert (trained.head_dim, trained.dv, trained.backward.bias_grad) == (d, dv, bias_grad)
        assert not trained.atomic_dq  # a two-width dQ is the dQ kernel's
        loops.add(trained.wgmma_backward)
    assert not refused, f"{len(refused)} refused, e.g.\n" + "\n".join(refused[:5])
    assert loops == ({True, False} if (gpu, d) == ("h200", 192) else {gpu == "h200"}), loops
