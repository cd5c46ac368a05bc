"""`ExpertSplit`: what an expert-parallel layer whose experts are split over the tensor parallel
group (etp = tp, `tp_split`) changes in its own computation: each rank's share of the down
bias and of the aux loss's gradient. Apart from `tp_split`, so that the layer can hold one
without importing what builds it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from interlace.comm import Group


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

    def aux_loss(self, aux: torch.Tensor) -> torch.Tensor:
        """The aux loss (0-d), its value unchanged, its gradient 1/p."""
        share = aux / self.group.size
        return share + (aux - share).detach()
