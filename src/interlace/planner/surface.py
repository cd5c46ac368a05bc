"""Matmul and attention rates measured on a grid of shapes (`interlace plan --hardware local
--calibrate`; measured by `planner.surface_measure`).

A `RateSurface` holds, for one dtype and one thread count on one device:

- **matmuls**: FLOP/s of an [m, k] @ [k, n] matmul at every (m, n, k) of a grid whose three
  axes take the same sizes (`sizes`);
- **attention**: the rate of causal scaled-dot-product attention, forward and backward, at
  every (sequence length, head width) of a second grid, counted in the cost model's FLOPs
  (4 · T · w a token forward, twice that backward, the masked half included), so that the
  kernel's own savings (a flash kernel skips masked tiles) and losses (its backward recomputes
  the scores) are in the rate;
- `reference`: the FLOP/s of the calibration's one timed matmul (`calibrate.MATMUL_SHAPES`),
  measured with the grid, which the `local` hardware's matmul rate stands for.

A shape between grid points is read by multilinear interpolation of log rate in log size;
outside the grid, at its edge (a smaller matmul is priced at the smallest measured, so
optimistically). `gemm_factor` and `attention_factor` are rates relative to `reference`: the
cost model multiplies the hardware's matmul rate by them (`gemm.shape_model`,
`cost_work.stage_work`).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any

from interlace.errors import ConfigError


@dataclass(frozen=True)
class RateSurface:
    """Rates measured on a grid (see the module docstring).

    dtype, threads, device: what was measured ("fp32", 2, "cpu"); reference: FLOP/s of the
    calibration's matmul; sizes: the matmul grid's sizes (each of m, n, k); gemm: FLOP/s at
    every (m, n, k), m slowest; seqs, head_dims: the attention grid's axes; attention: model
    FLOP/s at every (seq, head_dim), seq slowest.
    """

    dtype: str
    threads: int
    device: str
    reference: float
    sizes: tuple[int, ...]
    gemm: tuple[float, ...]
    seqs: tuple[int, ...]
    head_dims: tuple[int, ...]
    attention: tuple[float, ...]

    def __post_init__(self) -> None:
        for name, axes, values in (
            ("gemm", (self.sizes,) * 3, self.gemm),
            ("attention", (self.seqs, self.head_dims), self.attention),
        ):
            if any(not axis or list(axis) != sorted(set(axis)) for axis in axes):
                raise ConfigError(f"rate surface {name}: each axis must rise strictly: {axes}")
            if len(values) != math.prod(len(a) for a in axes):
                raise ConfigError(
                    f"rate surface {name}: {len(values)} rates for a grid of "
                    f"{' x '.join(str(len(a)) for a in axes)}"
                )
            if not all(v > 0 for v in (*values, self.reference)):
                raise ConfigError(f"rate surface {name}: every rate must be > 0")

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - frozen and small; a search asks often
    def gemm_factor(self, m: float, n: float, k: float) -> float:
        """FLOP/s of an [m, n] output over inner k, relative to `reference`."""
        return _interpolate((self.sizes,) * 3, self.gemm, (m, n, k)) / self.reference

    @functools.lru_cache(maxsize=4096)  # noqa: B019
    def attention_factor(self, seq: float, head_dim: float) -> float:
        """Causal attention's model FLOP/s at `seq` tokens and `head_dim` wide heads, relative
        to `reference`."""
        rate = _interpolate((self.seqs, self.head_dims), self.attention, (seq, head_dim))
        return rate / self.reference

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields (`from_dict` reads them back)."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RateSurface:
        """The surface `to_dict` wrote; ConfigError for a malformed one."""
        try:
            return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
        except TypeError as err:
            raise ConfigError(f"not a rate surface: {err}") from err


def _interpolate(
    axes: tuple[tuple[int, ...], ...], values: tuple[float, ...], point: tuple[float, ...]
) -> float:
    """Multilinear interpolation of log(values) on the grid `axes` (values in row-major order,
    the first axis slowest) at `point`, in log coordinates, each clamped to its axis."""
    corners = []  # per axis: ((index, weight), (index, weight))
    for axis, x in zip(axes, point, strict=True):
        if len(axis) == 1:
            corners.append(((0, 1.0),))
            continue
        x = min(max(x, axis[0]), axis[-1])
        i = min(len(axis) - 2, _below(axis, x))
        t = math.log(x / axis[i]) / math.log(axis[i + 1] / axis[i])
        corners.append(((i, 1 - t), (i + 1, t)))
    strides = [math.prod(len(a) for a in axes[d + 1 :]) for d in range(len(axes))]
    log_rate = 0.0
    for corner in itertools.product(*corners):
        weight = math.prod(w for _, w in corner)
        if weight:
            index = sum(i * s for (i, _), s in zip(corner, strides, strict=True))
            log_rate += weight * math.log(values[index])
    return math.exp(log_rate)


def _below(axis: tuple[int, ...], x: float) -> int:
    """The index of the last axis value <= x."""
    return max(i for i, v in enumerate(axis) if v <= x)
