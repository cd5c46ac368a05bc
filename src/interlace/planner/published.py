"""Published large-run throughput, priced by the cost model under each run's own layout.

The tables live in `published_data/`, one TOML file per source: `[source]` (its name,
repository, and a note on where each field comes from and what the source leaves unstated),
`[defaults]` shared by its rows, and `[[rows]]`. A row holds

- the model: layers, hidden, heads, kv_heads (default heads), ffn, gated (SwiGLU), vocab, seq,
  tied (embedding and output layer), bias;
- the layout: gpus, global_batch (sequences per step) and the stated Plan fields among
  `PLAN_FIELDS`; the hardware preset (`planner.hardware`);
- the published figure: `tokens_per_gpu_s`, or `tflops_per_gpu` with `flops` naming how the
  source counts FLOPs ("megatron": `megatron_flops_per_token`);
- where it comes from: url, commit, section;
- how the run differs from what interlace's runtime would run under that layout, where the
  source says (`as_ran`, each term's change to the estimate): `recomputed_matmuls`, the share
  of the forward's matmuls its backward runs again (torchtitan's op-level selective
  checkpointing: 0.5; interlace's `selective` replays none), that share of the forward's
  compute on top; `overlapped`, the groups whose collectives the run hides under compute
  (Megatron-LM's --tp-comm-overlap: "tp"; --overlap-grad-reduce, with pp > 1 too: "dp"),
  their exposed terms removed; `sharded_optimizer`, each data-parallel rank stepping 1/dp of
  the parameters (Megatron-LM's distributed optimizer), the optimizer term divided by dp;
  `compiled` (default true), false for a row run eagerly, which the summaries leave out (the
  GPU presets price compiled steps).

A row is priced by `cost.estimate` as `shape(row)` under its stated layout. Fields the source
leaves unstated are the cost model's fastest choice: no recomputation, and with pp > 1 the
micro-batch count (a power of two dividing a data-parallel rank's sequences, or all of them),
the schedule (`search.SEARCH_SCHEDULES`) and, interleaved, its stages per rank (each count
of at least 2 that divides a rank's layers, as Megatron-LM's layers per virtual stage must).
Memory does not constrain that choice (the published run ran); the predicted memory is
reported beside.

**Sign convention.** error = predicted tokens/s per GPU / published − 1: positive when the
planner is too optimistic (it predicts a faster run than was measured), negative when it is
too pessimistic.
"""

from __future__ import annotations

import itertools
import statistics
import tomllib
from collections.abc import Iterator
from dataclasses import replace
from importlib.resources import files
from typing import Any

from interlace.errors import ConfigError, PlanError
from interlace.models.config import GPTConfig
from interlace.plan import Plan
from interlace.planner.cost import PlanCost, estimate
from interlace.planner.hardware import GIB, get_hardware
from interlace.planner.search import SEARCH_SCHEDULES, check_plan, power_of_two_divisors

PLAN_FIELDS = (
    "dp",
    "dp_shard",
    "pp",
    "tp",
    "cp",
    "sequence_parallel",
    "recompute",
    "schedule",
    "virtual_stages",
    "micro_batches",
)
"""Row fields that are Plan fields, taken as stated."""
SOURCE_FIELDS = ("url", "commit", "section")
"""Row fields naming where the row comes from; every row has all three."""


def load_tables() -> dict[str, dict[str, Any]]:
    """Every data file, by file name without `.toml`: {"source": its [source] table, "rows":
    its rows, each with the file's [defaults] under it}. ConfigError for a row without a
    source field or with both or neither published figure."""
    tables = {}
    folder = files("interlace.planner").joinpath("published_data")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".toml"):
            continue
        data = tomllib.loads(entry.read_text(encoding="utf-8"))
        defaults = data.get("defaults", {})
        rows = [{**defaults, **row} for row in data["rows"]]
        for row in rows:
            _check_row(entry.name, row)
        tables[entry.name.removesuffix(".toml")] = {"source": data["source"], "rows": rows}
    return tables


def _check_row(file: str, row: dict[str, Any]) -> None:
    missing = [k for k in SOURCE_FIELDS if not row.get(k)]
    if missing:
        raise ConfigError(f"{file}: row {row.get('name')!r} has no {', '.join(missing)}")
    figures = [k for k in ("tokens_per_gpu_s", "tflops_per_gpu") if k in row]
    if len(figures) != 1:
        raise ConfigError(
            f"{file}: row {row['name']!r} needs one published figure, tokens_per_gpu_s or "
            f"tflops_per_gpu (with flops), not {figures or 'none'}"
        )


def shape(row: dict[str, Any]) -> GPTConfig:
    """The GPTConfig the cost model prices for `row`'s model: its width, depth, heads and
    key/value heads, feed-forward width, vocabulary, sequence, tying and biases; a gated row
    (SwiGLU) is of Llama's family and priced in its shape (RMSNorm, rotary positions)."""
    llama = {"norm": "rmsnorm", "feed_forward": "swiglu", "position_encoding": "rotary"}
    return GPTConfig(
        vocab_size=row["vocab"],
        seq_len=row["seq"],
        d_model=row["hidden"],
        n_layers=row["layers"],
        n_heads=row["heads"],
        n_kv_heads=row.get("kv_heads"),
        d_ff=row["ffn"],
        bias=row["bias"],
        tie_embeddings=row["tied"],
        **(llama if row["gated"] else {}),
    )


def megatron_flops_per_token(row: dict[str, Any]) -> float:
    """FLOPs per token (forward and backward) of `row`'s model as Megatron-LM counts them
    (`num_floating_point_operations` in megatron/training/training.py, commit f2e5db4):
    12·L·h²·(1 + kv_heads/heads + s/h + (ffn/h)·(3/2 if gated) + V/(2·L·h))."""
    layers, h, s = row["layers"], row["hidden"], row["seq"]
    kv = row.get("kv_heads", row["heads"]) / row["heads"]
    mlp = row["ffn"] / h * (1.5 if row["gated"] else 1.0)
    return 12 * layers * h * h * (1 + kv + s / h + mlp + row["vocab"] / (2 * layers * h))


def published_tokens_per_gpu_s(row: dict[str, Any]) -> float:
    """The row's published throughput in tokens per second per GPU: as published, or its
    TFLOP/s per GPU over the source's FLOPs per token."""
    if "tokens_per_gpu_s" in row:
        return float(row["tokens_per_gpu_s"])
    if row.get("flops") != "megatron":
        raise ConfigError(
            f'row {row["name"]!r}: tflops_per_gpu needs flops = "megatron" (the only FLOP '
            f"count known), not {row.get('flops')!r}"
        )
    return row["tflops_per_gpu"] * 1e12 / megatron_flops_per_token(row)


def layouts(row: dict[str, Any]) -> Iterator[Plan]:
    """The Plans of `row`'s layout: its stated fields, and each choice of the unstated
    micro-batch count, schedule and interleaved stages per rank where pp > 1 (recomputation
    unstated: none)."""
    stated = {k: row[k] for k in PLAN_FIELDS if k in row}
    base = Plan(**stated)
    if base.pp == 1:
        yield base
        return
    per_rank = row["global_batch"] // base.dp_size
    counts = sorted({*power_of_two_divisors(per_rank, per_rank), per_rank})
    counts = [stated["micro_batches"]] if "micro_batches" in stated else counts
    schedules = [stated["schedule"]] if "schedule" in stated else SEARCH_SCHEDULES
    per_rank_layers = row["layers"] // base.pp
    for m, schedule in itertools.product(counts, schedules):
        stage_counts = [base.virtual_stages]
        if schedule == "interleaved" and "virtual_stages" not in stated:
            stage_counts = [v for v in range(2, per_rank_layers + 1) if per_rank_layers % v == 0]
        for v in stage_counts:
            yield replace(base, micro_batches=m, schedule=schedule, virtual_stages=v)


def price(row: dict[str, Any]) -> PlanCost:
    """The estimate of the fastest of `layouts(row)` as the row ran it (`as_ran`) among those
    that are valid Plans of `shape(row)` on the row's GPUs, on its hardware preset; PlanError
    naming the row when none is."""
    spec = shape(row)
    hardware = get_hardware(row["hardware"])
    costs = []
    for plan in layouts(row):
        try:
            check_plan(plan, row["gpus"], spec)
        except PlanError:
            continue
        costs.append(estimate(plan, spec, hardware, row["global_batch"]))
    if not costs:
        raise PlanError(f"row {row['name']!r}: no valid plan of its layout on {row['gpus']} GPUs")
    return min(costs, key=lambda c: c.step_seconds + sum(as_ran(row, c).values()))


def as_ran(row: dict[str, Any], cost: PlanCost) -> dict[str, float]:
    """Seconds to add to `cost` (the estimate of interlace's runtime under `row`'s layout) per
    way the source's run differs from it (module docstring; negative: the run saves them)."""
    breakdown = cost.breakdown
    changes = {}
    if row.get("recomputed_matmuls"):
        changes["recomputed_matmuls"] = row["recomputed_matmuls"] * breakdown["compute"] / 3
    overlapped = set(row.get("overlapped", ()))
    if cost.plan.schedule != "interleaved":
        overlapped.discard("pp")  # Megatron-LM overlaps its transfers only when interleaved
    for name, seconds in breakdown.items():
        if name.partition(".")[0] in overlapped and name != "pp.bubble":  # idle, not a transfer
            changes[name] = -seconds
    if row.get("sharded_optimizer") and "optimizer" in breakdown:
        changes["optimizer"] = -breakdown["optimizer"] * (1 - 1 / cost.plan.dp_size)
    return changes


def relative_error(predicted: float, published: float) -> float:
    """predicted / published − 1 of two throughputs: > 0 when the prediction is faster."""
    return predicted / published - 1


def compare(row: dict[str, Any]) -> dict[str, Any]:
    """`row` priced: its plan, predicted and published tokens/s per GPU, the relative error
    (`relative_error`), predicted MFU, memory (GiB per GPU) and whether it fits, whether it ran
    compiled, the step's terms (with the matmuls a row recomputes beyond interlace's mode), and
    its source."""
    cost = price(row)
    changes = as_ran(row, cost)
    tokens_per_gpu = row["global_batch"] * row["seq"] / row["gpus"]  # per step
    predicted = tokens_per_gpu / (cost.step_seconds + sum(changes.values()))
    published = published_tokens_per_gpu_s(row)
    return {
        "name": row["name"],
        "gpus": row["gpus"],
        "hardware": row["hardware"],
        "plan": str(cost.plan),
        "global_batch": row["global_batch"],
        "seq_len": row["seq"],
        "published_tokens_per_gpu_s": published,
        "published_figure": {k: row[k] for k in ("tokens_per_gpu_s", "tflops_per_gpu") if k in row},
        "predicted_tokens_per_gpu_s": predicted,
        "error": relative_error(predicted, published),
        "predicted_mfu": cost.mfu,
        "memory_gib": cost.memory_bytes_per_device / GIB,
        "fits": cost.fits,
        "compiled": row.get("compiled", True),
        "breakdown": dict(cost.breakdown),
        "as_ran": changes,
        "interlace_tokens_per_gpu_s": tokens_per_gpu / cost.step_seconds,
        "source": {k: row[k] for k in SOURCE_FIELDS},
    }


def summarize(errors: list[float]) -> dict[str, float]:
    """Of a table's relative errors: rows, median |error|, the worst (largest |error|, with
    its sign), median signed error, rows over (error > 0) and under (< 0)."""
    return {
        "rows": len(errors),
        "median_abs_error": statistics.median(abs(e) for e in errors),
        "worst_error": max(errors, key=abs),
        "median_error": statistics.median(errors),
        "over": sum(e > 0 for e in errors),
        "under": sum(e < 0 for e in errors),
    }


__all__ = [
    "PLAN_FIELDS",
    "SOURCE_FIELDS",
    "as_ran",
    "compare",
    "layouts",
    "load_tables",
    "megatron_flops_per_token",
    "price",
    "published_tokens_per_gpu_s",
    "relative_error",
    "shape",
    "summarize",
]
