"""The seed papers' gains at their own settings: agreement with a published figure or range,
Megatron-LM's replayed reductions priced as it runs them, each group's technique and baseline
plans, and bad groups refused."""

from __future__ import annotations

import pytest

from interlace.bench import seed_settings
from interlace.bench.seed_settings import _megatron_replays_reductions, _oases_setting, agreement
from interlace.bench.seeds import BENCHMARK, run_local
from interlace.errors import ConfigError
from interlace.models.config import GPTConfig
from interlace.plan import Plan


@pytest.mark.parametrize(
    ("gain", "published", "expected"),
    [(1.2, (1.01, 1.5), 0.0), (2.0, (1.6, 1.6), 0.25), (0.5, (1.0, 2.0), -0.5), (3.0, (1, 2), 0.5)],
)
def test_agreement_is_the_distance_from_the_published_range(gain, published, expected):
    assert agreement(gain, published) == pytest.approx(expected)


def test_megatron_repeats_each_layers_two_forward_all_reduces_in_its_replay():
    spec = GPTConfig(vocab_size=128, seq_len=1024, d_model=1024, n_layers=24, n_heads=16)
    cost = next(_oases_setting(spec, "recompute=full"))
    assert str(cost.plan) == "dp=16,tp=2,micro_batches=20,recompute=full"
    replayed = _megatron_replays_reductions(cost, 24)
    # 4 all-reduces a layer plus the embedding's and the head's: 98; Megatron adds 48
    extra = cost.breakdown["tp.all_reduce"] * 48 / 98
    assert replayed.breakdown["tp.all_reduce"] == pytest.approx(
        cost.breakdown["tp.all_reduce"] + extra
    )
    assert replayed.step_seconds == pytest.approx(cost.step_seconds + extra)
    assert replayed.mfu == pytest.approx(cost.mfu * cost.step_seconds / replayed.step_seconds)


def test_prophet_is_compared_with_shadowing_and_dropless_on_the_same_layout():
    doc = {"result": run_local({"groups": "prophet"})}
    rows = doc["result"]["rows"]
    assert len(rows) == 12
    for r in rows:
        technique, baseline = Plan.parse(r["technique"]["plan"]), Plan.parse(r["baseline"]["plan"])
        assert technique.moe_balance == "prophet" and technique.ep == technique.dp
        assert baseline.moe_balance == ("shadow" if "FasterMoE" in r["name"] else "dropless")
        assert (baseline.ep, baseline.dp) == (technique.ep, technique.dp)
        assert r["gain"] == pytest.approx(
            r["baseline"]["step_seconds"] / r["technique"]["step_seconds"]
        )
        assert r["within"] == (abs(r["error"]) <= seed_settings.TOLERANCE)
    assert "moe-gpt-L on 32 vs DeepSpeed-MoE" in BENCHMARK.table(doc)
    assert "prophet: " in BENCHMARK.headline(doc)


@pytest.mark.slow
def test_oases_and_merak_toggle_their_techniques_on_a_megatron_layout():
    rows = run_local({"groups": "oases,merak"})["rows"]
    assert [r["group"] for r in rows] == ["oases"] * 7 + ["merak"] * 4
    for r in rows:
        technique, baseline = Plan.parse(r["technique"]["plan"]), Plan.parse(r["baseline"]["plan"])
        assert baseline.overlap.tp_subbatches == 1 and baseline.recompute == "full"
        if r["group"] == "oases":
            assert technique.overlap.tp_subbatches == 2 and technique.pp == baseline.pp == 1
        else:
            assert (technique.dp, technique.pp, technique.tp) == (
                baseline.dp,
                baseline.pp,
                baseline.tp,
            )
            assert technique.schedule == "shifted" and technique.recompute == "stage-aware"
        assert r["gain"] > 1


def test_an_unknown_group_is_refused():
    with pytest.raises(ConfigError, match=r"groups \['megatron'\] unknown"):
        BENCHMARK.check({"groups": "oases,megatron"})
