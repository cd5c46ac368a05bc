"""MoELayer: a single-device Mixture-of-Experts feed-forward layer.

y_n = Σ_j keep[n, j] · gate[n, j] · expert_{e[n, j]}(x_n) for every token n, where the router
picks e, gate and keep (see `interlace.moe.gating`). A dropped assignment adds nothing; the
residual connection around the layer carries the token unchanged. Each expert is the dense
model's `MLP`, so tensor-parallel code finds experts by the same structure as dense FFNs.
"""

import torch
from torch import nn

from interlace.models.mlp import MLP
from interlace.moe.gating import TopKRouter


class MoELayer(nn.Module):
    """Router + `experts` (nn.ModuleList of MLP), [B, T, d_model] → [B, T, d_model].

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
        self.experts = nn.ModuleList(MLP(d_model, ffn_dim, bias, dropout) for _ in range(n_experts))
        self.aux_loss = torch.zeros(())
        self.last_tokens_per_expert = torch.zeros(n_experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d_model] → [B, T, d_model]: route tokens, run each expert on its kept tokens."""
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.router(tokens)
        self.aux_loss = routing.aux_loss
        self.last_tokens_per_expert = routing.tokens_per_expert.detach()

        token_index = torch.arange(tokens.shape[0], device=x.device)
        token_index = token_index.unsqueeze(1).expand_as(routing.expert_index)
        kept_expert = routing.expert_index[routing.keep]
        order = torch.argsort(kept_expert, stable=True)
        kept_token = token_index[routing.keep][order]
        kept_gate = routing.gate_weight[routing.keep][order]
        counts = torch.bincount(kept_expert, minlength=len(self.experts)).tolist()

        out = torch.zeros_like(tokens)
        for expert, token, gate in zip(
            self.experts, kept_token.split(counts), kept_gate.split(counts), strict=True
        ):
            y = expert(tokens[token]) * gate.unsqueeze(1).to(tokens.dtype)
            out.index_add_(0, token, y)
        return out.view_as(x)
