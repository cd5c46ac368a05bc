"""The reductions of tensor parallelism as the layers run them: the plain all-reduce, made to
hand the thread's turn over to another sub-batch while it flies (overlapped tensor parallelism,
`overlap.py` and `interleave.py`), and, in a recomputed forward, to replay the first forward's
result instead of communicating again (`ReductionReplay`).

The layers pass `scheduled_reduce` (forward) and `yielding_reduce` (backward) to the plain
`comm.reduce_from_tp` / `comm.copy_to_tp`: with no yield point and no replay active, both are
`comm.all_reduced`. Sequence parallel layers pass `replayed_reduce_scatter` to
`comm.reduce_scatter_sequence`, their forward reduction. The state is per thread (each
sub-batch runs on its own thread). The replay itself is shared with recomputation and the
pipeline's shifted executor (`interlace.parallel.replay`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from interlace import comm
from interlace.comm import Group
from interlace.parallel.replay import replayed
from interlace.parallel.tensor.comm import all_reduced, reduce_scatter_dim1

_yield_point = threading.local()


def set_reduce_yield(switch: Callable[[], None] | None) -> None:
    """Install (None: remove) this thread's yield point for the all-reduces of 1D TP — the
    forward one of `reduce_from_tp` and the backward one of `copy_to_tp` in the layers: while one
    is set,
    the all-reduce is issued asynchronously, `switch()` runs (other sub-batches compute
    meanwhile; see `interlace.parallel.tensor.overlap`), and only then is the result waited on."""
    _yield_point.switch = switch


def hand_over() -> None:
    """Hand this thread's turn over to the other sub-batches and wait for it to come back, if
    a yield point is installed (else nothing): called with a collective in flight, which the
    caller waits on afterwards."""
    switch = getattr(_yield_point, "switch", None)
    if switch is not None:
        switch()


def yielding_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Σ over `group` of x (`comm.all_reduced`), handing the thread's turn over while the
    reduction flies if a yield point is installed on this thread: the backward reduction of
    `copy_to_tp` at every layer, and the output reduction of a 3D linear
    (`tensor3d.comm.linear3d`)."""
    if getattr(_yield_point, "switch", None) is None:
        return all_reduced(x, group)
    out = x.clone(memory_format=torch.contiguous_format)
    work = comm.all_reduce(out, group, async_op=True)
    hand_over()
    work.wait()
    return out


scheduled_reduce = replayed(yielding_reduce)
"""Σ over the group for the forward reduction of `reduce_from_tp` at every layer: yielding to
other sub-batches (`yielding_reduce`), replayed in recomputation."""

replayed_reduce_scatter = replayed(reduce_scatter_dim1)
"""Sequence parallelism's forward reduce-scatter [B, T, ...] → [B, T/p, ...], replayed in
recomputation."""
