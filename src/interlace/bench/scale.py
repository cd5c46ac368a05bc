"""`scale`: the planner at the papers' scale, beside the layouts and results they report.

No process is started: each setting is priced by `planner.search` on a hardware preset.
Settings (REFERENCE.md §1, §3, §4):

- **axonn**: the 80B GPT on 1024 Perlmutter A100-40GB, global batch 2048 × 2048 tokens. Beside
  the planner's pick, the best Megatron-style layout it finds (tp = devices per node, pipeline
  across nodes, 1F1B or interleaved), and AxoNN's published 57% of peak, 26% faster than
  Megatron-LM (so Megatron-LM ≈ 45%).
- **merak**: GPT 1.5B / 2.5B / 8.3B / 20B on 64 RTX 3090s (8 per node, 100 Gb/s IB), global
  batch 256. Beside the pick, the best Megatron-style layout with full recomputation (how the
  large models fit 24 GB), and Merak's published speedups over the best 3D framework
  (1.42×, 1.39×, 1.43×, 1.61×).
- **prophet**: MoE-GPTs on 16 and 32 RTX 3090s, one expert per device, top-1, 8 sequences of
  1024 tokens per device. Pro-Prophet names its models only by range (12–24 layers, hidden
  512–2048); S/M/L here are 12 layers d=512, 12 layers d=1024 and 24 layers d=2048. Beside the
  pick, plain expert parallelism over every device (ep = devices). Its published 1.36–2.66×
  over DeepSpeed-MoE comes from load imbalance, which the cost model does not price (it
  assumes balanced experts), so no published figure is compared there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from interlace.bench.base import Benchmark
from interlace.errors import ConfigError, PlanError
from interlace.models.config import GPTConfig
from interlace.models.presets import get_preset
from interlace.planner.cost import PlanCost
from interlace.planner.hardware import get_hardware
from interlace.planner.search import check_plan, pad_vocab, search

MERAK_SPEEDUPS = {"gpt2-1.5b": 1.42, "megatron-2.5b": 1.39, "megatron-8.3b": 1.43, "gpt-20b": 1.61}
"""Merak's reported speedup over the fastest 3D framework, per model (64 GPUs)."""
AXONN_PEAK_FRACTION = 0.57
"""AxoNN's reported fraction of peak for the 80B GPT on 1024 Perlmutter A100s."""
AXONN_VS_MEGATRON = 1.26
"""AxoNN's reported speedup over Megatron-LM in that setting."""
PROPHET_SIZES = {"S": (12, 512), "M": (12, 1024), "L": (24, 2048)}
"""MoE-GPT (layers, hidden) read for Pro-Prophet's S/M/L (see the module docstring)."""


@dataclass(frozen=True)
class Setting:
    """One priced setting: model, hardware, devices, batch, the baseline's filter and the
    published comparison (None where the paper gives none that the model can check)."""

    group: str
    name: str
    spec: GPTConfig
    hardware: str
    devices: int
    global_batch: int
    is_baseline: Callable[[PlanCost], bool]
    baseline: str
    published: dict[str, float] | None


def megatron_tp(per_node: int, heads: int) -> int:
    """Megatron's tensor parallel degree: the largest power of two up to the devices per node
    that divides the head count."""
    tp = 1
    while tp * 2 <= per_node and heads % (tp * 2) == 0:
        tp *= 2
    return tp


def _megatron_style(tp: int, recompute: str | None = None) -> Callable[[PlanCost], bool]:
    """Megatron's usual layout: the given in-node tp, pipeline across nodes, (interleaved)
    1F1B, optionally a given recomputation."""

    def accept(cost: PlanCost) -> bool:
        plan = cost.plan
        return (
            plan.tp == tp
            and plan.schedule in ("1f1b", "interleaved")
            and plan.overlap.tp_subbatches == 1
            and not plan.sequence_parallel
            and (recompute is None or plan.recompute == recompute)
        )

    return accept


def _all_experts_parallel(devices: int) -> Callable[[PlanCost], bool]:
    def accept(cost: PlanCost) -> bool:
        return cost.plan.ep == devices and cost.plan.tp == 1 and cost.plan.pp == 1

    return accept


def settings() -> list[Setting]:
    """Every setting of the benchmark, in page order."""
    axonn = pad_vocab(get_preset("axonn-80b"), 128)
    out = [
        Setting(
            "axonn",
            "axonn-80b",
            axonn,
            "perlmutter",
            1024,
            2048,
            _megatron_style(
                megatron_tp(get_hardware("perlmutter").devices_per_node, axonn.n_heads)
            ),
            "Megatron-style (tp=4 in node, pp across nodes)",
            {"fraction_of_peak": AXONN_PEAK_FRACTION, "speedup": AXONN_VS_MEGATRON},
        )
    ]
    per_node = get_hardware("rtx3090-ib").devices_per_node
    for name, speedup in MERAK_SPEEDUPS.items():
        spec = pad_vocab(get_preset(name), 128)
        tp = megatron_tp(per_node, spec.n_heads)
        out.append(
            Setting(
                "merak",
                name,
                spec,
                "rtx3090-ib",
                64,
                256,
                _megatron_style(tp, "full"),
                f"Megatron-style (tp={tp} in node, pp across nodes, full recompute)",
                {"speedup": speedup},
            )
        )
    for devices in (16, 32):
        for size, (layers, hidden) in PROPHET_SIZES.items():
            spec = GPTConfig(
                vocab_size=50304,
                seq_len=1024,
                d_model=hidden,
                n_layers=layers,
                n_heads=hidden // 64,
                n_experts=devices,
                top_k=1,
                moe_every=1,
            )
            out.append(
                Setting(
                    "prophet",
                    f"moe-gpt-{size} on {devices}",
                    spec,
                    "rtx3090-ib",
                    devices,
                    8 * devices,
                    _all_experts_parallel(devices),
                    f"expert parallel over all {devices} devices (ep={devices})",
                    None,
                )
            )
    return out


def _summary(cost: PlanCost | None, spec: GPTConfig) -> dict[str, Any] | None:
    if cost is None:
        return None
    try:
        check_plan(cost.plan, cost.n_devices, spec, runnable_only=True)
        runnable = True
    except PlanError:
        runnable = False
    return {
        "plan": str(cost.plan),
        "runnable": runnable,
        "step_seconds": cost.step_seconds,
        "tflops_per_device": cost.tflops_per_device,
        "mfu": cost.mfu,
        "memory_gib": cost.memory_bytes_per_device / 2**30,
        "breakdown": dict(cost.breakdown),
    }


def run_local(options: dict[str, Any]) -> dict[str, Any]:
    """Search every selected setting; best plan, best baseline plan, published figures."""
    rows = []
    for s in settings():
        if s.group not in options["groups"].split(","):
            continue
        ranked = search(s.spec, get_hardware(s.hardware), s.devices, s.global_batch)
        baseline = next((c for c in ranked if s.is_baseline(c)), None)
        best = ranked[0]
        rows.append(
            {
                "group": s.group,
                "name": s.name,
                "params_b": s.spec.num_params() / 1e9,
                "hardware": s.hardware,
                "devices": s.devices,
                "global_batch": s.global_batch,
                "seq_len": s.spec.seq_len,
                "plans_fitting": len(ranked),
                "best": _summary(best, s.spec),
                "baseline_name": s.baseline,
                "baseline": _summary(baseline, s.spec),
                "speedup_vs_baseline": (
                    baseline.step_seconds / best.step_seconds if baseline is not None else None
                ),
                "published": s.published,
            }
        )
    return {"settings": rows}


def _published(row: dict[str, Any]) -> str:
    pub = row["published"]
    if pub is None:
        return "-"
    parts = []
    if "fraction_of_peak" in pub:
        parts.append(f"{pub['fraction_of_peak']:.0%} of peak")
    parts.append(f"{pub['speedup']:.2f}x")
    return ", ".join(parts)


def table(doc: dict[str, Any]) -> str:
    """One row per setting: the pick, its MFU and memory, the baseline and the speedups."""
    lines = [
        f"{'setting':22s} {'pick':58s} {'MFU':>5s} {'GiB':>5s} {'base MFU':>8s} "
        f"{'ours/base':>9s} {'published':>16s}"
    ]
    for row in doc["result"]["settings"]:
        best, base = row["best"], row["baseline"]
        speed = row["speedup_vs_baseline"]
        base_mfu = "-" if base is None else f"{base['mfu']:.1%}"
        ours = "-" if speed is None else f"{speed:.2f}x"
        pick = best["plan"] + ("" if best["runnable"] else " *")
        lines.append(
            f"{row['name']:22s} {pick:58s} {best['mfu']:5.1%} {best['memory_gib']:5.1f} "
            f"{base_mfu:>8s} {ours:>9s} {_published(row):>16s}"
        )
    names = dict.fromkeys(r["baseline_name"] for r in doc["result"]["settings"])
    lines.append("baselines: " + "; ".join(names))
    lines.append("* a combination interlace does not run yet (priced by the model only)")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Predicted MFU of the pick and of the baseline per setting (and AxoNN's published)."""
    from interlace.plotting import new_figure, save_figure

    rows = doc["result"]["settings"]
    names = [r["name"] for r in rows]
    fig, ax = new_figure(figsize=(max(7, 0.9 * len(rows)), 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["best"]["mfu"] for r in rows], 0.4, label="planner's pick")
    ax.bar(
        [i + 0.2 for i in x],
        [r["baseline"]["mfu"] if r["baseline"] else 0 for r in rows],
        0.4,
        label="baseline layout",
    )
    for i, r in enumerate(rows):
        pub = r["published"] or {}
        if "fraction_of_peak" in pub:
            ax.scatter([i], [pub["fraction_of_peak"]], color="k", marker="*", zorder=3)
            ax.annotate("AxoNN published", (i, pub["fraction_of_peak"]), fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("predicted MFU")
    ax.set_title("planner at paper scale (predicted)", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def check(options: dict[str, Any]) -> None:
    """`groups` names only known settings groups."""
    known = {"axonn", "merak", "prophet"}
    unknown = set(options["groups"].split(",")) - known
    if unknown:
        raise ConfigError(
            f"groups {sorted(unknown)} unknown; choose from {','.join(sorted(known))}"
        )


def headline(doc: dict[str, Any]) -> str:
    """The 80B pick against Megatron-style and AxoNN's published figures."""
    rows = {r["name"]: r for r in doc["result"]["settings"]}
    axonn = rows.get("axonn-80b")
    if axonn is None:
        return "paper-scale picks (see table)"
    base = axonn["baseline"]
    return (
        f"80B GPT on 1024 Perlmutter A100s: the planner picks {axonn['best']['plan']} at a "
        f"predicted {axonn['best']['mfu']:.0%} of peak; the best Megatron-style layout is "
        f"predicted at {base['mfu']:.0%}; AxoNN published 57% of peak, 1.26x Megatron-LM"
    )


BENCHMARK = Benchmark(
    name="scale",
    summary="the planner's picks at paper scale beside Megatron-style layouts and papers",
    describe=(
        "The planner (no processes) on the papers' settings: the 80B GPT on 1024 Perlmutter "
        "A100s (AxoNN), GPT 1.5B–20B on 64 RTX 3090s (Merak) and MoE-GPTs on 16 and 32 RTX "
        "3090s (Pro-Prophet). For each, the fastest plan that fits, a baseline layout searched "
        "under the same model, and the published figure where one can be checked. These are "
        "predictions on nominal hardware presets, not measurements."
    ),
    table=table,
    plot=plot,
    run_local=run_local,
    check=check,
    headline=headline,
    options={"groups": "axonn,merak,prophet"},
    option_help={"groups": "settings priced, comma-separated: axonn, merak, prophet"},
)
