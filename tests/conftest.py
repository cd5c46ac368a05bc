"""Test set-up: one intra-op thread before any compute, so forked ranks start fast and safe; the
CPU as every test's device, GPU or not (INTERLACE_DEVICE=cpu, inherited by the ranks tests
launch). CUDA is hidden from the test process (CUDA_VISIBLE_DEVICES=""): once a process has run
a backward pass with a GPU visible, autograd's device threads break the backward of every rank
it forks. Tests marked `cuda` run each in a fresh interpreter that sees the machine's GPUs
(`interlace.testing.run_fresh`), and are skipped, with the reason, where there is none."""

import glob
import os
import subprocess
import sys

# The machine's own CUDA_VISIBLE_DEVICES, kept in the environment the first time this file runs:
# pytest-xdist's workers inherit the hidden value below, and read the kept one instead.
_KEPT_GPUS, _ALL_GPUS = "INTERLACE_TEST_MACHINE_GPUS", "<unset>"
os.environ.setdefault(_KEPT_GPUS, os.environ.get("CUDA_VISIBLE_DEVICES", _ALL_GPUS))
MACHINE_GPUS = None if os.environ[_KEPT_GPUS] == _ALL_GPUS else os.environ[_KEPT_GPUS]
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

from interlace.mesh import DEVICE_ENV  # noqa: E402
from interlace.testing import run_fresh  # noqa: E402

torch.set_num_threads(1)
os.environ[DEVICE_ENV] = "cpu"

# DDP imports torch._dynamo lazily; importing it once here spares every forked rank the cost.
import torch._dynamo  # noqa: E402

CUDA_ENV = {"CUDA_VISIBLE_DEVICES": MACHINE_GPUS, DEVICE_ENV: None}


def _machine_has_cuda() -> bool:
    """torch.cuda.is_available() as a process with the machine's GPUs visible sees it (asked
    in a subprocess, so this one never initialises CUDA)."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    env = {k: v for k, v in os.environ.items() if k not in CUDA_ENV}
    env |= {k: v for k, v in CUDA_ENV.items() if v is not None}
    probe = [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"]
    return subprocess.run(probe, env=env, capture_output=True, text=True).stdout.strip() == "True"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `cuda` tests where the machine has no CUDA device."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items or _machine_has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a `cuda` test in a fresh interpreter that sees the GPUs."""
    if pyfuncitem.get_closest_marker("cuda") is None:
        return None
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    run_fresh(pyfuncitem.obj, env=CUDA_ENV, timeout=240, **kwargs)
    return True
