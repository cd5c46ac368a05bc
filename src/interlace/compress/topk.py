"""Top-k sparsification with all-gather: the sparse baseline the S2 Reducer is compared with.

Per bucket g [d] each rank keeps its k = ceil(fraction · d) largest-magnitude entries, packs
(indices int32 [k], values [k]) as raw bytes into one buffer and all-gathers it (p·k·(4 + value
bytes) received); every rank then sums all ranks' entries into a zero [d] with `index_add_` and
divides by p. Index/value pairs cannot be summed by all-reduce, which is why the gather grows with
p — the problem the count sketch solves. With `error_feedback=True` the entries not sent are kept
and added to the next step's gradient. fraction = 1 sends everything and equals the dense mean.

torch has no top-k comm hook, hence this module. Register with
`ddp.register_comm_hook(TopKState(group, fraction=0.01), topk_hook)`.
"""

import math

import torch
import torch.distributed as dist

from interlace import comm
from interlace.compress.hook import CompressionState, Reduction, write_into
from interlace.errors import ConfigError


def topk_allgather(
    flat: torch.Tensor, group: comm.Group, k: int, residual: bool = False
) -> Reduction:
    """Mean over `group` of the flat gradient [d] from each rank's top-`k` entries (by |g|).

    With `residual=True` the result carries the entries this rank did not send [d].
    """
    _, index = flat.abs().topk(k, sorted=False)
    values = flat[index]
    payload = torch.cat([index.to(torch.int32).view(torch.uint8), values.view(torch.uint8)])
    gathered = payload.new_empty(group.size * payload.numel())
    work = comm.all_gather(gathered, payload, group, async_op=True)
    assert work is not None
    lost = None
    if residual:
        lost = flat.clone()
        lost[index] = 0
    index_bytes, ranks = 4 * k, group.size  # the callback holds no reference to the group

    def unpack(fut: torch.futures.Future) -> torch.Tensor:
        rows = gathered.view(ranks, -1)
        all_index = rows[:, :index_bytes].contiguous().view(torch.int32).view(-1).long()
        all_values = rows[:, index_bytes:].contiguous().view(flat.dtype).view(-1)
        out = torch.zeros_like(flat).index_add_(0, all_index, all_values)
        return out.div_(ranks)

    future = work.get_future().then(unpack)
    return Reduction(future, "topk", payload.nbytes, residual=lost)


class TopKState(CompressionState):
    """Options and per-bucket state of `topk_hook`: k = ceil(fraction · bucket numel)."""

    def __init__(
        self, group: comm.Group, fraction: float = 0.01, error_feedback: bool = False
    ) -> None:
        if not 0 < fraction <= 1:
            raise ConfigError(f"fraction={fraction} must be in (0, 1]; use e.g. fraction=0.01")
        super().__init__(group, error_feedback)
        self.fraction = fraction

    def k(self, numel: int) -> int:
        """Entries each rank sends from a bucket of `numel` elements (at least 1)."""
        return max(1, min(numel, math.ceil(self.fraction * numel)))


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean over `state.group` from every rank's top-k entries."""
    flat = bucket.buffer()
    entry = state.entry(bucket)
    grad = state.gradient(entry.index, flat)
    reduction = topk_allgather(grad, state.group, state.k(flat.numel()), state.error_feedback)
    state.record(entry, flat, reduction)
    return reduction.future.then(write_into(flat))
