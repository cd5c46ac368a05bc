"""Routing forced from a workload for the `moe` benchmark: the layer's real top-k router with
its choices replaced (`bench.moe`'s docstring, "How the routing is forced")."""

from __future__ import annotations

from typing import Any

import torch

from interlace.moe.gating import Routing, TopKRouter
from interlace.moe.layer import MoELayer


class ForcedRouter(TopKRouter):
    """A `TopKRouter` that routes each token to `choices` [N, k] (set before each forward; None =
    its own top-k), with gates from its own softmax at those experts and the library's
    capacity and aux loss. Keeps the kept counts [E] of its last forward (`last_kept`)."""

    choices: torch.Tensor | None = None

    def choose(self, probs: torch.Tensor) -> torch.Tensor:
        """`choices` [N, k] for probabilities [N, E], or the top k without them."""
        return super().choose(probs) if self.choices is None else self.choices.to(probs.device)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route x [N, d_model] to `choices` (`TopKRouter.forward`, keeping `last_kept`)."""
        routing = super().forward(x)
        kept = routing.expert_index[routing.keep]
        self.last_kept = torch.bincount(kept, minlength=self.n_experts)
        return routing


def forced_layer(o: dict[str, Any], experts: int, k: int) -> MoELayer:
    """A full `MoELayer` of the options' sizes whose router is a `ForcedRouter` (sharing the
    layer's projection)."""
    layer = MoELayer(o["d_model"], o["ffn"], experts, k, o["capacity_factor"])
    forced = ForcedRouter(o["d_model"], experts, k, o["capacity_factor"])
    forced.proj = layer.router.proj
    layer.router = forced
    return layer
