"""Cost terms of pipeline parallelism (`plan.pp`), for `planner.step.step_terms`.

The stages are the partitioner's balance of the layers (`profile.stages_of`) with each rank's
checkpoint ratios as the runtime derives them from `plan.recompute`
(`parallel.pipeline.recompute.recompute_ratios`), and the interleaved schedule runs the
plan's virtual stages per rank (`Plan.stages_per_rank`).
The slowest stage sets the pace.

A micro-batch's time on the slowest stage T_mb (compute, recompute, tp and ep) runs m times,
and the bubble adds (p − 1)/v · T_mb (GPipe and 1F1B v = 1), i.e. a bubble fraction
(p − 1)/(v·m + p − 1), but at least (p − m) · T_mb (`bubble_stage_times`): with fewer
micro-batches than stages (the interleaved schedule allows it) one micro-batch still passes
every rank in turn, so no step is shorter than p · T_mb; while the bubble leaves devices
idle, the busy ones compute `hardware.idle_speedup` times faster (CPU ranks sharing cores).
The shifted schedule moves the recomputation of the last min(m, p − 1) micro-batches into
the bubble. `pp.send_recv`: each micro-batch's boundary activation forward and its gradient
backward, 2·(v·m + p − 1) transfers, at least the 2·(p·v − 1) of one micro-batch's way through
every stage (`boundary_transfers`), not overlapped (an upper bound). The pp group holds
ranks tp · dp apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from interlace.parallel.pipeline.recompute import recompute_ratios
from interlace.plan import Plan
from interlace.planner.collective_cost import group_inside_node
from interlace.planner.hardware import Hardware
from interlace.planner.profile import ModelProfile, Stage, stages_of


def pipeline_stages(profile: ModelProfile, plan: Plan) -> tuple[Stage, ...]:
    """The plan's pp stages of `profile`, checkpointed as the runtime checkpoints them."""
    ratios = recompute_ratios(plan.recompute, plan.pp)
    return stages_of(profile, plan.pp, ratios, plan.recompute == "selective")


def bubble_stage_times(pp: int, micro_batches: int, virtual_stages: int) -> float:
    """The bubble in micro-batch stage times T_mb: max((p − 1)/v, p − m) (module docstring)."""
    return max((pp - 1) / virtual_stages, pp - micro_batches)


def boundary_transfers(pp: int, micro_batches: int, virtual_stages: int) -> int:
    """Stage-boundary transfers on a step's critical path: 2·max(v·m + p − 1, p·v − 1)."""
    v = virtual_stages
    return 2 * max(v * micro_batches + pp - 1, pp * v - 1)


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
    v = plan.stages_per_rank
    if pp == 1:
        return PipelineTerms(v, m, 0.0)
    recompute_runs = m - min(m, pp - 1) if plan.schedule == "shifted" else m
    inside = group_inside_node(pp, plan.tp_size * plan.dp_size, hardware.devices_per_node)
    alpha, bandwidth = hardware.link(inside)
    return PipelineTerms(v, recompute_runs, alpha + tokens * d * act_bytes / bandwidth)
