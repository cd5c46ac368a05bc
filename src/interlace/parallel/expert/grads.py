"""The gradients of expert-parallel layers: which parameters are experts (left out of the data
parallel all-reduce), their reduction over the ranks holding the same experts, and the global
norm that counts each expert once."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from interlace import comm
from interlace.comm import Group
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.parallel.grad_norm import clip_to_norm_, split_grad_norm


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Qualified names of the expert parameters of every `ExpertParallelMoE` in `model` (to
    leave out of the data parallel all-reduce, e.g. with DDP's
    `_set_params_and_buffers_to_ignore_for_model`)."""
    return [
        f"{name}.experts.{pname}"
        for name, module in model.named_modules()
        if isinstance(module, ExpertParallelMoE)
        for pname, _ in module.experts.named_parameters()
    ]


def _expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [
        p
        for module in model.modules()
        if isinstance(module, ExpertParallelMoE)
        for p in module.experts.parameters()
    ]


def reduce_expert_gradients(model: nn.Module, ep_dp: Group, dp_size: int) -> None:
    """Turn each local expert's gradient (the sum over its expert group's tokens) into data
    parallelism's average: sum over `ep_dp` (ranks holding the same experts), divide by
    `dp_size` (the whole data parallel degree). One flat all-reduce; collective over ep_dp."""
    grads = [p.grad for p in _expert_params(model) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if ep_dp.size > 1:
        comm.all_reduce(flat, ep_dp)
    flat.div_(dp_size)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(piece.view_as(g))


def grad_norm(parameters: Iterable[nn.Parameter], model: nn.Module, ep: Group) -> torch.Tensor:
    """Global L2 norm of the gradients of `parameters` when `model`'s experts are split over
    `ep`: expert squares summed over the group, the rest (replicated) counted once.
    Collective over `ep`."""
    experts = {id(p) for p in _expert_params(model)}
    return split_grad_norm(parameters, lambda p: 1 if id(p) in experts else ep.size, [ep])


def clip_grad_norm_(model: nn.Module, max_norm: float, ep: Group) -> torch.Tensor:
    """Scale `model`'s gradients in place so their global norm (`grad_norm`) is at most
    `max_norm`, as `torch.nn.utils.clip_grad_norm_` does for one process; returns the norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = grad_norm(params, model, ep)
    clip_to_norm_(params, norm, max_norm)
    return norm
