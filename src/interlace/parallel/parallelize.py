"""`parallelize(model, plan, mesh)`: a model in its parallel form for a Plan, and everything the
training loop needs to run it.

Every plan goes through the same steps in the same order; a dimension's step lives in its
package and writes what it adds to a training step into the one `Parallelized` result
(`parallel/parallelized.py`):

    1. tensor   1D (`tp`, `sequence_parallel`, `tp_subbatches`)   parallel/tensor/step.py
                or 3D (`tp3d`, `tp3d_prefetch`)                  parallel/tensor3d/step.py
       context  (`cp`: ring attention, zig-zag positions)      parallel/context/step.py
    2. expert   (`ep`, `moe_balance`; "ep"/"ep_dp" from "dp")    parallel/expert/step.py
    3. recompute (`recompute`: every block, when no pipeline)     here, interlace/recompute.py
    4. precision (`precision`: bf16, fp16, fp32, fp8)             here, interlace/precision.py
    5. compile  (`compile`: each block `torch.compile`d)          here, interlace/compile.py
    6. pipeline (`pp`, `micro_batches`, `schedule`, `recompute`) parallel/pipeline/step.py
    7. data     (`dp`, `dp_overlap`, `grad_compression`)         here, `apply_data`

The data step stays here because it composes with the experts: FSDP2 shards the experts over
their own replicas (the groups the expert step returns) before the rest of the model, and their
gradient reductions follow the data split's; the pipeline's stages link their expert layers
here too.

Steps 1 and 2 change the model in place; 3 makes each block recompute its activations in
backward (a pipeline's stages choose their own checkpointed blocks instead); 4 runs the model's
forward under autocast over the unchanged fp32 master weights (with a gradient scaler for
fp16); 5 compiles each block in place, its recomputation inside the compiled graph; 6 keeps
this rank's stages, which run under the same precision; 7 wraps what is left. The
result, `Parallelized`, owns what differs between plans — the module to run, the loss of its
logits (vocabulary-parallel under a split head, averaged over tp3d's z), the gradient
reduction after the last micro-batch, the gradient norm over every split, the checkpoint keys of
sharded parameters and the report — so a training loop has no branch per dimension.

A model built on the meta device (`weights` given) is split as such; step 7 makes this rank's
part real, each tensor read as its piece of the full one (`interlace.parallel.pieces`).

Every part is found by module structure (`interlace.parallel.detect`); what is not recognised
stays replicated, and the report (also logged on "interlace.parallel") lists, one line per
module, what was split and what was left replicated and why.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from torch import nn

from interlace.compile import compile_blocks, compile_loss, uncompilable
from interlace.errors import PlanError
from interlace.float8 import convert_to_float8
from interlace.loss import cross_entropy
from interlace.mesh import Mesh, data_group_name
from interlace.parallel.context.step import context_step
from interlace.parallel.data.apply import DataParallel, apply_data_parallel, check_reduce_dtype
from interlace.parallel.data.fsdp import (
    ShardedDataParallel,
    apply_fully_shard,
    overlaps_reduce_scatter,
    precision_policy,
    sharded_norm_share,
)
from interlace.parallel.data.ring import ring_group
from interlace.parallel.data.stored_shards import sharded_storage
from interlace.parallel.detect import Structure, find_structure
from interlace.parallel.expert.apply import link_within
from interlace.parallel.expert.grads import (
    expert_parameter_names,
    expert_parameters,
    reduce_expert_gradients,
)
from interlace.parallel.expert.groups import ExpertGroups
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.parallel.expert.options import replicated_because
from interlace.parallel.expert.shard import shard_experts
from interlace.parallel.expert.step import expert_step
from interlace.parallel.fits import check_mesh
from interlace.parallel.parallelized import Parallelized, layer_list
from interlace.parallel.pieces import Weights, load_pieces
from interlace.parallel.pipeline.step import pipeline_step
from interlace.parallel.tensor.step import tensor_step
from interlace.parallel.tensor3d.shard import Grid
from interlace.parallel.tensor3d.step import tensor3d_step
from interlace.plan import Plan
from interlace.precision import FP32, Precision, forward_in_precision, grad_scaler
from interlace.recompute import recompute_blocks

logger = logging.getLogger("interlace.parallel")


def parallelize(
    model: nn.Module,
    plan: Plan,
    mesh: Mesh | None,
    *,
    sequence_parallel: bool | None = None,
    gather_logits: bool = False,
    split_points: Sequence[str] | None = None,
    layers_per_stage: Sequence[int] | None = None,
    precision: Precision = FP32,
    compile: bool = False,
    weights: Weights | None = None,
) -> Parallelized:
    """Apply `plan` to `model` on `mesh` (None: one process, nothing to split) in the fixed
    order of the module docstring; returns the `Parallelized` result.

    Every rank must pass the same full model (same seed). `sequence_parallel` overrides the
    plan's; `gather_logits`: a split head (1D or 3D) all-gathers full logits [..., V] (for a
    model's own loss or `generate`) instead of leaving this rank's [..., V/tp] (3D: [...,
    V/(x·y)]) to the vocabulary-parallel loss; `split_points` / `layers_per_stage` override
    the pipeline partitioner; `precision`: the number formats (`interlace.precision.Precision`:
    autocast's dtype, float8 linears, the data-parallel gradient reduction's wire dtype);
    `compile`: each block compiled (`interlace.compile`; check the plan with
    `resolve_compile` first). Raises PlanError
    before modifying anything if the plan does not fit the mesh or the model.

    `weights`: `model` was built on the meta device and is split as such; once this rank's
    parameters are its own (after the pipeline keeps its stages and FSDP2 shards them, before
    DDP, which broadcasts them) each is allocated on the mesh's device and filled with its
    piece read from `weights` (`interlace.parallel.pieces`; a mesh needed).
    """
    if sequence_parallel is not None:
        plan = dataclasses.replace(plan, sequence_parallel=sequence_parallel)
    plan.validate(1 if mesh is None else mesh.device_mesh.size())
    if weights is not None and mesh is None:
        raise ValueError("pieces of a meta-device model are placed on a mesh; give one")
    result = Parallelized(model, plan, cross_entropy)
    structure = _found_structure(model)  # before any step splits the model
    result.layers = None if structure is None else structure.layers
    moe_layers = [] if structure is None else structure.experts  # kept in bf16 under fp8
    result.blocks = list(model.get_submodule(result.layers)) if result.layers else []
    if mesh is None:
        apply_recompute(result)
        apply_precision(result, precision, next(model.parameters()).device.type, moe_layers)
        apply_compile(result, compile)
        return result
    check_mesh(plan, mesh)
    if plan.tensor_parallel:
        tensor_step(result, mesh, gather_logits)
    if plan.tensor3d_parallel:
        tensor3d_step(result, mesh, gather_logits)
    if plan.context_parallel:
        context_step(result, mesh, structure)
    experts = expert_step(result, mesh, None if structure is None else structure.expert_blocks)
    apply_recompute(result)
    apply_precision(result, precision, mesh.device.type, moe_layers)
    apply_compile(result, compile)
    if plan.pipelined:
        pipeline_step(result, mesh, split_points, layers_per_stage)
        if plan.expert_parallel:
            link_within(result.roots())  # Trans is issued ahead within a stage only
    apply_data(result, mesh, experts, weights)
    for line in result.report:
        logger.info(line)
    return result


def apply_recompute(result: Parallelized) -> None:
    """Step 3: every block of the model's layer list recomputes its activations in backward
    (`plan.recompute` "full" or "selective"); with a pipeline its stages do, per their ratios."""
    mode = result.plan.recompute
    if mode == "none" or result.plan.pipelined:
        return
    layers = layer_list(result, f"recompute={mode}")
    replay = result.plan.tensor_parallel  # the replay context keeps torch.compile out
    result.report += recompute_blocks(result.model, layers, mode, replay)


def apply_precision(
    result: Parallelized, precision: Precision, device_type: str, moe_layers: list[str]
) -> None:
    """Step 4: the model's forward runs under autocast to `precision.compute` on `device_type` (a
    pipeline's stages, built next, run under it too); fp16 adds a gradient scaler that agrees
    over all ranks whether any gradient overflowed; fp8 gives the linear layers of the blocks
    float8 products, those under `moe_layers` (routers, experts) excepted."""
    result.precision = precision
    forward_in_precision(result.model, precision.compute, device_type)
    result.scaler = grad_scaler(precision.compute, device_type)
    if precision.compute != "fp32":
        result.report.append(f"precision: {precision.compute} autocast over fp32 weights")
    if precision.float8:
        within = layer_list(result, "precision=fp8")
        result.report += convert_to_float8(result.model, precision.float8, within, moe_layers)


def apply_compile(result: Parallelized, compile: bool) -> None:
    """Step 5: each block of the model's layer list compiled in place, and the plain
    cross-entropy loss (when `compile`)."""
    if not compile:
        return
    reason = uncompilable(result.plan)
    if reason is not None:
        raise PlanError(f"compiled blocks cannot run with {reason}; leave compile off")
    result.report += compile_blocks(result.model, layer_list(result, "compile"), result.plan)
    result.scores, lines = compile_loss(result.scores)
    result.report += lines


def apply_data(
    result: Parallelized,
    mesh: Mesh,
    experts: ExpertGroups | None = None,
    weights: Weights | None = None,
) -> None:
    """Step 7: gradients averaged over "dp" (experts excepted: they reduce over "ep_dp"); with
    dp_shard > 1 the model sharded over `mesh.data_mesh` (FSDP2), experts over "ep_dp" where
    they can be (`expert/shard.py`), the gradient norm counting each shard once. A meta-device
    model's pieces are read from `weights` once they are this rank's: after FSDP2 shards them,
    before DDP broadcasts them. Then what the data and expert dimensions add to a step: their
    gradient reductions after the last micro-batch and their metrics."""
    data, experts_sharded = _apply_data_split(result, mesh, experts, weights)
    result.module = data.module
    result.accumulation_scopes.append(data.no_sync)
    result.gradient_syncs.append(data.sync_gradients)
    if data.compression is not None:
        ratio = data.compression.summary
        result.metric_sources.append(lambda: {"compression_ratio": ratio()["ratio"]})
    if experts is not None:
        _add_expert_steps(result, experts, experts_sharded)


def _apply_data_split(
    result: Parallelized, mesh: Mesh, experts: ExpertGroups | None, weights: Weights | None
) -> tuple[DataParallel | ShardedDataParallel, bool]:
    """DDP or FSDP2 around the model (`apply_data`), and whether FSDP2 sharded the experts too
    (then it reduces their gradients over ep_dp)."""
    reduce_dtype = result.precision.reduce
    if result.plan.sharded_data_parallel:
        check_reduce_dtype(result.plan, reduce_dtype)
        assert mesh.data_mesh is not None, "build the mesh with build_mesh(plan)"
        layer_list(result, f"dp_shard={result.plan.dp_shard}")  # FSDP shards block by block
        overlap = overlaps_reduce_scatter(result.plan, mesh.device, reduce_dtype)
        replicas = mesh.group(data_group_name(result.plan))  # every rank of the sharding
        whole, experts_sharded = _shard_experts(result, mesh, experts, reduce_dtype)
        data = apply_fully_shard(
            result.model,
            result.roots(),
            result.blocks,
            mesh.data_mesh,
            result.precision.compute,
            reduce_dtype,
            result.plan.reshard_after_forward,
            ignored=whole,
            ring=ring_group(mesh.rows(replicas.name)) if overlap else None,
        )
        _load(result, mesh, weights)
        result.storage = sharded_storage(result.storage, result.model, mesh.split_mesh)
        if result.executor is not None:
            result.executor.rebind_parameters()
        plan = result.plan
        holders = 1 if experts_sharded else plan.dp_size // plan.ep
        expert_params = expert_parameters(result.model)
        result.norm_shares.append(sharded_norm_share(replicas, plan.dp, expert_params, holders))
        over = f" × cp={plan.cp}" if plan.context_parallel else ""
        result.report.append(
            f"data: parameters, gradients and optimizer states sharded over dp_shard="
            f"{result.plan.dp_shard}{over} (FSDP2"
            + (f", replicated over dp={result.plan.dp})" if result.plan.dp > 1 else ")")
        )
        return data, experts_sharded
    _load(result, mesh, weights)
    skip = expert_parameter_names(result.model)
    group = mesh.group(data_group_name(result.plan))
    return apply_data_parallel(result.model, result.plan, group, skip, reduce_dtype), False


def _add_expert_steps(result: Parallelized, experts: ExpertGroups, experts_sharded: bool) -> None:
    """After the data step: expert gradients reduced over their replicas (FSDP2 did it over
    ep_dp for sharded experts; under tensor parallelism they are summed over the groups that
    route other tokens here), and each expert-parallel layer's balance summary as a metric."""
    _, ep_dp, others = experts
    model = result.model
    if not experts_sharded:
        dp_size = result.plan.dp_size
        result.gradient_syncs.append(lambda: reduce_expert_gradients(model, ep_dp, dp_size, others))
    else:  # the sums over `others` and etp's over tp, after FSDP2's over ep_dp
        result.gradient_syncs.append(lambda: reduce_expert_gradients(model, None, 1, others))
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    result.metric_sources.append(lambda: {"moe": [m.balance_summary() for m in layers]})


def _shard_experts(
    result: Parallelized, mesh: Mesh, experts: ExpertGroups | None, reduce_dtype: str
) -> tuple[set[nn.Parameter], bool]:
    """Under sharded data parallelism, the experts sharded over their ep_dp group where they
    can be (`shard_experts`), else reported as kept whole; returns the expert parameters the
    rest of the model's sharding must leave alone (those kept whole) and whether they were
    sharded."""
    if experts is None:
        return set(), False
    ep_dp = experts.ep_dp
    plan = result.plan
    reason = replicated_because(plan, ep_dp.size)
    if reason is not None:
        result.report.append(f"experts: kept whole over ep_dp={ep_dp.size} ({reason})")
        return set(expert_parameters(result.model)), False
    policy = precision_policy(result.precision.compute, reduce_dtype)
    result.report.append(
        shard_experts(
            result.model,
            ep_dp,
            plan.dp_size,
            mesh.device.type,
            policy,
            plan.reshard_after_forward,
        )
    )
    return set(), True


def _load(result: Parallelized, mesh: Mesh, weights: Weights | None) -> None:
    """This rank's pieces of a meta-device model allocated and read from `weights`."""
    if weights is not None:
        plan = result.plan
        tp = mesh.group("tp") if plan.tensor_parallel else None
        grid = Grid.from_mesh(mesh) if plan.tensor3d_parallel else None
        load_pieces(result.model, result.roots(), result.storage, tp, grid, mesh.device, weights)


def _found_structure(model: nn.Module) -> Structure | None:
    """`model`'s structure (its list of blocks, its MoE layers), None where none is found (no
    token embedding)."""
    try:
        return find_structure(model)
    except ValueError:
        return None
