"""The position-wise feed-forward block shared by dense GPT layers and MoE experts.

`up` is the column-parallel and `down` the row-parallel Linear for tensor parallelism:
y = down(gelu(up(x))), with up: d_model → ffn_dim and down: ffn_dim → d_model.
"""

import torch
from torch import nn


class MLP(nn.Module):
    """GPT-2 feed-forward: [..., d_model] → [..., d_model] through a GELU hidden of ffn_dim."""

    def __init__(self, d_model: int, ffn_dim: int, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        self.up = nn.Linear(d_model, ffn_dim, bias=bias)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(ffn_dim, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d_model] → [..., d_model]."""
        return self.dropout(self.down(self.act(self.up(x))))
