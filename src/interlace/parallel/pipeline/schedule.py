"""`build_schedule`: torch.distributed.pipelining's GPipe, 1F1B or interleaved 1F1B for a Plan
(the schedules and what each can run: `pipeline.options`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from interlace.errors import PlanError


def build_schedule(
    schedule: str,
    stages: Sequence[PipelineStage],
    micro_batches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """torch's schedule object for `schedule` over this rank's `stages` (one, or v with
    interleaving). Gradients are not rescaled by torch (`scale_grads=False`): `loss_fn` must
    return each micro-batch's share of the loss whose gradient is wanted."""
    if schedule == "gpipe":
        return ScheduleGPipe(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "1f1b":
        return Schedule1F1B(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "interleaved":
        return ScheduleInterleaved1F1B(
            list(stages), micro_batches, loss_fn=loss_fn, scale_grads=False
        )
    raise PlanError(f"schedule={schedule!r} is not one of gpipe, 1f1b, interleaved, shifted")
