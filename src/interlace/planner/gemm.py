"""Matmul efficiency by shape on a GPU: tile and wave quantisation.

A GEMM kernel computes its [M, N] output in tiles of tile_m × tile_n, one tile per streaming
multiprocessor (SM) at a time, the tiles running in waves of `sms`. The shape alone costs two
losses (NVIDIA's performance guide calls them tile and wave quantisation):

- the last row and column of tiles are partly empty: M·N of ⌈M/tile_m⌉·⌈N/tile_n⌉ tiles' slots
  are useful;
- the last wave leaves SMs idle: tiles of ⌈tiles / sms⌉ · sms slots are used.

Their product is the fraction of the SMs' slots that computes useful output. An output of
fewer tiles than SMs (a weight gradient [N, K] summed over many tokens) is split along its
inner dimension as well (split-K: s chunks of at least `MIN_SPLIT_DEPTH`, each tile's chunks
on s SMs, their partial sums added afterwards, not priced). A library picks its tile and split
per shape; this model takes the best of the tile sizes in `TILES`, each at its own throughput
relative to the largest (a smaller tile reuses each element it loads on fewer outputs), and of
the power-of-two splits. The relative throughputs are assumed, not measured; stream-K kernels,
which cut the wave loss further, are not modelled, so the factor is a lower bound for shapes
near a wave boundary.

`shape_efficiency(m, n, k, sms)` ∈ (0, 1] multiplies a hardware's large-matmul efficiency
(`Hardware.efficiency`); it tends to 1 for large outputs. `layer_shape_efficiency` is the
FLOP-weighted harmonic mean over the matmuls one device runs for a transformer layer under a
plan — forward [M, N] (inner K), input gradient [M, K] (inner N), weight gradient [N, K]
(inner M) of each linear — so that a layer's matmul time is its FLOPs / (rate · factor).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from interlace.models.config import GPTConfig
from interlace.plan import Plan
from interlace.planner.hardware import Hardware

TILES: tuple[tuple[int, int, float], ...] = (
    (256, 128, 1.0),
    (128, 128, 0.9),
    (128, 64, 0.8),
    (64, 64, 0.6),
)
"""(tile_m, tile_n, throughput relative to the largest) of the tiles a GEMM library may pick;
each also transposed (tile_n × tile_m). Assumed: a smaller tile loads more per output."""
MIN_SPLIT_DEPTH = 256
"""The shallowest chunk of the inner dimension a split-K GEMM gives one SM."""

GemmFactor = Callable[[float, float, float], float]
"""(m, n, k) → the fraction of a large matmul's rate an [m, n] output over inner k reaches."""


@dataclass(frozen=True)
class Linear:
    """One linear layer of a block: n_in → n_out; `transposed` for the layers whose input is
    split where the others' output is (Megatron's row-parallel: the out projection, down)."""

    n_in: int
    n_out: int
    transposed: bool


def feed_forward_linears(config: GPTConfig) -> tuple[Linear, ...]:
    """A feed-forward's linears (a block's, or one expert's) in execution order: up, gate
    (swiglu), down (transposed)."""
    d, f = config.d_model, config.ffn_dim
    up = (Linear(d, f, False),) * (2 if config.feed_forward == "swiglu" else 1)
    return (*up, Linear(f, d, True))


def block_linears(config: GPTConfig) -> tuple[Linear, ...]:
    """The built-in GPT block's linears in execution order: q, k, v (kv heads · head width
    each), out (transposed), then `feed_forward_linears`."""
    d, kv = config.d_model, config.kv_heads * config.head_dim
    attention = (Linear(d, d, False), Linear(d, kv, False), Linear(d, kv, False))
    return (*attention, Linear(d, d, True), *feed_forward_linears(config))


@functools.lru_cache(maxsize=65536)  # a search prices the same few shapes for every plan
def shape_efficiency(m: float, n: float, k: float, sms: int) -> float:
    """Fraction of `sms` SMs' tile slots an [m, n] GEMM output with inner dimension `k` fills
    usefully, at the best of `TILES` and of the splits of k (see the module docstring); 1
    without SMs (`sms` 0: no shape model)."""
    if not sms:
        return 1.0
    m, n = max(1, math.ceil(m)), max(1, math.ceil(n))
    splits = [2**i for i in range(int(math.log2(max(1.0, k / MIN_SPLIT_DEPTH))) + 1)]
    best = 0.0
    for tile_m, tile_n, relative in TILES:
        for a, b in ((tile_m, tile_n), (tile_n, tile_m)):
            tiles = math.ceil(m / a) * math.ceil(n / b)
            for split in splits:
                slots = math.ceil(tiles * split / sms) * sms * a * b / split
                best = max(best, relative * m * n / slots)
    return best


def shape_model(hardware: Hardware, dtype: str) -> GemmFactor:
    """How `hardware`'s matmul rate in `dtype` depends on the shape: as measured on a grid
    where it has a surface in `dtype` (`RateSurface.gemm_factor`), else tile and wave
    quantisation on its `sm_count` SMs (`shape_efficiency`; 1 at every shape without SMs)."""
    if hardware.surface is not None and hardware.surface.dtype == dtype:
        return hardware.surface.gemm_factor
    return functools.partial(shape_efficiency, sms=hardware.sm_count)


def shape_source(hardware: Hardware, dtype: str) -> str | None:
    """Where `shape_model(hardware, dtype)` comes from, for `--explain`; None: no shape model."""
    if hardware.surface is not None and hardware.surface.dtype == dtype:
        return "measured on a grid of shapes, attention by sequence and head width"
    if hardware.sm_count:
        return f"tile and wave quantisation on {hardware.sm_count} SMs, modelled"
    return None


def _split(plan: Plan, linear: Linear) -> tuple[int, int]:
    """(in, out) divisors of `linear` on one device: 1D tp splits the output of a normal layer
    and the input of a transposed one; a 3D grid (x, y, z) splits in over x and out over y (a
    transposed layer: in over y, out over x)."""
    if plan.tp3d is not None:
        x, y, _ = plan.tp3d
        return (y, x) if linear.transposed else (x, y)
    return (plan.tp_size, 1) if linear.transposed else (1, plan.tp_size)


def harmonic_efficiency(gemms: Iterable[tuple[float, float, float]], factor: GemmFactor) -> float:
    """FLOP-weighted harmonic mean of `factor` (`shape_model`) over GEMMs (m, n, k), each run
    forward ([m, n], inner k), for the input gradient ([m, k], inner n) and for the weight
    gradient ([n, k], inner m)."""
    flops = slow = 0.0
    for m, n, k in gemms:
        for rows, cols, inner in ((m, n, k), (m, k, n), (n, k, m)):
            flops += m * n * k
            slow += m * n * k / factor(rows, cols, inner)
    return flops / slow if slow else 1.0


def layer_shape_efficiency(plan: Plan, config: GPTConfig, rows: float, factor: GemmFactor) -> float:
    """The shape factor (`factor`: `shape_model`) of one dense transformer layer's matmuls on
    one device under `plan`, each seeing `rows` rows (see the module docstring)."""
    gemms = []
    for linear in block_linears(config):
        split_in, split_out = _split(plan, linear)
        gemms.append((rows, linear.n_out / split_out, linear.n_in / split_in))
    return harmonic_efficiency(gemms, factor)


def expert_shape_efficiency(config: GPTConfig, rows: float, factor: GemmFactor) -> float:
    """The shape factor (`factor`: `shape_model`) of one expert's matmuls on `rows` rows
    (experts are whole on their owners under every plan)."""
    linears = feed_forward_linears(config)
    return harmonic_efficiency(((rows, e.n_out, e.n_in) for e in linears), factor)
