"""LIBSVM reading and the `interlace svm` command pieces: output and one-line errors."""

import argparse
import re
import shutil

import numpy as np
import pytest

from helpers import SVM_DATA
from interlace.errors import ConfigError, DataError
from interlace.svm import NonconvexSVC
from interlace.svm.cli import add_svm_args, run_svm
from interlace.svm.io import load_libsvm


@pytest.fixture
def heart(tmp_path):
    """Copies of heart_scale.tr / .t (shipped with the tests) in a temporary folder."""
    for name in ("heart_scale.tr", "heart_scale.t"):
        shutil.copy(SVM_DATA / name, tmp_path / name)
    return tmp_path / "heart_scale.tr", tmp_path / "heart_scale.t"


def _args(*argv):
    parser = argparse.ArgumentParser(prog="interlace svm")
    add_svm_args(parser)
    return parser.parse_args([str(a) for a in argv])


def test_run_svm_reports_accuracy_sparsity_iterations_time(heart, capsys):
    train, test = heart
    assert run_svm(_args(train, "--test", test, "--penalty", "mcp", "--lam", "0.02")) == 0
    out = capsys.readouterr().out
    (X, y), (X_test, y_test) = load_libsvm(train, test)
    model = NonconvexSVC(penalty="mcp", lam=0.02).fit(X, y)
    assert f"train accuracy  {100 * model.score(X, y):6.2f} %  (243 rows)" in out
    assert f"test accuracy   {100 * model.score(X_test, y_test):6.2f} %  (27 rows)" in out
    assert f"non-zeros       {np.count_nonzero(model.coef_)} / 13" in out
    assert f"iterations      {model.n_iter_} (converged)" in out
    assert re.search(r"time +\d+\.\d{3} s", out)


def test_run_svm_without_test_file_and_at_max_iter(heart, capsys):
    train, _ = heart
    assert (
        run_svm(_args(train, "--solver", "admm", "--max-iter", "4", "--tol", "0", "--no-intercept"))
        == 0
    )
    out = capsys.readouterr().out
    assert "test accuracy" not in out
    assert "iterations      4 (hit --max-iter before --tol)" in out


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        (["--penalty", "lasso"], ConfigError, "penalty='lasso' is unknown; choose one of scad"),
        (["--lam", "-0.5"], ConfigError, "lam=-0.5 must be a finite number >= 0"),
        (["--rho1", "0"], ConfigError, "rho1=0.0 must be a finite number > 0"),
        (["--test", "missing.t"], DataError, "'missing.t' does not exist"),
    ],
)
def test_run_svm_bad_settings_are_one_line_errors_before_any_output(
    heart, capsys, extra, error, message
):
    train, _ = heart
    with pytest.raises(error, match=re.escape(message)) as caught:
        run_svm(_args(train, *extra))
    assert "\n" not in str(caught.value)
    assert capsys.readouterr().out == ""


def test_run_svm_bad_files(tmp_path, capsys):
    garbage = tmp_path / "garbage.libsvm"
    garbage.write_text("this is not libsvm\n")
    one_class = tmp_path / "one.libsvm"
    one_class.write_text("1 1:0.5\n1 2:0.25\n")
    with pytest.raises(DataError, match="does not exist"):
        run_svm(_args(tmp_path / "nope.libsvm"))
    with pytest.raises(DataError, match=r"cannot parse .*garbage.libsvm.* as LIBSVM"):
        run_svm(_args(garbage))
    with pytest.raises(DataError, match=r"one.libsvm: y has only one class \(1.0\)"):
        run_svm(_args(one_class))
    assert capsys.readouterr().out == ""


def test_run_svm_test_labels_must_match_train_encoding(tmp_path):
    train = tmp_path / "train.libsvm"
    train.write_text("1 1:1\n-1 1:-1\n1 1:0.5\n-1 1:-0.5\n")
    test = tmp_path / "test.libsvm"
    test.write_text("0 1:1\n1 1:-1\n")
    with pytest.raises(DataError, match=r"labels \[0.0\] do not occur in .*train.libsvm"):
        run_svm(_args(train, "--test", test))


def test_load_libsvm_shares_the_feature_count(tmp_path):
    a = tmp_path / "a"
    a.write_text("1 1:1 3:2\n-1 2:1\n")
    b = tmp_path / "b"
    b.write_text("1 5:1\n")
    (Xa, ya), (Xb, _) = load_libsvm(a, b)
    assert Xa.shape == (2, 5) and Xb.shape == (1, 5)
    assert list(ya) == [1.0, -1.0] and Xa[0, 2] == 2.0


@pytest.mark.parametrize(
    ("content", "message"),
    [("", "is empty"), ("# only a comment\n", "holds no data rows"), ("1 3:1 1:2\n", "sorted")],
)
def test_load_libsvm_errors(tmp_path, content, message):
    path = tmp_path / "data.libsvm"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        load_libsvm(path)
    with pytest.raises(DataError, match="is a directory"):
        load_libsvm(tmp_path)


def test_help_lists_every_option():
    parser = argparse.ArgumentParser(prog="interlace svm")
    add_svm_args(parser)
    text = parser.format_help()
    options = ("--test", "--path", "--lams", "--folds", "--rule", "--penalty", "--lam", "--theta")
    for option in (*options, "--solver", "--rho1", "--rho2", "--max-iter"):
        assert option in text
