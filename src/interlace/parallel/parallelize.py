"""`parallelize(model, plan, mesh)`: turn a model into its parallel form for a Plan, in place.

The steps run in a fixed order, each the work of one module under `interlace/parallel/`:

    1. tensor parallel, 1D (`plan.tp`, mesh group "tp")    parallel/tensor.py
       + sub-batch overlap (`plan.overlap.tp_subbatches`)  parallel/tensor_overlap.py
       or 3D (`plan.tp3d`, groups "tp_x", "tp_y", "tp_z")  parallel/tensor3d.py
    2. expert parallel (`plan.ep`, `plan.moe_balance`;      parallel/expert.py
       groups "ep" / "ep_dp" carved from "dp")              parallel/expert_groups.py

Pipeline parallelism cuts the result into stages (`interlace.parallel.pipeline.PipelineRunner`),
and data parallelism (DDP over the mesh's "dp" group) wraps it; the Trainer applies both, in that
order, after this function. 3D tensor parallelism (`plan.tp3d`, mesh groups "tp_x", "tp_y",
"tp_z"; parallel/tensor3d.py) takes the place of step 1.

Every part is found by module structure (`interlace.parallel.detect`); what is not recognised
stays replicated, and `model.parallel_report` (also logged on "interlace.parallel") lists, one
line per module, what was split and what was left replicated and why.
"""

from __future__ import annotations

import logging

from torch import nn

from interlace.errors import PlanError
from interlace.mesh import Mesh
from interlace.parallel.detect import find_structure
from interlace.parallel.expert.apply import parallelize_experts
from interlace.parallel.expert.groups import build_expert_groups
from interlace.parallel.tensor.apply import apply_tensor_parallel, check_divisible
from interlace.parallel.tensor.moe import check_expert_blocks
from interlace.parallel.tensor.overlap import apply_tp_overlap, check_tp_overlap
from interlace.parallel.tensor3d.apply import apply_tensor3d, check_tensor3d
from interlace.parallel.tensor3d.shard import Grid
from interlace.plan import Plan

logger = logging.getLogger("interlace.parallel")


def parallelize(
    model: nn.Module, plan: Plan, mesh: Mesh, *, sequence_parallel: bool | None = None
) -> nn.Module:
    """Apply `plan`'s parallel dimensions to `model` on `mesh` and return it (same object).

    With `plan.tp > 1`, attention and feed-forward blocks become column → row parallel, the
    token embedding and LM head vocab-parallel, over the mesh's "tp" group (see
    `interlace.parallel.tensor.layers`); `sequence_parallel` (default: `plan.sequence_parallel`)
    also splits the activations between blocks along the sequence;
    `plan.overlap.tp_subbatches = k > 1` runs every layer in k interleaved sub-batches so their
    all-reduces overlap compute (`parallel/tensor_overlap.py`).
    With `plan.tp3d = (x, y, z)`, the block linears and norms of a dense decoder found by
    structure (the built-in GPT, HF GPT-2 and Llama) become 3D-parallel over the mesh's "tp_x",
    "tp_y", "tp_z" groups (`interlace.parallel.tensor3d`), their weights all-gathered over z one
    layer ahead unless `plan.overlap.tp3d_prefetch` is False; it then returns the logits of this
    rank's z slice of the batch [B/z, T, V] and the full loss (HF: the ModelOutput's `loss`).
    Every rank must pass the same full model (same seed). The built-in GPT then returns (this
    rank's logits [B, T, V/tp], full loss); other models return full logits. Raises PlanError,
    before modifying anything, if the plan asks for a dimension not implemented here or a model
    size is not divisible by `plan.tp`.
    """
    if sequence_parallel is None:
        sequence_parallel = plan.sequence_parallel
    _check_supported(plan, mesh, sequence_parallel)
    report: list[str] = []
    if plan.tp > 1:
        try:
            structure = find_structure(model)
        except ValueError as exc:
            raise PlanError(f"tp={plan.tp}: {exc}") from None
        check_divisible(structure, plan.tp)
        subbatches = plan.overlap.tp_subbatches
        check_expert_blocks(model, structure, plan.tp, subbatches)
        check_tp_overlap(structure, subbatches, sequence_parallel)
        report += apply_tensor_parallel(model, structure, mesh.group("tp"), sequence_parallel)
        report += apply_tp_overlap(
            model, structure, subbatches, sequence_parallel, plan.overlap.tp_block_boundary
        )
    if plan.tp3d is not None and plan.tp_size > 1:
        try:
            structure = find_structure(model)
        except ValueError as exc:
            raise PlanError(f"tp3d: {exc}") from None
        check_tensor3d(model, structure, plan.tp3d)
        grid, prefetch = Grid.from_mesh(mesh), plan.overlap.tp3d_prefetch
        report += apply_tensor3d(model, structure, grid, prefetch)
    if plan.ep > 1 or plan.moe_balance != "none":
        ep_group, ep_dp_group = build_expert_groups(mesh, plan.ep)  # collective
        report += parallelize_experts(model, ep_group, plan.moe_balance)
        model.expert_groups = (ep_group, ep_dp_group)
    for line in report:
        logger.info(line)
    model.parallel_report = report
    return model


def _check_supported(plan: Plan, mesh: Mesh, sequence_parallel: bool) -> None:
    pending = [
        (plan.ep > 1 and plan.tp_size > 1, f"ep={plan.ep} with tensor parallelism"),
        (plan.tp3d is not None and sequence_parallel, "sequence_parallel with tp3d"),
    ]
    for active, what in pending:
        if active:
            raise PlanError(f"parallelize does not apply {what} yet; drop it from the plan")
    if plan.overlap.tp_subbatches > 1 and plan.tp == 1:
        raise PlanError(
            f"tp_subbatches={plan.overlap.tp_subbatches} overlaps tensor parallel all-reduces; "
            "use it with tp > 1, or tp_subbatches=1"
        )
    if plan.tp3d is not None:
        grid = tuple(mesh.size(f"tp_{a}") if f"tp_{a}" in mesh.dims else 0 for a in "xyz")
        if grid != plan.tp3d:
            raise PlanError(
                f"plan tp3d={'x'.join(map(str, plan.tp3d))} but the mesh's tp_x, tp_y, tp_z "
                f"sizes are {grid}; build the mesh from the same plan (build_mesh(plan))"
            )
    if plan.tp > 1 and mesh.size("tp") != plan.tp:
        raise PlanError(
            f"plan tp={plan.tp} but the mesh's tp group has {mesh.size('tp')} ranks; build the "
            "mesh from the same plan (build_mesh(plan))"
        )
