"""`ExpertSplit`: what an expert-parallel layer whose experts are split over the tensor parallel
group (etp = tp, `tp_split`) changes in its own computation: each rank's share of the down
bias, the count matrix its placements are planned from, and its experts run on the rows every
rank of the group received. Apart from `tp_split`, so that the layer can hold one without
importing what builds it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from interlace import comm
from interlace.comm import Group
from interlace.moe.grouped import run_by_expert
from interlace.parallel.expert.comm import gather_rows, reduce_scatter_rows

Experts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""Experts run on rows x [M, d] sorted by expert, with counts [n] per expert → [M, d]."""


@dataclass(frozen=True)
class ExpertSplit:
    """An expert-parallel layer's experts split over the tensor parallel `group`
    (`tp_split`'s module docstring)."""

    group: Group

    def params(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stacked expert parameters ({name in an `MLP`: [n, *shape]}) as this rank computes
        its part of the sum: the down bias divided by p."""
        out = dict(params)
        if "down.bias" in out:
            out["down.bias"] = out["down.bias"] / self.group.size
        return out

    def total(self, counts: torch.Tensor) -> torch.Tensor:
        """This rank's [D, E] count matrix → the sum over the group (the counts of every token
        its ranks share out): the same on every rank of it, so are the placements planned from
        it. A new tensor."""
        out = counts.clone()
        comm.all_reduce(out, self.group)
        return out

    def run(self, experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`experts` (this rank's F/p of each) on the rows of every rank of the group: x [M, d]
        sorted by expert with `counts` [n] on each rank → this rank's M rows of the sum over
        the group of each rank's part [M, d]. The rows are gathered (backward: their
        gradients reduce-scattered), sorted by expert, run, and the results reduce-scattered
        back to the ranks that sent them (backward: gathered)."""
        every = counts.new_empty((self.group.size, counts.numel()))
        comm.all_gather(every.view(-1), counts.contiguous(), self.group)
        sizes = every.sum(dim=1).tolist()
        if not sum(sizes):  # no rank of the group has a row: nothing to exchange
            return experts(x, counts)
        rows = gather_rows(x, self.group, sizes)  # by rank, then expert
        return reduce_scatter_rows(run_by_expert(experts, rows, every), self.group, sizes)
