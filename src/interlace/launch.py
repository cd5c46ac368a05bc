"""Start N local ranks of `python -m interlace.train` with torch's elastic launcher (the engine
behind torchrun), restarting them all up to `max_restarts` times when one fails, and initialise a
rank's process group from the environment it provides. A rank dies with the process that
started it (`die_with_launcher`), so a killed launcher leaves no rank training on its own."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import signal
import sys
import uuid
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from interlace.mesh import backend_for, default_device

_PR_SET_PDEATHSIG = 1

PEER_LOST = 75
"""A launched rank's exit code when it stopped because another rank's connection went away."""

_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What gloo's errors say when the rank at the other end of a pair has gone."""

_LOCAL_LAUNCH = "INTERLACE_LOCAL_LAUNCH"
"""Set by `launch_local` for the ranks it starts (`rank_of_local_launch`)."""


class LaunchFailed(RuntimeError):
    """A rank of a launched run failed; the message names the rank and its error, `exit_code`
    is the failing rank's exit code (1 if it died without one, e.g. by a signal)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def launch_local(nproc: int, module_args: list[str], max_restarts: int = 0) -> None:
    """Run `python -m <module_args>` on `nproc` local ranks (single node) and wait; when a rank
    fails, stop them all and start them again, up to `max_restarts` times (each start sees
    `restart_count()`).

    Sets OMP_NUM_THREADS to share the cores between ranks unless the user set it. Raises
    LaunchFailed with the first failing rank's error once no restart is left, KeyboardInterrupt
    when the launcher gets SIGINT (Ctrl-C), and LaunchFailed with exit code 128 + N for
    another signal N (the elastic agent stops every rank first, as it does for SIGINT).
    """
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if max_restarts:
        # The ranks' process group otherwise lives in the launcher's one shared store, whose
        # keys outlive a restart: restarted ranks read the dead ranks' gloo addresses there
        # and fail to connect. torch's opt-out gives each start a store of its own.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ[_LOCAL_LAUNCH] = "1"
    # The agent's own lines (a signal received, a rank failed) repeat what the one line the
    # command prints says; the failure itself reaches ChildFailedError below. torch sets a
    # level on each of its modules' loggers, so each is quieted by name.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"interlace-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-u", "-m", *module_args)
    except SignalException as exc:
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        name = signal.Signals(exc.sigval).name
        raise LaunchFailed(f"stopped by {name}", 128 + int(exc.sigval)) from None
    except ChildFailedError as exc:
        rank, failure = _root_failure(exc)
        if failure.exitcode < 0:
            how = f"was killed by {signal.Signals(-failure.exitcode).name}"
        elif failure.exitcode == PEER_LOST:
            how = "and every other rank lost their connections to each other"
        else:
            how = f"failed (exit code {failure.exitcode}); its error is above"
        raise LaunchFailed(f"rank {rank} {how}", max(failure.exitcode, 1)) from None


def _root_failure(failed: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The rank whose failure stopped the job, and how: the earliest failure (by the agent's
    timestamps, whole seconds) that is neither a rank that lost a peer (`PEER_LOST`) nor one the
    agent stopped with SIGTERM after the first failure; the earliest of all where every failure
    is one of those."""

    def consequence(failure: ProcessFailure) -> bool:
        return failure.exitcode in (PEER_LOST, -signal.SIGTERM)

    ranked = sorted(failed.failures.items(), key=lambda f: (consequence(f[1]), f[1].timestamp))
    return ranked[0]


@contextlib.contextmanager
def quiet_when_a_peer_is_lost() -> Iterator[None]:
    """Around a launched rank's work: an error that only says another rank's connection went
    away (that rank failed, and its own error is the reason) exits with `PEER_LOST` and, under
    `launch_local`, no word (else one line), instead of a traceback of the broken collective."""
    try:
        yield
    except Exception as error:
        if not _lost_a_peer(error):
            raise
        if not rank_of_local_launch():
            print(f"interlace: rank {os.environ.get('RANK', '?')} lost a peer", file=sys.stderr)
        raise SystemExit(PEER_LOST) from None


def _lost_a_peer(error: BaseException | None) -> bool:
    """Whether `error` (or an error it was raised from) is a broken connection to another rank."""
    while error is not None:
        if isinstance(error, dist.DistNetworkError) or any(
            sign in str(error) for sign in _PEER_GONE
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


def restart_count() -> int:
    """How many times the elastic launcher (or torchrun) has restarted this rank's job: 0 on the
    first start and outside a launcher."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def die_with_launcher() -> None:
    """In a rank started by torch's elastic agent (`--nproc`, torchrun), have the kernel kill
    this process (SIGKILL) when its parent, the agent, dies (Linux's PR_SET_PDEATHSIG, through
    ctypes: torch's agent does not ask for it); exit at once if the parent is already gone.
    Does nothing elsewhere: a rank a shell or scheduler started may outlive its parent."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def rank_of_local_launch() -> bool:
    """True inside a rank `launch_local` started (`interlace train --nproc N`): its launcher
    reports an interrupt once for every rank, so the rank stops without a word."""
    return in_launched_rank() and _LOCAL_LAUNCH in os.environ


def in_launched_rank() -> bool:
    """True inside a rank started by torchrun / the elastic launcher."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


def init_from_env(timeout_s: float = 600.0) -> torch.device:
    """Initialise the default process group from torchrun's environment; returns this rank's
    device (`default_device()`: its LOCAL_RANK-th GPU, with NCCL, where CUDA is available)."""
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=timeout_s))
    return device
