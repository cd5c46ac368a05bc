"""The gradient norm of a model split over ranks, and clipping by it: one `clip_grad_norm_` for
every plan.

Every split works the same way: a rank's parameter either holds a piece of the full gradient
that no other rank of a group holds, or a copy that `h` ranks of the group hold alike
(replicated parameters, grouped-query kv pieces, replicated biases, the two ends of a tied
embedding). Each model-parallel dimension contributes a `NormShare`: its group and, per
parameter, how many of the group's ranks hold that gradient. Dividing each squared norm by the
product of its holders over all shares and summing over every share's group counts every piece
exactly once:

    ‖g‖² = Σ_ranks Σ_p ‖g_p‖² / Π_shares holders_s(p)

The groups must be distinct axes of the mesh (tp; tp_x, tp_y, tp_z; ep; pp; dp_shard): the
squares are all-reduced over one after the other. Data parallel replicas hold equal gradients
after their reduction and are not a share. A gradient sharded by FSDP2 (a DTensor) counts by its
local piece, and sharded data parallelism is a share like the others.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils import get_total_norm

from interlace import comm
from interlace.comm import Group
from interlace.tensors import local_tensor


@dataclass(frozen=True)
class NormShare:
    """One model-parallel group, and for each parameter the number of its ranks holding the same
    gradient (1: a piece no other rank of the group holds; group.size: replicated)."""

    group: Group
    holders: Callable[[torch.Tensor], int]


def grad_norm(parameters: Iterable[torch.Tensor], shares: Sequence[NormShare] = ()) -> torch.Tensor:
    """Global L2 norm (a 0-d fp32 tensor, equal on every rank) of the whole model's gradient,
    from this rank's `parameters`; collective over every share's group (every rank calls it).
    The local part is torch's multi-tensor norm over the gradients alike in holders (a few
    kernels, not a few per parameter)."""
    return _norm(_local_grads(parameters), shares)


def _norm(grads: dict[torch.Tensor, torch.Tensor], shares: Sequence[NormShare]) -> torch.Tensor:
    """`grad_norm` of {parameter: this rank's piece of its gradient}."""
    by_holders: dict[int, list[torch.Tensor]] = defaultdict(list)
    for p, grad in grads.items():
        by_holders[math.prod(share.holders(p) for share in shares)].append(grad)
    device = next(iter(grads.values())).device if grads else torch.device("cpu")
    total = torch.zeros((), device=device)
    for held, group in by_holders.items():
        total += get_total_norm(group, foreach=True).float().square() / held
    for share in shares:
        if share.group.size > 1:
            comm.all_reduce(total, share.group)
    return total.sqrt()


def _local_grads(parameters: Iterable[torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
    """{parameter: this rank's piece of its gradient} for the parameters that have one."""
    return {p: local_tensor(p.grad).detach() for p in parameters if p.grad is not None}


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, shares: Sequence[NormShare] = ()
) -> torch.Tensor:
    """Scale the gradients in place by min(1, max_norm / ‖g‖), as `torch.nn.utils.clip_grad_norm_`
    does for one process, with ‖g‖ the `grad_norm` over `shares`; returns ‖g‖ before clipping
    (max_norm = inf: only measure it)."""
    grads = _local_grads(parameters)
    norm = _norm(grads, shares)
    if math.isfinite(max_norm):
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for grad in grads.values():
            by_dtype[grad.dtype].append(grad)
        for dtype, grads in by_dtype.items():
            torch._foreach_mul_(grads, scale.to(dtype))  # what torch's own clipping calls
    return norm
