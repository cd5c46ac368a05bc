"""ADMM for the nonconvex penalised hinge-loss SVM, on NumPy / scipy.sparse.

Problem, for rows a_i of A [n, d] and labels y_i ∈ {−1, +1}:

    min_{w, b}  (1/n) Σ_i max(0, 1 − y_i(a_iᵀw + b)) + Σ_j p(w_j)

With H = diag(y)·A it is split as

    min (1/n)1ᵀξ + P(z)   s.t.  x − z = 0,  Hx + b·y + ξ − 1 − s = 0,  ξ ≥ 0,  s ≥ 0

(ξ is the hinge slack, s ≥ 0 the surplus of the margin over 1 − ξ), with scaled duals u1 [d],
u2 [n], penalties ρ1, ρ2 and ρ = ρ1/ρ2. One iteration updates, in this order,

    x  = (HᵀH + ρI)⁻¹ (ρ(z − u1) + Hᵀ(1 + s − ξ − u2 − b·y))      (factorised once)
    b  = yᵀ(1 + s − ξ − u2 − Hx)/n                                  (0 without intercept)
    z  = prox_{P/ρ1}(x + u1)                                        (exact, elementwise)
    ξ  = max(0, 1 + s − u2 − Hx − b·y − 1/(n·ρ2))
    s  = max(0, Hx + ξ − 1 + u2 + b·y)
    u1 += x − z;   u2 += Hx + ξ − 1 − s + b·y

and stops when the objective at (z, b) changes by less than `tol` relative to its previous value,
or after `max_iter` iterations. The model returned is (z, b): z is exactly sparse.

Known limits, measured on the LIBSVM files in shared/data/svm:
- The relative-change rule stops wherever progress per iteration is small, not only at a
  minimum. With the paper's heart_scale setting (ρ1 = 1.5, ρ2 = 10) each iteration can move a
  slack by at most 1/(n·ρ2), so on the full heart_scale it stops after 4 iterations at an
  objective 46 % above the best found; hence the default ρ2 = 1/n (see `interlace.svm.settings`).
- SCAD, MCP and capped-ℓ1 are bounded, so on (nearly) separable data the objective keeps falling
  as w grows and has no minimiser; the stopping rule then ends a slow drift.
- The problem is nonconvex: different ρ, warm starts or row splits may end at different
  stationary points.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
from sklearn.exceptions import ConvergenceWarning

from interlace.svm.linsolve import GramSolver
from interlace.svm.penalties import penalty_value, prox
from interlace.svm.settings import DEFAULTS, SVMSettings

Matrix = np.ndarray | sp.spmatrix | sp.sparray


@dataclass
class ADMMState:
    """Every iterate of the splitting; pass one back in to warm-start. Shapes: d or n as named."""

    x: np.ndarray  # [d]
    z: np.ndarray  # [d]
    u1: np.ndarray  # [d]
    xi: np.ndarray  # [n]
    s: np.ndarray  # [n]
    u2: np.ndarray  # [n]
    b: float = 0.0

    @classmethod
    def zeros(cls, n: int, d: int) -> ADMMState:
        """The cold start: everything 0."""
        return cls(*(np.zeros(k) for k in (d, d, d, n, n, n)))


@dataclass
class ADMMResult:
    """What `solve` returns: the sparse weights `coef` [d], `intercept`, iterations run, the
    objective at (z, b) after each iteration, whether the stopping rule fired, and the final
    state (for warm starts)."""

    coef: np.ndarray
    intercept: float
    n_iter: int
    objective_history: np.ndarray
    converged: bool
    state: ADMMState = field(repr=False)


def signed_rows(A: Matrix, y: np.ndarray) -> Matrix:
    """H = diag(y)·A [n, d], kept sparse (CSR) when A is sparse."""
    if sp.issparse(A):
        return sp.csr_matrix(sp.diags(y) @ A)
    return np.asarray(A, dtype=float) * y[:, None]


def objective(
    H: Matrix, y: np.ndarray, w: np.ndarray, b: float, penalty: str, lam: float, theta: float
) -> float:
    """(1/n) Σ max(0, 1 − y_i(a_iᵀw + b)) + Σ_j p(w_j) for H = diag(y)·A [n, d], w [d]."""
    hinge = np.maximum(0.0, 1.0 - (H @ w + b * y)).sum() / H.shape[0]
    return float(hinge + penalty_value(w, penalty, lam, theta).sum())


def relative_change(new: float, old: float) -> float:
    """|new − old| / |old| (guarded against old = 0): the stopping statistic."""
    return abs(new - old) / max(abs(old), np.finfo(float).tiny)


def solve(
    A: Matrix,
    y: np.ndarray,
    settings: SVMSettings = DEFAULTS,
    *,
    state: ADMMState | None = None,
    gram: GramSolver | None = None,
) -> ADMMResult:
    """Run ADMM with `settings` on A [n, d] (dense or sparse) with labels y [n] in {−1, +1}.

    `state` warm-starts from a previous result's state; `gram` reuses a factorisation of
    HᵀH + (rho1/rho2)I for H = diag(y)·A (a regularisation path shares one). Warns with
    ConvergenceWarning when `max_iter` is reached before the stopping rule fires.
    """
    penalty, lam, theta = settings.penalty, settings.lam, settings.shape
    y = np.asarray(y, dtype=float)
    n, d = A.shape
    rho1, rho2 = settings.rho1, settings.rho2_for(n)
    rho = rho1 / rho2
    if gram is None:
        gram = GramSolver(signed_rows(A, y), rho)
    elif gram.H.shape != (n, d) or not np.isclose(gram.rho, rho):
        raise ValueError(
            f"gram was factorised for H of shape {gram.H.shape} and rho={gram.rho}, "
            f"not for A of shape {(n, d)} and rho1/rho2={rho}"
        )
    H = gram.H
    st = ADMMState.zeros(n, d) if state is None else _copy(state)
    if st.x.shape != (d,) or st.xi.shape != (n,):
        raise ValueError(
            f"warm-start state is for d={st.x.shape[0]}, n={st.xi.shape[0]}, "
            f"not for A of shape {(n, d)}"
        )
    x, z, u1, xi, s, u2, b = st.x, st.z, st.u1, st.xi, st.s, st.u2, st.b
    slack_step = 1.0 / (n * rho2)
    max_iter, tol = settings.max_iter, settings.tol
    history = np.empty(max_iter)
    converged = False
    k = 0
    while k < max_iter:
        target = 1.0 + s - xi - u2  # what Hx + b·y should equal
        x = gram.solve(rho * (z - u1) + H.T @ (target - b * y))
        Hx = H @ x
        if settings.fit_intercept:
            b = float(y @ (target - Hx)) / n
        z = prox(x + u1, penalty, lam, theta, rho1)
        margin = Hx + b * y
        xi = np.maximum(0.0, 1.0 + s - u2 - margin - slack_step)
        s = np.maximum(0.0, margin + xi - 1.0 + u2)
        u1 += x - z
        u2 += margin + xi - 1.0 - s
        history[k] = objective(H, y, z, b, penalty, lam, theta)
        k += 1
        if k > 1 and relative_change(history[k - 1], history[k - 2]) < tol:
            converged = True
            break
    if not converged:
        warnings.warn(
            f"ADMM stopped at max_iter={max_iter} before the objective's relative change fell "
            f"below tol={tol}; raise max_iter or tol",
            ConvergenceWarning,
            stacklevel=2,
        )
    final = ADMMState(x=x, z=z, u1=u1, xi=xi, s=s, u2=u2, b=b)
    return ADMMResult(z.copy(), b, k, history[:k].copy(), converged, final)


def _copy(state: ADMMState) -> ADMMState:
    return ADMMState(
        *(
            np.array(v, dtype=float)
            for v in (state.x, state.z, state.u1, state.xi, state.s, state.u2)
        ),
        b=float(state.b),
    )
