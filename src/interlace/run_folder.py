"""How a run folder is written: checked before launch, every file replaced atomically and
durably, temporaries of an interrupted run removed at the next start.

A file is written to a hidden temporary `.<name>.partial` beside it, flushed to the disk
(fsync), renamed over the target and the folder fsync'd, so a crash or a full disk leaves the old
file or the new one, never part of one, and a reader never sees the temporary under the target's
name. Checkpoints follow the same rule with whole folders (`checkpoint.py`: `step-N.tmp`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from interlace.errors import ConfigError

CHECKPOINT_BYTES_PER_PARAM = 12
"""Bytes one checkpoint holds per parameter: the fp32 weight and AdamW's two fp32 moments."""

_PARTIAL = ".partial"


def checkpoint_bytes(num_params: int) -> int:
    """Estimated size in bytes of one checkpoint of a model with `num_params` parameters."""
    return CHECKPOINT_BYTES_PER_PARAM * num_params


def holds_checkpoint(run: Path) -> bool:
    """Whether the run folder `run` kept a finished checkpoint (`checkpoints/step-N`, not a
    `.tmp` one being written): what `--resume` there could continue from."""
    return any(not p.name.endswith(".tmp") for p in (Path(run) / "checkpoints").glob("step-*"))


def check_writable(out: Path, need_bytes: int) -> None:
    """ConfigError unless the folder `out` (or, if it does not exist yet, the nearest existing
    folder above it) accepts a file and has `need_bytes` free. Writes nothing that stays."""
    out = Path(out)
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"--out '{out}' cannot be created: '{existing}' is a file, not a folder; "
            "choose another --out"
        )
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ConfigError(
            f"--out '{out}' is not writable ({exc.strerror} in '{existing}'); "
            "choose a writable --out"
        ) from None
    free = shutil.disk_usage(existing).free
    if free < need_bytes:
        raise ConfigError(
            f"--out '{out}' has {_mib(free)} free, but one checkpoint of this model needs about "
            f"{_mib(need_bytes)} ({CHECKPOINT_BYTES_PER_PARAM} bytes per parameter: fp32 "
            "weights and AdamW's two moments); free some space or choose another --out"
        )


def fsync_path(path: Path) -> None:
    """Flush the file or folder `path` to the disk (a folder: its entries, after a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replaced_atomically(file: Path) -> Iterator[Path]:
    """A temporary path to write `file`'s new content to; when the block ends it is fsync'd
    and renamed over `file`, or removed if the block raised."""
    file = Path(file)
    tmp = file.with_name(f".{file.name}{_PARTIAL}")
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(file.parent)


def write_atomic(file: Path, data: str | bytes) -> None:
    """Replace `file` by `data` (text as UTF-8) atomically and durably."""
    with replaced_atomically(file) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def append_line(file: Path, line: str) -> None:
    """Append `line` and a newline to `file` in one write; if the write fails (a full disk), the
    file is cut back to its old length, so it never ends in part of a line."""
    data = (line + "\n").encode()
    fd = os.open(file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def remove_stale(folder: Path) -> list[Path]:
    """Delete what an interrupted run left in `folder`, its `checkpoints/` and `profile/`:
    `.<name>.partial` files (and a profile trace's `.partial.gz`) and `step-N.tmp` folders.
    Returns what was removed."""
    folder = Path(folder)
    stale = [*folder.glob(f".*{_PARTIAL}"), *folder.glob(f"checkpoints/.*{_PARTIAL}")]
    stale += folder.glob(f"profile/.*{_PARTIAL}*")
    stale += folder.glob("checkpoints/step-*.tmp")
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"
