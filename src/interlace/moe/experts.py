"""An MoE layer's E experts held as stacked tensors: `GroupedExperts`.

Every expert is the dense model's feed-forward (`MLP`: y = down · gelu(up · x + up.bias) +
down.bias), its weights held for all E experts at once in nn.Linear's layout: up_weight
[E, F, d], up_bias [E, F], down_weight [E, d, F], down_bias [E, d] (the tensors
`interlace.moe.grouped` computes on). A layer is four tensors whatever E: one graph input, one
gradient accumulation and one optimizer entry each, where one module per expert made 4·E of
them (on an H100, the host work for 768 expert tensors left the device idle between the MoE
blocks of a 1.7 B-parameter model).

Expert parallelism keeps and moves experts one by one (placements, replicas), so it holds its
experts as `MLP` modules again, copied out by `expert(e)` and registered under their index:
`<layer>.experts.<e>.up.weight` is `<layer>.experts.up_weight`[e]. Checkpoints store every
expert under that per-expert key whatever holds it (`checkpoint_slices`, `expert_keys`), so a
checkpoint resumes with or without expert parallelism, and checkpoints written when experts
were modules load unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from interlace.models.mlp import MLP
from interlace.moe.grouped import mlp_experts

STORED_AS = {
    "up_weight": "up.weight",
    "up_bias": "up.bias",
    "down_weight": "down.weight",
    "down_bias": "down.bias",
}
"""Each stacked tensor's name → the name of its slice in one expert (`MLP`), in order."""


class GroupedExperts(nn.Module):
    """E feed-forward experts d → F → d, stacked: x [M, d] sorted by expert, counts [E] →
    [M, d] (`forward`). `len()` is E; `expert(e)` copies expert e out as an `MLP`."""

    def __init__(
        self, n_experts: int, d_model: int, ffn_dim: int, bias: bool = True, dropout: float = 0.0
    ):
        super().__init__()
        self.d_model, self.ffn_dim, self.bias = d_model, ffn_dim, bias
        shapes = {
            "up_weight": (n_experts, ffn_dim, d_model),
            "up_bias": (n_experts, ffn_dim),
            "down_weight": (n_experts, d_model, ffn_dim),
            "down_bias": (n_experts, d_model),
        }
        for name, shape in shapes.items():
            if bias or name.endswith("weight"):
                self.register_parameter(name, nn.Parameter(torch.empty(shape)))
        self.act = nn.GELU(approximate="tanh")
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert initialised as its nn.Linear would be: uniform in ±1/√fan_in."""
        for name, param in self.named_parameters():
            fan_in = getattr(self, name.replace("bias", "weight")).shape[-1]
            nn.init.uniform_(param, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def init_gpt2_(self, std: float, residual_std: float) -> None:
        """GPT-2's init of each expert's Linears: up N(0, std), down (a residual projection)
        N(0, residual_std), zero biases."""
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            else:
                nn.init.normal_(param, 0.0, std if name == "up_weight" else residual_std)

    def __len__(self) -> int:
        return self.up_weight.shape[0]

    def expert(self, e: int) -> MLP:
        """Expert `e` as an `MLP` of its own, holding copies of its slices."""
        with torch.device(self.up_weight.device):
            mlp = MLP(self.d_model, self.ffn_dim, self.bias, self.dropout.p)
        mlp.to(dtype=self.up_weight.dtype)
        with torch.no_grad():
            for name, param in self.named_parameters():
                mlp.get_parameter(STORED_AS[name]).copy_(param[e])
        return mlp

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor, rows: int | None = None
    ) -> torch.Tensor:
        """x [M, d] sorted by expert, `counts` [E] rows each → [M, d] (rows past Σ counts: zero),
        every expert in one grouped call; `rows` as for `grouped_mlp`."""
        params = {STORED_AS[name]: param for name, param in self.named_parameters()}
        return mlp_experts(self, params, x, counts, rows)

    def checkpoint_slices(self) -> dict[str, list[str]]:
        """{parameter name: the checkpoint keys of its E slices along the first dimension,
        relative to this module}: every expert stored as its own `MLP` would be."""
        return {name: expert_keys(name, len(self)) for name, _ in self.named_parameters()}


def expert_keys(name: str, n_experts: int) -> list[str]:
    """The keys under which a checkpoint stores the `n_experts` slices of the stacked tensor
    `name` (`[<layer>.experts.]up_weight` → `[<layer>.experts.]<e>.up.weight`)."""
    prefix, _, leaf = name.rpartition(".")
    return [".".join(filter(None, (prefix, str(e), STORED_AS[leaf]))) for e in range(n_experts)]
