"""The ring reduce-scatter of gloo runs (`comm.ring_reduce_scatter`, through `comm.reduce_scatter`
and FSDP2's `parallel/data/ring.py`): on 2, 3 and 4 ranks each rank's output is the sum (or
mean) over ranks of its chunk, as torch's reduce-scatter gives it, for fp32 and bf16 buffers.
(Sharded data parallelism's and sequence parallelism's equality with the serial run go through
it on every gloo run.)"""

import time

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


def _one_step_gradients(background: bool, delay: float) -> dict:
    """This rank's gradient pieces after one backward of the tiny GPT under dp_shard=2 (its
    blocks' reduce-scatters in the background or not), every ring slowed by `delay` seconds,
    and the threads the rings ran on."""
    import threading

    from interlace.mesh import build_mesh
    from interlace.models.gpt import build_model
    from interlace.parallel import parallelize as par
    from interlace.parallel.data import ring
    from interlace.plan import Plan
    from interlace.tensors import local_tensor

    threads, real = [], ring.ring_reduce_scatter

    def slow(chunks, group):
        threads.append(threading.current_thread().name)
        time.sleep(delay)
        return real(chunks, group)

    ring.ring_reduce_scatter = slow
    par.overlaps_reduce_scatter = lambda *args: background
    plan = Plan.parse("dp_shard=2")
    torch.manual_seed(0)
    result = par.parallelize(build_model("tiny"), plan, build_mesh(plan))
    tokens = torch.randint(
        0, 256, (2, 33), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    result.forward_backward(tokens[:, :-1], tokens[:, 1:])
    grads = {n: local_tensor(p.grad).clone() for n, p in result.model.named_parameters()}
    return {"grads": grads, "threads": threads}


def test_background_reduce_scatters_are_whole_when_backward_returns():
    """Slowed rings in the background still land before `backward()` returns: the gradients
    equal the synchronous ring's bit for bit; the blocks' rings ran on the background thread,
    the model's own (last, nothing to overlap) on the main one."""
    eager = run_ranks(2, _one_step_gradients, False, 0.0)
    background = run_ranks(2, _one_step_gradients, True, 0.2)
    for mine, reference in zip(background, eager, strict=True):
        assert mine["grads"].keys() == reference["grads"].keys()
        for name, grad in mine["grads"].items():
            assert torch.equal(grad, reference["grads"][name]), name
        blocks = [t for t in mine["threads"] if t.startswith("interlace-ring")]
        assert len(blocks) == 2 and mine["threads"].count("MainThread") == 1  # tiny: 2 blocks
        assert set(reference["threads"]) == {"MainThread"}
