"""How a split names and places this rank's parameters in a checkpoint (`Storage`): what each
dimension's `apply` step records, and what `interlace.checkpoint` reads to store every piece
either as its place in the full tensor, which any split can read, or under its own key."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

Layout = tuple[DeviceMesh, tuple[Placement, ...]]
"""Where a parameter's piece lies in the full tensor: the mesh its split runs over and the
placement along each of the mesh's dimensions."""


@dataclass(frozen=True)
class Storage:
    """How this rank's parameters are named and placed in a checkpoint: `aliases` {name: the
    name it is stored as} (a pipeline's copy of the tied embedding, stored as the embedding);
    `keys` {name: key of this rank's piece} for pieces only the same split can read; `layouts`
    {name: where its piece lies in the full tensor} for pieces stored as full tensors, which
    any split can read. `keys` and `layouts` are looked up under the stored name.
    `assembly` {name: how the pieces of its split make the full tensor}: 1D tensor
    parallelism's `ShardSpec` fields (dim, segments, replicas) or 3D's `Shard3D` fields,
    recorded in the checkpoint's
    meta.json (every rank's, under the stored names) so that one process can rebuild a tensor
    stored as pieces (`interlace export`)."""

    aliases: dict[str, str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)
    assembly: dict[str, dict[str, int]] = field(default_factory=dict)
