"""The token exchange of expert parallelism as autograd functions: `all_to_all_rows` sends rows to
their owner ranks (dispatch, combine) and its backward sends the gradients back by the reverse
split; `keep_in_graph` ties the replicas of a Trans into the graph so its backward (Agg, a
collective) runs on every rank. Written over `interlace.comm` so the meter counts both
directions."""

from __future__ import annotations

import torch

from interlace import comm
from interlace.comm import Group


def _exchange(
    x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """all_to_all_single of the rows of x [Σ input_splits, ...] → [Σ output_splits, ...]."""
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    comm.all_to_all(out, x, group, output_splits, input_splits)
    return out


class _AllToAll(torch.autograd.Function):
    """Forward: rows to ranks by `input_splits`; backward: gradients back by the reverse."""

    @staticmethod
    def forward(ctx, x, group: Group, output_splits: list[int], input_splits: list[int]):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _exchange(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, ctx.group, input_splits, output_splits), None, None, None


class _KeepInGraph(torch.autograd.Function):
    """Identity on `out` that also consumes `replicas` (gradient zero), so that Trans's backward
    (a collective) runs on every rank, even one that received no replica or used none."""

    @staticmethod
    def forward(ctx, out, replicas):
        ctx.replica_shape = replicas.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_zeros(ctx.replica_shape)


def all_to_all_rows(
    x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """Rows of x [Σ input_splits, ...] to the ranks of `group` (input_splits[r] rows to rank r)
    → the rows received [Σ output_splits, ...]; backward: the reverse exchange."""
    return _AllToAll.apply(x, group, output_splits, input_splits)


def keep_in_graph(out: torch.Tensor, replicas: torch.Tensor) -> torch.Tensor:
    """`out` unchanged, with `replicas` (any shape) an input of its graph (gradient zero)."""
    return _KeepInGraph.apply(out, replicas)
