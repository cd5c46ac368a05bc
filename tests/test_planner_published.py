"""Published throughput tables: every row loads, names its source and prices; the error's sign."""

import pytest

from interlace.bench import get_benchmark
from interlace.errors import ConfigError, PlanError
from interlace.models.config import GPTConfig
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.cost import estimate
from interlace.planner.hardware import get_hardware
from interlace.planner.published import (
    SOURCE_FIELDS,
    as_ran,
    compare,
    layouts,
    load_tables,
    megatron_flops_per_token,
    price,
    published_tokens_per_gpu_s,
    relative_error,
    shape,
    summarize,
)
from interlace.planner.search import check_plan

TABLES = load_tables()
ROWS = [(name, row) for name, t in TABLES.items() for row in t["rows"]]


def test_both_sources_are_there_with_their_rows():
    assert len(TABLES["megatron_lm"]["rows"]) == 9
    assert len(TABLES["torchtitan"]["rows"]) == 6


@pytest.mark.slow  # a second each: the large models' profiles
@pytest.mark.parametrize(("table", "row"), ROWS, ids=[f"{t}:{r['name']}" for t, r in ROWS])
def test_every_row_names_its_source_and_prices_on_its_gpus(table, row):
    source = TABLES[table]["source"]
    assert source["name"] and source["repository"] and source["note"].strip()
    assert all(row[k] for k in SOURCE_FIELDS)
    assert row["url"].startswith(f"https://github.com/{source['repository']}/blob/")
    assert row["commit"] in row["url"]
    cost = price(row)
    assert cost.n_devices == row["gpus"]
    assert cost.step_seconds > 0
    for field in ("dp", "dp_shard", "pp", "tp", "recompute", "sequence_parallel"):
        if field in row:
            assert getattr(cost.plan, field) == row[field]


def test_a_row_without_a_source_or_a_figure_is_refused():
    from interlace.planner import published

    row = {"name": "x", "url": "u", "commit": "c", "section": "s", "tokens_per_gpu_s": 1.0}
    published._check_row("f.toml", row)
    with pytest.raises(ConfigError, match="no commit"):
        published._check_row("f.toml", {**row, "commit": ""})
    with pytest.raises(ConfigError, match="one published figure"):
        published._check_row("f.toml", {**row, "tflops_per_gpu": 2.0})


def test_a_gated_row_is_priced_in_llamas_shape():
    llama8b = next(r for r in TABLES["torchtitan"]["rows"] if r["name"] == "llama3.1-8b fsdp8")
    spec = shape(llama8b)
    assert (spec.n_kv_heads, spec.ffn_dim, spec.feed_forward, spec.norm) == (
        8,
        14336,
        "swiglu",
        "rmsnorm",
    )
    assert spec.num_params() == get_preset("llama3-8b").num_params()  # 8,030,261,248
    assert (spec.n_heads, spec.n_layers, spec.vocab_size, spec.seq_len) == (32, 32, 128256, 8192)
    assert not spec.tie_embeddings and not spec.bias


def test_a_hand_checked_row_is_what_the_cost_model_gives():
    row = next(r for r in TABLES["megatron_lm"]["rows"] if r["name"] == "gpt-1.7b")
    spec = GPTConfig(
        vocab_size=131072,
        seq_len=4096,
        d_model=2048,
        n_layers=24,
        n_heads=16,
        d_ff=8192,
        tie_embeddings=False,
    )
    assert shape(row) == spec
    assert list(layouts(row)) == [Plan(dp=48, sequence_parallel=False)]
    cost = estimate(Plan(dp=48), spec, get_hardware("dgx-h100"), 192)
    result = compare(row)
    assert result["interlace_tokens_per_gpu_s"] == pytest.approx(
        192 * 4096 / cost.step_seconds / 48
    )
    # as Megatron ran it: the gradient all-reduce hidden, the optimizer step of 1/48 of the
    # parameters per rank
    b = cost.breakdown
    step = cost.step_seconds - b["dp.all_reduce"] - b["optimizer"] * (1 - 1 / 48)
    assert result["predicted_tokens_per_gpu_s"] == pytest.approx(192 * 4096 / step / 48)
    # Megatron's count: 72·L·h² + 12·L·h·s + 6·h·V per token; 408.8 TFLOP/s per GPU published.
    flops = 72 * 24 * 2048**2 + 12 * 24 * 2048 * 4096 + 6 * 2048 * 131072
    assert megatron_flops_per_token(row) == pytest.approx(flops)
    assert published_tokens_per_gpu_s(row) == pytest.approx(408.8e12 / flops)
    assert result["error"] == pytest.approx(
        result["predicted_tokens_per_gpu_s"] * flops / 408.8e12 - 1
    )


def test_unstated_pipeline_fields_are_the_fastest_choice():
    row = next(r for r in TABLES["megatron_lm"]["rows"] if r["name"] == "gpt-70b")
    plans = list(layouts(row))
    assert {p.micro_batches for p in plans} == {1, 2, 4, 8}  # 384 sequences / 48 ranks
    # interleaved: every count of virtual stages whose layers divide a rank's 84 / 2 = 42
    interleaved = {p.virtual_stages for p in plans if p.schedule == "interleaved"}
    assert interleaved == {2, 3, 6, 7, 14, 21, 42}
    spec, hardware = shape(row), get_hardware(row["hardware"])
    best = price(row)

    def as_run(cost):
        return cost.step_seconds + sum(as_ran(row, cost).values())

    for plan in plans:
        try:
            check_plan(plan, row["gpus"], spec)
        except PlanError:
            continue
        assert as_run(best) <= as_run(estimate(plan, spec, hardware, row["global_batch"]))


def test_megatron_hides_its_transfers_only_under_the_interleaved_schedule():
    row = next(r for r in TABLES["megatron_lm"]["rows"] if r["name"] == "gpt-70b")
    spec, hardware = shape(row), get_hardware(row["hardware"])
    for schedule, hidden in (("interleaved", True), ("1f1b", False)):
        plan = next(p for p in layouts(row) if p.schedule == schedule and p.micro_batches == 8)
        cost = estimate(plan, spec, hardware, row["global_batch"])
        changes = as_ran(row, cost)
        assert cost.breakdown["pp.send_recv"] > 0 and "pp.bubble" not in changes
        assert changes.get("pp.send_recv") == (-cost.breakdown["pp.send_recv"] if hidden else None)


def test_a_prediction_faster_than_published_is_a_positive_error():
    assert relative_error(110.0, 100.0) == pytest.approx(0.10)
    assert relative_error(80.0, 100.0) == pytest.approx(-0.20)
    stats = summarize([0.10, -0.20, 0.05])
    assert stats["median_abs_error"] == pytest.approx(0.10)
    assert stats["worst_error"] == pytest.approx(-0.20)
    assert stats["median_error"] == pytest.approx(0.05)
    assert (stats["rows"], stats["over"], stats["under"]) == (3, 2, 1)


def test_the_benchmark_writes_rows_and_a_summary_per_table(tmp_path):
    bench = get_benchmark("published")
    options = {"tables": "torchtitan"}
    bench.check(options)
    result = bench.run_local(options)
    assert [r["table"] for r in result["rows"]] == ["torchtitan"] * 6
    assert set(result["tables"]) == {"torchtitan"}
    doc = {"result": result}
    assert "torchtitan" in bench.table(doc) and "median |error|" in bench.headline(doc)
    with pytest.raises(ConfigError, match="unknown"):
        bench.check({"tables": "nope"})


def test_what_a_source_ran_differently_changes_its_terms_only():
    row = next(r for r in TABLES["torchtitan"]["rows"] if r["name"] == "llama3.1-8b fsdp8 tp8")
    cost = price(row)
    b = cost.breakdown
    assert as_ran(row, cost) == {"recomputed_matmuls": pytest.approx(0.5 * b["compute"] / 3)}
    overlapped = {**row, "overlapped": ["tp"], "sharded_optimizer": True}
    changes = as_ran(overlapped, cost)
    assert changes["tp.all_gather"] == -b["tp.all_gather"]
    assert changes["tp.reduce_scatter"] == -b["tp.reduce_scatter"]
    assert changes["optimizer"] == pytest.approx(-b["optimizer"] * (1 - 1 / cost.plan.dp_size))
    assert "dp_shard.all_gather" not in changes  # a group the source does not overlap


def test_eager_rows_are_listed_but_left_out_of_the_summary():
    result = get_benchmark("published").run_local({"tables": "torchtitan"})
    eager = [r for r in result["rows"] if not r["compiled"]]
    assert len(eager) == 2 and result["tables"]["torchtitan"]["rows"] == 4
