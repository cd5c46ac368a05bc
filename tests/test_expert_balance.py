"""MoE balancing on count matrices: placements, the performance model worked out by hand, the
greedy searches, the strategies' replanning; and the expert-parallel layer's construction."""

import json
from dataclasses import replace

import pytest
import torch

from interlace.comm import Group
from interlace.errors import ConfigError, PlanError
from interlace.moe import MoELayer
from interlace.moe.balance import (
    ExpertSize,
    LayerCost,
    Placement,
    Prophet,
    Shadow,
    balance_degree,
    device_loads,
    layer_time,
    make_balancer,
    prophet_search,
    shadow_search,
)
from interlace.moe.experts import STORED_AS
from interlace.parallel.expert.grads import expert_parameter_names
from interlace.parallel.expert.layer import ExpertParallelMoE

# Two devices, expert e on device e. Device 0 routes 6 tokens to expert 0 and 2 to expert 1;
# device 1 routes 4 to expert 0 and none to expert 1.
COUNTS_2 = torch.tensor([[6, 2], [4, 0]])
COST_2 = LayerCost(token_bytes=2, expert_bytes=100, bandwidth=10, throughput=5)


def test_device_loads_without_and_with_a_replica():
    base = Placement.blocked(2, 2)
    computed, received = device_loads(COUNTS_2, base)
    assert computed.tolist() == [10, 2]  # device 0: its 6 + device 1's 4; device 1: 2
    assert received.tolist() == [4, 2]
    replicated = base.with_replicas(0, [1])  # device 1 computes its 4 tokens of expert 0
    computed, received = device_loads(COUNTS_2, replicated)
    assert computed.tolist() == [6, 6]
    assert received.tolist() == [0, 2]
    assert balance_degree(COUNTS_2, base) == pytest.approx(4.0)  # std of (10, 2)
    assert balance_degree(COUNTS_2, replicated) == 0.0


def test_performance_model_equals_hand_computation():
    base = Placement.blocked(2, 2)
    t = layer_time(COUNTS_2, base, COST_2)
    # A2A = max R · token_bytes / B = 4 · 2 / 10; FEC = max H / t = 10 / 5; BEC = 2 · FEC
    assert (t.a2a, t.fec, t.bec, t.trans, t.agg) == pytest.approx((0.8, 2.0, 4.0, 0.0, 0.0))
    assert t.total == pytest.approx(4 * 0.8 + 2.0 + 4.0)

    replicated = base.with_replicas(0, [1])
    t = layer_time(COUNTS_2, replicated, COST_2)
    # A2A = 2 · 2 / 10; FEC = 6 / 5; Trans = Agg = (D − n) · P / (D · B) = 2 · 100 / (2 · 10)
    assert (t.a2a, t.fec, t.bec, t.trans, t.agg) == pytest.approx((0.4, 1.2, 2.4, 10.0, 10.0))
    assert t.total == pytest.approx(1.6 + 1.2 + 2.4 + 10 + 10)

    hidden = LayerCost(2, 100, 10, 5, fnec=5.0, bnec=3.0, overlap=True)
    t = layer_time(COUNTS_2, replicated, hidden)
    # Trans − FEC − FNEC = 10 − 1.2 − 5; Agg − BEC − BNEC = 10 − 2.4 − 3
    assert (t.trans, t.agg) == pytest.approx((3.8, 4.6))
    t = layer_time(COUNTS_2, replicated, LayerCost(2, 100, 10, 5, fnec=50.0, overlap=True))
    assert t.trans == 0.0  # fully hidden, never negative


def test_trans_term_is_s_times_d_minus_n_over_d_for_a_uniform_exclusion_count():
    # D = 4; s = 2 experts each held by 3 devices (n = 1 excluded): s · (D − n) · P / (D · B)
    placement = Placement.blocked(4, 4).with_replicas(0, [1, 2]).with_replicas(3, [0, 1])
    cost = LayerCost(token_bytes=1, expert_bytes=40, bandwidth=2, throughput=1, grad_bytes=20)
    t = layer_time(torch.ones(4, 4, dtype=torch.long), placement, cost)
    assert t.trans == pytest.approx(2 * 3 * 40 / (4 * 2))
    assert t.agg == pytest.approx(2 * 3 * 20 / (4 * 2))


# Expert 0 (on device 0) is hot, its tokens mostly from devices 0, 1, 2; device 3 sends 1.
SKEWED = torch.tensor([[30, 2, 2, 2], [20, 2, 2, 2], [10, 2, 2, 2], [1, 2, 2, 2]])
COMPUTE_BOUND = LayerCost(token_bytes=1, expert_bytes=10, bandwidth=1000, throughput=1)
LINK_BOUND = LayerCost(token_bytes=1, expert_bytes=10_000, bandwidth=1, throughput=1000)


def test_prophet_replicates_the_hottest_expert_and_balances_the_devices():
    base = Placement.blocked(4, 4)
    placement = prophet_search(SKEWED, base, COMPUTE_BOUND)
    # all three other devices: device loads (30, 28, 18, 9) beat any smaller replica set
    assert placement.replicas == ((1, 2, 3), (), (), ())
    assert device_loads(SKEWED, placement)[0].tolist() == [30, 28, 18, 9]
    assert balance_degree(SKEWED, placement) < balance_degree(SKEWED, base) / 2
    assert layer_time(SKEWED, placement, COMPUTE_BOUND).total < (
        layer_time(SKEWED, base, COMPUTE_BOUND).total
    )


def test_a_searched_placement_holds_python_ints_that_json_writes():
    # the metrics row's balance summary lists the replicas as they are held
    placement = prophet_search(SKEWED, Placement.blocked(4, 4), COMPUTE_BOUND)
    devices = [d for replicas in placement.replicas for d in replicas]
    assert devices and all(type(d) is int for d in devices)
    assert json.loads(json.dumps(placement.replicas)) == [list(r) for r in placement.replicas]


def test_prophet_excludes_the_devices_holding_the_fewest_tokens():
    placement = prophet_search(SKEWED, Placement.blocked(4, 4), COMPUTE_BOUND, n_exclude=1)
    assert placement.replicas == ((1, 2), (), (), ())  # device 3 sends only 1 token


def test_prophet_keeps_the_best_prefix_so_a_slow_link_means_no_replicas():
    base = Placement.blocked(4, 4)
    assert prophet_search(SKEWED, base, LINK_BOUND) == base


def test_prophet_stops_once_the_devices_are_balanced_enough():
    balanced = torch.full((4, 4), 5)
    assert prophet_search(balanced, Placement.blocked(4, 4), COMPUTE_BOUND) == (
        Placement.blocked(4, 4)
    )


# Two devices, experts 0 and 1 on device 0. The hottest expert 0 comes mostly from device 1,
# so replicating it there overshoots (40, 80); from no replicas the greedy takes the smaller
# expert 1 instead (65, 55), and from shadowing's (40, 80) it hands expert 2 back to device 0.
OVERSHOOT = torch.tensor([[10, 5, 20, 0], [50, 25, 0, 10]])


def test_prophet_picks_the_replicas_that_balance_best_not_the_hottest():
    base = Placement.blocked(4, 2)
    placement = prophet_search(OVERSHOOT, base, COMPUTE_BOUND)
    shadow = shadow_search(OVERSHOOT, base, COMPUTE_BOUND)
    assert device_loads(OVERSHOOT, shadow)[0].tolist() == [40, 80]  # hottest first
    assert placement.replicas == ((1,), (), (0,), ())  # from shadowing's start
    assert device_loads(OVERSHOOT, placement)[0].tolist() == [60, 60]
    from_nothing = prophet_search(OVERSHOOT, base, COMPUTE_BOUND, n_exclude=0)
    assert from_nothing.replicas == ((), (1,), (), ())  # the greedy alone: (65, 55)
    assert balance_degree(OVERSHOOT, from_nothing) == 5.0  # shadow: 20
    assert balance_degree(OVERSHOOT, placement) == 0.0
    modelled = [layer_time(OVERSHOOT, p, COMPUTE_BOUND).total for p in (placement, from_nothing)]
    assert modelled[0] < modelled[1] < layer_time(OVERSHOOT, shadow, COMPUTE_BOUND).total


# Four devices; the hot expert 0 is requested by devices 1 and 2 only, the rest evenly.
SUBSET = torch.tensor([[10, 5, 5, 5], [40, 5, 5, 5], [40, 5, 5, 5], [0, 5, 5, 5]])


def test_prophet_replicates_on_the_requesting_subset_and_keeps_balancing():
    base = Placement.blocked(4, 4)
    placement = prophet_search(SUBSET, base, COMPUTE_BOUND)
    shadow = shadow_search(SUBSET, base, COMPUTE_BOUND)
    assert shadow.replicas[0] == (1, 2, 3)  # loads (10, 60, 60, 20): std 22.8
    assert placement.replicas[0] == (1, 2)  # device 3 sent none of expert 0's tokens
    # after expert 0, devices 1 and 2 tie at 60: smaller experts still spread the load
    assert len(placement.replicated) > 1
    assert device_loads(SUBSET, placement)[0].tolist() == [25, 50, 50, 25]
    assert balance_degree(SUBSET, placement) == 12.5
    assert layer_time(SUBSET, placement, COMPUTE_BOUND).total < (
        layer_time(SUBSET, shadow, COMPUTE_BOUND).total
    )


def test_prophet_replicates_when_trans_and_agg_hide_under_compute():
    base = Placement.blocked(4, 2)
    exposed = LayerCost(token_bytes=1, expert_bytes=150, bandwidth=1, throughput=1)
    hidden = LayerCost(token_bytes=1, expert_bytes=150, bandwidth=1, throughput=1, overlap=True)
    # base: 4 · R 75 + 3 · H 90 = 570. Expert 1 on device 1: H (65, 55), R 50, Trans = Agg =
    # 2 · 150 / 2 = 150 in full (695: not worth it), hidden to 150 − 65 and 150 − 130 (500)
    assert prophet_search(OVERSHOOT, base, exposed) == base
    placement = prophet_search(OVERSHOOT, base, hidden)
    assert placement.replicated
    assert layer_time(OVERSHOOT, placement, hidden).total <= 500
    assert Prophet().overlap is None and not Shadow().overlap  # prophet follows the layer


def test_prophet_rejects_an_exclusion_count_that_leaves_no_replica():
    with pytest.raises(ValueError, match=r"n_exclude=3 must be in \[0, 2\]"):
        prophet_search(SKEWED, Placement.blocked(4, 4), COMPUTE_BOUND, n_exclude=3)


def test_shadow_broadcasts_hottest_experts_while_the_modelled_time_falls():
    base = Placement.blocked(4, 4)
    placement = shadow_search(SKEWED, base, COMPUTE_BOUND)
    assert placement.replicas[0] == (1, 2, 3)  # the hottest, on every other device
    assert layer_time(SKEWED, placement, COMPUTE_BOUND).total < (
        layer_time(SKEWED, base, COMPUTE_BOUND).total
    )
    assert shadow_search(SKEWED, base, LINK_BOUND) == base


def test_shadow_matches_broadcasting_one_expert_at_a_time_on_random_counts():
    generator = torch.Generator().manual_seed(11)
    cost = replace(COMPUTE_BOUND, exchange=True, send_share=0.5, latency=1e-4, cores=2.0)
    for devices, experts in ((2, 4), (4, 8), (4, 4), (8, 16)):
        base = Placement.blocked(experts, devices)
        for _ in range(5):
            weights = torch.rand(experts, generator=generator) ** 3
            counts = torch.poisson(weights.expand(devices, experts) * 400, generator=generator)
            expected, current = base, layer_time(counts, base, cost).total
            for expert in sorted(range(experts), key=lambda e: (-counts[:, e].sum(), e)):
                trial = expected.with_replicas(expert, range(devices))
                if layer_time(counts, trial, cost).total >= current:
                    break
                expected, current = trial, layer_time(counts, trial, cost).total
            assert shadow_search(counts, base, cost) == expected


def test_searches_reject_a_count_matrix_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"shape \(4, 4\)"):
        prophet_search(torch.ones(2, 4), Placement.blocked(4, 4), COMPUTE_BOUND)


def test_strategies_replan_every_k_iterations_from_iteration_one():
    assert [i for i in range(10) if Prophet(replan_every=3).due(i)] == [1, 4, 7]
    assert [i for i in range(4) if Shadow().due(i)] == [1, 2, 3]
    assert not any(make_balancer("dropless").due(i) for i in range(4))
    assert make_balancer("none").dropless is None  # the router's own capacity decides
    assert make_balancer("prophet").dropless and make_balancer("shadow").dropless


def test_make_balancer_names_valid_choices():
    with pytest.raises(ConfigError, match="use one of none, dropless, shadow, prophet"):
        make_balancer("fastest")
    with pytest.raises(ConfigError, match="prophet"):
        make_balancer("prophet", replan_evry=3)
    with pytest.raises(ConfigError, match="bandwidth"):
        make_balancer("shadow", bandwidth=0)


def test_placement_needs_experts_divisible_by_devices():
    with pytest.raises(ValueError, match="divisible by 4"):
        Placement.blocked(6, 4)


def _fake_group(size: int, rank: int) -> Group:
    return Group("ep", pg=None, size=size, rank=rank)  # construction talks to nobody


def test_layer_keeps_its_experts_under_their_global_index():
    layer = MoELayer(8, 16, n_experts=4, top_k=2)
    parallel = ExpertParallelMoE(layer, _fake_group(2, 1), balance="prophet")
    assert list(parallel.experts) == ["2", "3"]
    copied = dict(parallel.experts["2"].named_parameters())
    for name, stacked in layer.experts.named_parameters():
        assert torch.equal(copied[STORED_AS[name]], stacked[2])
    assert parallel.router.dropless  # prophet is dropless
    names = expert_parameter_names(torch.nn.Sequential(parallel))
    assert names[0] == "0.experts.2.up.weight" and len(names) == 8
    assert parallel.expert_size.token_bytes == 8 * 4
    assert parallel.expert_size.expert_bytes == (2 * 8 * 16 + 16 + 8) * 4


def test_layer_rejects_experts_not_divisible_by_the_group():
    with pytest.raises(PlanError, match=r"3 experts cannot be split over ep=2"):
        ExpertParallelMoE(MoELayer(8, 16, n_experts=3), _fake_group(2, 0))


def test_prophet_replans_early_once_the_routing_drifts_from_its_placement():
    size = ExpertSize(token_bytes=1, expert_bytes=10, flops_per_token=1)
    prophet = Prophet(bandwidth=1000, flops=1, overlap=False)  # COMPUTE_BOUND's model
    base = Placement.blocked(4, 4)
    placed = prophet.search(SKEWED, base, size)
    assert placed.replicas[0]  # the hot expert 0 is replicated
    assert not prophet.stale(SKEWED, placed, base, size)
    drifted = SKEWED[:, [1, 0, 2, 3]]  # expert 1 (device 1's) is now the hot one
    assert prophet.stale(drifted, placed, base, size)
    assert not prophet.stale(drifted, prophet.search(drifted, base, size), base, size)
    tolerant = Prophet(bandwidth=1000, flops=1, overlap=False, drift=10.0)
    assert not tolerant.stale(drifted, placed, base, size)
    never = Prophet(bandwidth=1000, flops=1, overlap=False, drift=None)
    assert not never.stale(drifted, placed, base, size)
    assert not Shadow().stale(drifted, base, base, size)
    with pytest.raises(ConfigError, match=r"drift=-0\.1"):
        Prophet(drift=-0.1)


def test_the_layer_starts_a_search_when_due_or_stale_only():
    layer = MoELayer(8, 16, n_experts=4, top_k=1)
    prophet = Prophet(bandwidth=1e12, flops=1e6, overlap=False, replan_every=100)
    parallel = ExpertParallelMoE(layer, _fake_group(4, 0), balance=prophet)
    parallel.iteration = 1  # due
    parallel._start_plan(SKEWED)
    assert parallel._planning is not None
    parallel._replan()
    assert parallel.placement.replicas[0]
    parallel.iteration = 2  # not due, and the placement still fits the counts
    parallel._start_plan(SKEWED)
    assert parallel._planning is None
    parallel._start_plan(SKEWED[:, [1, 0, 2, 3]])  # drifted: stale
    assert parallel._planning is not None
    before = parallel.placement
    parallel._replan()
    assert parallel.placement.replicas[1] and parallel.placement != before
