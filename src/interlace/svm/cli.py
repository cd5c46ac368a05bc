"""`interlace svm TRAIN [--test TEST] --penalty scad --lam 0.015 ...`: fit and report.

`add_svm_args` declares the options on a parser; `run_svm` runs them and prints train/test
accuracy, non-zero weights, iterations and fit time. Bad settings raise ConfigError and bad data
DataError, each one line and before any fitting.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings

import numpy as np
from sklearn.exceptions import ConvergenceWarning

from interlace.config_args import add_dataclass_args, dataclass_from_args
from interlace.errors import DataError
from interlace.svm.estimator import NonconvexSVC, binary_labels
from interlace.svm.io import load_libsvm
from interlace.svm.settings import SVMSettings


def add_svm_args(parser: argparse.ArgumentParser) -> None:
    """Declare the `svm` command's arguments on `parser`: the files, then every SVMSettings
    field."""
    parser.add_argument("train", metavar="TRAIN", help="training data, LIBSVM format")
    parser.add_argument("--test", metavar="TEST", help="held-out data, LIBSVM format")
    add_dataclass_args(parser, SVMSettings)


def run_svm(args: argparse.Namespace) -> int:
    """Fit `NonconvexSVC` on `args.train`, evaluate on it and on `args.test`; print a report.

    Returns 0. Raises ConfigError for bad settings and DataError for bad files or labels.
    """
    settings = dataclass_from_args(SVMSettings, args)
    paths = [args.train] + ([args.test] if args.test else [])
    data = load_libsvm(*paths)
    X, y = data[0]
    try:
        classes, _ = binary_labels(y)
    except ValueError as error:
        raise DataError(f"{args.train}: {error}") from error
    if args.test:
        unknown = np.setdiff1d(np.unique(data[1][1]), classes)
        if unknown.size:
            raise DataError(
                f"{args.test}: labels {unknown.tolist()} do not occur in {args.train} "
                f"(its classes are {classes.tolist()}); use the same label encoding in both"
            )
    model = NonconvexSVC(**dataclasses.asdict(settings))
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        model.fit(X, y)
    hit_limit = any(issubclass(w.category, ConvergenceWarning) for w in caught)
    seconds = time.perf_counter() - start
    n, d = X.shape
    rho2 = "1/n" if settings.rho2 is None else f"{settings.rho2:g}"
    print(
        f"{args.train}: {n} rows x {d} features; penalty={settings.penalty} "
        f"lam={settings.lam:g} theta={settings.shape:g} rho1={settings.rho1:g} rho2={rho2}"
    )
    print(f"train accuracy  {100 * model.score(X, y):6.2f} %  ({n} rows)")
    if args.test:
        X_test, y_test = data[1]
        print(f"test accuracy   {100 * model.score(X_test, y_test):6.2f} %  ({len(y_test)} rows)")
    print(f"non-zeros       {np.count_nonzero(model.coef_)} / {d}")
    stopped = "hit --max-iter before --tol" if hit_limit else "converged"
    print(f"iterations      {model.n_iter_} ({stopped})")
    print(f"time            {seconds:.3f} s")
    return 0
