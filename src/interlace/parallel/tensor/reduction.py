"""The reductions of 1D tensor parallelism as the layers run them: the plain all-reduce, made to
hand the thread's turn over to another sub-batch while it flies (overlapped tensor parallelism,
`overlap.py` and `interleave.py`), and, in a recomputed forward, to replay the first forward's
result instead of communicating again (`ReductionReplay`).

The layers pass `scheduled_reduce` (forward) and `yielding_reduce` (backward) to the plain
`comm.reduce_from_tp` / `comm.copy_to_tp`: with no yield point and no replay active, both are
`comm.all_reduced`. Sequence parallel layers pass `replayed_reduce_scatter` to
`comm.reduce_scatter_sequence`, their forward reduction. The state is per thread (each
sub-batch runs on its own thread).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from interlace import comm
from interlace.comm import Group
from interlace.parallel.tensor.comm import Reduce, all_reduced, reduce_scatter_dim1

_yield_point = threading.local()


def set_reduce_yield(switch: Callable[[], None] | None) -> None:
    """Install (None: remove) this thread's yield point for the all-reduces of 1D TP — the
    forward one of `reduce_from_tp` and the backward one of `copy_to_tp` in the layers: while one
    is set,
    the all-reduce is issued asynchronously, `switch()` runs (other sub-batches compute
    meanwhile; see `interlace.parallel.tensor.overlap`), and only then is the result waited on."""
    _yield_point.switch = switch


def yielding_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Σ over `group` of x (`comm.all_reduced`), handing the thread's turn over while the
    reduction flies if a yield point is installed on this thread: the backward reduction of
    `copy_to_tp` at every layer."""
    switch = getattr(_yield_point, "switch", None)
    if switch is None:
        return all_reduced(x, group)
    out = x.clone(memory_format=torch.contiguous_format)
    work = comm.all_reduce(out, group, async_op=True)
    switch()
    work.wait()
    return out


_replay_state = threading.local()


class ReductionReplay:
    """The results of the forward reductions (`reduce_from_tp`'s all-reduce, or sequence
    parallelism's reduce-scatter) of one checkpointed forward, so that its recomputation
    replays them instead of communicating again: Oases' rule that recomputation never repeats
    a forward all-reduce. It keeps one reduced [.., d] tensor per reduction (two per block; a
    sequence shard under sequence parallelism), the memory Oases spends on it.

        replay = ReductionReplay()
        with replay.recording():
            out = forward(x)       # reduces as usual, keeps each result
        with replay.replaying():
            out = forward(x)       # the same results in the same order, no communication

    `contexts()` gives the pair for `torch.utils.checkpoint`'s `context_fn`. The state is per
    thread: reductions on other threads (overlapped sub-batches) communicate in both runs.
    """

    def __init__(self) -> None:
        self._kept: list[tuple[torch.Size, torch.Tensor, int]] = []
        self._next = 0

    @classmethod
    def contexts(
        cls,
    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """(recording, replaying) context managers of a fresh replay: a checkpoint `context_fn`."""
        replay = cls()
        return replay.recording(), replay.replaying()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Reduce as usual and keep every result, in order."""
        with self._active("record"):
            yield

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Hand out the kept results instead of reducing; all of them must be used."""
        with self._active("replay"):
            yield
        if self._next != len(self._kept):
            raise RuntimeError(
                f"recomputation issued {self._next} tensor parallel reductions, the forward "
                f"{len(self._kept)}: the replayed forward must take the same path"
            )
        self._kept, self._next = [], 0

    @contextlib.contextmanager
    def _active(self, mode: str) -> Iterator[None]:
        previous = getattr(_replay_state, "active", None)
        _replay_state.active = (self, mode)
        try:
            yield
        finally:
            _replay_state.active = previous

    def keep(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Keep a forward reduction's result `out` of input `x` (recording)."""
        kept = out.detach()
        self._kept.append((x.shape, kept, kept._version))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The next kept result, in place of reducing x (replaying)."""
        if self._next >= len(self._kept):
            raise RuntimeError(
                "recomputation issued more tensor parallel reductions than the forward"
            )
        shape, kept, version = self._kept[self._next]
        self._next += 1
        if shape != x.shape or kept._version != version:
            raise RuntimeError(
                "a replayed reduction does not match the forward's (other shape, or its result "
                "was modified in place since)"
            )
        return kept


def replayed(reduce: Reduce) -> Reduce:
    """`reduce` as a checkpointed forward runs it: the kept result while a `ReductionReplay`
    replays (no communication), else `reduce(x, group)`, kept while one records."""

    def run(x: torch.Tensor, group: Group) -> torch.Tensor:
        active = getattr(_replay_state, "active", None)
        if active is not None and active[1] == "replay":
            return active[0].take(x)
        out = reduce(x, group)
        if active is not None:
            active[0].keep(x, out)
        return out

    return run


scheduled_reduce = replayed(yielding_reduce)
"""Σ over the group for the forward reduction of `reduce_from_tp` at every layer: yielding to
other sub-batches (`yielding_reduce`), replayed in recomputation."""

replayed_reduce_scatter = replayed(reduce_scatter_dim1)
"""Sequence parallelism's forward reduce-scatter [B, T, ...] → [B, T/p, ...], replayed in
recomputation."""
