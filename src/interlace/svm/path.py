"""Regularisation path: fit a decreasing sequence of λ with `settings.solver`.

With "lla" every point is exactly the estimator's fit at that λ, and all points share one linear
program (the slopes change, not its matrix). With "admm" all points share one factorisation of
HᵀH + ρI (it does not depend on λ), and each ADMM run starts from the previous point's full state
(primal, slack and dual variables), so a whole path costs little more than one cold fit. Use it
to pick λ by validation (`interlace.svm.select`), or to draw accuracy against sparsity.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils.validation import check_X_y

from interlace.errors import ConfigError
from interlace.svm import admm, lla
from interlace.svm.estimator import binary_labels
from interlace.svm.linsolve import GramSolver
from interlace.svm.settings import DEFAULTS, SVMSettings


@dataclass(frozen=True)
class RegularizationPath:
    """Fits along a path: `lams` [k] (decreasing), `coefs` [k, d], `intercepts` [k],
    `n_iters` [k], `converged` [k], and the `classes` [2] (classes[1] is the positive side)."""

    lams: np.ndarray
    coefs: np.ndarray
    intercepts: np.ndarray
    n_iters: np.ndarray
    converged: np.ndarray
    classes: np.ndarray

    def decision_function(self, X) -> np.ndarray:
        """Scores [n, k] of X [n, d] under every point of the path."""
        return np.asarray(X @ self.coefs.T) + self.intercepts[None, :]

    def predict(self, X) -> np.ndarray:
        """Labels [n, k] of X [n, d] under every point of the path."""
        return self.classes[(self.decision_function(X) > 0).astype(int)]

    def n_nonzero(self) -> np.ndarray:
        """Number of non-zero weights [k] at each point."""
        return np.count_nonzero(self.coefs, axis=1)


def lam_max(A, y_pm: np.ndarray) -> float:
    """‖Aᵀy‖∞ / n for A [n, d], y_pm [n] in {−1, +1}: a start where the weights are (nearly) 0.

    It is exactly the smallest λ with w = 0 stationary when the classes are balanced (then b = 0
    and every hinge is active); with unbalanced classes it is a good heuristic start.
    """
    return float(np.abs(np.asarray(A.T @ y_pm)).max() / A.shape[0])


def default_lams(A, y_pm: np.ndarray, n_lams: int = 20, lam_ratio: float = 1e-2) -> np.ndarray:
    """`n_lams` values [n_lams], geometric from `lam_max` down to `lam_ratio`·lam_max."""
    top = lam_max(A, y_pm)
    if top == 0:
        raise ConfigError("every feature is zero in X, so there is no path to fit; check the data")
    return np.geomspace(top, top * lam_ratio, n_lams)


def regularization_path(
    X,
    y,
    lams=None,
    *,
    n_lams: int = 20,
    lam_ratio: float = 1e-2,
    settings: SVMSettings = DEFAULTS,
) -> RegularizationPath:
    """Fit X [n, d] (dense or sparse), labels y [n] (two classes) at every λ in `lams`.

    `lams` is sorted decreasing; without it, `default_lams(n_lams, lam_ratio)` is used. Every
    point uses `settings` with its own λ in place of `settings.lam`. Warns once, with the count,
    if some ADMM points hit `max_iter`.
    """
    X, y = check_X_y(X, y, accept_sparse="csr", dtype=np.float64)
    classes, y_pm = binary_labels(y)
    if lams is None:
        lams = default_lams(X, y_pm, n_lams, lam_ratio)
    lams = np.sort(np.asarray(lams, dtype=float).ravel())[::-1]
    if lams.size == 0 or not np.all(np.isfinite(lams)) or lams[-1] < 0:
        raise ConfigError(f"lams={lams!r} must be a non-empty list of finite numbers >= 0")
    if settings.solver == "lla":
        results = _lla_points(X, y_pm, lams, settings)
    else:
        results = _admm_points(X, y_pm, lams, settings)
    converged = np.array([r.converged for r in results])
    if not converged.all():
        warnings.warn(
            f"{(~converged).sum()} of {len(lams)} path points stopped at "
            f"max_iter={settings.max_iter}",
            ConvergenceWarning,
            stacklevel=2,
        )
    return RegularizationPath(
        lams=lams,
        coefs=np.stack([r.coef for r in results]),
        intercepts=np.array([r.intercept for r in results]),
        n_iters=np.array([r.n_iter for r in results]),
        converged=converged,
        classes=classes,
    )


def _lla_points(X, y_pm: np.ndarray, lams: np.ndarray, settings: SVMSettings) -> list:
    """One LLA fit per λ [k], all on one linear program (its slopes change, not its matrix)."""
    program = lla.WeightedL1SVM(admm.signed_rows(X, y_pm), y_pm, settings.fit_intercept)
    return [lla.solve(X, y_pm, replace(settings, lam=float(lam)), program=program) for lam in lams]


def _admm_points(X, y_pm: np.ndarray, lams: np.ndarray, settings: SVMSettings) -> list:
    """One ADMM fit per λ [k], each warm-started from the previous one, on one factorisation."""
    rho = settings.rho1 / settings.rho2_for(X.shape[0])
    gram = GramSolver(admm.signed_rows(X, y_pm), rho)
    results, state = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for lam in lams:
            result = admm.solve(X, y_pm, replace(settings, lam=float(lam)), state=state, gram=gram)
            results.append(result)
            state = result.state
    return results
