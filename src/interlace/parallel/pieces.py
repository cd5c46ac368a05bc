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

from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from interlace.comm import Group
from interlace.parallel.expert.fused import fused_expert_slices
from interlace.parallel.storage import Storage
from interlace.parallel.tensor.shard import narrow_runs, shard_runs, shard_spec
from interlace.parallel.tensor3d.shard import Grid, full_shape3d, shard3d_runs, shard3d_spec
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
    of FSDP2) lies in the full tensor as stored (a 3D piece of a Conv1D weight: [in, out])."""
    spec3d = shard3d_spec(tensor)
    if spec3d is not None:
        assert grid is not None, "a 3D tensor parallel piece without its grid"
        runs = shard3d_runs(full_shape3d(tensor.shape, spec3d, grid), spec3d, grid)
        return runs[::-1] if spec3d.conv1d else runs
    shape = list(tensor.shape)  # a DTensor: its global shape, the tensor parallel piece
    runs = [[(0, n)] for n in shape]
    spec = shard_spec(tensor)
    if spec is not None:
        assert tp is not None, "a tensor parallel piece without its group"
        length = shape[spec.dim] * tp.size // spec.replicas
        runs[spec.dim] = shard_runs(spec, tp.rank, tp.size, length)
    if isinstance(tensor, DTensor):
        local, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        runs = [narrow_runs(r, start, n) for r, start, n in zip(runs, offset, local, strict=True)]
    return runs


def _as_held(piece: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`piece`, read at `piece_runs(tensor, ...)`, in the layout `tensor` holds it: a 3D piece of
    a Conv1D weight, read [in', out'], transposed to the [out', in'] it is held as."""
    spec = shard3d_spec(tensor)
    return piece.t() if spec is not None and spec.conv1d else piece
