"""Mesh: named process groups for every parallel dimension, on torch's DeviceMesh.

Rank order, outermost to innermost: `pp`, `dp`, `cp` (with context parallelism only), then
tensor parallel — `tp` for 1D, or `tp_z`, `tp_y`, `tp_x` for 3D (x varies fastest). `dp` holds
every data-parallel rank (dp · dp_shard); with sharded data parallelism it is also split into
`dp_replicate` (outer) × `dp_shard` (inner), the mesh FSDP2 shards over (`Mesh.data_mesh`).
The innermost dimensions hold the chattiest groups, so consecutive ranks (one node) share a
tensor parallel group.
With cp > 1, `dp_cp` flattens `dp` × `cp`: the ranks that hold the same parameters and see
different tokens, over which gradients and losses are averaged. With 3D tensor parallelism
`tp_xy` flattens `tp_y` × `tp_x` (local rank y_i · x + x_i): the ranks of one z slice, over which
the embedding and the LM head are split by vocabulary rows.
Global rank (dp_i over all dp · dp_shard data-parallel ranks; cp = 1 and cp_i = 0 without cp)
    r = (((pp_i · dp + dp_i) · cp + cp_i) · tp_size) + tp_i           (1D)
    r = (((pp_i · dp + dp_i) · z + z_i) · y + y_i) · x + x_i   (3D)
Expert parallel groups (`ep`, and `ep_dp` for the replicas of the same experts) are carved
from `dp` with ep innermost by `interlace.parallel.expert.groups.build_expert_groups`.

The backend follows the device: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from interlace.comm import Group
from interlace.errors import ConfigError, PlanError
from interlace.parallel.dimensions import DIMENSIONS
from interlace.plan import Plan

DEVICE_ENV = "INTERLACE_DEVICE"
"""Environment variable that, set to 'cpu', keeps `default_device()` on the CPU where CUDA is
available. Forked gloo ranks (`testing.run_ranks`), benchmark workers and the test suite set it."""


def default_device() -> torch.device:
    """This process's device: the CPU under INTERLACE_DEVICE=cpu or without CUDA, else CUDA
    device LOCAL_RANK (torchrun's; 0 outside it). Initialises no CUDA state."""
    pinned = os.environ.get(DEVICE_ENV, "")
    if pinned not in ("", "cpu"):
        raise ConfigError(f"{DEVICE_ENV}={pinned!r} is not understood; set 'cpu' or leave it unset")
    if pinned == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def backend_for(device: torch.device) -> str:
    """The process-group backend for `device`: 'nccl' for CUDA, 'gloo' otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def mesh_dims(plan: Plan) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(names, sizes) of the mesh dimensions for `plan`, outermost first: what each
    dimension's `options.mesh_dims` names, in mesh order (`parallel.dimensions`)."""
    dims = [dim for options in DIMENSIONS for dim in options.mesh_dims(plan)]
    return tuple(name for name, _ in dims), tuple(size for _, size in dims)


def data_group_name(plan: Plan) -> str:
    """The mesh group gradients and losses are averaged over: "dp", or "dp_cp" (dp × cp)
    under context parallelism."""
    return "dp_cp" if plan.context_parallel else "dp"


FLATTENED = {"dp_cp": ("dp", "cp"), "tp_xy": ("tp_y", "tp_x")}
"""Groups made of several mesh dimensions as one, by name: their dimensions, outermost first."""

SHARDED_DIMS = ("dp_replicate", "dp_shard")
"""The two dimensions sharded data parallelism splits `dp` into, outermost first."""


@dataclass
class Mesh:
    """The DeviceMesh of a plan plus its named groups. `group('dp')` etc. give `comm.Group`s.
    `data_mesh`: with sharded data parallelism, `dp` split into `dp_replicate` × `dp_shard`
    (only `dp_shard` when dp = 1), the mesh FSDP2 shards over (under cp its `dp_shard` spans
    dp_shard × cp ranks); else None. `split_mesh`: the mesh `data_mesh` is sliced from, whose
    other dimensions are the plan's (under cp, dp × cp alone), from which FSDP2's dimensions
    and a tensor split's are sliced together (the checkpoint layout of FSDP2's shards of
    tensor parallel pieces); None with `data_mesh`. `flattened`: meshes of
    several dimensions as one, by name (`dp_cp` under context parallelism, `tp_xy` under 3D
    tensor parallelism)."""

    plan: Plan
    device_mesh: DeviceMesh
    device: torch.device
    data_mesh: DeviceMesh | None = None
    flattened: dict[str, DeviceMesh] = field(default_factory=dict)
    split_mesh: DeviceMesh | None = None

    @property
    def dims(self) -> tuple[str, ...]:
        """Dimension names, outermost first."""
        names = self.device_mesh.mesh_dim_names
        assert names is not None
        return tuple(names)

    def group(self, name: str) -> Group:
        """The process group of dimension `name` (a mesh dimension, or one of `data_mesh`'s)
        that contains this rank."""
        if name in self.dims:
            sub = self.device_mesh[name]
        elif self.data_mesh is not None and name in (self.data_mesh.mesh_dim_names or ()):
            sub = self.data_mesh[name]
        elif name in self.flattened:
            sub = self.flattened[name]
        else:
            raise KeyError(f"mesh has no dimension '{name}'; it has {', '.join(self.dims)}")
        return Group(name=name, pg=sub.get_group(), size=sub.size(), rank=sub.get_local_rank())

    def rows(self, name: str) -> list[list[int]]:
        """The global ranks of every group of mesh dimension `name` (or of `FLATTENED` ones),
        one list per group in mesh order: the same on every rank (to make groups of the same
        ranks collectively)."""
        parts = FLATTENED[name] if name in self.flattened else (name,)
        where = [self.dims.index(part) for part in parts]
        ranks = self.device_mesh.mesh.movedim(where, list(range(-len(parts), 0)))
        width = math.prod(ranks.shape[-len(parts) :])
        return ranks.reshape(-1, width).tolist()

    def size(self, name: str) -> int:
        """Ranks in dimension `name`."""
        return self.device_mesh[name].size()

    def rank(self, name: str) -> int:
        """This rank's index inside dimension `name`."""
        return self.device_mesh[name].get_local_rank()


def build_mesh(plan: Plan, device: torch.device | None = None) -> Mesh:
    """Build the Mesh for `plan` inside an initialised default process group.

    `device` defaults to `default_device()`. Raises PlanError if the world size differs from the
    plan's.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "build_mesh needs torch.distributed initialised (launch with "
            "`interlace train --nproc N` or torchrun)"
        )
    world = dist.get_world_size()
    if world != plan.world_size:
        raise PlanError(
            f"plan '{plan}' needs {plan.world_size} ranks but the world size is {world}"
        )
    device = device or default_device()
    names, sizes = mesh_dims(plan)
    device_mesh = init_device_mesh(device.type, sizes, mesh_dim_names=names)
    flattened = {}
    if plan.context_parallel:  # torch asks that a flattened mesh be kept, not sliced again
        flattened["dp_cp"] = device_mesh[FLATTENED["dp_cp"]]._flatten("dp_cp")
    if plan.tensor3d_parallel:
        flattened["tp_xy"] = device_mesh[FLATTENED["tp_xy"]]._flatten("tp_xy")
    data_mesh = split = None
    if plan.sharded_data_parallel:  # torch has no public way to split a mesh dimension
        # by index: torch 2.11's check of a named dimension is inverted and refuses "dp".
        # Under cp, FSDP2 shards over dp_shard × cp, ranks that hold the same parameters.
        source = flattened.get("dp_cp", device_mesh)
        dim = 0 if plan.context_parallel else names.index("dp")
        split = source._unflatten(dim, (plan.dp, plan.shard_ranks), SHARDED_DIMS)
        data_mesh = split[SHARDED_DIMS] if plan.dp > 1 else split["dp_shard"]
    return Mesh(plan, device_mesh, device, data_mesh, flattened, split)
