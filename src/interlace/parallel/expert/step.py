"""What expert parallelism adds to `parallelize` (step 2): the experts split over "ep" (carved
out of "dp"), the norm's share of what each rank holds, and the groups the data step shards and
reduces the experts over."""

from __future__ import annotations

import dataclasses

from interlace.mesh import Mesh
from interlace.parallel.detect import ExpertBlock
from interlace.parallel.expert.apply import parallelize_experts, share_tokens_over_tp
from interlace.parallel.expert.fused import FusedExpertParallel
from interlace.parallel.expert.grads import expert_norm_share
from interlace.parallel.expert.groups import ExpertGroups, build_expert_groups
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.parallel.expert.tp_split import split_experts_over_tp
from interlace.parallel.parallelized import Parallelized
from interlace.parallel.pieces import StoredWhole
from interlace.parallel.tensor.shard import sharded_parameter_names, tensor_layouts
from interlace.parallel.tensor3d.apply import keep_whole


def expert_step(
    result: Parallelized, mesh: Mesh, blocks: list[ExpertBlock] | None = None
) -> ExpertGroups | None:
    """Step 2 of `parallelize`: experts split over "ep" (carved out of "dp"; collective),
    reduced over "ep_dp"; under 1D tensor parallelism each tp rank dispatches its share of the
    tokens, the experts reduced over "tp" too (`expert.tp_tokens`); under 3D tensor
    parallelism each layer takes the hidden states gathered over "tp_x"
    (`tensor3d.apply.keep_whole`) and the x·y ranks, "tp_xy", share its tokens the same way
    (under its sequence parallelism the x ranks share them, the y ranks holding other parts
    of the sequences, the aux loss averaged over "tp_y" too); the grid's z slices route other
    rows, so the experts are summed over "tp_z" too and the aux loss averaged over it. With
    etp = tp each expert is split over "tp" as well (`expert.tp_split`): the tp ranks share the
    tokens out as with etp = 1 and gather the rows they received for their pieces, whose
    gradients are summed over "ep_dp" alone.
    `blocks`: the blocks with fused experts, as found before step 1 split the model. Returns
    the groups (None without ep), which the data step shards and reduces the experts over."""
    plan = result.plan
    if not plan.expert_parallel:
        return None
    ep, ep_dp = build_expert_groups(mesh, plan.ep)
    result.report += parallelize_experts(result.model, ep, plan.moe_balance, blocks=blocks)
    tp = z = None  # the ranks that share one set of tokens; the grid's slices of the rows
    share, rows = None, ()  # the ranks that split that set; those that hold other tokens
    if plan.tensor_parallel:
        tp = share = mesh.group("tp")
    elif plan.tensor3d_parallel:
        tp, x = mesh.group("tp_xy"), mesh.group("tp_x")
        z = mesh.group("tp_z") if plan.tp3d[2] > 1 else None
        share = x if plan.sequence_parallel else tp  # y ranks then hold other sequence parts
        rows = (mesh.group("tp_y"),) if plan.sequence_parallel else ()
        rows += (z,) if z is not None else ()
        for name, layer in result.model.named_modules():
            if isinstance(layer, FusedExpertParallel):  # its block routes: the block is whole
                block = result.model.get_submodule(name.rpartition(".")[0])
                keep_whole(block, layer.router.d_model, x)
            elif isinstance(layer, ExpertParallelMoE):
                keep_whole(layer, layer.router.d_model, x)
        result.report.append("ep × tp3d: each expert-parallel layer's input gathered over tp_x")
    if plan.etp > 1:  # each expert split over tp: its pieces see every row of the tp group
        result.report += split_experts_over_tp(result.model, tp)
        store_expert_pieces(result, mesh)
        tp = None
    if share is not None:
        replicated = plan.tensor3d_parallel or not plan.sequence_parallel
        result.report += share_tokens_over_tp(result.model, share, replicated, rows)
    if not plan.sharded_data_parallel:  # else sharded data parallelism's share counts experts
        result.norm_shares.append(expert_norm_share(result.model, ep))
    others = tuple(g for g in (tp, z) if g is not None)
    return ExpertGroups(ep, ep_dp, others)


def store_expert_pieces(result: Parallelized, mesh: Mesh) -> None:
    """Record the experts' pieces under etp as 1D tensor parallelism records its own (each
    stored as its place in the full expert, `tensor.shard.tensor_layouts`, or whole:
    `pieces.StoredWhole`)."""
    tp_mesh = mesh.device_mesh["tp"]
    stored = result.storage
    specs = sharded_parameter_names(result.model)
    layouts = tensor_layouts(result.model, tp_mesh)
    new = [name for name in specs if name not in stored.assembly]
    result.storage = dataclasses.replace(
        stored,
        keys={**stored.keys, **{n: f"{n}.tp{mesh.group('tp').rank}" for n in new}},
        layouts={**stored.layouts, **{n: (tp_mesh, layouts[n]) for n in new if n in layouts}},
        whole={**stored.whole, **{n: StoredWhole(mesh.group("tp"), None, specs[n]) for n in new}},
        assembly={**stored.assembly, **{n: dataclasses.asdict(specs[n]) for n in new}},
    )
