"""Run a function on N gloo ranks, fast, for tests.

torch's own launchers (spawn, torchrun) start a fresh interpreter per rank: 3–9 s each. Forking
from a parent that has already imported torch and set `torch.set_num_threads(1)` (before any
compute, so no thread pool is forked mid-use) takes ~0.1 s. torch offers no fork-based runner with
a per-test timeout and the failing rank's traceback, hence this module.

Ranks rendezvous through a FileStore in a temporary directory (no port races). Each rank's return
value travels back through `torch.save`, so tensors and dicts of tensors are fine.

Ranks compute on the CPU whatever the machine has (INTERLACE_DEVICE=cpu, see
`mesh.default_device`): gloo cannot carry CUDA tensors, and a forked child cannot use CUDA once
its parent has initialised it. Nothing here touches CUDA, in the parent or in a rank.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from interlace.mesh import DEVICE_ENV


class RankFailed(RuntimeError):
    """A rank raised, died or hung; the message holds its traceback."""


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any
) -> list[Any]:
    """Call `fn(*args, **kwargs)` on `world_size` forked gloo ranks; return each rank's result.

    Inside `fn`, torch.distributed is initialised (gloo, collective timeout = `timeout`),
    `dist.get_rank()` tells the rank and `default_device()` is the CPU. The call fails with
    RankFailed as soon as any rank raises (its traceback in the message), and after `timeout`
    seconds if some rank hangs.
    """
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="interlace-ranks-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, store_path, tmp, timeout, fn, args, kwargs),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            _wait_all(procs, tmp, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        return [
            torch.load(Path(tmp) / f"result{r}.pt", weights_only=False) for r in range(world_size)
        ]


def _rank_main(
    rank: int,
    world_size: int,
    store_path: str,
    tmp: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ[DEVICE_ENV] = "cpu"
    # the fork left the parent's thread pool behind: make this rank's own now, on its main
    # thread, before another thread (autograd's, a background reduce-scatter's) races to
    torch.set_num_threads(torch.get_num_threads())
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(*args, **kwargs)
        dist.destroy_process_group()
        torch.save(result, Path(tmp) / f"result{rank}.pt")
    except BaseException:
        # Written before the connections close, so this rank's error is stamped first.
        (Path(tmp) / f"error{rank}.txt").write_text(f"{time.time()}\n{traceback.format_exc()}")
        os._exit(1)
    os._exit(0)


def _wait_all(procs: list[mp.Process], tmp: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        if any(not p.is_alive() and p.exitcode != 0 for p in procs):
            time.sleep(0.5)  # let secondary failures land, then blame the first one
            raise RankFailed(_failure_message(procs, tmp))
        if time.monotonic() > deadline:
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            raise RankFailed(f"ranks {hung} still running after {timeout:.0f} s (hang?)")
        time.sleep(0.01)
    if any(p.exitcode != 0 for p in procs):
        raise RankFailed(_failure_message(procs, tmp))


def run_fresh(
    fn: Callable[..., Any],
    *args: Any,
    env: dict[str, str | None],
    timeout: float = 600.0,
    **kwargs: Any,
) -> Any:
    """Call `fn(*args, **kwargs)` in a fresh (spawned) interpreter whose environment is this
    one's updated by `env` (None: unset); return its result, or raise RankFailed with its
    traceback.

    For what must not happen in this process: a test process that has run a backward pass with
    a GPU visible cannot fork ranks that run one (autograd's device threads), so it keeps CUDA
    hidden and runs its CUDA tests this way.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="interlace-fresh-") as tmp:
        proc = ctx.Process(target=_fresh_main, args=(tmp, fn, args, kwargs))
        saved = {key: os.environ.get(key) for key in env}
        _set_environ(env)  # the child starts with this environment
        try:
            proc.start()
        finally:
            _set_environ(saved)
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise RankFailed(f"still running after {timeout:.0f} s (hang?)")
        if proc.exitcode != 0:
            raise RankFailed(_failure_message([proc], tmp))
        return torch.load(Path(tmp) / "result0.pt", weights_only=False)


def _set_environ(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _fresh_main(tmp: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    try:
        result = fn(*args, **kwargs)
        torch.save(result, Path(tmp) / "result0.pt")
    except BaseException:
        (Path(tmp) / "error0.txt").write_text(f"{time.time()}\n{traceback.format_exc()}")
        os._exit(1)


def _failure_message(procs: list[mp.Process], tmp: str) -> str:
    """The traceback of the rank that failed first; other failures are usually its echo."""
    failures = []
    for rank, p in enumerate(procs):
        error = Path(tmp) / f"error{rank}.txt"
        if error.exists():
            stamp, detail = error.read_text().split("\n", 1)
            failures.append((float(stamp), rank, detail))
        elif not p.is_alive() and p.exitcode != 0:
            failures.append((float("inf"), rank, f"exit code {p.exitcode}, no traceback\n"))
    failures.sort()
    _, rank, detail = failures[0]
    others = sorted(r for _, r, _ in failures[1:])
    also = f"(ranks {others} failed after it)\n" if others else ""
    return f"rank {rank} failed first {also}\n{detail}"
