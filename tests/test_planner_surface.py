"""Matmul and attention rates measured on a grid of shapes (`planner.surface`,
`planner.surface_measure`, `interlace plan --hardware local --calibrate`): reading the grid,
counting the measured FLOPs, pricing a step's matmuls and attention from it by hand, the cache,
and `--calibrate-model` measured relative to it."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from helpers import fake_calibration
from interlace.cli import main
from interlace.errors import ConfigError
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner import calibrate as cal
from interlace.planner import cli as planner_cli
from interlace.planner import model_calibration as mcal
from interlace.planner import surface_measure as sm
from interlace.planner.cost_pipeline import pipeline_stages
from interlace.planner.cost_work import stage_work
from interlace.planner.gemm import shape_efficiency, shape_model
from interlace.planner.hardware import PRESETS, local
from interlace.planner.profile import model_profile
from interlace.planner.surface import RateSurface

PEAK = 1e11


def surface(gemm=lambda m, n, k: PEAK, attention=lambda s, h: PEAK, dtype="fp32"):
    """A surface on sizes (32, 128, 512), sequences (64, 256), head widths (16, 32), its rates
    from `gemm(m, n, k)` and `attention(seq, head_dim)`; reference PEAK."""
    sizes, seqs, heads = (32, 128, 512), (64, 256), (16, 32)
    return RateSurface(
        dtype=dtype,
        threads=1,
        device="cpu",
        reference=PEAK,
        sizes=sizes,
        gemm=tuple(gemm(m, n, k) for m in sizes for n in sizes for k in sizes),
        seqs=seqs,
        head_dims=heads,
        attention=tuple(attention(s, h) for s in seqs for h in heads),
    )


def test_the_grid_is_read_exactly_at_its_points_log_linearly_between_and_clamped_outside():
    grid = surface(gemm=lambda m, n, k: m * 1e6 + n * 1e3 + k, attention=lambda s, h: s * h)
    assert grid.gemm_factor(128, 32, 512) * PEAK == pytest.approx(128e6 + 32e3 + 512)
    # halfway in log2 between m = 32 and 128 (m = 64): the geometric mean of both rates
    expected = math.sqrt((32e6 + 32e3 + 32) * (128e6 + 32e3 + 32))
    assert grid.gemm_factor(64, 32, 32) * PEAK == pytest.approx(expected)
    assert grid.gemm_factor(4, 10**6, 512) == grid.gemm_factor(32, 512, 512)  # clamped
    assert grid.attention_factor(128, 16) * PEAK == pytest.approx(math.sqrt(64 * 16 * 256 * 16))
    assert grid.attention_factor(8192, 64) * PEAK == pytest.approx(256 * 32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sizes": (128, 32, 512)}, "each axis must rise strictly"),
        ({"gemm": (1.0,) * 26}, "26 rates for a grid of 3 x 3 x 3"),
        ({"attention": (1.0, 1.0, 0.0, 1.0)}, "every rate must be > 0"),
    ],
)
def test_a_malformed_surface_is_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(surface(), **change)
    with pytest.raises(ConfigError, match="not a rate surface"):
        RateSurface.from_dict({"dtype": "fp32"})


def test_a_surface_stands_in_for_tile_quantisation_in_its_own_dtype_only():
    h100 = dataclasses.replace(
        PRESETS["dgx-h100"], surface=surface(gemm=lambda m, n, k: PEAK / 2, dtype="bf16")
    )
    assert shape_model(h100, "bf16")(4096, 4096, 4096) == pytest.approx(0.5)
    tiles = shape_model(h100, "fp32")
    assert tiles(256, 256, 256) == shape_efficiency(256, 256, 256, 132) < 1


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_steps_matmuls_and_attention_are_priced_at_the_measured_rates(recompute):
    config = get_preset("tiny")
    plan = Plan(recompute=recompute)
    stage = pipeline_stages(model_profile(config), plan)[0]
    tokens = 8 * config.seq_len
    # matmuls at 0.8 of the reference everywhere on the grid, attention at 0.25
    measured = surface(gemm=lambda m, n, k: 0.8 * PEAK, attention=lambda s, h: 0.25 * PEAK)
    hardware = dataclasses.replace(local(PEAK, 1e9), surface=measured)
    work = stage_work(plan, config, stage, tokens, hardware, "fp32")
    attention = stage.n_layers * 4 * config.seq_len * config.n_heads * config.head_dim
    matmuls = stage.flops - attention
    assert work.compute == pytest.approx(
        3 * tokens * (matmuls / (0.8 * PEAK) + attention / (0.25 * PEAK))
    )
    replayed = stage.recompute_flops
    assert (replayed > 0) == (recompute == "full")
    replayed_attention = attention * stage.n_checkpointed / stage.n_layers
    assert work.recompute == pytest.approx(
        tokens
        * ((replayed - replayed_attention) / (0.8 * PEAK) + replayed_attention / (0.25 * PEAK))
    )
    unmeasured = stage_work(plan, config, stage, tokens, local(PEAK, 1e9), "fp32")
    assert unmeasured.compute == pytest.approx(3 * tokens * stage.flops / PEAK)


def test_the_measured_flops_are_counted_as_the_cost_model_counts_them(monkeypatch):
    monkeypatch.setattr(sm, "best_seconds", lambda *args: 1.0)
    monkeypatch.setattr(cal, "best_seconds", lambda *args: 1.0)
    grid = sm.measure_surface(
        "fp32", 1, torch.device("cpu"), sizes=(8, 16), seqs=(16, 32), head_dims=(8,)
    )
    assert grid.gemm == tuple(2 * m * n * k for m in (8, 16) for n in (8, 16) for k in (8, 16))
    heads = sm.ATTENTION_WIDTH["cpu"] // 8
    # 3 · 4 · T · w FLOPs for each of batch · T tokens, batch · T = ATTENTION_TOKENS
    assert grid.attention == tuple(
        3 * 4 * seq * heads * 8 * sm.ATTENTION_TOKENS["cpu"] for seq in (16, 32)
    )
    assert grid.reference == 2 * math.prod(cal.MATMUL_SHAPES["cpu"])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cached machine calibration (no measuring); surfaces measured as `surface()` would,
    counted; runs priced as on the CPU (its dtype and threads), also where CUDA is present."""
    path = tmp_path / "hw.json"
    monkeypatch.setenv(cal.CACHE_ENV, str(path))
    path.write_text(json.dumps(fake_calibration().to_dict()))
    calls = []

    def measured(dtype, threads, device=None):
        calls.append((dtype, threads))
        return dataclasses.replace(
            surface(dtype=dtype, attention=lambda s, h: PEAK / 4), threads=threads
        )

    monkeypatch.setattr(sm, "measure_surface", measured)
    cpu = lambda: torch.device("cpu")  # noqa: E731 - priced as a CPU run on any machine
    monkeypatch.setattr(sm, "default_device", cpu)
    monkeypatch.setattr(planner_cli, "default_device", cpu)
    return calls


ARGV = ["plan", "--model", "tiny", "--hardware", "local", "--plan", "dp=1", "--json"]


def _plan(capsys, *options: str) -> dict:
    assert main([*ARGV, "--global-batch", "8", *options]) == 0
    return json.loads(capsys.readouterr().out)["plans"][0]


def test_calibrate_measures_once_per_dtype_and_prices_attention_slower(cache, capsys):
    plain = _plan(capsys)
    calibrated = _plan(capsys, "--calibrate")
    assert calibrated["breakdown"]["compute"] > plain["breakdown"]["compute"]
    assert "measured on a grid" in calibrated["rates"]["compute"]["shapes"]
    _plan(capsys, "--calibrate")
    _plan(capsys, "--calibrate", "--precision", "bf16")
    _plan(capsys, "--calibrate", "--recalibrate")
    threads = cal.threads_per_rank(1)
    assert cache == [("fp32", threads), ("bf16", threads), ("fp32", threads)]


def test_calibrate_model_is_measured_relative_to_the_surface(cache, capsys, monkeypatch):
    calibration = cal.Calibration(**json.loads(cal.cache_path().read_text()))
    rate = calibration.flops_for_threads(cal.threads_per_rank(1), "fp32")
    monkeypatch.setattr(mcal, "measure_model_flops", lambda *a, **k: rate / 8)
    model = _plan(capsys, "--calibrate-model")["breakdown"]["compute"]
    both = _plan(capsys, "--calibrate-model", "--calibrate")
    # at the measured batch both price the measured step; the surface only moves other shapes
    assert both["breakdown"]["compute"] == pytest.approx(model)
    assert "relative to it" in both["rates"]["compute"]["source"]


def test_calibrate_is_refused_off_local(cache, capsys):
    argv = [a for a in ARGV if a not in ("--hardware", "local")]
    assert main([*argv, "--hardware", "dgx-h100", "--calibrate"]) == 2
    assert "apply to --hardware local only, not 'dgx-h100'" in capsys.readouterr().err
    assert cache == [] and not sm.surface_cache_path().exists()
