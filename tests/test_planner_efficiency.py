"""Matmul efficiency by rows: the curve, the compute terms priced at the rows each matmul sees
(micro-batch, sub-batch, expert), the fit of `matmul_half_rows`, and bad values refused."""

import dataclasses

import pytest

from interlace.bench.cluster_calibration import cluster_hardware
from interlace.errors import ConfigError
from interlace.models.config import GPTConfig
from interlace.models.presets import get_preset
from interlace.plan import Overlap, Plan
from interlace.planner.calibrate import fit_half_rows
from interlace.planner.cost import estimate
from interlace.planner.gemm import layer_shape_efficiency, shape_model
from interlace.planner.hardware import PRESETS, get_hardware, local
from interlace.planner.profile import model_profile

TINY = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4)
D, V, T = 64, 256, 64
LAYER_FLOPS = 2 * 12 * D * D + 4 * T * D  # q,k,v,out + MLP matmuls, plus q·kᵀ and attn·v
HEAD_FLOPS = 2 * D * V  # tied LM head
RATE = 1e12


def hw(half_rows: float = 0.0, efficiency: float = 1.0):
    """Peak RATE, fast links (compute is what is checked), the given curve."""
    base = local(RATE, 1e12, latency=0.0, devices_per_node=8, dtype="bf16")
    return dataclasses.replace(
        base, matmul_efficiency=efficiency, matmul_half_rows=float(half_rows)
    )


def test_curve_hand_values():
    h = hw(half_rows=256, efficiency=0.8)
    assert h.efficiency(256) == pytest.approx(0.4)  # half of 0.8 at m = half_rows
    assert h.efficiency(768) == pytest.approx(0.8 * 768 / 1024)
    assert h.efficiency() == 0.8  # a large matmul
    assert h.matmul_flops("bf16", 256) == pytest.approx(0.4 * RATE)
    flat = hw(efficiency=0.8)
    assert flat.efficiency(1) == flat.efficiency(10**6) == 0.8
    assert all(p.matmul_half_rows == 0 for p in PRESETS.values())


def test_a_dtype_measured_apart_has_its_own_efficiency_on_the_same_curve():
    h = dataclasses.replace(hw(half_rows=256, efficiency=0.8), efficiency_by_dtype={"bf16": 0.4})
    assert h.efficiency(256, "bf16") == pytest.approx(0.2)  # half of bf16's 0.4
    assert h.efficiency(256, "fp32") == h.efficiency(256) == pytest.approx(0.4)  # half of 0.8
    assert h.matmul_flops("bf16") == pytest.approx(0.4 * RATE)
    with pytest.raises(ConfigError, match=r"efficiency_by_dtype\[bf16\]=1.5 must be in \(0, 1\]"):
        dataclasses.replace(h, efficiency_by_dtype={"bf16": 1.5})


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_half_rows_is_refused(bad):
    with pytest.raises(ConfigError, match=r"matmul_half_rows=.* must be a finite number >= 0"):
        hw(half_rows=bad)


def test_zero_half_rows_prices_compute_as_a_constant_efficiency():
    tokens = 4 * T  # 4 sequences, one micro-batch
    whole = 3 * (2 * LAYER_FLOPS + HEAD_FLOPS) * tokens
    flat = hw(efficiency=0.5)
    assert estimate(Plan(), TINY, flat, 4).breakdown["compute"] == pytest.approx(
        whole / (0.5 * RATE), rel=1e-12
    )
    sub = estimate(Plan(tp=2, overlap=Overlap(tp_subbatches=2)), TINY, flat, 4)
    assert sub.breakdown["compute"] == pytest.approx(whole / 2 / (0.5 * RATE), rel=1e-12)
    moe = get_preset("moe-tiny")
    cost = estimate(Plan(dp=2, ep=2), moe, flat, 4)
    flops = 3 * model_profile(moe).forward_flops_per_token * 2 * T
    assert cost.breakdown["compute"] == pytest.approx(flops / (0.5 * RATE), rel=1e-12)


def test_micro_batch_rows_set_the_rate():
    h = 128
    tokens = 4 * T  # 256 rows: efficiency 256 / 384
    cost = estimate(Plan(), TINY, hw(half_rows=h), 4)
    expected = 3 * (2 * LAYER_FLOPS + HEAD_FLOPS) * tokens / (RATE * tokens / (tokens + h))
    assert cost.breakdown["compute"] == pytest.approx(expected)
    # 3D tensor parallelism: z = 2 halves every matmul's rows (and the replicated ends' FLOPs)
    three = estimate(Plan(tp3d=(1, 1, 2)), TINY, hw(half_rows=h), 4)
    rows = tokens / 2
    expected = 3 * (2 * LAYER_FLOPS + HEAD_FLOPS) / 2 * tokens / (RATE * rows / (rows + h))
    assert three.breakdown["compute"] == pytest.approx(expected)


def test_tp_subbatches_run_the_layers_on_half_the_rows():
    """h = 128, 256 tokens: the head at 1/rate(256) = 1.5 / RATE per FLOP, the split layers at
    1/rate(128) = 2 / RATE."""
    curve = hw(half_rows=128)
    one = estimate(Plan(tp=2), TINY, curve, 4).breakdown["compute"]
    two = estimate(Plan(tp=2, overlap=Overlap(tp_subbatches=2)), TINY, curve, 4)
    layers, head = 2 * LAYER_FLOPS, HEAD_FLOPS
    ratio = (2 * layers + 1.5 * head) / (1.5 * (layers + head))
    assert two.breakdown["compute"] / one == pytest.approx(ratio)
    assert 1 < ratio < 4 / 3  # 4/3 if every FLOP were in the layers


def test_experts_compute_at_their_share_of_the_tokens():
    """moe-tiny (4 experts, top-2, one MoE layer), dp=2: 128 tokens per device; an expert sees
    128 · 2 / 4 = 64 rows without ep and 64 · 2 = 128 with ep=2."""
    moe = get_preset("moe-tiny")
    h, tokens = 64, 2 * T
    curve = hw(half_rows=h)
    per_token = model_profile(moe).forward_flops_per_token
    expert = 2 * 4 * D * moe.ffn_dim  # top_k · two d × ffn matmuls, forward

    def inverse(rows: float) -> float:
        return (rows + h) / (RATE * rows)

    dp = estimate(Plan(dp=2), moe, curve, 4).breakdown["compute"]
    expected = 3 * tokens * ((per_token - expert) * inverse(128) + expert * inverse(64))
    assert dp == pytest.approx(expected)
    ep = estimate(Plan(dp=2, ep=2), moe, curve, 4).breakdown["compute"]
    assert ep == pytest.approx(3 * tokens * per_token * inverse(128))


@pytest.mark.parametrize(("efficiency", "half_rows"), [(0.6, 300.0), (0.9, 40.0), (1.0, 1000.0)])
def test_fit_recovers_a_known_curve(efficiency, half_rows):
    samples = [(m, efficiency * m / (m + half_rows)) for m in (2048, 1024, 512)]
    fitted = fit_half_rows(samples)
    assert fitted == pytest.approx((efficiency, half_rows))


def test_fit_edge_cases_and_errors():
    # points above any curve with E <= 1 are fitted with E = 1: 1/e − 1 = h/m through 0
    e, h = fit_half_rows([(1000, 1.25 * 1000 / 2000), (2000, 1.25 * 2000 / 3000)])
    xs, ys = [1 / 1000, 1 / 2000], [2000 / 1250 - 1, 3000 / 2500 - 1]
    assert e == 1.0
    assert h == pytest.approx(
        sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    )
    # efficiency falling with m: no half rows, the harmonic mean
    assert fit_half_rows([(100, 0.5), (200, 0.25)]) == pytest.approx((1 / 3, 0.0))
    with pytest.raises(ConfigError, match="two distinct row counts"):
        fit_half_rows([(100, 0.5), (100, 0.6)])
    with pytest.raises(ConfigError, match=r"in \(0, 1\]"):
        fit_half_rows([(100, 0.5), (200, 1.5)])


def test_bench_hardware_carries_the_fitted_curve():
    calibration = {
        "link_bandwidth_Bps": 1e9,
        "link_latency_s": 1e-4,
        "memory_bandwidth_Bps": 1e10,
        "idle_speedup": 1.2,
        "matmul_efficiency": 0.7,
        "matmul_half_rows": 512.0,
        "overlap_efficiency": 0.5,
    }
    hardware = cluster_hardware(calibration, 2, 5e10)
    assert hardware.matmul_half_rows == 512.0 and hardware.matmul_efficiency == 0.7
    assert hardware.matmul_flops("fp32", 512) == pytest.approx(5e10 * 0.35)


def test_the_h100_preset_prices_a_narrow_models_step_at_its_measured_efficiency():
    # bf16 compiled steps measured on one H100: gpt2-124m (d 768) 34.8 %, gpt2-1.5b (d 1600)
    # 40.6 % of the bf16 peak; fp32 has no width law
    h100 = get_hardware("dgx-h100")
    assert h100.efficiency(None, "bf16", 768) == pytest.approx(0.348, abs=0.002)
    assert h100.efficiency(None, "bf16", 1600) == pytest.approx(0.406, abs=0.002)
    assert h100.efficiency(None, "bf16", 20480) == pytest.approx(0.48 * 20480 / 20771)
    assert h100.efficiency(None, "fp32", 768) == h100.efficiency(None, "fp32")
    with pytest.raises(ConfigError, match="width_half_by_dtype"):
        dataclasses.replace(h100, width_half_by_dtype={"bf16": -1.0})


def test_a_steps_compute_is_priced_at_its_models_width():
    from interlace.planner.cost_pipeline import pipeline_stages
    from interlace.planner.cost_work import stage_work

    h100, plan = get_hardware("dgx-h100"), Plan()
    for name in ("gpt2-124m", "gpt2-1.5b"):
        config = get_preset(name)
        stage = pipeline_stages(model_profile(config), plan)[0]
        work = stage_work(plan, config, stage, 8192, h100, "bf16")
        shapes = layer_shape_efficiency(plan, config, 8192, shape_model(h100, "bf16"))
        assert work.shape_factor == shapes < 1
        efficiency = h100.efficiency(8192, "bf16", config.d_model)
        assert work.rate == pytest.approx(989e12 * efficiency * shapes)
        assert work.compute == pytest.approx(3 * stage.flops * 8192 / work.rate)


def test_explain_gives_each_rate_with_where_it_came_from():
    from helpers import fake_calibration
    from interlace.planner.calibrate import hardware_from
    from interlace.planner.search import explain

    config = get_preset("gpt2-124m")
    h100 = estimate(Plan(dp=8), config, get_hardware("dgx-h100"), 64)
    shapes = layer_shape_efficiency(
        Plan(dp=8), config, 8 * 1024, shape_model(get_hardware("dgx-h100"), "bf16")
    )
    rate = 989e12 * get_hardware("dgx-h100").efficiency(8 * 1024, "bf16", 768) * shapes
    assert h100.rates["compute"]["flops"] == pytest.approx(rate)
    text = explain(h100)
    assert f"compute {rate / 1e12:.4g} TFLOP/s" in text
    assert f"matmul shapes {shapes:.1%} of it (tile and wave quantisation on 132 SMs" in text
    assert "measured on one H100" in text and "datasheet link rates" in text
    local = estimate(Plan(dp=2), config, hardware_from(fake_calibration(), 2), 8, dtype="fp32")
    assert set(local.rates) == {"compute", "links", "overlap", "memory"}
    assert {r["source"] for r in local.rates.values()} == {"calibrated on this machine (cached)"}
    assert "calibrated on this machine" in explain(local)
