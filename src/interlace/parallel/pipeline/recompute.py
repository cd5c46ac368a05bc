"""Activation recomputation per pipeline stage: which layers of each stage are checkpointed.

A checkpointed layer keeps only its input and replays its forward during backward
(`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`): memory falls from the layer's
saved activations to d per token, compute rises from 3F to 4F.

- `none`: no layer is checkpointed.
- `full`: every layer of every stage.
- `selective`: every layer, under the selective policy of `interlace.recompute` (outside a
  pipeline only, for now; the planner prices it through these ratios).
- `stage-aware` (Merak): under 1F1B stage s holds about P − s micro-batches in flight, so later
  stages have memory to spare. With stage 0 checkpointing a fraction r0 of its layers, stage s
  needs only

      r_s = 1 − (1 − r0) · (P − 1) / (P − 1 − s)        clamped to [0, 1],  s < P − 1

  for the same activation memory (the last stage runs each backward right after its forward
  and checkpoints nothing). r0 comes from a memory budget when one is given
  (`ratio_for_budget`), else 1.0. With a budget, a stage whose estimate would still exceed it
  (the formula assumes equal stages; a heavy LM head breaks that) checkpoints more: each
  rank takes the larger of the formula's ratio and the smallest ratio that fits.
- an explicit list: one ratio per pipeline rank.

A ratio r checkpoints the first ⌈r · n⌉ of the n layers of each stage the rank runs (with
interleaving, of each of its virtual stages).
"""

from __future__ import annotations

from collections.abc import Sequence

from interlace.errors import PlanError
from interlace.parallel.pipeline.partition import Partition, checkpointed_count


def stage_aware_ratios(pp: int, r0: float = 1.0) -> tuple[float, ...]:
    """Merak's per-stage checkpoint ratios for `pp` stages from stage 0's ratio `r0` (see the
    module docstring): non-increasing in s, r_0 = r0, last stage 0."""
    if not 0.0 <= r0 <= 1.0:
        raise PlanError(f"stage-0 checkpoint ratio r0={r0} must be in [0, 1]")
    ratios = []
    for s in range(pp - 1):
        r = 1.0 - (1.0 - r0) * (pp - 1) / (pp - 1 - s)
        ratios.append(round(min(1.0, max(0.0, r)), 12))  # no float dust like 2e-16
    return (*ratios, 0.0)


def recompute_ratios(mode: str | Sequence[float], pp: int, r0: float = 1.0) -> tuple[float, ...]:
    """Checkpoint ratio per pipeline rank for `mode` "none" | "full" | "selective" |
    "stage-aware" (with stage-0 ratio `r0`) or an explicit sequence of `pp` ratios in [0, 1]."""
    if isinstance(mode, str):
        if mode == "none":
            return (0.0,) * pp
        if mode in ("full", "selective"):
            return (1.0,) * pp
        if mode == "stage-aware":
            return stage_aware_ratios(pp, r0)
        raise PlanError(
            f"recompute={mode!r} is not one of none, full, selective, stage-aware, or a list"
        )
    ratios = tuple(float(r) for r in mode)
    if len(ratios) != pp or any(not 0.0 <= r <= 1.0 for r in ratios):
        raise PlanError(
            f"recompute ratios {list(ratios)} must be {pp} values in [0, 1], one per pipeline rank"
        )
    return ratios


def ratio_for_budget(
    part: Partition,
    budget_bytes: float,
    micro_batch_tokens: int,
    in_flight: float,
    stages: Sequence[int] = (0,),
) -> float:
    """The smallest checkpoint ratio whose estimated memory (`Partition.stage_memory`, summed
    over `stages`, the stages one rank runs, each with `in_flight` micro-batches) fits
    `budget_bytes`. Candidates are the ratios that checkpoint whole layers. Raises PlanError
    when even full checkpointing does not fit."""

    def memory(ratio: float) -> float:
        return sum(part.stage_memory(s, micro_batch_tokens, in_flight, ratio) for s in stages)

    counts = [part.bounds[s][1] - part.bounds[s][0] for s in stages]
    for ratio in sorted({k / n for n in counts for k in range(n + 1)}):
        if memory(ratio) <= budget_bytes:
            return ratio
    raise PlanError(
        f"pipeline stage(s) {list(stages)} need about {memory(1.0) / 2**30:.3g} GiB even with "
        f"every layer recomputed, over the memory budget of {budget_bytes / 2**30:.3g} GiB; "
        "use more pipeline stages, fewer or smaller micro-batches, or a larger budget"
    )


def checkpointed_layers(layers: Sequence[int], ratio: float) -> frozenset[int]:
    """The layer indices (of the ones a rank holds, `layers` in order) to checkpoint: the
    first ⌈ratio · len(layers)⌉."""
    return frozenset(layers[: checkpointed_count(ratio, len(layers))])
