"""The seed papers' headline comparisons, priced by the cost model at each paper's own setting:
the technique on against the baseline the paper compares with, under the runtime's own
schedules (`planner.cost.estimate`; no process is started). What each paper published and
where it is read from:

- **oases** (Oases, lucasleesw/oases at commit 9331a2c513401f48bc5677ed2dd908f9c693dde9: its
  README and figures/performance_no_nvlink.png, the values printed on the bars): seven GPTs
  (hidden 1024–12288, 24 to 4 layers, heads of 64, sequence 1024, no vocabulary projection)
  under tensor × data parallelism on 32 RTX 3090s in servers of 4 without NVLink (its
  scripts: 4 GPUs per server, micro-batch 4, 20 accumulated per step), Oases' normalised
  throughput over Megatron-LM's: 1.53, 1.95, 1.78, 1.73, 1.67, 1.71, 1.81. Oases = sub-batched
  tensor parallelism (`tp_subbatches=2`) with recomputation that reuses the forward's
  all-reduces (interlace's `recompute=full`); Megatron-LM = plain tensor parallelism with full
  recomputation, which repeats each layer's two forward all-reduces (priced as run: that share
  of the tp all-reduce term added). Each at its fastest tp that fits.
- **merak** (REFERENCE.md §1): GPT 1.5B–20B on 64 RTX 3090s, global batch 256, up to 1.42×,
  1.39×, 1.43×, 1.61× over the 3D frameworks. Baseline = the fastest Megatron-style 3D layout
  under 1F1B with full recomputation (Merak's starting point) and no sharding; Merak = the same
  layout with the shifted schedule, stage-aware recomputation and sub-pipelined tensor
  parallelism (`tp_subbatches=2` where tp > 1).
- **axonn** (REFERENCE.md §3): the 80B GPT on 1024 Perlmutter A100s, global batch 2048, 26%
  faster than Megatron-LM. AxoNN = the fastest layout with 3D tensor parallelism (tp3d × data;
  the search splits a step into micro-batches under a pipeline, so its fastest tp3d layouts
  have one where AxoNN accumulated gradients instead); Megatron-LM = the fastest
  Megatron-style layout (`bench scale`'s baseline).
- **prophet** (REFERENCE.md §4): MoE-GPTs S/M/L (as `bench scale`) on 16 and 32 RTX 3090s, one
  expert per device, top-1, expert popularity Zipf with exponent 1 (the top 3 of 16 experts
  then take 54% of the tokens; the paper: over 50%). Pro-Prophet's published 1.01–1.5× over
  FasterMoE (`shadow`) and 1.36–2.66× over DeepSpeed-MoE, a range over its models: a
  prediction inside [0.75 · low, 1.25 · high] is within. DeepSpeed-MoE is priced dropless (every
  token computed, as the runs compared computed every token); with its capacity drops, it
  would compute fewer tokens, not the same step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from interlace.bench.scale import Setting, settings
from interlace.errors import PlanError
from interlace.models.config import GPTConfig
from interlace.plan import Plan
from interlace.planner.cost import PlanCost, estimate
from interlace.planner.hardware import Hardware, get_hardware
from interlace.planner.search import MEMORY_FRACTION, search

OASES_GAINS = {
    (1024, 24): 1.53,
    (2048, 24): 1.95,
    (3072, 24): 1.78,
    (4096, 16): 1.73,
    (6144, 16): 1.67,
    (8192, 8): 1.71,
    (12288, 4): 1.81,
}
"""(hidden, layers) → Oases' throughput over Megatron-LM's, 32 RTX 3090s without NVLink."""
OASES_MICRO_BATCH, OASES_ACCUMULATED = 4, 20
PROPHET_SKEW = 1.0
PROPHET_VS_FASTERMOE = (1.01, 1.5)
PROPHET_VS_DEEPSPEED = (1.36, 2.66)
TOLERANCE = 0.25
"""A predicted gain within ±25% of the published one (of a published range's ends) agrees."""


def agreement(gain: float, published: tuple[float, float]) -> float:
    """Relative distance of `gain` from the published range [low, high] (a single figure: low
    = high): 0 inside it, else gain / the nearer end − 1."""
    low, high = published
    return gain / min(max(gain, low), high) - 1


def row(
    group: str, name: str, technique: PlanCost, baseline: PlanCost, published: tuple
) -> dict[str, Any]:
    """One comparison: both plans' figures, the predicted gain (baseline step / technique
    step), the published gain (or range), their agreement and the terms that differ most."""
    gain = baseline.step_seconds / technique.step_seconds
    error = agreement(gain, published)
    terms = set(technique.breakdown) | set(baseline.breakdown)
    saved = {t: baseline.breakdown.get(t, 0.0) - technique.breakdown.get(t, 0.0) for t in terms}
    return {
        "group": group,
        "name": name,
        "technique": _summary(technique),
        "baseline": _summary(baseline),
        "gain": gain,
        "published": list(published),
        "error": error,
        "within": abs(error) <= TOLERANCE,
        "saved_seconds": dict(sorted(saved.items(), key=lambda kv: -abs(kv[1]))[:3]),
    }


def _summary(cost: PlanCost) -> dict[str, Any]:
    return {
        "plan": str(cost.plan),
        "step_seconds": cost.step_seconds,
        "mfu": cost.mfu,
        "memory_gib": cost.memory_bytes_per_device / 2**30,
        "breakdown": dict(cost.breakdown),
    }


def oases_hardware() -> Hardware:
    """Oases' cluster: the rtx3090-ib preset's devices and links, 4 to a server (its scripts),
    each server's 100 Gb/s shared by its 4."""
    preset = get_hardware("rtx3090-ib")
    return dataclasses.replace(
        preset, name="rtx3090-ib, 4 per node", devices_per_node=4,
        inter_node_bandwidth=preset.inter_node_bandwidth * 2,
    )  # fmt: skip


def _fits(cost: PlanCost) -> bool:
    """Whether `cost`'s plan fits in the share of device memory `search` allows a plan."""
    return cost.memory_bytes_per_device <= MEMORY_FRACTION * cost.memory_limit_bytes


def _fastest(costs: Iterator[PlanCost]) -> PlanCost:
    fitting = [c for c in costs if _fits(c)]
    if not fitting:
        raise PlanError("no layout of the comparison fits the device memory")
    return min(fitting, key=lambda c: c.step_seconds)


def _megatron_replays_reductions(cost: PlanCost, layers: int) -> PlanCost:
    """`cost` with Megatron-LM's full recomputation repeating each layer's two forward tp
    all-reduces (interlace's replay reuses them): 2·L more of the term's 4·L + 2."""
    reduce = cost.breakdown["tp.all_reduce"]
    extra = reduce * 2 * layers / (4 * layers + 2)
    breakdown = {**cost.breakdown, "tp.all_reduce": reduce + extra}
    slower = cost.step_seconds / (cost.step_seconds + extra)
    return dataclasses.replace(
        cost,
        step_seconds=cost.step_seconds + extra,
        breakdown=breakdown,
        tflops_per_device=cost.tflops_per_device * slower,
        mfu=cost.mfu * slower,
    )


def oases_rows() -> list[dict[str, Any]]:
    """Oases against Megatron-LM on each of its seven GPTs (see the module docstring)."""
    rows = []
    for (hidden, layers), published in OASES_GAINS.items():
        spec = GPTConfig(
            vocab_size=128, seq_len=1024, d_model=hidden, n_layers=layers, n_heads=hidden // 64
        )
        oases = _fastest(_oases_setting(spec, "recompute=full,tp_subbatches=2"))
        megatron = _fastest(
            _megatron_replays_reductions(c, layers) for c in _oases_setting(spec, "recompute=full")
        )
        rows.append(row("oases", f"H={hidden} L={layers}", oases, megatron, (published,) * 2))
    return rows


def _oases_setting(spec: GPTConfig, options: str, devices: int = 32) -> Iterator[PlanCost]:
    """`spec` priced under tp × dp = `devices` for every tp from 2 (with the plan `options`),
    Oases' batch: 4 sequences per micro-batch, 20 micro-batches a step per data replica."""
    hardware = oases_hardware()
    for tp in (2, 4, 8, 16, 32):
        dp = devices // tp
        plan = Plan.parse(f"dp={dp},tp={tp},micro_batches={OASES_ACCUMULATED},{options}")
        yield estimate(plan, spec, hardware, OASES_MICRO_BATCH * OASES_ACCUMULATED * dp)


def merak_rows() -> list[dict[str, Any]]:
    """Merak against the fastest Megatron-style 1F1B + full recomputation layout, per model."""
    rows = []
    for s in settings():
        if s.group != "merak":
            continue
        hardware = get_hardware(s.hardware)
        for baseline in search(s.spec, hardware, s.devices, s.global_batch):
            if not _checkpointed_3d(baseline.plan):
                continue
            merak = _merak(baseline.plan, s.spec, hardware, s.global_batch)
            if merak is not None:
                published = (s.published["speedup"],) * 2
                rows.append(row("merak", s.name, merak, baseline, published))
                break
    return rows


def _checkpointed_3d(plan: Plan) -> bool:
    """Megatron-style 3D as Merak starts from: pp > 1 under 1F1B, full recomputation, plain
    tensor parallelism, no sharding."""
    return (
        plan.pp > 1
        and plan.schedule == "1f1b"
        and plan.recompute == "full"
        and plan.dp_shard == 1
        and plan.tp3d is None
        and not plan.sequence_parallel
        and plan.overlap.tp_subbatches == 1
    )


def _merak(plan: Plan, spec: GPTConfig, hardware: Hardware, batch: int) -> PlanCost | None:
    """`plan` with Merak's three techniques, priced; None where its micro-batches cannot be
    split in two for the sub-pipelined tensor parallelism or it does not fit."""
    overlap = dataclasses.replace(plan.overlap, tp_subbatches=2 if plan.tp > 1 else 1)
    merak = dataclasses.replace(plan, schedule="shifted", recompute="stage-aware", overlap=overlap)
    try:
        cost = estimate(merak, spec, hardware, batch)
    except PlanError:
        return None
    return cost if _fits(cost) else None


def axonn_rows() -> list[dict[str, Any]]:
    """AxoNN's 3D tensor × data layout against the fastest Megatron-style one, 80B GPT."""
    s = next(s for s in settings() if s.group == "axonn")
    ranked = search(s.spec, get_hardware(s.hardware), s.devices, s.global_batch)
    axonn = next(c for c in ranked if c.plan.tp3d is not None)
    megatron = next(c for c in ranked if s.is_baseline(c))
    published = (s.published["speedup"],) * 2
    return [row("axonn", s.name, axonn, megatron, published)]


def prophet_rows() -> list[dict[str, Any]]:
    """Pro-Prophet against FasterMoE's shadowing and dropless DeepSpeed-MoE, per model."""
    rows = []
    for s in settings():
        if s.group != "prophet":
            continue
        prophet = _balanced(s, "prophet")
        for balance, label, published in (
            ("shadow", "FasterMoE", PROPHET_VS_FASTERMOE),
            ("dropless", "DeepSpeed-MoE", PROPHET_VS_DEEPSPEED),
        ):
            rows.append(row("prophet", f"{s.name} vs {label}", prophet, _balanced(s, balance),
                            published))  # fmt: skip
    return rows


def _balanced(s: Setting, balance: str) -> PlanCost:
    """Setting `s` under one expert per device (ep = dp = devices) balanced by `balance`."""
    plan = Plan.parse(f"dp={s.devices},ep={s.devices},moe_balance={balance}")
    hardware = get_hardware(s.hardware)
    return estimate(plan, s.spec, hardware, s.global_batch, expert_skew=PROPHET_SKEW)


ROWS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "oases": oases_rows,
    "merak": merak_rows,
    "axonn": axonn_rows,
    "prophet": prophet_rows,
}
"""Each group's comparisons, in page order."""
