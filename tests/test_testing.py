"""The fork-based rank runner: results come back, failures and hangs fail fast with a traceback."""

import time

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
    start = time.monotonic()
    with pytest.raises(RankFailed, match="still running"):
        run_ranks(2, _rank_zero_hangs, timeout=2)
    assert time.monotonic() - start < 10
