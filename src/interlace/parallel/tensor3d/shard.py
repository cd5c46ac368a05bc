"""Which piece of a 3D tensor-parallel parameter a rank holds: the grid of groups, `Shard3D`,
the piece cut from the full tensor, checkpoint keys, and the gradient norm that counts every
piece once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from interlace.comm import Group
from interlace.mesh import Mesh
from interlace.parallel.grad_norm import NormShare
from interlace.parallel.tensor.shard import ShardSpec, assemble, narrow_runs, shard_runs

AXES = ("x", "y", "z")


@dataclass(frozen=True)
class Grid:
    """The three groups of a 3D tensor parallel grid."""

    x: Group
    y: Group
    z: Group

    @classmethod
    def from_mesh(cls, mesh: Mesh) -> Grid:
        """The grid of the mesh's "tp_x", "tp_y", "tp_z" dimensions."""
        return cls(mesh.group("tp_x"), mesh.group("tp_y"), mesh.group("tp_z"))

    def axis(self, name: str) -> Group:
        """The group of axis "x", "y" or "z"."""
        return getattr(self, name)


@dataclass(frozen=True)
class Shard3D:
    """How a parameter is cut over the grid: dim 0 over `rows`, dim 1 over `cols`, then dim 0
    again over `flat` (contiguous pieces of the row-major block). None: not cut that way.

    The rows cut is `ShardSpec(0, segments, replicas)`'s over the `rows` group: `segments` equal
    parts (3 for a fused q|k|v) each cut, `replicas` consecutive ranks holding the same piece
    (kv heads fewer than the group). `conv1d`: the serial tensor is stored [in, out] (HF's
    Conv1D) and the piece is cut from its transpose."""

    rows: str | None = None
    cols: str | None = None
    flat: str | None = None
    segments: int = 1
    replicas: int = 1
    conv1d: bool = False

    @property
    def axes(self) -> tuple[str, ...]:
        """The grid axes whose ranks hold different pieces."""
        return tuple(a for a in (self.rows, self.cols, self.flat) if a is not None)


VOCAB_ROWS = Shard3D(rows="y", flat="x")
"""The embedding's and LM head's pieces: vocabulary rows over y, then over x (rank (x_i, y_i)
holds chunk y_i·x + x_i of x·y), the same on every z rank."""

_SPEC_ATTR = "_interlace_tp3d_shard"


def shard3d_spec(param: torch.Tensor) -> Shard3D | None:
    """The Shard3D of a parameter split by 3D tensor parallelism, None for a replicated one."""
    return getattr(param, _SPEC_ATTR, None)


def shard3d_runs(shape: Sequence[int], spec: Shard3D, grid: Grid) -> list[list[tuple[int, int]]]:
    """Per dimension of a full tensor of `shape` [rows, (cols)] as it is cut (HF's Conv1D: its
    transpose [out, in]), the [start, stop) index runs of this rank's piece under `spec`, in
    order: the rows cut as `ShardSpec(0, segments, replicas)` over `rows`, then the columns
    chunked over `cols`, then the block's rows chunked over `flat` (chunks as `torch.chunk`)."""
    runs = [[(0, n)] for n in shape]
    if spec.rows is not None:
        rows = grid.axis(spec.rows)
        rule = ShardSpec(0, spec.segments, spec.replicas)
        runs[0] = shard_runs(rule, rows.rank, rows.size, shape[0])
    for dim, axis in ((1, spec.cols), (0, spec.flat)):
        if axis is not None:
            group = grid.axis(axis)
            held = sum(stop - start for start, stop in runs[dim])
            size = -(-held // group.size)
            runs[dim] = narrow_runs(runs[dim], group.rank * size, size)
    return runs


def full_shape3d(piece: Sequence[int], spec: Shard3D, grid: Grid) -> list[int]:
    """The shape [rows, (cols)], as cut (see `shard3d_runs`), of the full tensor whose piece
    under `spec` on `grid` is of shape `piece`: every cut even, as `check_grid` ensures."""

    def parts(axis: str | None) -> int:
        return 1 if axis is None else grid.axis(axis).size

    rows = piece[0] * parts(spec.rows) * parts(spec.flat) // spec.replicas
    return [rows, *(n * parts(spec.cols) for n in piece[1:])]


def shard3d_of(full: torch.Tensor, spec: Shard3D, grid: Grid) -> torch.Tensor:
    """This rank's piece of the full (serial) tensor under `spec` (its runs, `shard3d_runs`,
    of the tensor as cut), as a new contiguous tensor."""
    piece = full.t() if spec.conv1d else full
    for dim, runs in enumerate(shard3d_runs(piece.shape, spec, grid)):
        piece = torch.cat([piece.narrow(dim, start, stop - start) for start, stop in runs], dim)
    return piece.contiguous()


def assemble3d(pieces: dict[tuple[int, ...], torch.Tensor], spec: Shard3D) -> torch.Tensor:
    """Inverse of `shard3d_of`: the full tensor from one piece per coordinate, a coordinate
    being the piece's index along each of `spec.axes` in order (`_piece_index`: rows' over
    its replicas). The last cut is undone first: flat pieces joined along dim 0, then cols
    along dim 1, then the rows' parts as `ShardSpec(0, segments)` assembles them."""
    joins = [join for axis, join in ((spec.rows, "rows"), (spec.cols, 1), (spec.flat, 0)) if axis]

    def joined(prefix: tuple[int, ...]) -> torch.Tensor:
        if len(prefix) == len(joins):
            return pieces[prefix]
        count = 1 + max(coords[len(prefix)] for coords in pieces)
        parts = [joined((*prefix, i)) for i in range(count)]
        join = joins[len(prefix)]
        return (
            assemble(parts, ShardSpec(0, spec.segments))
            if join == "rows"
            else torch.cat(parts, join)
        )

    full = joined(())
    return full.t() if spec.conv1d else full


def shard3d_parameter(param: nn.Parameter, spec: Shard3D, grid: Grid) -> nn.Parameter:
    """This rank's piece of `param` (see `shard3d_of`) as a new Parameter carrying `spec`."""
    new = nn.Parameter(shard3d_of(param.detach(), spec, grid), requires_grad=param.requires_grad)
    setattr(new, _SPEC_ATTR, spec)
    return new


KEY_MARK = ".tp3d."
"""What separates a parameter's name from its piece's coordinates in a checkpoint key."""


def shard3d_keys(model: nn.Module, grid: Grid) -> dict[str, str]:
    """{parameter name: checkpoint key unique to this rank's piece}, e.g. `blocks.0.mlp.up.weight`
    → `blocks.0.mlp.up.weight.tp3d.y1.z0.x1` (the piece's index along each of `spec.axes`, in
    order); ranks holding the same piece share its key."""
    keys = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if (spec := shard3d_spec(param)) is not None:
            coords = ".".join(f"{a}{_piece_index(spec, a, grid)}" for a in spec.axes)
            keys[name] = f"{name}{KEY_MARK}{coords}"
    return keys


def piece_coordinates(key: str) -> tuple[int, ...]:
    """The coordinates a `shard3d_keys` key names: `....tp3d.y1.z0.x1` → (1, 0, 1)."""
    return tuple(int(part[1:]) for part in key.rpartition(KEY_MARK)[2].split("."))


def _piece_index(spec: Shard3D, axis: str, grid: Grid) -> int:
    """Which piece along `axis` this rank holds (replicated kv rows: one index per replica set)."""
    rank = grid.axis(axis).rank
    return rank // spec.replicas if axis == spec.rows else rank


def tensor3d_norm_shares(grid: Grid) -> list[NormShare]:
    """3D tensor parallelism's shares of the gradient norm, one per axis: a piece split over an
    axis is held by one of its ranks (by `spec.replicas` of them along `spec.rows`: grouped-query
    kv pieces), anything else by all of them."""

    def axis_share(axis: str) -> NormShare:
        group = grid.axis(axis)

        def holders(param: torch.Tensor) -> int:
            spec = shard3d_spec(param)
            if spec is None or axis not in spec.axes:
                return group.size
            return spec.replicas if axis == spec.rows else 1

        return NormShare(group, holders)

    return [axis_share(axis) for axis in AXES]


def tensor3d_layouts(model: nn.Module, grid: Grid) -> dict[str, tuple[Placement, ...]]:
    """{parameter name: placements over the ("tp_z", "tp_y", "tp_x") mesh} of the pieces that
    are one contiguous block of the full tensor: each dim cut by at most one axis of more than
    one rank, no fused or replicated rows, no transposed storage. What a checkpoint stores as
    the full tensor's piece, readable under any other split; the rest keep `shard3d_keys`."""
    layouts = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        spec = shard3d_spec(param)
        if spec is None or spec.segments != 1 or spec.replicas != 1 or spec.conv1d:
            continue
        cuts = {axis: dim for dim, axis in ((0, spec.rows), (1, spec.cols), (0, spec.flat))}
        cuts = {a: d for a, d in cuts.items() if a is not None and grid.axis(a).size > 1}
        if len(set(cuts.values())) == len(cuts):
            layouts[name] = tuple(Shard(cuts[a]) if a in cuts else Replicate() for a in "zyx")
    return layouts
