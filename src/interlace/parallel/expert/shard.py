"""Experts under sharded data parallelism (`dp_shard > 1`): each expert-parallel layer's local
experts (`LocalExperts`) sharded by FSDP2 over their `ep_dp` group, the ranks holding the same
experts, so that an expert's parameters, gradients and AdamW states take 1/|ep_dp| per rank, as
the rest of the model's take 1/dp_shard.

The experts are a module FSDP2 shards on its own, over a 1D mesh of the ep_dp group
(`DeviceMesh.from_group`), before the blocks holding them (whose `fully_shard` then leaves them
to it). Its hooks run where the layer reads its experts, stacked (`LocalExperts.forward`):
gather before, free after (`reshard_after_forward`), gather again before the stacking's
backward; their gradients are reduce-scattered at the end of the backward pass, where FSDP2
finishes a module whose inputs need no gradient.

**Gradient scale.** A local expert's gradient is the sum over the tokens its expert group
routed to it of the gradients of each rank's mean loss; data parallelism's average is its sum
over ep_dp divided by the whole data parallel degree dp · dp_shard, not by |ep_dp| (FSDP2's mean
over its mesh). The experts' module divides by dp · dp_shard (`set_gradient_divide_factor`)
after a summing reduce-scatter (`set_force_sum_reduction_for_comms`: gloo and the CPU's ring
reduce-scatter sum or average only), and the reduction after backward
(`reduce_expert_gradients`) leaves them out.

**Kept whole** (`options.replicated_because` says why, and so does the report): under the balancing
strategies that place replicas (shadow, prophet), whose Trans sends an owner's whole parameters
to other ranks, with `overlap` before the layer's forward, and whose Agg adds the replicas'
gradients into the owner's at the end of the backward pass, after FSDP2 has reduced them; there
the experts stay replicated over ep_dp as under plain data parallelism. Where ep_dp is one rank
there is nothing to shard.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from interlace.comm import Group
from interlace.parallel.data.fsdp import attributes_kept
from interlace.parallel.data.ring import RingReduceScatter
from interlace.parallel.expert.layer import ExpertParallelMoE


def shard_experts(
    model: nn.Module,
    ep_dp: Group,
    dp_size: int,
    device_type: str,
    policy: MixedPrecisionPolicy,
    reshard_after_forward: bool,
) -> str:
    """Shard the local experts of every `ExpertParallelMoE` in `model` over `ep_dp` (FSDP2, on
    `device_type`, under `policy`), their gradients the sum over ep_dp divided by `dp_size`
    (dp · dp_shard); before the blocks are sharded. In place; returns a report line."""
    mesh = DeviceMesh.from_group(ep_dp.pg, device_type, mesh_dim_names=("ep_dp",))
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    with attributes_kept(model):  # etp's pieces keep their ShardSpec
        for layer in layers:
            experts = fully_shard(
                layer.experts,
                mesh=mesh,
                mp_policy=policy,
                reshard_after_forward=reshard_after_forward,
            )
            experts.set_gradient_divide_factor(dp_size)
            experts.set_force_sum_reduction_for_comms(True)
            if device_type == "cpu":
                experts.set_custom_reduce_scatter(RingReduceScatter())
    return (
        f"experts: parameters, gradients and optimizer states of {len(layers)} layers' experts "
        f"sharded over their ep_dp={ep_dp.size} replicas (FSDP2)"
    )
