"""Reading the pickled files of a checkpoint without running code they name.

A checkpoint folder may come from anyone, and a pickle can call any function while it loads.
Two kinds of pickled file are read here, both before anything is loaded:

- `rng-rank<r>.pt`, a dict of the generators' states (uint8 tensors), through
  `torch.load(weights_only=True)`, which builds tensors and containers and nothing else;
- DCP's `.metadata`, which torch's own reader loads with plain `pickle.load`. It is first
  unpickled here by an `Unpickler` that resolves only DCP's metadata classes, `torch.Size`,
  torch dtypes and layouts and paths, so a file naming anything else is refused before torch
  reads it. torch does not offer this check itself.
"""

from __future__ import annotations

import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata

from interlace.errors import CheckpointError

_ALLOWED = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    **{
        ("pathlib", name): getattr(pathlib, name)
        for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
    },
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves the globals a DCP `.metadata` file names from `_ALLOWED`, the classes defined in
    `torch.distributed.checkpoint.metadata` and torch's dtypes; refuses any other."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == dcp_metadata.__name__:
            value = getattr(dcp_metadata, name, None)
            if isinstance(value, type) and value.__module__ == module:
                return value
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def check_dcp_metadata(file: Path) -> None:
    """Unpickle DCP's `.metadata` `file` with only DCP's own classes resolvable; CheckpointError
    if it names any other global (which torch's `pickle.load` would import and may call)."""
    try:
        with Path(file).open("rb") as handle:
            _MetadataUnpickler(handle).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint file '{file}' is refused: it is not DCP metadata ({exc}), and loading "
            "it could run code"
        ) from None


def load_rng_state(file: Path) -> dict[str, Any]:
    """The RNG states saved in `file` ({"torch": uint8 tensor, "cuda": [uint8 tensors]}) read
    with `weights_only=True`; CheckpointError if the file holds anything else."""
    try:
        state = torch.load(file, weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, ... by file content
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"checkpoint file '{file}' is refused: it holds more than tensors ({reason})"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("torch"), torch.Tensor):
        raise CheckpointError(f"checkpoint file '{file}' is refused: it holds no RNG state")
    return state
