"""The model's own training step measured on this machine, for the planner's compute terms.

A matmul rate alone prices a step too fast: at a GPU's bf16 speed the norms, the softmax, the
element-wise work and the loss, which run at memory speed, weigh as much as the matmuls, and
the narrower the model the more (on one H100 the `local` calibration's matmul rate priced
gpt2-124m's step at 11.8 ms against the Trainer's 32.7 ms). So, as profile-guided planners do,
`measure_model_flops` runs the model's forward and backward exactly as a run computes it —
`parallelize` on one process: the run's precision, blocks and loss compiled on CUDA — and
counts the model FLOP/s it achieves. `interlace plan --hardware local --calibrate-model`
prices the model's compute at that rate's fraction of the calibrated matmul rate
(`with_model_efficiency`), measured once per model shape, rows, dtype and machine and cached
beside the machine's calibration (`cached_model_flops`); `bench planner` fits its efficiency
curve on `measure_model_efficiency`, the same step against a matmul rate measured with it.

torch measures no model for a planner; this module is the planner's, hence written here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

from interlace.compile import resolve_compile
from interlace.errors import ConfigError
from interlace.mesh import default_device
from interlace.models.config import GPTConfig
from interlace.models.gpt import build_model
from interlace.parallel.parallelize import parallelize
from interlace.plan import Plan
from interlace.planner.bytes import state_bytes_per_param
from interlace.planner.calibrate import (
    cache_path,
    fingerprint,
    measure_matmul_flops,
    memory_bytes,
)
from interlace.planner.hardware import Hardware
from interlace.planner.measured_cache import cached_entry
from interlace.planner.step import step_terms
from interlace.precision import Precision
from interlace.throughput import model_flops_per_token, synchronize

MEASURED_PRECISIONS = ("fp32", "bf16", "fp16")
"""The dtypes a model's step can be measured in: those a run trains in."""


def measure_model_flops(
    config: GPTConfig,
    rows: int,
    threads: int,
    min_seconds: float = 0.5,
    dtype: str = "fp32",
    device: torch.device | None = None,
) -> float:
    """The model FLOP/s a training step of `config` reaches on `device` (default: the CPU) with
    `threads` threads: 3 · forward FLOPs per token · tokens / the median seconds of forward +
    backward of `rows` sequences of config.seq_len tokens, run by `parallelize` on one process
    in `dtype` (blocks and loss compiled where a run compiles them: on CUDA), after warm-up
    calls (compilation), each timed to a device sync."""
    device = device or torch.device("cpu")
    compiled = resolve_compile("auto", device, Plan())
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = parallelize(
            build_model(config, device=device),
            Plan(),
            None,
            precision=Precision(dtype),
            compile=compiled,
        )
        ids = torch.randint(0, config.vocab_size, (rows, config.seq_len + 1), device=device)
        x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

        def step() -> float:
            start = time.perf_counter()
            model.forward_backward(x, y)
            synchronize(device)
            return time.perf_counter() - start

        for _ in range(3 if compiled else 1):  # compilation, then a settled allocator
            step()
        times: list[float] = []
        while sum(times) < min_seconds or len(times) < 3:
            times.append(step())
        model.model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(saved)
    return model_flops_per_token(config) * rows * config.seq_len / statistics.median(times)


def measure_model_efficiency(
    config: GPTConfig, rows: int, threads: int, min_seconds: float = 0.5
) -> float:
    """`measure_model_flops` of `config` in fp32 on the CPU as a fraction of
    `measure_matmul_flops(threads)` measured right after it, in (0, 1]: the machine's achieved
    efficiency at the model's shapes (`bench planner`'s curve, `calibrate.fit_half_rows`)."""
    achieved = measure_model_flops(config, rows, threads, min_seconds)
    return min(1.0, achieved / measure_matmul_flops(threads))


def measurable(config: GPTConfig, dtype: str, device: torch.device) -> None:
    """ConfigError unless `config`'s step can be measured on `device` in `dtype`: a dtype a run
    trains in, and weights, gradients and AdamW states (16 bytes a parameter) within the
    device's memory."""
    if dtype not in MEASURED_PRECISIONS:
        raise ConfigError(
            f"--calibrate-model measures a run's step, which trains in "
            f"{', '.join(MEASURED_PRECISIONS)}, not {dtype}; pass --dtype with one of them"
        )
    need = state_bytes_per_param() * config.num_params()
    have = memory_bytes(device)
    if need > have:
        raise ConfigError(
            f"--calibrate-model runs the model on this machine's {device.type}, but its "
            f"{config.num_params() / 1e9:.2f} B parameters need {need / 2**30:.1f} GiB for "
            f"weights, gradients and optimizer states alone (the device has "
            f"{have / 2**30:.1f} GiB); drop --calibrate-model for this model"
        )


def efficiency_cache_path() -> Path:
    """The model efficiencies' cache: `model-efficiency.json` beside the machine's calibration
    (`calibrate.cache_path()`)."""
    return cache_path().with_name("model-efficiency.json")


def cached_model_flops(
    config: GPTConfig, rows: int, dtype: str, recalibrate: bool = False
) -> float:
    """`measure_model_flops` of `config` at `rows` sequences in `dtype` on this machine's
    device (`mesh.default_device`, all its threads), from the cache unless `recalibrate` or
    not measured yet for this model, rows, dtype and machine (`calibrate.fingerprint`); a new
    measurement is cached. ConfigError where `measurable` says no."""
    device = default_device()
    measurable(config, dtype, device)
    key = json.dumps([config.to_dict(), rows, dtype, fingerprint()], sort_keys=True)
    threads = os.cpu_count() or 1

    def measured() -> float:
        return measure_model_flops(config, rows, threads, dtype=dtype, device=device)

    return cached_entry(efficiency_cache_path(), key, measured, float, recalibrate)


def surface_factor(config: GPTConfig, hardware: Hardware, rows: int, dtype: str) -> float:
    """The share of `hardware`'s matmul rate in `dtype` that one device's step of `config` on
    `rows` sequences reaches under its measured shapes and attention (`hardware.surface`;
    `--calibrate`): 3 · forward FLOPs · tokens / (peak · the step's priced compute seconds),
    priced at efficiency 1. 1 without a surface in `dtype`."""
    if hardware.surface is None or hardware.surface.dtype != dtype:
        return 1.0
    whole = dataclasses.replace(
        hardware,
        efficiency_by_dtype={**hardware.efficiency_by_dtype, dtype: 1.0},
        matmul_half_rows=0.0,
    )
    terms = step_terms(Plan(), config, whole, rows, dtype=dtype)
    flops = 3 * terms.profile.forward_flops_per_token * terms.tokens
    return flops / (terms.forward + terms.backward) / whole.peak(dtype)


def with_model_efficiency(
    hardware: Hardware, dtype: str, achieved_flops: float, shape_factor: float = 1.0
) -> Hardware:
    """`hardware` with its matmuls in `dtype` at the efficiency a model step reaching
    `achieved_flops` FLOP/s has against its peak (at most 1) once the `shape_factor` its
    measured shapes already price is divided out (`surface_factor`; 1 without a surface), at
    every size (a step measured at one batch: the curve's half rows set to 0, and no tile
    model: the measured step's shapes are in it), so its compute is priced at the measured
    step's time."""
    efficiency = min(1.0, achieved_flops / (hardware.peak(dtype) * shape_factor))
    source = "the model's own step measured on this device"
    if hardware.surface is not None:
        source += "; matmul shapes and attention measured on a grid, relative to it"
    return dataclasses.replace(
        hardware,
        efficiency_by_dtype={**hardware.efficiency_by_dtype, dtype: efficiency},
        matmul_half_rows=0.0,
        sm_count=0,
        sources={**hardware.sources, "compute": source},
    )
