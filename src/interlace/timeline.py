"""Per-rank timelines of one step: spans, a Chrome trace (Perfetto) and a PNG.

A `Span` is one interval of work on one rank's lane — a forward or backward of a micro-batch,
a collective, a recomputation. Both the pipeline runtime (measured spans) and the planner's
simulator (predicted spans) produce them; this module writes them out the same way:

    write_chrome_trace(spans, "trace.json")   # open in https://ui.perfetto.dev or chrome://tracing
    plot_timeline(spans, "trace.png")          # one row per rank and lane, a box per span

The Chrome trace is the JSON "Trace Event Format": one complete event ("ph": "X") per span,
times in microseconds, `pid` = rank, `tid` = lane, with a metadata event naming each rank.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from interlace.plotting import new_figure, save_figure

CATEGORY_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "recompute": "#c44e52",
    "comm": "#dd8452",
    "optimizer": "#8172b3",
    "idle": "#cccccc",
}
"""Fill colour per span category; any other category is drawn grey-blue."""
OTHER_COLOUR = "#64b5cd"


@dataclass(frozen=True)
class Span:
    """One interval of work. start and duration in seconds from the step's start (any common
    origin); `lane` separates overlapping work on one rank (e.g. "compute", "comm")."""

    rank: int
    name: str
    category: str
    start: float
    duration: float
    lane: str = "compute"
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.duration < 0:
            raise ValueError(f"span {self.name!r} on rank {self.rank} has negative duration")

    @property
    def end(self) -> float:
        """start + duration, seconds."""
        return self.start + self.duration


def chrome_trace(spans: Iterable[Span]) -> dict[str, Any]:
    """The Trace Event Format document for `spans`: {"traceEvents": [...],
    "displayTimeUnit": "ms"}; one "X" event per span (µs), plus process/thread names."""
    spans = list(spans)
    origin = min((s.start for s in spans), default=0.0)
    events: list[dict[str, Any]] = []
    lanes: dict[tuple[int, str], int] = {}
    for s in sorted(spans, key=lambda s: (s.rank, s.start)):
        tid = lanes.setdefault((s.rank, s.lane), len([k for k in lanes if k[0] == s.rank]))
        events.append(
            {
                "name": s.name,
                "cat": s.category,
                "ph": "X",
                "pid": s.rank,
                "tid": tid,
                "ts": (s.start - origin) * 1e6,
                "dur": s.duration * 1e6,
                "args": s.args,
            }
        )
    for rank in sorted({r for r, _ in lanes}):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
    for (rank, lane), tid in lanes.items():
        events.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}}
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: Iterable[Span], path: str | Path) -> Path:
    """Write `chrome_trace(spans)` to `path` atomically (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(chrome_trace(spans), f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def spans_to_json(spans: Sequence[Span]) -> list[dict[str, Any]]:
    """Spans as plain dicts (for results files and for sending between ranks)."""
    return [asdict(s) for s in spans]


def spans_from_json(rows: Iterable[dict[str, Any]]) -> list[Span]:
    """Inverse of `spans_to_json`."""
    return [Span(**row) for row in rows]


def plot_timeline(spans: Sequence[Span], path: str | Path, title: str = "") -> Path:
    """A Gantt chart of `spans` as PNG at `path`: one row per (rank, lane), rank 0 on top,
    time in milliseconds; span names are written inside boxes wide enough to hold them."""
    rows = sorted({(s.rank, s.lane) for s in spans})
    index = {row: i for i, row in enumerate(rows)}
    origin = min((s.start for s in spans), default=0.0)
    fig, ax = new_figure(figsize=(10, 0.5 + 0.45 * max(len(rows), 1)))
    total = max((s.end for s in spans), default=origin) - origin
    for s in spans:
        y = index[(s.rank, s.lane)]
        x = (s.start - origin) * 1e3
        ax.barh(
            y,
            s.duration * 1e3,
            left=x,
            height=0.8,
            color=CATEGORY_COLOURS.get(s.category, OTHER_COLOUR),
            edgecolor="black",
            linewidth=0.3,
        )
        if total > 0 and s.duration / total > 0.03:
            ax.text(x + s.duration * 5e2, y, s.name, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {lane}" for r, lane in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title)
    used = sorted({s.category for s in spans})
    handles = [_patch(CATEGORY_COLOURS.get(c, OTHER_COLOUR), c) for c in used]
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="upper right")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    return path


def _patch(colour: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=colour, edgecolor="black", label=label)
