"""The paper-scale planner benchmark: settings, baselines and the page section."""

import dataclasses

import pytest

from interlace.bench import scale
from interlace.bench.scale import BENCHMARK, Setting, megatron_tp, run_local
from interlace.errors import ConfigError
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.hardware import PRESETS
from interlace.planner.profile import model_profile


@pytest.mark.parametrize(
    ("per_node", "heads", "expected"), [(8, 25, 1), (8, 20, 4), (4, 80, 4), (8, 64, 8)]
)
def test_megatron_tp_is_the_largest_in_node_power_of_two_dividing_heads(per_node, heads, expected):
    assert megatron_tp(per_node, heads) == expected


def test_merak_settings_price_the_pick_and_a_megatron_style_baseline():
    doc = {"result": run_local({"groups": "merak"})}
    rows = doc["result"]["settings"]
    assert [r["name"] for r in rows] == ["gpt2-1.5b", "megatron-2.5b", "megatron-8.3b", "gpt-20b"]
    for row in rows:
        base = Plan.parse(row["baseline"]["plan"])
        assert base.recompute == "full" and base.schedule in ("1f1b", "interleaved")
        assert f"tp={base.tp} in node" in row["baseline_name"]
        assert row["best"]["step_seconds"] <= row["baseline"]["step_seconds"]
        assert row["speedup_vs_baseline"] >= 1
    assert "gpt-20b" in BENCHMARK.table(doc)


def test_speedup_of_a_tiny_setting_priced_by_hand(monkeypatch):
    """The tiny GPT on 2 devices of a DGX A100 node in bf16, 2 sequences of 64 tokens per
    step: the pick dp=2 and the baseline tp=2, each priced by hand (α = 5 µs and 300 GB/s per
    NVLink message, 75% of 312 TFLOP/s, AdamW streaming 32 bytes per parameter at 2039 GB/s)."""
    spec = get_preset("tiny")
    # the matmul shapes' tile and wave factor is priced by hand in test_planner_gemm.py
    monkeypatch.setitem(PRESETS, "dgx-a100", dataclasses.replace(PRESETS["dgx-a100"], sm_count=0))
    tiny = Setting(
        "merak", "tiny", spec, "dgx-a100", 2, 2, lambda c: str(c.plan) == "tp=2", "tp=2", None
    )
    monkeypatch.setattr(scale, "settings", lambda: [tiny])
    (row,) = run_local({"groups": "merak"})["settings"]
    flops, params = model_profile(spec).forward_flops_per_token, spec.num_params()
    rate, alpha, bandwidth = 0.75 * 312e12, 5e-6, 300e9

    def optimizer(device_params: float) -> float:
        return 32 * device_params / 2039e9

    # dp=2: 64 tokens per rank; one all-reduce of the fp32 gradients (one DDP bucket: exposed)
    dp = 3 * flops * 64 / rate + 2 * alpha + 4 * params / bandwidth + optimizer(params)
    # tp=2: 128 tokens, half the FLOPs; two all-reduces of the [128, 64] bf16 activation per
    # layer forward and two backward, one for the embedding and one for the head
    reduce = 2 * alpha + 128 * spec.d_model * 2 / bandwidth
    tp = 3 * flops * 128 / 2 / rate + (4 * spec.n_layers + 2) * reduce + optimizer(params / 2)
    assert row["best"]["plan"] == "dp=2" and row["baseline"]["plan"] == "tp=2"
    assert row["best"]["step_seconds"] == pytest.approx(dp, rel=1e-12)
    assert row["baseline"]["step_seconds"] == pytest.approx(tp, rel=1e-12)
    assert row["speedup_vs_baseline"] == pytest.approx(tp / dp, rel=1e-12)


def test_unknown_group_is_refused():
    with pytest.raises(ConfigError, match="unknown"):
        BENCHMARK.check({"groups": "merak,alpa"})
