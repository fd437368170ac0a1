"""Fit fagen.plan.REGISTER_COSTS to ptxas -v data, by linear programming (needs scipy).

    python scripts/fit_registers.py sweep.csv:1 tuner.csv:50 matrix.csv:40 ... [--margin 8] [--wgmma-margin 4]

Each CSV (scripts/register_sweep.py, or scripts/compile_matrix.py --csv) holds a spec, the arch it
was compiled for, and ptxas' registers and spills; `:W` weighs its kernels that fit. The terms
are fagen.plan.register_terms'. Constraints: every kernel that spilled is predicted at least
256 + margin; every shipped spec at most 254 (room for rounding up). Objective: the weighted
sum of how far fitting kernels are predicted over 255, plus their distance to ptxas' count.
Prints the costs (rounded up to 0.01) and, per file, what they refuse and accept.
"""

from __future__ import annotations

import argparse
import csv
import json

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

import fagen.plan as plan_mod
from fagen.load import SPECS, load_spec
from fagen.plan import plan, register_terms
from fagen.spec import AttentionSpec

LOWER = {"mma_sync": {"few_threads": 25, "o": 1, "s": 1, "q": 1}, "wgmma": {"o": 1, "s": 1.5}}


def terms(spec: AttentionSpec) -> dict[str, float]:
    p = plan(spec)
    q = p.m_frags * (spec.head_dim // 16) * 4 if spec.pipeline.q_in_registers else 0
    return register_terms(spec, p.m_frags * p.o_n_frags * 4, p.m_frags * p.s_n_frags * 4, q, p.threads)


def load(path: str):
    rows = []
    for r in csv.DictReader(open(path)):
        spec = AttentionSpec.model_validate(json.loads(r["spec"]))
        rows.append((spec, terms(spec), int(r["registers"]), int(r["spill_stores"]) > 0 or int(r["stack"]) > 0))
    return rows


def fit(data, kind: str, margin: float):
    names = sorted({n for rows, _ in data for s, t, _, _ in rows if (s.wgmma == (kind == "wgmma")) for n in t})
    A, y, regs, w, src = [], [], [], [], []
    for i, (rows, weight) in enumerate(data):
        for s, t, r, spilled in rows:
            if s.wgmma == (kind == "wgmma"):
                A.append([t.get(n, 0.0) for n in names]); y.append(spilled); regs.append(r); w.append(weight); src.append(i)
    A, y, regs, w, src = np.array(A), np.array(y), np.array(regs, float), np.array(w, float), np.array(src)
    shipped = [load_spec(p) for p in sorted(SPECS.glob("*.yaml"))]
    S = np.array([[terms(s).get(n, 0.0) for n in names] for s in shipped if s.wgmma == (kind == "wgmma")])
    k, fits = len(names), ~y
    m, spills = fits.sum(), A[y]
    C, I, Z = sp.csr_matrix, sp.identity(m, format="csr"), sp.csr_matrix((m, m))
    A_ub = sp.vstack([sp.hstack([C(-spills), C((len(spills), 2 * m))]), sp.hstack([C(S), C((len(S), 2 * m))]),
                      sp.hstack([C(A[fits]), -I, Z]), sp.hstack([C(A[fits]), Z, -I]), sp.hstack([C(-A[fits]), Z, -I])], format="csr")
    b_ub = np.concatenate([-(256 + margin) * np.ones(len(spills)), 254 * np.ones(len(S)), 255 * np.ones(m), regs[fits], -regs[fits]])
    c = np.concatenate([np.zeros(k), w[fits], w[fits]])
    bounds = [(LOWER[kind].get(n, 0), None) for n in names] + [(0, None)] * (2 * m)
    res = linprog(c, A_ub=A_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if res.status:
        raise SystemExit(f"{kind}: {res.message}")
    costs = np.ceil(res.x[:k] * 100) / 100
    pred = A @ costs
    for i in range(len(data)):
        sel = src == i
        print(f"  file {i}: {(sel & ~y).sum()} fit, {((pred > 255) & sel & ~y).sum()} of them refused; "
              f"{(sel & y).sum()} spilled, {((pred <= 255) & sel & y).sum()} of them accepted")
    return {n: float(v) for n, v in zip(names, costs) if v > 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="CSV[:weight]")
    ap.add_argument("--margin", type=float, default=8)
    ap.add_argument("--wgmma-margin", type=float, default=4)
    args = ap.parse_args()
    plan_mod.MAX_REGISTERS = 10**6  # the data holds refused specs too
    data = []
    for f in args.files:
        path, _, weight = f.partition(":")
        data.append((load(path), float(weight or 1)))
    for kind, margin in (("mma_sync", args.margin), ("wgmma", args.wgmma_margin)):
        print(kind)
        print(f"  {json.dumps(fit(data, kind, margin))}")


if __name__ == "__main__":
    main()
