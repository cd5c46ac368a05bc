"""Greedy placement searches over a routing count matrix, driven by the performance model.

Both take C [D, E] (tokens device s routed to expert e, from a recent iteration), the layer's
replica-free `base` placement (the owners) and its `LayerCost`, and return a new Placement. They
are pure and deterministic (ties go to the lower index), so every rank that holds the same
all-gathered counts reaches the same placement without talking to the others.

- `shadow_search` (FasterMoE's shadowing): replicate the hottest expert (most tokens overall) on
  every device, then the next hottest, while the modelled layer time keeps falling.
- `prophet_search` (Pro-Prophet's lightweight placement): repeatedly take the busiest expert
  (most tokens computed on its owner under the placement so far) and replicate it on all
  devices but the n that hold the fewest of its tokens; n is fixed (`n_exclude`) or, by
  default, chosen per expert as the one with the lowest modelled time. Keep the prefix of
  steps with the lowest modelled time; stop when max(H) − min(H) < α · tokens / E or the
  busiest expert is one already replicated.
"""

from __future__ import annotations

import torch

from interlace.moe.balance.cost import LayerCost, layer_time
from interlace.moe.balance.placement import Placement, device_loads


def shadow_search(counts: torch.Tensor, base: Placement, cost: LayerCost) -> Placement:
    """FasterMoE-style shadowing of the hottest experts on all devices (see module docstring)."""
    _check_counts(counts, base)
    placement = base
    current = layer_time(counts, placement, cost).total
    totals = counts.sum(dim=0).tolist()
    for expert in sorted(range(base.num_experts), key=lambda e: (-totals[e], e)):
        trial = placement.with_replicas(expert, range(base.num_devices))
        modelled = layer_time(counts, trial, cost).total
        if modelled >= current:
            break
        placement, current = trial, modelled
    return placement


def prophet_search(
    counts: torch.Tensor,
    base: Placement,
    cost: LayerCost,
    alpha: float = 0.1,
    n_exclude: int | None = None,
) -> Placement:
    """Pro-Prophet's greedy lightweight placement (see module docstring).

    alpha: stop once the spread of tokens computed per device is below alpha · tokens / E.
    n_exclude: devices left without a replica of each replicated expert (those holding the
        fewest of its tokens); None lets the model pick it per expert.
    """
    _check_counts(counts, base)
    if n_exclude is not None and n_exclude < 0:
        raise ValueError(f"n_exclude={n_exclude} must be >= 0 (or None to let the model choose)")
    threshold = alpha * float(counts.sum()) / base.num_experts
    placement = base
    best, best_time = placement, layer_time(counts, placement, cost).total
    while True:
        computed, _ = device_loads(counts, placement)
        if float(computed.max() - computed.min()) < threshold:
            break
        expert = _busiest_expert(counts, placement)
        if placement.replicas[expert]:
            break
        options = _replica_options(counts, placement, expert, n_exclude)
        if not options:
            break
        placement = min(
            options,
            key=lambda p: (layer_time(counts, p, cost).total, len(p.replicas[expert])),
        )
        modelled = layer_time(counts, placement, cost).total
        if modelled < best_time:
            best, best_time = placement, modelled
    return best


def _busiest_expert(counts: torch.Tensor, placement: Placement) -> int:
    """The expert with the most tokens computed on its owner (ties: lowest index)."""
    at_owner = torch.where(placement.replica_mask(), 0, counts).sum(dim=0)
    return int(torch.argmax(at_owner))


def _replica_options(
    counts: torch.Tensor, placement: Placement, expert: int, n_exclude: int | None
) -> list[Placement]:
    """Placements replicating `expert` on all non-owner devices but the n holding the fewest
    of its tokens, for each allowed n that leaves at least one replica."""
    others = [s for s in range(placement.num_devices) if s != placement.owner[expert]]
    others.sort(key=lambda s: (int(counts[s, expert]), s))
    choices = range(len(others)) if n_exclude is None else [n_exclude]
    return [placement.with_replicas(expert, others[n:]) for n in choices if n < len(others)]


def _check_counts(counts: torch.Tensor, base: Placement) -> None:
    expected = (base.num_devices, base.num_experts)
    if tuple(counts.shape) != expected:
        raise ValueError(
            f"count matrix has shape {tuple(counts.shape)} but the placement has "
            f"{expected[0]} devices and {expected[1]} experts; pass counts of shape {expected}"
        )
