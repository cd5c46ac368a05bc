"""`interlace bench restart`: faults injected into real runs and what they cost.

An uninterrupted `interlace train --nproc 2` run of the tiny model is the reference. Then, for
each step in `kill_at`, the same run under `--max-restarts 1` has one rank SIGKILLed as soon as
metrics.jsonl reaches that step; the launcher restarts both ranks, which continue from the
newest checkpoint. Per fault: whether the run finished by itself (a run lost otherwise), the
step it continued from and so the steps computed twice (at most `ckpt_every`), whether every
step's loss equals the reference's exactly, and the seconds from the kill until the run was
back at the killed step (the time to recover: detection, process start-up, loading and the
recomputed steps). The launch helpers here also serve `tests/test_restart.py`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from interlace.bench.base import Benchmark
from interlace.errors import ConfigError


def launch(out: Path, steps: int, *extra: str) -> subprocess.Popen:
    """`interlace train` of the tiny model on 2 ranks into `out`, in the background (stdout and
    stderr piped)."""
    argv = [str(Path(sys.executable).parent / "interlace"), "train", "--model", "tiny"]
    argv += ["--global-batch", "4", "--eval-every", "0", "--no-progress", "--nproc", "2"]
    argv += ["--steps", str(steps), "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def logged_step(out: Path) -> int:
    """The last step `out`/metrics.jsonl holds whole (0 before the first)."""
    file = out / "metrics.jsonl"
    lines = file.read_text().splitlines() if file.exists() else []
    return json.loads(lines[-1])["step"] if lines and lines[-1].endswith("}") else 0


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout_s: float = 120) -> int:
    """Poll until `out`'s metrics reach `step`; returns the step seen. AssertionError if the run
    ends or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while (seen := logged_step(out)) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the run did not reach step {step}: {proc.communicate()}")
        time.sleep(0.002)
    return seen


def rank_pids(launcher: int) -> list[int]:
    """The process ids of the rank processes the launcher `launcher` started (Linux /proc)."""
    children = []
    for task in Path(f"/proc/{launcher}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children]
    return [pid for pid, cmd in zip(children, cmdlines, strict=True) if b"interlace.train" in cmd]


def running(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def losses(out: Path) -> list[tuple[int, float]]:
    """(step, loss) of every row of `out`/metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows]


def _fault(root: Path, kill_at: int, options: dict[str, Any], reference: list) -> dict[str, Any]:
    """One run with a rank SIGKILLed at step `kill_at`, and what it cost."""
    out = root / f"kill-{kill_at}"
    every = str(options["ckpt_every"])
    proc = launch(out, options["steps"], "--ckpt-every", every, "--max-restarts", "1")
    killed = wait_for_step(proc, out, kill_at)
    metrics = (out / "metrics.jsonl").stat().st_ino
    os.kill(rank_pids(proc.pid)[-1], signal.SIGKILL)
    start = time.monotonic()
    while (out / "metrics.jsonl").stat().st_ino == metrics:  # the restart rewrites it
        if proc.poll() is not None:
            break
        time.sleep(0.002)
    else:
        wait_for_step(proc, out, killed + 1, timeout_s=240)
    recover_s = time.monotonic() - start
    _, stderr = proc.communicate(timeout=240)
    found = re.search(rb"restart 1: continuing from '.*step-(\d+)'", stderr)
    resumed = int(found.group(1)) if found else 0
    return {
        "kill_at": killed,
        "finished": proc.returncode == 0,
        "resumed_from": resumed,
        "recomputed_steps": killed - resumed,
        "recover_s": recover_s,
        "losses_equal": proc.returncode == 0 and losses(out) == reference,
    }


def run_local(options: dict[str, Any]) -> dict[str, Any]:
    """The reference run, then one faulted run per step of `kill_at`."""
    kill_steps = [int(step) for step in str(options["kill_at"]).split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        reference = launch(root / "reference", options["steps"], "--ckpt-every", "0")
        _, stderr = reference.communicate(timeout=240)
        if reference.returncode:
            raise RuntimeError(f"the reference run failed: {stderr.decode()[-2000:]}")
        expected = losses(root / "reference")
        faults = [_fault(root, step, options, expected) for step in kill_steps]
    return {"steps": options["steps"], "ckpt_every": options["ckpt_every"], "faults": faults}


def check(options: dict[str, Any]) -> None:
    """Kill steps inside the run, a positive checkpoint interval."""
    if options["ckpt_every"] < 1:
        raise ConfigError(f"ckpt_every={options['ckpt_every']} must be >= 1")
    for step in str(options["kill_at"]).split(","):
        if not (step.isdigit() and 1 <= int(step) < options["steps"]):
            raise ConfigError(
                f"kill_at step '{step}' must be an integer in [1, steps={options['steps']})"
            )


def table(doc: dict[str, Any]) -> str:
    """One row per fault."""
    result = doc["result"]
    lines = [f"{result['steps']} steps, a checkpoint every {result['ckpt_every']}"]
    lines.append(
        f"{'killed at':>9s} {'finished':>8s} {'resumed':>7s} {'redone':>6s} "
        f"{'recover s':>9s} {'losses equal':>12s}"
    )
    for f in result["faults"]:
        lines.append(
            f"{f['kill_at']:9d} {f['finished']!s:>8s} {f['resumed_from']:7d} "
            f"{f['recomputed_steps']:6d} {f['recover_s']:9.1f} {f['losses_equal']!s:>12s}"
        )
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Seconds to recover and steps recomputed, per fault."""
    from interlace.plotting import new_figure, save_figure

    faults = doc["result"]["faults"]
    labels = [f"step {f['kill_at']}" for f in faults]
    fig, ax = new_figure(figsize=(7, 4))
    ax.bar(labels, [f["recover_s"] for f in faults], color="C0", label="seconds to recover")
    ax.set_ylabel("seconds from the kill to new progress")
    twin = ax.twinx()
    twin.plot(labels, [f["recomputed_steps"] for f in faults], "o", color="C3")
    twin.set_ylabel("steps recomputed", color="C3")
    twin.set_ylim(0, doc["result"]["ckpt_every"] + 1)
    ax.set_title("one rank SIGKILLed, --max-restarts 1", fontsize=9)
    save_figure(fig, path, dpi=110)


def headline(doc: dict[str, Any]) -> str:
    """Faults, runs lost, the most steps recomputed, the median time to recover."""
    faults = doc["result"]["faults"]
    lost = sum(not f["finished"] for f in faults)
    exact = sum(f["losses_equal"] for f in faults)
    times = sorted(f["recover_s"] for f in faults)
    return (
        f"{len(faults)} faults injected, {lost} runs lost, {exact} of {len(faults)} loss curves "
        f"equal to the uninterrupted run's, at most {max(f['recomputed_steps'] for f in faults)} "
        f"steps recomputed (checkpoint every {doc['result']['ckpt_every']}), median "
        f"{times[len(times) // 2]:.1f} s to recover"
    )


def key_numbers(result: dict[str, Any]) -> dict[str, float]:
    """Seconds to recover from each fault."""
    return {f"recover s at step {f['kill_at']}": f["recover_s"] for f in result["faults"]}


BENCHMARK = Benchmark(
    name="restart",
    summary="ranks SIGKILLed mid-run under --max-restarts: runs lost, steps redone, recovery",
    describe=(
        "An uninterrupted `interlace train --nproc 2` run of the tiny model is the reference; "
        "then, for each kill step, the same run under `--max-restarts 1` with `--ckpt-every` "
        "has one rank SIGKILLed when metrics.jsonl reaches that step. Recorded per fault: "
        "whether the run finished by itself, the checkpoint it continued from, the steps "
        "computed twice (at most ckpt_every), whether every loss equals the reference's "
        "exactly, and the seconds from the kill to the first step beyond it (failure "
        "detection, process start-up of both ranks, loading, recomputation)."
    ),
    table=table,
    plot=plot,
    run_local=run_local,
    check=check,
    headline=headline,
    key_numbers=key_numbers,
    options={"steps": 40, "ckpt_every": 5, "kill_at": "8,12,17,23,31"},
    option_help={
        "steps": "training steps of each run",
        "ckpt_every": "steps between checkpoints",
        "kill_at": "steps at which a rank is SIGKILLed, comma-separated, one run each",
    },
)
