"""Step terms priced by hand: FSDP's gathers and reduce-scatters, HSDP's replica all-reduce, the
expert gradients' all-reduce, 3D tensor parallelism's gathers before the head and its
vocabulary-parallel all-reduces over the x·y ranks, its sequence parallel gathers and
reduce-scatters over y, the gradients a grid sums over z, from the
model's sizes, the ring's wire bytes and the link each runs on, so that a term priced twice
over, or on the wrong link, turns a test red. (`planner.step.step_terms`' other terms are
priced by hand in test_planner.py, test_planner_context.py, test_planner_cost3d.py and
test_planner_fsdp_bytes.py.)"""

import pytest

from interlace.models.config import GPTConfig
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.cost import estimate
from interlace.planner.hardware import local
from interlace.planner.step import step_terms

ALPHA, BW, RATE = 1e-5, 1e9, 1e12
SLOW = BW / 4  # the inter-node link
D, V, T = 64, 256, 64
TINY = GPTConfig(vocab_size=V, seq_len=T, d_model=D, n_layers=2, n_heads=4)
LAYER = 12 * D * D + 13 * D  # q, k, v, out and the 4D MLP with biases, two LayerNorms
ROOT = V * D + T * D + 2 * D  # token (tied with the head) and position embeddings, final norm
PARAMS = 2 * LAYER + ROOT
BF16, FP32 = 2, 4  # gathered parameters in the compute dtype, gradients reduced in fp32


HARDWARE = local(
    RATE, BW, inter_node_bandwidth=SLOW, latency=ALPHA, devices_per_node=2, dtype="bf16"
)


def terms(plan, config=TINY, global_batch=8):
    """(exposed, hidden) seconds per term of one bf16 step on nodes of 2 devices."""
    return step_terms(plan, config, HARDWARE, global_batch, dtype="bf16").breakdown()


def fsdp_gather(params):  # 2 ranks: one α and the other rank's shard
    return ALPHA + params / 2 * BF16 / BW


def fsdp_scatter(params):  # 2 ranks: one α and half the fp32 gradients
    return ALPHA + params / 2 * FP32 / BW


def test_fsdp_gathers_every_parameter_twice_but_the_roots_and_scatters_every_gradient():
    exposed, hidden = terms(Plan(dp_shard=2))
    gather, scatter = (
        exposed[k] + hidden[k] for k in ("dp_shard.all_gather", "dp_shard.reduce_scatter")
    )
    assert gather == pytest.approx(fsdp_gather(PARAMS) + fsdp_gather(2 * LAYER))  # root kept
    assert scatter == pytest.approx(fsdp_scatter(PARAMS))


def test_under_long_compute_fsdp_exposes_the_first_gather_and_the_last_reduce_scatter():
    # 32 sequences per rank: each pass outlasts its collectives; the backward's last
    # reduce-scatter is shared between its gathers and reduce-scatters by their seconds
    exposed, _ = terms(Plan(dp_shard=2), global_batch=64)
    backward_gather, reduce = fsdp_gather(2 * LAYER), fsdp_scatter(PARAMS)
    last = fsdp_scatter(LAYER) / (backward_gather + reduce)
    assert exposed["dp_shard.all_gather"] == pytest.approx(
        fsdp_gather(LAYER) + last * backward_gather
    )
    assert exposed["dp_shard.reduce_scatter"] == pytest.approx(last * reduce)


@pytest.mark.parametrize("plan", ["dp_shard=2,tp=2", "dp_shard=2,tp3d=2x1x1"])
def test_fsdp_holds_the_roots_and_two_blocks_gathered_each_split_over_the_tensor_ranks(plan):
    # the root (embedding, head: vocabulary rows over tp, or the grid's x·y; the position
    # embedding and final norm counted with them) and two blocks, in bf16
    cost = estimate(Plan.parse(plan), TINY, HARDWARE, 8, dtype="bf16")
    assert cost.memory["fsdp_gathered"] == pytest.approx((ROOT + 2 * LAYER) / 2 * BF16)


def test_hsdp_all_reduces_the_gradient_shards_over_the_replicas_across_nodes():
    # dp_replicate ranks sit dp_shard = 2 apart: a group of 2 spans 4 ranks, two nodes
    exposed, hidden = terms(Plan(dp=2, dp_shard=2))
    shard = PARAMS / 2 * FP32
    assert exposed["dp_replicate.all_reduce"] == pytest.approx(2 * ALPHA + shard / SLOW)
    assert "dp_replicate.all_reduce" not in hidden


def test_expert_gradients_are_all_reduced_over_the_replicas_of_each_expert():
    moe = get_preset("moe-tiny")  # one MoE layer of 4 experts, ffn 4d, with biases
    experts = 4 * (2 * D * 4 * D + 4 * D + D) / 2  # ep = 2 splits them
    # ep_dp = dp / ep = 2 ranks ep = 2 apart: 4 ranks, two nodes
    exposed, hidden = terms(Plan(dp=4, ep=2), moe)
    assert exposed["ep_dp.all_reduce"] == pytest.approx(2 * ALPHA + experts * FP32 / SLOW)
    assert "ep_dp.all_reduce" not in hidden


def test_3d_gathers_over_x_the_residual_before_the_head_and_its_gradient_at_the_embedding():
    # tp3d = (2, 1, 1): the final norm's input and the split embedding output's gradient,
    # [tokens, d / x] per rank of 4 sequences, gathered over x = 2 ranks of one node
    exposed, hidden = terms(Plan(tp3d=(2, 1, 1)), global_batch=4)
    one = ALPHA + 4 * T * D / 2 * BF16 / BW
    assert exposed["tp_x.all_gather"] == pytest.approx(2 * one)
    assert "tp_x.all_gather" not in hidden


def test_3d_all_reduces_the_vocab_parallel_ends_over_the_xy_ranks():
    # tp3d = (2, 2, 1) on nodes of 2: the embedding's output (forward) and the head's input
    # gradient (backward), [tokens, d] of 4 sequences, each a ring all-reduce over x·y = 4
    # ranks spanning two nodes: 2·3 messages of a quarter of it on the slow link
    exposed, hidden = terms(Plan(tp3d=(2, 2, 1)), global_batch=4)
    one = 2 * 3 * (ALPHA + 4 * T * D / 4 * BF16 / SLOW)
    assert exposed["tp_xy.all_reduce"] == pytest.approx(2 * one)
    assert "tp_xy.all_reduce" not in hidden


def test_expert_layers_under_3d_gather_their_input_over_x_and_share_tokens_over_xy():
    # dp=2, ep=2, tp3d=2x1x1 on nodes of 2: moe-tiny's one MoE layer takes its input [T, d/x]
    # gathered over x (forward; its output's gradient, backward), and the x·y = 2 ranks (one
    # node) gather the halves of the tokens each dispatched (forward; the input gradient,
    # backward); the embedding and head gather over x too, as dense grids do
    tokens = 4 * T  # 8 sequences over dp = 2
    exposed, _ = terms(Plan(dp=2, ep=2, tp3d=(2, 1, 1)), get_preset("moe-tiny"))
    half = ALPHA + tokens * D / 2 * BF16 / BW
    assert exposed["tp_xy.all_gather"] == pytest.approx(2 * half)
    assert exposed["tp_x.all_gather"] == pytest.approx(2 * half + 2 * half)


def test_expert_layers_under_a_grid_with_z_route_each_slice_and_sum_over_z():
    # dp=2, ep=2, tp3d=2x1x2 on nodes of 2: a dp rank's 4 sequences are cut over z = 2, so an
    # MoE layer gathers [2T, d/x] over x and its x·y = 2 ranks share 2T tokens (T each); the
    # ends gather the same residual over x. Summed over z (x·y = 2 ranks apart: two nodes):
    # the ends' vocabulary rows, (V + T)·d + 2d over x·y, and the owners' two whole experts
    moe = get_preset("moe-tiny")
    exposed, _ = terms(Plan(dp=2, ep=2, tp3d=(2, 1, 2)), moe)
    one = ALPHA + T * D * BF16 / BW
    assert exposed["tp_xy.all_gather"] == pytest.approx(2 * one)
    assert exposed["tp_x.all_gather"] == pytest.approx(2 * one + 2 * one)
    ends = ROOT / 2 * FP32
    experts = 4 * (2 * D * 4 * D + 4 * D + D) / 2 * FP32
    z_sum = 2 * (ALPHA + ends / 2 / SLOW) + 2 * (ALPHA + experts / 2 / SLOW)
    assert exposed["tp_z.all_reduce"] == pytest.approx(z_sum)


@pytest.mark.parametrize("plan, shards", [("tp3d=1x1x2", 1), ("dp_shard=2,tp3d=1x1x2", 2)])
def test_a_grid_with_z_sums_the_ends_gradients_over_z(plan, shards):
    # the vocabulary rows and position embedding every z slice holds alike, fp32 over z = 2
    # ranks of one node: by a hook each micro-batch (one here), or FSDP2's shard once a step
    exposed, _ = terms(Plan.parse(plan))
    assert exposed["tp_z.all_reduce"] == pytest.approx(2 * (ALPHA + ROOT / shards * FP32 / 2 / BW))


def test_fsdp_over_a_grid_with_z_keeps_the_whole_root_gathered_for_the_backward():
    # dp_shard=2, tp3d=1x1x2: each z rank holds the ends whole (split over x·y = 1) and half
    # of each layer's weights; the root stays gathered after the forward, so the backward
    # gathers the two layers' halves only. The shard group's ranks sit 2 apart: two nodes
    exposed, hidden = terms(Plan.parse("dp_shard=2,tp3d=1x1x2,tp3d_prefetch=false"))
    gather = exposed["dp_shard.all_gather"] + hidden["dp_shard.all_gather"]

    def slow_gather(params):
        return ALPHA + params / 2 * BF16 / SLOW

    assert gather == pytest.approx(slow_gather(LAYER + ROOT) + slow_gather(LAYER))


def test_3d_sequence_parallelism_moves_the_residual_over_y_by_gathers_and_scatters():
    # tp3d = (1, 2, 1) with the sequence split over y = 2 ranks of one node, 4 sequences:
    # each of the 2 layers' 2 blocks all-gathers [t/2, d] on entry and reduce-scatters its
    # gradient, its transposed layer reduce-scatters [t, d] and all-gathers the gradient;
    # the ends gather over y too (the head's input, the embedding's gradient): each moves
    # half of [t, d] in one ring step
    exposed, hidden = terms(Plan(tp3d=(1, 2, 1), sequence_parallel=True), global_batch=4)
    one = ALPHA + 4 * T * D / 2 * BF16 / BW
    assert exposed["tp_y.all_gather"] == pytest.approx((2 * 2 * 2 + 2) * one)
    assert exposed["tp_y.reduce_scatter"] == pytest.approx(2 * 2 * 2 * one)
    assert "tp_y.all_reduce" not in exposed and "tp_y.all_reduce" not in hidden


def test_expert_layers_under_3d_sequence_parallelism_share_tokens_over_x_alone():
    # dp=2, ep=2, tp3d=2x2x1, sequence parallel: a dp rank's 4 sequences, half of each on a y
    # rank; an MoE layer gathers [2T, d/2] over x (forward, and the gradient in backward) and
    # its x = 2 ranks of one node share those 2T tokens (T each); the head gathers [2T, d/2]
    # over x, the embedding's gradient [4T, d/2]
    moe = get_preset("moe-tiny")
    exposed, _ = terms(Plan(dp=2, ep=2, tp3d=(2, 2, 1), sequence_parallel=True), moe)
    one = ALPHA + T * D * BF16 / BW
    assert "tp_xy.all_gather" not in exposed
    assert exposed["tp_x.all_gather"] == pytest.approx(2 * one + 2 * one + one + (2 * one - ALPHA))
