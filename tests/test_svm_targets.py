"""GridSearchCV over the default λ grid against LinearSVC-ℓ1 over its C grid (3-fold CV): as
accurate (within 1 point), no more non-zeros, and on one-hot data exactly the rule's groups."""

import numpy as np
import pytest

from helpers import SVM_DATA
from interlace.svm.compare import BASELINE, Tuned, categorical_split, compare, plot
from interlace.svm.io import load_libsvm
from interlace.svm.select import LAM_GRID


def _check(results):
    base = results[BASELINE]
    for penalty in ("scad", "mcp"):
        ours = results[penalty]
        assert ours.test_accuracy >= base.test_accuracy - 0.01, penalty
        assert ours.nonzeros <= base.nonzeros, penalty


@pytest.mark.parametrize("seed", [0, 1])
def test_one_hot_problem_keeps_only_the_rule(seed):
    X_train, y_train, X_test, y_test, problem = categorical_split(300, seed=seed)
    results = compare(X_train, y_train, X_test, y_test, groups=problem.groups)
    _check(results)
    for penalty in ("scad", "mcp"):
        assert results[penalty].kept == tuple(problem.rule_variables), penalty


def test_heart_scale_authors_split():
    (X_train, y_train), (X_test, y_test) = load_libsvm(
        SVM_DATA / "heart_scale.tr", SVM_DATA / "heart_scale.t"
    )
    _check(compare(X_train, y_train, X_test, y_test))


def test_default_grid_starts_at_the_sparse_end():
    # GridSearchCV keeps the first of tied candidates, which must then be the larger λ.
    assert list(LAM_GRID) == sorted(LAM_GRID, reverse=True) and LAM_GRID[0] >= 0.1
    assert np.isclose(LAM_GRID[-1], 1e-3)


def test_plot_writes_a_png(tmp_path):
    def tuned(points):
        _, accuracy, nonzeros = points[-1]
        return Tuned(points[-1][0], accuracy, accuracy, nonzeros, 0.1, tuple(points))

    results = {"scad": tuned([(0.1, 0.8, 0), (0.01, 1.0, 4)]), BASELINE: tuned([(1.0, 1.0, 9)])}
    plot(results, tmp_path / "sparsity.png", "hand-made", admm={"scad": tuned([(0.01, 1.0, 40)])})
    assert (tmp_path / "sparsity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
