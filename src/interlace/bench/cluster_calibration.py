"""The machine measured on the benchmark's own ranks, for the planner's step-time estimates.

Every rank measures at once, as they compute at once in a run, so ranks sharing a CPU's cores
see each other's load: the link (an all_reduce size sweep over the world group, each call after
a few milliseconds of compute as in a step, fitted as α + bytes / bandwidth:
`planner.calibrate.link_sweep`, `fit_link`), matmul FLOP/s at the rank's thread count, the
efficiency the model's own step reaches at that rate at one rank's share of the batch and at
1/2 and 1/4 of it (`measure_model_efficiency`, fitted as a curve in the tokens a matmul sees:
`fit_half_rows`), the share of an all-reduce that hides under concurrent compute
(`measure_overlap`), the bandwidth of an optimizer step (`measure_optimizer_bandwidth`) and how
much faster one rank computes while the others wait (`idle_speedup`). With `calibrate_shapes`,
also matmul and attention rates on a grid of shapes (`interlace plan --calibrate`), which
`shapes_hardware` prices with in place of the fitted curve.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from interlace.bench.base import RankContext
from interlace.bench.timing import slowest
from interlace.models.config import GPTConfig
from interlace.planner.calibrate import (
    fit_half_rows,
    fit_link,
    link_sweep,
    measure_matmul_flops,
    measure_optimizer_bandwidth,
    measure_overlap,
    memory_bytes,
)
from interlace.planner.hardware import RATE_KINDS, Hardware, local
from interlace.planner.model_calibration import measure_model_efficiency, surface_factor
from interlace.planner.surface import RateSurface
from interlace.planner.surface_measure import measure_surface, with_surface


def _efficiency_curve(
    ctx: RankContext, config: GPTConfig, rows: int, threads: int
) -> dict[int, float]:
    """Tokens -> the slowest rank's `measure_model_efficiency` of `config` at `rows` sequences
    per rank (1.5 s of steps) and at rows // 2 and rows // 4 (0.5 s each), all ranks at once."""
    dist.barrier(group=ctx.group.pg)
    return {
        r * config.seq_len: -slowest(
            -measure_model_efficiency(config, r, threads, min_seconds=1.5 if r == rows else 0.5),
            ctx.group,
        )
        for r in dict.fromkeys((rows, max(1, rows // 2), max(1, rows // 4)))
    }


def calibrate_cluster(ctx: RankContext, config: GPTConfig, rows: int) -> dict[str, Any]:
    """The cluster's link, matmul rate, `config`'s efficiency at `rows` sequences per rank,
    overlap, optimizer bandwidth and idle speed-up, each the slowest rank's (collective)."""
    alpha, bandwidth = (
        fit_link(link_sweep(ctx.group, repeats=15, compute_between=0.005), ctx.group.size)
        if ctx.group.size > 1
        else (0.0, 1e12)
    )
    threads = torch.get_num_threads()
    dist.barrier(group=ctx.group.pg)
    flops = measure_matmul_flops(threads)
    optimizer = measure_optimizer_bandwidth(threads)
    dist.barrier(group=ctx.group.pg)
    alone = measure_matmul_flops(threads) if ctx.group.rank == 0 else 0.0  # the others wait
    alone = slowest(alone, ctx.group)
    curve = _efficiency_curve(ctx, config, rows, threads)
    efficiency, half_rows = (
        fit_half_rows(list(curve.items()))
        if len(curve) > 1
        else (curve[rows * config.seq_len], 0.0)
    )
    overlap = measure_overlap(ctx.group) if ctx.group.size > 1 else 1.0
    return {
        "link_latency_s": alpha,
        "link_bandwidth_Bps": bandwidth,
        "matmul_flops": slowest(-flops, ctx.group) * -1,  # the slowest rank's rate
        "model_efficiency": curve[rows * config.seq_len],
        "model_efficiency_by_tokens": {str(t): e for t, e in curve.items()},
        "matmul_efficiency": efficiency,
        "matmul_half_rows": half_rows,
        "overlap_efficiency": slowest(-overlap, ctx.group) * -1,
        "memory_bandwidth_Bps": slowest(-optimizer, ctx.group) * -1,
        "idle_speedup": max(1.0, alone / (slowest(-flops, ctx.group) * -1)),
        "threads": threads,
    }


def cluster_hardware(calibration: dict[str, Any], ranks: int, matmul_flops: float) -> Hardware:
    """`hardware.local` for `ranks` ranks from `calibrate_cluster`'s figures, at the matmul
    rate `matmul_flops`."""
    return dataclasses.replace(
        local(
            matmul_flops,
            calibration["link_bandwidth_Bps"],
            memory_bytes=memory_bytes() / ranks,
            devices_per_node=ranks,
            latency=calibration["link_latency_s"],
            memory_bandwidth=calibration["memory_bandwidth_Bps"],
            idle_speedup=calibration["idle_speedup"],
            sources=dict.fromkeys(RATE_KINDS, "calibrated on the cluster's own ranks"),
        ),
        matmul_efficiency=calibration["matmul_efficiency"],
        matmul_half_rows=calibration["matmul_half_rows"],
        overlap_efficiency=calibration["overlap_efficiency"],
    )


def matmul_rate_now(ctx: RankContext) -> float:
    """The slowest rank's matmul FLOP/s, all ranks measuring at once, right now (a shared
    machine's speed drifts over the minutes a benchmark takes)."""
    dist.barrier(group=ctx.group.pg)
    rate = measure_matmul_flops(torch.get_num_threads(), min_seconds=0.2)
    return slowest(-rate, ctx.group) * -1


def calibrate_shapes(ctx: RankContext) -> RateSurface:
    """fp32 matmul and attention rates on a grid of shapes (`measure_surface`), every rank
    measuring at once with its threads, rank 0's kept by all (collective)."""
    dist.barrier(group=ctx.group.pg)
    measured = measure_surface("fp32", torch.get_num_threads(), torch.device("cpu"))
    shared: list[Any] = [measured.to_dict() if ctx.group.rank == 0 else None]
    first = dist.get_global_rank(ctx.group.pg, 0)
    dist.broadcast_object_list(shared, src=first, group=ctx.group.pg)
    return RateSurface.from_dict(shared[0])


def shapes_hardware(
    calibration: dict[str, Any],
    surface: RateSurface,
    config: GPTConfig,
    rows: int,
    ranks: int,
    matmul_flops: float,
) -> Hardware:
    """`cluster_hardware` pricing matmul shapes and attention from `surface`, the model's own
    efficiency taken at one point, `rows` sequences per rank (`calibration`'s), relative to what
    the surface prices for that step (`model_calibration.surface_factor`), at every size."""
    whole = dataclasses.replace(
        cluster_hardware(calibration, ranks, matmul_flops),
        matmul_efficiency=1.0,
        matmul_half_rows=0.0,
    )
    gridded = with_surface(whole, surface)
    factor = surface_factor(config, gridded, rows, "fp32")
    efficiency = min(1.0, calibration["model_efficiency"] / factor)
    return dataclasses.replace(gridded, matmul_efficiency=efficiency)
