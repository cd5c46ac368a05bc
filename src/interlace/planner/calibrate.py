"""Measure this machine for the planner: matmul FLOP/s, link α and bandwidth, memory.

`calibrate()` returns a `Calibration` and caches it as JSON (`cache_path()`: the file named by
$INTERLACE_HARDWARE_CACHE, else ~/.cache/interlace/hardware-local.json) together with the
machine's fingerprint (CPU count, torch version, architecture); a cached result is reused until
the fingerprint changes or `recalibrate=True`. `local_hardware(ranks)` turns it into a
`Hardware` for `ranks` ranks on this machine (the hardware named `local`, `--hardware local`).

- **Compute**: matmuls of a transformer layer's shape in each dtype the planner prices a
  local run in (`CALIBRATED_DTYPES`: fp32, and bf16, the default on CUDA), on the device a
  run uses (`mesh.default_device`). On the CPU, timed with the thread count one rank of an
  N-rank run uses (`interlace train` and `interlace bench` give each rank cpu_count // N
  threads), for every N up to the CPU count; on CUDA, once per dtype on the device.
- **Link**: an all_reduce size sweep between 2 forked gloo ranks over loopback (the ranks of a
  local run), each call after a few milliseconds of compute as in a training step (so the
  time includes waking the transfer threads and waiting for the other rank), fitted on mean
  times as t = a + b·bytes by least squares on relative error. A 2-rank ring
  all_reduce sends 2 messages and `wire_bytes` = n, so α = a / 2 and bandwidth = 1 / b.
  `link_sweep` and `fit_link` also run inside a benchmark's ranks, on an emulated link.
- **Overlap**: the fraction of an all-reduce that hides under a matmul loop of about the same
  length running at the same time (async c10d), on the same 2 ranks: `hidden_fraction`. On a
  CPU the ranks' compute and gloo's transfer threads share the cores, so it is below 1.
- **Memory**: the machine's RAM, shared by the ranks (on CUDA the device's memory, one device
  per rank), and the bandwidth an AdamW step with gradient clipping reaches on the device
  (`measure_optimizer_bandwidth`), which prices the optimizer step.

torch has no calibration of its own; this module is the planner's, hence written here.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from interlace import comm
from interlace.comm import Group, wire_bytes
from interlace.errors import ConfigError
from interlace.mesh import default_device
from interlace.optim import build_optimizer
from interlace.parallel.grad_norm import GradNorm
from interlace.planner.bytes import step_bytes_per_param
from interlace.planner.hardware import RATE_KINDS, Hardware, local
from interlace.precision import DTYPES
from interlace.testing import run_ranks

CACHE_ENV = "INTERLACE_HARDWARE_CACHE"
"""Environment variable naming the calibration cache file."""
SWEEP_BYTES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 2 * 2**20, 8 * 2**20)
"""All-reduce payloads of the link sweep (fp32 tensors)."""
LINK_COMPUTE_BETWEEN = 0.005
"""Seconds of compute before each timed all_reduce of the local link sweep (`link_sweep`)."""
MATMUL_SHAPES = {"cpu": (2048, 512, 2048), "cuda": (8192, 2048, 8192)}
"""(rows, inner, cols) of the timed matmul per device type: 2048 tokens through a 512 → 2048
projection on the CPU; 8192 through 2048 → 8192 on CUDA (a GPU needs more work per call)."""
OPTIMIZER_PARAMS = {"cpu": 2**20, "cuda": 2**26}
"""Parameters of the timed optimizer step per device type (a GPU needs more to reach its
memory bandwidth: 2**26 parameters are 2 GiB of weights, gradients and moments)."""
CALIBRATED_DTYPES = ("fp32", "bf16")
"""The dtypes whose matmul rate is measured: what `interlace plan --hardware local` prices."""


@dataclass(frozen=True)
class Calibration:
    """Measured machine quantities.

    matmul_flops: sustained FLOP/s of one rank per dtype ("fp32", "bf16") and thread count
    ("1", "2", ...; on CUDA one entry, "1"); link_latency: α seconds per message;
    link_bandwidth: bytes/s per direction; memory_bytes: the machine's RAM (on CUDA one
    device's memory); overlap_efficiency: the fraction of a collective that hides under
    concurrent compute (`measure_overlap`); memory_bandwidth: bytes/s of an optimizer step per
    thread count, like matmul_flops (`measure_optimizer_bandwidth`); fingerprint: what the
    numbers belong to (its "device": "cpu" or "cuda"); seconds: how long the calibration took.
    """

    matmul_flops: dict[str, dict[str, float]]
    link_latency: float
    link_bandwidth: float
    memory_bytes: float
    fingerprint: dict[str, Any]
    overlap_efficiency: float
    memory_bandwidth: dict[str, float]
    seconds: float = 0.0

    def flops_for_threads(self, threads: int, dtype: str = "fp32") -> float:
        """FLOP/s in `dtype` measured with `threads` threads (the nearest measured count
        below it); ConfigError for a dtype not measured."""
        if dtype not in self.matmul_flops:
            raise ConfigError(
                f"the calibration measured no {dtype} matmul rate; choose one of: "
                f"{', '.join(self.matmul_flops)}"
            )
        return _for_threads(self.matmul_flops[dtype], threads)

    def bandwidth_for_threads(self, threads: int) -> float:
        """Optimizer-step bytes/s measured with `threads` threads (the nearest count below)."""
        return _for_threads(self.memory_bandwidth, threads)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field."""
        return asdict(self)


def _for_threads(by_threads: dict[str, float], threads: int) -> float:
    counts = sorted(int(t) for t in by_threads)
    usable = [t for t in counts if t <= threads] or counts[:1]
    return by_threads[str(usable[-1])]


MEASURED_STEP = 2
"""What the calibration's step measurements time, numbered so a cache of an older kind is
measured again: 2 since the optimizer step is torch's fused AdamW with the clip inside it on the
CPU too (1: foreach AdamW on the CPU and a separate clipping pass)."""


def fingerprint() -> dict[str, Any]:
    """What a calibration depends on: CPU count, torch version, architecture, the type of
    device a run computes on ("cpu" or "cuda"; read without initialising CUDA) and what its
    step measurements time (`MEASURED_STEP`)."""
    return {
        "measured_step": MEASURED_STEP,
        "cpus": os.cpu_count() or 1,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "device": default_device().type,
    }


def cache_path() -> Path:
    """$INTERLACE_HARDWARE_CACHE, else ~/.cache/interlace/hardware-local.json."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    return Path.home() / ".cache" / "interlace" / "hardware-local.json"


def threads_per_rank(ranks: int) -> int:
    """Threads a rank of a `ranks`-rank local run uses: cpu_count // ranks, at least 1."""
    return max(1, (os.cpu_count() or 1) // ranks)


# --------------------------------------------------------------------------- compute
def measure_matmul_flops(
    threads: int,
    min_seconds: float = 0.3,
    dtype: str = "fp32",
    device: torch.device | None = None,
    shape: tuple[int, int, int] | None = None,
) -> float:
    """Sustained FLOP/s of [n, k] @ [k, m] matmuls (`shape`, default `MATMUL_SHAPES` of the
    device type) in `dtype` ("fp32", "bf16", "fp16") on `device` (default: the CPU) with
    `threads` CPU threads: the best of repeated timings within about `min_seconds`."""
    device = device or torch.device("cpu")
    n, k, m = shape or MATMUL_SHAPES[device.type]
    a = torch.randn(n, k, device=device, dtype=DTYPES[dtype])
    b = torch.randn(k, m, device=device, dtype=DTYPES[dtype])
    return 2 * n * k * m / best_seconds(lambda: a @ b, threads, min_seconds, device)


def measure_optimizer_bandwidth(
    threads: int,
    params: int | None = None,
    min_seconds: float = 0.3,
    device: torch.device | None = None,
) -> float:
    """Bytes/s the run's AdamW step (`optim.build_optimizer`) with its gradient-norm clipping
    (`GradNorm.clip_`) streams on `device` (default: the CPU) with `threads` threads:
    `bytes.step_bytes_per_param()` · `params` / seconds (best of repeated steps over 8
    parameter tensors of `params` / 8 elements, with gradients; default `OPTIMIZER_PARAMS` of
    the device type)."""
    device = device or torch.device("cpu")
    params = params or OPTIMIZER_PARAMS[device.type]
    weights = nn.ParameterList(torch.randn(params // 8, device=device) for _ in range(8))
    for w in weights:
        w.grad = torch.randn_like(w)
    optimizer = build_optimizer(weights, lr=1e-6, weight_decay=0.0)

    clipping = GradNorm(weights.parameters())

    def step() -> None:
        clipping.clip_(1.0, optimizer)
        optimizer.step()

    seconds = best_seconds(step, threads, min_seconds, device)  # its warm-up makes the moments
    return step_bytes_per_param() * 8 * (params // 8) / seconds


def best_seconds(
    fn: Callable[[], object], threads: int, min_seconds: float, device: torch.device
) -> float:
    """The shortest of repeated calls of `fn` (after one warm-up) within about `min_seconds`,
    on `threads` CPU threads; on CUDA each call is timed to a device sync."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fn()
        sync()
        best, spent = float("inf"), 0.0
        while spent < min_seconds:
            start = time.perf_counter()
            fn()
            sync()
            elapsed = time.perf_counter() - start
            best, spent = min(best, elapsed), spent + elapsed
    finally:
        torch.set_num_threads(saved)
    return best


def fit_half_rows(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(efficiency E, half rows h) of the curve E · m / (m + h) (`Hardware.efficiency`) fitted
    to (rows m, achieved efficiency) samples, e.g. `model_calibration.measure_model_efficiency`
    at a few batch sizes with m = its tokens: least squares of 1/eff = 1/E + (h/E) · 1/m, a
    line in 1/m. With E above 1 the fit is redone with E = 1; a falling slope (efficiency not
    rising with m) gives h = 0 and E the harmonic mean. ConfigError unless there are two
    distinct m > 0 and every efficiency is in (0, 1]."""
    if len({m for m, _ in samples}) < 2 or any(m <= 0 for m, _ in samples):
        raise ConfigError(
            f"efficiency samples {samples} need at least two distinct row counts m > 0"
        )
    if any(not 0 < e <= 1 for _, e in samples):
        raise ConfigError(f"efficiency samples {samples} must each be in (0, 1]")
    xs = [1 / m for m, _ in samples]
    ys = [1 / e for _, e in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    if slope <= 0:
        return 1 / my, 0.0
    intercept = my - slope * mx
    if intercept >= 1:
        return 1 / intercept, slope / intercept
    # E = 1: 1/eff − 1 = h · 1/m through the origin (h >= 0 since every eff <= 1)
    h = sum(x * (y - 1) for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return 1.0, h


# --------------------------------------------------------------------------- overlap
def hidden_fraction(compute_s: float, comm_s: float, both_s: float) -> float:
    """(C + M − B) / min(C, M), clipped to [0, 1]: the share of the shorter of a computation
    (C seconds alone) and a collective (M alone) that disappears when both run at once (B)."""
    return min(1.0, max(0.0, (compute_s + comm_s - both_s) / min(compute_s, comm_s)))


def measure_overlap(group: Group, seconds: float = 0.05, repeats: int = 5) -> float:
    """The hidden fraction of an async all_reduce over `group` under a matmul loop of about the
    same length (`seconds`), both timed alone and together (medians of `repeats`); every rank
    must call it. Uses its own comm meter."""
    meter = comm.CommMeter()
    compute = _compute_loop(seconds, group)

    def timed(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            dist.barrier(group=group.pg)
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    compute_s = timed(compute)
    probe = torch.zeros(2**18)  # 1 MB: sized below from its own time
    probe_s = timed(lambda: comm.all_reduce(probe, group, meter=meter))
    elements = max(1, int(probe.numel() * compute_s / max(probe_s, 1e-9)))
    buffer = torch.zeros(int(_agreed(torch.tensor([elements]), group)))
    comm_s = timed(lambda: comm.all_reduce(buffer, group, meter=meter))

    def both() -> None:
        work = comm.all_reduce(buffer, group, async_op=True, meter=meter)
        compute()
        work.wait()

    return hidden_fraction(compute_s, comm_s, timed(both))


def _agreed(value: torch.Tensor, group: Group) -> torch.Tensor:
    """The largest of every rank's `value` (so all ranks run the same sizes)."""
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group.pg)
    return value


# --------------------------------------------------------------------------- link
def link_sweep(
    group: Group,
    sizes: tuple[int, ...] = SWEEP_BYTES,
    repeats: int = 5,
    compute_between: float = 0.0,
) -> list[tuple[int, float]]:
    """(payload bytes, mean seconds) of a blocking all_reduce over `group` per size in
    `sizes`; every rank must call it. The mean, not the median: a step's time adds up its
    collectives, so their expected time is what counts (on loopback a small all_reduce takes
    0.3 ms or 3 ms, depending on when the ranks' threads wake). Each timed call follows a
    barrier, or with `compute_between` > 0 about that many seconds of matmuls instead, as in
    a training step:
    the ranks then arrive as unevenly as they do there, and the time includes waiting for the
    slower one. Uses its own comm meter (nothing is counted elsewhere)."""
    meter = comm.CommMeter()
    compute = _compute_loop(compute_between, group) if compute_between > 0 else None
    out = []
    for size in sizes:
        buffer = torch.zeros(size // 4)
        comm.all_reduce(buffer, group, meter=meter)  # warm-up: connection and allocation
        times = []
        for _ in range(repeats):
            if compute is None:
                dist.barrier(group=group.pg)
            else:
                compute()
            start = time.perf_counter()
            comm.all_reduce(buffer, group, meter=meter)
            times.append(time.perf_counter() - start)
        out.append((size, statistics.fmean(times)))
    return out


def _compute_loop(seconds: float, group: Group) -> Callable[[], None]:
    """A loop of 256² matmuls lasting about `seconds`, the same count on every rank."""
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    per_matmul = (time.perf_counter() - start) / 5
    count = int(_agreed(torch.tensor([max(1, round(seconds / per_matmul))]), group))

    def compute() -> None:
        for _ in range(count):
            a @ a

    return compute


def fit_link(samples: list[tuple[int, float]], group_size: int = 2) -> tuple[float, float]:
    """(α seconds per message, bandwidth bytes/s) from all_reduce (payload, seconds) samples
    over `group_size` ranks: t = α·2(p−1) + wire_bytes / bandwidth, least squares on relative
    error (each sample weighted 1/t²). α is clipped at 0; ConfigError for a non-positive slope."""
    steps = 2 * (group_size - 1)
    xs = [wire_bytes("all_reduce", n, group_size) for n, _ in samples]
    ts = [t for _, t in samples]
    w = [1 / t**2 for t in ts]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs, strict=True)) / sw
    mt = sum(wi * t for wi, t in zip(w, ts, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs, strict=True))
    sxt = sum(wi * (x - mx) * (t - mt) for wi, x, t in zip(w, xs, ts, strict=True))
    if sxx <= 0 or sxt <= 0:
        raise ConfigError(
            f"link sweep {samples} shows no growth of time with size; use larger sizes"
        )
    slope = sxt / sxx
    intercept = mt - slope * mx
    return max(intercept, 0.0) / steps, 1 / slope


def _sweep_rank(
    sizes: tuple[int, ...], repeats: int, overlap: bool
) -> tuple[list[tuple[int, float]], float | None]:
    world = Group("world", dist.group.WORLD, 2, dist.get_rank())
    samples = link_sweep(world, sizes, repeats, compute_between=LINK_COMPUTE_BETWEEN)
    return samples, measure_overlap(world) if overlap else None


def _loopback(sizes: tuple[int, ...], repeats: int, overlap: bool):
    saved = torch.get_num_threads()
    try:
        return run_ranks(2, _sweep_rank, sizes, repeats, overlap, timeout=60.0)[0]
    finally:
        torch.set_num_threads(saved)


def measure_loopback_link(
    sizes: tuple[int, ...] = SWEEP_BYTES, repeats: int = 5
) -> tuple[float, float]:
    """(α, bandwidth) between 2 forked gloo ranks on loopback (`link_sweep` + `fit_link`).
    The caller's torch thread count is restored afterwards."""
    samples, _ = _loopback(sizes, repeats, overlap=False)
    return fit_link(samples)


def memory_bytes(device: torch.device | None = None) -> float:
    """The machine's physical memory in bytes, or a CUDA `device`'s."""
    if device is not None and device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# --------------------------------------------------------------------------- cache
def measure() -> Calibration:
    """Measure everything now (a few seconds): the link first (forking before any
    multi-threaded compute or CUDA), then on the run's device matmuls in every
    `CALIBRATED_DTYPES` and optimizer steps, on the CPU for every thread count a local run can
    give a rank."""
    started = time.perf_counter()
    samples, overlap = _loopback(SWEEP_BYTES, 15, overlap=True)
    alpha, bandwidth = fit_link(samples)
    device = default_device()
    cpus = os.cpu_count() or 1
    counts = sorted({threads_per_rank(r) for r in range(1, cpus + 1)})
    if device.type == "cuda":
        counts = [1]  # one device per rank, whatever its threads
    flops = {
        dtype: {str(t): measure_matmul_flops(t, dtype=dtype, device=device) for t in counts}
        for dtype in CALIBRATED_DTYPES
    }
    return Calibration(
        matmul_flops=flops,
        memory_bandwidth={str(t): measure_optimizer_bandwidth(t, device=device) for t in counts},
        link_latency=alpha,
        link_bandwidth=bandwidth,
        memory_bytes=memory_bytes(device),
        fingerprint=fingerprint(),
        overlap_efficiency=overlap,
        seconds=time.perf_counter() - started,
    )


def load_cached(path: Path | None = None) -> Calibration | None:
    """The cached calibration if it exists, parses and matches this machine's fingerprint."""
    path = path or cache_path()
    try:
        data = json.loads(path.read_text())
        calibration = Calibration(**data)
    except (OSError, ValueError, TypeError):
        return None
    return calibration if calibration.fingerprint == fingerprint() else None


def calibrate(recalibrate: bool = False, path: Path | None = None) -> Calibration:
    """The cached calibration of this machine, measuring (and caching) it when there is none,
    the machine changed, or `recalibrate`."""
    path = path or cache_path()
    if not recalibrate:
        cached = load_cached(path)
        if cached is not None:
            return cached
    calibration = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(calibration.to_dict(), indent=1))
    os.replace(tmp, path)
    return calibration


def hardware_from(
    calibration: Calibration, ranks: int = 2, bandwidth: float | None = None
) -> Hardware:
    """A `local` Hardware for `ranks` ranks sharing this machine: one rank's FLOP/s in each
    measured dtype at its thread count, the measured link (or `bandwidth` bytes/s, e.g. an
    emulated link's rate, keeping the measured α), and RAM / ranks (on CUDA one device's
    memory); all ranks on one node."""
    if ranks < 1:
        raise ConfigError(f"ranks={ranks} must be >= 1")
    threads = threads_per_rank(ranks)
    shared = calibration.fingerprint["device"] == "cpu"  # RAM of one machine
    return local(
        {
            dtype: calibration.flops_for_threads(threads, dtype)
            for dtype in calibration.matmul_flops
        },
        bandwidth if bandwidth is not None else calibration.link_bandwidth,
        memory_bytes=calibration.memory_bytes / (ranks if shared else 1),
        devices_per_node=max(ranks, 1),
        latency=calibration.link_latency,
        overlap_efficiency=calibration.overlap_efficiency,
        memory_bandwidth=calibration.bandwidth_for_threads(threads),
        sources={
            **dict.fromkeys(RATE_KINDS, "calibrated on this machine (cached)"),
            **({"links": "given (--bandwidth); α calibrated"} if bandwidth is not None else {}),
        },
    )


def local_hardware(
    ranks: int = 2, bandwidth: float | None = None, recalibrate: bool = False
) -> Hardware:
    """`hardware_from(calibrate(recalibrate), ranks, bandwidth)`: this machine, measured."""
    return hardware_from(calibrate(recalibrate), ranks, bandwidth)


__all__ = [
    "CACHE_ENV",
    "CALIBRATED_DTYPES",
    "Calibration",
    "best_seconds",
    "cache_path",
    "calibrate",
    "fingerprint",
    "fit_half_rows",
    "fit_link",
    "hardware_from",
    "link_sweep",
    "local_hardware",
    "measure",
    "measure_loopback_link",
    "measure_matmul_flops",
    "measure_optimizer_bandwidth",
    "measure_overlap",
    "threads_per_rank",
]
