"""h, the share of an overlapped Trans/Agg that really hides, measured on the layer itself.

Pro-Prophet's scheduler assumes that Trans flying under the expert and non-MoE compute costs
nothing (h = 1), which holds where a copy engine moves the bytes over an otherwise idle link.
Where the transfer needs the same processors as the compute (gloo's TCP sends on shared CPU
cores) or shares the link with the dispatch and combine, it hides less. A micro-benchmark of
one transfer under one matmul overstates h (it sees neither the other all-to-alls nor the
layer's own threads), so h is measured on a stack of the benchmark's blocks:

    n   forward + backward with no replicas
    s   the same with a fixed placement (every expert replicated on the next rank),
        Trans and Agg run synchronously (`overlap=False`)
    b   the same placement, overlapped as the layer schedules it (`overlap=True`)

s − n is what Trans and Agg cost exposed; b − n what is left of it under the scheduler, so
h = 1 − (b − n) / (s − n), clipped to [0, 1]. The performance model then leaves
(1 − h) · min(T, W) of a transfer T under compute W exposed (`LayerCost.hidden_share`).

The probe keeps tokens at home so that the replicas' bytes dominate s − n: with tokens
travelling as well, the difference drowned in the run-to-run spread at 4 ranks on 2 cores and
h came out anywhere in [0, 1]. It is an upper bound: in training the overlapped transfers
also share the link with the dispatch and combine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from interlace.bench.timing import median, sample
from interlace.comm import Group
from interlace.moe.balance import Placement
from interlace.parallel.expert.layer import ExpertParallelMoE


def hidden_share(plain_s: float, sync_s: float, overlapped_s: float) -> float:
    """h = 1 − (b − n) / (s − n) clipped to [0, 1] from the three timings (module docstring):
    plain n, synchronous replicas s, overlapped replicas b. 0 (price transfers in full) when
    the probe saw no cost of the replicas at all: it cannot tell what hides."""
    exposed = sync_s - plain_s
    if exposed <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - (overlapped_s - plain_s) / exposed))


def probe_routing(tokens: int, base: Placement, rank: int) -> torch.Tensor:
    """[tokens, 1] experts for `rank`'s tokens: round robin over its own experts."""
    own = [e for e, owner in enumerate(base.owner) if owner == rank]
    order = torch.arange(tokens) % len(own)
    return torch.tensor(own)[order].unsqueeze(1)


def replicated_everywhere(base: Placement) -> Placement:
    """`base` with every expert also computed on every other rank."""
    placement = base
    for expert in range(base.num_experts):
        placement = placement.with_replicas(expert, range(base.num_devices))
    return placement


def measure_hidden_share(
    group: Group, build: Callable[[bool], nn.Module], x: torch.Tensor, samples: int = 5
) -> dict[str, Any]:
    """h and its three timings (slowest rank, median of `samples`), `build(overlap)` giving a
    fresh stack of blocks with expert-parallel layers linked as the benchmark links them, run
    on this rank's input x [1, tokens, d_model]."""
    if group.size == 1:
        return {"hidden_share": 1.0}
    x = x.detach().requires_grad_(True)

    def seconds(model: nn.Module) -> float:
        def fwd_bwd() -> None:
            model(x).float().pow(2).mean().backward()

        return median(sample(fwd_bwd, group, min_samples=samples, min_seconds=0))

    timings = []
    for overlap, replicated in ((True, False), (False, True), (True, True)):
        model = build(overlap)
        if replicated:
            for layer in model.modules():
                if isinstance(layer, ExpertParallelMoE):
                    layer.placement = replicated_everywhere(layer.base_placement)
        timings.append(seconds(model))
    plain, sync, overlapped = timings
    return {
        "hidden_share": hidden_share(plain, sync, overlapped),
        "overlap_plain_s": plain,
        "overlap_sync_s": sync,
        "overlap_overlapped_s": overlapped,
    }
