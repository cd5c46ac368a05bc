"""The one-step LLA fit: the ℓ1-SVM, then one reweighted ℓ1-SVM, each an exact linear program.

The hinge loss plus a weighted ℓ1 term, (1/n) Σ max(0, 1 − y_i(a_iᵀw + b)) + Σ_j c_j |w_j|, is a
linear program in w = w⁺ − w⁻ (w⁺, w⁻ ≥ 0), the slacks ξ ≥ 0 and a free b:

    min  Σ_j c_j (w⁺_j + w⁻_j) + (1/n) Σ_i ξ_i   s.t.  y_i(a_iᵀ(w⁺ − w⁻) + b) + ξ_i ≥ 1.

scipy's HiGHS dual simplex solves it to a vertex, where every column it does not need is exactly
0. The fit solves it twice:

1. c_j = λ: the convex ℓ1-SVM. Its optimal objective does not depend on any starting point;
   where collinear columns tie, several vertices reach it, and the simplex returns one of them
   (w₁);
2. c_j = p'(|w₁_j|): the local linear approximation of the nonconvex penalty at w₁. p is concave
   in |w|, so this weighted ℓ1 term majorises it at w₁, and the objective at the result is at
   most the objective at w₁. For SCAD and MCP the slope is 0 beyond aλ (γλ): large weights are
   no longer shrunk, while weights that were 0 keep the full slope λ and stay 0 unless the hinge
   needs them.

When every slope equals λ (SCAD with all |w₁_j| ≤ λ) step 2 is the same program and is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from interlace.svm.admm import Matrix, objective, signed_rows
from interlace.svm.penalties import penalty_slope
from interlace.svm.settings import DEFAULTS, SVMSettings

ZERO = 1e-9
"""Weights with |w_j| ≤ this are set to 0: HiGHS leaves round-off of ~1e-13 where w⁺ and w⁻
cancel; a weight the fit uses is many orders of magnitude larger."""


@dataclass(frozen=True)
class LLAResult:
    """What `solve` returns: weights `coef` [d] and `intercept` after the LLA step, the ℓ1
    start `l1_coef` [d] and `l1_intercept`, and the nonconvex objective at both [2]."""

    coef: np.ndarray
    intercept: float
    l1_coef: np.ndarray
    l1_intercept: float
    objective_history: np.ndarray

    @property
    def converged(self) -> bool:
        """Always True: both linear programs are solved to optimality (else RuntimeError)."""
        return True

    @property
    def n_iter(self) -> int:
        """Linear programs counted: always 2 (the ℓ1 start and the LLA step)."""
        return len(self.objective_history)


class WeightedL1SVM:
    """The linear program above for one H = diag(y)·A [n, d]; `solve(c)` for any slopes c [d].

    HiGHS's simplex works on a basis as large as the number of rows, so the form with fewer rows
    is solved (on heart_scale's 162 × 13 folds: dual 5–6 ms, primal 9–12 ms). Presolve is off:
    on these programs it costs more than it saves (8.6 → 5.3 ms on the same folds).

    - primal: n rows, the 2d + n (+1) variables above;
    - dual:   max Σ α_i  s.t. −c ≤ Hᵀα ≤ c, yᵀα = 0 (with an intercept), 0 ≤ α_i ≤ 1/n;
      2d (+1) rows. w⁺ and w⁻ are the multipliers of its rows Hᵀα ≤ c and
      −Hᵀα ≤ c, and b that of yᵀα = 0, so w_j = 0 wherever |Hᵀα|_j < c_j.
    """

    def __init__(self, H: Matrix, y: np.ndarray, fit_intercept: bool) -> None:
        n, d = H.shape
        self.n, self.d, self.fit_intercept = n, d, fit_intercept
        self.dual = n > 2 * d + 1
        if self.dual:  # a dense H stays dense: scipy's checks of a small sparse matrix cost more
            self.A = (
                sp.vstack([H.T, -H.T], format="csc") if sp.issparse(H) else np.vstack([H.T, -H.T])
            )
            self.y = y[None, :] if fit_intercept else None
            return
        H = sp.csr_matrix(H)
        columns = [-H, H, -sp.eye(n, format="csr")]
        if fit_intercept:
            columns.append(sp.csr_matrix(-y[:, None]))
        self.A = sp.hstack(columns, format="csc")
        lower = np.zeros(self.A.shape[1])
        lower[2 * d + n :] = -np.inf  # b is free
        self.bounds = np.column_stack([lower, np.full(self.A.shape[1], np.inf)])

    def solve(self, c: np.ndarray) -> tuple[np.ndarray, float]:
        """Weights w [d] (|w_j| ≤ `ZERO` set to 0) and intercept b at the optimum, slopes c [d]."""
        n, d = self.n, self.d
        if self.dual:
            result = _linprog(
                -np.ones(n),
                A_ub=self.A,
                b_ub=np.concatenate([c, c]),
                A_eq=self.y,
                b_eq=[0.0] if self.fit_intercept else None,
                bounds=(0.0, 1.0 / n),
            )
            w = result.ineqlin.marginals[d:] - result.ineqlin.marginals[:d]
            b = -float(result.eqlin.marginals[0]) if self.fit_intercept else 0.0
        else:
            cost = np.zeros(self.A.shape[1])
            cost[:d] = cost[d : 2 * d] = c
            cost[2 * d : 2 * d + n] = 1.0 / n
            result = _linprog(cost, A_ub=self.A, b_ub=-np.ones(n), bounds=self.bounds)
            w = result.x[:d] - result.x[d : 2 * d]
            b = float(result.x[2 * d + n]) if self.fit_intercept else 0.0
        w[np.abs(w) <= ZERO] = 0.0
        return w, b


def _linprog(cost: np.ndarray, **program):
    result = linprog(cost, method="highs-ds", options={"presolve": False}, **program)
    if result.status != 0:
        raise RuntimeError(f"HiGHS could not solve the ℓ1-SVM linear program: {result.message}")
    return result


def solve(
    A: Matrix,
    y: np.ndarray,
    settings: SVMSettings = DEFAULTS,
    *,
    program: WeightedL1SVM | None = None,
) -> LLAResult:
    """One-step LLA fit of A [n, d] (dense or sparse), labels y [n] in {−1, +1} (module
    docstring). Uses `penalty`, `lam`, `theta` and `fit_intercept` of `settings`; `program`
    reuses the linear program built for the same A, y and intercept (a path shares one)."""
    penalty, lam, theta = settings.penalty, settings.lam, settings.shape
    y = np.asarray(y, dtype=float)
    H = signed_rows(A, y)
    if program is None:
        program = WeightedL1SVM(H, y, settings.fit_intercept)
    w1, b1 = program.solve(np.full(H.shape[1], lam))
    slopes = penalty_slope(w1, penalty, lam, theta)
    w, b = (w1, b1) if np.all(slopes == lam) else program.solve(slopes)
    history = np.array([objective(H, y, v, c, penalty, lam, theta) for v, c in ((w1, b1), (w, b))])
    return LLAResult(w, b, w1, b1, history)
