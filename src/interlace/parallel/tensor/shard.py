"""How a 1D tensor-parallel parameter is split: `ShardSpec`, the piece a rank holds, the full
tensor gathered back, and the in-place column split of a linear layer.

Rank r of p holds, along `ShardSpec.dim`, piece r // replicas of every one of `segments` equal
parts (3 for GPT-2's fused q|k|v); replicas > 1 is a grouped-query kv head shared by
consecutive ranks, whose gradient is summed among them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard

from interlace import comm
from interlace.comm import Group
from interlace.parallel.detect import linear_shape
from interlace.parallel.grad_norm import NormShare
from interlace.parallel.grad_sums import Slots, sum_gradient_among

S = TypeVar("S")


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is split over the tensor parallel group.

    Along `dim`, the full tensor is `segments` equal parts (3 for fused q|k|v) and each part is
    cut into p/`replicas` contiguous pieces; rank r holds piece r // replicas of every part
    (replicas > 1: a grouped-query kv head shared by consecutive ranks).
    """

    dim: int
    segments: int = 1
    replicas: int = 1


_SPEC_ATTR = "_interlace_tp_shard"


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The ShardSpec of a tensor-parallel parameter, None for a replicated one."""
    return getattr(param, _SPEC_ATTR, None)


def parameters_split_by(
    model: nn.Module, spec_of: Callable[[torch.Tensor], S | None]
) -> dict[str, S]:
    """{parameter name: its spec} of every parameter of `model` that `spec_of` (`shard_spec`,
    3D's `shard3d_spec`) gives one, tied aliases included (both `wte.weight` and
    `lm_head.weight`: a state dict holds both)."""
    named = model.named_parameters(remove_duplicate=False)
    return {n: s for n, p in named if (s := spec_of(p)) is not None}


def sharded_parameter_names(model: nn.Module) -> dict[str, ShardSpec]:
    """{parameter name: ShardSpec} of every 1D tensor-parallel parameter of `model`."""
    return parameters_split_by(model, shard_spec)


def shard_runs(spec: ShardSpec, rank: int, size: int, length: int) -> list[tuple[int, int]]:
    """The [start, stop) index runs along `spec.dim` (of the full tensor's `length`) that rank
    `rank`'s piece (of `size` ranks) holds, in order: piece r // replicas of every part."""
    part = length // spec.segments
    piece = part * spec.replicas // size
    first = rank // spec.replicas * piece
    return [(s * part + first, s * part + first + piece) for s in range(spec.segments)]


def narrow_runs(runs: list[tuple[int, int]], start: int, length: int) -> list[tuple[int, int]]:
    """The runs holding positions [start, start + length) of the indices `runs` hold, in order
    (clipped at their end)."""
    out, position = [], 0
    for first, stop in runs:
        low, high = max(position, start), min(position + stop - first, start + length)
        if low < high:
            out.append((first + low - position, first + high - position))
        position += stop - first
    return out


def shard_of(full: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s piece (of `size` ranks) of the full tensor, as a new contiguous tensor."""
    runs = shard_runs(spec, rank, size, full.shape[spec.dim])
    return torch.cat([full.narrow(spec.dim, start, stop - start) for start, stop in runs], spec.dim)


def assemble(pieces: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Inverse of `shard_of`: the full tensor from one piece per part (ranks 0, replicas, …)."""
    views = [p.unflatten(spec.dim, (spec.segments, -1)) for p in pieces]
    return torch.stack(views, spec.dim + 1).flatten(spec.dim, spec.dim + 2)


def gather_full(shard: torch.Tensor, spec: ShardSpec, group: Group) -> torch.Tensor:
    """All-gather a parameter's pieces over `group` and return the full (serial) tensor."""
    out = torch.empty((group.size * shard.numel(),), dtype=shard.dtype, device=shard.device)
    comm.all_gather(out, shard.detach().contiguous().view(-1), group)
    pieces = list(out.view(group.size, *shard.shape)[:: spec.replicas])
    return assemble(pieces, spec)


def shard_parameter(param: nn.Parameter, spec: ShardSpec, group: Group) -> nn.Parameter:
    """This rank's piece of `param` (see `shard_of`) as a new Parameter carrying `spec`; a
    piece shared by several ranks (replicas > 1) gets its gradient summed among them."""
    piece = shard_of(param.detach(), spec, group.rank, group.size)
    new = nn.Parameter(piece, requires_grad=param.requires_grad)
    setattr(new, _SPEC_ATTR, spec)
    if spec.replicas > 1 and new.requires_grad:
        sum_gradient_among(new, replica_slots(spec, group))
    return new


def replica_slots(spec: ShardSpec, group: Group) -> Slots:
    """The ranks of `group` holding each piece of a parameter split by `spec` (`replicas`
    consecutive ranks each), among which its gradient is summed."""
    return Slots(group, group.size // spec.replicas, group.rank // spec.replicas)


def shard_column(layer: nn.Module, segments: int, replicas: int, group: Group) -> None:
    """Shard `layer` in place along its output features (see ShardSpec)."""
    _, n_out, layout = linear_shape(layer)  # type: ignore[misc]
    dim = 0 if layout == "linear" else 1
    layer.weight = shard_parameter(layer.weight, ShardSpec(dim, segments, replicas), group)
    if layer.bias is not None:
        layer.bias = shard_parameter(layer.bias, ShardSpec(0, segments, replicas), group)
    local = n_out * replicas // group.size
    if layout == "linear":
        layer.out_features = local
    else:
        layer.nf = local


def tensor_norm_share(group: Group) -> NormShare:
    """1D tensor parallelism's share of the gradient norm: a sharded piece is held by
    `spec.replicas` ranks of `group` (1 unless a grouped-query kv head), the rest by all."""

    def holders(param: torch.Tensor) -> int:
        spec = shard_spec(param)
        return group.size if spec is None else spec.replicas

    return NormShare(group, holders)


def tensor_layouts(model: nn.Module, mesh: DeviceMesh) -> dict[str, tuple[Placement, ...]]:
    """{parameter name: placements over the 1D `mesh` ("tp")} of the sharded parameters whose
    piece is one contiguous block of the full tensor (`Shard(spec.dim)`): what a checkpoint
    stores as the full tensor's piece, readable under any other split. Fused q|k|v and
    grouped-query kv pieces are not such blocks and are left out."""
    return {
        name: (Shard(spec.dim),)
        for name, spec in sharded_parameter_names(model).items()
        if spec.segments == 1 and spec.replicas == 1
    }
