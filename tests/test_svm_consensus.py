"""Consensus ADMM on 2 and 4 gloo ranks solves the same problem as the single-process solver."""

import warnings
from dataclasses import replace

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.exceptions import ConvergenceWarning

from interlace import comm
from interlace.svm import SVMSettings, admm
from interlace.svm.consensus import fit_consensus, world_group
from interlace.svm.penalties import DEFAULT_THETA
from interlace.testing import RankFailed, run_ranks


def _noisy_data(n=402, d=8, seed=0):
    """Overlapping classes (label noise), so the hinge-loss minimiser is finite and unique."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    w = np.zeros(d)
    w[:3] = [2.0, -1.5, 1.0]
    y = np.where(X @ w + 0.5 + 2.0 * rng.standard_normal(n) > 0, 1.0, -1.0)
    return X, y


def _rank_fit(X, y, settings, sparse=False):
    group = world_group()
    rows = np.array_split(np.arange(len(y)), group.size)[group.rank]  # uneven for n=402, K=4
    X_local = sp.csr_matrix(X[rows]) if sparse else X[rows]
    meter = comm.CommMeter()
    comm.meter, saved = meter, comm.meter
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            result = fit_consensus(X_local, y[rows], group, settings)
    finally:
        comm.meter = saved
    return result, meter.snapshot()


SETTINGS = SVMSettings(lam=0.05, tol=0.0, max_iter=600)


@pytest.mark.parametrize(("world_size", "penalty"), [(2, "scad"), (2, "lsp"), (4, "mcp")])
def test_consensus_matches_single_process(world_size, penalty):
    X, y = _noisy_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        reference = admm.solve(X, y, replace(SETTINGS, penalty=penalty, max_iter=3000))
    results = run_ranks(world_size, _rank_fit, X, y, replace(SETTINGS, penalty=penalty))
    (coef, intercept, n_iter), snapshot = results[0]
    for other, _ in results[1:]:  # every rank holds the same model
        np.testing.assert_array_equal(other.coef, coef)
    assert n_iter == 600
    np.testing.assert_array_equal(np.flatnonzero(coef), np.flatnonzero(reference.coef))
    np.testing.assert_allclose(coef, reference.coef, atol=1e-2 * np.abs(reference.coef).max())
    assert intercept == pytest.approx(reference.intercept, abs=1e-2)
    H = admm.signed_rows(X, y)
    ours = admm.objective(H, y, coef, intercept, penalty, 0.05, DEFAULT_THETA[penalty])
    assert ours == pytest.approx(reference.objective_history[-1], rel=1e-4)
    # One all-reduce of d + 2 float64 per iteration, plus one for the input check.
    calls = snapshot["world"]["all_reduce"]["calls"]
    assert calls == 1 + n_iter + 1


def test_sparse_local_rows_give_the_dense_result():
    X, y = _noisy_data(n=200)
    settings = SVMSettings(penalty="mcp", lam=0.05, max_iter=200)
    dense = run_ranks(2, _rank_fit, X, y, settings)[0][0]
    sparse = run_ranks(2, _rank_fit, X, y, settings, sparse=True)[0][0]
    np.testing.assert_allclose(sparse.coef, dense.coef, atol=1e-10)
    assert sparse.n_iter == dense.n_iter < 200  # the default tol stops it


def _mismatched_features():
    group = world_group()
    d = 5 if group.rank == 0 else 6
    X = np.ones((4, d))
    return fit_consensus(X, np.array([1.0, -1.0, 1.0, -1.0]), group)


def _bad_labels():
    group = world_group()
    y = np.array([0.0, 1.0, 0.0, 1.0]) if group.rank == 1 else np.array([1.0, -1.0, 1.0, -1.0])
    return fit_consensus(np.eye(4), y, group)


def test_bad_input_fails_on_every_rank_with_a_clear_message():
    with pytest.raises(RankFailed, match=r"same feature count.*rank 0: 4x5, rank 1: 4x6"):
        run_ranks(2, _mismatched_features, timeout=30)
    with pytest.raises(RankFailed, match=r"rank 1: labels not all in \{-1, \+1\}"):
        run_ranks(2, _bad_labels, timeout=30)
