"""The gradient norm of a model split over ranks, and clipping by it.

Every split works the same way: a rank's parameter either holds a piece of the full gradient
that no other rank of the groups holds, or a copy that `h` ranks of the groups hold alike
(replicated parameters, grouped-query kv pieces, replicated biases). Dividing each squared
norm by its number of holders and summing over the groups counts every piece exactly once:

    ‖g‖² = Σ_groups Σ_p ‖g_p‖² / holders(p)

`grad_norm` and `clip_grad_norm_` are the 1D tensor-parallel case; expert parallelism
(`interlace.parallel.expert.layer`) and 3D tensor parallelism (`interlace.parallel.tensor3d`) pass
their own `holders`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from interlace import comm
from interlace.comm import Group
from interlace.parallel.tensor.shard import shard_spec


def split_grad_norm(
    parameters: Iterable[torch.Tensor],
    holders: Callable[[torch.Tensor], int],
    groups: Sequence[Group],
) -> torch.Tensor:
    """Global L2 norm (a 0-d tensor, equal on every rank) of the gradients of this rank's
    `parameters`, each squared norm divided by `holders(p)` (ranks of `groups` holding the same
    gradient) and summed over `groups`. Collective over every group of more than one rank."""
    params = [p for p in parameters if p.grad is not None]
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), device=device)
    for p in params:
        total += p.grad.detach().float().pow(2).sum() / holders(p)
    for group in groups:
        if group.size > 1:
            comm.all_reduce(total, group)
    return total.sqrt()


def clip_to_norm_(parameters: Iterable[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients in place by min(1, max_norm / norm), as
    `torch.nn.utils.clip_grad_norm_` does once it has the norm."""
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in parameters:
        if p.grad is not None:
            p.grad.detach().mul_(scale.to(p.grad.device, p.grad.dtype))


def grad_norm(parameters: Iterable[torch.Tensor], group: Group | None) -> torch.Tensor:
    """Global L2 norm of the gradients of a 1D tensor-parallel model: sharded pieces summed over
    `group` (kv pieces held by several ranks counted once), replicated ones counted once.
    Collective over `group`: every rank must call it."""
    size = group.size if group is not None else 1

    def holders(p: torch.Tensor) -> int:
        spec = shard_spec(p)
        return size if spec is None else spec.replicas

    return split_grad_norm(parameters, holders, [group] if group is not None else [])


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, group: Group | None
) -> torch.Tensor:
    """Scale gradients in place so their global norm (`grad_norm`) is at most `max_norm`, as
    `torch.nn.utils.clip_grad_norm_` does for one process; returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    norm = grad_norm(params, group)
    clip_to_norm_(params, norm, max_norm)
    return norm
