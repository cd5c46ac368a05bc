"""What `bench mfu` will cost, said before it starts: about how long and how much memory.

Time: the model FLOPs of every measurement's warm-up and timed steps (`mfu.shapes` × `mfu.modes`),
over the rate of a quick matmul probe on the run's device in each mode's precision times
`EFFICIENCY`, plus `COMPILE_S` for each compiled measurement. Memory: the largest measurement's
(the fp32 loop's) parameters, gradients, AdamW moments and activations as the planner prices them
(`planner.cost.plan_memory`), against the device's memory. Rough by design: the line it makes
says "about".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from interlace.bench.mfu_runs import (
    LOOPS,
    batches,
    micro_batches,
    mode_precision,
    modes,
    shapes,
)
from interlace.mesh import default_device
from interlace.plan import Plan
from interlace.planner.calibrate import measure_matmul_flops, memory_bytes
from interlace.planner.cost import plan_memory
from interlace.throughput import model_flops_per_token

EFFICIENCY = 0.5
"""Share of the probe's matmul rate a training step's model FLOPs reach (assumed: about half for
GPT-2 shapes in bf16 on an H100 and for the demo presets in bf16 on a CPU)."""
COMPILE_S = 30.0
"""Seconds torch.compile adds to one measurement (assumed, from an H100's runs)."""
LONG_S = 15 * 60
"""A model whose measurements take longer than this is named in the line."""
PROBE_SHAPE = {"cpu": (256, 256, 256)}
"""Matmul of the CPU's probe: small, as a CPU without bf16 units takes seconds for the
planner's calibration shape in bf16; other devices use the planner's (`MATMUL_SHAPES`)."""


@dataclass(frozen=True)
class Cost:
    """About how long a model's measurements take (seconds) and the most memory one needs."""

    seconds: float
    memory_bytes: float


def model_costs(
    options: dict[str, Any], device: torch.device, rates: dict[str, float]
) -> dict[str, Cost]:
    """{model: Cost} for every model of `options` (its dense equivalent's measurements
    included) on `device`, at `rates` (FLOP/s of the matmul probe per precision)."""
    steps = options["warmup"] + options["steps"]
    costs = {}
    for name, batch in batches(options).items():
        pairs = shapes(name, options)
        seconds = memory = 0.0
        for _, config in pairs:
            flops = model_flops_per_token(config) * batch * config.seq_len * steps
            for mode in modes(options, moe=len(pairs) > 1):
                rate = rates[mode_precision(device, mode)] * EFFICIENCY
                seconds += micro_batches(mode) * flops / rate
                compiled = LOOPS.get(mode, ("", False))[1] or (
                    mode.startswith("trainer") and device.type == "cuda"
                )
                seconds += COMPILE_S if compiled else 0.0
            memory = max(memory, plan_memory(Plan(), config, batch, dtype="fp32")["total"])
        costs[name] = Cost(seconds, memory)
    return costs


def probe_rates(device: torch.device) -> dict[str, float]:
    """Matmul FLOP/s on `device` in fp32 and bf16, within a fraction of a second each."""
    return {
        precision: measure_matmul_flops(
            torch.get_num_threads(),
            min_seconds=0.05,
            dtype=precision,
            device=device,
            shape=PROBE_SHAPE.get(device.type),
        )
        for precision in ("fp32", "bf16")
    }


def preview(options: dict[str, Any]) -> str:
    """The models, batches, steps and device of the run and about how long it takes and how
    much memory it needs; a model over `LONG_S` or over the device's memory is named."""
    device = default_device()
    costs = model_costs(options, device, probe_rates(device))
    available = memory_bytes(device)
    measurements = sum(
        len(pairs) * len(modes(options, moe=len(pairs) > 1))
        for pairs in (shapes(name, options) for name in costs)
    )
    models = ", ".join(f"{name} (batch {batch})" for name, batch in batches(options).items())
    most = max(cost.memory_bytes for cost in costs.values())
    line = (
        f"{models}; {measurements} measurements of {options['warmup']} warm-up + "
        f"{options['steps']} timed steps on {device}: "
        f"{_duration(sum(c.seconds for c in costs.values()))}, ~{_gib(most)} GiB at most"
    )
    cpu = device.type == "cpu"
    holder = "this machine's" if cpu else f"{device}'s"
    for name, cost in costs.items():
        over = cost.memory_bytes > available
        if cost.seconds > LONG_S or over:
            line += (
                f"; warning: {name} on {'the CPU' if cpu else device} takes "
                f"{_duration(cost.seconds)} and needs ~{_gib(cost.memory_bytes)} GiB"
                + (f", more than {holder} {_gib(available)} GiB" if over else "")
            )
    return line


def _duration(seconds: float) -> str:
    if seconds < 60:
        return "under a minute"
    if seconds < 90 * 60:
        return f"about {round(seconds / 60)} min"
    return f"about {seconds / 3600:.0f} h"


def _gib(nbytes: float) -> str:
    gib = nbytes / 2**30
    return f"{gib:.2g}" if gib < 10 else f"{gib:.0f}"
