"""Start N local ranks of `python -m interlace.train` with torch's elastic launcher (the engine
behind torchrun), restarting them all up to `max_restarts` times when one fails, and initialise a
rank's process group from the environment it provides. A rank dies with the process that
started it (`die_with_launcher`), so a killed launcher leaves no rank training on its own."""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import sys
import uuid

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from interlace.mesh import backend_for, default_device

_PR_SET_PDEATHSIG = 1


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
    LaunchFailed with the first failing rank's error once no restart is left.
    """
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if max_restarts:
        # The ranks' process group otherwise lives in the launcher's one shared store, whose
        # keys outlive a restart: restarted ranks read the dead ranks' gloo addresses there
        # and fail to connect. torch's opt-out gives each start a store of its own.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
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
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise LaunchFailed(
            f"rank {rank} failed (exit code {failure.exitcode}); its output is above",
            failure.exitcode if failure.exitcode > 0 else 1,
        ) from None


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
