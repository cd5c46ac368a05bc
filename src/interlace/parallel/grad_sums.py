"""Gradients summed over a group, for replicated parameters whose uses see only part of the data
on each rank of a split (sequence-parallel norms, a router fed one tp rank's share of the
tokens, row-parallel biases): a hook sums the gradient as backward produces it, and the group
is recorded on the parameter so that the sum survives a wrapper that replaces parameters.

FSDP2 replaces each parameter by a sharded one and computes the gradient of an unsharded copy:
a hook on the original never runs. Summing over the group commutes with FSDP2's reduce-scatter
(each rank of the group holds its shard in the same place), so `sum_replaced_gradients` sums
the sharded gradients after it instead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from interlace import comm
from interlace.comm import Group

SUMMED_OVER = "grad_summed_over"
"""Attribute of a parameter: the tuple of groups its gradient is summed over (a router under
ep × tp3d is summed over the x·y ranks that share its tokens and the z slices of the rows), or
of `Slots` it is summed among."""


@dataclass(frozen=True)
class Slots:
    """The ranks of `group` cut into `parts` runs of consecutive ranks, each holding one piece
    (a grouped-query kv head held by several tensor parallel ranks); this rank's run is
    `slot`. `sum` adds a gradient over the ranks of its run only."""

    group: Group
    parts: int
    slot: int

    def sum(self, grad: torch.Tensor) -> torch.Tensor:
        """Σ of `grad` over this rank's run: one all-reduce of [parts, *grad] over the group,
        each rank writing its own slot."""
        slots = grad.new_zeros((self.parts, *grad.shape))
        slots[self.slot] = grad
        comm.all_reduce(slots, self.group)
        return slots[self.slot]


def sum_gradient_among(param: torch.Tensor, slots: Slots) -> None:
    """Make `param`'s gradient its sum over its run of `slots`: a hook now, and the slots
    recorded for `sum_replaced_gradients`."""
    param.register_hook(slots.sum)
    setattr(param, SUMMED_OVER, (*getattr(param, SUMMED_OVER, ()), slots))


def sum_gradient_over(param: torch.Tensor, group: Group) -> None:
    """Make `param`'s gradient its sum over `group` (as well as over any group it is summed
    over already): a hook now, and the group recorded for `sum_replaced_gradients`."""
    param.register_hook(lambda grad: _summed(grad, group))
    setattr(param, SUMMED_OVER, (*getattr(param, SUMMED_OVER, ()), group))


def _summed(grad: torch.Tensor, group: Group) -> torch.Tensor:
    """Σ over `group` of `grad`, as a new tensor (a hook must not change its input)."""
    out = grad.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group)
    return out


def sum_replaced_gradients(parameters: Iterable[torch.Tensor]) -> None:
    """Sum over its recorded groups the gradient of each parameter that replaced one with
    hooks (a DTensor: FSDP2's shard), one flat all-reduce per group, and among its recorded
    `Slots` (the ranks holding one piece hold their shards of it in the same place), one
    all-reduce each; collective over each group."""
    groups: dict[str, tuple[Group, list[torch.Tensor]]] = defaultdict(lambda: (None, []))
    for param in parameters:
        if not isinstance(param, DTensor) or param.grad is None:
            continue
        for summed in getattr(param, SUMMED_OVER, ()):
            local = param.grad.to_local()
            if isinstance(summed, Slots):
                local.copy_(summed.sum(local))
                continue
            groups[summed.name] = (summed, [*groups[summed.name][1], local])
    for group, grads in groups.values():
        comm.all_reduce_flat_(grads, group)
