"""The `moe` benchmark's presentation: its table, chart, headline and key numbers, read from
the result that `interlace.bench.moe.run_rank` returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from interlace.plotting import new_figure, save_figure

TARGETS = {"balance_vs_shadow": 5.0, "speedup_vs_dropless": 1.3, "speedup_vs_shadow": 1.1}


def _configs(result: dict[str, Any]):
    for name, entry in result["workloads"].items():
        for key, value in entry.items():
            if key.startswith("top"):
                yield name, key, value


def table(doc: dict[str, Any]) -> str:
    """One block per workload and top-k, one row per strategy."""
    r = doc["result"]
    cal = r["calibration"]
    lines = [
        f"calibrated: B = {cal['bandwidth_Bps'] / 1e6:.1f} MB/s per rank (all_to_all), "
        f"t = {cal['throughput_tokens_per_s']:.0f} tokens/s (expert forward); model mean "
        f"relative error {r['model_error']['mean_relative_error']:.1%} over "
        f"{r['model_error']['count']} layers" + _paper_error(r["model_error"]),
    ]
    for name, key, value in _configs(r):
        lines.append(f"{name} {key}:")
        lines.append(
            f"  {'strategy':18s} {'balance':>8s} {'max/mean':>8s} {'dropped':>8s} "
            f"{'a2a MB':>7s} {'Trans MB':>8s} {'plan ms':>7s} {'step s':>7s} {'layer s':>8s} "
            f"{'model s':>8s}"
        )
        for s, m in value["strategies"].items():
            modelled = "-" if m["model_layer_s"] is None else f"{m['model_layer_s']:.4f}"
            lines.append(
                f"  {s:18s} {m['balance_degree']:8.1f} {m['max_mean_load']:8.2f} "
                f"{m['dropped_fraction']:8.1%} {m['all_to_all_bytes'] / 1e6:7.2f} "
                f"{m['trans_bytes'] / 1e6:8.2f} {m['plan_s_per_step'] * 1e3:7.1f} "
                f"{m['step_median_s']:7.3f} "
                f"{m['layer_s']:8.4f} {modelled:>8s}"
            )
        for t, v in value["targets"].items():
            shown = "perfect" if v["value"] is None else f"{v['value']:.2f}x"
            lines.append(
                f"  {t}: {shown} (target {v['target']}x, {'met' if v['met'] else 'not met'})"
            )
    skipped = r["peers"]["deepspeed_moe"].get("skipped")
    if skipped:
        lines.append(skipped)
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Step time and balance degree per strategy, for every workload and top-k."""
    configs = list(_configs(doc["result"]))
    fig, axes = new_figure(1, 2, figsize=(11, 3.8))
    axes = list(axes.reshape(-1))
    width = 0.8 / max(len(configs), 1)
    for i, (name, key, value) in enumerate(configs):
        strategies = list(value["strategies"])
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(strategies))]
        for ax, metric in zip(axes, ("step_median_s", "balance_degree"), strict=True):
            ax.bar(
                xs,
                [value["strategies"][s][metric] for s in strategies],
                width,
                label=f"{name} {key}",
            )
            ax.set_xticks(range(len(strategies)), strategies)
    axes[0].set_ylabel("step seconds (slowest rank, median)")
    axes[1].set_ylabel("balance degree (std of tokens per device)")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"MoE load balancing, ep={doc['environment']['ranks']}, {doc['environment']['network']}",
        fontsize=9,
    )
    save_figure(fig, path, dpi=100)


def headline(doc: dict[str, Any]) -> str:
    """Prophet vs shadow and dropless per workload and top-k, and the model's error."""
    parts = []
    for name, key, value in _configs(doc["result"]):
        t = value["targets"]
        if not t:
            continue
        shown = {n: "perfect" if v["value"] is None else f"{v['value']:.2f}x" for n, v in t.items()}
        balance = shown.get("balance_vs_shadow", "-")
        balance = "perfect (std 0)" if balance == "perfect" else f"{balance} shadow's"
        strategies = value["strategies"]
        peer = ""
        if "deepspeed_drop" in strategies and "prophet" in strategies:
            mine = strategies["prophet"]["step_median_s"]
            peer = ", DeepSpeed-MoE {:.2f}x with drops / {:.2f}x dropless".format(
                strategies["deepspeed_drop"]["step_median_s"] / mine,
                strategies["deepspeed_dropless"]["step_median_s"] / mine,
            )
        parts.append(
            f"{name} {key}: prophet balance {balance} (target 5x shadow's), "
            f"step {shown.get('speedup_vs_dropless', '-')} dropless (1.3x), "
            f"{shown.get('speedup_vs_shadow', '-')} shadow (1.1x){peer}"
        )
    error = doc["result"]["model_error"]
    return (
        "; ".join(parts)
        + f"; performance model error {error['mean_relative_error']:.0%}"
        + _paper_error(error)
    )


def _paper_error(error: dict[str, Any]) -> str:
    """' (Pro-Prophet's terms alone: x%)' when the result has it, else ''."""
    paper = error.get("paper_mean_relative_error")
    return "" if paper is None else f" (Pro-Prophet's terms alone: {paper:.0%})"


def key_numbers(result: dict[str, Any]) -> dict[str, float]:
    """Step time of every strategy on every workload and top-k."""
    return {
        f"{name} {key} {s} step_s": m["step_median_s"]
        for name, key, value in _configs(result)
        for s, m in value["strategies"].items()
    }


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def targets(strategies: dict[str, Any]) -> dict[str, Any]:
    """Prophet's three ratios against `TARGETS` from the strategies' figures: each
    {value, target, met}; empty without prophet."""
    p = strategies.get("prophet")
    out: dict[str, Any] = {}
    if p is None:
        return out
    pairs = {
        "balance_vs_shadow": ("shadow", "balance_degree"),
        "speedup_vs_dropless": ("dropless", "step_median_s"),
        "speedup_vs_shadow": ("shadow", "step_median_s"),
    }
    for name, (other, key) in pairs.items():
        if other not in strategies:
            continue
        value = _ratio(strategies[other][key], p[key])
        met = value is None or value >= TARGETS[name]  # None: prophet perfectly balanced
        out[name] = {"value": value, "target": TARGETS[name], "met": met}
    return out
