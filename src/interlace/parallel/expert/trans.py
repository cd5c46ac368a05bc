"""Trans and Agg of the expert-parallel layer: replicas of busy experts broadcast from their
owners (Trans, an autograd function), and their gradients reduced back to the owners (Agg,
its backward); `InFlight` holds a Trans issued ahead of the layer that needs it.

Split out of `interlace.parallel.expert.layer`, whose module docstring describes the scheme."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from interlace import comm
from interlace.comm import Group
from interlace.moe.balance import Placement


@dataclass(frozen=True)
class TransRoute:
    """Who sends which replicated expert to whom, for one placement, seen from one rank.

    local: experts this rank owns; numel: parameters per expert (flattened);
    send_rows: local expert index of each expert sent, ordered by destination rank, then expert;
    send_numel / recv_numel: [D] elements sent to / received from each rank;
    recv_experts: global index of each expert received, ascending (= arrival order).
    """

    local: int
    numel: int
    send_rows: tuple[int, ...]
    send_numel: list[int]
    recv_numel: list[int]
    recv_experts: tuple[int, ...]

    @classmethod
    def build(cls, placement: Placement, rank: int, numel: int) -> TransRoute:
        """The route of `placement`'s replicas for `rank` (experts of `numel` parameters)."""
        d = placement.num_devices
        local = placement.num_experts // d
        send_rows: list[int] = []
        send_numel, recv_numel = [0] * d, [0] * d
        recv_experts: list[int] = []
        for dest in range(d):
            for e in placement.replicated:
                if placement.owner[e] == rank and dest in placement.replicas[e]:
                    send_rows.append(e - rank * local)
                    send_numel[dest] += numel
        for e in placement.replicated:
            if rank in placement.replicas[e]:
                recv_experts.append(e)
                recv_numel[placement.owner[e]] += numel
        return cls(local, numel, tuple(send_rows), send_numel, recv_numel, tuple(recv_experts))


class Trans(torch.autograd.Function):
    """Forward (Trans): owners send replicated experts' flat parameters to the replica ranks.
    Backward (Agg): replicas send their gradients back; owners sum them into their own.

    Inputs are all local experts' parameters (every rank has some, so the node exists on every
    rank); the output is the flat parameters of the experts replicated here, [len(recv_experts)
    · numel], ascending by expert. With `overlap`, both directions are issued asynchronously:
    the forward appends its work handle to `works` and returns the buffer still filling (wait
    on the handle before reading it); the backward returns no parameter gradients and instead
    queues, for the end of the backward pass, a wait and the addition of the replicas'
    gradients into the owner's `.grad`.
    """

    @staticmethod
    def forward(ctx, route: TransRoute, group: Group, overlap: bool, works: list, *params):
        ctx.route, ctx.group, ctx.overlap = route, group, overlap
        ctx.shapes = [p.shape for p in params]
        ctx.params = params if overlap else ()
        per_expert = len(params) // route.local
        pieces = [
            p.reshape(-1) for row in route.send_rows for p in _of_expert(params, row, per_expert)
        ]
        send = torch.cat(pieces) if pieces else params[0].new_empty(0)
        out = send.new_empty(sum(route.recv_numel))
        works.append(comm.all_to_all(out, send, group, route.recv_numel, route.send_numel, overlap))
        return out

    @staticmethod
    def backward(ctx, grad):
        route = ctx.route
        grad = grad.contiguous()
        back = grad.new_empty(sum(route.send_numel))
        work = comm.all_to_all(
            back, grad, ctx.group, route.send_numel, route.recv_numel, ctx.overlap
        )
        if not ctx.overlap:
            return None, None, None, None, *_owner_grads(back, route, ctx.shapes)

        def add_into_owner() -> None:  # Agg waited at the end of the backward pass
            work.wait()
            for p, g in zip(ctx.params, _owner_grads(back, route, ctx.shapes), strict=True):
                if g is not None:
                    p.grad = g.clone() if p.grad is None else p.grad.add_(g)

        torch.autograd.Variable._execution_engine.queue_callback(add_into_owner)
        return None, None, None, None, *([None] * len(ctx.shapes))


def _owner_grads(
    back: torch.Tensor, route: TransRoute, shapes: list[torch.Size]
) -> list[torch.Tensor | None]:
    """The replicas' gradients `back` [len(send_rows) · numel], summed per local expert and
    cut into its parameters' shapes; None for the parameters of experts not replicated."""
    summed: dict[int, torch.Tensor] = {}  # local expert → its replicas' summed gradient
    for row, piece in zip(route.send_rows, back.view(-1, route.numel), strict=True):
        summed[row] = summed[row] + piece if row in summed else piece
    per_expert = len(shapes) // route.local
    grads: list[torch.Tensor | None] = [None] * len(shapes)
    for row, flat in summed.items():
        own = _of_expert(shapes, row, per_expert)
        pieces = flat.split([math.prod(shape) for shape in own])
        for i, (piece, shape) in enumerate(zip(pieces, own, strict=True)):
            grads[row * per_expert + i] = piece.view(shape)
    return grads


@dataclass
class InFlight:
    """A layer's Trans, issued (maybe ahead of the layer): its placement, the replicas' flat
    parameters [experts · numel] (None when nothing is replicated) and their global indices,
    the pending work handle (None once complete) and the versions of the parameters sent."""

    placement: Placement
    replicas: torch.Tensor | None
    experts: tuple[int, ...]
    work: dist.Work | None
    versions: tuple[int, ...]

    def wait(self) -> torch.Tensor | None:
        """The replicas' parameters, once they have arrived."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.replicas


def _of_expert(items: list | tuple, row: int, per_expert: int) -> list | tuple:
    """The `per_expert` consecutive entries of local expert `row` in an expert-major list."""
    return items[row * per_expert : (row + 1) * per_expert]
