"""`seeds`: each seed paper's headline gain, predicted by the cost model at the paper's own
setting (the technique on against the baseline it was compared with) beside the published one
(`bench/seed_settings.py` holds the settings, their sources and every assumption). No process
is started: these are predictions on hardware presets, which a 2-core CPU cluster could not
show at 32 to 1024 GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from interlace.bench.base import Benchmark, check_names
from interlace.bench.seed_settings import ROWS, TOLERANCE


def run_local(options: dict[str, Any]) -> dict[str, Any]:
    """Every comparison of the selected groups (`seed_settings.ROWS`)."""
    rows = [r for group in options["groups"].split(",") for r in ROWS[group]()]
    return {"rows": rows}


def _published(r: dict[str, Any]) -> str:
    low, high = r["published"]
    return f"{low:.2f}x" if low == high else f"{low:.2f}-{high:.2f}x"


def table(doc: dict[str, Any]) -> str:
    """One line per comparison: both plans, the predicted and published gains, agreement,
    and the term that differs most."""
    lines = [
        f"{'seed':8s} {'setting':32s} {'technique plan':56s} {'baseline plan':50s} "
        f"{'pred':>6s} {'published':>10s} {'off':>5s}  largest saving"
    ]
    for r in doc["result"]["rows"]:
        term, seconds = next(iter(r["saved_seconds"].items()))
        share = seconds / r["baseline"]["step_seconds"]
        lines.append(
            f"{r['group']:8s} {r['name']:32s} {r['technique']['plan']:56s} "
            f"{r['baseline']['plan']:50s} {r['gain']:5.2f}x {_published(r):>10s} "
            f"{r['error']:+5.0%}{' ' if r['within'] else '*'} {term} {share:+.0%} of the baseline"
        )
    lines.append(
        f"pred = baseline step / technique step; off = how far the prediction lies from the "
        f"published gain (or range); * beyond ±{TOLERANCE:.0%}"
    )
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Predicted against published gain per comparison, with the published range as a bar."""
    from interlace.plotting import new_figure, save_figure

    rows = doc["result"]["rows"]
    fig, ax = new_figure(figsize=(max(7, 0.45 * len(rows)), 4))
    x = range(len(rows))
    low = [r["published"][0] for r in rows]
    high = [r["published"][1] for r in rows]
    ax.bar(x, [h - lo for lo, h in zip(low, high, strict=True)], 0.6, bottom=low, color="0.8",
           label="published (range)")  # fmt: skip
    ax.scatter(x, low, color="0.4", marker="_", s=200)
    ax.scatter(x, [r["gain"] for r in rows], color="C0", zorder=3, label="predicted")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r['group']}: {r['name']}" for r in rows], rotation=60, ha="right",
                       fontsize=6)  # fmt: skip
    ax.set_ylabel("gain over the paper's baseline")
    ax.set_title("seed papers' gains: predicted at their settings vs published", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def check(options: dict[str, Any]) -> None:
    """`groups` names only known seed groups."""
    check_names(options, "groups", ROWS)


def headline(doc: dict[str, Any]) -> str:
    """Per seed, how many predictions agree with the published gain within the tolerance."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in doc["result"]["rows"]:
        groups.setdefault(r["group"], []).append(r)
    return "; ".join(
        f"{g}: {sum(r['within'] for r in rs)} of {len(rs)} within ±{TOLERANCE:.0%} "
        f"(predicted {_span([r['gain'] for r in rs])})"
        for g, rs in groups.items()
    )


def _span(gains: list[float]) -> str:
    low, high = min(gains), max(gains)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


BENCHMARK = Benchmark(
    name="seeds",
    summary="the seed papers' gains predicted at their own settings beside the published ones",
    describe=(
        "The cost model (no processes) at each seed paper's setting, the technique on against "
        "the baseline the paper compared with, under interlace's own schedules: Oases' "
        "sub-batched tensor parallelism against Megatron-LM on its seven GPTs (32 RTX 3090s, "
        "4 per server, no NVLink; published in its repository's figure), Merak's shifted "
        "schedule, stage-aware recomputation and sub-pipelined tensor parallelism against "
        "Megatron-style 3D with full recomputation (GPT 1.5B-20B on 64 RTX 3090s), AxoNN's 3D "
        "tensor x data layout against Megatron-style (80B on 1024 Perlmutter A100s), and "
        "Pro-Prophet against FasterMoE's shadowing and dropless DeepSpeed-MoE (MoE-GPTs on 16 "
        "and 32 RTX 3090s, Zipf-1 expert popularity). Gain = the baseline's predicted step / "
        "the technique's; agreement within ±25% of the published gain (of a range's ends). "
        "Settings, sources and assumptions: src/interlace/bench/seed_settings.py. "
        "Predictions, not measurements."
    ),
    table=table,
    plot=plot,
    run_local=run_local,
    check=check,
    headline=headline,
    options={"groups": ",".join(ROWS)},
    option_help={"groups": f"seed papers compared, comma-separated: {', '.join(ROWS)}"},
)
