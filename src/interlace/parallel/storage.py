"""How a split names and places this rank's parameters in a checkpoint (`Storage`): what each
dimension's `apply` step records, and what `interlace.checkpoint` reads to store every piece
either as its place in the full tensor, which any split can read, or under its own key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

Layout = tuple[DeviceMesh, tuple[Placement, ...]]
"""Where a parameter's piece lies in the full tensor: the mesh its split runs over and the
placement along each of the mesh's dimensions."""


class Whole(Protocol):
    """How a split parameter's piece that is not one block of its full tensor is stored as the
    full tensor (`pieces.StoredWhole`), for a parameter or an optimizer state of its shape,
    `value` as the state dict holds it (a plain piece: FSDP2's shards keep their own keys,
    `data.stored_shards`)."""

    def full(self, value: torch.Tensor) -> torch.Tensor:
        """The full tensor, gathered from every rank's piece (collective)."""
        ...

    def empty(self, value: torch.Tensor) -> torch.Tensor:
        """An uninitialised full tensor to read into."""
        ...

    def cut(self, full: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `full`, the local tensor of `value`'s shape."""
        ...


@dataclass(frozen=True)
class Storage:
    """How this rank's parameters are named and placed in a checkpoint: `aliases` {name: the
    name it is stored as} (a pipeline's copy of the tied embedding, stored as the embedding);
    `keys` {name: key of this rank's piece} for pieces only the same split can read; `layouts`
    {name: where its piece (its local tensor; under FSDP2 its shard) lies in the full tensor}
    for pieces stored as full tensors, which
    any split can read; `whole` {name: `Whole`} for pieces stored as full tensors gathered on
    saving and cut on loading, which any split can read too (`keys` still names where
    checkpoints written before them hold such a piece). `keys`, `layouts` and `whole` are looked
    up under the stored name.
    `assembly` {name: how the pieces of its split make the full tensor}: 1D tensor
    parallelism's `ShardSpec` fields (dim, segments, replicas) or 3D's `Shard3D` fields,
    recorded in the checkpoint's
    meta.json (every rank's, under the stored names) so that one process can rebuild a tensor
    stored as pieces (`interlace export`)."""

    aliases: dict[str, str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)
    whole: dict[str, Whole] = field(default_factory=dict)
    assembly: dict[str, dict[str, int]] = field(default_factory=dict)
