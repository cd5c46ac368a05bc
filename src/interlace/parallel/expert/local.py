"""`LocalExperts`: the experts an expert-parallel rank keeps of a layer, one module each under
its global index, read in one place: called, they return their parameters stacked.

An expert-parallel layer never calls its experts one by one: it runs them in one grouped call
on their stacked parameters. Reading them through the module's own call gives that read module
hooks, so that FSDP2 (`shard.py`) gathers sharded experts just before it, frees them after,
gathers them again before the stacking's backward and reduce-scatters their gradients at the
end of the backward pass, as it does for any module it shards.
"""

from __future__ import annotations

import torch
from torch import nn

from interlace.moe.grouped import stack_parameters


class LocalExperts(nn.ModuleDict):
    """A layer's local experts ({global index as a string: expert module}, all alike)."""

    def forward(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """{name in one expert: [n, *shape]}: the n experts' parameters stacked in order, cast to
        `dtype` (None: their own); differentiable (`stack_parameters`)."""
        return stack_parameters(list(self.values()), dtype)
