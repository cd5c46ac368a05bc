"""The optimizer step's cost, for `planner.step.step_terms`.

After the gradient all-reduces, every device steps its own parameters (`profile.device_params`
of the largest stage): `bytes.OPTIMIZER_BYTES_PER_PARAM` bytes per parameter streamed at the
hardware's `memory_bandwidth` (an infinite bandwidth prices it at 0).
"""

from __future__ import annotations

from interlace.plan import Plan
from interlace.planner.bytes import OPTIMIZER_BYTES_PER_PARAM
from interlace.planner.hardware import Hardware
from interlace.planner.profile import Stage, device_params


def optimizer_seconds(plan: Plan, stages: tuple[Stage, ...], hardware: Hardware) -> float:
    """Seconds of the optimizer step (with gradient clipping) on the device of `stages` that
    holds the most parameters under `plan`."""
    params = max(device_params(st, plan) for st in stages)
    return params * OPTIMIZER_BYTES_PER_PARAM / hardware.memory_bandwidth
