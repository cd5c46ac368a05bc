"""The `cp` benchmark's table, plot, headline and key numbers, from its JSON document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20


def _degrees(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(cp): row for cp, row in doc["result"]["degrees"].items()}


def activation_ratio(doc: dict[str, Any], cp: int) -> float:
    """Activations per rank at `cp` over cp = 1's, at the benchmark's sequence length."""
    rows = _degrees(doc)
    return rows[cp]["memory"]["activations"] / rows[1]["memory"]["activations"]


def longest_ratio(doc: dict[str, Any], cp: int) -> float:
    """The longest sequence under the cap at `cp` over cp = 1's."""
    rows = _degrees(doc)
    return rows[cp]["longest"]["longest"] / rows[1]["longest"]["longest"]


def table(doc: dict[str, Any]) -> str:
    """One row per cp degree: activations and step peak at the sequence length, their ratio to
    cp = 1, the longest sequence under the cap, the ring's times and hidden share, the zig-zag
    balance."""
    result = doc["result"]
    lines = [
        f"sequence {result['seq_len']} tokens, cap {result['cap_bytes'] / MIB:.1f} MiB "
        f"(cp=1's step peak); ring attention at {doc['options']['tokens_per_rank']} tokens/rank",
        f"{'cp':>3} {'activ MiB':>10} {'x cp=1':>7} {'peak MiB':>9} {'longest':>8} "
        f"{'ring s':>8} {'math s':>8} {'xfer s':>8} {'hidden':>7} {'balance':>8}",
    ]
    for cp, row in sorted(_degrees(doc).items()):
        memory, ring = row["memory"], row["ring"]
        times = (
            f"{ring['as_run_s']:8.4f} {ring['math_s']:8.4f} {ring['transfer_s']:8.4f} "
            f"{ring['hidden']:7.0%}"
            if ring
            else f"{'-':>8} {'-':>8} {'-':>8} {'-':>7}"
        )
        lines.append(
            f"{cp:>3} {memory['activations'] / MIB:10.1f} {activation_ratio(doc, cp):7.2f} "
            f"{memory['step_peak'] / MIB:9.1f} {row['longest']['longest']:>8} {times} "
            f"{row['work_balance']:8.3f}"
        )
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Left: activations per rank and the longest sequence, each over cp = 1's, against cp,
    with the 1/cp and cp limits. Right: the ring's time as run, its math and its transfers."""
    from interlace.plotting import new_figure, save_figure

    rows = _degrees(doc)
    cps = sorted(rows)
    fig, axes = new_figure(cols=2, figsize=(10, 4))
    left, right = axes[0]
    left.plot(cps, [activation_ratio(doc, cp) for cp in cps], "o-", label="activations / cp=1")
    left.plot(cps, [1 / cp for cp in cps], "k:", label="1/cp")
    left.plot(cps, [longest_ratio(doc, cp) for cp in cps], "s-", label="longest seq / cp=1")
    left.plot(cps, cps, "k--", label="cp")
    left.set_xlabel("cp")
    left.set_xticks(cps)
    left.legend(fontsize=7)
    ringed = [cp for cp in cps if rows[cp]["ring"]]
    width = 0.25
    for i, (key, label) in enumerate(
        (("as_run_s", "as run"), ("math_s", "math alone"), ("transfer_s", "transfers alone"))
    ):
        right.bar(
            [c + (i - 1) * width for c in range(len(ringed))],
            [rows[cp]["ring"][key] for cp in ringed],
            width,
            label=label,
        )
    right.set_xticks(range(len(ringed)), [f"cp={cp}" for cp in ringed])
    right.set_ylabel("s per forward + backward")
    right.legend(fontsize=7)
    fig.suptitle(f"context parallelism, sequence {doc['result']['seq_len']}", fontsize=9)
    save_figure(fig, path, dpi=110)


def headline(doc: dict[str, Any]) -> str:
    """The claim: activations per rank, longest sequence and hidden ring share at the largest cp."""
    rows = _degrees(doc)
    top = max(rows)
    ring = rows[top]["ring"]
    return (
        f"cp={top}: activations per rank {activation_ratio(doc, top):.2f}x cp=1's at "
        f"{doc['result']['seq_len']} tokens, longest sequence under cp=1's peak "
        f"{longest_ratio(doc, top):.1f}x, ring transfer {ring['hidden']:.0%} hidden at "
        f"{doc['options']['tokens_per_rank']} tokens per rank"
    )


def key_numbers(result: dict[str, Any]) -> dict[str, float]:
    """The ring's times and each degree's activations, whose spread tells reproducibility."""
    numbers = {}
    for cp, row in result["degrees"].items():
        numbers[f"cp={cp} activations"] = float(row["memory"]["activations"])
        if row["ring"]:
            numbers[f"cp={cp} ring_s"] = row["ring"]["as_run_s"]
    return numbers
