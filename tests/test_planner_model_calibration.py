"""`interlace plan --hardware local --calibrate-model`: the model's compute priced at the
efficiency its own step reaches here, measured once and cached; refused where it cannot be
measured."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import fake_calibration
from interlace.cli import main
from interlace.errors import ConfigError
from interlace.models.presets import get_preset
from interlace.planner import calibrate as cal
from interlace.planner import model_calibration as mcal

ARGV = ["plan", "--model", "tiny", "--hardware", "local", "--plan", "dp=1", "--json"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cached machine calibration (no measuring), and the model efficiencies beside it."""
    path = tmp_path / "hw.json"
    monkeypatch.setenv(cal.CACHE_ENV, str(path))
    path.write_text(json.dumps(fake_calibration().to_dict()))
    return path


def _breakdown(capsys, *options: str) -> dict:
    assert main([*ARGV, "--global-batch", "8", *options]) == 0
    return json.loads(capsys.readouterr().out)["plans"][0]["breakdown"]


def test_compute_is_priced_at_the_measured_step_rate_measured_once(cache, capsys, monkeypatch):
    calls = []
    calibration = cal.Calibration(**json.loads(cache.read_text()))
    rate = calibration.flops_for_threads(cal.threads_per_rank(1), "fp32")  # the priced peak

    def measured(config, rows, threads, min_seconds=0.5, dtype="fp32", device=None):
        calls.append((config.d_model, rows, dtype))
        return rate / 4  # a quarter of the calibrated matmul rate

    monkeypatch.setattr(mcal, "measure_model_flops", measured)
    monkeypatch.setattr(cal, "measure", lambda: calibration)  # --recalibrate: the machine too
    plain = _breakdown(capsys)
    calibrated = _breakdown(capsys, "--calibrate-model")
    assert calibrated["compute"] == pytest.approx(4 * plain["compute"])
    assert calibrated["optimizer"] == pytest.approx(plain["optimizer"])
    assert calls == [(get_preset("tiny").d_model, 8, "fp32")]  # one device: the whole batch
    _breakdown(capsys, "--calibrate-model")
    assert len(calls) == 1  # cached
    _breakdown(capsys, "--calibrate-model", "--precision", "bf16")
    _breakdown(capsys, "--calibrate-model", "--recalibrate")
    assert calls[1:] == [(calls[0][0], 8, "bf16"), calls[0]]
    cached = json.loads(mcal.efficiency_cache_path().read_text())
    assert sorted(cached.values()) == [rate / 4, rate / 4]


def test_a_real_measurement_is_cached(cache):
    config = get_preset("tiny")
    achieved = mcal.cached_model_flops(config, 2, "fp32")
    assert 1e6 < achieved < 1e13
    assert mcal.cached_model_flops(config, 2, "fp32") == achieved  # from the cache


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--hardware", "dgx-a100"], "apply to --hardware local only"),
        ([], "apply to --hardware local only, not 'dgx-a100'"),  # the default hardware
        (["--hardware", "local", "--precision", "tf32"], "trains in fp32, bf16, fp16, not tf32"),
    ],
)
def test_unmeasurable_requests_are_refused(cache, capsys, options, message):
    argv = [a for a in ARGV if a not in ("--hardware", "local")]
    assert main([*argv, "--calibrate-model", *options]) == 2
    assert message in capsys.readouterr().err
    assert not mcal.efficiency_cache_path().exists()


def test_a_model_larger_than_the_device_is_refused_before_building_it():
    with pytest.raises(ConfigError, match="drop --calibrate-model for this model"):
        mcal.measurable(get_preset("gpt3-175b"), "bf16", torch.device("cpu"))
