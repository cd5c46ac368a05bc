"""Planner: collective formulas, compute and memory terms against hand-computed values, search
validity, ordering and pruning, clear errors on bad input, and the CLI options."""

import argparse
import dataclasses
import json
import math

import pytest

from interlace.errors import ConfigError, PlanError
from interlace.models.config import GPTConfig
from interlace.models.presets import get_preset
from interlace.plan import Overlap, Plan
from interlace.plan_command import add_plan_args
from interlace.planner.cli import parse_model_spec, resolve_model, run_planner
from interlace.planner.collective_cost import collective_seconds, group_inside_node, ring_steps
from interlace.planner.cost import bubble_fraction, estimate
from interlace.planner.hardware import PRESETS, Hardware, get_hardware, local
from interlace.planner.search import check_plan, explain, pad_vocab, search

TINY = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4)
D, V, T = 64, 256, 64
ALPHA, BW, RATE = 1e-5, 1e9, 1e12


def hw(devices_per_node=2, memory=2**30):
    return local(
        RATE,
        BW,
        latency=ALPHA,
        devices_per_node=devices_per_node,
        memory_bytes=memory,
        dtype="bf16",
    )


def two_level():
    return Hardware(
        name="two-level",
        peak_flops={"bf16": 1e12},
        matmul_efficiency=1.0,
        memory_bytes=2**30,
        devices_per_node=4,
        intra_node_bandwidth=100e9,
        intra_node_latency=1e-6,
        inter_node_bandwidth=10e9,
        inter_node_latency=1e-5,
    )


# ----------------------------------------------------------------- collectives
@pytest.mark.parametrize(
    ("op", "expected"),
    [
        # α · ring steps + ring wire bytes / bandwidth, p = 4, payload 1 MB
        ("all_reduce", 6 * ALPHA + 2 * 3 / 4 * 1e6 / BW),
        ("all_gather", 3 * ALPHA + 3 * 1e6 / BW),
        ("reduce_scatter", 3 * ALPHA + 3 / 4 * 1e6 / BW),
        ("all_to_all", 3 * ALPHA + 3 / 4 * 1e6 / BW),
        ("broadcast", 3 * ALPHA + 1e6 / BW),
    ],
)
def test_collective_seconds_is_alpha_per_step_plus_ring_bytes(op, expected):
    assert collective_seconds(op, 1e6, 4, True, hw(4)) == pytest.approx(expected)
    assert collective_seconds(op, 1e6, 1, True, hw(4)) == 0.0


def test_collective_uses_the_link_of_its_placement():
    h = two_level()
    inside = collective_seconds("all_reduce", 1e6, 2, True, h)
    across = collective_seconds("all_reduce", 1e6, 2, False, h)
    assert inside == pytest.approx(2 * 1e-6 + 1e6 / 100e9)
    assert across == pytest.approx(2 * 1e-5 + 1e6 / 10e9)
    assert ring_steps("all_reduce", 8) == 14 and ring_steps("all_to_all", 8) == 7


def test_group_placement_follows_rank_order():
    assert group_inside_node(8, 1, 8)  # tp = 8 on a node of 8
    assert not group_inside_node(16, 1, 8)
    assert group_inside_node(2, 4, 8)  # dp = 2 over tp = 4
    assert not group_inside_node(2, 8, 8)  # dp = 2 over tp = 8: two nodes
    assert group_inside_node(1, 1024, 8)


# ----------------------------------------------------------------- time terms
LAYER_FLOPS = 2 * 12 * D * D + 4 * T * D  # q,k,v,out + MLP matmuls, plus q·kᵀ and attn·v
HEAD_FLOPS = 2 * D * V  # tied LM head


def test_compute_is_three_forwards_of_the_model_flops():
    cost = estimate(Plan(), TINY, hw(), global_batch=4)
    tokens = 4 * T
    expected = 3 * (2 * LAYER_FLOPS + HEAD_FLOPS) * tokens / RATE
    assert cost.breakdown["compute"] == pytest.approx(expected)
    assert cost.step_seconds == pytest.approx(sum(cost.breakdown.values()))
    assert cost.mfu == pytest.approx(cost.tflops_per_device * 1e12 / RATE)
    assert cost.mfu == pytest.approx(1.0)  # nothing but compute on one device


def test_pipeline_recompute_and_bubble_terms():
    plan = Plan(pp=2, micro_batches=2, recompute="full")
    cost = estimate(plan, TINY, hw(), global_batch=4)
    tokens = 2 * T  # 4 sequences / 2 micro-batches
    # one layer per stage; the last stage also runs the head and is the slowest
    compute_mb = 3 * (LAYER_FLOPS + HEAD_FLOPS) * tokens / RATE
    recompute_mb = LAYER_FLOPS * tokens / RATE
    assert cost.breakdown["compute"] == pytest.approx(2 * compute_mb)
    assert cost.breakdown["recompute"] == pytest.approx(2 * recompute_mb)
    assert cost.breakdown["pp.bubble"] == pytest.approx(1 * (compute_mb + recompute_mb))
    one_send = ALPHA + tokens * D * 2 / BW
    assert cost.breakdown["pp.send_recv"] == pytest.approx(2 * (2 + 1) * one_send)


def test_bubble_fraction_per_schedule():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(1.5 / 9.5)
    assert bubble_fraction(1, 8) == 0.0
    one = estimate(Plan(pp=2, micro_batches=4), TINY, hw(), 8)
    two = estimate(Plan(pp=2, micro_batches=4, schedule="interleaved"), TINY, hw(), 8)
    assert two.breakdown["pp.bubble"] == pytest.approx(one.breakdown["pp.bubble"] / 2)


def test_tp_all_reduce_count_and_bytes():
    cost = estimate(Plan(tp=2), TINY, hw(), global_batch=4)
    payload = 4 * T * D * 2  # [tokens, d] in bf16
    one = 2 * ALPHA + 2 * (1 / 2) * payload / BW
    # 2 forward + 2 backward per layer, embedding forward, head input backward
    assert cost.breakdown["tp.all_reduce"] == pytest.approx((4 * 2 + 2) * one)
    assert cost.breakdown["compute"] == pytest.approx(
        3 * (2 * LAYER_FLOPS + HEAD_FLOPS) * 4 * T / RATE / 2
    )


def test_tp_subbatches_hide_part_of_the_all_reduce():
    no_latency = local(RATE, BW, latency=0.0, devices_per_node=2, dtype="bf16")
    plain = estimate(Plan(tp=2), TINY, no_latency, 4)
    overlapped = estimate(Plan(tp=2, overlap=Overlap(tp_subbatches=2)), TINY, no_latency, 4)
    exposed = overlapped.breakdown["tp.all_reduce"]
    total = exposed + overlapped.hidden["tp.all_reduce"]
    assert exposed < plain.breakdown["tp.all_reduce"]
    assert exposed >= total / 2 - 1e-15


def test_sequence_parallel_splits_the_all_reduce_into_its_halves():
    no_latency = local(RATE, BW, latency=0.0, devices_per_node=2, dtype="bf16")
    plain = estimate(Plan(tp=2), TINY, no_latency, 4)
    sp = estimate(Plan(tp=2, sequence_parallel=True), TINY, no_latency, 4)
    assert "tp.all_reduce" not in sp.breakdown
    halves = sp.breakdown["tp.all_gather"] + sp.breakdown["tp.reduce_scatter"]
    assert halves == pytest.approx(plain.breakdown["tp.all_reduce"])


def test_dp_all_reduce_and_ddp_overlap():
    grads = TINY.num_params() * 4
    full = 2 * ALPHA + 2 * (1 / 2) * grads / BW
    blocking = estimate(Plan(dp=2, overlap=Overlap(dp_overlap=False)), TINY, hw(), 4)
    assert blocking.breakdown["dp.all_reduce"] == pytest.approx(full)
    ddp = estimate(Plan(dp=2), TINY, hw(), 4)  # one 25 MiB bucket holds every gradient
    backward = 2 / 3 * ddp.breakdown["compute"]
    assert ddp.breakdown["dp.all_reduce"] == pytest.approx(full)  # the last bucket never hides
    small_bucket = estimate(Plan(dp=2, overlap=Overlap(dp_bucket_mb=0.01)), TINY, hw(), 4)
    last = 2 * ALPHA + 0.01 * 2**20 / BW
    assert small_bucket.breakdown["dp.all_reduce"] == pytest.approx(max(full - backward, last))


def test_ep_all_to_all_bytes_and_expert_gradients():
    moe = get_preset("moe-tiny")  # 4 experts, top-2, layer 1 is MoE
    cost = estimate(Plan(dp=2, ep=2), moe, hw(), global_batch=4)
    tokens = 2 * T
    rows = tokens * 2 * moe.capacity_factor
    one = ALPHA + (1 / 2) * rows * D * 2 / BW
    assert cost.breakdown["ep.all_to_all"] == pytest.approx(4 * one)  # dispatch+combine, fwd+bwd
    assert cost.breakdown["ep.all_gather"] == pytest.approx(ALPHA + 1 * 8 * 4 / BW)
    assert "ep_dp.all_reduce" not in cost.breakdown  # dp / ep = 1
    experts = 4 * (2 * D * 4 * D + 5 * D)
    dense = (moe.num_params() - experts) * 4
    no_overlap = estimate(
        Plan(dp=2, ep=2, overlap=Overlap(dp_overlap=False)), moe, hw(), global_batch=4
    )
    assert no_overlap.breakdown["dp.all_reduce"] == pytest.approx(2 * ALPHA + dense / BW)


# ----------------------------------------------------------------- memory
LAYER_PARAMS = 2 * 2 * D + (4 * D * D + 4 * D) + (8 * D * D + 5 * D)
HEADS = 4
# attention: the shared input of q, k, v, their outputs, its output and log-sum-exps, the out
# projection's input; MLP: up's input and output, down's input; the two norms' inputs
LAYER_SAVED = (D + 3 * D + D + HEADS + D) + (D + 4 * D + 4 * D) + 2 * D
HEAD_SAVED = D + D + V  # final norm's input, the LM head's input, the loss's log-probabilities


def test_memory_of_a_single_device():
    cost = estimate(Plan(), TINY, hw(), global_batch=2)
    tokens = 2 * T
    expected = TINY.num_params() * 16 + tokens * (2 * LAYER_SAVED + HEAD_SAVED) * 2
    assert cost.memory_bytes_per_device == pytest.approx(expected)
    assert cost.memory["params_grads_optimizer"] == TINY.num_params() * 16


def test_memory_under_tp_keeps_replicated_activations_whole():
    """1D TP splits what its column- and row-parallel matrices keep; the norms' inputs and the
    input shared by each block's producers (and the head's input) stay whole on every rank."""
    cost = estimate(Plan(tp=2), TINY, hw(), global_batch=2)
    tokens = 2 * T
    layer_whole, head_whole = 2 * D + 2 * D, D + D
    per_rank = 2 * (layer_whole + (LAYER_SAVED - layer_whole) / 2) + (
        head_whole + (HEAD_SAVED - head_whole) / 2
    )
    assert cost.memory["activations"] == pytest.approx(tokens * per_rank * 2)
    sp = estimate(Plan(tp=2, sequence_parallel=True), TINY, hw(), global_batch=2)
    assert sp.memory["activations"] == pytest.approx(tokens * (2 * LAYER_SAVED + HEAD_SAVED))


def test_memory_of_a_checkpointed_1f1b_pipeline():
    cost = estimate(Plan(pp=2, micro_batches=2, recompute="full"), TINY, hw(), global_batch=4)
    tokens = 2 * T
    working = tokens * LAYER_SAVED * 2  # one layer's activations while it is recomputed
    embed = V * D + T * D
    stage0 = (embed + LAYER_PARAMS) * 16 + 2 * tokens * D * 2 + working  # 2 in flight, keeps d
    stage1 = (LAYER_PARAMS + 2 * D) * 16 + 1 * tokens * (D + HEAD_SAVED) * 2 + working
    assert embed + 2 * LAYER_PARAMS + 2 * D == TINY.num_params()
    assert cost.memory_bytes_per_device == pytest.approx(max(stage0, stage1))
    gpipe = estimate(Plan(pp=2, micro_batches=2, schedule="gpipe"), TINY, hw(), global_batch=4)
    none = estimate(Plan(pp=2, micro_batches=2), TINY, hw(), global_batch=4)
    assert cost.memory_bytes_per_device < none.memory_bytes_per_device
    assert none.memory["activations"] <= gpipe.memory["activations"]


def test_experts_shard_by_ep():
    moe = get_preset("moe-tiny")
    experts = 4 * (2 * D * 4 * D + 5 * D)
    cost = estimate(Plan(dp=2, ep=2), moe, hw(), global_batch=4)
    expected = (moe.num_params() - experts + experts / 2) * 16
    assert cost.memory["params_grads_optimizer"] == pytest.approx(expected)


# ----------------------------------------------------------------- search
def test_search_returns_valid_plans_fastest_first():
    results = search(TINY, hw(devices_per_node=4), 8, global_batch=16)
    assert results
    times = [c.step_seconds for c in results]
    assert times == sorted(times)
    for cost in results:
        check_plan(cost.plan, 8, TINY)
        assert cost.plan.world_size == 8
        assert cost.memory_bytes_per_device <= 0.9 * 2**30
    assert len({str(c.plan) for c in results}) == len(results)


def test_runnable_only_keeps_to_plan_validate():
    moe = get_preset("moe-tiny")
    results = search(moe, hw(devices_per_node=4), 8, global_batch=16, runnable_only=True)
    for cost in results:
        cost.plan.validate(8, moe)
    # every layout the search tries for an MoE model runs now, pp × ep and ep × tp among them
    everything = search(moe, hw(devices_per_node=4), 8, global_batch=16)
    assert {str(c.plan) for c in everything} == {str(c.plan) for c in results}
    assert any(c.plan.pp > 1 and c.plan.ep > 1 for c in results)
    assert any(c.plan.tp > 1 and c.plan.ep > 1 for c in results)


def test_search_prunes_by_memory():
    roomy = search(TINY, hw(), 4, global_batch=8)
    needs = sorted(c.memory_bytes_per_device for c in roomy)
    budget = needs[len(needs) // 2]  # a device that holds only the leaner half
    fitting = search(TINY, hw(memory=budget / 0.9), 4, global_batch=8)
    assert {str(c.plan) for c in fitting} == {
        str(c.plan) for c in roomy if c.memory_bytes_per_device <= budget
    }
    assert len(fitting) < len(roomy)


def test_too_large_a_model_on_too_few_devices_is_a_clear_error():
    with pytest.raises(PlanError, match=r"no plan fits in memory.*GiB per device"):
        search(get_preset("gpt3-175b"), get_hardware("dgx-a100"), 8, 8, vocab_multiple=128)


def test_bad_batch_is_a_clear_error():
    with pytest.raises(PlanError, match="not divisible by dp=2"):
        estimate(Plan(dp=2), TINY, hw(), global_batch=3)
    with pytest.raises(PlanError, match="micro_batches dividing 3"):
        estimate(Plan(pp=2, micro_batches=2), TINY, hw(), global_batch=3)
    with pytest.raises(PlanError, match="positive integer"):
        search(TINY, hw(), 4, global_batch=0)


def test_gpt3_on_1024_a100_keeps_tensor_parallelism_inside_a_node():
    a100 = get_hardware("dgx-a100")
    spec = get_preset("gpt3-175b")
    best = search(spec, a100, 1024, global_batch=1536, vocab_multiple=128)[0]
    assert best.plan.tp <= a100.devices_per_node
    assert best.plan.tp * best.plan.pp > 1  # 175B × 16 B cannot sit on one 80 GB device
    assert 0 < best.mfu < a100.matmul_efficiency  # communication and bubbles cost something
    text = explain(best)
    assert str(best.plan) in text and "GiB" in text
    # an unpadded vocabulary (50257, odd) admits no tensor parallelism at all
    assert pad_vocab(spec, 1).vocab_size == 50257 and pad_vocab(spec, 128).vocab_size == 50304


def test_explain_on_local_hardware_names_its_measured_peak_and_small_rates():
    cpu = local(80e9, 1e9, devices_per_node=2)  # 0.08 TFLOP/s: a CPU's measured matmul rate
    best = search(get_preset("demo"), cpu, 2, global_batch=32, dtype="fp32")[0]
    text = explain(best).splitlines()[0]
    assert f"{best.tflops_per_device:.3g} TFLOP/s" in text and " 0 TFLOP/s" not in text
    assert "of the measured matmul rate" in text and "MFU" not in text
    assert "MFU" in explain(search(get_preset("gpt2-124m"), get_hardware("dgx-a100"), 8, 64)[0])


# ----------------------------------------------------------------- hardware and model input
def test_hardware_presets_and_errors():
    assert {"dgx-a100", "perlmutter", "dgx-h100", "frontier", "rtx3090-ib"} <= set(PRESETS)
    assert get_hardware("perlmutter").devices_per_node == 4
    with pytest.raises(ConfigError, match=r"unknown hardware 'tpu'.*dgx-a100"):
        get_hardware("tpu")
    with pytest.raises(ConfigError, match="no peak for dtype 'fp8'"):
        get_hardware("dgx-a100").peak("fp8")
    with pytest.raises(ConfigError, match="matmul_efficiency"):
        local(1e12, 1e9).__class__(**{**local(1e12, 1e9).__dict__, "matmul_efficiency": 2.0})
    assert local(5e12, 2e9).matmul_flops("fp32") == 5e12  # measured: efficiency 1


def test_model_spec_strings():
    config = parse_model_spec("layers=60,hidden=10240,heads=80,vocab=51200")
    assert (config.n_layers, config.d_model, config.n_heads, config.vocab_size) == (
        60,
        10240,
        80,
        51200,
    )
    moe = parse_model_spec("layers=4,hidden=64,heads=4,vocab=256,experts=16,top_k=2,seq=128")
    assert moe.n_experts == 16 and moe.top_k == 2 and moe.seq_len == 128
    assert resolve_model("tiny") == TINY
    for bad, match in [
        ("layers=2,hidden=64,heads=4", "lacks vocab"),
        ("layers=2,hidden=64,heads=4,vocab=x", "vocab='x' is not an integer"),
        ("layers=2,hidden=64,heads=4,vocab=8,width=3", "unknown model spec key 'width'"),
        ("layers=2,hidden=64,heads=5,vocab=8", "not divisible by n_heads=5"),
        ("layers=2,layers=3", "given twice"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_model_spec(bad)
    with pytest.raises(ConfigError, match="unknown preset"):
        resolve_model("gpt-9")


# ----------------------------------------------------------------- CLI
def parse(argv):
    parser = argparse.ArgumentParser()
    add_plan_args(parser)  # includes the planner's options
    return parser.parse_args(argv)


def test_cli_search_prints_ranked_plans(capsys):
    argv = ["--model", "tiny", "--gpus", "4", "--global-batch", "8", "--search", "--top", "2"]
    assert run_planner(parse([*argv, "--explain"])) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s/dev" in out and "#1 " in out and "compute" in out and "#3" not in out
    assert run_planner(parse([*argv, "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["plans"]) == 2
    assert data["plans"][0]["step_seconds"] <= data["plans"][1]["step_seconds"]
    assert math.isclose(
        sum(data["plans"][0]["breakdown"].values()), data["plans"][0]["step_seconds"]
    )


def test_cli_prices_one_plan_and_rejects_missing_mode(capsys):
    args = parse(["--model", "layers=2,hidden=64,heads=4,vocab=256", "--plan", "dp=2,tp=2"])
    assert run_planner(args) == 0
    assert "dp=2,tp=2" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--search"):
        run_planner(parse(["--model", "tiny"]))
    with pytest.raises(PlanError, match="not divisible by the tensor parallel degree"):
        run_planner(parse(["--model", "tiny", "--plan", "tp=8", "--vocab-multiple", "1"]))


def test_recomputation_repeats_tensor_parallel_reductions_only_where_not_replayed():
    def tp_terms(**fields):
        base = {"tp": 2, "pp": 2, "micro_batches": 2}
        cost = estimate(Plan(**base, **fields), TINY, hw(devices_per_node=4), global_batch=4)
        return sum(v for k, v in cost.breakdown.items() if k.startswith("tp."))

    # the replayed forward reuses its reduced outputs: no more tp traffic than without it
    assert tp_terms(recompute="full") == pytest.approx(tp_terms())
    # sequence-parallel gathers are not replayed: 2 more per recomputed layer (of 4 per layer)
    sp, sp_full = (
        tp_terms(sequence_parallel=True),
        tp_terms(sequence_parallel=True, recompute="full"),
    )
    assert sp_full > sp


def test_overlap_efficiency_hides_only_its_share_of_the_hideable_part():
    full, half = hw(), dataclasses.replace(hw(), overlap_efficiency=0.5)
    plan = Plan(tp=2, overlap=Overlap(tp_subbatches=2))
    ideal, partial = (estimate(plan, TINY, h, global_batch=4) for h in (full, half))
    hideable = ideal.hidden["tp.all_reduce"]
    assert partial.hidden["tp.all_reduce"] == pytest.approx(hideable / 2)
    assert partial.step_seconds == pytest.approx(ideal.step_seconds + hideable / 2)


def test_optimizer_step_streams_each_devices_parameters_once():
    streamed = dataclasses.replace(hw(), memory_bandwidth=1e10)
    bytes_per_param = 16 + 12 + 4  # AdamW reads w, g, m, v and writes w, m, v; clipping reads g
    single = estimate(Plan(), TINY, streamed, global_batch=4)
    assert single.breakdown["optimizer"] == pytest.approx(
        TINY.num_params() * bytes_per_param / 1e10
    )
    # tensor parallelism splits the layers; the embedding (tied head) is vocab-parallel
    split = estimate(Plan(tp=2), TINY, streamed, global_batch=4)
    assert split.breakdown["optimizer"] == pytest.approx(single.breakdown["optimizer"] / 2)
    assert "optimizer" not in estimate(Plan(), TINY, hw(), global_batch=4).breakdown


def test_checkpointed_layers_split_too_under_tp_subbatches():
    """Inside a checkpoint each sub-batch checkpoints itself: the layers' all-reduces (not
    repeated by the recomputation) hide as without recomputation, and the recomputation's
    compute is cover too."""
    no_latency = local(RATE, BW, latency=0.0, devices_per_node=4, dtype="bf16")
    base = {"tp": 2, "pp": 2, "micro_batches": 2}
    sub = Overlap(tp_subbatches=2)
    plain = estimate(Plan(**base, recompute="full"), TINY, no_latency, 4)
    both = estimate(Plan(**base, recompute="full", overlap=sub), TINY, no_latency, 4)
    without = estimate(Plan(**base, overlap=sub), TINY, no_latency, 4)
    total = plain.breakdown["tp.all_reduce"]  # same bytes: nothing replayed communicates
    hidden = both.hidden["tp.all_reduce"]
    assert both.breakdown["tp.all_reduce"] + hidden == pytest.approx(total)
    assert hidden >= without.hidden["tp.all_reduce"] > 0


def test_idle_devices_speed_up_the_busy_ones_in_the_bubble():
    """pp=2, m=2, free links: the bubble is one micro-batch's compute, run idle_speedup
    times faster while the other stage waits."""
    plan = Plan(pp=2, micro_batches=2, schedule="gpipe")
    free = local(RATE, 1e30, latency=0.0, devices_per_node=2, dtype="bf16")
    even = estimate(plan, TINY, free, global_batch=4)
    shared = estimate(plan, TINY, dataclasses.replace(free, idle_speedup=2.0), 4)
    per_mb = even.breakdown["compute"] / 2
    assert even.breakdown["pp.bubble"] == pytest.approx(per_mb)
    assert shared.breakdown["pp.bubble"] == pytest.approx(per_mb / 2)
    with pytest.raises(ConfigError, match="idle_speedup"):
        dataclasses.replace(free, idle_speedup=0.5)


def test_block_boundary_hides_each_forward_boundary_but_the_stages_last():
    """Compute far above communication: within a layer the sub-batches leave half of the
    split all-reduces exposed (comm / s); the block-boundary step hides one more sub-batch
    all-reduce for every layer but the last."""
    slow = local(1e8, BW, latency=0.0, devices_per_node=2, dtype="bf16")
    tokens = 4 * TINY.seq_len
    piece = 2 * (1 / 2) * (tokens * TINY.d_model * 2 / 2) / BW  # ring all-reduce of half
    split = 4 * TINY.n_layers * 2 * piece
    within = Overlap(tp_subbatches=2, tp_block_boundary=False)
    inside = estimate(Plan(tp=2, overlap=within), TINY, slow, 4)
    across = estimate(Plan(tp=2, overlap=Overlap(tp_subbatches=2)), TINY, slow, 4)
    assert inside.hidden["tp.all_reduce"] == pytest.approx(split / 2)
    assert across.hidden["tp.all_reduce"] == pytest.approx(split / 2 + (TINY.n_layers - 1) * piece)
    gain = inside.breakdown["tp.all_reduce"] - across.breakdown["tp.all_reduce"]
    assert gain == pytest.approx((TINY.n_layers - 1) * piece)


def test_explain_names_the_interleaved_stages_per_rank():
    a100 = get_hardware("dgx-a100")
    plan = Plan.parse("dp=16,pp=8,tp=8,micro_batches=16,schedule=interleaved,virtual_stages=4")
    text = explain(estimate(plan, get_preset("gpt3-175b"), a100, 1536))
    assert "Pipeline bubble: 8 ranks of 4 stages each, 16 micro-batches" in text
    plan = Plan.parse("dp=16,pp=8,tp=8,micro_batches=16")
    assert "Pipeline bubble: 8 stages, 16" in explain(
        estimate(plan, get_preset("gpt3-175b"), a100, 1536)
    )
