"""`NonconvexSVC`: the LLA and ADMM solvers as a scikit-learn classifier.

It is a plain `BaseEstimator` + `ClassifierMixin`, so cloning, `get_params`/`set_params`,
`score`, pipelines and `GridSearchCV` come from scikit-learn; this module adds only the label
mapping (any two classes ↔ −1/+1) and the calls into `interlace.svm.lla` or `.admm`.
"""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from interlace.svm import admm, lla
from interlace.svm.settings import DEFAULTS, SVMSettings


def binary_labels(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Map labels y [n] of any two-class form to (classes [2], y_pm [n] in {−1, +1}).

    classes[0] ↦ −1 and classes[1] ↦ +1 (classes sorted, as `np.unique` gives them).
    Raises ValueError naming the classes found when there are not exactly two.
    """
    classes, index = np.unique(y, return_inverse=True)
    if len(classes) < 2:
        raise ValueError(
            f"y has only one class ({_show(classes)}); a classifier needs two classes to train"
        )
    if len(classes) > 2:
        raise ValueError(
            f"Only binary classification is supported. y has {len(classes)} classes "
            f"({_show(classes)}); give labels of exactly two classes"
        )
    return classes, np.where(index == 1, 1.0, -1.0)


def _show(classes: np.ndarray, limit: int = 10) -> str:
    shown = ", ".join(repr(c.item() if hasattr(c, "item") else c) for c in classes[:limit])
    return shown + (", ..." if len(classes) > limit else "")


def fit_settings(X, y_pm: np.ndarray, settings: SVMSettings) -> admm.ADMMResult | lla.LLAResult:
    """Fit X [n, d], labels y_pm [n] in {−1, +1} with `settings.solver`; the result has `coef` [d],
    `intercept`, `n_iter` and `objective_history` [n_iter]."""
    if settings.solver == "lla":
        return lla.solve(X, y_pm, settings)
    return admm.solve(X, y_pm, settings)


class NonconvexSVC(ClassifierMixin, BaseEstimator):
    """Linear SVM with hinge loss and a nonconvex sparsity penalty (one-step LLA or ADMM).

    Minimises (1/n) Σ max(0, 1 − y_i(x_iᵀw + b)) + Σ_j p(w_j) with p one of "scad", "mcp",
    "lsp", "capped_l1" (see `interlace.svm.penalties`); the weights come out exactly sparse.

    Parameters: the fields of `interlace.svm.settings.SVMSettings`, with their defaults and
    meanings (`penalty`, `lam`, `theta`, `solver`, `rho1`, `rho2`, `max_iter`, `tol`,
    `fit_intercept`); as scikit-learn asks, they are kept as given and checked when `fit` runs.
    The default `solver="lla"` fits the ℓ1-SVM and then one reweighted ℓ1 step
    (`interlace.svm.lla`); `solver="admm"` runs ADMM from w = 0. Both give exact zeros.

    Fitted attributes: `coef_` [1, n_features], `intercept_` [1], `classes_` [2] (the class
    mapped to the positive side is `classes_[1]`), `n_iter_` (ADMM iterations, or the 2 linear
    programs of "lla"), `objective_history_` [n_iter_], `n_features_in_`. Dense arrays and
    scipy.sparse matrices are accepted.
    """

    def __init__(
        self,
        penalty: str = DEFAULTS.penalty,
        lam: float = DEFAULTS.lam,
        theta: float | None = DEFAULTS.theta,
        solver: str = DEFAULTS.solver,
        rho1: float = DEFAULTS.rho1,
        rho2: float | None = DEFAULTS.rho2,
        max_iter: int = DEFAULTS.max_iter,
        tol: float = DEFAULTS.tol,
        fit_intercept: bool = DEFAULTS.fit_intercept,
    ) -> None:
        self.penalty = penalty
        self.lam = lam
        self.theta = theta
        self.solver = solver
        self.rho1 = rho1
        self.rho2 = rho2
        self.max_iter = max_iter
        self.tol = tol
        self.fit_intercept = fit_intercept

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = True
        tags.classifier_tags.multi_class = False
        return tags

    def fit(self, X, y) -> NonconvexSVC:
        """Fit on X [n, d] (dense or sparse) and labels y [n] of exactly two classes."""
        settings = SVMSettings(**self.get_params(deep=False))
        X, y = validate_data(self, X, y, accept_sparse="csr", dtype=np.float64)
        check_classification_targets(y)
        self.classes_, y_pm = binary_labels(y)
        result = fit_settings(X, y_pm, settings)
        self.coef_ = result.coef[None, :]
        self.intercept_ = np.array([result.intercept])
        self.n_iter_ = result.n_iter
        self.objective_history_ = result.objective_history
        return self

    def decision_function(self, X) -> np.ndarray:
        """Signed scores x_iᵀw + b [n]; positive means `classes_[1]`."""
        check_is_fitted(self)
        X = validate_data(self, X, accept_sparse="csr", dtype=np.float64, reset=False)
        return np.asarray(X @ self.coef_[0]).ravel() + self.intercept_[0]

    def predict(self, X) -> np.ndarray:
        """Predicted labels [n], in the form of `classes_`."""
        positive = self.decision_function(X) > 0
        return self.classes_[positive.astype(int)]
