"""Timing on many ranks: every sample is the slowest rank's time, so all ranks agree on it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from interlace import comm

_BOOKKEEPING = comm.CommMeter()  # the benchmark's own reductions stay out of the default meter


def slowest(seconds: float, group: comm.Group) -> float:
    """The maximum of `seconds` over the ranks of `group`."""
    value = torch.tensor([seconds], dtype=torch.float64)
    comm.all_reduce(value, group, op=dist.ReduceOp.MAX, meter=_BOOKKEEPING)
    return float(value)


def sample(
    fn: Callable[[], object],
    group: comm.Group,
    min_samples: int = 3,
    min_seconds: float = 0.5,
    max_samples: int = 20,
    warmup: int = 1,
) -> list[float]:
    """Seconds per call of `fn` (run on every rank after a barrier), slowest rank per sample:
    at least `min_samples`, more until `min_seconds` in total or `max_samples`."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    while len(samples) < min_samples or (sum(samples) < min_seconds and len(samples) < max_samples):
        dist.barrier(group=group.pg)
        start = time.perf_counter()
        fn()
        samples.append(slowest(time.perf_counter() - start, group))
    return samples


def median(samples: list[float]) -> float:
    """The median sample."""
    return statistics.median(samples)
