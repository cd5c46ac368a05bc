"""`planner`: the cost model against real runs — many plans of a small GPT (and of a small
MoE-GPT) trained for a few steps on the cluster's ranks, each beside its prediction.

On every rank first the machine is calibrated on the cluster itself, so on the emulated link
when it is shaped (`bench.cluster_calibration`: link α and bandwidth, matmul FLOP/s, the
dense model's own efficiency fitted as a curve in the tokens a matmul sees, the hidden share
of an overlapped all-reduce, the optimizer step's bandwidth, and how much faster one rank
computes while the others wait, which prices pipeline bubbles).
Then each plan whose world size is the cluster's runs through the Trainer: one warm-up step,
then `steps` steps, the slowest rank's step time per step, the median kept. Memory per
rank is measured as the optimizer's parameter, gradient and AdamW state bytes plus the peak of
the activations autograd keeps for backward (saved tensors counted once per storage while they
are alive; parameters excluded; tensors a checkpointed layer recomputes inside its backward are
not seen). Each is predicted by `cost.estimate` on `hardware.local` built from the calibration,
at the matmul rate measured again just before the plan ran.

Reported: Spearman rank correlation of predicted and measured step times, the median absolute
relative error, whether the predicted best plan is within 5% of the measured best, and the
memory model's relative error. With `shapes`, each plan is priced a second time with matmul
shapes and attention measured on a grid on the ranks (`interlace plan --calibrate`) and the
model's efficiency at one rank's share of the batch relative to it, in place of the fitted
curve (`cluster_calibration.shapes_hardware`), and summarised the same way.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from interlace.bench.base import Benchmark, RankContext
from interlace.bench.cluster_calibration import (
    calibrate_cluster,
    calibrate_shapes,
    cluster_hardware,
    matmul_rate_now,
    shapes_hardware,
)
from interlace.bench.saved_memory import SavedTensorMeter
from interlace.bench.timing import slowest
from interlace.errors import ConfigError
from interlace.mesh import build_mesh
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.cost import estimate
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

PIPELINE_PLANS = [
    f"pp=2,micro_batches={m},schedule={schedule},recompute={recompute}"
    for m in (2, 4)
    for schedule in ("gpipe", "1f1b", "interleaved", "shifted")
    for recompute in ("none", "full")
    if not (schedule == "shifted" and recompute == "none")
]
DENSE_PLANS = {
    1: ["dp=1", "dp=1,micro_batches=2"],
    2: [
        "dp=2",
        "dp=2,dp_overlap=false",
        "tp=2",
        "tp=2,tp_subbatches=2",
        "tp=2,sequence_parallel=true",
        *PIPELINE_PLANS,
    ],
    4: ["dp=4", "dp=2,tp=2", "tp=4", "pp=4,micro_batches=4", "dp=2,pp=2,micro_batches=2"],
}
"""The dense model's plans per cluster size."""
MOE_PLANS = {1: ["dp=1"], 2: ["dp=2", "dp=2,ep=2"], 4: ["dp=4,ep=2", "dp=4,ep=4"]}
"""The MoE model's plans per cluster size."""


def _state_bytes(trainer: Trainer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state tensors."""
    params = list(trainer.model.parameters())
    total = sum(2 * p.numel() * p.element_size() for p in params)  # weight + gradient
    for state in trainer.optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if v.dim() > 0)
    return total


def _dense_config(options: dict[str, Any]):
    """The dense model's config at the benchmark's sequence length."""
    config = get_preset(options["model"])
    if options["seq_len"]:
        config = dataclasses.replace(config, seq_len=options["seq_len"])
    return config


def _calibrate(ctx: RankContext) -> dict[str, Any]:
    """`calibrate_cluster` for the dense model at one rank's share of the global batch."""
    options = ctx.options
    rows = max(1, options["global_batch"] // ctx.group.size)
    return calibrate_cluster(ctx, _dense_config(options), rows)


def _run_plan(ctx: RankContext, model: str, text: str) -> dict[str, Any]:
    options, group = ctx.options, ctx.group
    plan = Plan.parse(text)
    config = TrainConfig(
        model=model,
        global_batch=options["global_batch"],
        seq_len=options["seq_len"] or None,
        steps=10_000,
        out=None,
        progress=False,
        eval_every=0,
    )
    setup = prepare_run(config, plan, group.size)
    trainer = Trainer(setup, build_mesh(plan))
    trainer.train_step()  # warm-up
    meter = SavedTensorMeter(exclude=trainer.model.parameters())
    times = []
    for _ in range(options["steps"]):
        dist.barrier(group=group.pg)
        with meter:
            row = trainer.train_step()
        times.append(slowest(row["step_time_s"], group))
    state = _state_bytes(trainer)
    memory = slowest(float(state + meter.peak_bytes), group)
    return {
        "plan": str(plan),
        "model": model,
        "step_s": times,
        "step_median_s": statistics.median(times),
        "memory_bytes": memory,
        "state_bytes": state,
        "activation_peak_bytes": meter.peak_bytes,
        "model_config": setup.model_config,
    }


def _predict(
    run: dict[str, Any], hardware, options: dict[str, Any], gridded=None
) -> dict[str, Any]:
    """`run` with its prediction on `hardware`, and on `gridded` (shapes measured on a grid)
    where given (`predicted_grid_s`)."""
    plan, config = Plan.parse(run["plan"]), run.pop("model_config")
    cost = estimate(plan, config, hardware, options["global_batch"], dtype="fp32")
    run["predicted_s"] = cost.step_seconds
    run["predicted_breakdown"] = cost.breakdown
    run["predicted_memory_bytes"] = cost.memory_bytes_per_device
    if gridded is not None:
        grid = estimate(plan, config, gridded, options["global_batch"], dtype="fp32")
        run["predicted_grid_s"] = grid.step_seconds
    return run


def run_rank(ctx: RankContext) -> dict[str, Any]:
    """Calibrate on the cluster, run every plan of the cluster's size, predict each. The
    matmul rate is measured again just before each plan (a shared machine's speed drifts
    over the minutes the plans take; the prediction is made at the speed the plan ran at),
    every other calibrated figure is kept."""
    options, p = ctx.options, ctx.group.size
    calibration = _calibrate(ctx)
    surface = calibrate_shapes(ctx) if options["shapes"] else None
    runs = []
    jobs = [(options["model"], t) for t in DENSE_PLANS.get(p, [])]
    if options["moe_model"]:
        jobs += [(options["moe_model"], t) for t in MOE_PLANS.get(p, [])]
    limit = options["plans"] or len(jobs)
    for model, text in jobs[:limit]:
        rate = matmul_rate_now(ctx)
        run = _run_plan(ctx, model, text)
        run["matmul_flops"] = rate
        gridded = None
        if surface is not None:
            rows = max(1, options["global_batch"] // p)
            config = _dense_config(options)
            gridded = shapes_hardware(calibration, surface, config, rows, p, rate)
        runs.append(_predict(run, cluster_hardware(calibration, p, rate), options, gridded))
    return {
        "calibration": calibration,
        "runs": runs,
        "summary": summarize(runs),
        **({"summary_grid": summarize(runs, "predicted_grid_s")} if surface else {}),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation of two equally long lists (average ranks for ties)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def summarize(runs: list[dict[str, Any]], key: str = "predicted_s") -> dict[str, Any]:
    """Rank correlation, median |relative error| of time (predicted as `key`: `predicted_s`,
    or `predicted_grid_s` with shapes measured on a grid) and memory, and whether the
    predicted best is within 5% of the measured best (per model)."""
    if not runs:
        return {}
    measured = [r["step_median_s"] for r in runs]
    predicted = [r[key] for r in runs]
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured, strict=True)]
    mem_errors = [abs(r["predicted_memory_bytes"] / r["memory_bytes"] - 1) for r in runs]
    best = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        mine = [r for r in runs if r["model"] == model]
        chosen = min(mine, key=lambda r: r[key])
        fastest = min(mine, key=lambda r: r["step_median_s"])
        best[model] = {
            "predicted_best": chosen["plan"],
            "measured_best": fastest["plan"],
            "predicted_best_slower_by": chosen["step_median_s"] / fastest["step_median_s"] - 1,
        }
    return {
        "plans": len(runs),
        "spearman": spearman(predicted, measured),
        "median_abs_rel_error": statistics.median(errors),
        "max_abs_rel_error": max(errors),
        "memory_median_abs_rel_error": statistics.median(mem_errors),
        "memory_max_abs_rel_error": max(mem_errors),
        "best": best,
        "best_within_5pct": all(b["predicted_best_slower_by"] <= 0.05 for b in best.values()),
    }


def table(doc: dict[str, Any]) -> str:
    """One row per plan: measured and predicted step, error, memory both ways; then summary."""
    r = doc["result"]
    c = r["calibration"]
    lines = [
        f"calibrated: {c['matmul_flops'] / 1e9:.1f} GFLOP/s per rank ({c['threads']} threads), "
        f"model steps at {c.get('model_efficiency', 1.0):.0%} of that"
        + (
            f" (fit: {c['matmul_efficiency']:.0%} · m / (m + {c['matmul_half_rows']:.0f}) at m "
            "tokens)"
            if "matmul_half_rows" in c
            else ""
        )
        + ", "
        f"{c.get('overlap_efficiency', 1.0):.0%} of overlapped comm hidden, "
        f"link {c['link_bandwidth_Bps'] / 1e6:.0f} MB/s, α {c['link_latency_s'] * 1e6:.0f} µs"
        + (
            f", optimizer step {c['memory_bandwidth_Bps'] / 1e9:.1f} GB/s, "
            f"one rank alone computes {c['idle_speedup']:.2f}× faster"
            if "idle_speedup" in c
            else ""
        ),
        f"{'model':10s} {'plan':56s} {'meas s':>7s} {'pred s':>7s} {'err':>6s} "
        f"{'mem MB':>7s} {'pred MB':>7s}",
    ]
    for run in r["runs"]:
        lines.append(
            f"{run['model']:10s} {run['plan']:56s} {run['step_median_s']:7.3f} "
            f"{run['predicted_s']:7.3f} {run['predicted_s'] / run['step_median_s'] - 1:+6.0%} "
            f"{run['memory_bytes'] / 1e6:7.1f} {run['predicted_memory_bytes'] / 1e6:7.1f}"
        )
    for run in (run for run in r["runs"] if "predicted_grid_s" in run):
        lines.append(
            f"  {run['plan']:64s} shapes measured on a grid: {run['predicted_grid_s']:7.3f} "
            f"{run['predicted_grid_s'] / run['step_median_s'] - 1:+6.0%}"
        )
    s = r["summary"]
    if "summary_grid" in r:
        g = r["summary_grid"]
        lines.append(
            f"shapes measured on a grid: Spearman {g['spearman']:.2f}, median |error| "
            f"{g['median_abs_rel_error']:.0%} (max {g['max_abs_rel_error']:.0%})"
        )
    if s:
        lines.append(
            f"{s['plans']} plans: Spearman {s['spearman']:.2f}, median |error| "
            f"{s['median_abs_rel_error']:.0%} (max {s['max_abs_rel_error']:.0%}), memory median "
            f"|error| {s['memory_median_abs_rel_error']:.0%}; predicted best within 5% of "
            f"measured best: {s['best_within_5pct']}"
        )
        for model, b in s["best"].items():
            lines.append(
                f"  {model}: predicted best {b['predicted_best']}, measured best "
                f"{b['measured_best']} (predicted best slower by "
                f"{b['predicted_best_slower_by']:.1%})"
            )
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Predicted vs measured step time per plan, log-log, with the y = x line."""
    from interlace.plotting import new_figure, save_figure

    runs = doc["result"]["runs"]
    fig, ax = new_figure(figsize=(6, 5.5))
    for i, model in enumerate(dict.fromkeys(r["model"] for r in runs)):
        mine = [r for r in runs if r["model"] == model]
        ax.scatter(
            [r["step_median_s"] for r in mine],
            [r["predicted_s"] for r in mine],
            color=f"C{i}",
            label=model,
            s=18,
        )
    values = [v for r in runs for v in (r["step_median_s"], r["predicted_s"])]
    lo, hi = min(values) / 1.3, max(values) * 1.3
    ax.plot([lo, hi], [lo, hi], color="0.5", linewidth=0.8, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    env, s = doc["environment"], doc["result"]["summary"]
    ax.set_title(
        f"planner vs runs, {env['ranks']} ranks, {env['network']}: Spearman "
        f"{s.get('spearman', 0):.2f}, median |err| {s.get('median_abs_rel_error', 0):.0%}",
        fontsize=8,
    )
    ax.legend(fontsize=7)
    save_figure(fig, path, dpi=110)


def check(options: dict[str, Any]) -> None:
    """Positive steps and batch; plans >= 0 (0 = all)."""
    if options["steps"] < 1 or options["global_batch"] < 1 or options["plans"] < 0:
        raise ConfigError(
            f"steps={options['steps']} and global_batch={options['global_batch']} must be "
            f">= 1 and plans={options['plans']} >= 0 (0 = every plan)"
        )


def headline(doc: dict[str, Any]) -> str:
    """Rank correlation and error of the cost model over the measured plans."""
    s = doc["result"]["summary"]
    return (
        f"{s['plans']} plans: Spearman {s['spearman']:.2f} between predicted and measured step "
        f"time, median |error| {s['median_abs_rel_error']:.0%}, memory median |error| "
        f"{s['memory_median_abs_rel_error']:.0%}; predicted best within 5% of the measured best: "
        f"{s['best_within_5pct']}"
    )


def key_numbers(result: dict[str, Any]) -> dict[str, float]:
    """Spearman and median error (their spread over repeats tells reproducibility)."""
    s = result["summary"]
    return {"spearman": s["spearman"], "median_abs_rel_error": s["median_abs_rel_error"]}


BENCHMARK = Benchmark(
    name="planner",
    summary="cost model vs measured step time and memory over many plans",
    describe=(
        "Each plan of a small GPT (dp with and without overlap, tp plain / sub-batched / "
        "sequence parallel, pp=2 under GPipe, 1F1B, interleaved and shifted with and without "
        "recomputation at 2 and 4 micro-batches) and of a small MoE-GPT (dp, ep) is trained "
        "for a few steps on the cluster's ranks and priced by `planner.cost.estimate` on "
        "hardware calibrated on the same cluster (matmul FLOP/s, all_reduce α and bandwidth). "
        "Targets: Spearman >= 0.9, median |error| <= 15%, the predicted best within 5% of the "
        "measured best, memory within 20%."
    ),
    table=table,
    plot=plot,
    run_rank=run_rank,
    check=check,
    headline=headline,
    key_numbers=key_numbers,
    options={
        "model": "demo",
        "moe_model": "moe-demo",
        "global_batch": 16,
        "seq_len": 0,
        "steps": 3,
        "plans": 0,
        "shapes": False,
    },
    option_help={
        "model": "dense preset whose plans run",
        "moe_model": "MoE preset whose plans also run (empty: none)",
        "global_batch": "sequences per step over all ranks",
        "seq_len": "tokens per sequence (0: the preset's)",
        "steps": "timed steps per plan, after one warm-up",
        "plans": "run only the first N plans of the rank count (0: every one)",
        "shapes": "also price each plan with matmul shapes and attention measured on a grid "
        "(`interlace plan --calibrate`), the model's efficiency taken at one batch relative "
        "to it, in place of the fitted curve (`predicted_grid_s`, `summary_grid`)",
    },
)
