"""3D tensor parallel cost terms against AxoNN's per-layer byte formula (REFERENCE.md §3)."""

import pytest

from interlace.models.config import GPTConfig
from interlace.models.presets import get_preset
from interlace.parallel.tensor3d.layers import layer_wire_bytes
from interlace.plan import Overlap, Plan
from interlace.planner.cost import estimate
from interlace.planner.cost3d import layer_cost
from interlace.planner.gemm import block_linears
from interlace.planner.hardware import local
from interlace.planner.search import search

CONFIG = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4)
BANDWIDTH = 1e9


@pytest.mark.parametrize("grid", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 2, 2), (4, 2, 1)])
def test_layer_seconds_times_bandwidth_are_the_axonn_bytes(grid):
    x, _, z = grid
    tokens, b = 512, 4
    # no latency, one link everywhere, compute so fast that nothing hides
    hardware = local(1e30, BANDWIDTH, latency=0.0, devices_per_node=64)
    cost = layer_cost(CONFIG, grid, tokens, b, 1e30, hardware)
    expected = {"tp_x": 0.0, "tp_y": 0.0, "tp_z": 0.0}
    for lin in block_linears(CONFIG):
        for axis, nbytes in layer_wire_bytes(
            lin.n_in, lin.n_out, tokens // z, grid, lin.transposed, b
        ).items():
            expected[axis] += nbytes
    # two LayerNorms, forward and backward: an all-reduce of [T, 2] statistics over X each
    expected["tp_x"] += 4 * 2 * (x - 1) / x * (tokens // z) * 2 * b
    measured = {axis: 0.0 for axis in expected}
    for key, seconds in cost.exposed.items():
        measured[key.split(".")[0]] += seconds * BANDWIDTH
    assert measured == pytest.approx(expected, rel=1e-9, abs=1e-6)
    assert sum(cost.hidden.values()) == pytest.approx(0.0, abs=1e-12)


def test_backward_reductions_hide_under_the_weight_gradient_matmul():
    grid, tokens, b = (1, 2, 2), 512, 4
    hardware = local(1e30, BANDWIDTH, latency=0.0, devices_per_node=64)
    slow_compute = layer_cost(CONFIG, grid, tokens, b, 1e3, hardware)
    # compute slow enough to cover every async collective: the dX all-reduces over Y and the
    # dW reduce-scatters over Z are all hidden, the forward ones stay exposed
    assert "tp_z.reduce_scatter" not in slow_compute.exposed
    assert slow_compute.hidden["tp_z.reduce_scatter"] > 0
    fast = layer_cost(CONFIG, grid, tokens, b, 1e30, hardware)
    assert slow_compute.exposed["tp_y.all_reduce"] < fast.exposed["tp_y.all_reduce"]
    # under FSDP2 each Z reduce-scatter is waited inside the backward: nothing of it hides
    sharded = layer_cost(CONFIG, grid, tokens, b, 1e3, hardware, scatter_in_backward=True)
    assert sharded.exposed["tp_z.reduce_scatter"] == pytest.approx(
        slow_compute.hidden["tp_z.reduce_scatter"]
    )
    assert "tp_z.reduce_scatter" not in sharded.hidden


def test_estimate_and_search_price_tp3d():
    hardware = local(1e12, BANDWIDTH, latency=1e-5, devices_per_node=8)
    cost = estimate(Plan(dp=2, tp3d=(2, 2, 1)), CONFIG, hardware, global_batch=8, dtype="fp32")
    assert {"tp_x.all_reduce", "tp_y.all_reduce", "dp.all_reduce"} <= set(cost.breakdown)
    assert cost.step_seconds == pytest.approx(sum(cost.breakdown.values()))
    flat = estimate(Plan(dp=8), CONFIG, hardware, global_batch=8, dtype="fp32")
    # every weight split over the 4 ranks: the layers over x·y, the embedding and head by
    # vocabulary rows over x·y, as 1D's over tp; so is their compute
    assert cost.memory["params_grads_optimizer"] < flat.memory["params_grads_optimizer"]
    one_d = estimate(Plan(dp=2, tp=4), CONFIG, hardware, global_batch=8, dtype="fp32")
    assert cost.breakdown["compute"] == pytest.approx(one_d.breakdown["compute"])
    assert cost.memory["params_grads_optimizer"] == pytest.approx(
        one_d.memory["params_grads_optimizer"]
    )
    plans = {str(c.plan) for c in search(CONFIG, hardware, 8, global_batch=8, dtype="fp32")}
    assert "tp3d=2x2x2" in plans and "dp=2,tp3d=2x2x1" in plans


def test_experts_under_a_grid_are_held_whole_by_their_owners_as_under_1d():
    # every non-expert weight split over the grid's 2 ranks, each expert whole on one of ep = 2
    hardware = local(1e12, BANDWIDTH, latency=1e-5, devices_per_node=8)
    moe = get_preset("moe-tiny")
    grid, one_d = (
        estimate(Plan.parse(p), moe, hardware, global_batch=8, dtype="fp32")
        for p in ("dp=2,ep=2,tp3d=2x1x1", "dp=2,ep=2,tp=2")
    )
    state = "params_grads_optimizer"
    assert grid.memory[state] == pytest.approx(one_d.memory[state])
    assert grid.breakdown["compute"] == pytest.approx(one_d.breakdown["compute"])


@pytest.mark.parametrize("grid", [(1, 2, 1), (2, 2, 1), (2, 4, 2)])
def test_sequence_parallel_prices_the_sequence_collectives_over_y(grid):
    x, y, z = grid
    tokens, b = 512, 4
    hardware = local(1e30, BANDWIDTH, latency=0.0, devices_per_node=64)
    plain = layer_cost(CONFIG, grid, tokens, b, 1e30, hardware)
    cost = layer_cost(CONFIG, grid, tokens, b, 1e30, hardware, sequence_parallel=True)

    def wire(terms: dict, axis: str) -> float:
        return sum(s for k, s in terms.items() if k.startswith(axis + ".")) * BANDWIDTH

    t, d = tokens // z, CONFIG.d_model
    # two blocks a layer: the entry's all-gather (backward: reduce-scatter) and the transposed
    # layer's reduce-scatter (backward: all-gather) of [t, d/x], each (y-1)/y of it on the wire;
    # the normal layers' dX all-reduces over y are gone
    one = (y - 1) / y * t * d / x * b
    assert wire(cost.exposed, "tp_y") == pytest.approx(2 * 4 * one)
    assert wire(cost.forward, "tp_y") == pytest.approx(2 * 2 * one)
    assert "tp_y.all_reduce" not in cost.exposed and "tp_y.all_reduce" not in cost.hidden
    # over x the norms' statistics cover t/y tokens; over z nothing changes
    norms = 4 * 2 * (x - 1) / x * t * 2 * b
    assert wire(cost.exposed, "tp_x") == pytest.approx(
        wire(plain.exposed, "tp_x") - norms + norms / y
    )
    assert wire(cost.exposed, "tp_z") == pytest.approx(wire(plain.exposed, "tp_z"))


def test_sequence_parallel_splits_the_norm_inputs_over_y_and_is_searched():
    hardware = local(1e12, BANDWIDTH, latency=1e-5, devices_per_node=8)
    plain = estimate(Plan(tp3d=(2, 2, 1)), CONFIG, hardware, global_batch=8, dtype="fp32")
    sp = Plan(tp3d=(2, 2, 1), sequence_parallel=True)
    cost = estimate(sp, CONFIG, hardware, global_batch=8, dtype="fp32")
    # each layer's two LayerNorm inputs [T, d/x] kept as [T/y, d/x]; the rest as before
    tokens, d = 8 * CONFIG.seq_len, CONFIG.d_model
    saved = CONFIG.n_layers * 2 * d / 2 * (1 - 1 / 2) * tokens * 4
    assert plain.memory["activations"] - cost.memory["activations"] == pytest.approx(saved)
    plans = {str(c.plan) for c in search(CONFIG, hardware, 4, global_batch=8, dtype="fp32")}
    assert str(sp) in plans and str(Plan(tp3d=(2, 2, 1))) in plans


@pytest.mark.parametrize("boundary", [True, False])
def test_sub_batches_hide_the_grids_all_reduces_as_1d_does(boundary):
    """tp3d = (2, 1, 1), two sub-batches, no latency, compute far above communication. Over x
    the normal linears (q, k, v: d wide, up: 4d) all-reduce their outputs and the transposed
    ones (out: d, down: 4d) their input gradients, 12·t·d a layer, in halves on the sub-batch
    threads: half of it stays exposed (comm / s), and each layer but the last leaves its last
    forward reduction (up's half) under the next layer; the norms' statistics stay exposed."""
    tokens, b = 4 * CONFIG.seq_len, 4
    slow = local(1e8, BANDWIDTH, latency=0.0, devices_per_node=2)
    overlap = Overlap(tp_subbatches=2, tp_block_boundary=boundary)
    cost = estimate(Plan(tp3d=(2, 1, 1), overlap=overlap), CONFIG, slow, 4, dtype="fp32")
    ring = 2 * (2 - 1) / 2 / BANDWIDTH  # seconds per byte of a ring all-reduce over 2 ranks
    layers, d = CONFIG.n_layers, CONFIG.d_model
    pool = layers * 12 * tokens * d * b * ring
    carried = (layers - 1) * tokens * 4 * d * b / 2 * ring if boundary else 0.0
    norms = layers * 4 * tokens * 2 * b * ring
    assert cost.hidden["tp_x.all_reduce"] == pytest.approx(pool / 2 + carried)
    assert cost.breakdown["tp_x.all_reduce"] == pytest.approx(pool / 2 - carried + norms)
    assert "tp_y.all_reduce" not in cost.breakdown


def test_sub_batched_grids_are_searched_without_sequence_parallelism():
    hardware = local(1e12, BANDWIDTH, latency=1e-5, devices_per_node=8)
    found = [c.plan for c in search(CONFIG, hardware, 4, global_batch=8, dtype="fp32")]
    expected = {"tp3d=2x2x1,tp_subbatches=2", "tp3d=2x2x1", "tp3d=1x2x2,tp_subbatches=2"}
    assert expected <= {str(p) for p in found}
    sub_batched = [p for p in found if p.tp3d is not None and p.overlap.tp_subbatches > 1]
    assert not any(p.sequence_parallel for p in sub_batched)


def test_sub_batches_share_each_gathered_block_over_z():
    # the sub-batches of a layer share one Z gather per pass half and one reduce-scatter of
    # their summed dW: Z's seconds are those of the unsplit layer
    slow = local(1e8, BANDWIDTH, latency=1e-5, devices_per_node=2)
    costs = [
        estimate(
            Plan(tp3d=(2, 1, 2), overlap=Overlap(tp_subbatches=s)), CONFIG, slow, 4, dtype="fp32"
        )
        for s in (1, 2)
    ]
    for kind in ("all_gather", "reduce_scatter"):
        key = f"tp_z.{kind}"
        plain, sub = (c.breakdown.get(key, 0.0) + c.hidden.get(key, 0.0) for c in costs)
        assert sub == pytest.approx(plain) and plain > 0, key


def test_recomputed_sub_batches_issue_their_forward_reductions_again():
    # a recomputed 3D layer repeats its forward all-reduces (the runtime's meter counts them
    # twice, with or without sub-batches): over x, q, k, v and up's outputs (7·t·d) and the
    # two norms' forward statistics [t, 2]
    tokens, b = 4 * CONFIG.seq_len, 4
    slow = local(1e8, BANDWIDTH, latency=0.0, devices_per_node=2)
    sub = Overlap(tp_subbatches=2)
    total = {}
    for recompute in ("none", "full"):
        plan = Plan(tp3d=(2, 1, 1), recompute=recompute, overlap=sub)
        cost = estimate(plan, CONFIG, slow, 4, dtype="fp32")
        total[recompute] = cost.breakdown["tp_x.all_reduce"] + cost.hidden["tp_x.all_reduce"]
    ring = 2 * (2 - 1) / 2 / BANDWIDTH
    d = CONFIG.d_model
    repeated = CONFIG.n_layers * (7 * tokens * d + 2 * tokens * 2) * b * ring
    assert total["full"] - total["none"] == pytest.approx(repeated)


def test_under_fsdp2_each_block_gathers_its_edges_on_the_spot():
    # z = 2, compute slow enough to hide every prefetched gather: replicated, the prefetch
    # runs across blocks and hides them all; under FSDP2 a block's pieces are gathered in its
    # own pre-forward and pre-backward, so q's forward gather and down's backward gather (the
    # block's first in either half) are exposed, half the block each on the wire
    grid, tokens, b, d = (1, 1, 2), 512, 4, CONFIG.d_model
    hardware = local(1e30, BANDWIDTH, latency=0.0, devices_per_node=64)
    replicated = layer_cost(CONFIG, grid, tokens, b, 1e3, hardware, prefetch=True)
    sharded = layer_cost(
        CONFIG, grid, tokens, b, 1e3, hardware, prefetch=True, scatter_in_backward=True
    )
    assert replicated.exposed.get("tp_z.all_gather", 0.0) == pytest.approx(0.0, abs=1e-15)
    q, down = d * d * b / 2 / BANDWIDTH, 4 * d * d * b / 2 / BANDWIDTH
    assert sharded.exposed["tp_z.all_gather"] == pytest.approx(q + down)
    both = {s: r.exposed.get("tp_z.all_gather", 0) + r.hidden.get("tp_z.all_gather", 0)
            for s, r in (("replicated", replicated), ("sharded", sharded))}  # fmt: skip
    assert both["sharded"] == pytest.approx(both["replicated"])
