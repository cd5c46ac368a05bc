"""Tokens to expert order and back, as gathers in both directions.

An MoE layer reads its N tokens' k assignments in expert order (`order`, a permutation of the
N·k assignments) and sums each token's k outputs back. Written with `index_select` and
`index_add`, the backward passes scatter with accumulation, which CUDA runs as a sorting kernel
(and torch.compile lowers to the same): on an H100 it cost a fifth of a MoE step. Since `order`
is a permutation, the way back is a gather by its inverse, hence this autograd function
(torch has no differentiable permutation of rows).
"""

from __future__ import annotations

import torch


class _PermuteRows(torch.autograd.Function):
    """rows [M, ...] → rows[perm]; backward: grad[inverse], with inverse = argsort(perm)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor):
        ctx.save_for_backward(inverse)
        return rows.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def to_expert_order(
    tokens: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int
) -> torch.Tensor:
    """tokens [N, d] → assignment rows [N·k, d] in `order` (a permutation of the N·k
    token-major assignments, token t's c-th at t·k + c; `inverse` its inverse)."""
    rows = tokens.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, tokens.shape[-1])
    return _PermuteRows.apply(rows, order, inverse)


def from_expert_order(
    rows: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Inverse of `to_expert_order`, each token's k rows weighted and summed: rows [N·k, d] in
    `order`, weights [N, k] → [N, d] (in the promoted dtype of the two)."""
    token_major = _PermuteRows.apply(rows, inverse, order)
    n, k = weights.shape
    return (token_major.view(n, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inverse [M] with inverse[perm[i]] = i, for a permutation `perm` [M] of 0..M-1."""
    positions = torch.arange(perm.numel(), device=perm.device)
    return torch.empty_like(perm).scatter_(0, perm, positions)
