"""The whole model of a checkpoint, read on one process without a process group.

A checkpoint stores each parameter either whole (one key, the full shape: any split reads it)
or, where only the same split can read it, as one key per piece (`parallel.storage.Storage`). Pieces
of 1D tensor parallelism, `<name>.tp<rank>` (a fused q|k|v cut per head, grouped-query kv heads
shared by several ranks, or pieces FSDP made DTensors under dp_shard with tp), are assembled
by the rule the checkpoint recorded for them (meta.json's `assembly`: the parameter's
`ShardSpec`, `parallel.tensor.shard.assemble`). Other pieces (3D grids that cut one dimension
twice, `<name>.tp3d.y1.z0.x1`) likewise by their recorded `Shard3D` over the coordinates their
keys name. Pieces with no recorded rule (checkpoints written before it was) are refused,
naming the plan and the parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from interlace.checkpoint import single_process_is_intended
from interlace.errors import CheckpointError, ExportError
from interlace.parallel.tensor.shard import ShardSpec, assemble
from interlace.parallel.tensor3d.shard import KEY_MARK, Shard3D, assemble3d, piece_coordinates
from interlace.plan import Plan

_MODEL = "model."
"""Prefix of the model's entries among a checkpoint's keys (saved as {"model", "optim"})."""


def read_full_state(
    checkpoint: Path, meta: dict[str, Any], shapes: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """{name: full tensor} for every parameter name in `shapes` ({name: full shape}), read from
    `checkpoint` (already verified: `checkpoint.verify_checkpoint`, which returned `meta`).
    Raises ExportError for a parameter stored as pieces with no recorded assembly."""
    stored = _stored_tensors(checkpoint)
    plan = Plan.from_dict(meta["plan"])
    assembly = meta.get("assembly", {})
    sources = {
        name: _source(name, shape, stored, plan, assembly.get(name), checkpoint)
        for name, shape in shapes.items()
    }
    request = {
        key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype)
        for keys, _ in sources.values()
        for key in keys
    }
    with single_process_is_intended():
        dcp.load(request, checkpoint_id=checkpoint)
    return {name: join([request[k] for k in keys]) for name, (keys, join) in sources.items()}


Join = Callable[[list[torch.Tensor]], torch.Tensor]
"""How the tensors under a parameter's keys make its full tensor."""


def _stored_tensors(checkpoint: Path) -> dict[str, TensorStorageMetadata]:
    """{key: shape and dtype} of every tensor the checkpoint stores."""
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    return {
        key: value
        for key, value in metadata.state_dict_metadata.items()
        if isinstance(value, TensorStorageMetadata)
    }


def _source(
    name: str,
    shape: torch.Size,
    stored: dict[str, TensorStorageMetadata],
    plan: Plan,
    assembly: dict[str, Any] | None,
    checkpoint: Path,
) -> tuple[list[str], Join]:
    """The keys holding parameter `name` and how they join: its own key; its experts one per
    module, stacked; its tensor-parallel pieces assembled by the rule the checkpoint recorded
    (`assembly`: 1D's `ShardSpec` fields over the tp ranks in order, or 3D's `Shard3D` over
    the pieces' grid coordinates)."""
    key = _MODEL + name
    if key in stored:
        if stored[key].size != shape:
            raise CheckpointError(
                f"checkpoint '{checkpoint}' stores {name} with shape {list(stored[key].size)}, "
                f"but its model config gives {list(shape)}"
            )
        return [key], lambda tensors: tensors[0]
    parent, _, leaf = key.rpartition(".")
    experts = [f"{parent}.experts.{e}.{leaf}" for e in range(shape[0] if shape else 0)]
    if experts and all(stored.get(k) and stored[k].size == shape[1:] for k in experts):
        return experts, torch.stack  # fused experts split into one module each (expert parallel)
    if assembly is not None and plan.tensor3d_parallel:
        spec3d = Shard3D(**assembly)
        pieces = sorted(k for k in stored if k.startswith(key + KEY_MARK))
        coords = [piece_coordinates(k) for k in pieces]
        return pieces, lambda tensors: assemble3d(dict(zip(coords, tensors, strict=True)), spec3d)
    pieces = [f"{key}.tp{rank}" for rank in range(plan.tp)]
    if assembly is not None and plan.tp > 1 and all(piece in stored for piece in pieces):
        spec = ShardSpec(**assembly)
        return pieces, lambda tensors: assemble(tensors[:: spec.replicas], spec)
    found = sorted(k for k in stored if k.startswith(key + "."))
    if not found:
        raise CheckpointError(f"checkpoint '{checkpoint}' holds no {name}")
    raise ExportError(
        f"checkpoint under plan '{plan}' stores {name} as per-rank pieces ({found[0]}, ...) "
        "with no recorded rule to assemble them (a checkpoint written before export could "
        "assemble pieces); export reads parameters stored whole and recorded pieces"
    )
