"""The checks `parallelize` makes before it splits anything: whether a plan's tensor and
pipeline splits fit a model (`check_fits`, also run by a launcher on a meta-device model before
it starts ranks) and whether a mesh is the plan's (`check_mesh`)."""

from __future__ import annotations

from torch import nn

from interlace.errors import PlanError
from interlace.mesh import Mesh
from interlace.parallel.detect import Structure, find_structure
from interlace.parallel.pipeline.runner import check_pipelined
from interlace.parallel.tensor.apply import check_divisible
from interlace.parallel.tensor.moe import check_expert_blocks
from interlace.parallel.tensor.overlap import check_tp_overlap
from interlace.parallel.tensor3d.apply import check_tensor3d
from interlace.plan import Plan


def check_fits(model: nn.Module, plan: Plan) -> None:
    """PlanError, naming what blocks it, if `plan`'s tensor and pipeline splits cannot run on
    `model` (which may live on the meta device): the checks `parallelize` makes before it
    splits anything, without a mesh, so a launcher can run them before starting ranks."""
    if plan.tensor_parallel:
        tensor_structure(model, plan)
    if plan.tensor3d_parallel:
        tensor3d_structure(model, plan)
    if plan.pipelined:
        check_pipelined(model, plan)


def tensor_structure(model: nn.Module, plan: Plan) -> Structure:
    """The structure 1D tensor parallelism splits under `plan`; PlanError where it cannot."""
    structure = _structure(model, f"tp={plan.tp}")
    subbatches = plan.overlap.tp_subbatches
    check_divisible(structure, plan.tp)
    check_expert_blocks(model, structure, plan.tp, subbatches, plan.expert_parallel)
    check_tp_overlap(model, structure, subbatches, plan.sequence_parallel)
    return structure


def tensor3d_structure(model: nn.Module, plan: Plan) -> Structure:
    """The structure 3D tensor parallelism splits under `plan`; PlanError where it cannot."""
    structure = _structure(model, "tp3d")
    check_tensor3d(model, structure, plan.tp3d, plan.expert_parallel)  # type: ignore[arg-type]
    check_tp_overlap(model, structure, plan.overlap.tp_subbatches, plan.sequence_parallel)
    return structure


def _structure(model: nn.Module, what: str) -> Structure:
    try:
        return find_structure(model)
    except ValueError as exc:
        raise PlanError(f"{what}: {exc}") from None


def check_mesh(plan: Plan, mesh: Mesh) -> None:
    """The mesh must be the plan's (`build_mesh(plan)`)."""
    sizes = {"pp": plan.pp, "dp": plan.dp_size, "cp": plan.cp}
    if plan.tp3d is not None:
        sizes |= dict(zip(("tp_x", "tp_y", "tp_z"), plan.tp3d, strict=True))
    else:
        sizes["tp"] = plan.tp
    for name, size in sizes.items():
        have = mesh.size(name) if name in mesh.dims else 1
        if have != size:
            raise PlanError(
                f"plan {name}={size} but the mesh's {name} group has {have} ranks; build the "
                "mesh from the same plan (build_mesh(plan))"
            )
