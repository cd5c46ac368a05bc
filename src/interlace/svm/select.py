"""Choosing λ: the default grid, k-fold cross-validation along the path, and the one-SE rule.

`LAM_GRID` is the default grid, listed from the sparse end. With its default shape every penalty
has slope λ at 0 (LSP λ/θ with θ = 1), so a weight leaves 0 at the same λ whichever penalty is
used, and one grid serves all four. With
features scaled to [−1, 1] or one-hot, λ ≥ 0.1 keeps at most a few weights and λ = 0.001 lets the
hinge drive the fit. Listing it decreasing matters for `GridSearchCV`: on tied scores it keeps
the first candidate, which is then the larger λ.

`cross_validate_path` scores every λ on k folds; `one_standard_error` then picks the sparsest
model whose mean score is within one standard error of the best (glmnet's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.model_selection import StratifiedKFold

from interlace.svm.path import RegularizationPath, regularization_path
from interlace.svm.settings import DEFAULTS, SVMSettings

LAM_GRID = (0.1, 0.03, 0.01, 0.003, 0.001)
"""The default λ grid, from the sparse end (module docstring)."""


@dataclass(frozen=True)
class CVPath:
    """`lams` [k] (decreasing), per-λ mean validation accuracy `mean` [k] and its standard error
    `stderr` [k] over the folds, and the `path` fitted on all the rows (its non-zeros [k])."""

    lams: np.ndarray
    mean: np.ndarray
    stderr: np.ndarray
    path: RegularizationPath

    @property
    def best(self) -> int:
        """Index of the best mean score; on a tie, the larger λ."""
        return int(np.argmax(self.mean))

    @property
    def one_se(self) -> int:
        """Index that `one_standard_error` picks."""
        return one_standard_error(self.mean, self.stderr, self.path.n_nonzero())


def one_standard_error(mean: np.ndarray, stderr: np.ndarray, nonzeros: np.ndarray) -> int:
    """Index of the sparsest point (fewest `nonzeros` [k]; on a tie, the first) whose `mean` [k]
    is at least the best mean minus the best point's `stderr` [k]. Points are in path order, so
    ties go to the larger λ."""
    best = int(np.argmax(mean))
    within = np.flatnonzero(mean >= mean[best] - stderr[best])
    return int(within[np.argmin(nonzeros[within])])


def cross_validate_path(
    X, y, lams=LAM_GRID, *, settings: SVMSettings = DEFAULTS, folds: int = 3, seed: int = 0
) -> CVPath:
    """Accuracy of every λ in `lams` on `folds` ≥ 2 stratified folds of X [n, d], y [n], and
    the path on all rows. Fold splits are shuffled with `seed`."""
    lams = np.sort(np.asarray(lams, dtype=float))[::-1]
    splitter = StratifiedKFold(folds, shuffle=True, random_state=seed)
    scores = np.empty((folds, len(lams)))
    for k, (train, valid) in enumerate(splitter.split(X, y)):
        fold = regularization_path(X[train], y[train], lams, settings=settings)
        scores[k] = (fold.predict(X[valid]) == np.asarray(y)[valid, None]).mean(axis=0)
    stderr = scores.std(axis=0, ddof=1) / np.sqrt(folds)
    path = regularization_path(X, y, lams, settings=settings)
    return CVPath(lams=lams, mean=scores.mean(axis=0), stderr=stderr, path=path)
