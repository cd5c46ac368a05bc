"""Analytical cost of one training step of a Plan: time per runtime op, and memory per device.

Every term is named after the runtime operation the comm meter (`interlace.comm`) records, as
`<group>.<op>` (`tp.all_reduce`, `dp.all_reduce`, `ep.all_to_all`, `ep_dp.all_reduce`, ...),
plus `compute`, `recompute`, `pp.bubble`, `pp.send_recv` and `optimizer`, so a prediction can
be set beside a measurement term by term. The terms are seconds on the critical path; they sum
to `step_seconds`. Parts hidden under computation are reported separately in `hidden`.
`estimate` sums `planner.step.step_terms`, which prices each parallel dimension in its own
module:

- work: `cost_work` (FLOPs of the partitioner's shards at the rows each matmul sees);
- tp (1D, Megatron, sequence parallel, sub-batches): `cost_tensor`;
- tp_x / tp_y / tp_z (3D, AxoNN, weight prefetch): `cost3d`;
- cp (the ring's K/V passes hidden under per-block attention, or the all-to-all's exchanges):
  `cost_context`; a rank computes and keeps T/cp tokens of each sequence;
- ep (dispatch/combine, load imbalance under `expert_skew`, `moe_balance` replicas):
  `cost_moe`;
- pp (stages, bubble, schedules, recomputation, boundary transfers): `cost_pipeline`;
- dp (dp_cp under cp) and ep_dp (gradient all-reduces, DDP's overlap): `cost_data`;
- the optimizer step: `cost_optimizer`.

**Collectives** (ring algorithm, `interlace.comm.wire_bytes` factors, `collective_cost`): a
collective over p ranks takes α·steps + wire_bytes / bandwidth, with steps = 2(p−1) for
all_reduce and p−1 for the others (one α per ring step). A group is inside a node when all its
ranks share one: in the mesh order (outermost first) pp, dp, tp, a group of `size` ranks whose
consecutive members are `stride` ranks apart spans size·stride consecutive ranks, inside a node
iff that is at most devices_per_node (tp: stride 1; dp and ep: stride tp; ep_dp: stride tp·ep;
pp: stride tp·dp; cp, between dp and tp, and dp_cp: stride tp).

**Memory** per device, the largest stage (`profile.stage_memory`): parameters ×
`bytes.state_bytes_per_param` (fp32 weight and gradient, two AdamW moments: 16 bytes, 12 with
bf16 moments), non-expert parameters divided by tp, expert parameters by tp·ep; activations:
the layers' saved elements per token (from the shards: under 1D TP the norms' inputs and each
block's shared producer input stay whole, the rest is divided by tp; all of it with sequence
parallel; a checkpointed layer keeps its d-wide input, divided by tp only with sequence
parallel) × tokens per micro-batch (T/cp of each sequence under context parallelism) ×
micro-batches in flight (`micro_batches_in_flight`: all m under GPipe,
≤ p − s under 1F1B) in the compute dtype, plus one layer's full activations as the working set
of a recomputation. Under 3D tensor parallelism the layers are split x·y·z (tokens over z), the
embedding and head only by z.

Not modelled yet: gradient compression (priced as dense), routing that differs between
devices or drifts between iterations (the skew is one fixed popularity), kernel efficiency
falling with narrow matmuls (tensor parallelism's widths: only rows, and on presets that
measured it the model's width, are modelled), and
contention between groups sharing a link.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from interlace.models.config import GPTConfig
from interlace.plan import Plan
from interlace.planner.bytes import activation_bytes
from interlace.planner.cost_pipeline import bubble_stage_times, pipeline_stages
from interlace.planner.gemm import shape_source
from interlace.planner.hardware import Hardware
from interlace.planner.profile import Stage, model_profile, stage_memory
from interlace.planner.step import StepTerms, step_terms


@dataclass(frozen=True)
class PlanCost:
    """The estimate for one plan: seconds per term (`breakdown`, summing to `step_seconds`),
    seconds hidden under compute per term (`hidden`), throughput and memory per device, and
    the expert-parallel details (`moe`, see `step.StepTerms`); under context parallelism
    `context`: `cp`, `tokens_per_sequence` (T/cp, what a device holds of each sequence) and
    `memory_without_cp` (bytes a device of the same layout would hold with whole sequences);
    `rates`: the figures the terms were priced with and where each came from (`priced_rates`)."""

    plan: Plan
    hardware: str
    n_devices: int
    global_batch: int
    seq_len: int
    breakdown: dict[str, float]
    hidden: dict[str, float]
    step_seconds: float
    tflops_per_device: float
    mfu: float
    memory_bytes_per_device: float
    memory: dict[str, float] = field(default_factory=dict)
    memory_limit_bytes: float = 0.0
    moe: dict[str, float] = field(default_factory=dict)
    context: dict[str, float] = field(default_factory=dict)
    rates: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """True when the estimated memory fits the device."""
        return self.memory_bytes_per_device <= self.memory_limit_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: the plan string and every number."""
        return {
            "plan": str(self.plan),
            "hardware": self.hardware,
            "n_devices": self.n_devices,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "step_seconds": self.step_seconds,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "memory_bytes_per_device": self.memory_bytes_per_device,
            "memory_limit_bytes": self.memory_limit_bytes,
            "breakdown": dict(self.breakdown),
            "hidden": dict(self.hidden),
            "memory": dict(self.memory),
            "moe": dict(self.moe),
            "context": dict(self.context),
            "rates": {kind: dict(rate) for kind, rate in self.rates.items()},
        }


def estimate(
    plan: Plan,
    config: GPTConfig,
    hardware: Hardware,
    global_batch: int,
    seq_len: int | None = None,
    dtype: str = "bf16",
    expert_skew: float = 0.0,
    optimizer_state: str = "fp32",
) -> PlanCost:
    """Estimate one optimizer step of `config` under `plan` on `hardware` with `global_batch`
    sequences of `seq_len` tokens (default: the config's), expert popularity Zipf with
    exponent `expert_skew` and AdamW's moments in `optimizer_state`'s dtype: `step_terms`,
    summed. The plan's tp may be 1D or 3D. Raises PlanError for a batch the plan cannot split
    or a bad skew."""
    terms = step_terms(
        plan, config, hardware, global_batch, seq_len, dtype, expert_skew, optimizer_state
    )
    breakdown, hidden = terms.breakdown()
    profile = terms.profile
    seq = profile.config.seq_len
    memory = _largest_stage_memory(
        terms.stages, plan, terms.tokens, dtype, profile.config, optimizer_state
    )
    step = sum(breakdown.values())
    n_devices = plan.world_size
    model_flops = 3 * profile.forward_flops_per_token * global_batch * seq
    tflops = model_flops / step / n_devices / 1e12
    return PlanCost(
        plan=plan,
        hardware=hardware.name,
        n_devices=n_devices,
        global_batch=global_batch,
        seq_len=seq,
        breakdown=breakdown,
        hidden=hidden,
        step_seconds=step,
        tflops_per_device=tflops,
        mfu=tflops * 1e12 / hardware.peak(dtype),
        memory_bytes_per_device=memory.pop("total"),
        memory=memory,
        memory_limit_bytes=hardware.memory_bytes,
        moe=dict(terms.moe),
        context=_context_summary(terms, dtype, optimizer_state),
        rates=priced_rates(hardware, dtype, terms),
    )


def priced_rates(hardware: Hardware, dtype: str, terms: StepTerms) -> dict[str, dict[str, Any]]:
    """Per kind of figure (`hardware.RATE_KINDS`), the values `terms` were priced with and
    their `source`: compute (FLOP/s of the slowest stage's matmuls, its share of the `dtype`
    peak, the factor their shapes cost on the device's SMs), links (α seconds and bytes/s
    inside and between nodes), overlap (the share of a hideable collective that hides), memory
    (bytes/s of the optimizer step)."""
    intra, inter = hardware.link(True), hardware.link(False)
    values: dict[str, dict[str, Any]] = {
        "compute": {
            "flops": terms.compute_rate,
            "of_peak": terms.compute_rate / hardware.peak(dtype),
            "dtype": dtype,
            "shape_factor": terms.shape_factor,
            "sms": hardware.sm_count,
            "shapes": shape_source(hardware, dtype),
        },
        "links": {
            "intra_latency": intra[0],
            "intra_bandwidth": intra[1],
            "inter_latency": inter[0],
            "inter_bandwidth": inter[1],
        },
        "overlap": {"efficiency": hardware.overlap_efficiency},
        "memory": {"bandwidth": hardware.memory_bandwidth},
    }
    return {kind: {**value, "source": hardware.source(kind)} for kind, value in values.items()}


def plan_memory(
    plan: Plan,
    config: GPTConfig,
    micro_batch_rows: int,
    dtype: str = "bf16",
    optimizer_state: str = "fp32",
) -> dict[str, float]:
    """Bytes per device of `config` under `plan` (its largest stage) for micro-batches of
    `micro_batch_rows` sequences with activations in `dtype` and AdamW's moments in
    `optimizer_state`'s: the memory part of `estimate`, with no hardware
    (`profile.stage_memory`'s parts and their `total`). Under context parallelism a rank holds
    1/cp of each sequence's tokens."""
    profile = model_profile(config)
    stages = pipeline_stages(profile, plan)
    tokens = micro_batch_rows * config.seq_len // plan.cp
    return _largest_stage_memory(stages, plan, tokens, dtype, config, optimizer_state)


def _context_summary(terms: StepTerms, dtype: str, optimizer_state: str) -> dict[str, float]:
    """What context parallelism buys: the tokens a device keeps of each sequence and the
    memory the same layout would need at cp = 1 (its `PlanCost.context`); empty without cp."""
    plan, config = terms.plan, terms.profile.config
    if not plan.context_parallel:
        return {}
    whole = _largest_stage_memory(
        terms.stages, plan, terms.tokens * plan.cp, dtype, config, optimizer_state
    )
    return {
        "cp": float(plan.cp),
        "tokens_per_sequence": float(config.seq_len // plan.cp),
        "memory_without_cp": whole["total"],
    }


def _largest_stage_memory(
    stages: tuple[Stage, ...],
    plan: Plan,
    tokens: int,
    dtype: str,
    config: GPTConfig,
    optimizer_state: str,
) -> dict[str, float]:
    v = plan.stages_per_rank
    act_bytes = activation_bytes(dtype)
    return max(
        (
            stage_memory(st, plan, tokens, act_bytes, config.d_model, s, v, optimizer_state)
            for s, st in enumerate(stages)
        ),
        key=lambda mem: mem["total"],
    )


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Share of a pipelined step spent idle: (p − 1)/(v·m + p − 1) (1F1B/GPipe v = 1), at
    least (p − m)/p (`cost_pipeline.bubble_stage_times`)."""
    bubble = bubble_stage_times(pp, micro_batches, virtual_stages)
    return bubble / (micro_batches + bubble) if pp > 1 else 0.0


__all__ = ["PlanCost", "bubble_fraction", "estimate", "plan_memory"]
