"""The planner prices experts as the runtime lays them out: whole on their owner under ep × tp
(each tp rank dispatching its share of the tokens, the shares all-gathered over tp without
sequence parallelism) or split over tp under etp = tp (each tp rank dispatching all the tokens,
the layer's output summed over tp), sharded over ep_dp under dp_shard except where balancing
replicas keeps them whole, and reduced accordingly."""

import dataclasses

import pytest

from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.cost import estimate
from interlace.planner.cost_pipeline import pipeline_stages
from interlace.planner.hardware import get_hardware
from interlace.planner.profile import device_params, model_profile

MOE = dataclasses.replace(get_preset("moe-gpt-12l"), dropless=True)
HW = get_hardware("dgx-a100")


def _params(plan_text: str) -> tuple[float, float]:
    """(expert, non-expert) parameters one device of the first stage keeps."""
    plan = Plan.parse(plan_text)
    stage = pipeline_stages(model_profile(MOE), plan)[0]
    held = device_params(stage, plan)
    dense = (stage.params - stage.expert_params) / (plan.tp_size * plan.shard_ranks)
    return held - dense, stage.expert_params


@pytest.mark.parametrize(
    ("plan_text", "split"),
    [
        ("dp=4,ep=2", 2),
        ("dp=2,ep=2,tp=2", 2),  # whole experts on every tp rank
        ("dp_shard=4,ep=2", 4),  # sharded over ep_dp = 2
        ("dp=2,dp_shard=2,ep=2", 4),
        ("dp_shard=4,ep=2,moe_balance=prophet", 2),  # replicas keep them whole
        ("tp=2", 2),  # ep = 1: each expert split along its width
        ("dp=2,ep=2,tp=2,etp=2", 4),  # each expert split over tp as well
        ("dp=2,dp_shard=2,ep=2,tp=2,etp=2", 8),  # and its pieces sharded over ep_dp = 2
    ],
)
def test_expert_parameters_per_device_follow_the_runtime_split(plan_text, split):
    held, total = _params(plan_text)
    assert held == pytest.approx(total / split)


def _cost(plan_text: str):
    return estimate(Plan.parse(plan_text), MOE, HW, global_batch=64)


def test_ep_times_tp_dispatches_a_share_per_tp_rank_and_gathers_it():
    alone, with_tp = _cost("dp=4,ep=2"), _cost("dp=4,ep=2,tp=2")
    # each tp rank sends half the rows the same ep group sends at tp = 1 (same tokens per rank)
    a2a = with_tp.breakdown["ep.all_to_all"]
    assert a2a < alone.breakdown["ep.all_to_all"]
    assert with_tp.breakdown["tp.all_gather"] > 0
    sequence = _cost("dp=4,ep=2,tp=2,sequence_parallel=true")
    assert sequence.breakdown["ep.all_to_all"] == pytest.approx(a2a)


def test_sharded_experts_reduce_scatter_and_gather_over_ep_dp():
    sharded, whole = _cost("dp_shard=4,ep=2"), _cost("dp_shard=4,ep=2,moe_balance=dropless")
    assert whole.breakdown.keys() == sharded.breakdown.keys()
    assert sharded.breakdown["ep_dp.reduce_scatter"] > 0
    assert sharded.breakdown["ep_dp.all_gather"] > 0
    assert "ep_dp.all_reduce" not in sharded.breakdown
    kept = _cost("dp_shard=4,ep=2,moe_balance=shadow")
    assert kept.breakdown["ep_dp.all_reduce"] > 0
    assert "ep_dp.reduce_scatter" not in kept.breakdown
    assert kept.memory_bytes_per_device > sharded.memory_bytes_per_device


def test_experts_split_over_tp_share_the_dispatch_and_exchange_the_rows_over_tp():
    from interlace.planner.bytes import activation_bytes
    from interlace.planner.collective_cost import collective_seconds
    from interlace.planner.cost_moe import expert_terms
    from interlace.planner.cost_work import stage_work

    alone, whole = _cost("dp=4,ep=2"), _cost("dp=4,ep=2,tp=2")
    split = _cost("dp=4,ep=2,tp=2,etp=2")
    # the tp ranks share the dispatch out as with etp=1: half of ep alone's each
    assert split.breakdown["ep.all_to_all"] == pytest.approx(whole.breakdown["ep.all_to_all"])
    assert split.breakdown["ep.all_to_all"] < alone.breakdown["ep.all_to_all"]
    assert split.memory_bytes_per_device < whole.memory_bytes_per_device
    tokens = 16 * MOE.seq_len  # a rank's micro-batch: 64 sequences over dp = 4
    token_bytes = MOE.d_model * activation_bytes("bf16")
    rows = tokens * MOE.top_k * token_bytes  # the rows a tp group's owner ranks received
    for text, share in (
        ("dp=4,ep=2,tp=2,etp=2,recompute=full", tokens / 2 * token_bytes),
        ("dp=4,ep=2,tp=2,etp=2,sequence_parallel=true", 0.0),  # each its own shard: no share
    ):
        plan = Plan.parse(text)
        stage = pipeline_stages(model_profile(MOE), plan)[0]
        work = stage_work(plan, MOE, stage, tokens, HW, "bf16")
        exposed = expert_terms(plan, MOE, stage, tokens, 2, work, HW, 0.0).comm.exposed
        calls = 2 * stage.n_moe + stage.n_moe_checkpointed  # forward, backward, replayed
        gather, scatter = (
            collective_seconds(op, payload, 2, True, HW)
            for op, payload in (("all_gather", rows / 2), ("reduce_scatter", rows))
        )
        shared = collective_seconds("all_gather", share, 2, True, HW) if share else 0.0
        assert {k for k in exposed if k.startswith("tp.")} == {"tp.all_gather", "tp.reduce_scatter"}
        assert exposed["tp.reduce_scatter"] == pytest.approx(calls * scatter), text
        assert exposed["tp.all_gather"] == pytest.approx(calls * (gather + shared)), text


def test_sub_batches_price_the_layers_without_experts_and_leave_moe_layers_whole():
    from interlace.planner.collective_cost import collective_seconds
    from interlace.planner.cost_tensor import tensor_terms
    from interlace.planner.cost_work import stage_work

    config = dataclasses.replace(MOE, moe_every=2)  # layers 1, 3, ... route
    plan = Plan.parse("dp=4,tp=2,tp_subbatches=2")
    stage = pipeline_stages(model_profile(config), plan)[0]
    assert 0 < stage.n_moe < stage.n_layers and 0 < stage.moe_layer_flops < stage.layer_flops
    tokens, d = 16 * config.seq_len, config.d_model
    # rows matter (half rows), shapes do not (no SMs), nothing hides: every call counts
    hw = dataclasses.replace(HW, sm_count=0, matmul_half_rows=4096.0, overlap_efficiency=0.0)
    work = stage_work(plan, config, stage, tokens, hw, "bf16")
    rate, sub_rate = (hw.matmul_flops("bf16", rows, d) for rows in (tokens, tokens / 2))
    dense = stage.layer_flops - stage.moe_layer_flops
    moe_extra = (
        work.compute
        - 3 * stage.flops * tokens / 2 / rate
        - 3 * dense * tokens / 2 * (1 / sub_rate - 1 / rate)
    )
    whole = stage_work(Plan.parse("dp=4,tp=2"), config, stage, tokens, hw, "bf16")
    assert moe_extra == pytest.approx(whole.compute - 3 * stage.flops * tokens / 2 / rate)
    exposed = tensor_terms(plan, stage, tokens, 2, d, work, hw).exposed["tp.all_reduce"]
    one = collective_seconds("all_reduce", tokens * d * 2, 2, True, hw)
    piece = collective_seconds("all_reduce", tokens * d * 2 / 2, 2, True, hw)
    split = stage.n_layers - stage.n_moe
    calls = 4 * stage.n_layers + int(stage.has_embed) + int(stage.has_head)
    assert exposed == pytest.approx((calls - 4 * split) * one + 4 * split * 2 * piece)
