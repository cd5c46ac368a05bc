"""A model built on the meta device, made real after `parallelize` split it: each tensor this
rank holds is allocated on its device and filled with its piece of the full tensor, read from a
`Weights` source (a Hugging Face folder's safetensors, `interlace.models.hf`), so no rank ever
holds a tensor it does not keep.

Where a piece lies in its full tensor is the splits' own rules, composed: 1D tensor
parallelism's (`shard_runs`: one run per fused q|k|v segment, a grouped-query kv head's
replicas reading the same run), then FSDP2's shard of that piece (torch's
`compute_local_shape_and_global_offset` of the DTensor). A pipeline rank holds fewer tensors,
its last stage's copy of a tied embedding read as the embedding (`Storage.aliases`). An
expert-parallel rank holds its experts of a fused experts tensor [E, ...] one module each,
renamed (`fused_expert_slices`): each is read as its expert's run of the fused tensor. A 3D
tensor parallel piece is its runs under the parameter's `Shard3D` (`shard3d_runs`, the rule
`shard3d_of` cuts by), a Conv1D weight's read from the stored [in, out] tensor and transposed.
A place is given as runs: per dimension, the [start, stop) index runs of the full tensor the
piece holds, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from interlace import comm
from interlace.comm import Group
from interlace.parallel.expert.fused import fused_expert_slices
from interlace.parallel.storage import Storage
from interlace.parallel.tensor.shard import ShardSpec, narrow_runs, shard_runs, shard_spec
from interlace.parallel.tensor3d.shard import (
    Grid,
    Shard3D,
    full_shape3d,
    shard3d_runs,
    shard3d_spec,
)
from interlace.tensors import Runs, local_tensor, materialise, state_tensors


class Weights(Protocol):
    """Where the full tensors are read from, by their names in the full model."""

    def read(self, name: str, runs: Runs) -> torch.Tensor:
        """The piece of full tensor `name` at `runs`: shape [sum of each dimension's runs]."""
        ...

    def init_buffers(self, modules: list[nn.Module]) -> None:
        """Compute the buffers of `modules` that are not stored (non-persistent), allocated on
        their device, in place."""
        ...


def load_pieces(
    model: nn.Module,
    roots: list[nn.Module],
    storage: Storage,
    tp: Group | None,
    grid: Grid | None,
    device: torch.device,
    weights: Weights,
) -> None:
    """Make `model` (built on the meta device, then split: this rank's part, under the full
    model's names, held by the modules `roots` that run it: `model` or its pipeline stages)
    real on `device`: each parameter and persistent buffer filled with its piece read from
    `weights` (under the name `storage` stores it as, a kept expert's slice as its run of the
    fused tensor; `tp`: the 1D tensor parallel group, `grid` the 3D one, None without), the
    non-persistent buffers computed by `weights.init_buffers`. In place."""
    held = nn.ModuleList(roots)
    materialise(held, device)
    state = dict(state_tensors(model))
    named = {id(t) for t in state.values()}
    kept = held.state_dict(keep_vars=True)
    if unnamed := [n for n, t in kept.items() if id(t) not in named]:
        raise ValueError(f"{unnamed}: held by the stages but not named in the model")
    owners = [n.rpartition(".")[0] for n, _ in held.named_buffers() if n not in kept]
    weights.init_buffers([held.get_submodule(owner) for owner in dict.fromkeys(owners)])
    experts = fused_expert_slices(model)
    with torch.no_grad():
        for name, tensor in state.items():
            local = local_tensor(tensor)
            piece = weights.read(*_place(name, tensor, storage, experts, tp, grid))
            local.copy_(_as_held(piece, tensor).view(local.shape))


def _place(
    name: str,
    tensor: torch.Tensor,
    storage: Storage,
    experts: dict[str, tuple[str, int]],
    tp: Group | None,
    grid: Grid | None,
) -> tuple[str, Runs]:
    """The full tensor this rank's piece of tensor `name` is read from (`storage`'s alias; a
    kept expert's slice, `experts`: the fused tensor) and the piece's runs in it (the slice's:
    its expert's run, then its own, [1, *shape])."""
    runs = piece_runs(tensor, tp, grid)
    if name not in experts:
        return storage.aliases.get(name, name), runs
    fused, expert = experts[name]
    return fused, [[(expert, expert + 1)], *runs]


def piece_runs(tensor: torch.Tensor, tp: Group | None, grid: Grid | None) -> Runs:
    """Where this rank's piece of `tensor` (a parameter as `parallelize` left it: a tensor
    parallel piece carrying its `ShardSpec`, over `tp`, or its `Shard3D`, over `grid`; a DTensor
    of FSDP2, its local shard of that piece) lies in the full tensor as stored (a 3D piece of a
    Conv1D weight: [in, out])."""
    return _runs(tensor, shard_spec(tensor), shard3d_spec(tensor), tp, grid)


def _runs(
    tensor: torch.Tensor,
    spec: ShardSpec | None,
    spec3d: Shard3D | None,
    tp: Group | None,
    grid: Grid | None,
) -> Runs:
    """`piece_runs` of `tensor` split by `spec` or `spec3d` (a state dict's copy of a parameter
    does not carry them)."""
    full = _full_shape(tensor, spec, spec3d, tp, grid)
    runs = [[(0, n)] for n in full]
    if spec3d is not None:
        runs = shard3d_runs(full, spec3d, grid)  # type: ignore[arg-type]
    elif spec is not None:
        runs[spec.dim] = shard_runs(spec, tp.rank, tp.size, full[spec.dim])  # type: ignore[union-attr]
    if isinstance(tensor, DTensor):
        local, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        runs = [narrow_runs(r, start, n) for r, start, n in zip(runs, offset, local, strict=True)]
    return runs[::-1] if spec3d is not None and spec3d.conv1d else runs


def _full_shape(
    tensor: torch.Tensor,
    spec: ShardSpec | None,
    spec3d: Shard3D | None,
    tp: Group | None,
    grid: Grid | None,
) -> list[int]:
    """The shape of the full tensor `tensor` is a piece of (see `_runs`), as the piece is held
    (a 3D piece of a Conv1D weight: [out, in])."""
    shape = list(tensor.shape)  # a DTensor: its global shape, the tensor parallel piece
    if spec3d is not None:
        assert grid is not None, "a 3D tensor parallel piece without its grid"
        return full_shape3d(shape, spec3d, grid)
    if spec is not None:
        assert tp is not None, "a tensor parallel piece without its group"
        shape[spec.dim] = shape[spec.dim] * tp.size // spec.replicas
    return shape


@dataclass(frozen=True)
class StoredWhole:
    """How a checkpoint stores a tensor parallel piece that no DCP placement describes (the
    runs of fused q|k|v or gate|up, a kv head several ranks hold, a 3D grid's rows cut
    twice): as the full tensor, which any split reads (`parallel.storage.Whole`). On saving,
    each rank writes its piece at its runs (`piece_runs`) into a full tensor of −inf and a max
    all-reduce over the split's groups fills in the others' (exact: the ranks holding one
    element hold the same value), then moves it to host memory; on loading, each rank takes
    its runs from the full tensor read there. Every rank holds these parameters' full tensors
    (and their optimizer states') in host memory while it saves or loads, one at a time on
    its device. Written by hand because DCP reshards a tensor by one block per rank, and such
    a piece is several."""

    tp: Group | None
    grid: Grid | None
    spec: ShardSpec | None = None
    spec3d: Shard3D | None = None

    def full(self, value: torch.Tensor) -> torch.Tensor:
        """The full tensor, in host memory (collective over the split's groups)."""
        full = value.new_full(self._stored_shape(value), float("-inf"))
        piece = value.detach()
        full[self._index(value, full.device)] = piece.t() if self._transposed else piece
        for group in self._groups():
            comm.all_reduce(full, group, op=dist.ReduceOp.MAX)
        return full.cpu()

    def empty(self, value: torch.Tensor) -> torch.Tensor:
        """An uninitialised full tensor in host memory to read into."""
        return torch.empty(self._stored_shape(value), dtype=value.dtype, device="cpu")

    def cut(self, full: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `full`, in the layout of `value`."""
        piece = full[self._index(value, full.device)]
        return piece.t() if self._transposed else piece

    @property
    def _transposed(self) -> bool:
        """A 3D piece of a Conv1D weight: held [out, in], stored [in, out]."""
        return self.spec3d is not None and self.spec3d.conv1d

    def _stored_shape(self, value: torch.Tensor) -> list[int]:
        shape = _full_shape(value, self.spec, self.spec3d, self.tp, self.grid)
        return shape[::-1] if self._transposed else shape

    def _index(self, value: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Index tensors on `device`, broadcast against each other, of the positions of the
        rank's piece."""
        runs = _runs(value, self.spec, self.spec3d, self.tp, self.grid)
        return tuple(
            torch.cat([torch.arange(a, b, device=device) for a, b in dim_runs]).view(
                [-1 if k == d else 1 for k in range(len(runs))]
            )
            for d, dim_runs in enumerate(runs)
        )

    def _groups(self) -> list[Group]:
        """The split's groups of more than one rank."""
        groups = [] if self.tp is None else [self.tp]
        if self.grid is not None:
            groups += [self.grid.x, self.grid.y, self.grid.z]
        return [g for g in groups if g.size > 1]


def _as_held(piece: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`piece`, read at `piece_runs(tensor, ...)`, in the layout `tensor` holds it: a 3D piece of
    a Conv1D weight, read [in', out'], transposed to the [out', in'] it is held as."""
    spec = shard3d_spec(tensor)
    return piece.t() if spec is not None and spec.conv1d else piece
