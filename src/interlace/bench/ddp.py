"""`ddp`: a data-parallel training step of the reference GPT, gradients all-reduced during
backward (torch DDP, default 25 MB buckets) vs after backward (one flat all-reduce).

Per step: the slowest rank's step time; compute time (the same per-rank work on a one-rank
Trainer, no communication); communication time (an all-reduce of all gradients alone); bytes
counted by the comm meter, bytes the kernel saw leave the rank's interface (TCP/IP headers
included), and the ring formula 2·(p−1)/p·params·4.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from interlace import comm
from interlace.bench.base import (
    Benchmark,
    RankContext,
    mode_step_times,
    plot_modes_against_limits,
)
from interlace.bench.timing import median, sample, slowest
from interlace.errors import ConfigError
from interlace.mesh import build_mesh
from interlace.models.presets import get_preset
from interlace.plan import Overlap, Plan
from interlace.planner.calibrate import hidden_fraction
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

_METER = comm.CommMeter()
MODES = {"ddp_overlap": Overlap(dp_overlap=True), "after_backward": Overlap(dp_overlap=False)}


def _config(options: dict[str, Any], ranks: int) -> TrainConfig:
    return TrainConfig(
        model=options["model"],
        global_batch=options["micro_batch"] * ranks,
        steps=10_000,
        out=None,
        progress=False,
        eval_every=0,
    )


def _measure_mode(ctx: RankContext, overlap: Overlap, steps: int) -> dict[str, Any]:
    group = ctx.group
    plan = Plan(dp=group.size, overlap=overlap)
    setup = prepare_run(_config(ctx.options, group.size), plan, group.size)
    trainer = Trainer(setup, build_mesh(plan))
    trainer.train_step()  # warm-up; DDP rebuilds its buckets after the first step
    step_s, tx, payload, wire = [], [], [], []
    for _ in range(steps):
        dist.barrier(group=group.pg)
        sent = ctx.tx_bytes()
        row = trainer.train_step()
        tx.append(ctx.tx_bytes() - sent)
        step_s.append(slowest(row["step_time_s"], group))
        dp = comm.meter.snapshot()["dp"]["all_reduce"]
        payload.append(dp["bytes"])
        wire.append(dp["wire_bytes"])
    tokens = setup.config.global_batch * setup.model_config.seq_len
    return {
        "step_s": step_s,
        "step_median_s": median(step_s),
        "tokens_per_s": tokens / median(step_s),
        "tx_bytes": tx,
        "meter_payload_bytes": payload[-1],
        "meter_wire_bytes": wire[-1],
    }


def run_rank(ctx: RankContext) -> dict[str, Any]:
    """Compute alone, gradient all-reduce alone, then a few steps in each mode."""
    group, steps = ctx.group, ctx.options["steps"]
    one_rank = dataclasses.replace(
        _config(ctx.options, group.size), global_batch=ctx.options["micro_batch"]
    )
    solo = Trainer(prepare_run(one_rank, Plan(), 1))
    compute_s = median(sample(solo.train_step, group, min_samples=steps, min_seconds=0))
    params = solo.setup.model_config.num_params()
    del solo
    gradients = torch.zeros(params)
    comm_s = median(
        sample(
            lambda: comm.all_reduce(gradients, group, meter=_METER),
            group,
            min_samples=steps,
            min_seconds=0,
        )
    )
    modes = {}
    for name, overlap in MODES.items():
        mode = _measure_mode(ctx, overlap, steps)
        mode["hidden_fraction"] = hidden_fraction(compute_s, comm_s, mode["step_median_s"])
        modes[name] = mode
    p = group.size
    return {
        "params": params,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "formula_wire_bytes": 2 * (p - 1) / p * params * 4,
        "modes": modes,
    }


def table(doc: dict[str, Any]) -> str:
    """One row per mode, plus the compute / communication / bytes reference lines."""
    r = doc["result"]
    lines = [
        f"model {doc['options']['model']} ({r['params'] / 1e6:.1f} M params), "
        f"compute alone {r['compute_s']:.3f} s, gradient all-reduce alone "
        f"{r['comm_s']:.3f} s, serial sum {r['compute_s'] + r['comm_s']:.3f} s",
        f"{'mode':15s} {'step s':>7s} {'tokens/s':>9s} {'hidden':>7s} "
        f"{'meter wire MB':>13s} {'iface tx MB':>11s} {'formula MB':>10s}",
    ]
    for name, m in r["modes"].items():
        lines.append(
            f"{name:15s} {m['step_median_s']:7.3f} {m['tokens_per_s']:9.0f} "
            f"{m['hidden_fraction']:7.2f} {m['meter_wire_bytes'] / 1e6:13.2f} "
            f"{median(m['tx_bytes']) / 1e6:11.2f} {r['formula_wire_bytes'] / 1e6:10.2f}"
        )
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Step time per mode against compute alone, serial sum and the ideal max."""
    env = doc["environment"]
    plot_modes_against_limits(
        doc["result"],
        path,
        ylabel="seconds per step",
        title=f"DDP step, {doc['options']['model']}, {env['ranks']} ranks, {env['network']}",
    )


def check(options: dict[str, Any]) -> None:
    """A known model and positive counts."""
    get_preset(options["model"])
    if options["micro_batch"] < 1 or options["steps"] < 1:
        raise ConfigError("micro_batch and steps must be >= 1")


def headline(doc: dict[str, Any]) -> str:
    """DDP's step vs the no-overlap step, and measured bytes vs the ring formula."""
    r = doc["result"]
    ddp, after = r["modes"]["ddp_overlap"], r["modes"]["after_backward"]
    tx = median(ddp["tx_bytes"])
    return (
        f"DDP step {ddp['step_median_s']:.3f} s vs {after['step_median_s']:.3f} s without "
        f"overlap ({after['step_median_s'] / ddp['step_median_s']:.2f}x), "
        f"{ddp['hidden_fraction']:.2f} of the communication hidden; bytes on the wire "
        f"{tx / r['formula_wire_bytes']:.3f}x the formula 2(p-1)/p*params*4"
    )


BENCHMARK = Benchmark(
    name="ddp",
    summary="data-parallel GPT step: DDP bucketed overlap vs all-reduce after backward",
    describe=(
        "A training step of the reference GPT (`bench-25m`: 25 M parameters, byte-level, "
        "4 sequences of 128 tokens per rank) through interlace's Trainer, with DDP's bucketed "
        "all-reduce during backward vs one all-reduce after backward. The physical limit of a "
        "step is max(compute, communication); no overlap gives their sum. Bytes: what the comm "
        "meter counted, what left the network interface, and the ring formula."
    ),
    table=table,
    plot=plot,
    run_rank=run_rank,
    check=check,
    headline=headline,
    key_numbers=mode_step_times,
    options={"model": "bench-25m", "micro_batch": 4, "steps": 3},
    option_help={
        "model": "model preset trained",
        "micro_batch": "sequences per rank per step",
        "steps": "timed steps per mode (and samples of compute and all-reduce alone)",
    },
)
