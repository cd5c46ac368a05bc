"""`interlace svm TRAIN [--test TEST] --penalty scad --lam 0.015 ...`: fit and report.

`add_svm_args` declares the options on a parser; `run_svm` runs them and prints train/test
accuracy, non-zero weights, iterations and fit time. With `--path` it instead cross-validates
every λ of the grid (`interlace.svm.select`), prints one row per λ, and reports the model the
one-standard-error rule (or `--rule best`) picks. Bad settings raise ConfigError and bad data
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
from interlace.errors import ConfigError, DataError
from interlace.svm.estimator import NonconvexSVC, binary_labels
from interlace.svm.io import load_libsvm
from interlace.svm.select import LAM_GRID, CVPath, cross_validate_path
from interlace.svm.settings import SVMSettings


def add_svm_args(parser: argparse.ArgumentParser) -> None:
    """Declare the `svm` command's arguments on `parser`: the files, the path options, then every
    SVMSettings field."""
    parser.add_argument("train", metavar="TRAIN", help="training data, LIBSVM format")
    parser.add_argument("--test", metavar="TEST", help="held-out data, LIBSVM format")
    parser.add_argument(
        "--path",
        action="store_true",
        help="cross-validate every λ of --lams instead of fitting --lam, and report the chosen one",
    )
    parser.add_argument(
        "--lams",
        type=_numbers,
        default=LAM_GRID,
        metavar="L1,L2,...",
        help=f"λ grid for --path (default {','.join(map(str, LAM_GRID))})",
    )
    parser.add_argument("--folds", type=int, default=3, help="folds for --path (default 3)")
    parser.add_argument(
        "--rule",
        choices=("1se", "best"),
        default="1se",
        help="--path's choice: the sparsest λ within one standard error of the best (1se), "
        "or the best mean accuracy (best)",
    )
    add_dataclass_args(parser, SVMSettings)


def run_svm(args: argparse.Namespace) -> int:
    """Fit `NonconvexSVC` on `args.train`, or cross-validate its path with `args.path`; evaluate
    on the train file and on `args.test`; print a report.

    Returns 0. Raises ConfigError for bad settings and DataError for bad files or labels.
    """
    settings = dataclass_from_args(SVMSettings, args)
    if args.path:
        _check_path_args(args)
    data = _load(args)
    if args.path:
        _run_path(args, settings, data)
    else:
        _run_fit(args, settings, data)
    return 0


def _load(args: argparse.Namespace) -> list:
    """[(X, y)] of TRAIN (and TEST), checked: two classes, test labels among them, and enough
    rows of each class for `--folds` with `--path`."""
    data = load_libsvm(*([args.train] + ([args.test] if args.test else [])))
    y = data[0][1]
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
    smallest = min(np.count_nonzero(y == c) for c in classes)
    if args.path and args.folds > smallest:
        raise DataError(
            f"{args.train}: --folds {args.folds} is more than the {smallest} rows of its "
            "smaller class; use fewer folds"
        )
    return data


def _run_fit(args: argparse.Namespace, settings: SVMSettings, data: list) -> None:
    X, y = data[0]
    model = NonconvexSVC(**dataclasses.asdict(settings))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        _, seconds = _timed(lambda: model.fit(X, y))
    hit_limit = any(issubclass(w.category, ConvergenceWarning) for w in caught)
    n, d = X.shape
    rho2 = "1/n" if settings.rho2 is None else f"{settings.rho2:g}"
    rhos = f" rho1={settings.rho1:g} rho2={rho2}" if settings.solver == "admm" else ""
    print(
        f"{args.train}: {n} rows x {d} features; penalty={settings.penalty} "
        f"lam={settings.lam:g} theta={settings.shape:g} solver={settings.solver}{rhos}"
    )
    stopped = "hit --max-iter before --tol" if hit_limit else "converged"
    _print_model(args, data, model, seconds, stopped)


def _run_path(args: argparse.Namespace, settings: SVMSettings, data: list) -> None:
    X, y = data[0]
    cv, seconds = _timed(
        lambda: cross_validate_path(X, y, args.lams, settings=settings, folds=args.folds)
    )
    chosen = cv.one_se if args.rule == "1se" else cv.best
    settings = dataclasses.replace(settings, lam=float(cv.lams[chosen]))
    _print_path(args, X, cv, chosen, settings)
    model = NonconvexSVC(**dataclasses.asdict(settings)).fit(X, y)
    _print_model(args, data, model, seconds, stopped=None)


def _check_path_args(args: argparse.Namespace) -> None:
    if args.folds < 2:
        raise ConfigError(f"--folds {args.folds} must be an integer >= 2")
    lams = np.asarray(args.lams, dtype=float)
    if lams.size == 0 or not np.all(np.isfinite(lams)) or np.any(lams < 0):
        raise ConfigError(f"--lams {args.lams} must be finite numbers >= 0")


def _numbers(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers"
        ) from None


def _timed(work):
    start = time.perf_counter()
    result = work()
    return result, time.perf_counter() - start


def _print_path(
    args: argparse.Namespace, X, cv: CVPath, chosen: int, settings: SVMSettings
) -> None:
    n, d = X.shape
    print(
        f"{args.train}: {n} rows x {d} features; penalty={settings.penalty} "
        f"theta={settings.shape:g} solver={settings.solver}; {args.folds}-fold CV over "
        f"{len(cv.lams)} lam values"
    )
    print(f"{'lam':>10}  {'cv accuracy':>17}  {'non-zeros':>9}")
    nonzeros = cv.path.n_nonzero()
    for k, lam in enumerate(cv.lams):
        marks = [name for name, index in (("best", cv.best), ("1se", cv.one_se)) if index == k]
        row = f"{lam:>10.4g}  {100 * cv.mean[k]:>6.2f} ± {100 * cv.stderr[k]:>5.2f} %  "
        print(row + f"{nonzeros[k]:>4} / {d}" + "".join(f"  {mark}" for mark in marks))
    print(f"chosen ({args.rule})    lam={cv.lams[chosen]:g}")


def _print_model(args, data, model: NonconvexSVC, seconds: float, stopped: str | None) -> None:
    X, y = data[0]
    n, d = X.shape
    print(f"train accuracy  {100 * model.score(X, y):6.2f} %  ({n} rows)")
    if args.test:
        X_test, y_test = data[1]
        print(f"test accuracy   {100 * model.score(X_test, y_test):6.2f} %  ({len(y_test)} rows)")
    print(f"non-zeros       {np.count_nonzero(model.coef_)} / {d}")
    if stopped is not None:
        print(f"iterations      {model.n_iter_} ({stopped})")
    print(f"time            {seconds:.3f} s")
