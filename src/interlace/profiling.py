"""`profile_steps`: torch.profiler over chosen steps of a run, written into its folder.

The recorded steps follow the first (compilation) step and the memory-measured third step, so
they show a steady step, and one more step before them lets the profiler settle (torch's own
warm-up phase). Each rank writes `profile/rank<r>.json.gz`, a Chrome trace that Perfetto or
chrome://tracing opens (every operator on the host, every kernel and copy on a CUDA device), and
`profile/rank<r>.txt`, the operators that took the most device time (host time on the CPU),
headed on a device by where its time went per step (`interlace.device_time`: busy, idle, by
kind of kernel, communication left exposed).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from interlace.device_time import DeviceTime, describe, device_time
from interlace.run_folder import replaced_atomically, write_atomic

PROFILE_FOLDER = "profile"
TOP_OPERATORS = 40


def profile_window(first: int, settle_after: int, count: int, total: int) -> range:
    """The steps (as the Trainer counts them before each: 0-based) to profile: one to settle,
    then `count` recorded, starting after step `settle_after` (the warm-up or memory step) and
    never before `first` (where this invocation starts) nor past `total`."""
    start = max(first, settle_after + 1)
    return range(start, min(start + 1 + count, total)) if count else range(0)


class StepProfiler:
    """Profiles the steps of `window` (`profile_window`); call `step()` after every training
    step from `first` on. Writes rank `rank`'s trace and table into `folder`."""

    def __init__(
        self, window: range, first: int, folder: Path, rank: int, device: torch.device
    ) -> None:
        self.window = window
        self.folder = Path(folder)
        self.rank = rank
        self.cuda = device.type == "cuda"
        self._device_time: DeviceTime | None = None  # this rank's, once the steps are recorded
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profiler = (
            profile(
                activities=activities,
                schedule=schedule(
                    wait=window.start - first, warmup=1, active=len(window) - 1, repeat=1
                ),
                on_trace_ready=self._write,
            )
            if len(window) > 1
            else None
        )

    def __enter__(self) -> StepProfiler:
        if self._profiler is not None:
            self._profiler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._profiler is not None:
            self._profiler.stop()

    def covers(self, step: int) -> bool:
        """Whether step `step` (0-based, before it runs) is profiled: its time is not steady."""
        return self._profiler is not None and step in self.window

    def step(self) -> None:
        """Mark the end of a training step."""
        if self._profiler is not None:
            self._profiler.step()

    def report(self, ranks: int) -> dict[str, Any]:
        """The run report's fields: `profile`, every rank's files (each rank profiles the same
        steps) relative to the run folder, empty when nothing is recorded; and
        `profile_device_time`, this rank's `DeviceTime` as a dict (None off a device)."""
        names = [f"rank{r}.{ext}" for r in range(ranks) for ext in ("json.gz", "txt")]
        spent = self._device_time
        return {
            "profile": [] if self._profiler is None else [f"{PROFILE_FOLDER}/{n}" for n in names],
            "profile_device_time": None if spent is None else dataclasses.asdict(spent),
        }

    def _write(self, prof: Any) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(self.folder / f"rank{self.rank}.json.gz") as tmp:
            staged = tmp.with_name(tmp.name + ".gz")  # torch compresses by the suffix
            prof.export_chrome_trace(str(staged))
            staged.replace(tmp)
            if self.cuda:  # a CPU trace holds no device event: not read back for nothing
                trace = json.loads(gzip.decompress(tmp.read_bytes()))
                self._device_time = device_time(trace, len(self.window) - 1)
        key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=TOP_OPERATORS)
        head = "" if self._device_time is None else describe(self._device_time) + "\n\n"
        write_atomic(self.folder / f"rank{self.rank}.txt", head + table + "\n")
