"""The expert load heat-map of a training run: tokens each rank computes in each MoE layer,
under the base placement (every token at its expert's owner) and under the balanced one.

The numbers come from the metrics rows' `moe` entries (`ExpertParallelMoE.balance_summary`:
per layer, `tokens_base` and `tokens`, [D] tokens computed per rank of rank 0's expert group,
derived from that step's routed count matrix). The map is their mean over the run's steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from interlace.plotting import new_figure, save_figure

PANELS = (
    ("tokens_base", "balance_degree_base", "base placement"),
    ("tokens", "balance_degree", "balanced placement"),
)


def load_map(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """{steps, tokens_base, tokens, balance_degree_base, balance_degree}: over the metric `rows`
    that carry per-layer loads, the mean tokens computed per rank ([layers][D] each) and the
    mean of each step's balance degree ([layers] each); None when no row carries loads (no
    expert parallelism)."""
    steps = [r["moe"] for r in rows if r.get("moe") and all("tokens" in m for m in r["moe"])]
    if not steps:
        return None
    out: dict[str, Any] = {"steps": len(steps)}
    layers = range(len(steps[0]))
    for key, degree, _ in PANELS:
        out[key] = [
            [
                sum(values) / len(steps)
                for values in zip(*(s[layer][key] for s in steps), strict=True)
            ]
            for layer in layers
        ]
        out[degree] = [sum(s[layer][degree] for s in steps) / len(steps) for layer in layers]
    return out


def plot_load_map(load: dict[str, Any], file: Path, title: str) -> None:
    """Two heat-maps side by side (rows = MoE layers, columns = ranks, colour = mean tokens
    computed), base and balanced placement on one colour scale, to a PNG. Raises ImportError
    without matplotlib."""
    layers, devices = len(load["tokens"]), len(load["tokens"][0])
    top = max(max(row) for key, _, _ in PANELS for row in load[key]) or 1.0
    fig, axes = new_figure(1, 2, figsize=(4 + 1.2 * devices, 1.6 + 0.5 * layers))
    for ax, (key, degree, label) in zip(axes.reshape(-1), PANELS, strict=True):
        image = ax.imshow(load[key], cmap="viridis", vmin=0, vmax=top, aspect="auto")
        for layer, row in enumerate(load[key]):
            for device, value in enumerate(row):
                shade = "black" if value > 0.6 * top else "white"
                ax.text(device, layer, f"{value:.0f}", ha="center", va="center", color=shade)
        std = sum(load[degree]) / layers
        ax.set_title(f"{label}: balance degree {std:.0f} (mean per step)", fontsize=9)
        ax.set_xticks(range(devices))
        ax.set_yticks(range(layers))
        ax.set_xlabel("rank in the expert group")
        ax.set_ylabel("MoE layer")
    fig.colorbar(image, ax=axes.reshape(-1)[-1], label="tokens computed per step (mean)")
    fig.suptitle(f"{title} · mean over {load['steps']} steps", fontsize=9)
    save_figure(fig, file, dpi=110)
