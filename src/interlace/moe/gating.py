"""Top-k token routing for Mixture-of-Experts layers (Switch top-1, GShard top-2).

The router only decides; it computes no expert. Given N tokens it returns, per token, its k
experts, their gate weights and whether each assignment fits in the expert's capacity, plus the
load-balancing loss and the per-expert token counts. The local MoE layer, the expert-parallel
layer and the load balancer all consume the same `Routing`.

- probs = softmax(x · Wᵀ) in fp32, [N, E]; the k largest per token are its experts.
- top-2 gate weights are renormalised to sum to 1 (GShard); top-1 keeps the raw probability.
- capacity C = ceil(capacity_factor · N · k / E). Assignments claim slots in priority order:
  every token's first choice before any second choice, then by token order; an assignment
  beyond C is dropped. `dropless=True` means no capacity.
- aux loss = E · Σ_e f_e · P_e with f_e the fraction of tokens whose first choice is e and
  P_e the mean router probability of e (Switch Transformer eq. 4); 1 when perfectly balanced.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from interlace.errors import ConfigError


@dataclass
class Routing:
    """One routing decision for N tokens, k choices each, over E experts.

    expert_index: [N, k] long, the chosen experts, best first.
    gate_weight: [N, k] fp32, the weight of each chosen expert's output.
    keep: [N, k] bool, False where the assignment overflowed its expert's capacity.
    aux_loss: [] fp32, the load-balancing loss (differentiable through the router).
    tokens_per_expert: [E] long, assignments per expert before any drop (sums to N·k).
    capacity: slots per expert, or None when dropless.
    """

    expert_index: torch.Tensor
    gate_weight: torch.Tensor
    keep: torch.Tensor
    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    capacity: int | None


class TopKRouter(nn.Module):
    """Linear router without bias, [N, d_model] → Routing over n_experts with top_k choices."""

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int = 1,
        capacity_factor: float = 1.25,
        dropless: bool = False,
    ):
        super().__init__()
        if top_k not in (1, 2) or top_k > n_experts:
            raise ConfigError(
                f"top_k={top_k} with n_experts={n_experts} is invalid; use top_k=1, "
                "or top_k=2 with n_experts>=2"
            )
        self.d_model = d_model
        self.n_experts = n_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.dropless = dropless
        self.proj = nn.Linear(d_model, n_experts, bias=False)

    def capacity(self, num_tokens: int) -> int | None:
        """Slots per expert for num_tokens tokens: ceil(factor · N · k / E), None if dropless."""
        if self.dropless:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.n_experts)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route tokens x [N, d_model]; see the module docstring for the rules."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.proj.weight.float())
        probs = logits.softmax(dim=-1)
        expert_index = self.choose(probs)
        top_probs = probs.gather(1, expert_index)
        gate_weight = top_probs if self.top_k == 1 else top_probs / top_probs.sum(-1, keepdim=True)

        first_choice_share = expert_counts(expert_index[:, 0], self.n_experts)
        first_choice_share = first_choice_share.float() / x.shape[0]
        aux_loss = self.n_experts * (first_choice_share * probs.mean(dim=0)).sum()

        tokens_per_expert = expert_counts(expert_index.flatten(), self.n_experts)
        capacity = self.capacity(x.shape[0])
        if capacity is None:
            keep = torch.ones_like(expert_index, dtype=torch.bool)
        else:
            keep = _slot_in_expert(expert_index, self.n_experts) < capacity
        return Routing(expert_index, gate_weight, keep, aux_loss, tokens_per_expert, capacity)

    def choose(self, probs: torch.Tensor) -> torch.Tensor:
        """The experts of each token, [N, k], from the router's probabilities [N, E]: top k."""
        return probs.topk(self.top_k, dim=-1).indices


def expert_counts(expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert [n_experts] (long) of the expert indices `expert` [M], each in
    [0, n_experts): a one-hot comparison summed over M. Static shapes and no host sync (unlike
    torch.bincount), and no scatter: CUDA runs an accumulating index_add into E bins as a
    sorting kernel, which cost a fifth of an MoE step on an H200."""
    return (expert.unsqueeze(-1) == _expert_ids(n_experts, expert.device)).sum(0)


def _expert_ids(n_experts: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n_experts, device=device)


def _slot_in_expert(expert_index: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Queue position of each assignment [N, k] at its expert, first choices before second ones.

    Assignments are ordered choice-major ([all first choices, all second choices]); an
    assignment's slot is the number of assignments before it in that order with the same
    expert: a running count down a one-hot [N·k, E] (no sort, no scatter).
    """
    by_priority = expert_index.t().flatten()
    hits = by_priority.unsqueeze(-1) == _expert_ids(n_experts, by_priority.device)
    seen = hits.cumsum(0, dtype=torch.int32)  # assignments to each expert up to this one
    slot = seen.gather(1, by_priority.unsqueeze(-1)).squeeze(-1) - 1
    return slot.view(expert_index.shape[1], -1).t()
