"""Expert tensor parallelism (etp = tp): each expert of an expert-parallel layer split over the
1D tensor parallel group, as a dense feed-forward is.

Expert groups are carved out of the dp groups (`groups.py`), so the p ranks of a tp group hold
the same experts. With etp each holds F/p of every one's hidden features: rank r keeps rows
[r·F/p, (r+1)·F/p) of up (and of its bias) and those columns of down (`ShardSpec(0)` and
`ShardSpec(1)`, recorded as 1D tensor parallelism records them: checkpoints store each piece
as its place in the full expert, and the gradient norm counts each piece once).

The layer then runs as a row-parallel block: its input enters the tensor parallel region (the
gradient all-reduced; under sequence parallelism the sequence all-gathered) and its output
leaves it summed (one all-reduce; the reduce-scatter of the sequence). Every tp rank holds the
same tokens at the layer, so it routes all of them, alike (the router and its input are the
same on every rank): the same routing, count matrix, dispatch and placement on every rank of
the tp group, which computes the same rows on its own features. So each rank dispatches what
a rank of `ep` alone dispatches for those tokens: the dispatch is not shared over tp as with
etp = 1 (`tp_tokens`); every tp rank sends it, and the experts' memory is 1/p in return.

Three sums need a correction, each here:

- an expert's down bias is added by all p ranks: each adds bias/p (`ExpertSplit.params`), so
  each rank's bias gradient is 1/p of the whole, summed over tp with the experts' reduction
  (`split_bias_gradients`; not by a hook: a replicated expert's gradient reaches its owner by
  Agg, after the hooks);
- the aux loss is the whole on every rank, and its gradient reaches the router on every rank
  besides the partial gradient from the gates: its gradient is taken 1/p (`aux_loss`; the
  value is unchanged), so the router's gradient, summed over tp (a hook; under sequence
  parallelism the sequence pass sums it), counts it once;
- an expert piece's gradient is its own over all the group's tokens: summed over ep_dp only,
  not over tp (`expert.step`).

Experts with a structure of their own (`fused.py`: Hugging Face Mixtral, Qwen2-MoE) are not
split; etp = 1 runs them.
"""

from __future__ import annotations

import torch
from torch import nn

from interlace.comm import Group
from interlace.errors import PlanError
from interlace.parallel.expert.fused import FusedExpertParallel
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.parallel.expert.split import ExpertSplit
from interlace.parallel.grad_sums import sum_gradient_over
from interlace.parallel.tensor.layers import enter_block, leave_block
from interlace.parallel.tensor.shard import ShardSpec, shard_column, shard_parameter
from interlace.tensors import local_tensor


def split_experts_over_tp(model: nn.Module, tp: Group, sequence_parallel: bool) -> list[str]:
    """Split the experts of every `ExpertParallelMoE` of `model` over `tp` in place (see the
    module docstring); returns the report line. PlanError, before any change, for experts
    with a structure of their own or a width tp does not divide."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, ExpertParallelMoE)]
    for name, layer in layers:
        if isinstance(layer, FusedExpertParallel):
            raise PlanError(
                f"etp={tp.size} cannot split {name}'s fused experts (a Hugging Face MoE block); "
                "use etp=1"
            )
        width = layer._local_experts()[0].up.out_features
        if width % tp.size:
            raise PlanError(
                f"{name}: expert width {width} is not divisible by etp={tp.size}; use etp=1"
            )
    for _, layer in layers:
        for expert in layer._local_experts():
            shard_column(expert.up, 1, 1, tp)
            expert.down.weight = shard_parameter(expert.down.weight, ShardSpec(1), tp)
            expert.down.in_features = expert.up.out_features
        if not sequence_parallel:  # the sequence pass hooks every replicated layer parameter
            for param in layer.router.parameters():
                sum_gradient_over(param, tp)
        layer.split = ExpertSplit(tp)
        layer.measure_experts()
        enter_block(layer, layer.router.d_model, tp, sequence_parallel)
        leave_block(layer, tp, sequence_parallel)
    how = "sequence all-gathered" if sequence_parallel else "tokens replicated"
    return [
        f"etp={tp.size}: each expert of {len(layers)} expert-parallel layers split over "
        f"{tp.name} ({how}, every rank routing all of them; one "
        f"{'reduce-scatter' if sequence_parallel else 'all-reduce'} of each layer's output)"
    ]


def split_bias_gradients(model: nn.Module) -> list[tuple[Group, list[torch.Tensor]]]:
    """(tp group, the local gradients of its split layers' expert down biases) per group, in
    module order: what `grads.reduce_expert_gradients` sums over tp."""
    by_group: dict[str, tuple[Group, list[torch.Tensor]]] = {}
    for layer in model.modules():
        if not isinstance(layer, ExpertParallelMoE) or layer.split is None:
            continue
        group = layer.split.group
        _, grads = by_group.setdefault(group.name, (group, []))
        for expert in layer._local_experts():
            bias = expert.down.bias
            if bias is not None and bias.grad is not None:
                grads.append(local_tensor(bias.grad))
    return list(by_group.values())
