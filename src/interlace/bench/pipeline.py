"""`pipeline`: pipeline-parallel steps of the built-in GPT with pp = all ranks, timed from
per-rank timelines (`parallel/pipeline/trace.py`).

1. Bubble: GPipe and 1F1B for each micro-batch count m. Every recorded step gives one
   timeline; bubble = mean over ranks of 1 − busy / makespan (busy: the union of the rank's
   forward / backward spans; makespan: first span start to last span end over all ranks),
   against the theory (p − 1) / (m + p − 1) of equal stages with backward = 2 × forward and
   free communication.
2. Recomputation off the critical path: step time of 1F1B with full recomputation vs Merak's
   shifted critical-path schedule (with full and with stage-aware recomputation) at m =
   `compare_micro_batches`.
3. Memory: peak bytes of saved activations per stage under 1F1B for recompute none / full /
   stage-aware (`saved_memory.py` says what is counted), beside the partitioner's estimate.
4. Contention: each stage's forward + backward of one micro-batch with the other ranks idle,
   against its busy time per micro-batch inside a GPipe step; ranks share the machine's cores.

Each rank runs one thread (`torch.set_num_threads(1)`). Step times are the slowest rank's.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from interlace.bench.base import GPT_OPTION_HELP, Benchmark, RankContext, gpt_config
from interlace.bench.saved_memory import SavedTensorMeter
from interlace.bench.timing import median, slowest
from interlace.errors import ConfigError
from interlace.mesh import Mesh, build_mesh
from interlace.models.gpt import build_model
from interlace.parallel.pipeline.partition import micro_batches_in_flight
from interlace.parallel.pipeline.runner import PipelineRunner
from interlace.parallel.pipeline.trace import (
    StepRecorder,
    bubble_fraction,
    busy_seconds,
    gather_spans,
    write_step_trace,
)
from interlace.plan import Plan
from interlace.planner.cost import bubble_fraction as theoretical_bubble
from interlace.timeline import Span, spans_from_json, spans_to_json

BUBBLE_SCHEDULES = ("gpipe", "1f1b")
COMPARED = {  # name: (schedule, recompute)
    "1f1b+full": ("1f1b", "full"),
    "shifted+full": ("shifted", "full"),
    "shifted+stage-aware": ("shifted", "stage-aware"),
}
RECOMPUTE_MODES = ("none", "full", "stage-aware")


def _micro_batch_counts(options: dict[str, Any]) -> list[int]:
    return [int(m) for m in str(options["micro_batches"]).split(",")]


def _runner(options: dict[str, Any], mesh: Mesh, m: int, schedule: str, recompute: str):
    torch.manual_seed(0)
    plan = Plan(pp=mesh.size("pp"), micro_batches=m, schedule=schedule, recompute=recompute)
    return PipelineRunner(build_model(gpt_config(options)), plan, mesh)


def _batch(options: dict[str, Any], m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids x, y [m · micro_batch, seq_len]."""
    g = torch.Generator().manual_seed(1)
    shape = (m * options["micro_batch"], options["seq_len"])
    x = torch.randint(0, options["vocab"], shape, generator=g)
    return x, torch.randint(0, options["vocab"], shape, generator=g)


def _recorded_steps(ctx: RankContext, runner: PipelineRunner, m: int) -> dict[str, Any]:
    """A warm-up step, then `steps` recorded steps: step times (slowest rank) and, on rank 0,
    each step's bubble and makespan and the last step's spans."""
    x, y = _batch(ctx.options, m)
    runner.step(x, y)  # torch infers stage shapes on the first step
    runner.zero_grad()
    recorder = StepRecorder(runner, group=ctx.group.pg)
    step_s, bubbles, makespans, spans = [], [], [], None
    for _ in range(ctx.options["steps"]):
        with recorder.record():
            start = time.perf_counter()
            runner.step(x, y)
            seconds = time.perf_counter() - start
        runner.zero_grad()
        step_s.append(slowest(seconds, ctx.group))
        spans = gather_spans(recorder.spans, ctx.group.pg)
        if spans is not None:
            bubbles.append(bubble_fraction(spans))
            makespans.append(max(s.end for s in spans) - min(s.start for s in spans))
    out: dict[str, Any] = {"step_s": step_s, "step_median_s": median(step_s)}
    if spans is not None:
        out.update(
            bubble=median(bubbles),
            bubbles=bubbles,
            makespan_s=median(makespans),
            spans=spans_to_json(spans),
            busy_per_micro_batch_s=[busy_seconds(spans, r) / m for r in range(ctx.group.size)],
        )
    return out


def _peak_saved_bytes(ctx: RankContext, runner: PipelineRunner, m: int) -> list[int]:
    """Peak saved-activation bytes of each rank during one 1F1B step (after a warm-up)."""
    x, y = _batch(ctx.options, m)
    runner.step(x, y)
    runner.zero_grad()
    with SavedTensorMeter(exclude=runner.parameters()) as meter:
        runner.step(x, y)
    peaks: list[Any] = [None] * ctx.group.size
    dist.all_gather_object(peaks, meter.peak_bytes, group=ctx.group.pg)
    return peaks


def _estimated_bytes(runner: PipelineRunner, options: dict[str, Any], m: int) -> list[float]:
    """The partitioner's estimate of each stage's saved activations under 1F1B."""
    part, p = runner.partition, runner.pp.size
    tokens = options["micro_batch"] * options["seq_len"]
    return [
        part.stage_memory(s, tokens, micro_batches_in_flight("1f1b", s, p, m), ratio)
        - part.stage_memory(s, tokens, 0.0, ratio)
        for s, ratio in enumerate(runner.layout.stage_ratios)
    ]


def _solo_stage_s(ctx: RankContext, runner: PipelineRunner, reps: int = 3) -> list[float]:
    """Each rank's forward + backward of one micro-batch through its stage while every other
    rank waits at a barrier (no contention for cores); one entry per rank."""
    options, stage = ctx.options, runner.stages[0]
    b, t = options["micro_batch"], options["seq_len"]
    if stage.is_first:
        inputs = torch.randint(0, options["vocab"], (b, t))
    else:
        inputs = torch.randn(b, t, options["d_model"], requires_grad=True)
    mine = 0.0
    for turn in range(ctx.group.size):
        dist.barrier(group=ctx.group.pg)
        if turn == ctx.group.rank:
            samples = []
            for _ in range(reps + 1):  # the first one warms up
                start = time.perf_counter()
                out = stage(inputs)
                out.backward(torch.ones_like(out))
                samples.append(time.perf_counter() - start)
            mine = statistics.median(samples[1:])
        dist.barrier(group=ctx.group.pg)
    runner.zero_grad()
    everyone: list[Any] = [None] * ctx.group.size
    dist.all_gather_object(everyone, mine, group=ctx.group.pg)
    return everyone


def run_rank(ctx: RankContext) -> dict[str, Any]:
    """Bubble per schedule and m, the recomputation comparison, memory per stage, contention."""
    torch.set_num_threads(1)
    options, p = ctx.options, ctx.group.size
    mesh = build_mesh(Plan(pp=p))
    counts = _micro_batch_counts(options)
    bubble: dict[str, dict[str, Any]] = {}
    solo: list[float] = []
    for schedule in BUBBLE_SCHEDULES:
        bubble[schedule] = {}
        for m in counts:
            runner = _runner(options, mesh, m, schedule, "none")
            bubble[schedule][str(m)] = _recorded_steps(ctx, runner, m)
            if not solo:
                solo = _solo_stage_s(ctx, runner)
    m_cmp = options["compare_micro_batches"]
    compared = {
        name: _recorded_steps(ctx, _runner(options, mesh, m_cmp, schedule, recompute), m_cmp)
        for name, (schedule, recompute) in COMPARED.items()
    }
    memory = {}
    for mode in RECOMPUTE_MODES:
        runner = _runner(options, mesh, m_cmp, "1f1b", mode)
        memory[mode] = {
            "ratios": list(runner.layout.stage_ratios),
            "peak_bytes": _peak_saved_bytes(ctx, runner, m_cmp),
            "estimated_bytes": _estimated_bytes(runner, options, m_cmp),
        }
    if ctx.group.rank != 0:  # the spans and bubbles live on rank 0
        return {"solo_stage_s": solo}
    return {
        "pp": p,
        "params": gpt_config(options).num_params(),
        "theory": {str(m): theoretical_bubble(p, m) for m in counts},
        "bubble": bubble,
        "compared": compared,
        "compare_micro_batches": m_cmp,
        "memory": memory,
        "solo_stage_s": solo,
    }


# ---------------------------------------------------------------------- reading a result
def _shifted_gain(r: dict[str, Any], name: str) -> float:
    """How much faster `name` is than 1F1B + full recomputation: 1 − its step / 1F1B's."""
    base = r["compared"]["1f1b+full"]["step_median_s"]
    return 1 - r["compared"][name]["step_median_s"] / base


def _contention(r: dict[str, Any]) -> list[float]:
    """Per stage: busy time per micro-batch inside the GPipe step at the largest m / the
    stage's forward + backward alone."""
    largest = max(r["bubble"]["gpipe"], key=int)
    busy = r["bubble"]["gpipe"][largest]["busy_per_micro_batch_s"]
    return [b / s for b, s in zip(busy, r["solo_stage_s"], strict=True)]


def table(doc: dict[str, Any]) -> str:
    """Bubble per schedule and m against theory; compared step times; memory per stage."""
    r = doc["result"]
    o = doc["options"]
    lines = [
        f"GPT {r['params'] / 1e6:.2f} M params, {o['layers']} layers, d={o['d_model']}, "
        f"micro-batch {o['micro_batch']}x{o['seq_len']} tokens, pp={r['pp']}; stage forward + "
        f"backward alone (ms): {', '.join(f'{s * 1e3:.0f}' for s in r['solo_stage_s'])}",
        f"{'schedule':9s} {'m':>3s} {'bubble':>7s} {'theory':>7s} {'rel.err':>7s} {'step s':>7s}",
    ]
    for schedule, rows in r["bubble"].items():
        for m, row in rows.items():
            theory = r["theory"][m]
            lines.append(
                f"{schedule:9s} {m:>3s} {row['bubble']:7.3f} {theory:7.3f} "
                f"{row['bubble'] / theory - 1:+7.1%} {row['step_median_s']:7.3f}"
            )
    lines.append(f"step time at m={r['compare_micro_batches']} (faster than 1f1b+full):")
    for name, row in r["compared"].items():
        lines.append(f"  {name:20s} {row['step_median_s']:7.3f} s  {_shifted_gain(r, name):+6.1%}")
    lines.append(
        f"peak saved activations per stage, 1F1B m={r['compare_micro_batches']} "
        "(MB measured / estimated; checkpoint ratios):"
    )
    for mode, row in r["memory"].items():
        cells = "  ".join(
            f"{m / 1e6:6.1f}/{e / 1e6:5.1f}"
            for m, e in zip(row["peak_bytes"], row["estimated_bytes"], strict=True)
        )
        ratios = ",".join(f"{x:g}" for x in row["ratios"])
        lines.append(f"  {mode:12s} {cells}  ({ratios})")
    slow = ", ".join(f"{c:.2f}" for c in _contention(r))
    lines.append(f"contention: busy per micro-batch in GPipe / alone, per stage: {slow}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Bubble vs m (measured and theory), compared step times, memory per stage; and the
    timelines of one 1F1B + full and one shifted step beside it (`pipeline_timeline.png`)."""
    from interlace.plotting import new_figure, save_figure

    r = doc["result"]
    fig, axes = new_figure(1, 3, figsize=(14, 4))
    left, middle, right = axes.ravel()
    counts = [int(m) for m in r["theory"]]
    left.plot(counts, list(r["theory"].values()), "k--", marker="o", label="(p-1)/(m+p-1)")
    for schedule, rows in r["bubble"].items():
        left.plot(counts, [rows[str(m)]["bubble"] for m in counts], marker="s", label=schedule)
    left.set_xlabel("micro-batches m")
    left.set_ylabel("bubble fraction")
    left.set_xscale("log", base=2)
    left.set_xticks(counts, [str(m) for m in counts])
    left.legend(fontsize=7)
    left.set_title(f"bubble, pp={r['pp']}", fontsize=9)
    names = list(r["compared"])
    middle.bar(names, [r["compared"][n]["step_median_s"] for n in names], color=["C0", "C1", "C2"])
    middle.set_ylabel("seconds per step")
    middle.set_title(f"recomputation, m={r['compare_micro_batches']}", fontsize=9)
    middle.tick_params(axis="x", labelsize=7)
    width = 0.8 / len(r["memory"])
    for k, (mode, row) in enumerate(r["memory"].items()):
        stages = [s + k * width for s in range(r["pp"])]
        right.bar(stages, [b / 1e6 for b in row["peak_bytes"]], width=width, label=mode)
    centres = [s + width * (len(r["memory"]) - 1) / 2 for s in range(r["pp"])]
    right.set_xticks(centres, [str(s) for s in range(r["pp"])])
    right.set_xlabel("stage")
    right.set_ylabel("peak saved activations (MB)")
    right.set_title("1F1B activation memory per stage", fontsize=9)
    right.legend(fontsize=7)
    save_figure(fig, path)
    spans = timeline_spans(r)
    write_step_trace(
        spans,
        path.parent / f"{doc['benchmark']}_timeline.json",
        title=f"one step, pp={r['pp']}, m={r['compare_micro_batches']}: rows per rank and schedule",
    )


def timeline_spans(r: dict[str, Any]) -> list[Span]:
    """The last recorded step of 1F1B + full and of shifted + stage-aware, one lane each."""
    spans = []
    for name in ("1f1b+full", "shifted+stage-aware"):
        for s in spans_from_json(r["compared"][name]["spans"]):
            spans.append(dataclasses.replace(s, lane=name))
    return spans


def check(options: dict[str, Any]) -> None:
    """Positive sizes, heads dividing d_model, micro-batch counts as a comma list of ints."""
    sizes = ("vocab", "seq_len", "d_model", "layers", "heads", "micro_batch", "steps")
    if any(options[s] < 1 for s in sizes):
        raise ConfigError(f"{', '.join(sizes)} must all be >= 1")
    if options["d_model"] % options["heads"]:
        raise ConfigError(f"heads={options['heads']} must divide d_model={options['d_model']}")
    try:
        counts = _micro_batch_counts(options)
    except ValueError:
        raise ConfigError(
            f"micro_batches={options['micro_batches']!r} must be a comma list of counts, "
            "e.g. 4,8,16"
        ) from None
    if min(counts) < 1 or options["compare_micro_batches"] < 1:
        raise ConfigError("micro_batches and compare_micro_batches must be >= 1")


def headline(doc: dict[str, Any]) -> str:
    """Bubble error against theory and the shifted schedule's gain."""
    r = doc["result"]
    errors = [
        abs(row["bubble"] / r["theory"][m] - 1)
        for rows in r["bubble"].values()
        for m, row in rows.items()
    ]
    gain = _shifted_gain(r, "shifted+stage-aware")
    return (
        f"measured bubble within {max(errors):.0%} of (p-1)/(m+p-1) over GPipe and 1F1B "
        f"(mean error {statistics.mean(errors):.0%}); shifted + stage-aware step "
        f"{gain:+.0%} vs 1F1B + full recomputation "
        f"({_shifted_gain(r, 'shifted+full'):+.0%} with full recomputation)"
    )


def key_numbers(result: dict[str, Any]) -> dict[str, float]:
    """Bubble per schedule and m, and the compared step times."""
    out = {
        f"{schedule} m={m} bubble": row["bubble"]
        for schedule, rows in result["bubble"].items()
        for m, row in rows.items()
    }
    out.update({f"{n} step_s": row["step_median_s"] for n, row in result["compared"].items()})
    return out


BENCHMARK = Benchmark(
    name="pipeline",
    summary="pipeline GPT step: GPipe / 1F1B bubble vs theory, shifted critical path, memory",
    describe=(
        "Pipeline-parallel steps of a small GPT over all ranks (pp = ranks, one thread per "
        "rank), timed from per-rank timelines of every stage forward, backward and "
        "recomputation. Bubble = mean over ranks of 1 − busy / makespan, against "
        "(p−1)/(m+p−1) for GPipe and 1F1B; step time of 1F1B with full recomputation vs "
        "Merak's shifted critical-path schedule; peak bytes of saved activations per stage "
        "(autograd's saved tensors, parameters excluded) for recompute none / full / "
        "stage-aware under 1F1B. With more ranks than cores, ranks slow each other down: the "
        "table gives each stage's busy time per micro-batch inside a GPipe step over its time "
        "alone."
    ),
    table=table,
    plot=plot,
    run_rank=run_rank,
    check=check,
    headline=headline,
    key_numbers=key_numbers,
    default_ranks=4,
    options={
        "vocab": 256,
        "seq_len": 128,
        "d_model": 256,
        "layers": 8,
        "heads": 4,
        "micro_batch": 4,
        "micro_batches": "4,8,16",
        "compare_micro_batches": 8,
        "steps": 3,
    },
    option_help={
        **GPT_OPTION_HELP,
        "micro_batch": "sequences per micro-batch",
        "micro_batches": "micro-batch counts per step of the bubble runs, comma-separated",
        "compare_micro_batches": "micro-batches per step of the recomputation comparison",
        "steps": "recorded steps per schedule, after one warm-up",
    },
)
