"""Tensors a checkpoint stores one key per row: what a module declares with
`checkpoint_slices()` ({its parameter's name: the keys of the parameter's rows along its first
dimension}, names relative to the module).

An MoE layer holds its E experts stacked (`interlace.moe.experts.GroupedExperts`) but stores
each expert under the key its own module would have, the key an expert-parallel layer, which
holds every expert as a module, stores it under: so a checkpoint resumes with or without expert
parallelism. Each row is a view of the stacked tensor (its parameter, or an optimizer state of
the same shape): DCP writes them from, and reads them into, the stacked tensor itself. A
DTensor (a parameter sharded by FSDP along its first dimension) gives the rows it holds
locally, under their global index.

Hand-written because DCP keys a tensor by one name; its resharding cuts tensors into chunks,
not into named rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from interlace.errors import CheckpointError


def sliced_names(model: nn.Module) -> dict[str, list[str]]:
    """{name of a tensor of `model` stored one key per row: those keys, in row order}."""
    sliced = {}
    for prefix, module in model.named_modules():
        declare = getattr(module, "checkpoint_slices", None)
        if declare is None:
            continue
        lead = f"{prefix}." if prefix else ""
        for name, keys in declare().items():
            sliced[lead + name] = [lead + key for key in keys]
    return sliced


def one_key_per_row(
    state: dict[str, Any], optim: dict[str, Any], sliced: dict[str, list[str]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model `state` and optimizer state dict `optim` with every tensor of `sliced` (and its
    optimizer state, per-row where it has the tensor's rows, else repeated for every row)
    replaced by the rows this rank holds, each under its key; views, sharing storage."""
    model = {}
    for name, value in state.items():
        if name in sliced:
            model.update({sliced[name][i]: row for i, row in _rows(name, value).items()})
        else:
            model[name] = value
    per_parameter = {}
    for name, entries in optim["state"].items():
        if name not in sliced:
            per_parameter[name] = entries
            continue
        rows = {k: _rows(name, t) for k, t in entries.items() if _same_rows(t, state.get(name))}
        for i in _rows(name, state[name]):
            per_parameter[sliced[name][i]] = {
                k: rows[k][i] if k in rows else t for k, t in entries.items()
            }
    return model, {**optim, "state": per_parameter}


def rejoined(
    loaded: dict[str, Any],
    loaded_optim: dict[str, Any],
    state: dict[str, Any],
    optim: dict[str, Any],
    sliced: dict[str, list[str]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inverse of `one_key_per_row` after DCP read into its rows: `loaded` and `loaded_optim`
    with the rows' keys replaced by the stacked tensors of `state` and `optim` they are views
    of (which hold what was read)."""
    keys = {key for row_keys in sliced.values() for key in row_keys}
    model = {k: v for k, v in loaded.items() if k not in keys}
    model.update({name: state[name] for name in sliced if name in state})
    per_parameter = {k: v for k, v in loaded_optim["state"].items() if k not in keys}
    per_parameter.update({name: optim["state"][name] for name in sliced if name in optim["state"]})
    return model, {**loaded_optim, "state": per_parameter}


def _same_rows(value: Any, parameter: Any) -> bool:
    return torch.is_tensor(value) and parameter is not None and value.shape == parameter.shape


def _rows(name: str, value: torch.Tensor) -> dict[int, torch.Tensor]:
    """{global row index: row} of the rows of `value` (named `name`) this rank holds."""
    if not isinstance(value, DTensor):
        return dict(enumerate(value.unbind(0)))
    shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    if tuple(shape[1:]) != tuple(value.shape[1:]):
        raise CheckpointError(
            f"{name}: stored one key per row, but this rank holds a piece of its rows "
            f"({list(shape)} of {list(value.shape)}); it can be split along its first "
            "dimension only"
        )
    return {offset[0] + i: row for i, row in enumerate(value.to_local().unbind(0))}
