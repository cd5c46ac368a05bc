"""A Hugging Face folder's safetensors read piece by piece, for a model built on the meta device
(`interlace.parallel.pieces` asks for each tensor's piece; `models/hf.py` builds the model).

The files' tensors are matched to the model's as transformers itself loads them (`stored_as`,
by its conversion mapping): under the model's names, renamed (Mixtral's `block_sparse_moe` is
the model's `mlp`), or fused from experts stored one tensor each (Mixtral's and Qwen2-MoE's
gate|up [E, 2F, d] and down [E, d, F], `Stacked`), a piece of a fused tensor read from only the
experts and parts it holds. The buffers the folder does not store (the rotary embedding's
inverse frequencies) are computed by the model's own rule (`FolderWeights.init_buffers`).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from interlace.tensors import Runs, state_tensors


def open_weights(folder: Path, model: nn.Module) -> FolderWeights | None:
    """`folder`'s safetensors as the pieces of `model` (built from its config on the meta device)
    are read from, or None where they do not hold every tensor of the model, by name and shape,
    as transformers loads them (`stored_as`: renamed, experts stored one by one fused; no
    weights at all, a conversion read here cannot reproduce)."""
    files = _stored_files(folder)
    stored = stored_as(model, list(files))
    wanted = {n: t.shape for n, t in state_tensors(model)}
    if stored is None or not wanted.keys() <= stored.keys():
        return None
    weights = FolderWeights(folder, files, _stored_shapes(folder, files), stored, model)
    return weights if all(weights.shape(n) == shape for n, shape in wanted.items()) else None


@dataclass(frozen=True)
class Stacked:
    """A model tensor [E, ...] transformers fuses as it loads from tensors stored one per expert:
    `parts[j][e]` the stored name of part j of expert e (each [...] without the expert
    dimension); each part's experts stacked along a new first dimension, then the parts
    concatenated along `dim` (>= 1) in order (Mixtral's gate|up: w1 then w3, dim 1)."""

    parts: tuple[tuple[str, ...], ...]
    dim: int


def stored_as(model: nn.Module, keys: list[str]) -> dict[str, str | Stacked] | None:
    """{name of a tensor of `model`: how the folder stores it} from the stored tensor names
    `keys`, by the conversion mapping transformers itself loads the folder with
    (`get_model_conversion_mapping`, `rename_source_key`): a tensor under its stored name
    (renamed or not), one fused from experts stored one by one as `Stacked`. None where the
    mapping converts otherwise than stacking experts and concatenating parts (a split, a
    transpose: the whole model is built then). Stored tensors the model does not have are
    left out, as `from_pretrained` ignores them; of several renamed to one name, the first in
    transformers' order is the one it loads."""
    try:
        from transformers import conversion_mapping
        from transformers import core_model_loading as loading
    except ImportError:  # transformers 4: the model's names are the files'
        return dict(zip(keys, keys, strict=True))
    mapping = conversion_mapping.get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, loading.WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, loading.WeightConverter)]
    wanted, prefix = model.state_dict(), model.base_model_prefix
    plain: dict[str, str] = {}
    found: dict[str, dict[str, list[str]]] = {}  # {name: {source pattern: keys, in order}}
    for key in sorted(keys, key=loading.dot_natural_key):  # the order transformers stacks in
        name, pattern = loading.rename_source_key(key, renamings, converters, prefix, wanted)
        if name not in wanted and key in wanted:
            name, pattern = loading.rename_source_key(key, [], [], prefix, wanted)
        if name in wanted and pattern is None:
            plain.setdefault(name, key)
        elif name in wanted:
            found.setdefault(name, {}).setdefault(pattern, []).append(key)
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    stacked = {n: _stacked(by_pattern[next(iter(f))], f) for n, f in found.items()}
    return None if None in stacked.values() else {**plain, **stacked}


def _stacked(converter: Any, found: dict[str, list[str]]) -> Stacked | None:
    """The `Stacked` tensor transformers' `converter` fuses from the stored tensors `found`
    ({source pattern: names, in order}), or None for operations other than
    `MergeModulelist(dim=0)` (one source pattern), then `Concatenate(dim >= 1)` (several)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    merge, *concat = converter.operations
    if type(merge) is not MergeModulelist or merge.dim != 0:
        return None
    parts = tuple(tuple(found[p]) for p in converter.source_patterns if p in found)
    if not concat and len(converter.source_patterns) == 1:
        return Stacked(parts, 1)
    if len(concat) == 1 and type(concat[0]) is Concatenate and concat[0].dim >= 1:
        return Stacked(parts, concat[0].dim)
    return None


class FolderWeights:
    """A Hugging Face folder's safetensors read piece by piece (`interlace.parallel.pieces`'s
    `Weights`): only the pieces asked for are read from the files. `files`: {stored name: file
    holding it}; `shapes`: {stored name: its shape}; `stored`: {tensor name: how it is stored,
    `stored_as`}; `model`: the transformers model the tensors are of (its rule computes the
    buffers it does not store)."""

    def __init__(
        self,
        folder: Path,
        files: dict[str, str],
        shapes: dict[str, torch.Size],
        stored: dict[str, str | Stacked],
        model: nn.Module,
    ) -> None:
        self.folder = folder
        self.files = files
        self.shapes = shapes
        self.stored = stored
        self.model = model

    def shape(self, name: str) -> torch.Size | None:
        """The shape of tensor `name` as stored (fused: as transformers fuses it), None where
        its experts or parts do not fuse."""
        stored = self.stored[name]
        return self.shapes[stored] if isinstance(stored, str) else _fused_shape(stored, self.shapes)

    def read(self, name: str, runs: Runs) -> torch.Tensor:
        """The piece of tensor `name` at `runs` (per dimension, the [start, stop) index runs it
        holds), in its stored dtype: [sum of each dimension's runs]; reads only that piece (of
        a fused one, only the experts and parts it holds)."""
        if not all(runs):  # an empty piece
            return torch.empty([sum(stop - start for start, stop in r) for r in runs])
        stored = self.stored[name]
        if isinstance(stored, str):
            return self._read(stored, runs)
        experts = [e for start, stop in runs[0] for e in range(start, stop)]
        return torch.stack([self._read_expert(stored, e, runs[1:]) for e in experts])

    def _read_expert(self, stored: Stacked, expert: int, runs: Runs) -> torch.Tensor:
        """Expert `expert`'s piece at `runs` (its own dimensions) of the fused tensor `stored`:
        each part's runs along the concatenated dimension read from that part, joined."""
        dim = stored.dim - 1
        keys = [part[expert] for part in stored.parts]
        widths = [self.shapes[key][dim] for key in keys]
        blocks = [
            self._read(keys[part], [*runs[:dim], within, *runs[dim + 1 :]])
            for part, within in _runs_in_parts(runs[dim], widths)
        ]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim)

    def _read(self, key: str, runs: Runs) -> torch.Tensor:
        """Stored tensor `key`'s piece at `runs`: [sum of each dimension's runs]."""
        with _safe_open(self.folder / self.files[key]) as stored:
            return _join(stored.get_slice(key), runs, ())

    def init_buffers(self, modules: list[nn.Module]) -> None:
        """Compute the buffers of `modules` that the folder does not store (non-persistent) in
        place, by the transformers model's own rule, as `from_pretrained` does: its
        `_init_weights` of each (the rotary embedding's inverse frequencies from the config)."""
        for module in modules:
            self.model._init_weights(module)


def _fused_shape(stored: Stacked, shapes: dict[str, torch.Size]) -> torch.Size | None:
    """The shape [E, ...] transformers fuses `stored` to (its stack and concatenation, run on
    the meta device), None where they fail (experts or parts of disagreeing shapes)."""
    try:
        parts = [
            torch.stack([torch.empty(shapes[key], device="meta") for key in part])
            for part in stored.parts
        ]
        return torch.cat(parts, stored.dim).shape
    except (RuntimeError, IndexError):
        return None


def _runs_in_parts(
    runs: list[tuple[int, int]], widths: list[int]
) -> list[tuple[int, list[tuple[int, int]]]]:
    """`runs` of a dimension concatenated from parts `widths` wide, as (part, runs within it)
    in order: a run crossing a boundary cut there, consecutive runs in one part together."""
    bounds = list(itertools.accumulate(widths, initial=0))
    groups: list[tuple[int, list[tuple[int, int]]]] = []
    for start, stop in runs:
        for part, (low, high) in enumerate(itertools.pairwise(bounds)):
            if max(start, low) < min(stop, high):
                run = (max(start, low) - low, min(stop, high) - low)
                if groups and groups[-1][0] == part:
                    groups[-1][1].append(run)
                else:
                    groups.append((part, [run]))
    return groups


def _safe_open(path: Path) -> Any:
    """The safetensors file `path`, opened for reading tensors (a context manager)."""
    from safetensors import safe_open  # comes with transformers: the hf extra

    return safe_open(path, "pt")


def _join(stored: Any, runs: Runs, index: tuple) -> torch.Tensor:
    """The blocks of the safetensors slice `stored` at every combination of `runs` after
    `index`, joined in order along each dimension."""
    dim = len(index)
    if dim == len(runs):
        return stored[index]
    blocks = [_join(stored, runs, (*index, slice(start, stop))) for start, stop in runs[dim]]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim)


def _stored_files(folder: Path) -> dict[str, str]:
    """{tensor name: file} of `folder`'s safetensors: the index's map of a sharded set, else
    model.safetensors's tensors ({} without either)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    if not (folder / "model.safetensors").is_file():
        return {}
    with _safe_open(folder / "model.safetensors") as stored:
        return dict.fromkeys(stored.keys(), "model.safetensors")


def _stored_shapes(folder: Path, files: dict[str, str]) -> dict[str, torch.Size]:
    """{stored name: shape} of the tensors `files` ({name: file}) lists, each file opened once."""
    shapes = {}
    for file, keys in itertools.groupby(sorted(files, key=files.__getitem__), files.__getitem__):
        with _safe_open(folder / file) as stored:
            shapes |= {key: torch.Size(stored.get_slice(key).get_shape()) for key in keys}
    return shapes
