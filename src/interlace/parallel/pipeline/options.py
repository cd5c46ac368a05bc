"""The rules of the pipeline schedules, without torch: which schedules exist, their virtual
stages per rank, and what each can run (`build_schedule` in `schedule.py` makes them).

The schedules (torch.distributed.pipelining's GPipe, 1F1B and interleaved 1F1B, and our own):

torch's schedules already run micro-batches in these orders, with the activation and gradient
send/recv between neighbouring stages issued inside torch (`PipelineStage`; that point-to-point
traffic does not pass interlace's comm meter). This module only maps a Plan onto them and
checks, before any work, that the combination can run:

- gpipe: all forwards, then all backwards; any number of micro-batches M.
- 1f1b: after a warm-up of P − s forwards, stage s alternates one forward, one backward;
  needs M ≥ P.
- interleaved: 1F1B over v virtual stages per rank (stage i on rank i mod P, torch's loop
  placement), a smaller bubble for v× more point-to-point messages; needs v ≥ 2, at least
  P·v layers, and M a multiple of max(1, M // P) (torch's rounds).
- shifted: Merak's shifted critical path (`shifted.py`, our own executor: torch has no
  recompute action to place before a gradient receive); needs M ≥ P, one stage per rank.
"""

from __future__ import annotations

from typing import Any

from interlace.errors import PlanError, check_plan_choice

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "shifted")
"""Every schedule a Plan can name; `build_schedule` makes the first three (torch's)."""


PIPELINE_ONLY_RECOMPUTE = ("stage-aware",)
"""Recomputation modes set per pipeline stage, which need pp > 1."""


def mesh_dims(plan: Any) -> tuple[tuple[str, int], ...]:
    """The pipeline's mesh dimension of `plan` (a Plan): ("pp", stages), the outermost."""
    return (("pp", plan.pp),)


def virtual_stages_for(schedule: str, requested: int | None) -> int:
    """Stages per rank: `requested` (default 2) for interleaved, 1 for every other schedule;
    PlanError naming the fix for a count the schedule cannot run."""
    if schedule == "interleaved":
        v = 2 if requested is None else requested
        if v < 2:
            raise PlanError(
                f"schedule=interleaved needs at least 2 virtual stages per rank, got "
                f"virtual_stages={v}; use virtual_stages=2 or more, or schedule=1f1b"
            )
        return v
    if requested not in (None, 1):
        raise PlanError(
            f"virtual_stages={requested} needs schedule=interleaved (got schedule={schedule}); "
            "use schedule=interleaved, or leave virtual_stages out"
        )
    return 1


def check_schedule(
    schedule: str, pp: int, micro_batches: int, n_layers: int, virtual_stages: int = 1
) -> None:
    """Raise PlanError, naming the fix, if torch's `schedule` cannot run `micro_batches` over
    `pp` ranks × `virtual_stages` for a model of `n_layers` layers."""
    if schedule not in PIPELINE_SCHEDULES:
        raise PlanError(f"schedule={schedule!r} is not one of gpipe, 1f1b, interleaved, shifted")
    stages = pp * virtual_stages
    if n_layers < stages:
        raise PlanError(
            f"{stages} pipeline stages (pp={pp} × {virtual_stages} per rank) need at least "
            f"{stages} layers, the model has {n_layers}; use fewer stages"
        )
    if schedule in ("1f1b", "shifted") and micro_batches < pp:
        raise PlanError(
            f"schedule={schedule} needs micro_batches >= pp; got micro_batches={micro_batches} "
            f"with pp={pp}: use micro_batches={pp} or more, or schedule=gpipe"
        )
    if schedule == "interleaved":
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            raise PlanError(
                f"schedule=interleaved with pp={pp} needs micro_batches a multiple of "
                f"{rounds} (torch's rounds of micro_batches // pp); got {micro_batches}: use "
                f"micro_batches={rounds * (micro_batches // rounds)}"
            )


def check_values(plan: Any) -> None:
    """PlanError naming the fix for a bad pipeline option of `plan`: the schedule's name, a
    stages-per-rank count its schedule runs, and `micro_batches`, `schedule`,
    `virtual_stages` and the per-stage recomputation only with pp > 1."""
    check_plan_choice("schedule", plan.schedule, PIPELINE_SCHEDULES)
    v = plan.virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise PlanError(
            f"virtual_stages={v!r} must be a whole number of stages per rank, e.g. "
            "virtual_stages=4 (0: the schedule's own)"
        )
    if plan.pp > 1:
        virtual_stages_for(plan.schedule, v or None)  # a count the schedule cannot run raises
        return
    for name, value, default in (
        ("micro_batches", plan.micro_batches, 1),
        ("schedule", plan.schedule, "1f1b"),
        ("virtual_stages", plan.virtual_stages, 0),
    ):
        if value != default:
            accumulation = " (gradient accumulation is the trainer's micro_batch)"
            raise PlanError(
                f"{name}={value} applies to pipeline parallelism; use pp > 1 with it"
                + (accumulation if name == "micro_batches" else "")
            )
    if plan.recompute in PIPELINE_ONLY_RECOMPUTE:
        raise PlanError(
            f"recompute={plan.recompute} sets a ratio per pipeline stage and needs pp > 1; "
            "use recompute=full or selective without a pipeline"
        )


def check_model(plan: Any, spec: Any) -> None:
    """PlanError unless model `spec` (GPTConfig-like) has a layer per stage and the schedule
    can run `plan`'s micro-batches over its stages (`check_schedule`)."""
    if spec.n_layers < plan.pp:
        raise PlanError(f"pp={plan.pp} exceeds n_layers={spec.n_layers}; use pp<={spec.n_layers}")
    if plan.pp > 1:
        check_schedule(
            plan.schedule,
            plan.pp,
            plan.micro_batches,
            spec.n_layers,
            plan.stages_per_rank,
        )
