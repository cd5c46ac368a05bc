"""What 3D tensor parallelism adds to `parallelize` (step 1): the split, and its share of each
step (rows over z, loss averaged over z, gradient norm, checkpoint layout)."""

from __future__ import annotations

import dataclasses
import functools

from interlace.mesh import Mesh
from interlace.parallel.fits import tensor3d_structure
from interlace.parallel.parallelized import Parallelized
from interlace.parallel.pieces import StoredWhole
from interlace.parallel.storage import Storage
from interlace.parallel.tensor.interleave import deferral_scope
from interlace.parallel.tensor.layers import vocab_parallel_cross_entropy
from interlace.parallel.tensor.options import defers_block_boundary
from interlace.parallel.tensor.overlap import apply_tp_overlap
from interlace.parallel.tensor.shard import parameters_split_by
from interlace.parallel.tensor3d.apply import apply_tensor3d, z_rows
from interlace.parallel.tensor3d.comm import mean_over
from interlace.parallel.tensor3d.shard import (
    Grid,
    shard3d_keys,
    shard3d_spec,
    tensor3d_layouts,
    tensor3d_norm_shares,
)


def tensor3d_step(result: Parallelized, mesh: Mesh, gather_logits: bool) -> None:
    """Step 1 of `parallelize` under `tp3d`: 3D tensor parallelism over "tp_x", "tp_y",
    "tp_z" (with sub-batch overlap), the vocabulary over "tp_xy"; the loss scored from
    this rank's vocabulary slice (unless `gather_logits`); with z > 1 each rank's rows of a
    batch and the loss averaged over z; the norm's shares and the checkpoint layout of the
    split parameters."""
    model, plan = result.model, result.plan
    structure = tensor3d_structure(model, plan)
    grid, xy = Grid.from_mesh(mesh), mesh.group("tp_xy")
    result.report += apply_tensor3d(
        model,
        structure,
        grid,
        xy,
        plan.overlap.tp3d_prefetch,
        plan.sharded_data_parallel,
        gather_logits,
        plan.sequence_parallel,
    )
    result.report += apply_tp_overlap(
        model,
        structure,
        plan.overlap.tp_subbatches,
        plan.sequence_parallel,
        defers_block_boundary(plan),
        structure.d_model // grid.x.size,
    )
    result.forward_scopes.append(deferral_scope)  # a stage's forward, as the model's does
    score = result.scores
    if structure.vocab is not None and xy.size > 1 and not gather_logits:
        score = functools.partial(vocab_parallel_cross_entropy, group=xy)
    if grid.z.size > 1:
        z = grid.z
        result.row_cuts.append(lambda b: z_rows(b, z))
        result.scores = lambda logits, targets: mean_over(score(logits, targets), z)
    else:
        result.scores = score
    result.norm_shares += tensor3d_norm_shares(grid)
    grid_mesh = mesh.device_mesh["tp_z", "tp_y", "tp_x"]
    specs = parameters_split_by(model, shard3d_spec)
    result.storage = Storage(
        keys=shard3d_keys(model, grid),
        whole={name: StoredWhole(None, grid, spec3d=spec) for name, spec in specs.items()},
        layouts={name: (grid_mesh, p) for name, p in tensor3d_layouts(model, grid).items()},
        assembly={name: dataclasses.asdict(spec) for name, spec in specs.items()},
    )
