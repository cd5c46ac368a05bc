"""The position-wise feed-forward blocks: GPT-2's (shared by dense layers and MoE experts) and
Llama's gated one.

`up` (and `gate`) are the column-parallel and `down` the row-parallel Linears for tensor
parallelism:

    MLP:       y = down(gelu(up(x)))               up: d_model → ffn_dim, down: ffn_dim → d_model
    SwiGLUMLP: y = down(silu(gate(x)) · up(x))     gate, up: d_model → ffn_dim
"""

import torch
import torch.nn.functional as F
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


class SwiGLUMLP(nn.Module):
    """Llama feed-forward: [..., d_model] → [..., d_model] through a SiLU-gated hidden of
    ffn_dim."""

    def __init__(self, d_model: int, ffn_dim: int, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        self.gate = nn.Linear(d_model, ffn_dim, bias=bias)
        self.up = nn.Linear(d_model, ffn_dim, bias=bias)
        self.down = nn.Linear(ffn_dim, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d_model] → [..., d_model]."""
        return self.dropout(self.down(F.silu(self.gate(x)) * self.up(x)))
