"""The one-step LLA fit: exact ℓ1-SVM linear programs, the slopes, and the majorisation step."""

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.optimize import linprog

from helpers import SVM_DATA
from interlace.svm import NonconvexSVC, SVMSettings, lla
from interlace.svm.admm import objective, signed_rows
from interlace.svm.io import load_libsvm
from interlace.svm.penalties import PENALTIES, penalty_slope, penalty_value


def _plain_lp(A, y, c, fit_intercept):
    """The weighted ℓ1-SVM optimum, from the textbook primal with HiGHS's default settings."""
    n, d = A.shape
    H = A * y[:, None]
    columns = [-H, H, -np.eye(n)] + ([-y[:, None]] if fit_intercept else [])
    cost = np.concatenate([c, c, np.full(n, 1 / n), [0.0] * fit_intercept])
    bounds = [(0, None)] * (2 * d + n) + [(None, None)] * fit_intercept
    return linprog(cost, A_ub=np.hstack(columns), b_ub=-np.ones(n), bounds=bounds).fun


@pytest.mark.parametrize(("n", "d", "dual"), [(120, 8, True), (30, 60, False)])
@pytest.mark.parametrize("fit_intercept", [True, False])
def test_both_forms_reach_the_optimum_with_exact_zeros(n, d, dual, fit_intercept):
    rng = np.random.default_rng(n)
    A = rng.standard_normal((n, d))
    y = np.where(A[:, 0] + 0.5 * A[:, 1] + 0.3 * rng.standard_normal(n) > 0, 1.0, -1.0)
    c = rng.uniform(0.0, 0.05, d)
    program = lla.WeightedL1SVM(signed_rows(A, y), y, fit_intercept)
    assert program.dual == dual
    w, b = program.solve(c)
    reached = np.maximum(0, 1 - y * (A @ w + b)).mean() + c @ np.abs(w)
    assert reached == pytest.approx(_plain_lp(A, y, c, fit_intercept), rel=1e-8, abs=1e-12)
    assert fit_intercept or b == 0.0
    assert 0 < np.count_nonzero(w) < d  # a vertex: the columns it does not need are exactly 0


@pytest.mark.parametrize("penalty", PENALTIES)
def test_slope_is_the_penalty_derivative(penalty):
    lam, theta = 0.3, {"scad": 3.7, "mcp": 2.0, "lsp": 0.5, "capped_l1": 0.8}[penalty]
    t = np.linspace(0.013, 2.0, 157)
    h = 1e-6
    numeric = (
        penalty_value(t + h, penalty, lam, theta) - penalty_value(t - h, penalty, lam, theta)
    ) / (2 * h)
    knots = np.array([lam, theta * lam, theta])
    away = np.abs(t[:, None] - knots[None, :]).min(axis=1) > 2 * h
    np.testing.assert_allclose(
        penalty_slope(t, penalty, lam, theta)[away], numeric[away], atol=1e-6
    )
    at_zero = penalty_slope(np.zeros(1), penalty, lam, theta)[0]
    assert at_zero == pytest.approx(lam / theta if penalty == "lsp" else lam)


@pytest.mark.parametrize(
    ("penalty", "theta"), [("scad", 3.7), ("mcp", 3.0), ("lsp", 1.0), ("capped_l1", 0.05)]
)
def test_the_lla_step_never_raises_the_objective(penalty, theta):
    ((X, y),) = load_libsvm(SVM_DATA / "heart_scale")
    H = signed_rows(X, y)
    lowered = 0
    for lam in (0.1, 0.03, 0.01):
        fit = lla.solve(X, y, SVMSettings(penalty=penalty, lam=lam, theta=theta))
        start, end = fit.objective_history
        l1_start = objective(H, y, fit.l1_coef, fit.l1_intercept, penalty, lam, theta)
        assert start == pytest.approx(l1_start)
        assert end <= start + 1e-12
        lowered += end < start - 1e-6
    assert lowered >= 2


def test_estimator_reports_the_lla_fit_and_the_solver_choice():
    ((X, y),) = load_libsvm(SVM_DATA / "heart_scale")
    model = NonconvexSVC(penalty="mcp", lam=0.03).fit(X, y)
    fit = lla.solve(X, y, SVMSettings(penalty="mcp", lam=0.03))
    np.testing.assert_array_equal(model.coef_[0], fit.coef)
    assert model.n_iter_ == 2 and model.objective_history_.shape == (2,)
    assert 0 < np.count_nonzero(model.coef_) < 13
    admm = NonconvexSVC(penalty="mcp", lam=0.03, solver="admm").fit(sp.csr_matrix(X), y)
    assert admm.n_iter_ > 2
