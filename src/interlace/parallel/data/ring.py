"""FSDP2's reduce-scatter on gloo as `comm.ring_reduce_scatter`: half the bytes of torch's,
which runs a whole all-reduce there, plugged in through `set_custom_reduce_scatter`. CUDA keeps
torch's (NCCL's reduce-scatter is a ring already)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from interlace.comm import ring_reduce_scatter


class RingReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter (output [S], input [n·S], the sum or mean over the group's n
    ranks of input chunk `rank`) as a ring of gloo sends."""

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
        n = group.size()
        output_tensor.copy_(ring_reduce_scatter(input_tensor.view(n, -1), group))
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(n)
