"""bench planner: its statistics against hand-computed values, and one tiny plan run for real
on 2 forked ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from interlace.bench import get_benchmark
from interlace.bench.base import RankContext
from interlace.bench.planner import run_rank, spearman, summarize
from interlace.comm import Group
from interlace.errors import ConfigError
from interlace.models.presets import get_preset
from interlace.planner.profile import model_profile
from interlace.testing import run_ranks


def test_spearman_hand_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (0,1,2,3) vs (1,0,2,3): 1 − 6·Σd²/(n(n²−1)) = 1 − 6·2/60 = 0.8
    assert spearman([1, 2, 3, 4], [2, 1, 3, 4]) == pytest.approx(0.8)
    assert spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)  # ties share a rank


def test_summarize_hand_values():
    runs = [
        {
            "model": "a",
            "plan": "x",
            "step_median_s": 1.0,
            "predicted_s": 1.1,
            "memory_bytes": 100.0,
            "predicted_memory_bytes": 90.0,
        },
        {
            "model": "a",
            "plan": "y",
            "step_median_s": 2.0,
            "predicted_s": 1.0,
            "memory_bytes": 100.0,
            "predicted_memory_bytes": 100.0,
        },
    ]
    s = summarize(runs)
    assert s["median_abs_rel_error"] == pytest.approx((0.1 + 0.5) / 2)
    assert s["memory_max_abs_rel_error"] == pytest.approx(0.1)
    assert s["best"]["a"] == {
        "predicted_best": "y",
        "measured_best": "x",
        "predicted_best_slower_by": 1.0,
    }
    assert s["best_within_5pct"] is False and s["spearman"] == pytest.approx(-1.0)


def _rank(options):
    group = Group("world", dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    return run_rank(RankContext(group, None, "lo", options))


def _tiny_options(**changes) -> dict:
    """The benchmark's options for one step of the tiny model's first plan, and `changes`."""
    options = get_benchmark("planner").options
    tiny = {"model": "tiny", "moe_model": "", "global_batch": 4, "steps": 1, "plans": 1}
    return {**options, **tiny, **changes}


def test_one_tiny_plan_runs_and_is_predicted():
    bench = get_benchmark("planner")
    options = _tiny_options()
    bench.check(options)
    result = run_ranks(2, _rank, options, timeout=120)[0]
    (run,) = result["runs"]
    config = get_preset("tiny")
    if options["seq_len"]:
        config = dataclasses.replace(config, seq_len=options["seq_len"])
    assert run["plan"] == "dp=2" and run["step_median_s"] > 0 and run["predicted_s"] > 0
    assert run["memory_bytes"] > run["state_bytes"] > 0
    assert result["calibration"]["link_bandwidth_Bps"] > 0
    # predicted at the matmul rate measured just before the plan ran
    assert run["matmul_flops"] > 0
    assert run["predicted_s"] == pytest.approx(
        dp2_step_by_hand(
            config, options["global_batch"], run["matmul_flops"], result["calibration"]
        ),
        rel=1e-9,
    )
    assert "1 plans" in bench.table({"result": result})
    with pytest.raises(ConfigError, match="steps=0"):
        bench.check({**options, "steps": 0})


def test_shapes_measured_on_a_grid_price_each_plan_a_second_time(monkeypatch):
    import interlace.bench.cluster_calibration as cc
    from interlace.planner.surface import RateSurface

    def uniform(dtype, threads, device=None):  # every shape 1.25 times the reference rate
        fast = 1.25e9
        return RateSurface(dtype, threads, "cpu", 1e9, (8, 64), (fast,) * 8, (8,), (8,), (fast,))

    monkeypatch.setattr(cc, "measure_surface", uniform)
    bench = get_benchmark("planner")
    result = run_ranks(2, _rank, _tiny_options(shapes=True), timeout=120)[0]
    (run,) = result["runs"]
    calibration = result["calibration"]
    # a uniform grid leaves the model's own step at one batch, at every size: its factor is
    # divided out of the model's efficiency
    at_one_point = {
        **calibration,
        "matmul_efficiency": calibration["model_efficiency"],
        "matmul_half_rows": 0.0,
    }
    expected = dp2_step_by_hand(get_preset("tiny"), 4, run["matmul_flops"], at_one_point)
    assert run["predicted_grid_s"] == pytest.approx(expected, rel=1e-9)
    assert result["summary_grid"]["plans"] == 1
    assert "shapes measured on a grid" in bench.table({"result": result})


def dp2_step_by_hand(config, global_batch: int, matmul_flops: float, calibration) -> float:
    """dp=2 on 2 ranks of one node, fp32, as calibrated: 3F FLOPs per token over each rank's
    tokens at matmul_flops · E · t / (t + h); the gradient all-reduce, 2 ring steps and as
    many wire bytes as its 4 bytes per parameter, stays exposed (the whole gradient is DDP's
    one bucket, the last); AdamW with clipping streams 32 bytes per parameter."""
    tokens = global_batch // 2 * config.seq_len
    efficiency = (
        calibration["matmul_efficiency"] * tokens / (tokens + calibration["matmul_half_rows"])
    )
    params = config.num_params()
    assert 4 * params <= 25 * 2**20  # one DDP bucket
    compute = (
        3 * model_profile(config).forward_flops_per_token * tokens / (matmul_flops * efficiency)
    )
    all_reduce = 2 * calibration["link_latency_s"] + 4 * params / calibration["link_bandwidth_Bps"]
    return compute + all_reduce + 32 * params / calibration["memory_bandwidth_Bps"]


NOMINAL_CALIBRATION = {
    "link_latency_s": 1e-5,
    "link_bandwidth_Bps": 1e9,
    "matmul_efficiency": 1.0,
    "matmul_half_rows": 0.0,
    "overlap_efficiency": 1.0,
    "memory_bandwidth_Bps": 1e10,
    "idle_speedup": 1.0,
}
"""Stands in for the calibration where only memory is checked: the memory model reads no rate."""


def _memory_rank(options, plans):
    import interlace.bench.planner as bench_planner

    # this forked rank's copies only
    bench_planner.DENSE_PLANS[2] = plans
    bench_planner._calibrate = lambda ctx: NOMINAL_CALIBRATION
    return _rank(options)


def test_memory_model_within_20_percent_of_real_runs():
    """Measured: parameters, gradients and AdamW state plus the peak of what autograd keeps
    (every storage once). Plans without recomputation: the meter cannot see what a
    checkpointed layer rebuilds inside its backward."""
    bench = get_benchmark("planner")
    options = {**bench.options, "moe_model": "", "global_batch": 8, "steps": 1}
    plans = ["dp=2", "tp=2", "pp=2,micro_batches=2"]
    result = run_ranks(2, _memory_rank, options, plans, timeout=180)[0]
    errors = {
        r["plan"]: r["predicted_memory_bytes"] / r["memory_bytes"] - 1 for r in result["runs"]
    }
    assert set(errors) == set(plans)
    assert all(abs(e) < 0.2 for e in errors.values()), errors
