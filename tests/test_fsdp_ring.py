"""The ring reduce-scatter of gloo runs (`comm.ring_reduce_scatter`, through `comm.reduce_scatter`
and FSDP2's `parallel/data/ring.py`): on 2, 3 and 4 ranks each rank's output is the sum (or
mean) over ranks of its chunk, as torch's reduce-scatter gives it, for fp32 and bf16 buffers.
(Sharded data parallelism's and sequence parallelism's equality with the serial run go through
it on every gloo run.)"""

import pytest
import torch
import torch.distributed as dist

from interlace import comm
from interlace.comm import Group
from interlace.parallel.data.ring import RingReduceScatter
from interlace.testing import run_ranks


def _both(dtype: torch.dtype, op: dist.ReduceOp.RedOpType) -> tuple[torch.Tensor, torch.Tensor]:
    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    buffer = torch.randint(-50, 50, (n * 7,), generator=gen).to(dtype)  # sums exact in bf16
    ring, torchs = torch.empty(7, dtype=dtype), torch.empty(7, dtype=dtype)
    RingReduceScatter()(ring, buffer, dist.group.WORLD, op)
    through_comm = torch.empty(7, dtype=dtype)
    comm.reduce_scatter(through_comm, buffer, Group("world", dist.group.WORLD, n, rank))
    if op == dist.ReduceOp.AVG:
        through_comm /= n
    assert torch.equal(through_comm, ring)
    dist.reduce_scatter_tensor(torchs, buffer.clone(), op=dist.ReduceOp.SUM)
    if op == dist.ReduceOp.AVG:
        torchs /= n
    return ring, torchs


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG])
def test_each_rank_gets_the_reduction_of_its_chunk(ranks, dtype, op):
    for ring, torchs in run_ranks(ranks, _both, dtype, op):
        assert torch.equal(ring, torchs)
