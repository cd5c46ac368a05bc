"""What 1D tensor parallelism adds to `parallelize` (step 1): the split, and its share of each
step (loss scorer, gradient norm, checkpoint layout)."""

from __future__ import annotations

import dataclasses

from interlace.mesh import Mesh
from interlace.parallel.fits import tensor_structure
from interlace.parallel.parallelized import Parallelized
from interlace.parallel.pieces import StoredWhole
from interlace.parallel.storage import Storage
from interlace.parallel.tensor.apply import apply_tensor_parallel
from interlace.parallel.tensor.interleave import deferral_scope
from interlace.parallel.tensor.layers import vocab_parallel_cross_entropy
from interlace.parallel.tensor.options import defers_block_boundary
from interlace.parallel.tensor.overlap import apply_tp_overlap
from interlace.parallel.tensor.shard import (
    sharded_parameter_names,
    tensor_layouts,
    tensor_norm_share,
)


def tensor_step(result: Parallelized, mesh: Mesh, gather_logits: bool) -> None:
    """Step 1 of `parallelize` under `tp`: 1D tensor parallelism over "tp" (with sub-batch
    overlap); the vocabulary-parallel loss (unless `gather_logits`), the norm's share and the
    checkpoint layout of the split parameters."""
    model, plan = result.model, result.plan
    sequence_parallel = plan.sequence_parallel
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
        defers_block_boundary(plan),
    )
    if not gather_logits:
        result.scores = lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, tp)
    result.norm_shares.append(tensor_norm_share(tp))
    result.forward_scopes.append(deferral_scope)  # a stage's forward, as the model's does
    tp_mesh = mesh.device_mesh["tp"]
    specs = sharded_parameter_names(model)
    result.storage = Storage(
        keys={name: f"{name}.tp{tp.rank}" for name in specs},
        layouts={name: (tp_mesh, p) for name, p in tensor_layouts(model, tp_mesh).items()},
        whole={name: StoredWhole(tp, None, spec) for name, spec in specs.items()},
        assembly={name: dataclasses.asdict(spec) for name, spec in specs.items()},
    )
