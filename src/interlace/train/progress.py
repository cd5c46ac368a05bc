"""The training progress bar on stderr, and the guarantee that its line is ended however the run
stops, so the line a launcher prints next (why the run stopped) stands on a line of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def progress_bar(steps: int, done: int, shown: bool) -> Iterator[Any]:
    """A tqdm bar over `steps` training steps starting at `done` (None when not `shown`), closed
    on leaving, by an error too. While it is open, SIGTERM (what torch's elastic agent sends the
    other ranks when one fails) ends the bar's line, then takes its default action, so the rank
    still reads as stopped by SIGTERM."""
    if not shown:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(
        total=steps,
        initial=done,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 5.0,
    )
    previous = _on_sigterm(_end_line_and_stop)
    try:
        yield bar
    finally:
        bar.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _on_sigterm(handler: Any) -> Any:
    """Install `handler` for SIGTERM where Python allows it (the main thread) and nobody has
    claimed the signal (a caller's own handler, such as a benchmark's teardown, stays); the handler
    it replaces, or None where none was installed."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, handler)


def _end_line_and_stop(signum: int, _frame: Any) -> None:
    sys.stderr.write("\n")
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def postfix(row: dict[str, Any]) -> dict[str, str]:
    """The bar's right-hand fields for one step's metrics `row`."""
    post = {
        "loss": f"{row['loss']:.3f}",
        "lr": f"{row['lr']:.1e}",
        "tok/s": f"{row['tokens_per_s']:.0f}",
    }
    if "mfu" in row:
        post["mfu"] = f"{row['mfu']:.1%}"
    if "eval_loss" in row:
        post["eval"] = f"{row['eval_loss']:.3f}"
    return post
