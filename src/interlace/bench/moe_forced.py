"""Routing forced from a workload for the `moe` benchmark: the layer's real top-k router with
its choices replaced (`bench.moe`'s docstring, "How the routing is forced")."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from interlace.moe.gating import Routing, TopKRouter, _slot_in_expert
from interlace.moe.layer import MoELayer


class ForcedRouter(TopKRouter):
    """A `TopKRouter` that routes each token to `choices` [N, k] (set before each forward; None =
    its own top-k), with gates from its own softmax at those experts. Keeps the kept counts [E]
    of its last forward."""

    choices: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> Routing:
        """Route x [N, d_model] to `choices`, with the library's gates, capacity and aux loss."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.proj.weight.float())
        probs = logits.softmax(dim=-1)
        if self.choices is None:
            expert_index = probs.topk(self.top_k, dim=-1).indices
        else:
            expert_index = self.choices.to(x.device)
        top_probs = probs.gather(1, expert_index)
        gate = top_probs if self.top_k == 1 else top_probs / top_probs.sum(-1, keepdim=True)
        first = torch.bincount(expert_index[:, 0], minlength=self.n_experts).float() / len(x)
        aux_loss = self.n_experts * (first * probs.mean(dim=0)).sum()
        routed = torch.bincount(expert_index.flatten(), minlength=self.n_experts)
        capacity = self.capacity(x.shape[0])
        if capacity is None:
            keep = torch.ones_like(expert_index, dtype=torch.bool)
        else:
            keep = _slot_in_expert(expert_index, routed) < capacity
        self.last_kept = torch.bincount(expert_index[keep], minlength=self.n_experts)
        return Routing(expert_index, gate, keep, aux_loss, routed, capacity)


def forced_layer(o: dict[str, Any], experts: int, k: int) -> MoELayer:
    """A full `MoELayer` of the options' sizes whose router is a `ForcedRouter` (sharing the
    layer's projection)."""
    layer = MoELayer(o["d_model"], o["ffn"], experts, k, o["capacity_factor"])
    forced = ForcedRouter(o["d_model"], experts, k, o["capacity_factor"])
    forced.proj = layer.router.proj
    layer.router = forced
    return layer
