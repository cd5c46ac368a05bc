"""The one-step LLA fit: the ℓ1-SVM, then one reweighted ℓ1-SVM, each an exact linear program.

The hinge loss plus a weighted ℓ1 term, (1/n) Σ max(0, 1 − y_i(a_iᵀw + b)) + Σ_j c_j |w_j|, is a
linear program in w = w⁺ − w⁻ (w⁺, w⁻ ≥ 0), the slacks ξ ≥ 0 and a free b:

    min  Σ_j c_j (w⁺_j + w⁻_j) + (1/n) Σ_i ξ_i   s.t.  y_i(a_iᵀ(w⁺ − w⁻) + b) + ξ_i ≥ 1.

HiGHS's dual simplex solves it to a vertex, where every column it does not need is exactly
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

import highspy
import numpy as np
import scipy.sparse as sp
from highspy._core import _Highs

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

    The program is handed to HiGHS once, as compressed arrays; each `solve` changes only the
    slopes, and the LLA step re-solves from the ℓ1 start's optimal basis. scipy's
    `linprog` checks, converts and cold-solves the whole program on every call, about 3.5 ms of
    fixed cost against HiGHS's 1–1.3 ms solve on heart_scale's folds (162 × 13; building here:
    0.8 ms), and has no warm start, hence highspy. Its `_Highs` core is used rather than the
    `Highs` wrapper, which enables callbacks, and with them HiGHS's banner, before output can be
    turned off. Presolve is off: on these programs it costs more than it saves.

    HiGHS's simplex works on a basis as large as the number of rows, so the form with fewer rows
    is solved:

    - primal: n rows, the 2d + n (+1) variables above; the slopes are costs;
    - dual:   max Σ α_i  s.t. −c ≤ Hᵀα ≤ c, yᵀα = 0 (with an intercept), 0 ≤ α_i ≤ 1/n;
      2d (+1) rows, the slopes their bounds. w⁺ and w⁻ are the multipliers of its rows
      Hᵀα ≤ c and −Hᵀα ≤ c, and b that of yᵀα = 0, so w_j = 0 wherever |Hᵀα|_j < c_j.
    """

    def __init__(self, H: Matrix, y: np.ndarray, fit_intercept: bool) -> None:
        n, d = H.shape
        self.n, self.d, self.fit_intercept = n, d, fit_intercept
        self.dual = n > 2 * d + 1
        H = sp.csc_matrix(H)
        plus, minus = (H.indptr, H.indices, H.data), (H.indptr, H.indices, -H.data)
        every_row = np.arange(n, dtype=np.int32)
        intercept = [(np.array([0, n]), every_row, y if self.dual else -y)] * fit_intercept
        free, inf = [-highspy.kHighsInf] * fit_intercept, highspy.kHighsInf
        if self.dual:  # rows Hᵀ, −Hᵀ, yᵀ: the compressed columns of H are the rows of Hᵀ
            lines, layout = [plus, minus, *intercept], highspy.MatrixFormat.kRowwise
            cost, lower, upper = -np.ones(n), np.zeros(n), np.full(n, 1.0 / n)
            row_lower = np.r_[np.full(2 * d, -inf), [0.0] * fit_intercept]
            row_upper = np.zeros(2 * d + fit_intercept)
        else:  # columns −H, H, −I, −y
            identity = (np.arange(n + 1), every_row, -np.ones(n))
            lines, layout = [minus, plus, identity, *intercept], highspy.MatrixFormat.kColwise
            cost = np.r_[np.zeros(2 * d), np.full(n, 1.0 / n), [0.0] * fit_intercept]
            lower, upper = np.r_[np.zeros(2 * d + n), free], np.full(cost.size, inf)
            row_lower, row_upper = np.full(n, -inf), -np.ones(n)
        starts, indices, values = _concatenated(lines)
        self.highs = _Highs()
        for option, value in (("output_flag", False), ("presolve", "off"), ("solver", "simplex")):
            self.highs.setOptionValue(option, value)
        status = self.highs.passModel(
            cost.size, row_lower.size, values.size, int(layout),
            int(highspy.ObjSense.kMinimize), 0.0, cost, lower, upper, row_lower, row_upper,
            starts, indices, values, np.zeros(cost.size, dtype=np.int32),  # continuous
        )  # fmt: skip
        if status != highspy.HighsStatus.kOk:
            raise RuntimeError(f"HiGHS refused the ℓ1-SVM linear program: {status.name}")
        self.slope_index = np.arange(2 * d, dtype=np.int32)

    def solve(self, c: np.ndarray, warm: bool = False) -> tuple[np.ndarray, float]:
        """Weights w [d] (|w_j| ≤ `ZERO` set to 0) and intercept b at the optimum, slopes c [d];
        `warm` continues from the previous solve's basis, else the simplex starts afresh (so
        the result depends on c alone: collinear columns tie, and another start may end at
        another optimal vertex)."""
        n, d, highs = self.n, self.d, self.highs
        if not warm:
            highs.clearSolver()
        slopes = np.concatenate([c, c]).astype(float)
        if self.dual:
            no_lower = np.full(2 * d, -highspy.kHighsInf)
            highs.changeRowsBounds(2 * d, self.slope_index, no_lower, slopes)
        else:
            highs.changeColsCost(2 * d, self.slope_index, slopes)
        highs.run()
        if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            status = highs.modelStatusToString(highs.getModelStatus())
            raise RuntimeError(f"HiGHS could not solve the ℓ1-SVM linear program: {status}")
        solution = highs.getSolution()
        if self.dual:
            multipliers = np.asarray(solution.row_dual)
            w = multipliers[d : 2 * d] - multipliers[:d]
            b = -float(multipliers[2 * d]) if self.fit_intercept else 0.0
        else:
            x = np.asarray(solution.col_value)
            w = x[:d] - x[d : 2 * d]
            b = float(x[2 * d + n]) if self.fit_intercept else 0.0
        w[np.abs(w) <= ZERO] = 0.0
        return w, b


def _concatenated(lines: list[tuple[np.ndarray, np.ndarray, np.ndarray]]):
    """One compressed matrix (starts, indices [int32], values [float64]) from compressed blocks
    (starts, indices, values), each block's lines (columns, or rows) after the previous's."""
    ends = np.cumsum([0] + [line[0][-1] for line in lines])
    starts = np.concatenate(
        [start[:-1] + offset for (start, _, _), offset in zip(lines, ends, strict=False)]
    )
    indices = np.concatenate([index for _, index, _ in lines]).astype(np.int32)
    values = np.concatenate([value for _, _, value in lines]).astype(float)
    return starts.astype(np.int32), indices, values


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
    w, b = (w1, b1) if np.all(slopes == lam) else program.solve(slopes, warm=True)
    history = np.array([objective(H, y, v, c, penalty, lam, theta) for v, c in ((w1, b1), (w, b))])
    return LLAResult(w, b, w1, b1, history)
