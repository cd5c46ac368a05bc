"""The pipeline layout of a Plan: which layers and which recomputation every stage gets.

One function decides it for both the runtime (`PipelineRunner`) and the planner / CLI
(`interlace plan --show-stages`), so what is shown is what runs:

1. checks the schedule can run (`schedule.check_schedule`); v = virtual stages per rank;
2. per-rank checkpoint ratios from `plan.recompute` (or an explicit list);
3. partitions the layers over pp · v stages, balancing training FLOPs with those ratios
   (or the user's layer counts / split points).

With a memory budget (stage-aware only): stage 0's ratio r0 is the smallest that fits on the
partition full recomputation would give; Merak's formula spreads it to the other ranks; the
layers are partitioned with those ratios; finally any rank still estimated over the budget
raises its ratio to the smallest that fits (PlanError if none does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from interlace.errors import ConfigError, PlanError
from interlace.parallel.pipeline.options import check_schedule
from interlace.parallel.pipeline.partition import (
    Partition,
    describe_stages,
    micro_batches_in_flight,
    model_shards,
    partition,
)
from interlace.parallel.pipeline.recompute import ratio_for_budget, recompute_ratios
from interlace.plan import Plan


@dataclass(frozen=True)
class PipelineLayout:
    """Stage partition plus the checkpoint ratio of each pipeline rank."""

    plan: Plan
    partition: Partition
    virtual_stages: int
    rank_ratios: tuple[float, ...]

    @property
    def n_stages(self) -> int:
        """Stages in all: pp · virtual_stages (stage s runs on rank s mod pp)."""
        return self.plan.pp * self.virtual_stages

    @property
    def stage_ratios(self) -> list[float]:
        """Checkpoint ratio of every (virtual) stage: that of the rank running it."""
        return [self.rank_ratios[s % self.plan.pp] for s in range(self.n_stages)]

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stage indices pipeline rank `pp_rank` runs, in order."""
        return [pp_rank + k * self.plan.pp for k in range(self.virtual_stages)]

    def describe(self, micro_batch_tokens: int = 1) -> str:
        """`describe_stages` table for micro-batches of `micro_batch_tokens` tokens (rows · T)."""
        return describe_stages(
            self.partition,
            pp=self.plan.pp,
            schedule=self.plan.schedule,
            micro_batches=self.plan.micro_batches,
            micro_batch_tokens=micro_batch_tokens,
            recompute_ratios=self.stage_ratios,
        )


def pipeline_layout(
    model: nn.Module,
    plan: Plan,
    *,
    layers_per_stage: Sequence[int] | None = None,
    split_points: Sequence[str] | None = None,
    recompute: Sequence[float] | None = None,
    memory_budget_bytes: float | None = None,
    micro_batch_tokens: int | None = None,
) -> PipelineLayout:
    """Lay `model` (any decoder `partition` understands; `meta` device is fine) out over
    `plan.pp` ranks under `plan.schedule` and `plan.recompute` (see the module docstring).
    `recompute` (one ratio per rank) overrides `plan.recompute`; `memory_budget_bytes` (per
    rank) needs `micro_batch_tokens`. Raises PlanError naming the fix for any impossible
    combination."""
    v = plan.stages_per_rank
    n_layers = len(model_shards(model)) - 2
    check_schedule(plan.schedule, plan.pp, plan.micro_batches, n_layers, v)
    mode = plan.recompute if recompute is None else recompute

    def split(rank_ratios: Sequence[float]) -> Partition:
        n_stages = plan.pp * v
        return partition(
            model,
            n_stages,
            layers_per_stage=layers_per_stage,
            split_points=split_points,
            recompute_ratios=[rank_ratios[s % plan.pp] for s in range(n_stages)],
        )

    if memory_budget_bytes is None:
        rank_ratios = recompute_ratios(mode, plan.pp)
        return PipelineLayout(plan, split(rank_ratios), v, rank_ratios)
    if mode != "stage-aware":
        raise PlanError(
            f"a memory budget sets stage-aware recomputation; got recompute={mode}: use "
            "recompute=stage-aware or drop the budget"
        )
    if micro_batch_tokens is None:
        raise PlanError("a memory budget needs micro_batch_tokens (rows · seq_len)")

    def fitting(part: Partition, rank: int) -> float:
        in_flight = micro_batches_in_flight(plan.schedule, rank, plan.pp, plan.micro_batches, v)
        stages = [rank + k * plan.pp for k in range(v)]
        return ratio_for_budget(part, memory_budget_bytes, micro_batch_tokens, in_flight, stages)

    formula = recompute_ratios(mode, plan.pp, fitting(split((1.0,) * plan.pp), 0))
    part = split(formula)
    rank_ratios = tuple(max(r, fitting(part, rank)) for rank, r in enumerate(formula))
    return PipelineLayout(plan, part, v, rank_ratios)


def check_split(
    model: nn.Module,
    plan: Plan,
    split_points: Sequence[str] | None,
    layers_per_stage: Sequence[int] | None,
) -> None:
    """PlanError/ConfigError before any rank starts for a user's pipeline split that cannot be
    used on `model` (a meta-device copy will do): a split point naming no layer, counts that do
    not add up, a split without pp > 1. Nothing to check without a split."""
    if not (split_points or layers_per_stage):
        return
    if not plan.pipelined:
        raise ConfigError("split_points / layers_per_stage split a pipeline: use them with pp > 1")
    pipeline_layout(model, plan, split_points=split_points, layers_per_stage=layers_per_stage)
