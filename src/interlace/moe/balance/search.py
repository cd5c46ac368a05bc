"""Greedy placement searches over a routing count matrix, driven by the performance model.

Both take C [D, E] (tokens device s routed to expert e, from a recent iteration), the layer's
replica-free `base` placement (the owners) and its `LayerCost`, and return a new Placement. They
are pure and deterministic (ties go to the lower index), so every rank that holds the same
all-gathered counts reaches the same placement without talking to the others.

- `shadow_search` (FasterMoE's shadowing): replicate the hottest expert (most tokens overall) on
  every device, then the next hottest, while the modelled layer time keeps falling.
- `prophet_search` (Pro-Prophet's lightweight placement): starting from no replicas, take at
  every step the (expert, n) choice with the lowest modelled layer time (ties: the lower
  balance degree, then fewer replicas): replicate the expert on all devices but the n that
  hold the fewest of its tokens, n fixed (`n_exclude`) or any. Each step adds devices to one
  expert's holders, so an expert may come back to grow its replicas over a larger subset of
  devices, and a move may relieve the busiest device or the busiest link. Keep the best
  prefix of steps; stop when max(H) − min(H) < α · tokens / E, when no expert can gain a
  holder, or after 4 steps without a better prefix. With the overlap-adjusted Trans/Agg
  (`LayerCost.overlap`) replicas are free while they hide under compute, so the search
  replicates more experts, over subsets of devices, than shadowing's all-or-nothing.
  With n free, shadowing's placement lies in the search space but the greedy path from no
  replicas can miss it (by up to ~20% of modelled layer time on skewed counts), so the greedy
  also runs from it, and the better end is kept: prophet never models worse than shadowing.
"""

from __future__ import annotations

import math

import torch

from interlace.moe.balance.cost import DeviceLoads, LayerCost, layer_time, loads_time
from interlace.moe.balance.placement import Placement


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

    counts: [D, E] tokens device s routed to expert e; base: the replica-free owners.
    alpha: stop once the spread of tokens computed per device is below alpha · tokens / E.
    n_exclude: devices left without a replica of a replicated expert (those holding the fewest
        of its tokens); None lets the model pick it at every step.
    """
    _check_counts(counts, base)
    if n_exclude is not None and not 0 <= n_exclude <= base.num_devices - 2:
        raise ValueError(
            f"n_exclude={n_exclude} must be in [0, {base.num_devices - 2}] on "
            f"{base.num_devices} devices (at least one replica), or None to let the model choose"
        )
    starts = [base] if n_exclude is not None else [base, shadow_search(counts, base, cost)]
    found = [_greedy(counts, start, cost, alpha, n_exclude) for start in starts]
    return min(found, key=lambda placement: _score(DeviceLoads.of(counts, placement), cost))


_PATIENCE = 4
"""Greedy steps without a better prefix before the search gives up. On random skewed counts,
2 · E steps (E experts) took 18× as long at E = 64, D = 8 (2.9 s a search) and found no
better placement; 1 step found placements ~0.1% slower by the model."""


def _greedy(
    counts: torch.Tensor, start: Placement, cost: LayerCost, alpha: float, n_exclude: int | None
) -> Placement:
    """Pro-Prophet's greedy steps from `start` (module docstring); the best prefix."""
    table = counts.to(torch.float64).tolist()
    ranked = _by_tokens(table, start)
    threshold = alpha * float(counts.sum()) / start.num_experts
    placement, loads = start, DeviceLoads.of(counts, start)
    best, best_score, since_best = placement, _score(loads, cost), 0
    while max(loads.computed) - min(loads.computed) >= threshold and since_best < _PATIENCE:
        moves = []
        for expert in range(start.num_experts):
            for devices in _new_replicas(table, ranked[expert], placement, expert, n_exclude):
                moved = _add(loads, table, placement, expert, devices)
                moves.append((_score(moved, cost), moved, expert, devices))
        if not moves:
            break
        score, loads, expert, devices = min(moves, key=lambda move: move[0])
        placement = placement.with_replicas(expert, placement.replicas[expert] + devices)
        since_best += 1
        if score < best_score:
            best, best_score, since_best = placement, score, 0
    return best


def _add(
    loads: DeviceLoads,
    table: list[list[float]],
    placement: Placement,
    expert: int,
    devices: tuple[int, ...],
) -> DeviceLoads:
    """The loads once `devices` (holding none of `expert` yet) also compute `expert` on their
    own tokens (table[s][e]: counts as nested lists), which stop reaching its owner, and
    receive its parameters from the owner."""
    owner = placement.owner[expert]
    moved = sum(table[s][expert] for s in devices)
    computed, received, sent = list(loads.computed), list(loads.received), list(loads.sent)
    replicas_in, replicas_out = list(loads.replicas_in), list(loads.replicas_out)
    computed[owner] -= moved
    received[owner] -= moved
    replicas_out[owner] += len(devices)
    for s in devices:
        computed[s] += table[s][expert]
        sent[s] -= table[s][expert]
        replicas_in[s] += 1
    new_holders = len(devices) + (0 if placement.replicas[expert] else 1)
    return DeviceLoads(
        computed=tuple(computed),
        received=tuple(received),
        sent=tuple(sent),
        routed=loads.routed,
        replicas_in=tuple(replicas_in),
        replicas_out=tuple(replicas_out),
        holders=loads.holders + new_holders,
        local_experts=loads.local_experts,
    )


def _score(loads: DeviceLoads, cost: LayerCost) -> tuple[float, float, int]:
    """What the search minimises: the modelled layer time, then the balance degree (so a move
    that spreads the load without relieving the busiest device still counts), then the
    devices holding replicas."""
    computed = loads.computed
    mean = sum(computed) / len(computed)
    spread = math.sqrt(sum((h - mean) ** 2 for h in computed) / len(computed))
    return loads_time(loads, cost).total, spread, loads.holders


def _by_tokens(table: list[list[float]], placement: Placement) -> list[list[int]]:
    """Per expert, the devices other than its owner, most of its tokens first (ties: lower
    index)."""
    return [
        sorted(
            (s for s in range(placement.num_devices) if s != placement.owner[e]),
            key=lambda s, e=e: (-table[s][e], s),
        )
        for e in range(placement.num_experts)
    ]


def _new_replicas(
    table: list[list[float]],
    others: list[int],
    placement: Placement,
    expert: int,
    n_exclude: int | None,
) -> list[tuple[int, ...]]:
    """For each allowed n, the devices that replicating `expert` on all devices but the n
    holding the fewest of its tokens adds to its current holders (non-empty sets only; a
    device that routed none of its tokens would only pay Trans and is never added). `others`:
    the devices but its owner, most of its tokens first (`_by_tokens`)."""
    held = set(placement.replicas[expert])
    choices = range(len(others)) if n_exclude is None else [n_exclude]
    added = {
        tuple(s for s in others[: len(others) - n] if s not in held and table[s][expert] > 0)
        for n in choices
    }
    return sorted(devices for devices in added if devices)


def _check_counts(counts: torch.Tensor, base: Placement) -> None:
    expected = (base.num_devices, base.num_experts)
    if tuple(counts.shape) != expected:
        raise ValueError(
            f"count matrix has shape {tuple(counts.shape)} but the placement has "
            f"{expected[0]} devices and {expected[1]} experts; pass counts of shape {expected}"
        )
