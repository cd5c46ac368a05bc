"""Automatic restart: a rank SIGKILLed mid-run under `--max-restarts 1` is restarted with its
peers, which continue from the newest checkpoint, and the run ends with the same losses as an
uninterrupted one, bit for bit; a killed launcher takes its ranks with it. Each launch costs
several seconds of process start-up, so these tests are marked slow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS = 40


def _launch(out: Path, steps: int, *extra: str) -> subprocess.Popen:
    """`interlace train` of the tiny model on 2 ranks in the background."""
    argv = [str(Path(sys.executable).parent / "interlace"), "train", "--model", "tiny"]
    argv += ["--global-batch", "4", "--eval-every", "0", "--no-progress", "--nproc", "2"]
    argv += ["--steps", str(steps), "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _logged_steps(out: Path) -> int:
    """The last step metrics.jsonl holds (0 before the first)."""
    file = out / "metrics.jsonl"
    lines = file.read_text().splitlines() if file.exists() else []
    return json.loads(lines[-1])["step"] if lines and lines[-1].endswith("}") else 0


def _ranks(launcher: int) -> list[int]:
    """The process ids of the launcher's rank processes."""
    children = []
    for task in Path(f"/proc/{launcher}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    return [
        pid for pid in children if b"interlace.train" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def _running(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for_step(proc: subprocess.Popen, out: Path, step: int) -> int:
    deadline = time.monotonic() + 120
    while (logged := _logged_steps(out)) < step:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)
    return logged


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows]


def test_a_killed_rank_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path):
    reference = _launch(tmp_path / "reference", STEPS, "--ckpt-every", "5")
    assert reference.wait(timeout=240) == 0, reference.communicate()
    out = tmp_path / "faulted"
    proc = _launch(out, STEPS, "--ckpt-every", "5", "--max-restarts", "1")
    killed_at = _wait_for_step(proc, out, 12)
    os.kill(_ranks(proc.pid)[-1], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr.decode()
    assert b"failed (exitcode: -9)" in stderr  # the launcher saw the kill and restarted
    assert killed_at < STEPS
    assert stdout.decode().startswith(f"done: {STEPS} steps")
    assert _losses(out) == _losses(tmp_path / "reference")  # exactly, every step
    assert (out / "checkpoints" / "latest").read_text() == "step-00000040"


def test_ranks_die_with_their_launcher(tmp_path):
    out = tmp_path / "run"
    proc = _launch(out, 100_000)
    _wait_for_step(proc, out, 1)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 2
    proc.kill()  # SIGKILL: the launcher cannot stop its ranks itself
    proc.wait()
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in ranks if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in alive:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not alive, "ranks kept running after their launcher was killed"
