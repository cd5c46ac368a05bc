"""Writing the run folder: an unwritable or full --out is refused before launch (exit 2) and a
disk that fills during the run stops it with one line and exit 3, leaving nothing half-written;
temporaries of an interrupted run are removed; a missing or corrupt newest checkpoint falls back
to the newest valid one; metrics are never left with part of a line or a half-rewritten file."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from interlace.checkpoint import _os_error_of, checkpoint_name, verify_checkpoint
from interlace.cli import main
from interlace.errors import ConfigError
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.report import MetricsLog, read_metrics
from interlace.run_folder import append_line, checkpoint_bytes
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig
from test_cli import checkpoint_dir, corrupt_a_shard, expect_usage_error, run_files, train_args


@pytest.fixture
def mount(tmp_path):
    """mount(options) → a fresh tmpfs folder mounted with `options` (e.g. "size=1m", "ro"),
    unmounted after the test; skips where this process may not mount (not root)."""
    mounted = []

    def make(options: str) -> Path:
        folder = tmp_path / f"mnt{len(mounted)}"
        folder.mkdir()
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True
        )
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()})")
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def stderr_lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_read_only_out_folder_is_refused_before_launch(capsys, mount):
    out = mount("ro,size=8m") / "run"
    expect_usage_error(capsys, train_args(out, 2), f"--out '{out}' is not writable")
    assert not out.exists()


def test_out_below_a_file_is_refused_before_launch(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run"
    expect_usage_error(capsys, train_args(out, 2), "is a file, not a folder")


def test_out_without_room_for_one_checkpoint_is_refused_before_launch(capsys, mount):
    need = checkpoint_bytes(get_preset("tiny").num_params())
    assert 1 << 20 < need < 2 << 20  # the tiny model's checkpoint: between 1 and 2 MiB
    out = mount("size=1m") / "run"
    expect_usage_error(capsys, train_args(out, 2), "1.0 MiB free", f"{need / 2**20:.1f} MiB")
    assert not out.exists()


def test_disk_filling_during_the_run_stops_it_with_one_line_and_exit_3(capsys, mount):
    # room for two checkpoints of the tiny model (~1.8 MB each), not three
    out = mount("size=4m") / "run"
    capsys.readouterr()
    args = train_args(out, 6, "--ckpt-every", "1", "--keep-checkpoints", "9", "--eval-every", "0")
    assert main(args) == 3
    lines = stderr_lines(capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith("interlace: error: the run stopped at step 3: No space left")
    assert "--resume" in lines[0]
    # nothing half-written in sight: no temporary, the last checkpoint complete, whole lines
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert not [n for n in names if n.endswith((".tmp", ".partial"))], names
    assert checkpoint_dir(out).name == checkpoint_name(2)
    verify_checkpoint(checkpoint_dir(out), {})
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]


def test_a_run_stopped_before_its_first_checkpoint_offers_overwrite_not_resume(
    capsys, tmp_path, monkeypatch
):
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path))

    monkeypatch.setattr("interlace.train.trainer.save_checkpoint", disk_full)
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(train_args(out, 4, "--ckpt-every", "2", "--eval-every", "0")) == 3
    (stopped,) = stderr_lines(capsys)
    assert "no checkpoint was finished yet" in stopped and "--overwrite" in stopped, stopped
    assert "--resume" not in stopped
    rerun = expect_usage_error(capsys, train_args(out, 4), "stopped before its first checkpoint")
    assert "--resume" not in rerun and "--overwrite" in rerun
    resumed = expect_usage_error(capsys, [*train_args(out, 4), "--resume"], "nothing to resume")
    assert "--overwrite" in resumed


def test_trainer_fit_refuses_an_earlier_run_as_the_cli_does(tmp_path):
    out = tmp_path / "run"
    config = TrainConfig(model="tiny", steps=1, eval_every=0, out=str(out), measure_memory=False)
    setup = prepare_run(config.validate(), Plan(), 1)
    Trainer(setup).fit()
    first = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"already holds a run .*--resume.*--overwrite"):
        Trainer(setup).fit()
    assert (out / "metrics.jsonl").read_text() == first  # nothing touched
    Trainer(setup).fit(earlier_run="overwrite")
    assert len(read_metrics(out / "metrics.jsonl")) == 1


def test_temporaries_of_an_interrupted_run_are_removed_at_start(tmp_path):
    out = tmp_path / "run"
    assert main(train_args(out, 2)) == 0
    stale = [out / "checkpoints" / "step-00000009.tmp", out / ".report.json.partial"]
    stale[0].mkdir()
    (stale[0] / "__0_0.distcp").write_bytes(b"half")
    stale[1].write_text("{")
    assert main(train_args(out, 3, "--resume")) == 0
    assert not any(path.exists() for path in stale)


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_resume_falls_back_from_a_bad_newest_checkpoint_with_a_warning(capsys, tmp_path, damage):
    out = tmp_path / "run"
    assert main(train_args(out, 3, "--ckpt-every", "1", "--keep-checkpoints", "2")) == 0
    newest = checkpoint_dir(out)
    assert newest.name == checkpoint_name(3)
    if damage == "missing":
        os.rename(newest, tmp_path / "moved")
    else:
        corrupt_a_shard(out)
    capsys.readouterr()
    assert main(train_args(out, 4, "--resume")) == 0
    warnings = [line for line in stderr_lines(capsys) if "warning" in line]
    assert len(warnings) == 1, warnings
    assert f"'{newest}'" in warnings[0]
    fallback = out / "checkpoints" / checkpoint_name(2)
    assert f"resuming from the newest valid checkpoint, '{fallback}'" in warnings[0]
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert checkpoint_dir(out).name == checkpoint_name(4)


def test_resume_without_any_valid_checkpoint_is_refused(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(train_args(out, 2)) == 0
    corrupt_a_shard(out)
    before = run_files(out)
    expect_usage_error(capsys, train_args(out, 3, "--resume"), "corrupt")
    assert run_files(out) == before


def test_metrics_rewrite_on_resume_is_all_or_nothing(tmp_path, monkeypatch):
    rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = (tmp_path / "metrics.jsonl").read_bytes()

    def write_half(self, data):  # the disk fills half-way through the rewrite
        with open(self, "wb") as handle:
            handle.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", write_half)
    with pytest.raises(OSError, match="No space left"):
        MetricsLog(tmp_path, resume_step=2)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_failed_append_leaves_no_part_of_a_line(tmp_path, monkeypatch):
    file = tmp_path / "metrics.jsonl"
    append_line(file, json.dumps({"step": 1}))
    real_write = os.write

    def write_some(fd, data):  # writes a few bytes, then the disk is full
        if len(data) > 4:
            return real_write(fd, data[:4])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write_some)
    with pytest.raises(OSError):
        append_line(file, json.dumps({"step": 2, "loss": 3.5}))
    monkeypatch.undo()
    assert file.read_text() == '{"step": 1}\n'


def test_resume_auto_continues_the_newest_checkpoint_or_starts_afresh(tmp_path):
    out = tmp_path / "run"
    assert main(train_args(out, 2, "--resume", "auto")) == 0  # nothing there: a fresh start
    first = read_metrics(out / "metrics.jsonl")
    assert main(train_args(out, 3, "--resume", "auto")) == 0  # continues from step 2
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[:2] == first and [r["step"] for r in rows] == [1, 2, 3]
    # an attempt that saved no checkpoint is replaced, not refused as an earlier run
    os.rename(out / "checkpoints", tmp_path / "moved")
    assert main(train_args(out, 2, "--resume", "auto")) == 0
    again = read_metrics(out / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in again] == [(r["step"], r["loss"]) for r in first]


def test_checkpoint_files_and_the_latest_pointer_are_flushed_to_disk(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "run"
    assert main(train_args(out, 1)) == 0
    ckpt = out / "checkpoints" / checkpoint_name(1)
    tmp = out / "checkpoints" / f"{checkpoint_name(1)}.tmp"  # the files' names while written
    written_as = {p.name.removesuffix(".tmp").removesuffix(".partial").lstrip(".") for p in synced}
    for name in ("__0_0.distcp", "metadata", "rng-rank0.pt", "meta.json", "manifest.json"):
        assert name in written_as, name  # DCP writes .metadata as .metadata.tmp, renamed
    assert tmp in synced  # the folder, before its rename
    assert out / "checkpoints" in synced  # after the rename, and after latest's
    assert out / "checkpoints" / ".latest.partial" in synced
    assert (ckpt / "manifest.json").exists()


def test_a_full_disk_is_named_after_rank_0_removed_the_unfinished_checkpoint(tmp_path, monkeypatch):
    """Rank 0 removes the unfinished folder at once; a slower rank, asking the disk why its write
    failed, asks through the checkpoints folder instead of failing on the missing one."""
    real = shutil.disk_usage

    def full(path):
        return real(path)._replace(free=0)  # raises, as the real one, for a missing path

    monkeypatch.setattr(shutil, "disk_usage", full)
    gone = tmp_path / "checkpoints" / f"{checkpoint_name(3)}.tmp"
    gone.parent.mkdir()
    error = _os_error_of(RuntimeError("torch's writer failed"), gone)
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC


@pytest.mark.slow  # a launch of two ranks: seconds of process start-up
def test_a_full_disk_under_two_ranks_exits_3_with_the_ranks_line(mount):
    out = mount("size=4m") / "run"
    args = train_args(out, 6, "--ckpt-every", "1", "--keep-checkpoints", "9", "--nproc", "2")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "interlace"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=240,
    )
    assert proc.returncode == 3, proc.stderr
    ours = [line for line in proc.stderr.splitlines() if line.startswith("interlace:")]
    assert ours and all("the run stopped at step 3: No space left" in line for line in ours)
    assert checkpoint_dir(out).name == checkpoint_name(2)
    assert not [p for p in out.rglob("*") if p.name.endswith((".tmp", ".partial"))]
