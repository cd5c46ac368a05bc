"""`interlace svm TRAIN [--test TEST] --penalty scad --lam 0.015 ...`: fit and report.

`add_svm_args` declares the options on a parser; `run_svm` runs them and prints train/test
accuracy, non-zero weights, iterations and fit time. Bad settings raise ConfigError and bad data
DataError, each one line and before any fitting.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
from sklearn.exceptions import ConvergenceWarning

from interlace.errors import DataError
from interlace.svm import admm
from interlace.svm.estimator import NonconvexSVC, binary_labels
from interlace.svm.io import load_libsvm
from interlace.svm.penalties import DEFAULT_THETA, PENALTIES


def add_svm_args(parser: argparse.ArgumentParser) -> None:
    """Declare the `svm` command's arguments on `parser`."""
    parser.add_argument("train", metavar="TRAIN", help="training data, LIBSVM format")
    parser.add_argument("--test", metavar="TEST", help="held-out data, LIBSVM format")
    parser.add_argument(
        "--penalty",
        default="scad",
        help=f"nonconvex penalty: {', '.join(PENALTIES)} (default: scad)",
    )
    parser.add_argument(
        "--lam", type=float, default=2**-6, help="penalty strength λ >= 0 (default: 2^-6)"
    )
    defaults = ", ".join(f"{k} {v}" for k, v in DEFAULT_THETA.items())
    parser.add_argument(
        "--theta",
        type=float,
        default=None,
        help=f"penalty shape: SCAD a, MCP γ, LSP θ, capped-ℓ1 θ (default: {defaults})",
    )
    parser.add_argument(
        "--rho1", type=float, default=0.5, help="ADMM penalty of x = z (default: 0.5)"
    )
    parser.add_argument(
        "--rho2",
        type=float,
        default=None,
        help="ADMM penalty of the margin constraint (default: 1/n_samples)",
    )
    parser.add_argument(
        "--max-iter", type=int, default=1000, help="iteration limit (default: 1000)"
    )
    parser.add_argument(
        "--tol",
        type=float,
        default=1e-4,
        help="stop when the objective's relative change is below this (default: 1e-4)",
    )
    parser.add_argument("--no-intercept", action="store_true", help="fit no intercept (b = 0)")


def run_svm(args: argparse.Namespace) -> int:
    """Fit `NonconvexSVC` on `args.train`, evaluate on it and on `args.test`; print a report.

    Returns 0. Raises ConfigError for bad settings and DataError for bad files or labels.
    """
    theta = admm.check_params(
        args.penalty, args.lam, args.theta, args.rho1, args.rho2, args.max_iter, args.tol
    )
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
    model = NonconvexSVC(
        penalty=args.penalty,
        lam=args.lam,
        theta=args.theta,
        rho1=args.rho1,
        rho2=args.rho2,
        max_iter=args.max_iter,
        tol=args.tol,
        fit_intercept=not args.no_intercept,
    )
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        model.fit(X, y)
    hit_limit = any(issubclass(w.category, ConvergenceWarning) for w in caught)
    seconds = time.perf_counter() - start
    n, d = X.shape
    rho2 = "1/n" if args.rho2 is None else f"{args.rho2:g}"
    print(
        f"{args.train}: {n} rows x {d} features; penalty={args.penalty} lam={args.lam:g} "
        f"theta={theta:g} rho1={args.rho1:g} rho2={rho2}"
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
