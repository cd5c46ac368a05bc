"""The load-balancing strategies of an expert-parallel MoE layer (`plan.moe_balance`).

    none      no balancing: the router's own capacity drops overflowing tokens (as configured)
    dropless  no capacity, no replicas: every token reaches its expert's owner
    shadow    dropless + FasterMoE shadowing: hottest experts replicated on every device
    prophet   dropless + Pro-Prophet lightweight placement: busiest experts replicated on the
              devices that send them the most tokens; replanned every k iterations, and
              sooner once the routing drifts away from the placement (`Prophet.stale`)

A strategy only decides placements; the expert-parallel layer (`interlace.parallel.expert.layer`)
carries them out. Replicas never change the math: a token meets the same expert parameters
wherever it is computed, and replica gradients are summed back into the owner's.

Planning is iterative: at training iterations 1, 1 + k, 1 + 2k, ... (k = `replan_every`) the
layer asks `search` for a placement from the previous iteration's count matrix (routing shifts
slowly, so it predicts the next) and keeps it until the next replan. Using the previous
iteration lets the parameters move before the current routing is known, and lets the layer run
the search on a background thread (`background`) while that previous iteration's all-to-alls
and expert compute run. A strategy may also declare its placement `stale` for the newest
counts, and the next iteration then replans before it is due (prophet, when the routing has
drifted away from its placement).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from interlace.errors import ConfigError
from interlace.moe.balance.cost import LayerCost, layer_time
from interlace.moe.balance.placement import Placement
from interlace.moe.balance.search import prophet_search, shadow_search

DEFAULT_BANDWIDTH = 12.5e9
"""Bytes/s per device assumed when none is given: a 100 Gbit/s link."""
DEFAULT_FLOPS = 100e12
"""Expert compute assumed when none is given: 100 TFLOP/s, a current accelerator."""


@dataclass(frozen=True)
class ExpertSize:
    """What the performance model needs to know of one MoE layer's experts.

    token_bytes: bytes of one token row; expert_bytes: bytes of one expert's parameters;
    flops_per_token: forward FLOPs one expert spends on one token (2 · its matmul weights).
    """

    token_bytes: float
    expert_bytes: float
    flops_per_token: float


@dataclass(frozen=True)
class Balancer:
    """Strategy 'none': no replicas; the router's capacity (or its dropless flag) decides."""

    name: ClassVar[str] = "none"
    dropless: ClassVar[bool | None] = None  # forced router mode; None keeps the router's
    replan_every: int = 0  # 0 = never plans

    def __post_init__(self) -> None:
        if self.replan_every < 0:
            raise ConfigError(f"replan_every={self.replan_every} must be >= 0 (0 = never)")

    def due(self, iteration: int) -> bool:
        """Whether to plan a new placement at training iteration `iteration` (0-based)."""
        k = self.replan_every
        return k > 0 and iteration >= 1 and (iteration - 1) % k == 0

    def search(self, counts: torch.Tensor, base: Placement, size: ExpertSize) -> Placement:
        """The placement to use from now on, given a count matrix [D, E]; here always `base`."""
        return base

    def stale(
        self, counts: torch.Tensor, placement: Placement, base: Placement, size: ExpertSize
    ) -> bool:
        """Whether `placement` has gone stale for the newest counts [D, E], so that the next
        iteration should replan before it is `due`; here never."""
        return False

    def for_layer(self, overlap: bool) -> Balancer:
        """This strategy as used by a layer whose scheduler overlaps Trans and Agg with compute
        (`overlap`) or not; the layer calls it once, when built. Here: unchanged."""
        return self


@dataclass(frozen=True)
class Dropless(Balancer):
    """Strategy 'dropless': no capacity (every token is computed), no replicas."""

    name: ClassVar[str] = "dropless"
    dropless: ClassVar[bool | None] = True


@dataclass(frozen=True)
class _Modelled(Balancer):
    """A dropless strategy that searches placements with the performance model.

    bandwidth: bytes/s per device (B̄); flops: expert FLOP/s per device; overlap: model Trans
    and Agg as hidden under compute (true only with an overlapping scheduler); None follows
    the layer (`for_layer`), and until then prices them as the layer's default scheduler,
    which overlaps. measured: a calibrated `LayerCost` (bandwidth, throughput and the
    measured refinements of `moe.balance.cost`) to search with instead of Pro-Prophet's
    terms from `bandwidth` and `flops`; the expert's sizes and `overlap` still come from the
    layer.
    """

    dropless: ClassVar[bool | None] = True
    replan_every: int = 1
    bandwidth: float = DEFAULT_BANDWIDTH
    flops: float = DEFAULT_FLOPS
    overlap: bool | None = False
    measured: LayerCost | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("bandwidth", "flops"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{self.name}: {name}={getattr(self, name)} must be > 0")

    def cost(self, size: ExpertSize) -> LayerCost:
        """The performance model's constants for experts of `size` on this hardware."""
        overlap = self.overlap is not False
        if self.measured is not None:
            return replace(
                self.measured,
                token_bytes=size.token_bytes,
                expert_bytes=size.expert_bytes,
                grad_bytes=None,
                overlap=overlap,
            )
        return LayerCost(
            token_bytes=size.token_bytes,
            expert_bytes=size.expert_bytes,
            bandwidth=self.bandwidth,
            throughput=self.flops / size.flops_per_token,
            overlap=overlap,
        )

    def for_layer(self, overlap: bool) -> _Modelled:
        """With `overlap` None, a copy whose Trans and Agg are priced as the layer's scheduler
        runs them (hidden only when it overlaps); an explicit `overlap` is kept."""
        return self if self.overlap is not None else replace(self, overlap=overlap)


@dataclass(frozen=True)
class Shadow(_Modelled):
    """Strategy 'shadow': FasterMoE shadowing, replanned every iteration by default; its
    broadcasts are priced in full (`overlap` false) unless told otherwise."""

    name: ClassVar[str] = "shadow"

    def search(self, counts: torch.Tensor, base: Placement, size: ExpertSize) -> Placement:
        """Hottest experts on every device while the modelled time falls (`shadow_search`)."""
        return shadow_search(counts, base, self.cost(size))


@dataclass(frozen=True)
class Prophet(_Modelled):
    """Strategy 'prophet': Pro-Prophet's greedy lightweight placement every `replan_every`
    iterations; `alpha` and `n_exclude` as in `prophet_search`. `overlap` follows the layer by
    default (None): under Pro-Prophet's scheduler (the expert-parallel layer's default) Trans
    and Agg hide under compute, so the search prices only what stays exposed; a layer built
    with `overlap=False` has them priced in full. An explicit true or false is kept."""

    name: ClassVar[str] = "prophet"
    replan_every: int = 10
    overlap: bool | None = None
    alpha: float = 0.1
    n_exclude: int | None = None
    drift: float | None = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.drift is not None and not self.drift >= 0:
            raise ConfigError(f"prophet: drift={self.drift} must be >= 0, or None (never early)")

    def search(self, counts: torch.Tensor, base: Placement, size: ExpertSize) -> Placement:
        """Busiest experts replicated where their tokens are (`prophet_search`)."""
        return prophet_search(counts, base, self.cost(size), self.alpha, self.n_exclude)

    def stale(
        self, counts: torch.Tensor, placement: Placement, base: Placement, size: ExpertSize
    ) -> bool:
        """Whether the routing has drifted away from `placement`: on the newest counts [D, E]
        the model prices it more than (1 + drift) times shadowing's placement (a search ~10×
        cheaper than prophet's, whose result prophet's own never prices worse). Pro-Prophet
        replans every k iterations because popularity shifts slowly; this replans sooner when
        it does not. Never with drift None."""
        if self.drift is None:
            return False
        cost = self.cost(size)
        shadowing = layer_time(counts, shadow_search(counts, base, cost), cost).total
        return layer_time(counts, placement, cost).total > (1 + self.drift) * shadowing


BALANCERS: dict[str, type[Balancer]] = {
    cls.name: cls for cls in (Balancer, Dropless, Shadow, Prophet)
}


def make_balancer(name: str, **options: float | int | bool | LayerCost | None) -> Balancer:
    """The strategy called `name` ('none', 'dropless', 'shadow', 'prophet') with `options`
    (its dataclass fields, e.g. replan_every=5). Raises ConfigError on an unknown name or
    option."""
    if name not in BALANCERS:
        raise ConfigError(f"moe_balance='{name}' is unknown; use one of {', '.join(BALANCERS)}")
    try:
        return BALANCERS[name](**options)
    except TypeError as exc:
        raise ConfigError(f"moe_balance='{name}': {exc}") from None
