"""Planner: context parallelism priced term by term against hand computations (a rank's T/cp
tokens, the ring's K/V and gradient passes hidden under per-block attention, the all-to-all's
exchanges, the gradient all-reduce over dp · cp), and searched: a long sequence that does not
fit one device gets cp, and the reason is said."""

import argparse
from dataclasses import replace

import pytest

from interlace.errors import PlanError
from interlace.models.config import GPTConfig
from interlace.models.presets import get_preset
from interlace.plan import Overlap, Plan
from interlace.plan_command import add_plan_args
from interlace.planner.cli import default_global_batch, run_planner
from interlace.planner.collective_cost import collective_seconds
from interlace.planner.context_choice import context_choice
from interlace.planner.cost import estimate, plan_memory
from interlace.planner.hardware import Hardware, get_hardware, local
from interlace.planner.search import check_plan, explain, pad_vocab, search
from interlace.planner.simulate import simulate

TINY = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4)
D, V, T, L = 64, 256, 64, 2
ALPHA, BW, RATE = 1e-5, 1e9, 1e12
LAYER_FLOPS = 2 * 12 * D * D + 4 * T * D  # matmuls, plus attention over the whole sequence
HEAD_FLOPS = 2 * D * V


def hw(rate=RATE, alpha=ALPHA, devices_per_node=8, overlap=1.0, memory=2**30):
    return local(
        rate,
        BW,
        latency=alpha,
        devices_per_node=devices_per_node,
        memory_bytes=memory,
        dtype="bf16",
        overlap_efficiency=overlap,
    )


def two_level(devices_per_node):
    return Hardware(
        name="two-level",
        peak_flops={"bf16": RATE},
        matmul_efficiency=1.0,
        memory_bytes=2**30,
        devices_per_node=devices_per_node,
        intra_node_bandwidth=100e9,
        intra_node_latency=1e-6,
        inter_node_bandwidth=10e9,
        inter_node_latency=1e-5,
    )


# ----------------------------------------------------------------- a rank's share of tokens
def test_compute_is_the_ranks_share_of_tokens_at_the_whole_sequences_attention():
    cost = estimate(Plan(cp=2), TINY, hw(), global_batch=2)
    tokens = 2 * T // 2  # two sequences, half of each
    expected = 3 * (L * LAYER_FLOPS + HEAD_FLOPS) * tokens / RATE
    assert cost.breakdown["compute"] == pytest.approx(expected)
    one_sequence = estimate(Plan(), TINY, hw(), global_batch=1)  # as many tokens, whole
    assert cost.breakdown["compute"] == pytest.approx(one_sequence.breakdown["compute"])


@pytest.mark.parametrize("cp", [2, 4])
def test_activations_are_divided_by_cp(cp):
    whole = estimate(Plan(), TINY, hw(), global_batch=2)
    split = estimate(Plan(cp=cp), TINY, hw(), global_batch=2)
    assert split.memory["activations"] == pytest.approx(whole.memory["activations"] / cp)
    assert split.memory["params_grads_optimizer"] == whole.memory["params_grads_optimizer"]
    assert split.context["tokens_per_sequence"] == T / cp
    assert split.context["memory_without_cp"] == pytest.approx(whole.memory_bytes_per_device)
    assert plan_memory(Plan(cp=cp), TINY, 2)["total"] == split.memory_bytes_per_device


# ----------------------------------------------------------------- the ring
def test_a_ring_pass_is_one_message():
    assert collective_seconds("ring_pass", 1e6, 4, True, hw()) == pytest.approx(ALPHA + 1e6 / BW)


# cp = 4, one sequence: a rank holds 16 tokens of width 64. K and V: 2 · 16 · 64 bf16 = 4096
# bytes (4.096 µs), their gradients in fp32 8192 bytes (8.192 µs). One block's forward
# attention is 4 · T · D · 16 / cp = 65536 FLOPs: at this rate b = 3 µs, backward 2b = 6 µs.
KV, GRAD, BLOCK = 4096 / BW, 8192 / BW, 3e-6
RING_RATE = 65536 / BLOCK


def ring_cost(recompute="none", overlap=1.0):
    hardware = hw(rate=RING_RATE, alpha=0.0, overlap=overlap)
    return estimate(Plan(cp=4, recompute=recompute), TINY, hardware, global_batch=1)


def test_ring_passes_hide_under_each_blocks_attention():
    cost = ring_cost()
    forward = 3 * (KV - BLOCK)  # 3 K/V passes, each 1.096 µs longer than its block
    backward = (
        0.0  # step 0: K/V (4.1 µs) under 6 µs
        + 2 * (KV + GRAD - 2 * BLOCK)  # steps 1, 2: K/V and the previous gradients, 12.3 µs
        + (GRAD - 2 * BLOCK)  # step 3: the gradients only
        + GRAD  # the last gradients, after the last block
    )
    total = 3 * KV + 3 * KV + 4 * GRAD
    assert cost.breakdown["cp.ring_pass"] == pytest.approx(L * (forward + backward))
    assert cost.hidden["cp.ring_pass"] == pytest.approx(L * total - L * (forward + backward))


def test_a_replayed_forward_runs_its_ring_again():
    plain, replayed = ring_cost(), ring_cost("full")
    extra = replayed.breakdown["cp.ring_pass"] - plain.breakdown["cp.ring_pass"]
    assert extra == pytest.approx(L * 3 * (KV - BLOCK))
    hidden = replayed.hidden["cp.ring_pass"] - plain.hidden["cp.ring_pass"]
    assert hidden == pytest.approx(L * 3 * BLOCK)


def test_only_the_overlap_efficiency_of_the_ring_hides():
    ideal, half = ring_cost(), ring_cost(overlap=0.5)
    total = ideal.breakdown["cp.ring_pass"] + ideal.hidden["cp.ring_pass"]
    assert half.hidden["cp.ring_pass"] == pytest.approx(ideal.hidden["cp.ring_pass"] / 2)
    assert half.breakdown["cp.ring_pass"] + half.hidden["cp.ring_pass"] == pytest.approx(total)


# ----------------------------------------------------------------- the all-to-all
@pytest.mark.parametrize(("recompute", "exchanges"), [("none", 4 * 2 * L), ("full", 4 * 3 * L)])
def test_all_to_all_moves_q_k_v_and_the_output_each_way(recompute, exchanges):
    plan = Plan(cp=2, cp_mode="alltoall", recompute=recompute)
    cost = estimate(plan, TINY, hw(), global_batch=2)
    tokens = 2 * T // 2
    one = ALPHA + 1 / 2 * tokens * D * 2 / BW  # [tokens, d] bf16, half of it leaves the rank
    assert cost.breakdown["cp.all_to_all"] == pytest.approx(exchanges * one)
    assert "cp.all_to_all" not in cost.hidden and "cp.ring_pass" not in cost.breakdown


@pytest.mark.parametrize(("devices_per_node", "inside"), [(4, True), (2, False)])
def test_the_cp_group_spans_cp_tensor_parallel_groups(devices_per_node, inside):
    plan = Plan(tp=2, cp=2, cp_mode="alltoall")
    cost = estimate(plan, TINY, two_level(devices_per_node), global_batch=2)
    tokens, width = 2 * T // 2, D // 2
    alpha, bandwidth = (1e-6, 100e9) if inside else (1e-5, 10e9)
    one = alpha + 1 / 2 * tokens * width * 2 / bandwidth
    assert cost.breakdown["cp.all_to_all"] == pytest.approx(4 * 2 * L * one)


# ----------------------------------------------------------------- gradients over dp · cp
def test_gradients_are_all_reduced_over_dp_times_cp():
    plan = Plan(dp=2, cp=2, overlap=Overlap(dp_overlap=False))
    cost = estimate(plan, TINY, hw(), global_batch=2)
    grads = TINY.num_params() * 4
    assert cost.breakdown["dp_cp.all_reduce"] == pytest.approx(6 * ALPHA + 2 * 3 / 4 * grads / BW)
    assert "dp.all_reduce" not in cost.breakdown
    alone = estimate(Plan(cp=2), TINY, hw(), global_batch=2)  # dp = 1: still cp ranks
    assert alone.breakdown["dp_cp.all_reduce"] + alone.hidden.get(
        "dp_cp.all_reduce", 0.0
    ) == pytest.approx(2 * ALPHA + grads / BW)


def test_the_simulated_step_matches_the_estimate():
    plan = Plan(dp=2, cp=2, recompute="full")
    hardware = hw(rate=RING_RATE)
    cost = estimate(plan, TINY, hardware, global_batch=2)
    assert simulate(plan, TINY, hardware, 2).step_seconds == pytest.approx(cost.step_seconds)


# ----------------------------------------------------------------- the search
def test_search_proposes_only_runnable_context_parallel_plans():
    ranked = search(TINY, hw(), 8, 2)
    splits = [c.plan for c in ranked if c.plan.context_parallel]
    assert {p.cp_mode for p in splits} == {"ring", "alltoall"}
    for plan in splits:
        plan.validate(8, TINY)
    with pytest.raises(PlanError, match="not implemented yet"):
        check_plan(Plan(tp3d=(2, 1, 1), cp=2), 4, TINY)  # priced only as the runtime composes cp
    pipelined = Plan(pp=2, cp=2, micro_batches=2)
    check_plan(pipelined, 4, TINY)  # cp inside pipeline stages runs


def test_a_sequence_too_long_for_one_device_gets_cp_for_memory():
    spec = replace(TINY, seq_len=8192)
    ranked = search(spec, hw(alpha=1e-5, devices_per_node=4, memory=16 * 2**20), 4, 1)
    best = ranked[0]
    # without cp only a 3D grid fits: it splits every activation and the logits over x·y
    assert best.plan.cp > 1 and all(c.plan.context_parallel or c.plan.tp3d for c in ranked)
    assert best.context["memory_without_cp"] > best.memory_limit_bytes
    why = context_choice(ranked)
    assert why.startswith(f"Why cp={best.plan.cp} ({best.plan.cp_mode}): a device keeps ")
    assert "with whole sequences (cp=1)" in why and "over the device's" in why
    without = next(c for c in ranked if not c.plan.context_parallel)
    assert why.endswith(f"{without.step_seconds / best.step_seconds:.2f}x as long).")
    only_cp = context_choice([c for c in ranked if c.plan.context_parallel])
    assert only_cp.endswith("No plan without context parallelism fits in memory.")
    assert "Context parallelism" in explain(best)


def test_default_global_batch_keeps_the_tokens_per_step():
    assert default_global_batch(1024, None) == 512
    assert default_global_batch(1024, 131072) == 4
    assert default_global_batch(1024, 2**30) == 1


def test_megatron_at_131072_tokens_on_64_gpus_picks_cp(capsys):
    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    argv = ["--model", "megatron-8.3b", "--seq", "131072", "--gpus", "64", "--search"]
    assert run_planner(parser.parse_args(argv)) == 0
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if line.startswith("1 "))
    assert ",cp=" in first and "global batch 4 × 131072 tokens" in out
    assert "with whole sequences (cp=1) this layout needs" in out and "over the device's" in out
    assert "The fastest plan without context parallelism that fits" in out
    spec = pad_vocab(get_preset("megatron-8.3b"), 128)
    best = search(spec, get_hardware("dgx-a100"), 64, 4, 131072)[0]
    assert best.plan.cp > 1 and best.fits
    assert best.context["memory_without_cp"] > best.memory_limit_bytes
    assert best.breakdown["cp.ring_pass"] < best.hidden["cp.ring_pass"]  # mostly hidden


def test_fsdp_under_cp_shards_the_state_over_dp_shard_times_cp():
    # the ranks of a cp group hold the same parameters: FSDP2 shards over all of them
    sharded = plan_memory(Plan(dp_shard=2, cp=2), TINY, 4)["params_grads_optimizer"]
    assert sharded == plan_memory(Plan(dp_shard=4), TINY, 4)["params_grads_optimizer"]
    assert Plan(dp_shard=2, cp=2).shard_ranks == 4 and Plan(cp=2).shard_ranks == 1
