"""Start N local ranks of `python -m interlace.train` with torch's elastic launcher (the engine
behind torchrun), and initialise a rank's process group from the environment it provides."""

from __future__ import annotations

import datetime
import logging
import os
import sys
import uuid

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from interlace.mesh import backend_for, default_device


class LaunchFailed(RuntimeError):
    """A rank of a launched run failed; the message names the rank and its error, `exit_code`
    is the failing rank's exit code (1 if it died without one, e.g. by a signal)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def launch_local(nproc: int, module_args: list[str]) -> None:
    """Run `python -m <module_args>` on `nproc` local ranks (single node, no restarts) and wait.

    Sets OMP_NUM_THREADS to share the cores between ranks unless the user set it. Raises
    LaunchFailed with the first failing rank's error.
    """
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"interlace-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
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
