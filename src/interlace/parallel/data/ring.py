"""FSDP2's reduce-scatter on gloo as `comm.ring_reduce_scatter`: half the bytes of torch's,
which runs a whole all-reduce there, plugged in through `set_custom_reduce_scatter`. CUDA keeps
torch's (NCCL's reduce-scatter is a ring already).

On the CPU FSDP2 has no second stream to overlap its reduce-scatters with backward: each
block's blocks the backward of the block before it. `RingReduceScatter(background)` runs the
ring on a thread of its own, over a process group of its own (`ring_group`: the same ranks,
other connections, so its sends never interleave with the gathers of the main thread), and
waits for every transfer at the end of the backward that started it (an autograd engine callback, as
FSDP2's own end-of-backward work is), so `.grad` is whole when `backward()` returns. That is
sound only where FSDP2 merely views the reduced buffer inside backward: no cast to another
dtype, no division after, no all-reduce over replicas (HSDP), no accumulation into gradients
from an earlier backward (a pipeline's micro-batches); `apply_fully_shard` uses it only there.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from interlace.comm import ring_reduce_scatter


class RingReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter (output [S], input [n·S], the sum or mean over the group's n
    ranks of input chunk `rank`) as a ring of gloo sends: now, or with `background` (FSDP2's
    group's ranks in a group of their own) on a background thread over that group, awaited at
    the end of the backward pass that issued it (see the module docstring for where that is
    sound)."""

    def __init__(self, background: dist.ProcessGroup | None = None) -> None:
        self.background = background
        self.worker = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="interlace-ring")
            if background is not None
            else None
        )
        self.pending: list[Future] = []

    def allocate(
        self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A plain buffer (FSDP2 asks its comm for the reduce-scatter input)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or async_op:
            raise ValueError(f"the ring reduce-scatter sums or averages synchronously, not {op}")
        if self.background is None:
            reduce_into(output_tensor, input_tensor, group, op)
            return
        if not self.pending:
            try:  # the end of this backward pass waits for every transfer it started
                torch.autograd.Variable._execution_engine.queue_callback(self.wait)
            except RuntimeError:  # not inside a backward pass: nothing to overlap with
                reduce_into(output_tensor, input_tensor, self.background, op)
                return
        assert self.worker is not None
        self.pending.append(
            self.worker.submit(reduce_into, output_tensor, input_tensor, self.background, op)
        )

    def wait(self) -> None:
        """Block until every transfer issued so far has landed in its output (re-raising a
        failed one's error)."""
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()


def reduce_into(
    output: torch.Tensor, chunks: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp
) -> None:
    """output [S] ← the sum (or mean, `op` AVG) over `group`'s n ranks of their chunk `rank`
    of `chunks` [n·S], by `ring_reduce_scatter`."""
    n = group.size()
    output.copy_(ring_reduce_scatter(chunks.view(n, -1), group))
    if op == dist.ReduceOp.AVG:
        output.div_(n)


def ring_group(ranks: list[list[int]]) -> dist.ProcessGroup:
    """A gloo group of this rank's row of `ranks` (every data-parallel group of the mesh, one
    row each, the same list on every rank: all ranks make every group, in that order)."""
    mine, _ = dist.new_subgroups_by_enumeration(ranks, backend="gloo")
    return mine
