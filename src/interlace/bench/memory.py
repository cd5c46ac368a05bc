"""`memory`: memory per rank and step time of one model at one global batch under replicated
data parallelism (DDP, dp=N), sharded data parallelism (FSDP2, dp_shard=N), sharded × tensor
parallelism (dp_shard=N/2,tp=2) and activation recomputation none / selective / full, each
beside the planner's prediction.

Each plan trains through the Trainer for 2 + `steps` steps: a warm-up step, the step whose
memory the Trainer measures on every rank (`interlace.memory.measure_step`: parameters,
gradients, optimizer states, activations, step peak, beside `planner.cost.plan_memory`), then
the timed steps, whose mean (the slowest rank's) is the step time. The step time is predicted
by `planner.cost.estimate` on hardware calibrated on the same cluster
(`bench.cluster_calibration`, skipped with `predict_time=false`). On a shaped link the bytes
each rank's interface sent per step are counted too (FSDP2's collectives bypass the comm meter).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from interlace.bench.base import Benchmark, RankContext
from interlace.bench.cluster_calibration import calibrate_cluster, cluster_hardware
from interlace.bench.memory_report import KEPT, headline, key_numbers, plot, table
from interlace.bench.timing import slowest
from interlace.errors import ConfigError
from interlace.mesh import build_mesh
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.cost import estimate
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig


def plans(ranks: int) -> list[str]:
    """The plans compared on `ranks` ranks (dp_shard × tp from 4 even ranks on)."""
    n = ranks
    rows = [f"dp={n}", f"dp={n},recompute=selective", f"dp={n},recompute=full"]
    rows += [f"dp_shard={n}", f"dp_shard={n},{KEPT}", f"dp_shard={n},recompute=full"]
    if n >= 4 and n % 2 == 0:
        rows.append(f"dp_shard={n // 2},tp=2")
    return rows


def _config(options: dict[str, Any]) -> TrainConfig:
    return TrainConfig(
        model=options["model"],
        seq_len=options["seq_len"] or None,
        global_batch=options["global_batch"],
        steps=2 + options["steps"],  # warm-up, the measured step, the timed steps
        measure_memory=True,
        out=None,
        progress=False,
        eval_every=0,
    )


def _run_plan(ctx: RankContext, text: str, calibration: dict[str, Any] | None) -> dict[str, Any]:
    """One plan trained, its memory measured, its step timed and, on a shaped link, the bytes
    its interface sent per step counted (collective)."""
    group, steps = ctx.group, 2 + ctx.options["steps"]
    plan = Plan.parse(text)
    setup = prepare_run(_config(ctx.options), plan, group.size)
    trainer = Trainer(setup, build_mesh(plan))
    dist.barrier(group=group.pg)
    sent = ctx.tx_bytes() if ctx.rate_bps else 0
    report = trainer.fit()
    row: dict[str, Any] = {
        "plan": str(plan),
        "step_s": slowest(report["mean_step_time_s"], group),
        "tx_bytes_per_step": (ctx.tx_bytes() - sent) / steps if ctx.rate_bps else None,
        "memory": trainer.memory,
        "predicted_step_s": None,
    }
    if calibration is not None:
        hardware = cluster_hardware(calibration, group.size, calibration["matmul_flops"])
        cost = estimate(
            plan, setup.model_config, hardware, setup.config.global_batch, dtype=setup.precision
        )
        row.update(
            predicted_step_s=cost.step_seconds,
            predicted_breakdown=cost.breakdown,
            predicted_hidden=cost.hidden,
        )
    return row


def run_rank(ctx: RankContext) -> dict[str, Any]:
    """Calibrate the cluster (unless `predict_time` is false), then run every plan."""
    options, ranks = ctx.options, ctx.group.size
    if ranks < 2:
        raise ConfigError("bench memory compares data-parallel plans: use --ranks 2 or more")
    setup = prepare_run(_config(options), Plan(dp=ranks), ranks)
    rows = options["global_batch"] // ranks
    calibration = (
        calibrate_cluster(ctx, setup.model_config, rows) if options["predict_time"] else None
    )
    return {
        "ranks": ranks,
        "params": setup.model_config.num_params(),
        "seq_len": setup.model_config.seq_len,
        "calibration": calibration,
        "plans": {
            run["plan"]: run for run in (_run_plan(ctx, t, calibration) for t in plans(ranks))
        },
    }


def check(options: dict[str, Any]) -> None:
    """A known model, positive batch and steps, seq_len >= 0 (0: the preset's)."""
    get_preset(options["model"])
    if options["global_batch"] < 1 or options["steps"] < 1 or options["seq_len"] < 0:
        raise ConfigError(
            f"global_batch={options['global_batch']} and steps={options['steps']} must be >= 1 "
            f"and seq_len={options['seq_len']} >= 0 (0: the preset's)"
        )


BENCHMARK = Benchmark(
    name="memory",
    summary="memory per rank and step time: DDP, FSDP, FSDP x TP, recompute none/selective/full",
    describe=(
        "One model at one global batch under `dp=N` (DDP), `dp=N` with `recompute=selective` "
        "and `full`, `dp_shard=N` (FSDP2) with and without full recomputation and with "
        "`reshard_after_forward=false` (no second gather in backward), and "
        "`dp_shard=N/2,tp=2`, all trained through the Trainer on the cluster's ranks. Memory "
        "per rank is the Trainer's own measurement of the run's third step (parameters, "
        "gradients and AdamW states as the bytes of their storages before the update; "
        "activations as the most the step had allocated and kept at the end of any module's "
        "forward, gradients excepted, which counts FSDP's gathered parameters too; live tensor "
        "bytes on the CPU) for the rank holding the most, predicted by `plan_memory` (state, and "
        "activations + recomputation working set + FSDP's gathered blocks). Step time is the "
        "mean of the timed steps (warm-up and the measured step excluded), predicted by "
        "`cost.estimate` on hardware calibrated on the same cluster. FSDP shards the state "
        "over N ranks (the limit: 1/N of DDP's) but moves more bytes: two all-gathers of the "
        "parameters and a reduce-scatter of the gradients against DDP's one all-reduce, 1.5x "
        "its bytes in a ring (on gloo too: interlace's reduce-scatter there is a ring of sends, "
        "torch's an all-reduce) (`sent MB`, counted at each rank's interface on a shaped link, "
        "as FSDP2's collectives bypass the comm meter). Its step can match DDP's only while "
        "those collectives hide under compute; on the CPU the gathers are asynchronous and "
        "issued a block ahead, and the blocks' reduce-scatters run on a thread of their own "
        "while backward goes on (fp32 reduction, no replicas, no pipeline)."
    ),
    table=table,
    plot=plot,
    run_rank=run_rank,
    check=check,
    headline=headline,
    key_numbers=key_numbers,
    default_ranks=4,
    options={
        "model": "bench-25m",
        "seq_len": 32,
        "global_batch": 16,
        "steps": 3,
        "predict_time": True,
    },
    option_help={
        "model": "model preset trained",
        "seq_len": "tokens per sequence (0: the preset's)",
        "global_batch": "sequences per step over all ranks",
        "steps": "timed steps per plan, after a warm-up step and the measured step",
        "predict_time": "calibrate the cluster and predict each plan's step time",
    },
)
