"""Benchmark: NonconvexSVC with each penalty against LIBLINEAR's ℓ1- and ℓ2-regularised SVMs.

For every dataset: a stratified 70/30 train/test split; λ (ours) or C (LIBLINEAR, via
scikit-learn's `LinearSVC`) chosen by stratified k-fold cross-validated accuracy on the train part
with `GridSearchCV`; then a refit on the whole train part, timed (median of a few refits), and the
test accuracy and the number of non-zero weights. The targets, per penalty, against
`LinearSVC(penalty="l1", loss="squared_hinge", dual=False)`: test accuracy at least as high, fewer
non-zero weights, fit time at most 3× — each reported as met or not, with the numbers.

Datasets: the LIBSVM files in the shared data folder (`INTERLACE_SVM_DATA`, else
`../shared/data/svm` beside the repository; a missing file is skipped with a note), scikit-learn's
bundled breast-cancer set (standardised on the train part), and a synthetic sparse problem with a
known support (`interlace.svm.synthetic`), where the recovered support is reported too.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn.base import clone
from sklearn.datasets import load_breast_cancer
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import GridSearchCV, StratifiedKFold, train_test_split
from sklearn.preprocessing import StandardScaler
from sklearn.svm import LinearSVC

from interlace.svm.estimator import NonconvexSVC, binary_labels
from interlace.svm.io import load_libsvm
from interlace.svm.path import lam_max
from interlace.svm.penalties import PENALTIES
from interlace.svm.synthetic import make_sparse_problem

BASELINES = ("liblinear_l1", "liblinear_l2")
"""Names of the LIBLINEAR methods in the results (ℓ1: squared hinge, primal; ℓ2: default)."""

TIME_TARGET = 3.0
"""The target: fit time at most this multiple of LIBLINEAR-ℓ1's."""


@dataclass(frozen=True)
class _Split:
    name: str
    source: str
    X_train: np.ndarray | sp.csr_matrix
    y_train: np.ndarray
    X_test: np.ndarray | sp.csr_matrix
    y_test: np.ndarray
    support: np.ndarray | None = None


@dataclass(frozen=True)
class _Settings:
    folds: int
    n_lams: int
    n_cs: int
    repeats: int
    libsvm_files: tuple[str, ...]
    synthetic: dict


_FULL = _Settings(
    folds=5,
    n_lams=10,
    n_cs=10,
    repeats=5,
    libsvm_files=("heart_scale", "australian_scale", "diabetes_scale"),
    synthetic=dict(n=500, d=5000, k=10),
)
_QUICK = _Settings(
    folds=3,
    n_lams=4,
    n_cs=4,
    repeats=1,
    libsvm_files=("heart_scale",),
    synthetic=dict(n=150, d=300, k=5),
)


def data_dir() -> Path:
    """The folder of LIBSVM files: $INTERLACE_SVM_DATA, else ../shared/data/svm beside the repo."""
    env = os.environ.get("INTERLACE_SVM_DATA")
    if env:
        return Path(env)
    repo_root = Path(__file__).resolve().parents[3]
    return (repo_root / ".." / "shared" / "data" / "svm").resolve()


def run_svm_benchmark(quick: bool = False) -> dict:
    """Run the comparison; return a JSON-able dict {"settings", "notes", "datasets": {name: ...}}.

    Each dataset entry holds its shape, source, and per method (four penalties and the two
    LIBLINEAR baselines) the chosen parameter, CV accuracy, test accuracy, non-zeros, median fit
    seconds; each penalty also holds `targets` against LIBLINEAR-ℓ1. `quick` shrinks grids, folds
    and data to a smoke test of a few seconds.
    """
    settings = _QUICK if quick else _FULL
    notes: list[str] = ["fit times are medians of refits on a shared machine: indicative only"]
    splits = _splits(settings, notes)
    datasets = {}
    for split in splits:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            datasets[split.name] = _run_dataset(split, settings)
    return {
        "quick": quick,
        "settings": {
            "cv_folds": settings.folds,
            "lam_grid": f"{settings.n_lams} values, geometric from lam_max to lam_max/100",
            "C_grid": f"{settings.n_cs} values, geometric from 1e-3 to 1e2",
            "timing_repeats": settings.repeats,
            "test_fraction": 0.3,
            "nonconvex_defaults": _public_params(NonconvexSVC()),
        },
        "notes": notes,
        "datasets": datasets,
    }


def _public_params(model: NonconvexSVC) -> dict:
    return {k: v for k, v in model.get_params().items() if k not in ("lam", "penalty")}


def _splits(settings: _Settings, notes: list[str]) -> list[_Split]:
    splits = []
    folder = data_dir()
    for name in settings.libsvm_files:
        path = folder / name
        if not path.is_file():
            notes.append(f"skipped {name}: {path} not found (set INTERLACE_SVM_DATA)")
            continue
        ((X, y),) = load_libsvm(path)
        splits.append(_split(name, f"LIBSVM file {path}", X.toarray(), y))
    cancer = load_breast_cancer()
    split = _split(
        "breast_cancer", "sklearn.datasets.load_breast_cancer", cancer.data, cancer.target
    )
    scaler = StandardScaler().fit(split.X_train)
    splits.append(
        _Split(
            split.name,
            split.source + ", standardised on the train part",
            scaler.transform(split.X_train),
            split.y_train,
            scaler.transform(split.X_test),
            split.y_test,
        )
    )
    problem = make_sparse_problem(**settings.synthetic, seed=0)
    shape = settings.synthetic
    synthetic = _split(
        f"synthetic_{shape['n']}x{shape['d']}",
        f"interlace.svm.synthetic, {shape['k']} informative features",
        problem.X,
        problem.y,
    )
    splits.append(_Split(**{**synthetic.__dict__, "support": problem.support}))
    return splits


def _split(name: str, source: str, X, y) -> _Split:
    X_train, X_test, y_train, y_test = train_test_split(
        X, y, test_size=0.3, stratify=y, random_state=0
    )
    return _Split(name, source, X_train, y_train, X_test, y_test)


def _run_dataset(split: _Split, settings: _Settings) -> dict:
    folds = StratifiedKFold(settings.folds, shuffle=True, random_state=0)
    _, y_pm = binary_labels(split.y_train)
    top = lam_max(split.X_train, y_pm)
    lams = np.geomspace(top, top / 100, settings.n_lams).tolist()
    cs = np.geomspace(1e-3, 1e2, settings.n_cs).tolist()
    candidates = {penalty: (NonconvexSVC(penalty=penalty), {"lam": lams}) for penalty in PENALTIES}
    candidates["liblinear_l1"] = (
        LinearSVC(penalty="l1", loss="squared_hinge", dual=False, max_iter=5000),
        {"C": cs},
    )
    candidates["liblinear_l2"] = (LinearSVC(penalty="l2", max_iter=5000), {"C": cs})
    n_train, d = split.X_train.shape
    entry: dict = {
        "source": split.source,
        "n_train": n_train,
        "n_test": split.X_test.shape[0],
        "n_features": d,
        "methods": {},
    }
    for method, (model, grid) in candidates.items():
        entry["methods"][method] = _run_method(model, grid, folds, split, settings.repeats)
    l1 = entry["methods"]["liblinear_l1"]
    for penalty in PENALTIES:
        ours = entry["methods"][penalty]
        ratio = ours["fit_seconds"] / max(l1["fit_seconds"], 1e-9)
        ours["targets"] = {
            "accuracy_ge_l1": ours["test_accuracy"] >= l1["test_accuracy"],
            "fewer_nonzeros_than_l1": ours["nonzeros"] < l1["nonzeros"],
            "time_ratio_to_l1": ratio,
            "time_within_3x_l1": ratio <= TIME_TARGET,
        }
    return entry


def _run_method(model, grid: dict, folds, split: _Split, repeats: int) -> dict:
    search = GridSearchCV(model, grid, cv=folds, scoring="accuracy", refit=False)
    search.fit(split.X_train, split.y_train)
    best = search.best_params_
    seconds = []
    for _ in range(repeats):
        fitted = clone(model).set_params(**best)
        start = time.perf_counter()
        fitted.fit(split.X_train, split.y_train)
        seconds.append(time.perf_counter() - start)
    coef = np.ravel(fitted.coef_)
    out = {
        "param": {k: float(v) for k, v in best.items()},
        "cv_accuracy": float(search.best_score_),
        "test_accuracy": float(fitted.score(split.X_test, split.y_test)),
        "nonzeros": int(np.count_nonzero(coef)),
        "fit_seconds": float(np.median(seconds)),
    }
    if hasattr(fitted, "n_iter_"):
        out["n_iter"] = int(np.max(fitted.n_iter_))
    if split.support is not None:
        found = set(np.flatnonzero(coef).tolist())
        true = set(split.support.tolist())
        out["support_found"] = len(found & true)
        out["support_size"] = len(true)
        out["false_features"] = len(found - true)
    return out


def svm_table(result: dict) -> str:
    """A plain-text table of `run_svm_benchmark`'s result, one row per dataset and method."""
    header = (
        f"{'dataset':<22} {'method':<13} {'param':<13} {'cv acc':>7} {'test acc':>8} "
        f"{'nonzeros':>10} {'fit s':>9}  vs LIBLINEAR-l1 (acc>=, fewer nnz, time<=3x)"
    )
    lines = [header, "-" * len(header)]
    for name, entry in result["datasets"].items():
        d = entry["n_features"]
        for method, m in entry["methods"].items():
            ((key, value),) = m["param"].items()
            nnz = f"{m['nonzeros']}/{d}"
            row = (
                f"{name:<22} {method:<13} {f'{key}={value:.3g}':<13} {m['cv_accuracy']:>7.3f} "
                f"{m['test_accuracy']:>8.3f} {nnz:>10} {m['fit_seconds']:>9.4f}"
            )
            if "targets" in m:
                t = m["targets"]
                marks = [_mark(t["accuracy_ge_l1"]), _mark(t["fewer_nonzeros_than_l1"])]
                marks.append(f"{_mark(t['time_within_3x_l1'])} ({t['time_ratio_to_l1']:.1f}x)")
                row += "  " + " ".join(marks)
            if "support_found" in m:
                row += (
                    f"  support {m['support_found']}/{m['support_size']}"
                    f" +{m['false_features']} false"
                )
            lines.append(row)
    lines.extend(f"note: {note}" for note in result.get("notes", []))
    return "\n".join(lines)


def _mark(ok: bool) -> str:
    return "yes" if ok else "NO"


def plot_svm(result: dict, path) -> None:
    """Save a PNG at `path`: test accuracy against non-zero weights, per method, per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = list(result["datasets"])
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.6 * rows), squeeze=False)
    markers = dict(zip([*PENALTIES, *BASELINES], "o^sDxP", strict=True))
    for ax, name in zip(axes.flat, names, strict=False):
        entry = result["datasets"][name]
        for method, m in entry["methods"].items():
            ax.scatter(
                m["nonzeros"],
                m["test_accuracy"],
                marker=markers.get(method, "."),
                label=method,
                alpha=0.8,
            )
        ax.set_title(f"{name} (d={entry['n_features']})", fontsize=9)
        ax.set_xlabel("non-zero weights")
        ax.set_ylabel("test accuracy")
        if entry["n_features"] > 100:
            ax.set_xscale("log")
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
