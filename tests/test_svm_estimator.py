"""NonconvexSVC as a scikit-learn estimator: API contract, labels, errors, sparse input, CV."""

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.base import clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import GridSearchCV
from sklearn.utils.estimator_checks import check_estimator

from interlace.errors import ConfigError
from interlace.svm import NonconvexSVC
from interlace.svm.synthetic import make_sparse_problem


def _data(seed=0, n=200, d=6):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    y = np.where(X[:, 0] - 0.7 * X[:, 1] + 0.3 + 0.8 * rng.standard_normal(n) > 0, 1, -1)
    return X, y


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.SkipTestWarning")  # pandas, array API
def test_passes_sklearn_check_estimator():
    check_estimator(NonconvexSVC())


@pytest.mark.parametrize(
    "labels", [("no", "yes"), (0, 1), (2, 4), (-1.0, 1.0), (True, False)], ids=str
)
def test_any_two_labels_give_the_same_model(labels):
    X, y = _data()
    reference = NonconvexSVC().fit(X, y)
    low, high = sorted(labels)
    mapped = np.where(y > 0, high, low)
    model = NonconvexSVC().fit(X, mapped)
    assert list(model.classes_) == [low, high]
    np.testing.assert_array_equal(model.coef_, reference.coef_)
    predicted = model.predict(X)
    assert set(np.unique(predicted)) <= {low, high}
    np.testing.assert_array_equal(predicted == high, model.decision_function(X) > 0)


def test_fitted_attributes_and_shapes():
    X, y = _data()
    model = NonconvexSVC(penalty="mcp", lam=0.05).fit(X, y)
    assert model.coef_.shape == (1, 6) and model.intercept_.shape == (1,)
    assert model.n_features_in_ == 6
    assert model.objective_history_.shape == (model.n_iter_,)
    assert model.score(X, y) > 0.75
    # The noise features (2..5) are dropped by the sparse penalty; the two real ones are kept.
    assert model.coef_[0, 0] > 0 > model.coef_[0, 1]
    assert np.count_nonzero(model.coef_) < 6


def test_one_class_is_a_clear_error():
    X, _ = _data()
    with pytest.raises(ValueError, match=r"only one class \('spam'\)"):
        NonconvexSVC().fit(X, np.full(len(X), "spam"))


def test_more_than_two_classes_is_a_clear_error():
    X, _ = _data()
    y = np.arange(len(X)) % 3
    with pytest.raises(ValueError, match=r"Only binary classification.*3 classes \(0, 1, 2\)"):
        NonconvexSVC().fit(X, y)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"penalty": "l1"}, "penalty='l1' is unknown"),
        ({"lam": -1.0}, "lam=-1.0 must be a finite number >= 0"),
        ({"rho1": 0.0}, "rho1=0.0 must be a finite number > 0"),
        ({"rho2": -2.0}, "rho2=-2.0 must be a finite number > 0"),
        ({"max_iter": 0}, "max_iter=0 must be an integer >= 1"),
        ({"penalty": "scad", "theta": 1.5}, "SCAD's a and must be > 2"),
    ],
)
def test_bad_settings_fail_before_fitting(params, message):
    X, y = _data()
    with pytest.raises(ConfigError, match=message):
        NonconvexSVC(**params).fit(X, y)


def test_sparse_input_gives_the_dense_result():
    problem = make_sparse_problem(n=150, d=400, k=5, seed=7)
    for penalty in ("scad", "lsp"):
        sparse = NonconvexSVC(penalty=penalty, lam=0.05).fit(problem.X, problem.y)
        dense = NonconvexSVC(penalty=penalty, lam=0.05).fit(problem.X.toarray(), problem.y)
        assert sparse.n_iter_ == dense.n_iter_
        np.testing.assert_allclose(sparse.coef_, dense.coef_, atol=1e-8)
        np.testing.assert_allclose(
            sparse.decision_function(sp.csc_matrix(problem.X)),
            dense.decision_function(problem.X.toarray()),
            atol=1e-8,
        )


def test_warns_when_max_iter_is_reached():
    X, y = _data()
    with pytest.warns(ConvergenceWarning, match="max_iter=3"):
        model = NonconvexSVC(solver="admm", max_iter=3, tol=0.0).fit(X, y)
    assert model.n_iter_ == 3


def test_no_intercept_and_params_round_trip():
    X, y = _data()
    model = NonconvexSVC(fit_intercept=False, penalty="capped_l1", theta=0.5).fit(X, y)
    assert model.intercept_[0] == 0.0
    copy = clone(model).set_params(lam=0.1)
    assert copy.get_params()["lam"] == 0.1 and copy.get_params()["theta"] == 0.5
    assert not hasattr(copy, "coef_")


def test_works_inside_grid_search():
    X, y = _data(seed=1, n=240, d=8)
    grid = {"lam": [0.4, 0.05, 0.01], "penalty": ["scad", "lsp"]}
    search = GridSearchCV(NonconvexSVC(), grid, cv=3).fit(X, y)
    assert search.cv_results_["mean_test_score"].shape == (6,)
    # λ = 0.4 zeroes every weight, which can do no better than the majority class.
    results = search.cv_results_
    scores = dict(zip(map(str, results["params"]), results["mean_test_score"], strict=True))
    assert scores[str({"lam": 0.4, "penalty": "scad"})] < search.best_score_
    assert search.best_params_["lam"] != 0.4
    assert search.best_estimator_.score(X, y) > 0.75
