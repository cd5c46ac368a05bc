"""`published`: the planner against published large-run throughput, under each run's layout.

No process is started: every row of the selected tables in `planner/published_data/` is priced
by `planner.published.compare` (its model and stated layout on a hardware preset) and set
beside the tokens/s per GPU the source published. error = predicted / published − 1: positive
when the planner is too optimistic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from interlace.bench.base import Benchmark, check_names
from interlace.planner.published import compare, load_tables, summarize


def run_local(options: dict[str, Any]) -> dict[str, Any]:
    """Every row of the selected tables priced (`compare`, plus its table's name), and per
    table its source and error summary (`summarize`) over its compiled rows (the presets
    price compiled steps; eager rows are listed, not summarised)."""
    rows, tables = [], {}
    for name, table in load_tables().items():
        if name not in options["tables"].split(","):
            continue
        priced = [{"table": name, **compare(row)} for row in table["rows"]]
        rows.extend(priced)
        tables[name] = {
            "source": table["source"]["name"],
            "repository": table["source"]["repository"],
            **summarize([r["error"] for r in priced if r["compiled"]]),
        }
    return {"rows": rows, "tables": tables}


def _summary_line(name: str, t: dict[str, Any]) -> str:
    return (
        f"{name} ({t['source']}): {t['rows']} rows, median |error| "
        f"{t['median_abs_error']:.0%}, worst {t['worst_error']:+.0%}, median "
        f"{t['median_error']:+.0%}; {t['over']} over, {t['under']} under"
    )


def table(doc: dict[str, Any]) -> str:
    """One line per row (plan, published and predicted tokens/s per GPU, error, predicted
    memory), then one summary line per table."""
    result = doc["result"]
    lines = [
        f"{'table':12s} {'row':28s} {'GPUs':>5s} {'plan (priced)':79s} {'published':>9s} "
        f"{'predicted':>9s} {'err':>5s} {'GiB':>4s}"
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['table']:12s} {r['name']:28s} {r['gpus']:5d} {r['plan']:79s} "
            f"{r['published_tokens_per_gpu_s']:9.0f} {r['predicted_tokens_per_gpu_s']:9.0f} "
            f"{r['error']:+5.0%} {r['memory_gib']:4.0f}" + ("" if r["compiled"] else "  (eager)")
        )
    lines.append(
        "tokens/s per GPU; err = predicted / published - 1 (> 0: planner too optimistic); "
        "eager rows are left out of the summaries"
    )
    lines.extend(_summary_line(name, t) for name, t in result["tables"].items())
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """The relative error of each row, one colour per table, with ±10% marked."""
    from matplotlib.patches import Patch

    from interlace.plotting import new_figure, save_figure

    rows = doc["result"]["rows"]
    tables = list(doc["result"]["tables"])
    fig, ax = new_figure(figsize=(max(7, 0.5 * len(rows)), 4))
    ax.bar(
        range(len(rows)),
        [100 * r["error"] for r in rows],
        color=[f"C{tables.index(r['table'])}" for r in rows],
    )
    ax.axhline(0, color="k", linewidth=0.8)
    for level in (-10, 10):
        ax.axhline(level, color="0.5", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["name"] for r in rows], rotation=40, ha="right", fontsize=7)
    ax.set_ylabel("predicted / published - 1 (%)")
    ax.set_title("planner vs published throughput, each run's own layout", fontsize=9)
    sources = [doc["result"]["tables"][name]["source"] for name in tables]
    ax.legend(
        handles=[Patch(color=f"C{i}", label=source) for i, source in enumerate(sources)],
        fontsize=7,
    )
    save_figure(fig, path)


def check(options: dict[str, Any]) -> None:
    """`tables` names only data files of `planner/published_data/`."""
    check_names(options, "tables", load_tables())


def headline(doc: dict[str, Any]) -> str:
    """Each table's median and worst relative error and how many rows the planner over- and
    under-predicts."""
    return "; ".join(
        f"{t['source']}: median |error| {t['median_abs_error']:.0%}, worst "
        f"{t['worst_error']:+.0%}, {t['over']} of {t['rows']} rows over and {t['under']} under"
        for t in doc["result"]["tables"].values()
    )


BENCHMARK = Benchmark(
    name="published",
    summary="the planner against published large-run throughput, each under its own layout",
    describe=(
        "The planner (no processes) on published large runs: Megatron-LM's H100 weak scaling "
        "table of GPT models (1.7B on 48 GPUs to 462B on 6144) and torchtitan's bf16 Llama 3.1 "
        "8B and 70B rows (8 to 256 H100s). Each row's model and stated layout (tp, pp, dp, FSDP, "
        "sequence parallelism, recomputation, global batch) is priced by `planner.cost.estimate` "
        "on the dgx-h100 preset; what a source leaves unstated is the fastest choice as the "
        "run ran it (micro-batches, schedule and the interleaved schedule's stages per rank; "
        "no recomputation). Where the source ran the layout otherwise than interlace's runtime "
        "would, the estimate is changed term by term as it ran (`planner.published.as_ran`: "
        "Megatron-LM's tensor-parallel and gradient overlaps, its interleaved schedule's "
        "overlapped boundary transfers and distributed optimizer, torchtitan's op-level "
        "checkpointing replaying every second matmul); the JSON keeps interlace's own figure "
        "beside. Eager rows are listed and "
        "left out of the summaries (the preset prices compiled steps). The sources, commits and "
        "every assumption are in `src/interlace/planner/published_data/`. Error = predicted "
        "tokens/s "
        "per GPU / published − 1 (> 0: the planner is too optimistic). Predictions, not "
        "measurements. "
        "AxoNN's 80B GPT at 57% of peak and picotron's Llama 7B at 38% MFU are not priced: "
        "no layout or batch for those runs was found in their repositories."
    ),
    table=table,
    plot=plot,
    run_local=run_local,
    check=check,
    headline=headline,
    options={"tables": "megatron_lm,torchtitan"},
    option_help={"tables": "data files priced, comma-separated: megatron_lm, torchtitan"},
)
