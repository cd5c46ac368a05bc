"""Where FSDP2's shards of tensor parallel pieces lie in the full tensors, for checkpoints
(`sharded_storage`).

A tensor split records, for each piece that is one block of its full tensor, the piece's
layout: its mesh ("tp", or "tp_z", "tp_y", "tp_x") and placements (`Storage.layouts`). FSDP2
then cuts each piece again along its first dimension over its own mesh (dp_shard, or
dp_replicate × dp_shard), so a rank holds a shard of a piece. That shard is still one block
of the full tensor, and a layout over FSDP2's dimensions and the split's together says
which: FSDP2's Shard(0) of a piece whose rows the split cut k ways is, in the left-to-right
order of DTensor's placements, torch's `_StridedShard(0, split_factor=k)` (the placement
torch itself gives FSDP2 over tensor parallel DTensors; private, and the only one that says
"cut after the inner split"). The checkpoint then stores every rank's shard as its block of
the full tensor, which DCP reshards to any other split, and loads into the shard in place.

Where FSDP2's cut is uneven (it pads the last shard) or its mesh is not sliced from the same
mesh as the split's (context parallelism's flattened dp × cp; the experts' ep_dp, a mesh
made from that group, as under `dp_shard=4,ep=2,tp=2,etp=2`), the layout is dropped and the
piece keeps its own key (resumed under its own plan). Pieces that are not
one block (fused q|k|v, kv heads held by several ranks, rows cut twice), stored whole
otherwise (`pieces.StoredWhole`), keep their own keys too once FSDP2 shards them: gathering
them whole would hold the sharded model whole on every rank.
"""

from __future__ import annotations

import dataclasses
import math

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from interlace.parallel.storage import Layout, Storage


def sharded_storage(storage: Storage, model: nn.Module, split_mesh: DeviceMesh | None) -> Storage:
    """`storage` of `model` once FSDP2 has sharded it: each layout of a parameter FSDP2 sharded
    becomes its shard's layout over FSDP2's and the split's dimensions (sliced from
    `split_mesh`, `Mesh.split_mesh`), or is dropped where it cannot be; the parameters FSDP2
    sharded leave `storage.whole` (see the module docstring)."""
    sharded = {
        name: param
        for name, param in model.named_parameters(remove_duplicate=False)
        if isinstance(param, DTensor)
    }
    layouts = {}
    for name, layout in storage.layouts.items():
        shard = sharded.get(name)
        combined = layout if shard is None else _shard_layout(shard, layout, split_mesh)
        if combined is not None:
            layouts[name] = combined
    whole = {name: w for name, w in storage.whole.items() if name not in sharded}
    return dataclasses.replace(storage, layouts=layouts, whole=whole)


def _shard_layout(shard: DTensor, layout: Layout, split_mesh: DeviceMesh | None) -> Layout | None:
    """The layout of FSDP2's `shard` (a DTensor over its mesh, of the piece `layout` places)
    over FSDP2's dimensions then the split's, or None where there is none."""
    piece_mesh, piece_placements = layout
    data_mesh = shard.device_mesh
    names = (*(data_mesh.mesh_dim_names or ()), *(piece_mesh.mesh_dim_names or ()))
    if split_mesh is None or not set(names) <= set(split_mesh.mesh_dim_names or ()):
        return None
    placements: list[Placement] = []
    for i, placement in enumerate(shard.placements):
        if isinstance(placement, Shard):
            if shard.shape[placement.dim] % data_mesh.size(i):
                return None  # FSDP2 padded the last shard
            inner = math.prod(
                piece_mesh.size(j)
                for j, p in enumerate(piece_placements)
                if isinstance(p, Shard) and p.dim == placement.dim
            )
            if inner > 1:
                placement = _StridedShard(placement.dim, split_factor=inner)
        placements.append(placement)
    return split_mesh[names], (*placements, *piece_placements)
