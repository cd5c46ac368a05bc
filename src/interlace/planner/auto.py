"""`interlace train --plan auto`: the fastest runnable plan for this machine.

The model preset (at the run's sequence length), the run's global batch and the number of
ranks are searched (`search.search(..., runnable_only=True)`) on this machine's calibrated
`local` hardware for that many ranks, in the run's precision (auto: bf16 on CUDA, fp32 on the
CPU, as the run resolves it) and optimizer state. The first plan the run can also split its
batch for (gradient accumulation, micro-batches) wins.
"""

from __future__ import annotations

from dataclasses import replace

from interlace.errors import ConfigError, InterlaceError
from interlace.mesh import default_device
from interlace.models.presets import get_preset
from interlace.planner.calibrate import local_hardware
from interlace.planner.cost import PlanCost
from interlace.planner.hardware import Hardware
from interlace.planner.search import explain, search
from interlace.precision import Precision, resolve_precision
from interlace.train_config import TrainConfig

AUTO = "auto"
"""The --plan value that asks for the planner's choice."""


def choose_plan(
    config: TrainConfig, world_size: int, hardware: Hardware | None = None
) -> tuple[PlanCost, list[PlanCost]]:
    """(the chosen plan's cost, every runnable candidate fastest first) for `config` on
    `world_size` ranks of `hardware` (default: this machine, calibrated). ConfigError when no
    runnable plan fits the run's batch."""
    if hardware is None:
        hardware = local_hardware(world_size)
    spec = get_preset(config.model)
    if config.seq_len:
        spec = replace(spec, seq_len=config.seq_len)
    name = resolve_precision(config.precision, default_device())
    dtype = Precision.of(name).compute  # fp8 priced as bf16
    ranked = search(
        spec,
        hardware,
        world_size,
        config.global_batch,
        dtype=dtype,
        runnable_only=True,
        optimizer_state=config.optimizer_state,
    )
    for cost in ranked:
        if _splits_batch(config, cost):
            return cost, ranked
    raise ConfigError(
        f"--plan {AUTO}: none of the {len(ranked)} runnable plans for {world_size} ranks splits "
        f"global_batch={config.global_batch} with micro_batch={config.micro_batch}; "
        "use a global batch that is a multiple of the rank count, or give --plan"
    )


def _splits_batch(config: TrainConfig, cost: PlanCost) -> bool:
    plan = cost.plan
    try:
        accum = config.accumulation(plan.dp)
    except InterlaceError:
        return False
    return (config.global_batch // plan.dp // accum) % plan.micro_batches == 0


def describe_choice(chosen: PlanCost, ranked: list[PlanCost]) -> str:
    """Two lines or so: the chosen plan against the runner-up, and `explain`'s first line."""
    others = [c for c in ranked if c is not chosen]
    versus = (
        f"; next best {others[0].plan} at {others[0].step_seconds:.3g} s"
        if others
        else "; the only runnable plan"
    )
    return (
        f"plan {AUTO}: chose {chosen.plan} (predicted {chosen.step_seconds:.3g} s per step on "
        f"{chosen.hardware} hardware, {len(ranked)} runnable plans{versus})\n"
        + explain(chosen).splitlines()[0]
    )


__all__ = ["AUTO", "choose_plan", "describe_choice"]
