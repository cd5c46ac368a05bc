"""`overlap`: how much of a collective hides under a compute kernel running at the same time.

For a compute kernel of length C and an all-reduce of length M (each measured alone), running
both together takes B. The hidden fraction is (C + M − B) / min(C, M): 0 when they serialise
(B = C + M), 1 when the shorter one disappears entirely (B = max(C, M)). It is measured for an
all-reduce of about 0.5×, 1× and 2× the compute time, with both ways torch offers to overlap:
an async c10d call (`async_op=True`, wait after the compute) and a functional collective (lazy
tensor, waited on first use).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from interlace import comm
from interlace.bench.base import Benchmark, RankContext
from interlace.bench.timing import median, sample
from interlace.errors import ConfigError
from interlace.planner.calibrate import hidden_fraction
from interlace.plotting import new_figure, save_figure

_METER = comm.CommMeter()
_MECHANISMS = ("async_c10d", "functional")


def _matmuls(a: torch.Tensor, b: torch.Tensor, count: int) -> None:
    for _ in range(count):
        torch.mm(a, b)


def _calibrate_compute(target_s: float, group: comm.Group) -> tuple[int, torch.Tensor]:
    a = torch.randn(512, 512)
    _matmuls(a, a, 3)
    start = time.perf_counter()
    _matmuls(a, a, 10)
    per_call = (time.perf_counter() - start) / 10
    count = torch.tensor([max(1, round(target_s / per_call))])
    comm.all_reduce(count, group, op=torch.distributed.ReduceOp.MIN, meter=_METER)
    return int(count), a


def _calibrate_comm_rate(group: comm.Group) -> float:
    probe = torch.ones(2 * 2**20)  # 8 MB
    seconds = median(
        sample(lambda: comm.all_reduce(probe, group, meter=_METER), group, min_seconds=0.2)
    )
    return probe.nbytes / seconds


def run_rank(ctx: RankContext) -> dict[str, Any]:
    """Measure compute alone, all-reduce alone and both together for each size ratio."""
    group = ctx.group
    count, a = _calibrate_compute(ctx.options["compute_s"], group)
    compute = lambda: _matmuls(a, a, count)  # noqa: E731
    compute_s = median(sample(compute, group))
    bytes_per_s = _calibrate_comm_rate(group)
    rows = []
    for ratio in _ratios(ctx.options):
        elements = max(1, int(ratio * compute_s * bytes_per_s / 4))
        buffer = torch.ones(elements)
        alone = median(sample(lambda b=buffer: comm.all_reduce(b, group, meter=_METER), group))
        for mechanism in _MECHANISMS:

            def both(b=buffer, how=mechanism) -> None:
                if how == "async_c10d":
                    work = comm.all_reduce(b, group, async_op=True, meter=_METER)
                    compute()
                    work.wait()
                else:
                    reduced = comm.lazy_all_reduce(b, group, meter=_METER)
                    compute()
                    reduced.add_(0)  # first use waits

            both_s = median(sample(both, group))
            rows.append(
                {
                    "mechanism": mechanism,
                    "ratio": ratio,
                    "bytes": buffer.nbytes,
                    "compute_s": compute_s,
                    "comm_s": alone,
                    "both_s": both_s,
                    "serial_s": compute_s + alone,
                    "ideal_s": max(compute_s, alone),
                    "hidden_fraction": hidden_fraction(compute_s, alone, both_s),
                }
            )
    return {"rows": rows, "matmuls": count, "matmul_shape": list(a.shape)}


def table(doc: dict[str, Any]) -> str:
    """One row per mechanism and size ratio."""
    lines = [
        f"{'mechanism':11s} {'comm/compute':>12s} {'size':>9s} {'compute s':>9s} "
        f"{'comm s':>7s} {'both s':>7s} {'serial s':>8s} {'hidden':>7s}"
    ]
    for r in doc["result"]["rows"]:
        lines.append(
            f"{r['mechanism']:11s} {r['comm_s'] / r['compute_s']:12.2f} "
            f"{r['bytes'] / 2**20:7.1f}MB {r['compute_s']:9.3f} {r['comm_s']:7.3f} "
            f"{r['both_s']:7.3f} {r['serial_s']:8.3f} {r['hidden_fraction']:7.2f}"
        )
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Bars: serial, measured and ideal time per ratio and mechanism."""
    rows = doc["result"]["rows"]
    fig, ax = new_figure(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.25 for x in xs], [r["serial_s"] for r in rows], 0.25, label="serial (C + M)")
    ax.bar(list(xs), [r["both_s"] for r in rows], 0.25, label="measured, overlapped")
    ax.bar([x + 0.25 for x in xs], [r["ideal_s"] for r in rows], 0.25, label="ideal max(C, M)")
    ax.set_xticks(
        list(xs),
        [
            f"{r['mechanism']}\nM/C={r['comm_s'] / r['compute_s']:.1f}\n"
            f"hidden {r['hidden_fraction']:.2f}"
            for r in rows
        ],
        fontsize=7,
    )
    ax.set_ylabel("seconds")
    ax.set_title(f"overlap of all_reduce and matmul, {doc['environment']['network']}", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def _ratios(options: dict[str, Any]) -> list[float]:
    return [float(r) for r in options["ratios"].split(",")]


def check(options: dict[str, Any]) -> None:
    """Positive compute time and size ratios."""
    try:
        ratios = _ratios(options)
    except ValueError:
        raise ConfigError(f"ratios={options['ratios']!r} must be numbers like 0.5,1,2") from None
    if options["compute_s"] <= 0 or any(r <= 0 for r in ratios):
        raise ConfigError("compute_s and every ratio must be > 0")


def headline(doc: dict[str, Any]) -> str:
    """Hidden fraction of the all-reduce closest to the compute's length (target >= 0.8)."""
    rows = doc["result"]["rows"]
    parts = []
    for mechanism in _MECHANISMS:
        mine = [r for r in rows if r["mechanism"] == mechanism]
        row = min(mine, key=lambda r: abs(r["comm_s"] / r["compute_s"] - 1))
        verdict = "meets" if row["hidden_fraction"] >= 0.8 else "misses"
        parts.append(
            f"{mechanism}: {row['hidden_fraction']:.2f} hidden at comm/compute "
            f"{row['comm_s'] / row['compute_s']:.2f} ({verdict} the 0.8 target)"
        )
    return "; ".join(parts)


def key_numbers(result: dict[str, Any]) -> dict[str, float]:
    """Hidden fraction per mechanism and ratio (each run calibrates its own sizes, so the
    normalised figure is the one to compare across runs)."""
    return {
        f"{r['mechanism']} x{r['ratio']:g} hidden": r["hidden_fraction"] for r in result["rows"]
    }


BENCHMARK = Benchmark(
    name="overlap",
    summary="fraction of an all-reduce hidden under a concurrent matmul kernel",
    describe=(
        "A matmul loop of about `compute_s` seconds and an all-reduce sized to 0.5x, 1x and 2x "
        "its length, alone and together. Hidden fraction = (C + M - B) / min(C, M): 0 means "
        "serial, 1 means the shorter one is fully hidden, which is the physical limit. "
        "Measured for async c10d calls and for functional collectives. On a 2-core machine two "
        "ranks' compute threads occupy both cores, and gloo's transfer threads and the "
        "kernel's TCP work compete with them: the hidden fraction swings from run to run and "
        "is lowest when communication and compute have the same length."
    ),
    table=table,
    plot=plot,
    run_rank=run_rank,
    check=check,
    headline=headline,
    key_numbers=key_numbers,
    options={"compute_s": 0.5, "ratios": "0.5,1,2"},
    option_help={
        "compute_s": "seconds of the matmul loop",
        "ratios": "all-reduce lengths as multiples of the matmul loop's, comma-separated",
    },
)
