"""Checkpoints on torch.distributed.checkpoint (DCP), atomic and verified.

Layout of `<run>/checkpoints/`:
    step-00000100/            one finished checkpoint
        .metadata, *.distcp   DCP's files: model + optimizer state, written by every rank
        rng-rank<r>.pt        each rank's RNG state
        meta.json             step, Plan, model config, train config, data state, world size
        manifest.json         size and SHA-256 of every file above (written last)
    latest                    name of the newest finished checkpoint

A checkpoint is first written to `step-<8-digit step>.tmp/` and renamed when complete, so a crash
leaves either the previous checkpoint or a new complete one, never a half-written one. Loading
verifies the manifest, that the checkpoint belongs to this run (same plan, model, data) and
that its pickled files name nothing but tensors and DCP's metadata classes (`safe_load.py`)
before touching any tensor: no file of a checkpoint can run code when it is loaded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from interlace.errors import CheckpointError
from interlace.parallel.storage import Storage, Whole
from interlace.plan import Plan
from interlace.run_folder import fsync_path, write_atomic
from interlace.safe_load import check_dcp_metadata, load_rng_state
from interlace.stored_rows import one_key_per_row, rejoined, sliced_names
from interlace.tensors import local_tensor

_META = "meta.json"
_MANIFEST = "manifest.json"
_LATEST = "latest"
_DCP_METADATA = ".metadata"
_DISK_FULL_BYTES = 1 << 20
"""Free space below which a failed checkpoint write is reported as a full disk."""


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint after `step` optimizer steps."""
    return f"step-{step:08d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _every_ranks(entries: dict[str, Any]) -> dict[str, Any]:
    """The union of every rank's `entries` (collective under torch.distributed; a barrier)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return entries
    every: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, entries)
    return {k: v for rank in every for k, v in rank.items()}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@dataclasses.dataclass(frozen=True)
class _Cut:
    """A piece stored as its full tensor, on loading: the full tensor read (or a DTensor view
    of it sharing the piece's storage, read in place), how it is cut (None for a view), the
    piece as the state dict holds it."""

    full: torch.Tensor
    whole: Whole | None
    piece: torch.Tensor

    def apply(self) -> None:
        """Copy this rank's part of the full tensor read into the piece, in place."""
        if self.whole is not None:
            with torch.no_grad():
                self.piece.copy_(self.whole.cut(self.full, self.piece))


def _stored(
    state: dict[str, Any], optim: dict[str, Any], storage: Storage, reading: bool = False
) -> tuple[dict[str, Any], dict[str, Any], set[str], list[_Cut]]:
    """Model and optimizer state dicts as DCP stores them, the names stored as full tensors,
    and (`reading`) what goes back from the full tensors read into each piece. A piece of a
    parameter in `storage.layouts` (its local tensor, under FSDP2: `data.stored_shards`)
    becomes a DTensor view of the full tensor, sharing its storage: the checkpoint holds the
    full tensor, which any other split can read. One in `storage.whole` is stored as its full
    tensor too, gathered on saving (collective); on `reading`, an empty full tensor is read in
    its place. Another
    parameter in `storage.keys` is stored under its own key: a piece only the same split can
    read. `param_groups` keep the parameter names, shared by all."""
    aliases = storage.aliases
    # a pipeline's last stage holds the tied head under its own name: its piece's layout (or
    # key) is the embedding's, under which it is stored
    keys = {aliases.get(k, k): v for k, v in storage.keys.items()}
    layouts = {aliases.get(k, k): v for k, v in storage.layouts.items()}
    state = {aliases.get(k, k): v for k, v in state.items()}
    optim = {**optim, "state": {aliases.get(k, k): v for k, v in optim["state"].items()}}
    viewed = {n for n in layouts if n in state}
    whole = {aliases.get(k, k): v for k, v in storage.whole.items()}
    whole = {n: w for n, w in whole.items() if n in state and n not in viewed}
    cuts: list[_Cut] = []

    def view(name: str, value: Any) -> Any:
        if not torch.is_tensor(value) or value.dim() == 0:
            return value  # AdamW's step count stays as it is
        if name in viewed:
            mesh, placements = layouts[name]
            local = value.to_local() if isinstance(value, DTensor) else value
            full = DTensor.from_local(local, mesh, placements, run_check=False)
            if reading:
                cuts.append(_Cut(full, None, value))
            return full
        if name not in whole:
            return value
        if not reading:
            return whole[name].full(value)
        cut = _Cut(whole[name].empty(value), whole[name], value)
        cuts.append(cut)
        return cut.full

    def key(name: str) -> str:
        return name if name in viewed or name in whole else keys.get(name, name)

    model_state = {key(k): view(k, v) for k, v in state.items()}
    optim_state = {
        **optim,
        "state": {key(k): {n: view(k, t) for n, t in s.items()} for k, s in optim["state"].items()},
    }
    return model_state, optim_state, viewed | set(whole), cuts


def _untied(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """`state` without the entries that repeat an earlier entry's tensor (a tied LM head, which
    a state dict lists under both names), and {name left out: the name it repeats}: the tensor
    is stored once, under its first name, whatever the split."""
    first: dict[tuple, str] = {}
    kept, tied = {}, {}
    for name, value in state.items():
        if torch.is_tensor(value):
            local = local_tensor(value)
            ident = (local.untyped_storage().data_ptr(), local.storage_offset(), local.shape)
            if ident in first:
                tied[name] = first[ident]
                continue
            first[ident] = name
        kept[name] = value
    return kept, tied


def _restored(
    model_state: dict[str, Any],
    optim_state: dict[str, Any],
    storage: Storage,
    full: set[str],
    cuts: list[_Cut],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inverse of `_stored`: this rank's pieces under the parameter names, `full` the names
    stored as full tensors; each of `cuts` copies its part of a full tensor read into its
    piece (a DTensor view was read in place), which takes the full tensor's place."""
    back = {stored: name for name, stored in storage.keys.items() if name not in full}
    unalias = {stored: name for name, stored in storage.aliases.items()}
    for cut in cuts:
        cut.apply()
    pieces = {id(cut.full): cut.piece for cut in cuts}

    def local(value: Any) -> Any:
        return pieces.get(id(value), value)

    def name(key: str) -> str:
        stored = back.get(key, key)
        return unalias.get(stored, stored)

    model = {name(k): local(v) for k, v in model_state.items()}
    state = {name(k): {n: local(t) for n, t in s.items()} for k, s in optim_state["state"].items()}
    return model, {**optim_state, "state": state}


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    keep: int,
    storage: Storage | None = None,
) -> Path:
    """Write the checkpoint of `step` under `root` (collective: every rank calls it).

    `meta` (JSON-able) is stored as meta.json with `step` added. `storage` names and places
    this rank's pieces of split parameters (see `Storage`; default: every tensor whole under
    its name). Keeps the newest `keep` checkpoints. Returns the final folder.
    """
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f"{checkpoint_name(step)}.tmp"
    try:
        _write_folder(tmp, step, model, optimizer, meta, storage or Storage())
    except BaseException:  # a full disk on any rank: no half-written folder stays behind
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_path(root)
        write_atomic(root / _LATEST, final.name)
        _prune(root, keep, step)
    _barrier()
    return final


def _write_folder(
    tmp: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    storage: Storage,
) -> None:
    """Every rank's files of the checkpoint into `tmp`, each fsync'd, the manifest last
    (collective). An OSError of any rank's DCP write is raised as that OSError."""
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    model_state, optim_state, *_ = _stored(_untied(model_state)[0], optim_state, storage)
    model_state, optim_state = one_key_per_row(model_state, optim_state, sliced_names(model))
    # DCP stages tensors ahead (torch's default: 10 MB) on a CUDA stream wherever CUDA is
    # available: useless for CPU tensors, fatal in a CPU rank forked from a CUDA process.
    on_gpu = any(p.is_cuda for p in model.parameters())
    writer = dcp.FileSystemWriter(tmp, per_thread_copy_ahead=10_000_000 if on_gpu else 0)
    rng_file = tmp / f"rng-rank{_rank()}.pt"
    try:
        with single_process_is_intended():  # DCP fsyncs its files (sync_files=True)
            dcp.save({"model": model_state, "optim": optim_state}, storage_writer=writer)
        torch.save(_rng_state(), rng_file)
    except (CheckpointException, RuntimeError) as exc:
        raise _os_error_of(exc, tmp) from None
    fsync_path(rng_file)
    assembly = _every_ranks({storage.aliases.get(k, k): v for k, v in storage.assembly.items()})
    if _rank() == 0:
        meta = {**meta, "step": step, **({"assembly": assembly} if assembly else {})}
        write_atomic(tmp / _META, json.dumps(meta, indent=1, sort_keys=True))
        write_atomic(tmp / _MANIFEST, json.dumps(_manifest(tmp), indent=1, sort_keys=True))


def _os_error_of(exc: BaseException, folder: Path) -> BaseException:
    """The OSError behind a failed write into `folder`: the first among the ranks' failures DCP
    gathered, or "no space left" where the folder's disk is full (torch's file writer reports
    a full disk as a RuntimeError); else `exc` itself. The disk is asked through the folder's
    nearest existing ancestor: rank 0 may already have removed the folder itself."""
    failures = exc.failures.values() if isinstance(exc, CheckpointException) else [exc]
    for failure in failures:
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, OSError):
            return error
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if shutil.disk_usage(existing).free < _DISK_FULL_BYTES:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
    return exc


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint folder meant by `path`: a checkpoint itself, or a `checkpoints/` folder or
    run folder, resolved through `latest`. When the checkpoint `latest` names is missing or fails
    `verify_checkpoint`, the newest kept checkpoint that passes is taken instead, with a warning
    on stderr. Raises CheckpointError if there is none."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if (candidate / _MANIFEST).exists() or (candidate / _META).exists():
            return candidate
        latest = candidate / _LATEST
        if latest.exists():
            return _newest_valid(candidate, candidate / latest.read_text().strip())
    if not path.exists():
        raise CheckpointError(f"checkpoint path '{path}' does not exist")
    if (path / "metrics.jsonl").exists():
        raise CheckpointError(
            f"'{path}' holds a run that stopped before its first checkpoint, so there is "
            "nothing to resume: start it again with --overwrite instead of --resume"
        )
    raise CheckpointError(f"'{path}' holds no checkpoint (no {_META}, no checkpoints/{_LATEST})")


def checkpoint_at(run: Path, step: int) -> Path:
    """The checkpoint of `step` in the run folder `run` (`<run>/checkpoints/step-N`); raises
    CheckpointError naming the steps kept there if it has none of that step."""
    root = Path(run) / "checkpoints"
    folder = root / checkpoint_name(step)
    if folder.is_dir():
        return folder
    steps = sorted(
        int(p.name.removeprefix("step-"))
        for p in root.glob("step-*")
        if p.is_dir() and not p.name.endswith(".tmp")
    )
    kept = ", ".join(map(str, steps)) if steps else "none"
    raise CheckpointError(f"run '{run}' has no checkpoint of step {step}; steps kept: {kept}")


def _newest_valid(root: Path, named: Path) -> Path:
    """`named` if it verifies, else the newest finished checkpoint under `root` that does."""
    kept = sorted((p for p in root.glob("step-*") if not p.name.endswith(".tmp")), reverse=True)
    problem = None
    for checkpoint in [named, *(p for p in kept if p != named)]:
        try:
            verify_checkpoint(checkpoint, {})
        except CheckpointError as exc:
            problem = problem or exc
            continue
        if problem is not None and _rank() == 0:
            print(
                f"interlace: warning: {problem}; resuming from the newest valid checkpoint, "
                f"'{checkpoint}', instead",
                file=sys.stderr,
            )
        return checkpoint
    raise problem  # `named` was tried first, so a problem was found


def verify_checkpoint(path: Path, expect: dict[str, Any]) -> dict[str, Any]:
    """Check the folder's files against its manifest, its meta against `expect` (keys of
    meta.json that must be equal, e.g. plan, model, data) and its pickled files for anything
    but tensors and DCP metadata, without running them. Returns meta; raises CheckpointError
    naming the first problem."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' is missing")
    manifest_file = path / _MANIFEST
    if not manifest_file.exists():
        raise CheckpointError(f"checkpoint '{path}' is incomplete or corrupt: no {_MANIFEST}")
    try:
        manifest = json.loads(manifest_file.read_text())
        meta = json.loads((path / _META).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint '{path}' is corrupt: cannot read its metadata ({exc})"
        ) from None
    for name, entry in manifest.items():
        file = path / name
        if not file.exists():
            raise CheckpointError(f"checkpoint '{path}' is corrupt: file '{name}' is missing")
        if file.stat().st_size != entry["size"] or _sha256(file) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint '{path}' is corrupt: file '{name}' does not match "
                "its recorded size/checksum"
            )
    if _DCP_METADATA not in manifest:
        raise CheckpointError(f"checkpoint '{path}' is incomplete: no {_DCP_METADATA} in it")
    check_dcp_metadata(path / _DCP_METADATA)
    for name in manifest:
        if name.startswith("rng-rank"):
            load_rng_state(path / name)
    for key, value in expect.items():
        if meta.get(key) != value:
            where, theirs, ours = _first_difference(key, meta.get(key), value)
            raise CheckpointError(
                f"checkpoint '{path}' does not match this run: its {where} is "
                f"{_short(theirs)}, this run's is {_short(ours)}"
            )
    return meta


def _first_difference(where: str, theirs: Any, ours: Any) -> tuple[str, Any, Any]:
    """The dotted path of the first entry in which two unequal values (nested dicts) differ,
    and the two values there."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        for key in sorted(set(theirs) | set(ours), key=str):
            if theirs.get(key) != ours.get(key):
                return _first_difference(f"{where}.{key}", theirs.get(key), ours.get(key))
    return where, theirs, ours


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    expect: dict[str, Any],
    storage: Storage | None = None,
) -> dict[str, Any]:
    """Verify, then load model, optimizer and this rank's RNG state in place (collective);
    `storage` that of this run's split (as given to save_checkpoint). A
    checkpoint saved under another split loads as long as what this split reads was stored as
    full tensors (DCP reshards them); its RNG state is restored only under the same world size.
    Returns the checkpoint's meta (with `step`)."""
    path = Path(path)
    meta = verify_checkpoint(path, expect)
    rng_file = path / f"rng-rank{_rank()}.pt"
    same_world = meta.get("world_size") == (dist.get_world_size() if dist.is_initialized() else 1)
    if same_world and not rng_file.exists():
        raise CheckpointError(f"checkpoint '{path}' has no RNG state for rank {_rank()}")
    rng_state = load_rng_state(rng_file) if same_world else None
    storage = _as_written(storage or Storage(), path)
    model_state, optim_state = get_state_dict(model, optimizer)
    model_state, tied = _untied(model_state)
    model_state, optim_state, full, cuts = _stored(model_state, optim_state, storage, True)
    sliced = sliced_names(model)
    # DCP keeps one copy of non-tensor values, so ranks holding different parameters (pipeline
    # stages) would get another rank's param_groups: keep this rank's own, unread (hyper-
    # parameters come from the run's config, the per-parameter state from the checkpoint;
    # the groups of AdamW with other --optimizer-state name other settings)
    param_groups = copy.deepcopy(optim_state["param_groups"])
    rows, optim_rows = one_key_per_row(model_state, optim_state, sliced)
    state = {"model": rows, "optim": {"state": optim_rows["state"]}}
    try:
        with single_process_is_intended():
            dcp.load(state, checkpoint_id=path)
    except (CheckpointException, RuntimeError) as exc:
        raise CheckpointError(
            f"checkpoint '{path}' (plan {Plan.from_dict(meta['plan'])}) cannot be read under "
            f"this split: {_first_line(exc)}; FSDP2's shards of tensor parallel pieces that are "
            "not one block of the full tensor (fused, shared or twice-cut ones), that it cut "
            "unevenly or over a mesh of their own (experts over ep_dp), and pieces in "
            "checkpoints written before they were stored whole, are stored as their split had "
            "them: resume under the checkpoint's plan"
        ) from None
    state["optim"]["param_groups"] = param_groups
    loaded = rejoined(state["model"], state["optim"], model_state, optim_state, sliced)
    model_state, optim_state = _restored(*loaded, storage, full, cuts)
    model_state.update({name: model_state[first] for name, first in tied.items()})
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    if rng_state is not None:
        _set_rng_state(rng_state)
    return meta


def _as_written(storage: Storage, path: Path) -> Storage:
    """`storage` reading each piece the way the checkpoint at `path` holds it: a piece of
    `storage.whole` that the checkpoint holds under its own key (written before such pieces
    were stored whole) is read from there."""
    written = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    stored = {name: storage.aliases.get(name, name) for name in storage.whole}
    own = {
        name
        for name, as_named in stored.items()
        if f"model.{as_named}" not in written
        and f"model.{storage.keys.get(name, as_named)}" in written
    }
    kept = {name: whole for name, whole in storage.whole.items() if name not in own}
    return dataclasses.replace(storage, whole=kept)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def single_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: one process is a valid run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict[str, Any]:
    """The CPU generator's state, and CUDA's where this process uses CUDA (asking a process that
    does not, such as a forked gloo rank, would initialise CUDA)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    return {
        file.relative_to(folder).as_posix(): {"size": file.stat().st_size, "sha256": _sha256(file)}
        for file in sorted(folder.rglob("*"))
        if file.is_file() and file.name != _MANIFEST
    }


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _prune(root: Path, keep: int, step: int) -> None:
    """Delete all but the newest `keep` finished checkpoints up to `step`. Those of later steps
    (left by a run this one resumed before their step) are neither counted nor deleted: the
    run replaces each when it reaches its step."""
    finished = sorted(
        p
        for p in root.glob("step-*")
        if not p.name.endswith(".tmp") and p.name <= checkpoint_name(step)
    )
    for old in finished[:-keep]:
        shutil.rmtree(old)


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."
