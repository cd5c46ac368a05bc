"""The pipeline partitioner and stage-aware recomputation, no ranks needed: the dynamic program
equals brute force, layer costs come from parameter shapes, overrides and bad names are handled,
the stage table and the CLI's layout read a meta model (GPT, HF GPT-2 and Llama), and
stage-aware recomputation follows Merak's formula."""

import dataclasses
import itertools
import math
import random

import pytest

from helpers import tiny_config
from interlace.errors import PlanError
from interlace.models.gpt import build_model
from interlace.models.presets import get_preset
from interlace.parallel.pipeline.layout import pipeline_layout
from interlace.parallel.pipeline.partition import (
    balance,
    describe_stages,
    micro_batches_in_flight,
    model_shards,
    partition,
)
from interlace.parallel.pipeline.recompute import (
    checkpointed_layers,
    ratio_for_budget,
    recompute_ratios,
    stage_aware_ratios,
)
from interlace.plan import Plan


def _brute_force(costs, n_stages, first, last, scale):
    n, best = len(costs), math.inf
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        edges = (0, *cuts, n)
        worst = max(
            scale[s] * sum(costs[a:b])
            + (first if s == 0 else 0)
            + (last if s == n_stages - 1 else 0)
            for s, (a, b) in enumerate(itertools.pairwise(edges))
        )
        best = min(best, worst)
    return best


def _slowest(counts, costs, first, last, scale):
    edges = list(itertools.accumulate(counts, initial=0))
    n_stages = len(counts)
    return max(
        scale[s] * sum(costs[a:b]) + (first if s == 0 else 0) + (last if s == n_stages - 1 else 0)
        for s, (a, b) in enumerate(itertools.pairwise(edges))
    )


def test_balance_equals_brute_force_on_random_costs():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        n_stages = rng.randint(1, min(n, 5))
        costs = [rng.uniform(0.1, 10) for _ in range(n)]
        first, last = rng.uniform(0, 10), rng.uniform(0, 10)
        scale = [rng.choice([3.0, 3.5, 4.0]) for _ in range(n_stages)]
        counts = balance(costs, n_stages, first_extra=first, last_extra=last, stage_scale=scale)
        assert len(counts) == n_stages and sum(counts) == n and min(counts) >= 1
        got = _slowest(counts, costs, first, last, scale)
        assert got == pytest.approx(_brute_force(costs, n_stages, first, last, scale))


def test_balance_gives_the_heavy_head_stage_fewer_layers():
    assert balance([1.0] * 8, 2) == (4, 4)
    assert balance([1.0] * 8, 2, last_extra=2.0) == (5, 3)
    assert balance([1.0] * 8, 2, first_extra=2.0) == (3, 5)
    with pytest.raises(PlanError, match="pp<=3"):
        balance([1.0] * 3, 4)


def test_gpt_layer_cost_from_parameter_shapes():
    config = tiny_config(4)
    shards = model_shards(build_model(config, device="meta"))
    d, f, T, V = config.d_model, config.ffn_dim, config.seq_len, config.vocab_size
    assert [s.name for s in shards] == [
        "embed",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "head",
    ]
    assert shards[1].flops == 2 * (4 * d * d + 2 * d * f) + 4 * T * d
    assert shards[0].flops == 0  # lookups
    assert shards[-1].flops == 2 * d * V  # the tied head multiplies, its weight is counted once
    assert sum(s.params for s in shards) == config.num_params()


def test_moe_expert_matrices_count_top_k_of_n_experts():
    config = dataclasses.replace(get_preset("moe-tiny"), n_layers=2)  # layer 1 is MoE
    shards = model_shards(build_model(config, device="meta"))
    d, f, T, E, k = config.d_model, config.ffn_dim, config.seq_len, config.n_experts, config.top_k
    assert shards[2].flops == 2 * (4 * d * d + d * E + k * 2 * d * f) + 4 * T * d


def test_partition_of_gpt_is_optimal_over_all_splits():
    config = tiny_config(6, vocab_size=4096)  # a heavy head
    model = build_model(config, device="meta")
    part = partition(model, 3)
    assert part.layers_per_stage[-1] < part.layers_per_stage[0]
    slowest = max(part.stage_cost(s) for s in range(3))
    for cuts in itertools.combinations(range(1, 6), 2):
        edges = (0, *cuts, 6)
        other = dataclasses.replace(part, bounds=tuple(itertools.pairwise(edges)))
        assert slowest <= max(other.stage_cost(s) for s in range(3)) + 1e-6


def test_partition_overrides_and_bad_names():
    model = build_model(tiny_config(4), device="meta")
    assert partition(model, 2, layers_per_stage=[1, 3]).bounds == ((0, 1), (1, 4))
    assert partition(model, 3, split_points=["blocks.1", "blocks.3"]).layers_per_stage == (1, 2, 1)
    with pytest.raises(PlanError, match=r"'blocks\.9' matches no module"):
        partition(model, 2, split_points=["blocks.9"])
    with pytest.raises(PlanError, match=r"'blocks\.1\.attn' is a module but not a layer"):
        partition(model, 2, split_points=["blocks.1.attn"])
    with pytest.raises(PlanError, match="stage 0 without a layer"):
        partition(model, 2, split_points=["blocks.0"])
    with pytest.raises(PlanError, match="increasing"):
        partition(model, 3, split_points=["blocks.3", "blocks.1"])
    with pytest.raises(PlanError, match="summing to the model's 4 layers"):
        partition(model, 2, layers_per_stage=[2, 3])
    with pytest.raises(PlanError, match="one count per stage"):
        partition(model, 2, layers_per_stage=[4])


def test_describe_stages_table():
    model = build_model(tiny_config(4), device="meta")
    part = partition(model, 2)
    table = describe_stages(part, micro_batches=4, micro_batch_tokens=128, recompute_ratios=[1, 0])
    lines = table.splitlines()
    assert lines[0].split() == [
        "stage",
        "rank",
        "layers",
        "GFLOP/mb",
        "vs",
        "max",
        "memory",
        "GiB",
        "recompute",
    ]
    assert "embed + blocks.0…1" in lines[1] and lines[1].endswith("1.00")
    assert "blocks.2…3 + head" in lines[2] and lines[2].endswith("0.00")
    assert len(lines) == 3


def test_layout_for_the_cli_on_a_meta_model():
    model = build_model("gpt2-124m", device="meta")
    plan = Plan.parse("pp=4,micro_batches=8,schedule=interleaved,recompute=stage-aware")
    layout = pipeline_layout(model, plan)
    assert layout.n_stages == 8 and layout.stages_of(1) == [1, 5]
    assert layout.rank_ratios == (1.0, 1.0, 1.0, 0.0)
    assert sum(layout.partition.layers_per_stage) == 12
    rows = layout.describe(micro_batch_tokens=4 * 1024).splitlines()[1:]
    assert [row.split()[:2] for row in rows] == [[str(s), str(s % 4)] for s in range(8)]
    # a budget: every rank's estimate fits, ratios never below Merak's formula
    plan = Plan.parse("pp=4,micro_batches=8,schedule=shifted,recompute=stage-aware")
    tokens, budget = 8 * 1024, 4 * 2**30
    layout = pipeline_layout(model, plan, memory_budget_bytes=budget, micro_batch_tokens=tokens)
    formula = stage_aware_ratios(4, layout.rank_ratios[0])
    assert all(r >= f - 1e-9 for r, f in zip(layout.rank_ratios, formula, strict=True))
    assert layout.rank_ratios != formula  # the heavy head made a stage checkpoint more
    for s in range(4):
        in_flight = micro_batches_in_flight("shifted", s, 4, 8)
        memory = layout.partition.stage_memory(s, tokens, in_flight, layout.rank_ratios[s])
        assert memory <= budget
    with pytest.raises(PlanError, match="even with every layer recomputed"):
        pipeline_layout(model, plan, memory_budget_bytes=2**30, micro_batch_tokens=tokens)
    with pytest.raises(PlanError, match="recompute=stage-aware or drop the budget"):
        pipeline_layout(model, Plan(pp=2, micro_batches=2), memory_budget_bytes=2**30)


def test_hf_gpt2_and_llama_split_at_their_layers():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    )
    shards = model_shards(gpt2)
    assert [s.name for s in shards[1:-1]] == [f"transformer.h.{i}" for i in range(4)]
    assert sum(s.params for s in shards) == gpt2.num_parameters()
    assert shards[1].flops == 2 * 12 * 64 * 64 + 4 * 64 * 64
    part = partition(gpt2, 2, split_points=["transformer.h.3"])
    assert part.layers_per_stage == (3, 1)

    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=64,
        )
    )
    shards = model_shards(llama)
    assert [s.name for s in shards[1:-1]] == [f"model.layers.{i}" for i in range(4)]
    assert sum(s.params for s in shards) == llama.num_parameters()
    d, inner = 64, 128
    assert shards[1].flops == 2 * (3 * d * d + 3 * d * inner) + 4 * 64 * d
    assert partition(llama, 2).layers_per_stage == (2, 2)


# --------------------------------------------------------------------------- recomputation
def test_stage_aware_ratios_follow_merak_formula():
    assert stage_aware_ratios(4, 0.5) == pytest.approx((0.5, 0.25, 0.0, 0.0))
    assert stage_aware_ratios(4, 1.0) == (1.0, 1.0, 1.0, 0.0)
    assert stage_aware_ratios(2, 0.3) == pytest.approx((0.3, 0.0))
    rng = random.Random(1)
    for _ in range(50):
        pp, r0 = rng.randint(2, 8), rng.random()
        ratios = stage_aware_ratios(pp, r0)
        for s in range(pp - 1):
            expected = 1 - (1 - r0) * (pp - 1) / (pp - 1 - s)
            assert ratios[s] == pytest.approx(min(1.0, max(0.0, expected)))
        assert ratios[-1] == 0.0
        assert list(ratios) == sorted(ratios, reverse=True)


def test_recompute_modes_and_layer_choice():
    assert recompute_ratios("none", 3) == (0.0, 0.0, 0.0)
    assert recompute_ratios("full", 3) == (1.0, 1.0, 1.0)
    assert recompute_ratios([0.5, 0.0], 2) == (0.5, 0.0)
    with pytest.raises(PlanError, match="2 values in"):
        recompute_ratios([0.5], 2)
    with pytest.raises(PlanError, match="2 values in"):
        recompute_ratios([1.5, 0.0], 2)
    assert checkpointed_layers(range(2, 6), 0.5) == {2, 3}
    assert checkpointed_layers(range(2, 5), 0.5) == {2, 3}  # rounded up
    assert checkpointed_layers(range(2, 6), 0.0) == set()


def test_ratio_for_budget_is_the_smallest_that_fits():
    part = partition(build_model(tiny_config(8), device="meta"), 2)
    tokens, in_flight = 4096, 2
    none = part.stage_memory(0, tokens, in_flight, 0.0)
    full = part.stage_memory(0, tokens, in_flight, 1.0)
    assert full < none
    budget = (none + full) / 2
    r0 = ratio_for_budget(part, budget, tokens, in_flight)
    assert part.stage_memory(0, tokens, in_flight, r0) <= budget
    assert part.stage_memory(0, tokens, in_flight, r0 - 0.25) > budget  # 4 layers: steps of 1/4
    assert ratio_for_budget(part, none, tokens, in_flight) == 0.0
    with pytest.raises(PlanError, match="memory budget"):
        ratio_for_budget(part, full / 2, tokens, in_flight)
