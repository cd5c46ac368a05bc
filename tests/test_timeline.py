"""Chrome trace and PNG timelines from spans."""

import json

import pytest

from interlace.timeline import (
    Span,
    chrome_trace,
    plot_timeline,
    spans_from_json,
    spans_to_json,
    write_chrome_trace,
)


def _spans() -> list[Span]:
    return [
        Span(rank=0, name="F0", category="forward", start=1.0, duration=0.5),
        Span(rank=0, name="all_reduce", category="comm", start=1.2, duration=0.1, lane="comm"),
        Span(rank=1, name="B0", category="backward", start=1.5, duration=0.25),
    ]


def test_chrome_trace_events_in_microseconds_from_earliest_start():
    doc = chrome_trace(_spans())
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["pid"], e["ts"], e["dur"]) for e in complete] == [
        ("F0", 0, 0.0, 500000.0),
        ("all_reduce", 0, pytest.approx(200000.0), pytest.approx(100000.0)),
        ("B0", 1, 500000.0, 250000.0),
    ]
    # the two lanes of rank 0 get distinct thread ids, each named
    tids = {e["name"]: e["tid"] for e in complete if e["pid"] == 0}
    assert tids["F0"] != tids["all_reduce"]
    names = {
        (e["pid"], e.get("tid"), e["args"]["name"]) for e in doc["traceEvents"] if e["ph"] == "M"
    }
    assert (0, tids["all_reduce"], "comm") in names
    assert (1, None, "rank 1") in names


def test_write_and_round_trip(tmp_path):
    path = write_chrome_trace(_spans(), tmp_path / "sub" / "t.json")
    assert json.loads(path.read_text())["traceEvents"]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert spans_from_json(spans_to_json(_spans())) == _spans()


def test_png_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_timeline(_spans(), tmp_path / "t.png", title="one step")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_negative_duration_refused():
    with pytest.raises(ValueError, match="negative duration"):
        Span(rank=0, name="x", category="forward", start=0.0, duration=-1.0)
