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

The fused experts of a Hugging Face MoE block (`fused.py`: Mixtral, Qwen2-MoE) split the same
way: rank r keeps its F/p rows of the gate and of the up part of gate|up (`ShardSpec(0,
segments=2)`, gate rows first, as the fused tensor holds them) and those columns of down.
Their block routes outside the experts module, on every tp rank alike, and hands it the
tokens with their gate weights: both enter the tensor parallel region (`_enter_fused`), since
each rank's share of the output makes a partial gradient for the gate weights as for the
tokens; the router, then, gets its whole gradient on every rank and needs no sum. Not under
sequence parallelism, where such a block takes flattened [N, d] tokens that are not its
sequence.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from interlace.comm import Group
from interlace.errors import PlanError
from interlace.parallel.expert.fused import FusedExpert, FusedExpertParallel
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.parallel.expert.split import ExpertSplit
from interlace.parallel.grad_sums import sum_gradient_over
from interlace.parallel.tensor.layers import enter_block, enter_tp, leave_block
from interlace.parallel.tensor.shard import ShardSpec, shard_column, shard_parameter
from interlace.tensors import local_tensor


def split_experts_over_tp(model: nn.Module, tp: Group, sequence_parallel: bool) -> list[str]:
    """Split the experts of every `ExpertParallelMoE` of `model` over `tp` in place (see the
    module docstring); returns the report line. PlanError, before any change, for a width tp
    does not divide, or fused experts under sequence parallelism."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, ExpertParallelMoE)]
    fused_names = [n for n, m in layers if isinstance(m, FusedExpertParallel)]
    check_fused_split(fused_names, tp.size, sequence_parallel)
    for name, layer in layers:
        width = _width(layer._local_experts()[0], name in fused_names)
        if width % tp.size:
            raise PlanError(
                f"{name}: expert width {width} is not divisible by etp={tp.size}; use etp=1"
            )
    for _, layer in layers:
        if isinstance(layer, FusedExpertParallel):
            for expert in layer._local_experts():
                _split_fused(expert, tp)
            _enter_fused(layer, tp)
        else:
            for expert in layer._local_experts():
                _split_mlp(expert, tp)
            if not sequence_parallel:  # the sequence pass hooks every replicated parameter
                for param in layer.router.parameters():
                    sum_gradient_over(param, tp)
            enter_block(layer, layer.router.d_model, tp, sequence_parallel)
        layer.split = ExpertSplit(tp)
        layer.measure_experts()
        leave_block(layer, tp, sequence_parallel)
    how = "sequence all-gathered" if sequence_parallel else "tokens replicated"
    return [
        f"etp={tp.size}: each expert of {len(layers)} expert-parallel layers split over "
        f"{tp.name} ({how}, every rank routing all of them; one "
        f"{'reduce-scatter' if sequence_parallel else 'all-reduce'} of each layer's output)"
    ]


def check_fused_split(blocks: list[str], etp: int, sequence_parallel: bool) -> None:
    """PlanError if etp > 1 would split the fused experts of `blocks` (names of Hugging Face
    MoE blocks or of their experts) under sequence parallelism (see the module docstring)."""
    if etp > 1 and sequence_parallel and blocks:
        raise PlanError(
            f"etp={etp} with sequence_parallel=true cannot split the fused experts of "
            f"{blocks[0]} (a Hugging Face MoE block hands them flattened tokens, not its "
            "sequence shard); use sequence_parallel=false, or etp=1"
        )


def _width(expert: nn.Module, fused: bool) -> int:
    """An expert's hidden width F: of an `MLP`, up's outputs; of a `FusedExpert`, half of
    gate|up's rows."""
    if fused:
        return getattr(expert, expert.names[0]).shape[0] // 2
    return expert.up.out_features


def _split_mlp(expert: nn.Module, tp: Group) -> None:
    """An `MLP` expert's F/p hidden features on this rank: up's rows (and bias), down's
    columns."""
    shard_column(expert.up, 1, 1, tp)
    expert.down.weight = shard_parameter(expert.down.weight, ShardSpec(1), tp)
    expert.down.in_features = expert.up.out_features


def _split_fused(expert: FusedExpert, tp: Group) -> None:
    """A `FusedExpert`'s F/p hidden features on this rank: its rows of the gate and of the up
    part of gate|up [2F, d] → [2F/p, d], its columns of down [d, F] → [d, F/p]."""
    gate_up, down = expert.names
    setattr(expert, gate_up, shard_parameter(getattr(expert, gate_up), ShardSpec(0, 2), tp))
    setattr(expert, down, shard_parameter(getattr(expert, down), ShardSpec(1), tp))


def _enter_fused(layer: FusedExpertParallel, tp: Group) -> None:
    """The tokens [N, d] and gate weights [N, k] a block hands its fused experts enter the
    tensor parallel region (forward identity, backward all-reduce over `tp`)."""

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = _FUSED_CALL.bind(mod, *args, **kwargs)
        for name in ("hidden", "top_k_weights"):
            bound.arguments[name] = enter_tp(bound.arguments[name], tp)
        return bound.args[1:], bound.kwargs

    layer.register_forward_pre_hook(hook, with_kwargs=True)


_FUSED_CALL = inspect.signature(FusedExpertParallel.forward)


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
            down = getattr(expert, "down", None)  # a `FusedExpert` has no biases
            bias = None if down is None else down.bias
            if bias is not None and bias.grad is not None:
                grads.append(local_tensor(bias.grad))
    return list(by_group.values())
