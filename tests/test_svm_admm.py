"""The ADMM core: objective behaviour, the linear solver's paths, support recovery, warm starts."""

import warnings
from dataclasses import replace

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.exceptions import ConvergenceWarning

from helpers import SVM_DATA
from interlace.svm import SVMSettings, admm, linsolve, regularization_path
from interlace.svm.io import load_libsvm
from interlace.svm.path import lam_max
from interlace.svm.penalties import PENALTIES
from interlace.svm.synthetic import make_sparse_problem

AUTHORS = SVMSettings(penalty="scad", lam=2**-6, theta=3.7, rho1=1.5, rho2=10.0)


def _libsvm(name):
    ((X, y),) = load_libsvm(SVM_DATA / name)  # shipped with the tests: see data/svm/README.md
    return X, y


def _increases(history, skip):
    return np.diff(history[skip:]).clip(min=0)


def test_objective_near_monotone_on_heart_scale_with_authors_settings():
    X, y = _libsvm("heart_scale")
    with pytest.warns(ConvergenceWarning, match="max_iter=400"):
        result = admm.solve(X, y, replace(AUTHORS, tol=0.0, max_iter=400))
    h = result.objective_history
    assert len(h) == 400
    assert _increases(h, skip=5).max() <= 1e-6 * h[0]
    assert h[-1] < h[5] - 0.01  # and it does go down


def test_authors_stopping_rule_on_their_train_split():
    X, y = _libsvm("heart_scale.tr")
    result = admm.solve(X, y, AUTHORS)  # tol=1e-4 relative change, max 1000 iterations
    assert result.converged and 10 < result.n_iter < 1000
    h = result.objective_history
    assert admm.relative_change(h[-1], h[-2]) < 1e-4 <= admm.relative_change(h[-2], h[-3])
    assert _increases(h, skip=5).max() <= 1e-6 * h[0]
    A = X.toarray() * y[:, None]
    assert h[-1] == pytest.approx(
        admm.objective(A, y, result.coef, result.intercept, "scad", 2**-6, 3.7)
    )


@pytest.mark.parametrize("penalty", PENALTIES)
def test_default_settings_reach_a_low_objective(penalty):
    # Defaults (ρ1 = 0.5, ρ2 = 1/n) stop within 2 % of what 3000 iterations reach.
    X, y = _libsvm("heart_scale")
    fit = admm.solve(X, y, SVMSettings(penalty=penalty))
    with pytest.warns(ConvergenceWarning):
        long = admm.solve(X, y, SVMSettings(penalty=penalty, tol=0.0, max_iter=3000))
    assert fit.converged and fit.n_iter < 300
    assert fit.objective_history[-1] <= 1.02 * long.objective_history[-1]


@pytest.mark.parametrize("penalty", PENALTIES)
def test_known_sparse_support_is_recovered(penalty):
    problem = make_sparse_problem(n=300, d=1000, k=10, seed=3)  # n < d: Woodbury path
    lam = 0.2 * lam_max(problem.X, problem.y)
    result = admm.solve(problem.X, problem.y, SVMSettings(penalty=penalty, lam=lam))
    assert np.array_equal(np.flatnonzero(result.coef), problem.support)
    assert np.all(np.sign(result.coef[problem.support]) == np.sign(problem.w[problem.support]))


def _gram_case(n, d, sparse, seed=0):
    rng = np.random.default_rng(seed)
    H = (
        sp.random(n, d, density=0.3, random_state=seed, format="csr")
        if sparse
        else (rng.standard_normal((n, d)))
    )
    r = rng.standard_normal(d)
    dense = H.toarray() if sparse else H
    return H, r, np.linalg.solve(dense.T @ dense + 0.15 * np.eye(d), r)


@pytest.mark.parametrize(
    ("n", "d", "sparse", "method", "gram_shape"),
    [
        (60, 20, False, "cholesky", (20, 20)),
        (20, 60, False, "woodbury-cholesky", (20, 20)),
        (60, 20, True, "cholesky", (20, 20)),
        (20, 60, True, "woodbury-cholesky", (20, 20)),
    ],
)
def test_gram_solver_paths(n, d, sparse, method, gram_shape):
    H, r, expected = _gram_case(n, d, sparse)
    solver = linsolve.GramSolver(H, 0.15)
    assert solver.method == method and solver.gram_shape == gram_shape
    np.testing.assert_allclose(solver.solve(r), expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(
    ("n", "d", "method"), [(60, 20, "sparse-lu"), (20, 60, "woodbury-sparse-lu")]
)
def test_gram_solver_sparse_lu_beyond_the_dense_limit(monkeypatch, n, d, method):
    monkeypatch.setattr(linsolve, "DENSE_GRAM_LIMIT", 5)
    H, r, expected = _gram_case(n, d, sparse=True)
    solver = linsolve.GramSolver(H, 0.15)
    assert solver.method == method
    np.testing.assert_allclose(solver.solve(r), expected, rtol=1e-9, atol=1e-10)


def test_sparse_high_dimensional_input_is_never_densified():
    H = sp.random(50, 200_000, density=1e-3, random_state=0, format="csr")
    solver = linsolve.GramSolver(H, 1.0)
    assert solver.gram_shape == (50, 50) and sp.issparse(solver.H)
    r = np.random.default_rng(0).standard_normal(200_000)
    x = solver.solve(r)
    residual = H.T @ (H @ x) + x - r
    assert np.abs(residual).max() < 1e-8


def test_warm_start_and_shared_factorisation():
    problem = make_sparse_problem(n=200, d=80, k=5, seed=1)
    X, y = problem.X, problem.y
    settings = SVMSettings(lam=0.05)
    first = admm.solve(X, y, settings)
    gram = linsolve.GramSolver(admm.signed_rows(X, y), 0.5 * X.shape[0])  # ρ1/ρ2 = 0.5/(1/n)
    again = admm.solve(X, y, settings, gram=gram)
    np.testing.assert_array_equal(first.coef, again.coef)
    # Restarting from the final state carries on from there, where a cold start begins near 1.
    with pytest.warns(ConvergenceWarning):
        warm = admm.solve(X, y, replace(settings, max_iter=5, tol=0.0), state=first.state)
    assert warm.objective_history[0] == pytest.approx(first.objective_history[-1], rel=1e-3)
    assert first.objective_history[0] > 2 * first.objective_history[-1]
    with pytest.raises(ValueError, match="gram was factorised"):
        admm.solve(X, y, replace(settings, rho1=1.0), gram=gram)


ADMM_MCP = SVMSettings(penalty="mcp", solver="admm")


def test_regularization_path_shapes_sparsity_and_first_point():
    problem = make_sparse_problem(n=200, d=100, k=5, seed=2)
    labels = np.where(problem.y > 0, "yes", "no")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        path = regularization_path(problem.X, labels, n_lams=8, settings=ADMM_MCP)
    assert path.coefs.shape == (8, 100) and np.all(np.diff(path.lams) < 0)
    nnz = path.n_nonzero()
    assert nnz[0] <= 2 and nnz[-1] >= 5
    assert list(path.classes) == ["no", "yes"]
    assert path.predict(problem.X[:3]).shape == (3, 8)
    # The first point is a cold start: identical to a plain fit at that λ.
    y_pm = np.where(labels == "yes", 1.0, -1.0)
    cold = admm.solve(problem.X, y_pm, replace(ADMM_MCP, lam=path.lams[0]))
    np.testing.assert_array_equal(path.coefs[0], cold.coef)


def test_regularization_path_warns_once_with_a_count():
    problem = make_sparse_problem(n=100, d=30, k=3, seed=4)
    with pytest.warns(ConvergenceWarning, match=r"of 3 path points stopped at max_iter=2") as seen:
        regularization_path(
            problem.X,
            problem.y,
            lams=[0.1, 0.01, 0.05],
            settings=SVMSettings(max_iter=2, solver="admm"),
        )
    assert len(seen) == 1


def test_regularization_path_rejects_negative_lams():
    problem = make_sparse_problem(n=50, d=10, k=2, seed=5)
    with pytest.raises(ValueError, match="must be a non-empty list of finite numbers >= 0"):
        regularization_path(problem.X, problem.y, lams=[0.1, -1.0])
