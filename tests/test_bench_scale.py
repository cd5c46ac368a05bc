"""The paper-scale planner benchmark: settings, baselines and the page section."""

import pytest

from interlace.bench.scale import BENCHMARK, megatron_tp, run_local
from interlace.errors import ConfigError
from interlace.plan import Plan


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
        assert row["speedup_vs_baseline"] == pytest.approx(
            row["baseline"]["step_seconds"] / row["best"]["step_seconds"]
        )
    assert "gpt-20b" in BENCHMARK.table(doc)


def test_unknown_group_is_refused():
    with pytest.raises(ConfigError, match="unknown"):
        BENCHMARK.check({"groups": "merak,alpa"})
