"""The `pipeline` benchmark: its loopback smoke run with the smallest settings, the bubble
formula, the saved-activation meter against a hand count, and option checks."""

import json

import pytest
import torch

from interlace.bench import get_benchmark
from interlace.bench.runner import parse_options, run_benchmark
from interlace.bench.saved_memory import SavedTensorMeter
from interlace.errors import ConfigError
from interlace.planner.cost import bubble_fraction


def test_theoretical_bubble():
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(1, 8) == 0.0


def test_saved_tensor_meter_counts_activations_once_and_releases_them():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorMeter(exclude=[weight]) as meter:
        h = x @ weight  # saves x (and the excluded weight)
        y = (h.tanh() * h).sum()  # tanh saves its output; mul saves both of its inputs
        held = meter.live_bytes
    # x, h and tanh(h): three [4, 8] float tensors, h counted once although saved twice
    assert held == 3 * 4 * 8 * 4
    y.backward()
    assert meter.live_bytes == 0 and meter.peak_bytes == held


def test_bad_options_are_refused():
    bench = get_benchmark("pipeline")
    with pytest.raises(ConfigError, match="comma list of counts"):
        bench.check(parse_options(bench, ["micro_batches=4,x"]))
    with pytest.raises(ConfigError, match="must divide d_model"):
        bench.check(parse_options(bench, ["heads=3"]))


def test_loopback_smoke_run_writes_json_png_and_timeline(tmp_path):
    options = [
        "layers=4",
        "d_model=32",
        "heads=2",
        "seq_len=16",
        "vocab=64",
        "micro_batch=1",
        "micro_batches=2,4",
        "compare_micro_batches=2",
        "steps=1",
    ]
    run_benchmark("pipeline", 2, "loopback", tmp_path, options, command="interlace bench t")
    result = json.loads((tmp_path / "pipeline.json").read_text())["result"]
    assert set(result["bubble"]) == {"gpipe", "1f1b"}
    for rows in result["bubble"].values():
        assert set(rows) == {"2", "4"}
        assert all(0 < row["bubble"] < 1 and row["step_median_s"] > 0 for row in rows.values())
    assert set(result["compared"]) == {"1f1b+full", "shifted+full", "shifted+stage-aware"}
    memory = result["memory"]
    for s in range(2):  # checkpointing every layer keeps less than checkpointing none
        assert memory["full"]["peak_bytes"][s] < memory["none"]["peak_bytes"][s]
    assert memory["stage-aware"]["ratios"] == [1.0, 0.0]
    assert len(result["solo_stage_s"]) == 2
    for name in ("pipeline.png", "pipeline_timeline.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    trace = json.loads((tmp_path / "pipeline_timeline.json").read_text())
    assert any(e["cat"] == "recompute" for e in trace["traceEvents"] if e["ph"] == "X")
