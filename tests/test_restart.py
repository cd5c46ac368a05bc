"""Automatic restart: a rank SIGKILLed mid-run under `--max-restarts 1` is restarted with its
peers, which continue from the newest checkpoint, and the run ends with the same losses as an
uninterrupted one, bit for bit; a killed launcher takes its ranks with it. Each launch costs
several seconds of process start-up, so these tests are marked slow."""

from __future__ import annotations

import os
import signal
import time

import pytest

from interlace.bench.restart import launch, losses, rank_pids, running, wait_for_step

pytestmark = pytest.mark.slow

STEPS = 40


def test_a_killed_rank_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path):
    reference = launch(tmp_path / "reference", STEPS, "--ckpt-every", "5")
    assert reference.wait(timeout=240) == 0, reference.communicate()
    out = tmp_path / "faulted"
    proc = launch(out, STEPS, "--ckpt-every", "5", "--max-restarts", "1")
    killed_at = wait_for_step(proc, out, 12)
    os.kill(rank_pids(proc.pid)[-1], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr.decode()
    resumed = int(stderr.decode().split("restart 1: continuing from '")[1].split("step-")[1][:8])
    assert killed_at - 5 <= resumed <= killed_at  # at most ckpt_every steps computed twice
    assert stdout.decode().startswith(f"done: {STEPS} steps")
    assert losses(out) == losses(tmp_path / "reference")  # exactly, every step
    assert (out / "checkpoints" / "latest").read_text() == "step-00000040"


def test_ranks_die_with_their_launcher(tmp_path):
    out = tmp_path / "run"
    proc = launch(out, 100_000)
    wait_for_step(proc, out, 1)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2
    proc.kill()  # SIGKILL: the launcher cannot stop its ranks itself
    proc.wait()
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in ranks if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in alive:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not alive, "ranks kept running after their launcher was killed"
