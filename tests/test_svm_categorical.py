"""`make_categorical_problem`: one-hot groups that sum to one, and labels set by a sparse rule."""

import numpy as np
import pytest

from interlace.svm import SVMSettings, lla
from interlace.svm.synthetic import make_categorical_problem


def test_every_group_is_one_hot_and_levels_are_in_range():
    problem = make_categorical_problem(200, n_variables=22, levels=(2, 8), seed=3)
    X, groups = problem.X, problem.groups
    assert X.shape == (200, len(groups)) and np.array_equal(np.unique(groups), np.arange(22))
    assert set(np.unique(X.data)) == {1.0}
    for g in range(22):
        columns = X[:, groups == g].toarray()
        assert np.all(columns.sum(axis=1) == 1)  # exactly collinear with the intercept
        assert 2 <= columns.shape[1] <= 8


def test_labels_depend_on_the_rule_variables_only():
    problem = make_categorical_problem(400, rule_variables=3, seed=1)
    assert len(problem.rule_variables) == 3
    assert np.array_equal(
        problem.support, np.flatnonzero(np.isin(problem.groups, problem.rule_variables))
    )
    assert 0.2 < np.mean(problem.y > 0) < 0.8
    rule_rows = problem.X[:, problem.support].toarray()
    _, pattern = np.unique(rule_rows, axis=0, return_inverse=True)
    for k in np.unique(pattern):
        assert len(np.unique(problem.y[pattern.ravel() == k])) == 1


def test_the_rule_columns_alone_separate_the_classes():
    problem = make_categorical_problem(300, seed=2)
    X = problem.X[:, problem.support]
    fit = lla.solve(X, problem.y, SVMSettings(penalty="mcp", lam=1e-3))
    margins = problem.y * (X @ fit.coef + fit.intercept)
    assert margins.min() >= 1 - 1e-9


def test_same_seed_same_problem_and_bad_arguments():
    a, b = make_categorical_problem(50, seed=7), make_categorical_problem(50, seed=7)
    assert (a.X != b.X).nnz == 0 and np.array_equal(a.y, b.y)
    with pytest.raises(ValueError, match=r"levels=\(1, 3\) must be"):
        make_categorical_problem(50, levels=(1, 3))
    with pytest.raises(ValueError, match="rule_variables=5 must be in"):
        make_categorical_problem(50, n_variables=4, rule_variables=5)
