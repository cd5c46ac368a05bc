"""A checkpointed forward's collectives, recorded once and replayed in its recomputation
(`ReductionReplay`), so that recomputing a forward never communicates again: Oases' rule. A
split layer's forward reduction opts in by running through `replayed`; recomputation
(`interlace.recompute`) and the pipeline's shifted executor drive the replay. The state is per
thread: reductions on other threads (overlapped sub-batches) communicate in both runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from interlace.comm import Group, Reduce

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
