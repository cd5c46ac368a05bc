"""The `tp3d` benchmark: its layouts, its predictions, and a loopback smoke run with the smallest
settings in which every layout's measured bytes equal the prediction."""

import json

import pytest

from interlace.bench import get_benchmark
from interlace.bench.runner import parse_options, run_benchmark
from interlace.bench.tp3d import layouts, predicted_1d
from interlace.errors import ConfigError
from interlace.models.config import GPTConfig


def test_layouts_are_1d_then_every_grid_of_the_ranks():
    assert layouts(4) == [None, (4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4)]
    assert layouts(1) == [None, (1, 1, 1)]


def test_1d_prediction_by_hand():
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=1, n_heads=2)
    # 6 all-reduces of [T, d] (2 blocks × 2 + embedding + head) and the loss's 3 [T] floats
    tokens = 8
    assert predicted_1d(cfg, tokens, 2) == {"tp": (6 * tokens * 16 * 4 + 3 * tokens * 4) * 1.0}


def test_bad_options_are_refused():
    bench = get_benchmark("tp3d")
    with pytest.raises(ConfigError, match="must divide d_model"):
        bench.check(parse_options(bench, ["heads=3"]))


def test_loopback_smoke_run_measures_what_it_predicts(tmp_path):
    options = ["vocab=64", "seq_len=8", "d_model=16", "layers=1", "heads=2", "batch=2", "steps=1"]
    run_benchmark("tp3d", 2, "loopback", tmp_path, options, command="interlace bench t")
    result = json.loads((tmp_path / "tp3d.json").read_text())["result"]
    assert list(result["layouts"]) == ["tp=2", "tp3d=2x1x1", "tp3d=1x2x1", "tp3d=1x1x2"]
    for name, row in result["layouts"].items():
        assert row["measured"] == pytest.approx(row["predicted"]), name
        assert row["step_median_s"] > 0
    assert set(result["layouts"]["tp3d=1x1x2"]["measured"]) == {"tp_z"}
    assert result["layouts"]["tp3d=1x1x2"]["step_median_s_no_prefetch"] > 0  # timed once more
    assert (tmp_path / "tp3d.png").read_bytes()[:4] == b"\x89PNG"
