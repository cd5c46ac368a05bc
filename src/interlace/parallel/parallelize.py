"""`parallelize(model, plan, mesh)`: a model in its parallel form for a Plan, and everything the
training loop needs to run it.

Every plan goes through the same steps in the same order, each one `apply_*` of its dimension:

    1. tensor   1D (`tp`, `sequence_parallel`, `tp_subbatches`)   parallel/tensor/
                or 3D (`tp3d`, `tp3d_prefetch`)                  parallel/tensor3d/
       context  (`cp`: ring attention, zig-zag positions)      parallel/context/
    2. expert   (`ep`, `moe_balance`; "ep"/"ep_dp" from "dp")    parallel/expert/
    3. recompute (`recompute`: every block, when no pipeline)     interlace/recompute.py
    4. precision (`precision`: bf16, fp16 or fp32)                interlace/precision.py
    5. compile  (`compile`: each block `torch.compile`d)          interlace/compile.py
    6. pipeline (`pp`, `micro_batches`, `schedule`, `recompute`) parallel/pipeline/
    7. data     (`dp`, `dp_overlap`, `grad_compression`)         parallel/data/

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

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from interlace.comm import Group
from interlace.compile import compile_blocks, compile_loss, uncompilable
from interlace.errors import PlanError
from interlace.float8 import convert_to_float8
from interlace.loss import CrossEntropy, causal_lm_loss, cross_entropy
from interlace.mesh import Mesh, data_group_name
from interlace.parallel.context.apply import apply_context
from interlace.parallel.context.zigzag import shard_sequence
from interlace.parallel.data.apply import DataParallel, apply_data_parallel, check_reduce_dtype
from interlace.parallel.data.fsdp import (
    ShardedDataParallel,
    apply_fully_shard,
    overlaps_reduce_scatter,
    precision_policy,
    sharded_norm_share,
)
from interlace.parallel.data.ring import ring_group
from interlace.parallel.detect import find_structure
from interlace.parallel.expert.apply import (
    link_within,
    parallelize_experts,
    share_tokens_over_tp,
)
from interlace.parallel.expert.grads import (
    expert_norm_share,
    expert_parameter_names,
    expert_parameters,
    reduce_expert_gradients,
)
from interlace.parallel.expert.groups import build_expert_groups
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.parallel.expert.rules import replicated_because
from interlace.parallel.expert.shard import shard_experts
from interlace.parallel.fits import check_mesh, tensor3d_structure, tensor_structure
from interlace.parallel.grad_norm import GradNorm, NormShare
from interlace.parallel.pieces import Weights, load_pieces
from interlace.parallel.pipeline.runner import PipelineRunner
from interlace.parallel.storage import Storage
from interlace.parallel.tensor.apply import apply_tensor_parallel
from interlace.parallel.tensor.layers import vocab_parallel_cross_entropy
from interlace.parallel.tensor.overlap import apply_tp_overlap
from interlace.parallel.tensor.shard import (
    parameters_split_by,
    sharded_parameter_names,
    tensor_layouts,
    tensor_norm_share,
)
from interlace.parallel.tensor3d.apply import apply_tensor3d, z_rows
from interlace.parallel.tensor3d.comm import mean_over
from interlace.parallel.tensor3d.shard import (
    Grid,
    shard3d_keys,
    shard3d_spec,
    tensor3d_layouts,
    tensor3d_norm_shares,
)
from interlace.plan import Plan
from interlace.precision import FP32, Precision, forward_in_precision, grad_scaler, scaled_step
from interlace.recompute import recompute_blocks

logger = logging.getLogger("interlace.parallel")


class Parallelized:
    """A model split by `parallelize`, with what the training loop needs to run it.

    `model`: this rank's part under the full model's parameter names (a pipeline rank's stages),
    for the optimizer and checkpoints. `module`: what to call (`model`, or its DDP wrapper).
    `report`: one line per split module. `layers`: the name of the model's list of blocks, if
    it has one, and `blocks` the blocks themselves (the same modules after every step).
    `storage`: how checkpoints name and place this rank's pieces (`parallel.storage.Storage`):
    a key per piece that differs between ranks of a split (`.tp1`, `.x0.y1`), and for the pieces
    that are one block of the full tensor their place in it (mesh and placements), so that they
    are stored as the full tensor any other split can read (where the parameter is not
    already a DTensor; the key otherwise).

    What the steps add to a training step, run in the order they were added: `row_cuts`, each
    taking this rank's part of a batch (tp3d's z rows, cp's tokens); `gradient_syncs`, the
    reductions after a step's last backward (the data split's, the experts' over their
    replicas); `metric_sources`, each giving entries of the step's metrics row.
    """

    def __init__(self, model: nn.Module, plan: Plan, scores: CrossEntropy) -> None:
        self.model = model
        self.precision = FP32
        self.scaler: torch.amp.GradScaler | None = None
        self.module = model
        self.plan = plan
        self.scores = scores
        self.report: list[str] = []
        self.storage = Storage()
        self.norm_shares: list[NormShare] = []
        self.expert_groups: tuple[Group, Group, Group | None] | None = None  # ep, ep_dp, tp
        self.pipeline: PipelineRunner | None = None
        self.data: DataParallel | ShardedDataParallel | None = None
        self.row_cuts: list[Callable[[torch.Tensor], torch.Tensor]] = []
        self.gradient_syncs: list[Callable[[], None]] = []
        self.metric_sources: list[Callable[[], dict[str, Any]]] = []
        self.layers: str | None = None
        self.blocks: list[nn.Module] = []
        self._grad_norm: GradNorm | None = None

    # ------------------------------------------------------------------ one step
    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's part of a batch-major tensor [B, T, ...]: its rows (tp3d: its slice
        over z) and its tokens (cp: its zig-zag share of T)."""
        for cut in self.row_cuts:
            batch = cut(batch)
        return batch

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of this rank's logits against its targets [b, T]: mean cross-entropy (over
        the split vocabulary, the mean over tp3d's z) plus the model's auxiliary loss."""
        return causal_lm_loss(logits, targets, self.model, self.scores)

    def forward_backward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        loss_scale: float | torch.Tensor = 1.0,
        sync: bool = True,
    ) -> torch.Tensor:
        """Forward and backward of token ids x [B, T] against targets y [B, T] (this rank's
        data-parallel rows); gradients of `loss_scale` · loss accumulate in `.grad`. `sync` on
        the last micro-batch of a step (data parallel reduction, tied embeddings). Returns the
        loss, detached, equal on every rank of the model-parallel groups. Under fp16 the
        gradients are those of the loss times the gradient scaler's scale until
        `clip_grad_norm_` unscales them."""
        if self.scaler is not None:
            loss_scale = self.scaler.scale(torch.tensor(loss_scale, device=x.device))
        if self.pipeline is not None:
            step = self.pipeline.step(self.rows(x), self.rows(y), loss_scale=loss_scale, sync=sync)
            return step.detach()
        if not self.module.training:  # after `evaluate` (walking every module costs each step)
            self.module.train()
        deferred = self.data.no_sync() if self.data is not None and not sync else None
        with deferred or contextlib.nullcontext():
            loss = self.loss(self.module(self.rows(x)), self.rows(y))
            (loss * loss_scale).backward()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss of x [B, T] against y [B, T], forward only (B a multiple of
        `plan.batch_rows_unit`)."""
        if self.pipeline is not None:
            return self.pipeline.evaluate(self.rows(x), self.rows(y))
        self.model.eval()
        return self.loss(self.model(self.rows(x)), self.rows(y))

    def sync_gradients(self) -> None:
        """After a step's last backward: gradients averaged over the data parallel ranks where
        backward did not (no DDP), expert gradients over their replicas (sharded ones: FSDP2
        reduced them over ep_dp, and under ep × tp they are summed over tp here)."""
        for sync in self.gradient_syncs:
            sync()

    def clip_grad_norm_(
        self, max_norm: float, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.Tensor:
        """Clip to `max_norm` by the whole model's gradient norm, counted once over every split;
        returns that norm before clipping (equal on every rank). Under fp16 `optimizer`'s
        gradients are first divided by the scaler's scale (required then). Otherwise a fused
        `optimizer` applies the clip coefficient in its next step (`GradNorm.clip_`)."""
        if self.scaler is not None:
            if optimizer is None:
                raise ValueError("fp16: clip_grad_norm_ needs the optimizer to unscale")
            self.scaler.unscale_(optimizer)
        if self._grad_norm is None:  # the split is final once a step runs
            self._grad_norm = GradNorm(self.model.parameters(), self.norm_shares)
        return self._grad_norm.clip_(max_norm, optimizer if self.scaler is None else None)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.step()`; under fp16 through the gradient scaler, which skips the step on
        every rank when any rank's gradients overflowed, and adapts its scale."""
        if self.scaler is None:
            optimizer.step()
        else:
            scaled_step(self.scaler, optimizer)

    def metrics(self) -> dict[str, Any]:
        """What the plan's dimensions log per step: the gradient compression ratio so far,
        each expert-parallel layer's balance summary."""
        row: dict[str, Any] = {}
        for source in self.metric_sources:
            row |= source()
        return row


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
    plan's; `gather_logits`: a 1D-split head all-gathers full logits [..., V] (for a model's own
    loss or `generate`) instead of leaving this rank's [..., V/tp] to the vocabulary-parallel
    loss; `split_points` / `layers_per_stage` override the pipeline partitioner; `precision`:
    the number formats (`interlace.precision.Precision`: autocast's dtype, float8 linears, the
    data-parallel gradient reduction's wire dtype); `compile`: each block compiled
    (`interlace.compile`; check the plan with `resolve_compile` first). Raises PlanError
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
    moe_layers = find_structure(model).experts if precision.float8 else []  # kept in bf16
    result.layers = _layer_list(model)
    result.blocks = list(model.get_submodule(result.layers)) if result.layers else []
    if mesh is None:
        apply_recompute(result)
        apply_precision(result, precision, next(model.parameters()).device.type, moe_layers)
        apply_compile(result, compile)
        return result
    check_mesh(plan, mesh)
    apply_tensor(result, mesh, gather_logits)
    if plan.context_parallel:
        cp = mesh.group("cp")
        result.report += apply_context(model, cp, plan.cp_mode)
        result.row_cuts.append(lambda b: shard_sequence(b, cp.size, cp.rank, dim=1))
    apply_expert(result, mesh)
    apply_recompute(result)
    apply_precision(result, precision, mesh.device.type, moe_layers)
    apply_compile(result, compile)
    apply_pipeline(result, mesh, split_points, layers_per_stage)
    apply_data(result, mesh, weights)
    for line in result.report:
        logger.info(line)
    return result


def apply_tensor(result: Parallelized, mesh: Mesh, gather_logits: bool) -> None:
    """Step 1: 1D tensor parallelism over "tp" (with sub-batch overlap), or 3D over
    "tp_x", "tp_y", "tp_z"; sets the loss's scorer and the norm's shares."""
    model, plan = result.model, result.plan
    sequence_parallel = plan.sequence_parallel
    if plan.tensor_parallel:
        structure = tensor_structure(model, plan)
        tp = mesh.group("tp")
        result.report += apply_tensor_parallel(
            model, structure, tp, sequence_parallel, gather_logits, plan.expert_parallel
        )
        result.report += apply_tp_overlap(
            model,
            structure,
            plan.overlap.tp_subbatches,
            sequence_parallel,
            plan.overlap.tp_block_boundary,
        )
        if not gather_logits:
            result.scores = lambda logits, targets: vocab_parallel_cross_entropy(
                logits, targets, tp
            )
        result.norm_shares.append(tensor_norm_share(tp))
        tp_mesh = mesh.device_mesh["tp"]
        specs = sharded_parameter_names(model)
        result.storage = Storage(
            keys={name: f"{name}.tp{tp.rank}" for name in specs},
            layouts={name: (tp_mesh, p) for name, p in tensor_layouts(model, tp_mesh).items()},
            assembly={name: dataclasses.asdict(spec) for name, spec in specs.items()},
        )
    if plan.tensor3d_parallel:
        structure = tensor3d_structure(model, plan)
        grid = Grid.from_mesh(mesh)
        result.report += apply_tensor3d(model, structure, grid, plan.overlap.tp3d_prefetch)
        if grid.z.size > 1:
            z = grid.z
            result.row_cuts.append(lambda b: z_rows(b, z))
            result.scores = lambda logits, targets: mean_over(cross_entropy(logits, targets), z)
        result.norm_shares += tensor3d_norm_shares(grid)
        grid_mesh = mesh.device_mesh["tp_z", "tp_y", "tp_x"]
        result.storage = Storage(
            keys=shard3d_keys(model, grid),
            layouts={name: (grid_mesh, p) for name, p in tensor3d_layouts(model, grid).items()},
            assembly={
                name: dataclasses.asdict(spec)
                for name, spec in parameters_split_by(model, shard3d_spec).items()
            },
        )


def apply_expert(result: Parallelized, mesh: Mesh) -> None:
    """Step 2: experts split over "ep" (carved out of "dp"; collective), reduced over "ep_dp";
    under 1D tensor parallelism each tp rank dispatches its share of the tokens, the experts
    reduced over "tp" too (`expert.tp_tokens`)."""
    plan = result.plan
    if not plan.expert_parallel:
        return
    ep, ep_dp = build_expert_groups(mesh, plan.ep)
    result.report += parallelize_experts(result.model, ep, plan.moe_balance)
    tp = mesh.group("tp") if plan.tensor_parallel else None  # its ranks dispatch other tokens
    result.expert_groups = (ep, ep_dp, tp)
    if tp is not None:
        result.report += share_tokens_over_tp(result.model, tp, plan.sequence_parallel)
    if not plan.sharded_data_parallel:  # else sharded data parallelism's share counts experts
        result.norm_shares.append(expert_norm_share(result.model, ep))


def apply_recompute(result: Parallelized) -> None:
    """Step 3: every block of the model's layer list recomputes its activations in backward
    (`plan.recompute` "full" or "selective"); with a pipeline its stages do, per their ratios."""
    mode = result.plan.recompute
    if mode == "none" or result.plan.pipelined:
        return
    layers = _layers(result, f"recompute={mode}")
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
        within = _layers(result, "precision=fp8")
        result.report += convert_to_float8(result.model, precision.float8, within, moe_layers)


def apply_compile(result: Parallelized, compile: bool) -> None:
    """Step 5: each block of the model's layer list compiled in place, and the plain
    cross-entropy loss (when `compile`)."""
    if not compile:
        return
    reason = uncompilable(result.plan)
    if reason is not None:
        raise PlanError(f"compiled blocks cannot run with {reason}; leave compile off")
    result.report += compile_blocks(result.model, _layers(result, "compile"), result.plan)
    result.scores, lines = compile_loss(result.scores)
    result.report += lines


def apply_pipeline(
    result: Parallelized,
    mesh: Mesh,
    split_points: Sequence[str] | None,
    layers_per_stage: Sequence[int] | None,
) -> None:
    """Step 6: keep this rank's pipeline stages over "pp"; the model becomes those stages
    (expert-parallel layers issue each other's transfers within a stage only)."""
    plan = result.plan
    if not plan.pipelined:
        return
    runner = PipelineRunner(
        result.model,
        plan,
        mesh,
        result.scores,
        split_points=split_points,
        layers_per_stage=layers_per_stage,
        precision=result.precision.compute,
    )
    result.pipeline = runner
    result.model = result.module = runner.module
    link_within(runner.stages)  # Trans is issued ahead within a stage only
    result.norm_shares.append(runner.norm_share())
    held = dict(runner.module.named_parameters(remove_duplicate=False))
    storage = result.storage
    result.storage = Storage(
        aliases=runner.checkpoint_aliases(),
        keys={n: k for n, k in storage.keys.items() if n in held},
        layouts={n: layout for n, layout in storage.layouts.items() if n in held},
        assembly={n: spec for n, spec in storage.assembly.items() if n in held},
    )
    result.report.append(f"pipeline: stages {runner.stage_indices} of {runner.layout.n_stages}")


def apply_data(result: Parallelized, mesh: Mesh, weights: Weights | None = None) -> None:
    """Step 7: gradients averaged over "dp" (experts excepted: they reduce over "ep_dp"); with
    dp_shard > 1 the model sharded over `mesh.data_mesh` (FSDP2), experts over "ep_dp" where
    they can be (`expert/shard.py`), the gradient norm counting each shard once. A meta-device
    model's pieces are read from `weights` once they are this rank's: after FSDP2 shards them,
    before DDP broadcasts them. Then what the data and expert dimensions add to a step: their
    gradient reductions after the last micro-batch and their metrics."""
    experts_sharded = _apply_data_split(result, mesh, weights)
    data = result.data
    assert data is not None
    result.gradient_syncs.append(data.sync_gradients)
    if data.compression is not None:
        ratio = data.compression.summary
        result.metric_sources.append(lambda: {"compression_ratio": ratio()["ratio"]})
    if result.expert_groups is not None:
        _add_expert_steps(result, experts_sharded)


def _apply_data_split(result: Parallelized, mesh: Mesh, weights: Weights | None) -> bool:
    """DDP or FSDP2 around the model (`apply_data`); whether FSDP2 sharded the experts too
    (then it reduces their gradients over ep_dp)."""
    reduce_dtype = result.precision.reduce
    if result.plan.sharded_data_parallel:
        check_reduce_dtype(result.plan, reduce_dtype)
        assert mesh.data_mesh is not None, "build the mesh with build_mesh(plan)"
        _layers(result, f"dp_shard={result.plan.dp_shard}")  # FSDP shards block by block
        pipeline = result.pipeline
        overlap = overlaps_reduce_scatter(result.plan, mesh.device, reduce_dtype)
        replicas = mesh.group(data_group_name(result.plan))  # every rank of the sharding
        whole, experts_sharded = _shard_experts(result, mesh, reduce_dtype)
        result.data = apply_fully_shard(
            result.model,
            pipeline.stages if pipeline is not None else [result.model],
            result.blocks,
            mesh.data_mesh,
            result.precision.compute,
            reduce_dtype,
            result.plan.reshard_after_forward,
            ignored=whole,
            ring=ring_group(mesh.rows(replicas.name)) if overlap else None,
        )
        result.module = result.data.module
        _load(result, mesh, weights)
        if pipeline is not None:
            pipeline.rebind_parameters()
        plan = result.plan
        holders = 1 if experts_sharded else plan.dp_size // plan.ep
        experts = expert_parameters(result.model)
        result.norm_shares.append(sharded_norm_share(replicas, plan.dp, experts, holders))
        over = f" × cp={plan.cp}" if plan.context_parallel else ""
        result.report.append(
            f"data: parameters, gradients and optimizer states sharded over dp_shard="
            f"{result.plan.dp_shard}{over} (FSDP2"
            + (f", replicated over dp={result.plan.dp})" if result.plan.dp > 1 else ")")
        )
        return experts_sharded
    _load(result, mesh, weights)
    skip = expert_parameter_names(result.model)
    result.data = apply_data_parallel(
        result.model, result.plan, mesh.group(data_group_name(result.plan)), skip, reduce_dtype
    )
    result.module = result.data.module
    return False


def _add_expert_steps(result: Parallelized, experts_sharded: bool) -> None:
    """After the data step: expert gradients reduced over their replicas (FSDP2 did it over
    ep_dp for sharded experts; under ep × tp they are summed over tp here), and each
    expert-parallel layer's balance summary as a metric."""
    assert result.expert_groups is not None
    _, ep_dp, tp = result.expert_groups
    model = result.model
    if not experts_sharded:
        dp_size = result.plan.dp_size
        result.gradient_syncs.append(lambda: reduce_expert_gradients(model, ep_dp, dp_size, tp))
    elif tp is not None:
        result.gradient_syncs.append(lambda: reduce_expert_gradients(model, None, 1, tp))
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    result.metric_sources.append(lambda: {"moe": [m.balance_summary() for m in layers]})


def _shard_experts(
    result: Parallelized, mesh: Mesh, reduce_dtype: str
) -> tuple[set[nn.Parameter], bool]:
    """Under sharded data parallelism, the experts sharded over their ep_dp group where they
    can be (`shard_experts`), else reported as kept whole; returns the expert parameters the
    rest of the model's sharding must leave alone (those kept whole) and whether they were
    sharded."""
    if result.expert_groups is None:
        return set(), False
    _, ep_dp, _ = result.expert_groups
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
        roots = result.pipeline.stages if result.pipeline is not None else [result.model]
        load_pieces(result.model, roots, result.storage, tp, grid, mesh.device, weights)


def _layer_list(model: nn.Module) -> str | None:
    """The name of `model`'s list of blocks, found by structure before any step splits them."""
    try:
        return find_structure(model).layers
    except ValueError:
        return None


def _layers(result: Parallelized, what: str) -> str:
    if result.layers is None:
        raise PlanError(f"{what}: the model has no layer list (an nn.ModuleList of blocks)")
    return result.layers
