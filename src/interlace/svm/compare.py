"""`NonconvexSVC` against LinearSVC-ℓ1, each tuned by a plain `GridSearchCV`: the table and the
accuracy-against-non-zeros plot of docs/svm.md.

    python -m interlace.svm.compare [--train TRAIN --test TEST] [--plot PNG] [--solver admm]

always runs the generated one-hot problem (`make_categorical_problem`, 70/30 stratified split)
and, given LIBSVM files, that train/test pair too. Each model is tuned over its grid with k-fold
CV (λ over `LAM_GRID` for SCAD and MCP, C over `C_GRID` for `LinearSVC(penalty="l1",
dual=False)`); the search time is the fastest of `repeats` searches (the machine may be shared).
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from sklearn.base import clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import GridSearchCV, train_test_split
from sklearn.svm import LinearSVC

from interlace.svm.estimator import NonconvexSVC
from interlace.svm.io import load_libsvm
from interlace.svm.select import LAM_GRID
from interlace.svm.synthetic import CategoricalProblem, make_categorical_problem

C_GRID = (0.01, 0.1, 1.0, 10.0)
"""LinearSVC-ℓ1's grid of C."""

BASELINE = "linearsvc_l1"
"""The baseline's name in the results."""


@dataclass(frozen=True)
class Tuned:
    """One model after `GridSearchCV`: the chosen `param` value, its CV and test accuracy, its
    non-zero weights, the search's seconds, and per grid value [k] a refit's (value, test
    accuracy, non-zeros) for the plot; `kept` [g] lists the groups with a non-zero weight."""

    param: float
    cv_accuracy: float
    test_accuracy: float
    nonzeros: int
    seconds: float
    grid: tuple[tuple[float, float, int], ...]
    kept: tuple[int, ...] = ()


def candidates(penalties=("scad", "mcp"), solver: str = "lla") -> dict:
    """{name: (estimator, {param: grid})} for each penalty and for the LinearSVC-ℓ1 baseline."""
    models = {
        p: (NonconvexSVC(penalty=p, solver=solver), {"lam": list(LAM_GRID)}) for p in penalties
    }
    baseline = LinearSVC(penalty="l1", dual=False, max_iter=5000, random_state=0)
    models[BASELINE] = (baseline, {"C": list(C_GRID)})
    return models


def compare(
    X_train, y_train, X_test, y_test, *, groups=None, folds=3, repeats=1, **choice
) -> dict[str, Tuned]:
    """Tune every model of `candidates(**choice)` on the train part and score it on the test part.

    `groups` [d] (the column → variable map of a one-hot problem) fills `Tuned.kept`.
    """
    X_train, X_test = _int32(X_train), _int32(X_test)
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for name, (model, grid) in candidates(**choice).items():
            ((key, values),) = grid.items()
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                search = GridSearchCV(model, grid, cv=folds).fit(X_train, y_train)
                seconds.append(time.perf_counter() - start)
            points = []
            for value in values:
                fitted = clone(model).set_params(**{key: value}).fit(X_train, y_train)
                points.append((value, fitted.score(X_test, y_test), _nonzeros(fitted)))
            best = search.best_estimator_
            kept = () if groups is None else tuple(np.unique(groups[np.flatnonzero(best.coef_)]))
            results[name] = Tuned(
                param=float(search.best_params_[key]),
                cv_accuracy=float(search.best_score_),
                test_accuracy=float(best.score(X_test, y_test)),
                nonzeros=_nonzeros(best),
                seconds=min(seconds),
                grid=tuple(points),
                kept=tuple(int(g) for g in kept),
            )
    return results


def categorical_split(n_samples: int = 600, seed: int = 0):
    """(X_train, y_train, X_test, y_test, problem): a 70/30 stratified split of
    `make_categorical_problem(n_samples, seed=seed)` with its defaults (22 variables, rule on 3)."""
    problem = make_categorical_problem(n_samples, seed=seed)
    parts = train_test_split(
        problem.X, problem.y, test_size=0.3, stratify=problem.y, random_state=0
    )
    X_train, X_test, y_train, y_test = parts
    return X_train, y_train, X_test, y_test, problem


def table(name: str, results: dict[str, Tuned], d: int, problem: CategoricalProblem | None) -> str:
    """Plain-text rows: per model the chosen value, CV and test accuracy, non-zeros, seconds
    and the ratio to the baseline's seconds; with `problem`, the kept groups against the rule."""
    base = results[BASELINE].seconds
    lines = [f"{name}: d={d}"]
    for method, r in results.items():
        key = "C" if method == BASELINE else "lam"
        row = (
            f"  {method:<13} {f'{key}={r.param:g}':<9} cv {100 * r.cv_accuracy:6.2f} %  "
            f"test {100 * r.test_accuracy:6.2f} %  non-zeros {r.nonzeros:>3}  "
            f"CV {r.seconds:6.3f} s ({r.seconds / base:.1f}x)"
        )
        if problem is not None:
            rule = set(problem.rule_variables.tolist())
            row += f"  groups {len(r.kept)} ({len(set(r.kept) - rule)} outside the rule)"
        lines.append(row)
    return "\n".join(lines)


def plot(results: dict[str, Tuned], path, title: str, admm: dict[str, Tuned] | None = None) -> None:
    """Save a PNG at `path`: test accuracy against non-zeros along each model's grid, the
    cross-validated choice circled; `admm` adds the penalties fitted by ADMM, dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    curves = [(name, r, "-") for name, r in results.items()]
    curves += [(f"{name}, solver=admm", r, "--") for name, r in (admm or {}).items()]
    for (label, r, style), marker in zip(curves, "o^sDv", strict=False):
        _, accuracy, nonzeros = zip(*r.grid, strict=True)
        line = ax.plot(nonzeros, accuracy, style, marker=marker, label=label, alpha=0.8)[0]
        ax.scatter(
            r.nonzeros, r.test_accuracy, s=180, facecolors="none", edgecolors=line.get_color()
        )
    ax.set_xscale("symlog", linthresh=1)  # 0 stays on the axis
    ax.set_xticks([0, 1, 2, 5, 10, 20, 50, 100])
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("non-zero weights (each grid value, refit on the train part; log scale)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title + "; circled: chosen by 3-fold GridSearchCV", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Print the tables; with --plot, write the plot of the generated problem."""
    parser = argparse.ArgumentParser(prog="python -m interlace.svm.compare", description=__doc__)
    parser.add_argument("--train", help="LIBSVM training file (with --test)")
    parser.add_argument("--test", help="LIBSVM test file")
    parser.add_argument(
        "--plot", metavar="PNG", help="write the generated problem's plot here (with ADMM's too)"
    )
    parser.add_argument("--solver", default="lla", choices=("lla", "admm"))
    parser.add_argument("--seed", type=int, default=0, help="generated problem's seed")
    parser.add_argument("--repeats", type=int, default=3, help="searches timed per model")
    args = parser.parse_args(argv)
    X_train, y_train, X_test, y_test, problem = categorical_split(seed=args.seed)
    common = dict(folds=3, repeats=args.repeats, solver=args.solver)
    results = compare(X_train, y_train, X_test, y_test, groups=problem.groups, **common)
    name = f"one-hot, {len(problem.groups)} columns of 22 variables, rule on 3"
    print(table(name, results, X_train.shape[1], problem))
    if args.plot:
        admm = compare(X_train, y_train, X_test, y_test, solver="admm")
        del admm[BASELINE]
        plot(results, args.plot, f"generated one-hot problem (d={X_train.shape[1]})", admm)
    if args.train and args.test:
        (X_train, y_train), (X_test, y_test) = load_libsvm(args.train, args.test)
        results = compare(X_train, y_train, X_test, y_test, **common)
        print(table(args.train, results, X_train.shape[1], None))
    return 0


def _int32(X):
    """LinearSVC takes only 32-bit sparse indices; `load_libsvm` may give 64-bit ones."""
    if not sp.issparse(X):
        return X
    X = sp.csr_matrix(X)
    return sp.csr_matrix((X.data, X.indices.astype(np.int32), X.indptr.astype(np.int32)), X.shape)


def _nonzeros(model) -> int:
    return int(np.count_nonzero(model.coef_))


if __name__ == "__main__":
    raise SystemExit(main())
