"""Where a device's time went over profiled steps, read from torch.profiler's Chrome trace.

Per step: the span from the first kernel (or copy) to the last, the time the device was busy
(the union of its kernels and copies over every stream), the rest idle (waiting for the host,
or for another rank), the busy time by kind of kernel, and the communication that no
computation hid (the communication kernels' time outside every other kernel).

Hand-written because torch.profiler's tables sum each operator's own time: they say nothing
of the gaps between kernels, nor of what ran at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
"""The Chrome trace categories of work on the device."""

KINDS = (
    ("communication", ("nccl",)),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "triton_tem")),
    ("attention", ("flash", "sdpa", "fmha", "cudnn")),
    ("multi-tensor (optimizer, norms, foreach copies)", ("multi_tensor_apply",)),
    ("copies", ("memcpy", "memset")),
)
"""Each kind of kernel and the fragments of a kernel's name that mark it (lower case, first
match wins); a kernel matching none is 'other' (fused element-wise work, reductions, sorts)."""


@dataclass(frozen=True)
class DeviceTime:
    """Seconds per profiled step: `span` from the first device event to the last, `busy`
    (some event running), `by_kind` (each event's own time, summed by `KINDS`), and
    `exposed_communication` (communication while nothing else ran)."""

    steps: int
    span: float
    busy: float
    by_kind: dict[str, float]
    exposed_communication: float

    @property
    def idle(self) -> float:
        """Seconds per step the device had nothing to run."""
        return self.span - self.busy


def kind(name: str) -> str:
    """The `KINDS` entry of a device event named `name`, else 'other'."""
    lowered = name.lower()
    return next((k for k, marks in KINDS if any(m in lowered for m in marks)), "other")


def device_time(trace: dict, steps: int) -> DeviceTime | None:
    """The device time of a Chrome trace (torch.profiler's `export_chrome_trace`, parsed)
    recording `steps` steps, per step; None when it holds no device event (a CPU run)."""
    events = [
        (e["ts"], e["ts"] + e["dur"], kind(e["name"]))
        for e in trace.get("traceEvents", [])
        if e.get("cat") in DEVICE_EVENTS and e.get("ph") == "X"
    ]
    if not events:
        return None
    by_kind: dict[str, float] = {}
    for start, end, k in events:
        by_kind[k] = by_kind.get(k, 0.0) + (end - start)
    busy = _union([(s, e) for s, e, _ in events])
    computing = _union([(s, e) for s, e, k in events if k != "communication"])
    communicating = _union([(s, e) for s, e, k in events if k == "communication"])
    exposed = _length(communicating) - _overlap(communicating, computing)
    span = max(e for _, e, _ in events) - min(s for s, _, _ in events)
    per_step = 1e-6 / steps  # the trace counts microseconds
    return DeviceTime(
        steps=steps,
        span=span * per_step,
        busy=_length(busy) * per_step,
        by_kind={k: v * per_step for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        exposed_communication=exposed * per_step,
    )


def describe(time: DeviceTime) -> str:
    """A few lines, in milliseconds per step, for the top of a profile's table."""
    ms = 1e3
    lines = [
        f"device time per step (mean of {time.steps} profiled): span {time.span * ms:.2f} ms, "
        f"busy {time.busy * ms:.2f} ms ({time.busy / time.span:.1%}), "
        f"idle {time.idle * ms:.2f} ms (waiting for the host or another rank)",
        "busy by kind (each kernel's own time; streams may overlap): "
        + ", ".join(f"{k} {v * ms:.2f} ms" for k, v in time.by_kind.items()),
    ]
    if "communication" in time.by_kind:
        lines.append(
            f"communication not hidden under computation: {time.exposed_communication * ms:.2f} ms"
        )
    return "\n".join(lines)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering `intervals`."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
