"""Measure a `planner.surface.RateSurface` on this machine's device, and cache it
(`interlace plan --hardware local --calibrate`).

Each matmul of the grid (`GEMM_SIZES` per device type, the same sizes for m, n and k) and each
causal `scaled_dot_product_attention` forward + backward of the attention grid (`SEQS` ×
`HEAD_DIMS`; batch and heads sized so each call holds `ATTENTION_TOKENS` tokens of about
`ATTENTION_WIDTH` channels, as in a layer) is timed on the run's device (`mesh.default_device`)
with the thread count one rank uses, the best of repeated calls
(`calibrate.best_seconds`), after the calibration's reference matmul. Attention is torch's own
kernel choice for the device (flash or memory-efficient on CUDA, the CPU's fused kernel),
which is what a run calls.

Surfaces are cached in `rate-surfaces.json` beside the machine's calibration
(`calibrate.cache_path()`), one per dtype and thread count, for this machine's fingerprint.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from interlace.mesh import default_device
from interlace.planner.calibrate import (
    best_seconds,
    cache_path,
    fingerprint,
    measure_matmul_flops,
    threads_per_rank,
)
from interlace.planner.hardware import Hardware
from interlace.planner.measured_cache import cached_entry
from interlace.planner.surface import RateSurface
from interlace.precision import DTYPES

GEMM_SIZES = {"cpu": (32, 128, 512, 2048), "cuda": (256, 1024, 4096, 16384)}
"""The sizes of m, n and k of the matmul grid per device type."""
SEQS = {"cpu": (64, 256, 1024), "cuda": (512, 2048, 8192)}
"""The sequence lengths of the attention grid per device type."""
HEAD_DIMS = (32, 64, 128)
"""The head widths of the attention grid."""
ATTENTION_TOKENS = {"cpu": 4096, "cuda": 16384}
"""Tokens (batch · sequence) of each timed attention call per device type."""
ATTENTION_WIDTH = {"cpu": 256, "cuda": 2048}
"""Channels (heads · head width) of each timed attention call per device type."""
MIN_SECONDS = 0.02
"""About how long each shape is timed (at least one call after a warm-up)."""


def measure_attention_flops(
    seq: int,
    head_dim: int,
    threads: int,
    dtype: str,
    device: torch.device,
    min_seconds: float = MIN_SECONDS,
) -> float:
    """The rate of causal attention forward + backward at `seq` tokens and `head_dim` wide
    heads, in the cost model's FLOPs (3 · 4 · seq · width per token, `planner.surface`)."""
    heads = max(1, ATTENTION_WIDTH[device.type] // head_dim)
    batch = max(1, ATTENTION_TOKENS[device.type] // seq)
    shape = (batch, heads, seq, head_dim)
    q, k, v = (
        torch.randn(shape, device=device, dtype=DTYPES[dtype], requires_grad=True) for _ in range(3)
    )
    grad = torch.randn(shape, device=device, dtype=DTYPES[dtype])

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    seconds = best_seconds(step, threads, min_seconds, device)
    return 3 * 4 * seq * heads * head_dim * batch * seq / seconds


def measure_surface(
    dtype: str,
    threads: int,
    device: torch.device | None = None,
    min_seconds: float = MIN_SECONDS,
    sizes: tuple[int, ...] | None = None,
    seqs: tuple[int, ...] | None = None,
    head_dims: tuple[int, ...] = HEAD_DIMS,
) -> RateSurface:
    """Time the grids (default: those of `device`'s type; see the module docstring) in `dtype`
    on `device` (default: the run's) with `threads` CPU threads."""
    device = device or default_device()
    sizes = sizes or GEMM_SIZES[device.type]
    seqs = seqs or SEQS[device.type]
    reference = measure_matmul_flops(threads, 5 * min_seconds, dtype, device)
    gemm = []
    for m in sizes:
        for n in sizes:
            for k in sizes:
                shape = (m, k, n)  # measure_matmul_flops: [m, k] @ [k, n]
                gemm.append(measure_matmul_flops(threads, min_seconds, dtype, device, shape))
    attention = [
        measure_attention_flops(s, h, threads, dtype, device, min_seconds)
        for s in seqs
        for h in head_dims
    ]
    return RateSurface(
        dtype=dtype,
        threads=threads,
        device=device.type,
        reference=reference,
        sizes=tuple(sizes),
        gemm=tuple(gemm),
        seqs=tuple(seqs),
        head_dims=tuple(head_dims),
        attention=tuple(attention),
    )


def surface_cache_path() -> Path:
    """`rate-surfaces.json` beside the machine's calibration (`calibrate.cache_path()`)."""
    return cache_path().with_name("rate-surfaces.json")


def cached_surface(dtype: str, ranks: int, recalibrate: bool = False) -> RateSurface:
    """The surface of this machine in `dtype` for one of `ranks` local ranks (on the CPU with
    `calibrate.threads_per_rank(ranks)` threads; on CUDA one device each) from the cache,
    measured (and cached) when there is none for this fingerprint or `recalibrate`; a
    measurement says so on stderr with how long it took."""
    device = default_device()
    threads = 1 if device.type == "cuda" else threads_per_rank(ranks)
    key = json.dumps([fingerprint(), dtype, threads], sort_keys=True)
    path = surface_cache_path()

    def measured() -> dict:
        print(
            f"interlace: measuring {dtype} matmul and attention rates on a grid of shapes on "
            f"the {device.type} ({threads} threads; cached in {path})",
            file=sys.stderr,
        )
        started = time.perf_counter()
        surface = measure_surface(dtype, threads, device)
        print(f"interlace: measured in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        return surface.to_dict()

    return RateSurface.from_dict(cached_entry(path, key, measured, dict, recalibrate))


def with_surface(hardware: Hardware, surface: RateSurface) -> Hardware:
    """`hardware` pricing `surface.dtype`'s matmul shapes and attention from `surface`."""
    source = f"{hardware.source('compute')}; matmul shapes and attention measured on a grid"
    return dataclasses.replace(
        hardware, surface=surface, sources={**hardware.sources, "compute": source}
    )
