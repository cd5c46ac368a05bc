"""The token exchange of expert parallelism as autograd functions: `all_to_all_rows` sends rows to
their owner ranks (dispatch, combine) and its backward sends the gradients back by the reverse
split; `keep_in_graph` ties the replicas of a Trans into the graph so its backward (Agg, a
collective) runs on every rank. Experts split over a tensor parallel group (etp) pass their
rows through a conjugate pair of uneven collectives:

    gather_rows           forward all-gather of each rank's rows    backward reduce-scatter
    reduce_scatter_rows   forward each rank's rows of the sum       backward all-gather

(rank r holds `sizes[r]` rows; the collectives move them padded to the largest). Written over
`interlace.comm` so the meter counts both directions."""

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


def gathered_rows(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """Every rank's rows x [sizes[rank], ...] → [Σ sizes, ...] in rank order: one all-gather of
    the rows padded to max(sizes). Not differentiable (`gather_rows` is)."""
    most, rest = max(sizes), x.shape[1:]
    padded = x.contiguous()
    if x.shape[0] < most:
        padded = torch.cat([padded, x.new_zeros((most - x.shape[0], *rest))])
    out = x.new_empty((group.size * most, *rest))
    comm.all_gather(out, padded, group)
    if all(n == most for n in sizes):
        return out
    pieces = zip(out.view(group.size, most, *rest), sizes, strict=True)
    return torch.cat([rows[:n] for rows, n in pieces])


def _scattered_rows(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """Partial sums x [Σ sizes, ...] on every rank → this rank's rows [sizes[rank], ...] of their
    sum over `group`: one reduce-scatter of the rows padded to max(sizes)."""
    most, rest = max(sizes), x.shape[1:]
    if all(n == most for n in sizes):
        padded = x.contiguous()
    else:
        padded = x.new_zeros((group.size, most, *rest))
        for slot, rows in zip(padded, x.split(sizes), strict=True):
            slot[: rows.shape[0]] = rows
        padded = padded.view(group.size * most, *rest)
    out = x.new_empty((most, *rest))
    comm.reduce_scatter(out, padded, group)
    return out[: sizes[group.rank]]


class _Rows(torch.autograd.Function):
    """`gathered_rows` forward and `_scattered_rows` backward (`gather`), or the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, sizes: list[int], gather: bool):
        ctx.group, ctx.sizes, ctx.gather = group, sizes, gather
        return (gathered_rows if gather else _scattered_rows)(x, group, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        conjugate = _scattered_rows if ctx.gather else gathered_rows
        return conjugate(grad, ctx.group, ctx.sizes), None, None, None


def gather_rows(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """This rank's rows x [sizes[rank], ...] → every rank's, [Σ sizes, ...] in rank order;
    backward: each rank's rows of the gradients' sum over the group (their consumers compute
    a part of a sum on every rank)."""
    return _Rows.apply(x, group, sizes, True)


def reduce_scatter_rows(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """Partial sums x [Σ sizes, ...] over the group → this rank's rows [sizes[rank], ...] of their
    sum; backward: every rank's rows' gradients gathered."""
    return _Rows.apply(x, group, sizes, False)
