"""Cost terms of pipeline parallelism (`plan.pp`), for `planner.step.step_terms`.

The stages are the partitioner's balance of the layers (`profile.stages_of`) with each rank's
checkpoint ratios as the runtime derives them from `plan.recompute`
(`parallel.pipeline.recompute.recompute_ratios`), and the interleaved schedule runs the
runtime's default virtual stages per rank (`parallel.pipeline.schedule.virtual_stages_for`).
The slowest stage sets the pace.

A micro-batch's time on the slowest stage T_mb (compute, recompute, tp and ep) runs m times,
and the bubble adds (p − 1)/v · T_mb (GPipe and 1F1B v = 1), i.e. a bubble fraction
(p − 1)/(v·m + p − 1); while the bubble leaves devices idle, the busy ones compute
`hardware.idle_speedup` times faster (CPU ranks sharing cores). The shifted schedule moves the
recomputation of the last min(m, p − 1) micro-batches into the bubble. `pp.send_recv`: each
micro-batch's boundary activation forward and its gradient backward, 2·(v·m + p − 1)
transfers, not overlapped (an upper bound). The pp group holds ranks tp · dp apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from interlace.parallel.pipeline.options import virtual_stages_for
from interlace.parallel.pipeline.recompute import recompute_ratios
from interlace.plan import Plan
from interlace.planner.collective_cost import group_inside_node
from interlace.planner.hardware import Hardware
from interlace.planner.profile import ModelProfile, Stage, stages_of


def pipeline_stages(profile: ModelProfile, plan: Plan) -> tuple[Stage, ...]:
    """The plan's pp stages of `profile`, checkpointed as the runtime checkpoints them."""
    ratios = recompute_ratios(plan.recompute, plan.pp)
    return stages_of(profile, plan.pp, ratios, plan.recompute == "selective")


@dataclass(frozen=True)
class PipelineTerms:
    """What the pipeline adds to a step: `virtual_stages` per rank (v), the micro-batches whose
    recomputation stays on the critical path (`recompute_runs`), and the seconds of one
    boundary transfer (`send_recv_one`, 0 without a pipeline)."""

    virtual_stages: int
    recompute_runs: int
    send_recv_one: float


def pipeline_terms(
    plan: Plan, tokens: int, d: int, act_bytes: int, hardware: Hardware
) -> PipelineTerms:
    """The pipeline terms of `plan` for micro-batches of `tokens` tokens whose boundary
    activation is [tokens, d] at `act_bytes` bytes per element (see the module docstring)."""
    pp, m = plan.pp, plan.micro_batches
    v = virtual_stages_for(plan.schedule, None)
    if pp == 1:
        return PipelineTerms(v, m, 0.0)
    recompute_runs = m - min(m, pp - 1) if plan.schedule == "shifted" else m
    inside = group_inside_node(pp, plan.tp_size * plan.dp_size, hardware.devices_per_node)
    alpha, bandwidth = hardware.link(inside)
    return PipelineTerms(v, recompute_runs, alpha + tokens * d * act_bytes / bandwidth)
