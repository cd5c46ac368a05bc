"""The `memory` benchmark's table, plot, headline and key numbers, from its JSON document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20
PARTS = ("parameters", "gradients", "optimizer", "activations")
"""The measured parts of a rank's memory, stacked in this order."""


KEPT = "reshard_after_forward=false"
"""FSDP keeping each block's gathered parameters from its forward to its backward (ZeRO-2's
traffic: no second gather; its memory: the gathered blocks)."""


def heaviest_rank(memory: dict[str, Any]) -> dict[str, int]:
    """The measured parts of the rank holding the most (of `PARTS` together) in a Trainer's
    memory report."""
    return max(memory["per_rank"], key=lambda rank: sum(rank[part] for part in PARTS))


def predicted_parts(memory: dict[str, Any]) -> dict[str, float]:
    """`plan_memory`'s estimate in the measured split: {"state": parameters + gradients +
    optimizer states, "activations": saved activations + recomputation working set + FSDP's
    gathered parameters}."""
    p = memory["predicted"]
    return {
        "state": p["params_grads_optimizer"],
        "activations": p["activations"] + p["recompute_working_set"] + p["fsdp_gathered"],
    }


def compared(result: dict[str, Any]) -> tuple[dict, dict, dict]:
    """The runs of dp=N (DDP), dp=N,recompute=full and dp_shard=N (FSDP) on N ranks."""
    n, runs = result["ranks"], result["plans"]
    return runs[f"dp={n}"], runs[f"dp={n},recompute=full"], runs[f"dp_shard={n}"]


def fsdp_over_ddp(result: dict[str, Any]) -> float:
    """FSDP's step time over DDP's (dp_shard=N against dp=N, no recomputation)."""
    ddp, _, fsdp = compared(result)
    return fsdp["step_s"] / ddp["step_s"]


def kept_over_ddp(result: dict[str, Any]) -> float | None:
    """The step time of FSDP keeping its gathered blocks through backward (dp_shard=N with
    KEPT) over DDP's, None where the result has no such run."""
    kept = result["plans"].get(f"dp_shard={result['ranks']},{KEPT}")
    return None if kept is None else kept["step_s"] / compared(result)[0]["step_s"]


def _state(rank: dict[str, int]) -> int:
    return rank["parameters"] + rank["gradients"] + rank["optimizer"]


def table(doc: dict[str, Any]) -> str:
    """One row per plan: the heaviest rank's parts and step peak, state and activations beside
    their prediction, step time beside its prediction, and the bytes rank 0's interface sent per
    step on a shaped link (MiB, seconds, MB)."""
    r = doc["result"]
    width = max(map(len, r["plans"]))
    lines = [
        f"model {doc['options']['model']} ({r['params'] / 1e6:.1f} M params, seq_len "
        f"{r['seq_len']}), global batch {doc['options']['global_batch']}; MiB per rank "
        "(the rank holding the most), predicted in brackets",
        f"{'plan':{width}s} {'params':>7s} {'grads':>7s} {'optim':>7s} {'state (pred)':>16s} "
        f"{'activ (pred)':>16s} {'peak':>7s} {'step s (pred)':>15s} {'sent MB':>8s}",
    ]
    for name, run in r["plans"].items():
        mine, pred = heaviest_rank(run["memory"]), predicted_parts(run["memory"])
        predicted_s, sent = run["predicted_step_s"], run["tx_bytes_per_step"]
        lines.append(
            f"{name:{width}s} {mine['parameters'] / MIB:7.1f} {mine['gradients'] / MIB:7.1f} "
            f"{mine['optimizer'] / MIB:7.1f} {_state(mine) / MIB:7.1f} "
            f"({pred['state'] / MIB:6.1f}) {mine['activations'] / MIB:7.1f} "
            f"({pred['activations'] / MIB:6.1f}) {mine['step_peak'] / MIB:7.1f} "
            f"{run['step_s']:6.3f} "
            + (f"({predicted_s:6.3f})" if predicted_s is not None else "(     -)")
            + (f" {sent / 1e6:8.1f}" if sent is not None else f" {'-':>8s}")
        )
    lines.append(f"FSDP step / DDP step at equal batch: {fsdp_over_ddp(r):.2f}x")
    if (kept := kept_over_ddp(r)) is not None:
        lines.append(f"FSDP keeping the gathered blocks through backward ({KEPT}): {kept:.2f}x")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Left: per plan, the heaviest rank's measured parts stacked beside the predicted state and
    activations; right: measured and predicted step time per plan."""
    from interlace.plotting import new_figure, save_figure

    runs = doc["result"]["plans"]
    names = list(runs)
    xs = range(len(names))
    fig, axes = new_figure(1, 2, figsize=(13, 4.8))
    mem_ax, time_ax = axes[0]
    bottom = [0.0] * len(names)
    for i, part in enumerate(PARTS):
        values = [heaviest_rank(runs[n]["memory"])[part] / MIB for n in names]
        mem_ax.bar([x - 0.2 for x in xs], values, 0.4, bottom=bottom, color=f"C{i}", label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    predicted = [predicted_parts(runs[n]["memory"]) for n in names]
    state = [p["state"] / MIB for p in predicted]
    mem_ax.bar([x + 0.2 for x in xs], state, 0.4, color="0.55", label="predicted state")
    mem_ax.bar(
        [x + 0.2 for x in xs],
        [p["activations"] / MIB for p in predicted],
        0.4,
        bottom=state,
        color="0.8",
        label="predicted activations",
    )
    mem_ax.set_ylabel("MiB per rank (left: measured, right: predicted)")
    time_ax.bar([x - 0.2 for x in xs], [runs[n]["step_s"] for n in names], 0.4, label="measured")
    time_ax.bar(
        [x + 0.2 for x in xs],
        [runs[n]["predicted_step_s"] or 0.0 for n in names],
        0.4,
        color="0.7",
        label="predicted",
    )
    time_ax.set_ylabel("seconds per step")
    env = doc["environment"]
    for ax, what in ((mem_ax, "memory per rank"), (time_ax, "step time")):
        ax.set_xticks(list(xs), names, rotation=25, ha="right", fontsize=7)
        ax.set_title(
            f"{what}, {doc['options']['model']}, {env['ranks']} ranks, {env['network']}",
            fontsize=9,
        )
        ax.legend(fontsize=7)
    save_figure(fig, path, dpi=110)


def headline(doc: dict[str, Any]) -> str:
    """FSDP's step against DDP's, its state per rank against DDP's, and full recomputation's
    activations against none's."""
    r = doc["result"]
    ddp, full, fsdp = compared(r)
    n = r["ranks"]
    state = _state(heaviest_rank(fsdp["memory"])) / _state(heaviest_rank(ddp["memory"]))
    activations = (
        heaviest_rank(full["memory"])["activations"] / heaviest_rank(ddp["memory"])["activations"]
    )
    kept = kept_over_ddp(r)
    keeping = "" if kept is None else f"; {kept:.2f}x keeping the gathered blocks ({KEPT})"
    return (
        f"FSDP's step {fsdp['step_s']:.3f} s vs DDP's {ddp['step_s']:.3f} s at equal batch, "
        f"{fsdp_over_ddp(r):.2f}x (target <= 1.15x{keeping}); FSDP keeps {state:.3f} of DDP's "
        "state per "
        f"rank (1/{n} = {1 / n:.3f}); full recomputation keeps {activations:.2f}x the "
        "activations of none under DDP"
    )


def key_numbers(result: dict[str, Any]) -> dict[str, float]:
    """Each plan's step time and FSDP's ratio to DDP."""
    numbers = {f"{name} step_s": run["step_s"] for name, run in result["plans"].items()}
    return {**numbers, "fsdp/ddp": fsdp_over_ddp(result)}
