"""The whole model of a checkpoint, read on one process without a process group.

A checkpoint stores each parameter either whole (one key, the full shape: any split reads it)
or, where only the same split can read it, as one key per piece (`checkpoint.Storage`). Under
1D tensor parallelism each piece of the built-in GPT is one contiguous block of the full
tensor (q, k and v are separate Linears, each with its own heads), kept under
`<name>.tp<rank>` where FSDP made it a DTensor (dp_shard with tp): the pieces are joined back in
rank order along the one dimension their shape cuts. Other pieces (3D grids that cut one
dimension twice) are refused, naming the plan and the parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from interlace.checkpoint import single_process_is_intended
from interlace.errors import CheckpointError, ExportError
from interlace.plan import Plan

_MODEL = "model."
"""Prefix of the model's entries among a checkpoint's keys (saved as {"model", "optim"})."""


def read_full_state(
    checkpoint: Path, meta: dict[str, Any], shapes: dict[str, torch.Size], join: bool = True
) -> dict[str, torch.Tensor]:
    """{name: full tensor} for every parameter name in `shapes` ({name: full shape}), read from
    `checkpoint` (already verified: `checkpoint.verify_checkpoint`, which returned `meta`).
    `join`: whether 1D tensor-parallel pieces are contiguous blocks (the built-in GPT's) to
    concatenate; a Hugging Face model's may not be (a fused q|k|v is cut per head). Raises
    ExportError for a parameter stored as pieces that cannot be joined exactly."""
    stored = _stored_tensors(checkpoint)
    plan = Plan.from_dict(meta["plan"])
    sources = {
        name: _sources(name, shape, stored, plan, join, checkpoint)
        for name, shape in shapes.items()
    }
    request = {
        key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype)
        for keys, _ in sources.values()
        for key in keys
    }
    with single_process_is_intended():
        dcp.load(request, checkpoint_id=checkpoint)
    return {name: _joined([request[k] for k in keys], d) for name, (keys, d) in sources.items()}


STACKED = -1
"""The join "dimension" of experts stored one by one: stacked into a new first dimension."""


def _joined(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The pieces concatenated along `dim` (STACKED: stacked); a single piece as it is."""
    if dim == STACKED:
        return torch.stack(pieces)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _stored_tensors(checkpoint: Path) -> dict[str, TensorStorageMetadata]:
    """{key: shape and dtype} of every tensor the checkpoint stores."""
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    return {
        key: value
        for key, value in metadata.state_dict_metadata.items()
        if isinstance(value, TensorStorageMetadata)
    }


def _sources(
    name: str,
    shape: torch.Size,
    stored: dict[str, TensorStorageMetadata],
    plan: Plan,
    join: bool,
    checkpoint: Path,
) -> tuple[list[str], int]:
    """The keys holding parameter `name` and the dimension to join them along: its own key, or
    (`join`) its 1D tensor-parallel pieces in rank order."""
    key = _MODEL + name
    if key in stored:
        if stored[key].size != shape:
            raise CheckpointError(
                f"checkpoint '{checkpoint}' stores {name} with shape {list(stored[key].size)}, "
                f"but its model config gives {list(shape)}"
            )
        return [key], 0
    parent, _, leaf = key.rpartition(".")
    experts = [f"{parent}.experts.{e}.{leaf}" for e in range(shape[0] if shape else 0)]
    if experts and all(stored.get(k) and stored[k].size == shape[1:] for k in experts):
        return experts, STACKED  # fused experts split into one module each (expert parallel)
    pieces = [f"{key}.tp{rank}" for rank in range(plan.tp)]
    if join and plan.tp > 1 and all(piece in stored for piece in pieces):
        dim = _joined_dim([stored[piece].size for piece in pieces], shape)
        if dim is not None:
            return pieces, dim
    found = sorted(k for k in stored if k.startswith(key + "."))
    if not found:
        raise CheckpointError(f"checkpoint '{checkpoint}' holds no {name}")
    joined = "and the built-in GPT's pieces of 1D tensor parallelism" if join else "only"
    raise ExportError(
        f"checkpoint under plan '{plan}' stores {name} as per-rank pieces ({found[0]}, ...) "
        f"that only its own split can read; export reads parameters stored whole {joined}"
    )


def _joined_dim(pieces: list[torch.Size], shape: torch.Size) -> int | None:
    """The one dimension along which equal `pieces` concatenate to `shape`, or None."""
    if len(set(pieces)) != 1 or len(pieces[0]) != len(shape):
        return None
    cut = [d for d, (part, full) in enumerate(zip(pieces[0], shape, strict=True)) if part != full]
    if len(cut) != 1 or pieces[0][cut[0]] * len(pieces) != shape[cut[0]]:
        return None
    return cut[0]
