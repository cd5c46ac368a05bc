"""The planner writes and prices the layouts of published large runs, sharded data parallelism
and recomputation included: Megatron-LM's tp=8 with full recomputation and no pipeline,
Megatron's tp=8 × pp with selective recomputation and sequence parallelism (Korthikanti et al.
2022), torchtitan's FSDP × TP with selective recomputation; their state memory per device is
the hand count, recomputation trades memory for time as priced, and the search explores
dp_shard and recompute."""

import dataclasses

import pytest

from interlace.errors import PlanError
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.cost import estimate
from interlace.planner.hardware import get_hardware
from interlace.planner.search import candidate_plans, check_plan, pad_vocab

A100 = get_hardware("dgx-a100")
GPT3 = pad_vocab(get_preset("gpt3-175b"), 128)
MEGATRON = get_preset("megatron-8.3b")

PUBLISHED = [
    # (model, devices, global batch, plan)
    (MEGATRON, 512, 512, "dp=64,tp=8,recompute=full"),
    (GPT3, 1024, 1536, "dp=8,pp=16,tp=8,micro_batches=192,recompute=full"),
    (
        GPT3,
        512,
        1536,
        "dp=8,pp=8,tp=8,micro_batches=192,sequence_parallel=true,recompute=selective",
    ),
    (MEGATRON, 64, 64, "dp_shard=8,tp=8,recompute=selective"),
    (MEGATRON, 512, 512, "dp=8,dp_shard=8,tp=8,recompute=full"),
]


@pytest.mark.parametrize(("spec", "devices", "batch", "plan_text"), PUBLISHED)
def test_published_layouts_are_priced(spec, devices, batch, plan_text):
    plan = Plan.parse(plan_text)
    check_plan(plan, devices, spec)  # valid (some not runnable yet: pp with dp_shard/selective)
    cost = estimate(plan, spec, A100, batch)
    state = cost.memory["params_grads_optimizer"]
    # largest stage's parameters × 16 bytes over tp · dp_shard: within the embedding's share
    per_stage = spec.num_params() / plan.pp
    assert state == pytest.approx(per_stage * 16 / (plan.tp * plan.dp_shard), rel=0.1)
    assert 0.0 < cost.mfu < 1.0


def test_recomputation_trades_activation_memory_for_time():
    costs = {
        mode: estimate(Plan.parse(f"dp=64,tp=8,recompute={mode}"), MEGATRON, A100, 512)
        for mode in ("none", "selective", "full")
    }
    activations = {m: c.memory["activations"] for m, c in costs.items()}
    assert activations["full"] < activations["selective"] < activations["none"]
    # per layer, full keeps its d-wide input; the embedding and head are never recomputed
    d, tokens, act = MEGATRON.d_model, 512 // 64 * MEGATRON.seq_len, 2
    ends = activations["full"] - MEGATRON.n_layers * d * tokens * act
    assert 0 < ends < activations["full"] / 2
    assert costs["full"].breakdown["recompute"] == pytest.approx(
        costs["full"].breakdown["compute"] / 3, rel=0.05
    )  # one more forward (F) against 3F, the head not recomputed
    # selective replays elementwise work only: its tensors' traffic at the memory bandwidth
    selective, full = (costs[m].breakdown["recompute"] for m in ("selective", "full"))
    assert 0 < selective < full / 10


def test_sharding_divides_the_state_and_adds_gathers():
    replicated = estimate(Plan.parse("dp=8,tp=8"), MEGATRON, A100, 64)
    sharded = estimate(Plan.parse("dp_shard=8,tp=8"), MEGATRON, A100, 64)
    hsdp = estimate(Plan.parse("dp=2,dp_shard=4,tp=8"), MEGATRON, A100, 64)
    state = replicated.memory["params_grads_optimizer"]
    assert sharded.memory["params_grads_optimizer"] == pytest.approx(state / 8)
    assert hsdp.memory["params_grads_optimizer"] == pytest.approx(state / 4)
    assert sharded.memory["fsdp_gathered"] > 0 == replicated.memory["fsdp_gathered"]
    assert "dp.all_reduce" in replicated.breakdown
    assert {"dp_shard.all_gather", "dp_shard.reduce_scatter"} <= set(sharded.breakdown)
    assert "dp_replicate.all_reduce" in hsdp.breakdown


def test_search_space_holds_sharded_and_recomputed_layouts():
    plans = list(candidate_plans(64, MEGATRON, 64))
    assert any(p.dp_shard == 8 and p.tp == 8 for p in plans)
    assert {p.recompute for p in plans if p.pp == 1} == {"none", "selective", "full"}


def test_the_search_prices_3d_grids_inside_pipelines():
    # pp × tp3d with z > 1 runs (tests/test_tensor3d_layouts.py), so the search offers it
    spec = pad_vocab(get_preset("gpt2-1.5b"), 128)
    staged = [
        p
        for p in candidate_plans(16, spec, 64)
        if p.pipelined and p.tp3d is not None and p.tp3d[2] > 1 and _runs(p, spec)
    ]
    assert len(staged) > 10
    assert any(p.recompute == "selective" and p.overlap.tp3d_prefetch for p in staged)
    for plan in staged[:20]:
        priced = estimate(plan, spec, A100, 64)
        assert priced.breakdown["pp.bubble"] > 0 and priced.breakdown["tp_z.all_gather"] > 0


def _runs(plan: Plan, spec) -> bool:
    """Whether `Plan.validate` accepts `plan` for `spec` on its devices."""
    try:
        check_plan(plan, plan.world_size, spec, runnable_only=True)
    except PlanError:
        return False
    return True


def test_the_search_prices_sharded_3d_grids():
    # dp_shard × tp3d runs with z > 1 without the weight prefetch (test_tensor3d_layouts.py)
    spec = pad_vocab(get_preset("gpt2-1.5b"), 128)
    sharded = [
        p
        for p in candidate_plans(16, spec, 64)
        if p.tp3d is not None and p.dp_shard > 1 and _runs(p, spec)
    ]
    assert {p.tp3d[2] > 1 for p in sharded} == {True, False}
    plan = next(p for p in sharded if p.tp3d == (2, 1, 2))
    replicated = estimate(dataclasses.replace(plan, dp=plan.dp_shard, dp_shard=1), spec, A100, 64)
    priced = estimate(plan, spec, A100, 64)
    state = replicated.memory["params_grads_optimizer"]
    assert priced.memory["params_grads_optimizer"] == pytest.approx(state / plan.dp_shard)
    assert priced.breakdown["dp_shard.all_gather"] > 0 and priced.breakdown["tp_z.all_gather"] > 0
