"""MoELayer: a single-device Mixture-of-Experts feed-forward layer.

y_n = Σ_j keep[n, j] · gate[n, j] · expert_{e[n, j]}(x_n) for every token n, where the router
picks e, gate and keep (see `interlace.moe.gating`). A dropped assignment adds nothing; the
residual connection around the layer carries the token unchanged. Each expert is the dense
model's feed-forward, the E of them held as stacked tensors (`interlace.moe.experts`) and
computed in one grouped call (`interlace.moe.grouped`), the kept assignments sorted by expert.
"""

import torch
from torch import nn

from interlace.moe.experts import GroupedExperts
from interlace.moe.gating import TopKRouter, expert_counts
from interlace.moe.permute import from_expert_order, inverse_permutation, to_expert_order


class MoELayer(nn.Module):
    """Router + `experts` (`GroupedExperts`), [B, T, d_model] → [B, T, d_model].

    After each forward, `aux_loss` holds the router's load-balancing loss (a scalar tensor)
    and `last_tokens_per_expert` the [E] assignment counts before capacity drops.
    """

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        n_experts: int,
        top_k: int = 1,
        capacity_factor: float = 1.25,
        dropless: bool = False,
        bias: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.router = TopKRouter(d_model, n_experts, top_k, capacity_factor, dropless)
        self.experts = GroupedExperts(n_experts, d_model, ffn_dim, bias, dropout)
        self.aux_loss = torch.zeros(())
        self.last_tokens_per_expert = torch.zeros(n_experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d_model] → [B, T, d_model]: route tokens, run every expert on its kept tokens
        in one grouped call (no host sync, so torch.compile traces it whatever the routing)."""
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.router(tokens)
        self.aux_loss = routing.aux_loss
        self.last_tokens_per_expert = routing.tokens_per_expert.detach()

        # assignments in token order, the dropped ones as expert E: sorted last, computed by none
        n_experts, top_k = len(self.experts), routing.expert_index.shape[1]
        expert = torch.where(routing.keep, routing.expert_index, n_experts).flatten()
        order = torch.argsort(expert, stable=True)
        counts = expert_counts(expert, n_experts + 1)[:n_experts]
        inverse = inverse_permutation(order)
        rows = to_expert_order(tokens, order, inverse, top_k)
        y = self.experts(rows, counts, routing.capacity)
        out = from_expert_order(y, order, inverse, routing.gate_weight).to(tokens.dtype)
        return out.view_as(x)
