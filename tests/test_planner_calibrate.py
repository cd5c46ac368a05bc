"""Calibration of this machine: the link fit, the cache and its fingerprint, `local` hardware,
and one real (short) measurement."""

from __future__ import annotations

import json
import os

import pytest

from helpers import fake_calibration
from interlace.cli import main
from interlace.errors import ConfigError
from interlace.planner import calibrate as cal
from interlace.planner import model_calibration as mcal
from interlace.planner.hardware import get_hardware


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "hw.json"
    monkeypatch.setenv(cal.CACHE_ENV, str(path))
    return path


def test_fit_link_recovers_alpha_and_bandwidth():
    # 2 ranks: t = 2·α + n / bandwidth (wire bytes of a 2-rank all_reduce = n)
    alpha, bandwidth = 3e-5, 2e9
    samples = [(n, 2 * alpha + n / bandwidth) for n in (1_000, 10_000, 100_000, 1_000_000)]
    got_alpha, got_bw = cal.fit_link(samples)
    assert got_alpha == pytest.approx(alpha, rel=1e-6)
    assert got_bw == pytest.approx(bandwidth, rel=1e-6)
    # 4 ranks: 6 messages, wire bytes 1.5 n
    samples = [(n, 6 * alpha + 1.5 * n / bandwidth) for n in (1_000, 100_000, 1_000_000)]
    assert cal.fit_link(samples, 4) == pytest.approx((alpha, bandwidth), rel=1e-6)
    with pytest.raises(ConfigError, match="no growth"):
        cal.fit_link([(1_000, 1e-3), (2_000, 1e-3)])


def test_flops_for_threads_and_hardware_from():
    c = fake_calibration()
    assert c.flops_for_threads(1) == 5e10
    assert c.flops_for_threads(2) == 9e10
    assert c.flops_for_threads(8) == 9e10  # the nearest measured count below
    assert c.flops_for_threads(2, "bf16") == 3e11
    with pytest.raises(ConfigError, match="no fp16 matmul rate"):
        c.flops_for_threads(1, "fp16")
    hw = cal.hardware_from(c, ranks=1)
    threads = cal.threads_per_rank(1)
    assert hw.matmul_flops("fp32") == c.flops_for_threads(threads)
    assert hw.matmul_flops("bf16") == c.flops_for_threads(threads, "bf16")
    assert hw.memory_bytes == 8e9
    hw2 = cal.hardware_from(c, ranks=2, bandwidth=125e6)
    assert hw2.memory_bytes == 4e9
    assert hw2.link(True) == (1e-4, 125e6)
    assert hw2.memory_bandwidth == c.bandwidth_for_threads(cal.threads_per_rank(2))
    assert hw2.devices_per_node == 2
    with pytest.raises(ConfigError, match="ranks=0"):
        cal.hardware_from(c, ranks=0)


def test_cache_reused_until_fingerprint_changes_or_recalibrate(cache, monkeypatch):
    calls = []

    def fake_measure():
        calls.append(1)
        return fake_calibration(link_bandwidth=1e9 + len(calls))

    monkeypatch.setattr(cal, "measure", fake_measure)
    first = cal.calibrate()
    assert len(calls) == 1 and json.loads(cache.read_text())["link_bandwidth"] == 1e9 + 1
    assert cal.calibrate() == first and len(calls) == 1  # from the cache
    assert cal.calibrate(recalibrate=True).link_bandwidth == 1e9 + 2
    stale = json.loads(cache.read_text())
    stale["fingerprint"]["torch"] = "0.0"
    cache.write_text(json.dumps(stale))
    assert cal.calibrate().link_bandwidth == 1e9 + 3  # machine changed: measured again
    cache.write_text("{not json")
    assert cal.calibrate().link_bandwidth == 1e9 + 4
    assert len(calls) == 4


def test_local_hardware_reads_the_cache(cache):
    cache.write_text(json.dumps(fake_calibration().to_dict()))
    hw = cal.local_hardware(2)
    assert hw.name == "local"
    assert hw.matmul_flops("fp32") == fake_calibration().flops_for_threads(cal.threads_per_rank(2))
    with pytest.raises(ConfigError, match="local"):
        get_hardware("nope")
    with pytest.raises(ConfigError, match="local_hardware"):
        get_hardware("local")  # measured, not a preset


def test_plan_cli_on_local_hardware(cache, capsys):
    cache.write_text(json.dumps(fake_calibration().to_dict()))
    argv = ["plan", "--model", "tiny", "--hardware", "local", "--global-batch", "8"]
    assert main([*argv, "--plan", "dp=2", "--bandwidth", "1gbit", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["hardware"] == "local" and doc["plans"][0]["plan"] == "dp=2"
    assert main([*argv, "--search", "--gpus", "2", "--runnable-only"]) == 0
    assert "local" in capsys.readouterr().out
    bad = ["plan", "--model", "tiny", "--plan", "dp=2", "--hardware", "dgx-a100"]
    assert main([*bad, "--bandwidth", "1gbit"]) == 2
    assert "apply to --hardware local only" in capsys.readouterr().err


def test_measure_times_matmuls_in_every_priced_dtype(monkeypatch):
    """The calibration measures the matmul rate of fp32 and bf16 at every thread count, on the
    device runs compute on, and `local` hardware prices each dtype at its own rate."""
    rates = {"fp32": 1e10, "bf16": 4e10}
    calls = []

    def fake_matmul(threads, min_seconds=0.3, dtype="fp32", device=None):
        calls.append((threads, dtype, device.type))
        return rates[dtype] * threads

    monkeypatch.setattr(cal, "_loopback", lambda *a, **k: ([(2**12, 1e-4), (2**20, 1e-3)], 0.5))
    monkeypatch.setattr(cal, "measure_matmul_flops", fake_matmul)
    monkeypatch.setattr(cal, "measure_optimizer_bandwidth", lambda threads, device=None: 1e10)
    measured = cal.measure()
    counts = sorted({cal.threads_per_rank(r) for r in range(1, (os.cpu_count() or 1) + 1)})
    assert measured.matmul_flops == {
        dtype: {str(t): rate * t for t in counts} for dtype, rate in rates.items()
    }
    assert {device for _, _, device in calls} == {"cpu"}  # the tests' ranks are pinned to it
    hw = cal.hardware_from(measured, ranks=1)
    threads = cal.threads_per_rank(1)
    assert hw.matmul_flops("bf16") == pytest.approx(4 * hw.matmul_flops("fp32"))
    assert hw.matmul_flops("fp32") == rates["fp32"] * threads


def test_plan_on_local_hardware_prices_the_precision_at_its_measured_rate(cache, capsys):
    """Without --dtype a local plan is priced in training's default precision (fp32 on the
    CPU); --precision bf16 prices the same step's compute at the measured bf16 rate."""
    cache.write_text(json.dumps(fake_calibration().to_dict()))
    argv = ["plan", "--model", "tiny", "--hardware", "local", "--plan", "dp=1", "--json"]
    computes = {}
    for option in ([], ["--precision", "fp32"], ["--precision", "bf16"]):
        assert main([*argv, "--global-batch", "8", *option]) == 0
        computes[" ".join(option)] = json.loads(capsys.readouterr().out)["plans"][0]["breakdown"]
    assert computes[""] == computes["--precision fp32"]
    calibration, threads = fake_calibration(), cal.threads_per_rank(1)
    speedup = calibration.flops_for_threads(threads, "bf16") / calibration.flops_for_threads(
        threads, "fp32"
    )
    assert computes["--precision fp32"]["compute"] == pytest.approx(
        speedup * computes["--precision bf16"]["compute"]
    )


def test_real_shortfake_calibration():
    for dtype in cal.CALIBRATED_DTYPES:
        flops = cal.measure_matmul_flops(1, min_seconds=0.05, dtype=dtype)
        assert 1e8 < flops < 1e13
    alpha, bandwidth = cal.measure_loopback_link((16 * 2**10, 1 * 2**20, 8 * 2**20), 3)
    assert 0 <= alpha < 0.05
    assert 1e6 < bandwidth < 1e12


def test_model_efficiency_is_the_step_rate_over_the_matmul_rate(monkeypatch):
    from interlace.models.presets import get_preset

    tiny = get_preset("tiny")
    efficiency = mcal.measure_model_efficiency(tiny, rows=2, threads=1, min_seconds=0.05)
    assert 0 < efficiency <= 1
    # against a matmul rate a thousand times higher, the same step reaches a thousandth of it
    measured = cal.measure_matmul_flops(1)
    monkeypatch.setattr(mcal, "measure_matmul_flops", lambda threads: 1000 * measured)
    slower = mcal.measure_model_efficiency(tiny, rows=2, threads=1, min_seconds=0.05)
    assert slower < efficiency / 100


def test_overlap_is_measured_between_two_ranks():
    from interlace.testing import run_ranks

    def rank() -> float:
        import torch.distributed as dist

        from interlace.comm import Group

        world = Group("world", dist.group.WORLD, 2, dist.get_rank())
        return cal.measure_overlap(world, seconds=0.01, repeats=3)

    fractions = run_ranks(2, rank)
    assert all(0 <= f <= 1 for f in fractions)


def test_hidden_fraction_formula():
    assert cal.hidden_fraction(1.0, 1.0, 2.0) == 0.0  # serialised
    assert cal.hidden_fraction(1.0, 0.5, 1.0) == 1.0  # the shorter one vanished
    assert cal.hidden_fraction(1.0, 0.5, 1.25) == pytest.approx(0.5)


def test_optimizer_bandwidth_is_measured():
    bandwidth = cal.measure_optimizer_bandwidth(1, params=2**16, min_seconds=0.02)
    assert 1e7 < bandwidth < 1e13
