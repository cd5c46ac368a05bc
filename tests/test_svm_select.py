"""Choosing λ: the one-standard-error rule, the cross-validated path, and `interlace svm --path`."""

import argparse
import re

import numpy as np
import pytest
from sklearn.model_selection import StratifiedKFold

from helpers import SVM_DATA
from interlace.errors import ConfigError, DataError
from interlace.svm import NonconvexSVC, SVMSettings
from interlace.svm.cli import add_svm_args, run_svm
from interlace.svm.io import load_libsvm
from interlace.svm.select import LAM_GRID, cross_validate_path, one_standard_error

TRAIN, TEST = SVM_DATA / "heart_scale.tr", SVM_DATA / "heart_scale.t"


def test_one_standard_error_on_a_hand_made_table():
    #             λ:  1.0   0.3    0.1   0.03  0.01
    mean = np.array([0.70, 0.845, 0.86, 0.85, 0.86])
    stderr = np.array([0.50, 0.01, 0.02, 0.01, 0.01])
    nonzeros = np.array([1, 5, 9, 12, 13])
    assert int(np.argmax(mean)) == 2  # the best; a tie with the last goes to the larger λ
    # Within 0.86 − 0.02 (the best's error): 0.3, 0.1, 0.03, 0.01. Index 0 is not, however
    # large its own error. The sparsest of those is λ = 0.3.
    assert one_standard_error(mean, stderr, nonzeros) == 1
    # Equal non-zeros: the first (larger λ) wins.
    assert one_standard_error(mean, stderr, np.array([1, 9, 9, 9, 9])) == 1
    # A tighter best error leaves only the best and its tie.
    assert one_standard_error(mean, np.array([0.5, 0.01, 0.001, 0.01, 0.01]), nonzeros) == 2


def test_cross_validated_path_on_heart_scale():
    ((X, y),) = load_libsvm(TRAIN)
    cv = cross_validate_path(X, y, settings=SVMSettings(penalty="mcp"), folds=3)
    assert np.array_equal(cv.lams, LAM_GRID)
    assert cv.mean.shape == cv.stderr.shape == (5,) and np.all(cv.stderr > 0)
    assert cv.best == int(np.argmax(cv.mean)) and 0.8 < cv.mean[cv.best] < 0.9
    assert cv.mean[cv.one_se] >= cv.mean[cv.best] - cv.stderr[cv.best]
    nonzeros = cv.path.n_nonzero()
    assert nonzeros[cv.one_se] <= nonzeros[cv.best] and nonzeros[0] < nonzeros[-1]
    # Each path point is the estimator's fit at that λ.
    model = NonconvexSVC(penalty="mcp", lam=LAM_GRID[1]).fit(X, y)
    np.testing.assert_array_equal(cv.path.coefs[1], model.coef_[0])
    # Mean and standard error (sample std / √folds) of the estimator's fold accuracies.
    folds = StratifiedKFold(3, shuffle=True, random_state=0).split(X, y)
    scores = np.array(
        [
            [
                NonconvexSVC(penalty="mcp", lam=lam).fit(X[a], y[a]).score(X[b], y[b])
                for lam in LAM_GRID
            ]
            for a, b in folds
        ]
    )
    np.testing.assert_allclose(cv.mean, scores.mean(axis=0))
    np.testing.assert_allclose(cv.stderr, scores.std(axis=0, ddof=1) / np.sqrt(3))


def _args(*argv):
    parser = argparse.ArgumentParser(prog="interlace svm")
    add_svm_args(parser)
    return parser.parse_args([str(a) for a in argv])


def test_path_command_prints_the_table_and_the_one_se_model(capsys):
    assert run_svm(_args(TRAIN, "--test", TEST, "--path", "--penalty", "mcp")) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"^ +\d", line)]
    assert len(rows) == len(LAM_GRID)
    assert sum("best" in row for row in rows) == 1 and sum("1se" in row for row in rows) == 1
    ((X, y),) = load_libsvm(TRAIN)
    cv = cross_validate_path(X, y, settings=SVMSettings(penalty="mcp"))
    assert cv.one_se != cv.best  # on heart_scale.tr the rule picks a sparser λ than the best
    chosen = cv.lams[cv.one_se]
    assert f"chosen (1se)    lam={chosen:g}" in out
    assert "1se" in rows[cv.one_se] and "best" in rows[cv.best]
    assert re.search(rf"{100 * cv.mean[0]:6.2f} ± +{100 * cv.stderr[0]:.2f} %", rows[0])
    model = NonconvexSVC(penalty="mcp", lam=chosen).fit(X, y)
    assert f"non-zeros       {np.count_nonzero(model.coef_)} / 13" in out
    assert f"train accuracy  {100 * model.score(X, y):6.2f} %" in out
    assert "test accuracy" in out and "iterations" not in out


def test_path_command_best_rule_and_own_grid(capsys):
    assert (
        run_svm(_args(TRAIN, "--path", "--rule", "best", "--lams", "0.2,0.02", "--folds", "4")) == 0
    )
    out = capsys.readouterr().out
    assert "4-fold CV over 2 lam values" in out and "chosen (best)" in out


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        (["--folds", "1"], ConfigError, "--folds 1 must be an integer >= 2"),
        (["--lams", "0.1,-1"], ConfigError, "--lams (0.1, -1.0) must be finite numbers >= 0"),
        (["--folds", "200"], DataError, "--folds 200 is more than the 108 rows of its smaller"),
        (["--solver", "admm", "--lam", "-1"], ConfigError, "lam=-1.0 must be a finite number"),
    ],
)
def test_path_command_bad_input_is_one_line_before_any_output(capsys, extra, error, message):
    with pytest.raises(error, match=re.escape(message)) as caught:
        run_svm(_args(TRAIN, "--path", *extra))
    assert "\n" not in str(caught.value)
    assert capsys.readouterr().out == ""


def test_unparsable_lams_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as caught:
        _args(TRAIN, "--path", "--lams", "0.1,abc")
    assert caught.value.code == 2
    assert "is not a comma-separated list of numbers" in capsys.readouterr().err
