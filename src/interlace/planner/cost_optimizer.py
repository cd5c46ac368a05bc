"""The optimizer step's cost, for `planner.step.step_terms`.

After the gradient all-reduces, every device steps its own parameters (`profile.device_params`
of the largest stage): `bytes.step_bytes_per_param` of the run's optimizer state per parameter
streamed at the hardware's `memory_bandwidth` (an infinite bandwidth prices it at 0).
"""

from __future__ import annotations

from interlace.plan import Plan
from interlace.planner.bytes import step_bytes_per_param
from interlace.planner.hardware import Hardware
from interlace.planner.profile import Stage, device_params


def optimizer_seconds(
    plan: Plan, stages: tuple[Stage, ...], hardware: Hardware, optimizer_state: str = "fp32"
) -> float:
    """Seconds of the optimizer step (with gradient clipping) on the device of `stages` that
    holds the most parameters under `plan`, AdamW's moments in `optimizer_state`'s dtype."""
    params = max(device_params(st, plan) for st in stages)
    return params * step_bytes_per_param(optimizer_state) / hardware.memory_bandwidth
