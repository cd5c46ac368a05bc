"""`svm`: the nonconvex ADMM SVM (each penalty) vs LIBLINEAR's ℓ1 and ℓ2 SVMs; single process.

The measurement itself lives in `svm_benchmark` (imported only when it runs: it needs the `svm`
extra); this module registers it with the bench runner so it gets the same JSON, PNG and
BENCHMARKS.md section as the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from interlace.bench.base import Benchmark


def _run(options: dict[str, Any]) -> dict[str, Any]:
    from interlace.bench.svm_benchmark import run_svm_benchmark

    return run_svm_benchmark(quick=options["quick"])


def _table(doc: dict[str, Any]) -> str:
    from interlace.bench.svm_benchmark import svm_table

    return svm_table(doc["result"])


def _plot(doc: dict[str, Any], path: Path) -> None:
    from interlace.bench.svm_benchmark import plot_svm

    plot_svm(doc["result"], path)


def headline(doc: dict[str, Any]) -> str:
    """How many (dataset, penalty) pairs meet each target against LIBLINEAR-ℓ1."""
    counts = {"accuracy_ge_l1": 0, "fewer_nonzeros_than_l1": 0, "time_within_3x_l1": 0}
    total = 0
    for entry in doc["result"]["datasets"].values():
        for method in entry["methods"].values():
            if "targets" in method:
                total += 1
                for key in counts:
                    counts[key] += bool(method["targets"][key])
    return (
        f"of {total} dataset x penalty fits: accuracy >= LIBLINEAR-l1 in "
        f"{counts['accuracy_ge_l1']}, fewer non-zero weights in "
        f"{counts['fewer_nonzeros_than_l1']}, fit time within 3x in "
        f"{counts['time_within_3x_l1']}"
    )


BENCHMARK = Benchmark(
    name="svm",
    summary="nonconvex sparse SVM (SCAD, MCP, LSP, capped-l1) vs LIBLINEAR l1/l2",
    describe=(
        "Each penalty of `interlace.svm.NonconvexSVC` against scikit-learn's `LinearSVC` "
        "(LIBLINEAR) with l1 (squared hinge, primal) and l2 penalties, on the LIBSVM files in "
        "shared/data/svm, scikit-learn's breast-cancer set and a synthetic sparse problem with "
        "a known support: lambda or C chosen by 5-fold cross-validation, then test accuracy, "
        "non-zero weights and the median fit time of a few refits. Targets: accuracy at least "
        "LIBLINEAR-l1's, fewer non-zero weights, fit time at most 3x. Single process."
    ),
    table=_table,
    plot=_plot,
    run_local=_run,
    headline=headline,
    options={"quick": False},
    option_help={"quick": "smaller grids, folds and data: a smoke run of a few seconds"},
)
