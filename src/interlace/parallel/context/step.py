"""What context parallelism adds to `parallelize` (step 1, after the tensor split): ring or
all-to-all attention over "cp", and each rank's zig-zag share of every sequence's tokens."""

from __future__ import annotations

from interlace.mesh import Mesh
from interlace.parallel.context.apply import apply_context
from interlace.parallel.context.zigzag import shard_sequence
from interlace.parallel.detect import Structure
from interlace.parallel.parallelized import Parallelized


def context_step(result: Parallelized, mesh: Mesh, structure: Structure | None) -> None:
    """Every attention of `result.model` attends over "cp" (`plan.cp_mode`; a Hugging Face
    decoder's found in `structure`, the model's before the tensor split), and each batch
    [B, T, ...] is cut to this rank's zig-zag share of T."""
    cp = mesh.group("cp")
    result.report += apply_context(result.model, cp, result.plan.cp_mode, structure)
    result.row_cuts.append(lambda batch: shard_sequence(batch, cp.size, cp.rank, dim=1))
