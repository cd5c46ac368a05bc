"""The fork-based rank runner: results come back, failures and hangs fail fast with a traceback.
The test set-up hands `cuda` tests the machine's GPUs in pytest-xdist's workers too."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from interlace.testing import RankFailed, run_ranks


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t}


def test_results_come_back_in_rank_order():
    results = run_ranks(3, _sum_of_ranks)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"].item() == 3.0 for r in results)


def _rank_one_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def test_failing_rank_traceback_is_shown_quickly():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)rank 1 failed first.*ValueError: boom on purpose"):
        run_ranks(2, _rank_one_raises, timeout=30)
    assert time.monotonic() - start < 20


def _rank_zero_hangs():
    if dist.get_rank() == 0:
        time.sleep(60)


def test_hang_fails_after_timeout():
    # 5 s: the ranks' start-up and rendezvous (bounded by the same timeout) must fit in it on a
    # loaded machine (two test workers on two cores), or a rank fails there instead
    start = time.monotonic()
    with pytest.raises(RankFailed, match="still running"):
        run_ranks(2, _rank_zero_hangs, timeout=5)
    assert time.monotonic() - start < 20


_READ_MACHINE_GPUS = """
import importlib, json, os, sys
sys.path.insert(0, sys.argv[1])
seen, conftest = [], None
for kept, visible in json.loads(sys.argv[2]):
    for key, value in (("INTERLACE_TEST_MACHINE_GPUS", kept), ("CUDA_VISIBLE_DEVICES", visible)):
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    if conftest is None:
        conftest = importlib.import_module("conftest")
    else:
        importlib.reload(conftest)
    seen.append(conftest.MACHINE_GPUS)
print(json.dumps(seen))
"""


def test_the_machines_gpus_reach_cuda_tests_in_workers_that_inherit_the_hidden_value():
    """conftest hides CUDA from the test process; a pytest-xdist worker, started with that
    hidden value, must still hand its `cuda` tests the machine's own CUDA_VISIBLE_DEVICES."""
    cases = [
        (None, "2,3"),  # the first process: the machine's value
        (None, None),  # the first process, nothing set: every GPU
        ("2,3", ""),  # a worker of the first case
        ("<unset>", ""),  # a worker of the second
    ]
    tests_dir = str(Path(__file__).parent)
    args = [sys.executable, "-c", _READ_MACHINE_GPUS, tests_dir, json.dumps(cases)]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == ["2,3", None, "2,3", None]
