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

from dataclasses import replace

import numpy as np
import torch

from interlace.moe.balance.cost import DeviceLoads, LayerCost, loads_time
from interlace.moe.balance.placement import Placement


def shadow_search(counts: torch.Tensor, base: Placement, cost: LayerCost) -> Placement:
    """FasterMoE-style shadowing of the hottest experts on all devices (see module docstring).

    `base` has no replicas, so replicating the k hottest experts adds up k single moves: all
    E prefixes are modelled in one batch."""
    _check_counts(counts, base)
    table = counts.to(torch.float64).numpy()
    loads = DeviceLoads.of(counts, base)
    totals = counts.sum(dim=0).tolist()
    hottest = np.array(sorted(range(base.num_experts), key=lambda e: (-totals[e], e)))
    everywhere = np.ones((base.num_experts, base.num_devices))
    everywhere[np.arange(base.num_experts), np.asarray(base.owner)[hottest]] = 0.0
    alone = _moved(loads, table, base, hottest, everywhere)
    prefixes = loads_time(_accumulated(loads, alone), cost).total  # [E]
    current, taken = float(loads_time(loads, cost).total), 0
    while taken < base.num_experts and prefixes[taken] < current:
        current, taken = prefixes[taken], taken + 1
    placement = base
    for expert in hottest[:taken]:
        placement = placement.with_replicas(int(expert), range(base.num_devices))
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
2 · E steps (E experts) took 18× as long at E = 64, D = 8 and found no
better placement; 1 step found placements ~0.1% slower by the model."""


def _greedy(
    counts: torch.Tensor, start: Placement, cost: LayerCost, alpha: float, n_exclude: int | None
) -> Placement:
    """Pro-Prophet's greedy steps from `start` (module docstring); the best prefix.

    Every step scores all its candidate moves at once, as one batch of loads [M, D]."""
    table = counts.to(torch.float64).numpy()
    experts = np.arange(start.num_experts)[:, None]
    order = _by_tokens(table, start)  # [E, D − 1]
    routed_here = table.T[experts, order] > 0
    held = start.at_source_array().T[experts, order]
    threshold = alpha * float(counts.sum()) / start.num_experts
    placement, loads = start, DeviceLoads.of(counts, start)
    best, best_score, since_best = placement, _score(loads, cost), 0
    while np.ptp(loads.computed) >= threshold and since_best < _PATIENCE:
        moved, added = _candidate_moves(order, routed_here & ~held, n_exclude)
        if not len(moved):
            break
        batch = _moved(loads, table, placement, moved, added)
        columns = _columns(batch, cost)
        chosen = int(np.lexsort(columns[::-1])[0])  # stable: ties keep the moves' order
        expert, devices = int(moved[chosen]), np.flatnonzero(added[chosen])
        placement = placement.with_replicas(expert, (*placement.replicas[expert], *devices))
        held[expert] |= added[chosen, order[expert]] > 0
        loads, score = batch.at(chosen), tuple(float(column[chosen]) for column in columns)
        since_best += 1
        if score < best_score:
            best, best_score, since_best = placement, score, 0
    return best


def _candidate_moves(
    order: np.ndarray, fresh: np.ndarray, n_exclude: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """The moves of one greedy step: (experts [M], added [M, D] 0/1 devices each move adds).

    order [E, D − 1]: per expert the devices but its owner, most of its tokens first;
    fresh [E, D − 1] (in that order): the device routed tokens to the expert and holds none of
    it. Replicating an expert on all devices but the n holding the fewest of its tokens adds
    the fresh devices among the first D − 1 − n of `order`: for n free, each prefix of its
    fresh devices (one move per fresh position, ending there); for n fixed, at most one move.
    Moves come expert by expert, shortest first."""
    positions = order.shape[1]
    allowed = fresh.copy()
    if n_exclude is None:
        ends = allowed
    else:
        allowed[:, positions - n_exclude :] = False
        last = positions - 1 - np.argmax(allowed[:, ::-1], axis=1)
        ends = np.zeros_like(allowed)
        ends[np.arange(len(allowed)), last] = allowed.any(axis=1)
    moved, end = np.nonzero(ends)
    prefix = allowed[moved] & (np.arange(positions) <= end[:, None])  # [M, D − 1]
    added = np.zeros((len(moved), positions + 1))
    added[np.arange(len(moved))[:, None], order[moved]] = prefix
    return moved, added


def _moved(
    loads: DeviceLoads,
    table: np.ndarray,
    placement: Placement,
    experts: np.ndarray,
    added: np.ndarray,
) -> DeviceLoads:
    """The loads [M, D] after each of M moves: the devices of added[m] (0/1, holding none of
    experts[m] yet) also compute experts[m] on their own tokens (table [D, E]), which stop
    reaching its owner, and receive its parameters from the owner."""
    rows = np.arange(len(experts))
    kept = added * table[:, experts].T  # [M, D] tokens now computed where they were routed
    moved = kept.sum(axis=1)[:, None]
    at_owner = np.zeros_like(added)
    at_owner[rows, np.asarray(placement.owner)[experts]] = 1.0
    replicated = np.array([bool(devices) for devices in placement.replicas])
    count = added.sum(axis=1)
    return DeviceLoads(
        computed=loads.computed + kept - moved * at_owner,
        received=loads.received - moved * at_owner,
        sent=loads.sent - kept,
        routed=loads.routed,
        replicas_in=loads.replicas_in + added,
        replicas_out=loads.replicas_out + count[:, None] * at_owner,
        holders=loads.holders + count + ~replicated[experts],
        local_experts=loads.local_experts,
    )


def _accumulated(loads: DeviceLoads, moves: DeviceLoads) -> DeviceLoads:
    """The loads [M, D] after the first 1, 2, …, M of `moves` (each the loads after one move
    from `loads`, of distinct experts that had no replicas) one after the other."""
    return replace(
        moves,
        **{
            name: getattr(loads, name) + np.cumsum(getattr(moves, name) - getattr(loads, name), 0)
            for name in DeviceLoads.PER_PLACEMENT
        },
    )


def _columns(loads: DeviceLoads, cost: LayerCost) -> tuple[np.ndarray, ...]:
    """What the search minimises, lexicographically, per placement of a batch [M, D]: the
    modelled layer time, then the balance degree (so a move that spreads the load without
    relieving the busiest device still counts), then the devices holding replicas; each [M]."""
    return loads_time(loads, cost).total, loads.spread(), loads.holders


def _score(loads: DeviceLoads, cost: LayerCost) -> tuple[float, ...]:
    """`_columns` of one placement's loads [D]."""
    return tuple(float(column) for column in _columns(loads, cost))


def _by_tokens(table: np.ndarray, placement: Placement) -> np.ndarray:
    """[E, D − 1]: per expert, the devices other than its owner, most of its tokens first
    (ties: lower index)."""
    rows = []
    for e in range(placement.num_experts):
        others = np.array([s for s in range(placement.num_devices) if s != placement.owner[e]])
        rows.append(others[np.argsort(-table[others, e], kind="stable")])
    return np.array(rows, dtype=np.int64).reshape(placement.num_experts, -1)


def _check_counts(counts: torch.Tensor, base: Placement) -> None:
    expected = (base.num_devices, base.num_experts)
    if tuple(counts.shape) != expected:
        raise ValueError(
            f"count matrix has shape {tuple(counts.shape)} but the placement has "
            f"{expected[0]} devices and {expected[1]} experts; pass counts of shape {expected}"
        )
