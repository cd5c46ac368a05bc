"""Timelines of pipeline steps: one `Span` per stage forward, backward and recomputation of
every micro-batch, on every rank, gathered to one rank and written as a Chrome trace + PNG.

    recorder = StepRecorder(runner)                 # every pipeline rank
    with recorder.record():                         # collective: a barrier starts the clock
        runner.step(x, y)
    spans = gather_spans(recorder.spans, runner.pp.pg)   # every rank's spans on pp rank 0
    if spans is not None:
        write_step_trace(spans, "step.json")        # + step.png beside it

What is recorded (lane "compute", times in seconds from the common origin, name "F3" / "B3" /
"R3", args {"stage", "micro_batch", "pp_rank"} and "layer" for a recomputation):

- torch's schedules (GPipe, 1F1B, interleaved): each `PipelineStage.forward_one_chunk` is an
  "F" span and each `backward_one_chunk` a "B" span. Receives are waited on by the schedule
  before these calls, so waiting is not inside a span; the loss of the last stage is computed
  by the schedule after the forward and is not inside it either. A checkpointed block replays
  its forward inside autograd's backward, so its "R" span lies *within* its micro-batch's "B"
  span (one per checkpointed block, found by module hooks that fire only during a backward).
- the shifted executor: "F" (after the activation receive, loss included), "R" (the replay
  before the gradient receive) and "B" (after it) are disjoint, timed by the executor's
  `on_compute` callback.
- with an `optimizer`: one "optimizer" span per `optimizer.step()`.

Clocks: `record()` starts with a barrier over the group; each rank then reads
`time.perf_counter()`, and the group's rank 0 sends its reading and host name to all. Ranks on
rank 0's host share its clock (on Linux, perf_counter is the system-wide CLOCK_MONOTONIC), so
they take rank 0's reading as origin and their spans line up exactly. A rank on another host
takes its own reading: ranks leave a barrier within about one message latency of each other,
which then bounds the misalignment (no clock offsets are estimated).

Overhead: nothing is installed outside `record()`, so a runner that is not being recorded runs
exactly as without this module.

Several `runner.step` calls inside one `record()` (gradient accumulation) repeat micro-batch
names; their spans are still in time order.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from interlace.errors import ConfigError
from interlace.parallel.pipeline.runner import PipelineRunner
from interlace.parallel.pipeline.shifted import ShiftedSchedule
from interlace.timeline import (
    Span,
    plot_timeline,
    spans_from_json,
    spans_to_json,
    write_chrome_trace,
)

CATEGORIES = {"F": "forward", "B": "backward", "R": "recompute"}
"""Span category of each action kind."""


class StepRecorder:
    """Records this rank's share of a `PipelineRunner`'s steps as Spans (module docstring).

    group: the ranks that start the clock together (default: the runner's "pp" group; pass
    `dist.group.WORLD` when several pipelines are recorded at once). optimizer: also record
    each of its steps.
    """

    def __init__(
        self,
        runner: PipelineRunner,
        optimizer: torch.optim.Optimizer | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.runner = runner
        self.optimizer = optimizer
        self.group = group if group is not None else runner.pp.pg
        self.rank = dist.get_rank()
        self.spans: list[Span] = []
        self._origin = 0.0
        self._backward: tuple[int, int] | None = None  # (stage, micro-batch) in torch backward
        self._replay_start: dict[int, float] = {}

    @contextmanager
    def record(self) -> Iterator[list[Span]]:
        """Record everything the runner (and optimizer) does inside the block into `spans`,
        which are cleared first. Collective over `group` (a barrier starts the clock)."""
        self.spans = []
        self._origin = _common_origin(self.group)
        undo = self._install()
        try:
            yield self.spans
        finally:
            for remove in reversed(undo):
                remove()

    # ------------------------------------------------------------------ instrumentation
    def _install(self) -> list[Callable[[], None]]:
        undo: list[Callable[[], None]] = []
        schedule = self.runner.schedule
        if isinstance(schedule, ShiftedSchedule):
            stage = self.runner.stage_indices[0]
            schedule.on_compute = lambda kind, i, start, end: self._add(kind, stage, i, start, end)
            undo.append(lambda: setattr(schedule, "on_compute", None))
        for pipeline_stage in self.runner.pipeline_stages:
            undo.append(self._wrap_stage(pipeline_stage))
        if not isinstance(schedule, ShiftedSchedule):
            for stage, index in zip(self.runner.stages, self.runner.stage_indices, strict=True):
                for layer, block in stage.blocks.items():
                    if int(layer) in stage.checkpointed:
                        undo += self._hook_replay(block, index, int(layer))
        if self.optimizer is not None:
            undo += self._hook_optimizer(self.optimizer)
        return undo

    def _wrap_stage(self, stage: Any) -> Callable[[], None]:
        """Time torch's `forward_one_chunk` / `backward_one_chunk` of one PipelineStage."""
        forward, backward, index = (
            stage.forward_one_chunk,
            stage.backward_one_chunk,
            stage.stage_index,
        )

        def timed_forward(chunk: int, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = forward(chunk, *args, **kwargs)
            self._add("F", index, chunk, start, time.perf_counter())
            return out

        def timed_backward(chunk: int, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self._backward = (index, chunk)
            try:
                out = backward(chunk, *args, **kwargs)
            finally:
                self._backward = None
            self._add("B", index, chunk, start, time.perf_counter())
            return out

        stage.forward_one_chunk, stage.backward_one_chunk = timed_forward, timed_backward

        def restore() -> None:
            del stage.forward_one_chunk, stage.backward_one_chunk  # back to the class's methods

        return restore

    def _hook_replay(self, block: nn.Module, index: int, layer: int) -> list[Callable[[], None]]:
        """An "R" span for each call of a checkpointed `block` during a backward (its replay).
        The end hook runs even when checkpointing stops the replay early by raising."""

        def before(*_: Any) -> None:
            if self._backward is not None:
                self._replay_start[layer] = time.perf_counter()

        def after(*_: Any) -> None:
            start = self._replay_start.pop(layer, None)
            if start is not None and self._backward is not None:
                micro_batch = self._backward[1]
                self._add("R", index, micro_batch, start, time.perf_counter(), layer=layer)

        handles = [
            block.register_forward_pre_hook(before),
            block.register_forward_hook(after, always_call=True),
        ]
        return [handle.remove for handle in handles]

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> list[Callable[[], None]]:
        starts: list[float] = []

        def before(*_: Any) -> None:
            starts.append(time.perf_counter())

        def after(*_: Any) -> None:
            start = starts.pop()
            self.spans.append(self._span("optimizer", "optimizer", start, time.perf_counter()))

        handles = [
            optimizer.register_step_pre_hook(before),
            optimizer.register_step_post_hook(after),
        ]
        return [handle.remove for handle in handles]

    def _add(
        self, kind: str, stage: int, micro_batch: int, start: float, end: float, **extra: int
    ) -> None:
        args = {"stage": stage, "micro_batch": micro_batch, "pp_rank": self.runner.pp.rank}
        span = self._span(f"{kind}{micro_batch}", CATEGORIES[kind], start, end, {**args, **extra})
        self.spans.append(span)

    def _span(
        self, name: str, category: str, start: float, end: float, args: dict | None = None
    ) -> Span:
        return Span(self.rank, name, category, start - self._origin, end - start, args=args or {})


def _common_origin(group: dist.ProcessGroup) -> float:
    """This rank's time origin: rank 0's perf_counter after a barrier on its host, the own
    reading elsewhere (module docstring). Collective over `group`."""
    dist.barrier(group=group)
    mine = [socket.gethostname(), time.perf_counter()]
    first = list(mine)
    dist.broadcast_object_list(first, src=dist.get_global_rank(group, 0), group=group)
    return first[1] if first[0] == mine[0] else mine[1]


def gather_spans(spans: Sequence[Span], group: dist.ProcessGroup) -> list[Span] | None:
    """Every rank's `spans` of `group`, concatenated in rank order, on the group's rank 0
    (None on the others). Collective; pickled objects, meant for diagnostics only."""
    dst = dist.get_global_rank(group, 0)
    rows: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(spans_to_json(list(spans)), rows, dst=dst, group=group)
    if rows is None:
        return None
    return [span for part in rows for span in spans_from_json(part)]


def write_step_trace(spans: Sequence[Span], path: str | Path, title: str = "") -> tuple[Path, Path]:
    """The Chrome trace (Perfetto) at `path` and its Gantt chart at `path` with suffix .png
    (longest spans drawn first, so a recomputation shows on top of its backward)."""
    path = Path(path)
    png = path.with_suffix(".png")
    drawn = sorted(spans, key=lambda s: -s.duration)
    return write_chrome_trace(spans, path), plot_timeline(drawn, png, title=title)


def busy_seconds(spans: Sequence[Span], rank: int) -> float:
    """Seconds during which `rank` runs at least one span (the union of its intervals, so a
    recomputation nested in a backward counts once)."""
    intervals = sorted((s.start, s.end) for s in spans if s.rank == rank)
    total, reach = 0.0, float("-inf")
    for start, end in intervals:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def bubble_fraction(spans: Sequence[Span]) -> float:
    """Mean over ranks of 1 − busy / makespan, where the makespan runs from the first span's
    start to the last span's end over all ranks: the idle share of a pipeline step."""
    ranks = sorted({s.rank for s in spans})
    if not ranks:
        raise ValueError("no spans to measure a bubble from")
    makespan = max(s.end for s in spans) - min(s.start for s in spans)
    return sum(1 - busy_seconds(spans, r) / makespan for r in ranks) / len(ranks)


def check_trace_path(path: str | Path, pp: int) -> Path:
    """`path` as the target of `--trace`, checked before any work: ConfigError unless it ends
    in .json, its folder exists and is writable, and the plan has pp > 1."""
    path = Path(path)
    if path.suffix != ".json":
        raise ConfigError(
            f"--trace '{path}' must end in .json (a Chrome trace; the PNG goes beside it), "
            f"e.g. --trace {path.with_suffix('.json')}"
        )
    folder = path.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError(
            f"--trace '{path}': folder '{folder}' does not exist or is not writable; create it "
            "or choose a writable folder"
        )
    if pp < 2:
        raise ConfigError(
            f"--trace records pipeline stages and needs pp > 1; the plan has pp={pp}: add "
            "pp=2 (or more) to --plan, or drop --trace"
        )
    return path


@contextmanager
def trace_to_file(
    runner: PipelineRunner, path: str | Path, optimizer: torch.optim.Optimizer | None = None
) -> Iterator[None]:
    """Record the enclosed work on every rank of the world (collective), gather the spans to
    global rank 0 and write them to `path` (Chrome trace) and beside it as PNG."""
    world = dist.group.WORLD
    recorder = StepRecorder(runner, optimizer, group=world)
    with recorder.record():
        yield
    spans = gather_spans(recorder.spans, world)
    if spans is not None:
        plan = runner.plan
        title = f"one step, {plan}, {plan.micro_batches} micro-batches"
        write_step_trace(spans, path, title=title)
