"""Expert tensor parallelism (etp = tp): each expert of an expert-parallel layer split over the
1D tensor parallel group, as a dense feed-forward is.

Expert groups are carved out of the dp groups (`groups.py`), so the p ranks of a tp group hold
the same experts. With etp each holds F/p of every one's hidden features: rank r keeps rows
[r·F/p, (r+1)·F/p) of up (and of its bias) and those columns of down (`ShardSpec(0)` and
`ShardSpec(1)`, recorded as 1D tensor parallelism records them: checkpoints store each piece
as its place in the full expert, and the gradient norm counts each piece once). The fused
experts of a Hugging Face MoE block (`fused.py`: Mixtral, Qwen2-MoE) split the same way: rank
r keeps its F/p rows of the gate and of the up part of gate|up (`ShardSpec(0, segments=2)`,
gate rows first, as the fused tensor holds them) and those columns of down.

The tokens are dispatched once per tp group, as with etp = 1 (`tp_tokens`): each tp rank
routes and dispatches its share (its chunk of the tokens the group holds, or, under sequence
parallelism, its own sequence shard), so the all-to-all bytes of a tp group are those of `ep`
alone. An owner's p tp ranks then hold different rows for the same experts, and each only its
F/p of them: they all-gather their rows, each computes its part of every row, and the parts
are reduce-scattered back to the ranks that received the rows (`ExpertSplit.run`; backward:
the rows' gradients reduce-scattered, the results' gathered). The same holds for replicas
placed by a balancing strategy, whose placements the tp ranks plan alike from their count
matrices summed over tp (`ExpertSplit.total`).

Two sums need a correction, each here:

- an expert's down bias is added by all p ranks: each adds bias/p (`ExpertSplit.params`), so
  each rank's bias gradient is 1/p of the whole, summed over tp with the experts' reduction
  (`split_bias_gradients`; not by a hook: a replicated expert's gradient reaches its owner by
  Agg, after the hooks);
- an expert piece's gradient is its own over all the group's rows: summed over ep_dp only,
  not over tp (`expert.step`).

Capacity, the aux loss and the router's gradient are those of each rank's share, as with
etp = 1 (`tp_tokens`).
"""

from __future__ import annotations

import torch
from torch import nn

from interlace.comm import Group
from interlace.errors import PlanError
from interlace.parallel.expert.fused import FusedExpert
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.parallel.expert.split import ExpertSplit
from interlace.parallel.tensor.shard import ShardSpec, shard_column, shard_parameter
from interlace.tensors import local_tensor


def split_experts_over_tp(model: nn.Module, tp: Group) -> list[str]:
    """Split the experts of every `ExpertParallelMoE` of `model` over `tp` in place (see the
    module docstring); returns the report line. PlanError, before any change, for a width tp
    does not divide. The layers' tokens are shared out over tp next
    (`apply.share_tokens_over_tp`)."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, ExpertParallelMoE)]
    for name, layer in layers:
        width = _width(layer._local_experts()[0])
        if width % tp.size:
            raise PlanError(
                f"{name}: expert width {width} is not divisible by etp={tp.size}; use etp=1"
            )
    for _, layer in layers:
        for expert in layer._local_experts():
            if isinstance(expert, FusedExpert):
                _split_fused(expert, tp)
            else:
                _split_mlp(expert, tp)
        layer.split = ExpertSplit(tp)
        layer.measure_experts()
    return [
        f"etp={tp.size}: each expert of {len(layers)} expert-parallel layers split over "
        f"{tp.name} (the rows a tp group's ranks received gathered for their parts, the parts "
        "reduce-scattered back)"
    ]


def _width(expert: nn.Module) -> int:
    """An expert's hidden width F: of an `MLP`, up's outputs; of a `FusedExpert`, half of
    gate|up's rows."""
    if isinstance(expert, FusedExpert):
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
