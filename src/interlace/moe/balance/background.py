"""A placement search run on a background thread, so that planning overlaps the layer's work
(Pro-Prophet's scheduler: "planning for the next iteration overlaps this iteration's
all-to-all").

The searches are pure Python over a small count matrix and hold the GIL most of the time, but
the layer's thread spends much of an iteration inside gloo/NCCL collectives and matmuls, which
release it: the search runs there. `threading` and `concurrent.futures.Future` do the work; this
module only times the search and the wait for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from interlace.moe.balance.placement import Placement


@dataclass(frozen=True)
class PlanTiming:
    """Wall seconds of one background search (`search_s`, on its own thread) and of the wait
    for it on the thread that applied it (`wait_s`: the part not hidden), and the training
    iteration at which it was applied."""

    search_s: float
    wait_s: float
    iteration: int

    @property
    def hidden_s(self) -> float:
        """Seconds of the search that ran under the layer's own work: search_s − wait_s."""
        return max(0.0, self.search_s - self.wait_s)


class BackgroundSearch:
    """`search()` started now on a daemon thread called `name`; `result` joins it.

    An exception raised by the search is re-raised by `result`, on the joining thread, with
    its traceback.
    """

    def __init__(self, search: Callable[[], Placement], name: str):
        self._future: Future[tuple[Placement, float]] = Future()
        self._thread = threading.Thread(target=self._run, args=(search,), name=name, daemon=True)
        self._thread.start()

    def _run(self, search: Callable[[], Placement]) -> None:
        start = time.perf_counter()
        try:
            placement = search()
        except BaseException as exc:  # handed to the joining thread
            self._future.set_exception(exc)
        else:
            self._future.set_result((placement, time.perf_counter() - start))

    def result(self, iteration: int) -> tuple[Placement, PlanTiming]:
        """Wait for the search; its placement and timing, applied at training `iteration`."""
        start = time.perf_counter()
        placement, search_s = self._future.result()
        wait_s = time.perf_counter() - start
        self._thread.join()
        return placement, PlanTiming(search_s, wait_s, iteration)
