"""The gradients of expert-parallel layers: which parameters are experts (left out of the data
parallel all-reduce), their reduction over the ranks holding the same experts, and the global
norm that counts each expert once."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from interlace import comm
from interlace.comm import Group
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.parallel.expert.tp_split import split_bias_gradients
from interlace.parallel.grad_norm import NormShare
from interlace.tensors import local_tensor


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


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert parameters of every `ExpertParallelMoE` in `model`, in module order."""
    return [
        p
        for module in model.modules()
        if isinstance(module, ExpertParallelMoE)
        for p in module.experts.parameters()
    ]


def reduce_expert_gradients(
    model: nn.Module, ep_dp: Group | None, dp_size: int, others: Sequence[Group] = ()
) -> None:
    """Turn each local expert's gradient (the sum over the tokens its expert group dispatched)
    into data parallelism's average: sum over the ranks holding the same experts, `ep_dp` and
    `others` (groups whose ranks dispatch other tokens: ep × tp's tp, `tp_tokens`; tp3d's x·y
    ranks and z slices), divide by `dp_size` (the whole data parallel degree). One flat
    all-reduce per group; collective over ep_dp (None: already reduced there, as FSDP2 does
    for sharded experts) and each of `others`. A sharded gradient is reduced by its local
    piece (the pieces lie alike on every tp rank). Experts split over tp (etp) add their down
    biases' sums over tp (`tp_split.split_bias_gradients`)."""
    grads = [local_tensor(p.grad) for p in expert_parameters(model) if p.grad is not None]
    if ep_dp is not None:
        comm.all_reduce_flat_(grads, ep_dp, dp_size)
    for group in others:
        comm.all_reduce_flat_(grads, group)
    for group, biases in split_bias_gradients(model):  # etp: each rank added bias / p
        comm.all_reduce_flat_(biases, group)


def expert_norm_share(model: nn.Module, ep: Group) -> NormShare:
    """Expert parallelism's share of the gradient norm: a local expert's gradient is this rank's
    alone in `ep`; every other parameter is replicated over it."""
    experts = {id(p) for p in expert_parameters(model)}
    return NormShare(ep, lambda p: 1 if id(p) in experts else ep.size)
