"""The backward in `fagen bench`: fagen's backward kernels (fagen.backward) beside PyTorch SDPA's
FlashAttention-2 and cuDNN backends and, on the masked cases, FlexAttention (torch.compile, a
block mask), in the same process, on the same GPU.

FLOPs, by the FlashAttention papers' convention: the backward runs five N x N x d matmuls (S =
Q K^T again, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q), 2.5x the forward's two:
10 * B * H * Nq * Nk * d, halved for causal; masked cases count the kept (q, k) pairs,
10 * B * H * d * kept. Forward + backward: 3.5x the forward, 14 * B * H * Nq * Nk * d.

Each case draws fresh random inputs, shared by every implementation. fagen's kernels are checked
before they are timed, (1) against the float64 oracle (fagen.oracle.attention_backward) on a
smaller shape and (2) at the timed shape against float32 SDPA's gradients of the same inputs,
with every output NaN-poisoned before its launch (the forward's `out`; the backward's dq, dk,
dv and its D and LSE rows through torch's fill_uninitialized_memory): a kernel over either
tolerance is reported, not timed. Then the backward alone, given the saved forward (fagen:
compile_backward(spec)(dout, q, k, v, out, lse); the peers: torch.autograd.grad of a forward
output whose graph is kept, retain_graph=True), and forward + backward: CUDA events, warm-up,
median of 30 (fagen.check.time_ms). Peak memory: torch.cuda.max_memory_allocated during one
backward call less what was allocated before it (the gradients included).
"""

from __future__ import annotations

import math
import sys
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fagen import bench_cases, bench_rows, masks, oracle
from fagen.backward import compile_backward
from fagen.bench_cases import Case
from fagen.check import random_inputs, relative_error, time_ms, to_numpy
from fagen.dispatch import derive_spec
from fagen.spec import Mask
from fagen.variants import trainable

LENGTHS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128)
DTYPE = "float16"
MASKED_N, MASKED_HEAD_DIM = 4096, 128
MASKS = ("sliding_window", "documents", "prefix_lm")
N_DOCS = 4  # the backward's document case packs 4 documents (the forward sweep's: bench_cases.N_DOCS)
PEERS_DENSE = ("sdpa_flash", "sdpa_cudnn")
IMPLS = ("fagen", "sdpa_flash", "sdpa_cudnn", "flex", "fa4")
LABELS = {"fagen": "fagen", "sdpa_flash": "SDPA FA2", "sdpa_cudnn": "SDPA cuDNN", "flex": "Flex", "fa4": "FA4"}
BACKWARD_FACTOR = 2.5  # backward FLOPs / forward FLOPs: 5 matmuls to 2
FWD_BWD_FACTOR = 3.5
ORACLE_N = 1536  # the oracle check's length: past bench_cases.WINDOW and bench_cases.PREFIX, so their edges count
ORACLE_TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2}  # worst of dq, dk, dv against the float64 oracle
FULL_TOLERANCE = 2e-2  # ... against float32 SDPA at the timed shape
MATH_REFERENCE_MAX_BYTES = 8 << 30  # the float32 reference falls back to SDPA's math backend below this
JSON, CSV, PLOT = "bench_backward.json", "bench_backward.csv", "bench_backward.png"
FIX = f"pass a {JSON} written by `fagen bench --backward` (or the full `fagen bench`)"


def cases(quick: bool = False) -> list[Case]:
    """float16, B * N = 16k tokens, H * d = 2048: dense and causal for d in HEAD_DIMS and N in
    LENGTHS, each mask at N = 4k, d = 128, and each modifier on the causal mask at N = 4k for d in
    HEAD_DIMS (quick: d = 128, N = 4k, dense, causal and the sliding window)."""
    if quick:
        return [Case(DTYPE, 128, 4096, c) for c in (False, True)] + [_masked("sliding_window")]
    dense = [Case(DTYPE, d, n, c) for d in HEAD_DIMS for n in LENGTHS for c in (False, True)]
    modified = [Case(DTYPE, d, MASKED_N, True, modifier=m) for d in HEAD_DIMS for m in bench_cases.MODIFIERS]
    return dense + [_masked(m) for m in MASKS] + modified


def _masked(mask: str) -> Case:
    return Case(DTYPE, MASKED_HEAD_DIM, MASKED_N, True, mask, **({"docs": N_DOCS} if mask == "documents" else {}))


def backward_flops(case: Case) -> float:
    """10 * B * H * N^2 * d, halved for causal; masks: 10 * B * H * d * kept pairs."""
    return BACKWARD_FACTOR * bench_cases.case_flops(case)


def fwd_bwd_flops(case: Case) -> float:
    """14 * B * H * N^2 * d, halved for causal; masks: 14 * B * H * d * kept pairs."""
    return FWD_BWD_FACTOR * bench_cases.case_flops(case)


def describe_masks() -> str:
    """The masked cases' masks in words, for the run's meta."""
    return (f"sliding_window: {bench_cases.WINDOW} keys before the diagonal; documents: {N_DOCS} packed documents of "
            f"random lengths (seed 0), causal within each; prefix_lm: a {bench_cases.PREFIX}-key prefix, causal after; "
            f"causal + softcap {bench_cases.SOFTCAP:g}; causal + sinks: a float32 logit a head (bench_cases.sink_logits, "
            f"seed 0), its own gradient not compared")


@dataclass
class BackwardRow:
    case: str
    kernel: str  # fagen spec name or peer name
    impl: str  # fagen | sdpa_flash | sdpa_cudnn | flex | fa4
    dtype: str
    head_dim: int
    n: int
    batch: int
    heads: int
    causal: bool
    mask: str
    bwd_ms: float | None = None  # the backward alone, given the saved forward
    bwd_tflops: float | None = None  # backward_flops / bwd_ms
    fwd_bwd_ms: float | None = None  # forward then backward
    fwd_bwd_tflops: float | None = None  # fwd_bwd_flops / fwd_bwd_ms
    peak_mib: float | None = None  # extra memory during one backward call, its gradients included
    error: float | None = None  # worst relative error of dq, dk, dv against float32 SDPA, timed shape
    oracle_error: float | None = None  # fagen: ... against the float64 oracle, B=1 H=2 N<=ORACLE_N
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _row(case: Case, kernel: str, impl: str) -> BackwardRow:
    # a modifier's rows say it after their mask, and join the masks' table (as the forward's do)
    mask = case.mask if case.modifier == "none" else case.mask_label
    return BackwardRow(case.key, kernel, impl, case.dtype, case.head_dim, case.n, case.batch, case.heads,
                       case.causal, mask)


def _rates(row: BackwardRow, case: Case) -> None:
    row.bwd_tflops = backward_flops(case) / row.bwd_ms / 1e9
    row.fwd_bwd_tflops = fwd_bwd_flops(case) / row.fwd_bwd_ms / 1e9


# ---- measuring (GPU) -------------------------------------------------------------------------


def run(case_list: list[Case], progress=None) -> list[BackwardRow]:
    import torch

    # Flex compiles afresh: dynamo's recompile limit counts the forward sweep's graphs of the
    # same function, and past it dynamo would run Flex eagerly (slowly) without a word
    torch._dynamo.reset()
    rows: list[BackwardRow] = []
    for case in case_list:
        rows += run_case(case)
        if progress:
            progress(case)
    return rows


def run_case(case: Case) -> list[BackwardRow]:
    """fagen, then its peers (Flex on masks and the softcap, SDPA FA2 and cuDNN on the dense cases,
    FlashAttention-4 where it takes the mask or modifier), on one fresh draw of q, k, v and dout,
    each checked against one float32 reference."""
    q, k, v, out = random_inputs("torch", case.dtype, case.batch, case.heads, case.heads, case.n, case.n,
                                 case.head_dim)
    dout = random_inputs("torch", case.dtype, case.batch, case.heads, case.heads, case.n, case.n, case.head_dim)[0]
    reference, how = reference_gradients(case, q, k, v, dout)
    rows = [run_fagen(case, q, k, v, out, dout, reference, how)]
    if case.modifier != "none":  # SDPA takes neither modifier, Flex no sinks
        peers = (("flex",) if case.modifier == "softcap" else ()) + (bench_cases.FA4,)
    else:
        peers = (("flex",) if case.mask != "none" else PEERS_DENSE) + \
            ((bench_cases.FA4,) if case.mask in bench_cases.FA4_MASKS else ())
    for impl in peers:
        rows.append(run_peer(case, impl, q, k, v, dout, reference))
    return rows


def keep_matrix(case: Case) -> np.ndarray:
    """The case's mask as a dense [N, N] bool (bench_cases.mask_predicate)."""
    positions = np.arange(case.n)
    return np.asarray(bench_cases.mask_predicate(case)(positions[:, None], positions[None, :]), bool)


def reference_gradients(case: Case, q, k, v, dout) -> tuple[tuple | None, str]:
    """(dq, dk, dv) in float32 from float32 SDPA on the same inputs (memory-efficient backend,
    else math where its scores fit MATH_REFERENCE_MAX_BYTES), and how; None and why where
    neither ran. A modifier's case (SDPA takes none): modified_reference_gradients."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if case.modifier != "none":
        return modified_reference_gradients(case, q, k, v, dout), "float32 causal attention with the modifier, in torch"

    xs = [x.detach().float().requires_grad_() for x in (q, k, v)]
    mask = None if case.mask == "none" else torch.from_numpy(keep_matrix(case)).to(q.device)
    causal = case.causal and case.mask == "none"
    tried = []
    for backend in ("EFFICIENT_ATTENTION", "MATH"):
        scores = 4 * case.batch * case.heads * case.n * case.n
        if backend == "MATH" and scores > MATH_REFERENCE_MAX_BYTES:
            tried.append(f"MATH: its float32 scores would take {scores / 2**30:.0f} GiB")
            continue
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                out = torch.nn.functional.scaled_dot_product_attention(*xs, attn_mask=mask, is_causal=causal)
            return torch.autograd.grad(out, xs, dout.float()), f"float32 SDPA {backend}"
        except Exception as err:  # no reference leaves fagen checked by the oracle alone, and says so
            tried.append(f"{backend}: {_first_line(err)}")
    return None, "no float32 reference: " + "; ".join(tried)


def modified_reference_gradients(case: Case, q, k, v, dout) -> tuple:
    """(dq, dk, dv) in float32 of causal attention with the case's softcap or sinks, written out
    in torch (scores, cap, mask, softmax with the sink's column, P.V) and differentiated by
    autograd, a batch element at a time (its float32 scores: 1 GiB at N = 4k, H = 16)."""
    import torch

    scale = case.head_dim ** -0.5
    n = case.n
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    sinks = bench_cases.sink_tensor(case, q.device)
    grads = [torch.empty(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v)]
    for b in range(case.batch):
        xs = [x[b].detach().float().requires_grad_() for x in (q, k, v)]
        s = (xs[0] @ xs[1].transpose(-1, -2)) * scale
        if case.modifier == "softcap":
            s = bench_cases.SOFTCAP * torch.tanh(s / bench_cases.SOFTCAP)
        s = s.masked_fill(future, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.view(-1, 1, 1).expand(-1, n, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :n]
        out = p @ xs[2]
        for g, r in zip(grads, torch.autograd.grad(out, xs, dout[b].float())):
            g[b] = r
        del s, p, out
    return tuple(grads)


def grad_error(got, reference) -> float:
    """The worst relative L2 error of got's dq, dk, dv against the reference's; inf where got
    holds a NaN or an infinity (a poisoned output left unwritten)."""
    import torch

    worst = 0.0
    for g, r in zip(got, reference):
        g = g.float()
        if not bool(torch.isfinite(g).all()):
            return math.inf
        worst = max(worst, float(torch.linalg.vector_norm(g - r) / torch.linalg.vector_norm(r)))
    return worst


@contextmanager
def nan_filled_empties(device="cuda"):
    """torch.empty (and so every buffer fagen.backward allocates) NaN-filled, through torch's
    deterministic mode's fill_uninitialized_memory; yields whether the fill took (on `device`)."""
    import torch
    import torch.utils.deterministic

    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield bool(torch.empty(8, device=device).isnan().all())
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def peak_extra_mib(fn) -> float:
    """MiB torch's allocator held at most during fn(), over what it held before: the peak
    extra memory of one call, what it returns included."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak / 2**20


def fagen_spec(case: Case, q) -> tuple:
    """What fagen.attention trains with here: variants.trainable of dispatch.derive_spec for
    the case's key length (its shape class, as fagen.attention picks it), and the side inputs
    (doc_ids on q's device)."""
    if case.mask == "documents":
        import torch

        ids = masks.documents_of_lengths(case.doc_lengths(), case.batch)
        docs = torch.from_numpy(ids).to(q.device)
        return trainable(derive_spec(q, causal=True, doc_ids=docs, keys=case.n)), {"doc_ids": docs}
    if case.modifier != "none":
        sinks = bench_cases.sink_tensor(case, q.device) if case.modifier == "sinks" else None
        softcap = bench_cases.SOFTCAP if case.modifier == "softcap" else None
        spec = trainable(derive_spec(q, causal=True, softcap=softcap, sinks=sinks, keys=case.n))
        return spec, ({} if sinks is None else {"sinks": sinks})
    mask = {"sliding_window": Mask(kind="sliding_window", window_left=bench_cases.WINDOW),
            "prefix_lm": Mask(kind="prefix_lm", prefix_len=bench_cases.PREFIX)}.get(case.mask)
    return trainable(derive_spec(q, causal=case.causal and mask is None, mask=mask, keys=case.n)), {}


def oracle_check(spec, case: Case) -> tuple[float, bool]:
    """The worst relative error of fagen's dq, dk, dv against the float64 oracle at B=1, H=2,
    N = min(case.n, ORACLE_N) (documents: the first N positions of the case's packing), every
    output NaN-poisoned; and whether the poisoning took."""
    import torch

    n, d = min(case.n, ORACLE_N), case.head_dim
    q, k, v, out = random_inputs("torch", case.dtype, 1, 2, 2, n, n, d)
    dout = random_inputs("torch", case.dtype, 1, 2, 2, n, n, d)[0]
    docs = sinks = None
    if case.mask == "documents":
        docs = np.ascontiguousarray(masks.documents_of_lengths(case.doc_lengths())[:, :n])
    if case.modifier == "sinks":  # the case's first two heads'
        sinks = np.ascontiguousarray(bench_cases.sink_logits(case.heads)[:2])
    extras = {} if docs is None else {"doc_ids": torch.from_numpy(docs).to(q.device)}
    if sinks is not None:
        extras["sinks"] = torch.from_numpy(sinks).to(q.device)
    backward = compile_backward(spec)
    with nan_filled_empties(q.device) as poisoned:
        out, lse = backward.forward(q, k, v, out=out, return_lse=True, **extras)
        grads = backward(dout, q, k, v, out, lse, **extras)
    ref = oracle.attention_backward(to_numpy(q), to_numpy(k), to_numpy(v), to_numpy(dout), mask=spec.mask,
                                    doc_ids=docs, softcap=spec.score_mod.softcap, sinks=sinks)
    return max(relative_error(to_numpy(getattr(grads, name)), ref[name]) for name in ("dq", "dk", "dv")), poisoned


def run_fagen(case: Case, q, k, v, out, dout, reference, how: str) -> BackwardRow:
    """Check, then time, fagen's backward (and forward + backward) on these inputs; `out` is
    NaN-filled, the forward writes it."""
    row = _row(case, "fagen", "fagen")
    try:
        spec, extras = fagen_spec(case, q)
        row.kernel = spec.name
        backward = compile_backward(spec)
        forward = backward.forward
        row.oracle_error, poisoned = oracle_check(spec, case)
        tol = ORACLE_TOLERANCE[case.dtype]
        if not row.oracle_error <= tol:
            row.note = (f"WRONG, not timed: dq/dk/dv rel err {row.oracle_error:.2e} against the float64 oracle "
                        f"(tol {tol:.0e})")
            return row
        notes = [] if poisoned else ["outputs not NaN-poisoned (torch.empty gave no NaN under "
                                     "fill_uninitialized_memory)"]
        with nan_filled_empties(q.device):
            out, lse = forward(q, k, v, out=out, return_lse=True, **extras)
            grads = backward(dout, q, k, v, out, lse, **extras)
        if reference is None:
            notes.append(f"not checked at the timed shape ({how})")
        else:
            row.error = _error(grads, reference)
            if not row.error <= FULL_TOLERANCE:
                row.note = (f"WRONG, not timed: dq/dk/dv rel err {row.error:.2e} against {how} at the timed shape "
                            f"(tol {FULL_TOLERANCE:.0e})")
                return row
        del grads
        row.peak_mib = peak_extra_mib(lambda: backward(dout, q, k, v, out, lse, **extras))
        row.bwd_ms = time_ms(lambda: backward(dout, q, k, v, out, lse, **extras))

        def step():
            o, lse_ = forward(q, k, v, return_lse=True, **extras)
            return backward(dout, q, k, v, o, lse_, **extras)

        row.fwd_bwd_ms = time_ms(step)
        _rates(row, case)
        row.note = "; ".join(notes)
    except Exception as err:  # reported in its row; the other cases still run
        traceback.print_exc(file=sys.stderr)
        row.note = f"{type(err).__name__}: {_first_line(err)}"
    return row


def _error(grads, reference) -> float:
    return grad_error((grads.dq, grads.dk, grads.dv), reference)


def run_peer(case: Case, impl: str, q, k, v, dout, reference) -> BackwardRow:
    """A peer's backward alone (autograd.grad of a kept forward graph) and forward + backward;
    its gradients' error against the reference is reported, not a gate."""
    import torch

    row = _row(case, impl, impl)
    # each peer in its own layout: FlashAttention-4's [B, N, H, d], its gradients compared as [B, H, N, d]
    native = bench_cases.to_fa4_layout if impl == bench_cases.FA4 else (lambda x: x)
    xs = [native(x.detach()).requires_grad_() for x in (q, k, v)]
    dout = native(dout)
    try:
        with _peer_context(impl):
            attend = _peer_forward(case, impl)
            out = attend(*xs)
            grads = torch.autograd.grad(out, xs, dout, retain_graph=True)  # compiles Flex's backward
            if impl == bench_cases.FA4:
                grads = [g.transpose(1, 2) for g in grads]
            if reference is not None:
                row.error = grad_error(grads, reference)
                if not row.error <= FULL_TOLERANCE:
                    row.note = f"gradients off: rel err {row.error:.2e} against the float32 reference"
            del grads

            def backward():
                return torch.autograd.grad(out, xs, dout, retain_graph=True)

            def step():
                return torch.autograd.grad(attend(*xs), xs, dout)

            row.peak_mib = peak_extra_mib(backward)
            row.bwd_ms = time_ms(backward)
            row.fwd_bwd_ms = time_ms(step)
        _rates(row, case)
    except Exception as err:  # a peer that does not run this case is reported, not fatal
        row.note = f"{type(err).__name__}: {_first_line(err)}"
    return row


def _peer_context(impl: str):
    if impl in bench_cases.SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, bench_cases.SDPA_BACKENDS[impl]))
    return nullcontext()


def _peer_forward(case: Case, impl: str):
    import torch

    if impl in bench_cases.SDPA_BACKENDS:
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    if impl == bench_cases.FA4:
        return bench_cases.fa4_attention(case)
    block_mask, score_mod = bench_cases.flex_block_mask(case), bench_cases.flex_score_mod(case)
    flex = _compiled_flex()
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask, score_mod=score_mod)


_FLEX = None


def _compiled_flex():
    """flex_attention compiled for static shapes (no dynamic-shape kernels from shapes the
    forward sweep saw)."""
    global _FLEX
    if _FLEX is None:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:160]


# ---- writers (pure: unit-tested on synthetic rows) --------------------------------------------


def write_data(rows: list[BackwardRow], meta: dict, out: Path) -> list[Path]:
    """bench_backward.json and bench_backward.csv in `out`; their paths."""
    bench_rows.write_json(rows, out / JSON, meta)
    bench_rows.write_csv(rows, out / CSV, BackwardRow)
    return [out / JSON, out / CSV]


def read_json(path: Path, fix: str = FIX) -> tuple[list[BackwardRow], dict]:
    """The rows and meta of a bench_backward.json; ValueError (one line) for what is not one."""
    return bench_rows.read_json(path, BackwardRow, fix)


def _tf(r: BackwardRow | None, field: str = "bwd_tflops") -> str:
    value = None if r is None else getattr(r, field)
    return "n/a" if value is None else f"{value:.0f}"


def _ratio(a: BackwardRow | None, b: BackwardRow | None) -> str:
    if a is None or b is None or a.bwd_tflops is None or b.bwd_tflops is None:
        return "n/a"
    return f"{a.bwd_tflops / b.bwd_tflops:.2f}x"


def _peaks(t: dict[str, BackwardRow], impls: tuple[str, ...]) -> str:
    return " / ".join("n/a" if t.get(i) is None or t[i].peak_mib is None else f"{t[i].peak_mib:.0f}" for i in impls)


def _errors(r: BackwardRow) -> str:
    return " / ".join("n/a" if e is None else f"{e:.1e}" for e in (r.oracle_error, r.error))


def markdown(rows: list[BackwardRow], meta: dict, plot_link: str | None = None) -> list[str]:
    """BENCHMARKS.md's backward section, as lines: what was measured and the FLOP formulas, the
    run's meta, a table per head_dim (dense and causal: fagen, SDPA FA2, SDPA cuDNN), one for
    the masks (fagen, Flex), the notes, the plot."""
    table = bench_rows.by_case(rows)
    out = ["## Backward", "",
           "Generated by `fagen bench --backward` or the full `fagen bench` (do not edit; rerun it). fagen's backward "
           "(the three kernels of fagen.backward, given the forward's saved out and LSE) beside PyTorch SDPA's "
           "FlashAttention-2 and cuDNN backends, FlashAttention-4 (dense, causal, sliding-window, softcap and sinks "
           "cases, its own [B, N, H, d] layout) and, on masks and the softcap, FlexAttention (torch.compile, a block "
           "mask, the softcap as a score_mod), in the "
           "same process; a peer's backward is torch.autograd.grad of a kept forward graph (retain_graph=True). "
           "**Backward TFLOP/s = 10·B·H·Nq·Nk·d / time** (five matmuls: 2.5 × the forward's 4·B·H·Nq·Nk·d), halved "
           "for causal; masks count kept (q, k) pairs: 10·B·H·d·kept / time. **fwd+bwd TFLOP/s = 14·B·H·Nq·Nk·d / "
           "time** (3.5 × the forward), halved and counted the same way. B·N = 16k tokens, H·d = 2048. Each fagen "
           f"kernel was checked before it was timed, its outputs NaN-poisoned: against the float64 oracle at B=1, "
           f"H=2, N ≤ {ORACLE_N} (tolerance {ORACLE_TOLERANCE['float16']:.0e} for float16), then at the timed "
           f"shape against float32 SDPA's gradients (a modifier's cases: float32 attention with it, written out in "
           f"torch; tolerance {FULL_TOLERANCE:.0e}); err = the worst relative "
           "error of dq, dk, dv, oracle / timed shape. Peak MiB = extra memory during one backward call, its "
           "gradients included (torch.cuda.max_memory_allocated). Median of 30 CUDA-event timings after warm-up.",
           ""]
    out += [f"- {k}: {v}" for k, v in sorted(meta.items())] + [""]
    dense = [r for r in rows if r.mask == "none" and r.impl == "fagen"]
    for d in sorted({r.head_dim for r in dense}):
        out += [f"### Backward, head_dim {d}", "",
                "| dtype | N | mask | fagen | SDPA FA2 | SDPA cuDNN | FA4 | fagen / FA2 | fagen / FA4 | fagen fwd+bwd | "
                "FA2 fwd+bwd | cuDNN fwd+bwd | FA4 fwd+bwd | peak MiB fagen / FA2 / cuDNN | fagen err |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sorted((r for r in dense if r.head_dim == d), key=lambda r: (r.dtype, r.causal, r.n)):
            t = table[r.case]
            fa2, cudnn, fa4 = t.get("sdpa_flash"), t.get("sdpa_cudnn"), t.get("fa4")
            out.append(f"| {r.dtype} | {r.n} | {'causal' if r.causal else 'none'} | {_tf(r)} | {_tf(fa2)} | "
                       f"{_tf(cudnn)} | {_tf(fa4)} | {_ratio(r, fa2)} | {_ratio(r, fa4)} | {_tf(r, 'fwd_bwd_tflops')} | "
                       f"{_tf(fa2, 'fwd_bwd_tflops')} | {_tf(cudnn, 'fwd_bwd_tflops')} | {_tf(fa4, 'fwd_bwd_tflops')} | "
                       f"{_peaks(t, ('fagen', 'sdpa_flash', 'sdpa_cudnn'))} | {_errors(r)} |")
        out.append("")
    masked = [r for r in rows if r.mask != "none" and r.impl == "fagen"]
    if masked:
        out += ["### Backward, masks (kept-work TFLOP/s)", "",
                "| dtype | d | N | mask | fagen | Flex | fagen / Flex | FA4 | fagen / FA4 | fagen fwd+bwd | "
                "Flex fwd+bwd | peak MiB fagen / Flex | fagen err |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sorted(masked, key=lambda r: (r.mask, r.head_dim, r.n)):
            t = table[r.case]
            flex, fa4 = t.get("flex"), t.get("fa4")
            out.append(f"| {r.dtype} | {r.head_dim} | {r.n} | {r.mask} | {_tf(r)} | {_tf(flex)} | {_ratio(r, flex)} | "
                       f"{_tf(fa4)} | {_ratio(r, fa4)} | {_tf(r, 'fwd_bwd_tflops')} | {_tf(flex, 'fwd_bwd_tflops')} | "
                       f"{_peaks(t, ('fagen', 'flex'))} | {_errors(r)} |")
        out.append("")
    notes = [r for r in rows if r.note]
    if notes:
        out += ["### Backward notes", ""] + [f"- {r.case} {r.impl}: {r.note}" for r in notes] + [""]
    if plot_link is not None:
        out += [f"![{Path(PLOT).stem}]({plot_link})", ""]
    return out


def summary_lines(rows: list[BackwardRow]) -> list[str]:
    """A line per fagen row for the terminal."""
    return [f"{r.case:36} fagen-bwd {r.bwd_tflops or 0:7.1f} TFLOP/s backward, {r.fwd_bwd_tflops or 0:7.1f} "
            f"fwd+bwd  {r.note}".rstrip() for r in rows if r.impl == "fagen"]


COLORS = {"fagen": "C0", "sdpa_flash": "C1", "sdpa_cudnn": "C2", "flex": "C3", "fa4": "C4"}


def plot(rows: list[BackwardRow], path: Path) -> None:
    """Backward TFLOP/s, grouped bars per implementation: a panel per (head_dim, causal) of the
    dense cases against N, and one of the masks (fagen against Flex), three panels a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = [r for r in rows if r.mask == "none"]
    masked = [r for r in rows if r.mask != "none"]
    panels: list = sorted({(r.head_dim, r.causal) for r in dense}) + (["masks"] if masked else [])
    cols = min(3, max(1, len(panels)))
    grid = -(-max(1, len(panels)) // cols)
    fig, axes = plt.subplots(grid, cols, figsize=(4.2 * cols, 3.4 * grid), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        if panel == "masks":
            # a mask or modifier at each head_dim it ran at (the modifiers' at two)
            sel, group = masked, (lambda r: (r.mask, r.head_dim))
            groups = sorted({group(r) for r in sel})
            labels = [f"{mask} d{d}".replace("causal + ", "") for mask, d in groups]
            ns = sorted({r.n for r in sel})
            ax.set_title("masks and modifiers, N = " + ", ".join(f"{n // 1024}k" for n in ns), fontsize=9)
        else:
            d, causal = panel
            sel = [r for r in dense if (r.head_dim, r.causal) == panel]
            group = (lambda r: r.n)
            groups = sorted({r.n for r in sel})
            labels = [f"{n // 1024}k" if n >= 1024 else str(n) for n in groups]
            ax.set_title(f"backward d={d} {'causal' if causal else 'non-causal'}", fontsize=9)
            ax.set_xlabel("sequence length")
        impls = [i for i in IMPLS if any(r.impl == i for r in sel)]
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            vals = [next((r.bwd_tflops or 0.0 for r in sel if r.impl == impl and group(r) == g), 0.0) for g in groups]
            ax.bar(np.arange(len(groups)) + i * width, vals, width, label=LABELS[impl], color=COLORS[impl])
        ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
        ax.set_xticklabels(labels, fontsize=8, rotation=30 if panel == "masks" else 0, ha="right" if panel == "masks" else "center")
        ax.set_ylabel("backward TFLOP/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
