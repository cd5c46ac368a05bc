"""What a launched run says when it stops early: Ctrl-C under `--nproc N`, a rank killed, a rank
that lost its peer. The reason is one line, last; the elastic agent's and the peers' teardown
noise is not shown. The runs start real ranks (several seconds each), so they are marked slow."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from interlace import launch


def _failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file="")
    failure.timestamp = timestamp
    return failure


def test_the_root_failure_is_not_a_consequence_of_another():
    failures = {
        0: _failure(0, launch.PEER_LOST, 10),  # lost its peer first, by the clock
        1: _failure(1, -signal.SIGKILL, 11),  # the cause
        2: _failure(2, -signal.SIGTERM, 11),  # stopped by the agent
    }
    assert launch._root_failure(ChildFailedError("train", failures))[0] == 1
    consequences = {0: _failure(0, launch.PEER_LOST, 12), 1: _failure(1, launch.PEER_LOST, 11)}
    assert launch._root_failure(ChildFailedError("train", consequences))[0] == 1


def test_a_broken_connection_is_told_apart_from_other_errors():
    gloo = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:5: Connection reset by peer")
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise RuntimeError("Got the following error when running the callback") from inner
    except RuntimeError as wrapped:
        assert launch._lost_a_peer(wrapped)
    assert launch._lost_a_peer(dist.DistNetworkError("the store went away"))
    assert not launch._lost_a_peer(RuntimeError("shape mismatch"))
    with pytest.raises(SystemExit) as stopped, launch.quiet_when_a_peer_is_lost():
        raise gloo
    assert stopped.value.code == launch.PEER_LOST
    with pytest.raises(ValueError), launch.quiet_when_a_peer_is_lost():
        raise ValueError("a real error stays itself")


def _start(out: Path) -> tuple[subprocess.Popen, Path]:
    """A 2-rank run of the tiny model in its own session, stderr into a file."""
    log = out.parent / "stderr.txt"
    command = [sys.executable, "-m", "interlace.cli", "train", "--nproc", "2", "--model", "tiny"]
    command += ["--steps", "2000", "--eval-every", "0", "--out", str(out)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            command, stderr=stderr, stdout=subprocess.DEVNULL, env=env, start_new_session=True
        )
    return proc, log


def _wait_for_training(log: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while "step/s" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "no training step within 180 s"
        time.sleep(0.5)


def _message_lines(log: Path) -> list[str]:
    """stderr without the progress bar's redraws."""
    lines = log.read_text().replace("\r", "\n").splitlines()
    return [line for line in lines if line.strip() and not line.startswith("train:")]


@pytest.mark.slow
def test_ctrl_c_under_nproc_2_prints_one_line_and_exits_130(tmp_path):
    proc, log = _start(tmp_path / "run")
    _wait_for_training(log, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole group
    assert proc.wait(timeout=120) == 130
    assert _message_lines(log) == ["interlace: interrupted"]


@pytest.mark.slow
def test_a_killed_rank_is_named_alone_without_its_peers_tracebacks(tmp_path):
    proc, log = _start(tmp_path / "run")
    _wait_for_training(log, proc)
    ranks = subprocess.run(
        ["pgrep", "-f", "-P", str(proc.pid), "interlace.train"], capture_output=True, text=True
    ).stdout.split()
    assert len(ranks) == 2, ranks
    os.kill(int(ranks[-1]), signal.SIGKILL)
    assert proc.wait(timeout=120) == 1
    lines = _message_lines(log)
    assert len(lines) == 1 and lines[0].endswith("was killed by SIGKILL"), lines


_STOPPED_MID_BAR = """
import os, signal
from interlace.train.progress import progress_bar
with progress_bar(10, 0, shown=True) as bar:
    bar.update(1)
    bar.refresh()
    os.kill(os.getpid(), signal.SIGTERM)
"""


def test_a_rank_stopped_by_sigterm_ends_its_progress_line_and_still_reads_as_sigterm():
    stopped = subprocess.run(
        [sys.executable, "-c", _STOPPED_MID_BAR], capture_output=True, text=True, timeout=60
    )
    assert stopped.returncode == -signal.SIGTERM
    assert "1/10" in stopped.stderr and stopped.stderr.endswith("\n"), repr(stopped.stderr)
