"""The gradient norm of a 1D tensor-parallel model, and clipping by it.

Sharded parameters (those with a `ShardSpec`) hold disjoint pieces of the full tensor: their
squared norms are summed over the tensor parallel group (a grouped-query kv piece held by
several ranks counted once). Replicated parameters hold the same gradient on every rank and
are counted once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from interlace import comm
from interlace.comm import Group
from interlace.parallel.tensor import shard_spec


def grad_norm(parameters: Iterable[torch.Tensor], group: Group | None) -> torch.Tensor:
    """Global L2 norm of the gradients of a tensor-parallel model: sharded pieces summed over
    `group` (kv pieces held by several ranks counted once), replicated ones counted once.
    Collective over `group`: every rank must call it."""
    params = list(parameters)
    device = params[0].device if params else torch.device("cpu")
    sharded = torch.zeros((), device=device)
    replicated = torch.zeros((), device=device)
    for param in params:
        if param.grad is None:
            continue
        square = param.grad.detach().float().pow(2).sum()
        spec = shard_spec(param)
        if spec is None:
            replicated += square
        else:
            sharded += square / spec.replicas
    if group is not None and group.size > 1:
        comm.all_reduce(sharded, group)
    return (sharded + replicated).sqrt()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, group: Group | None
) -> torch.Tensor:
    """Scale gradients in place so their global norm (`grad_norm`) is at most `max_norm`, as
    `torch.nn.utils.clip_grad_norm_` does for one process; returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    norm = grad_norm(params, group)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(scale.to(p.grad.device, p.grad.dtype))
    return norm
