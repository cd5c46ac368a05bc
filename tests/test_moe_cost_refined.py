"""The performance model's measured refinements worked out by hand (latency, send share,
Trans/Agg as an all-to-all, per-call expert latency, backward ratio, shared cores, routing
cost), the search's incremental loads, and the calibration's line fit on synthetic timings."""

import random
from dataclasses import fields, replace

import numpy as np
import pytest
import torch

from interlace.bench.moe_calibrate import fit_line, layer_cost
from interlace.bench.moe_overlap import hidden_share, probe_routing, replicated_everywhere
from interlace.moe.balance import (
    ExpertSize,
    LayerCost,
    Placement,
    Prophet,
    Shadow,
    layer_time,
    prophet_search,
    shadow_search,
)
from interlace.moe.balance.cost import (
    DeviceLoads,
    LayerTime,
    exchange_time,
    loads_time,
    shared_finish,
)
from interlace.moe.balance.search import _candidate_moves, _moved

# Two devices, expert e on device e. Device 0 routes 6 tokens to expert 0 and 2 to expert 1;
# device 1 routes 4 to expert 0 and none to expert 1.
COUNTS_2 = torch.tensor([[6, 2], [4, 0]])
REFINED = LayerCost(
    token_bytes=2,
    expert_bytes=100,
    bandwidth=10,
    throughput=5,
    grad_bytes=50,
    latency=0.1,
    send_share=0.5,
    exchange=True,
    expert_latency=0.01,
    backward_ratio=1.5,
    route_time=0.001,
)


def test_refined_terms_without_replicas_equal_hand_computation():
    t = layer_time(COUNTS_2, Placement.blocked(2, 2), REFINED)
    # H = (10, 2), R = (4, 2), S = (2, 4), A = (8, 4), one expert call per device
    # A2A = α + max(4 + 0.5·2, 2 + 0.5·4) · 2 / 10; FEC = max(10/5 + 0.01, 2/5 + 0.01)
    assert t.a2a == pytest.approx(0.1 + 5 * 2 / 10)
    assert t.fec == pytest.approx(2.01)
    assert t.bec == pytest.approx(1.5 * 2.01)
    assert (t.trans, t.agg) == (0.0, 0.0)
    assert t.local == pytest.approx(0.001 * 8)
    assert t.total == pytest.approx(4 * 1.1 + 2.01 + 3.015 + 0.008)


def test_refined_trans_and_agg_are_the_all_to_all_that_moves_the_replicas():
    replicated = Placement.blocked(2, 2).with_replicas(0, [1])
    t = layer_time(COUNTS_2, replicated, REFINED)
    # H = (6, 6), R = (0, 2), S = (2, 0); device 1 holds a replica: two expert calls
    assert t.a2a == pytest.approx(0.1 + max(0 + 0.5 * 2, 2 + 0) * 2 / 10)
    assert t.fec == pytest.approx(max(6 / 5 + 0.01, 6 / 5 + 0.02))
    # Trans: device 1 receives one expert (100 B), device 0 sends it: max(0 + 0.5, 1 + 0) · 100
    assert t.trans == pytest.approx(0.1 + 1 * 100 / 10)
    # Agg: the reverse with 50-byte gradients: device 0 receives, device 1 sends
    assert t.agg == pytest.approx(0.1 + 1 * 50 / 10)
    hidden = layer_time(
        COUNTS_2, replicated, LayerCost(**{**REFINED.__dict__, "fnec": 2.0, "overlap": True})
    )
    assert hidden.trans == pytest.approx(10.1 - 1.22 - 2.0)
    assert hidden.agg == pytest.approx(max(0.0, 5.1 - 1.5 * 1.22))


def test_overlap_hides_only_the_measured_share():
    replicated = Placement.blocked(2, 2).with_replicas(0, [1])
    overlapped = replace(REFINED, fnec=2.0, overlap=True)
    quarter = layer_time(COUNTS_2, replicated, replace(overlapped, hidden_share=0.25))
    # Trans 10.1 flies under FEC + FNEC = 1.22 + 2: what sticks out, plus 3/4 of the covered
    # part; Agg 5.1 under BEC = 1.83 alike
    assert quarter.trans == pytest.approx((10.1 - 3.22) + 0.75 * 3.22)
    assert quarter.agg == pytest.approx((5.1 - 1.83) + 0.75 * 1.83)
    nothing = layer_time(COUNTS_2, replicated, replace(overlapped, hidden_share=0.0))
    assert (nothing.trans, nothing.agg) == pytest.approx((10.1, 5.1))  # as without overlap
    long_cover = replace(overlapped, fnec=50.0, hidden_share=0.5)
    assert layer_time(COUNTS_2, replicated, long_cover).trans == pytest.approx(0.5 * 10.1)


def test_hidden_share_is_what_overlapping_removes_of_the_exposed_transfers():
    # no replicas 1 s, replicas run synchronously 2 s: Trans + Agg cost 1 s exposed
    assert hidden_share(1.0, 2.0, 1.0) == 1.0  # overlapped, they vanish
    assert hidden_share(1.0, 2.0, 2.0) == 0.0  # overlapping hid nothing
    assert hidden_share(1.0, 2.0, 1.5) == pytest.approx(0.5)
    assert hidden_share(1.0, 2.0, 2.5) == 0.0  # overlapping cost more: clipped
    assert hidden_share(1.0, 2.0, 0.9) == 1.0  # faster than no replicas: noise, clipped
    assert hidden_share(1.0, 0.9, 1.2) == 0.0  # no visible cost: nothing shown to hide


def test_the_overlap_probe_keeps_tokens_home_and_replicates_every_expert_everywhere():
    base = Placement.blocked(8, 4)
    placement = replicated_everywhere(base)
    assert placement.owner == base.owner
    assert placement.replicas[0] == (1, 2, 3) and placement.replicas[7] == (0, 1, 2)
    choices = probe_routing(12, base, 1)
    assert choices.shape == (12, 1)
    assert torch.bincount(choices.flatten(), minlength=8).tolist() == [0, 0, 6, 6, 0, 0, 0, 0]


def test_prophet_never_picks_worse_than_shadowing_under_its_own_model():
    """Shadowing's placements (hottest experts on every device) lie in Pro-Prophet's search
    space; its greedy path alone can miss a better one, so the search also starts from them."""
    generator = torch.Generator().manual_seed(0)
    for devices in (2, 4):
        for share in (1.0, 0.0):
            cost = LayerCost(
                512,
                5e5,
                1.3e8,
                7.5e4,
                send_share=1.0,
                exchange=True,
                expert_latency=2e-4,
                cores=2.0,
                overlap=True,
                hidden_share=share,
            )
            for _ in range(10):
                popularity = torch.rand(8, generator=generator) ** 4 + 0.01
                counts = torch.stack(
                    [
                        torch.bincount(
                            torch.multinomial(popularity, 4096, True, generator=generator),
                            minlength=8,
                        )
                        for _ in range(devices)
                    ]
                )
                base = Placement.blocked(8, devices)
                prophet = layer_time(counts, prophet_search(counts, base, cost), cost).total
                shadow = layer_time(counts, shadow_search(counts, base, cost), cost).total
                assert prophet <= shadow + 1e-12


def test_exchange_time_and_defaults_reduce_to_max_received_over_bandwidth():
    cost = LayerCost(token_bytes=1, expert_bytes=1, bandwidth=4, throughput=1)
    assert exchange_time((3.0, 8.0), (9.0, 0.0), 2, cost) == pytest.approx(8 * 2 / 4)
    shared = LayerCost(1, 1, 4, 1, latency=0.5, send_share=1.0)
    assert exchange_time((3.0, 8.0), (9.0, 0.0), 2, shared) == pytest.approx(0.5 + 12 * 2 / 4)


def test_shared_cores_follow_processor_sharing():
    # 4 devices on 2 cores with 1, 2, 3, 4 s of work alone: all at half speed until the first
    # ends at 2 s, then three at 2/3 speed (device 2's last second: 1.5 s), then two at full
    # speed (1 s each) -> 5.5 s
    assert shared_finish([4.0, 1.0, 3.0, 2.0], 2.0) == pytest.approx(5.5)
    assert shared_finish([1.0, 1.0, 1.0, 1.0], 2.0) == pytest.approx(2.0)
    assert shared_finish([0.0, 0.0, 0.0, 3.0], 1.0) == pytest.approx(3.0)
    assert shared_finish([4.0, 1.0], None) == 4.0
    assert shared_finish([4.0, 1.0], 2.0) == 4.0


def test_bad_refinements_are_refused():
    with pytest.raises(ValueError, match=r"send_share=1\.5"):
        LayerCost(1, 1, 1, 1, send_share=1.5)
    with pytest.raises(ValueError, match="latency=-1"):
        LayerCost(1, 1, 1, 1, latency=-1)
    with pytest.raises(ValueError, match="cores=0"):
        LayerCost(1, 1, 1, 1, cores=0)
    with pytest.raises(ValueError, match=r"hidden_share=1\.2"):
        LayerCost(1, 1, 1, 1, hidden_share=1.2)


def _same_loads(a: DeviceLoads, b: DeviceLoads) -> bool:
    return all(np.array_equal(getattr(a, f.name), getattr(b, f.name)) for f in fields(DeviceLoads))


def test_search_updates_loads_as_recomputing_them():
    rng = random.Random(3)
    counts = torch.tensor([[rng.randrange(50) for _ in range(8)] for _ in range(4)])
    table = counts.to(torch.float64).numpy()
    placement = Placement.blocked(8, 4)
    loads = DeviceLoads.of(counts, placement)
    for expert, devices in ((0, (1, 2)), (5, (0,)), (0, (3,)), (7, (0, 1, 2))):
        added = np.zeros((1, 4))
        added[0, list(devices)] = 1.0
        loads = _moved(loads, table, placement, np.array([expert]), added).at(0)
        placement = placement.with_replicas(expert, placement.replicas[expert] + devices)
        assert _same_loads(loads, DeviceLoads.of(counts, placement))


def test_a_batch_of_moves_is_modelled_as_each_move_alone():
    rng = random.Random(5)
    counts = torch.tensor([[rng.randrange(60) for _ in range(8)] for _ in range(4)])
    table = counts.to(torch.float64).numpy()
    placement = Placement.blocked(8, 4).with_replicas(2, (0, 3))
    cost = LayerCost(
        64, 4096, 1e6, 1e4, fnec=0.01, overlap=True, latency=1e-3, send_share=0.5,
        exchange=True, expert_latency=1e-4, cores=2.0, route_time=1e-7, hidden_share=0.3,
    )  # fmt: skip
    moves = [(0, (2,)), (0, (2, 3)), (2, (2,)), (7, (0, 1, 2)), (5, (3,))]  # fresh holders
    added = np.zeros((len(moves), 4))
    for m, (_, devices) in enumerate(moves):
        added[m, list(devices)] = 1.0
    loads = DeviceLoads.of(counts, placement)
    batch = _moved(loads, table, placement, np.array([e for e, _ in moves]), added)
    batched = loads_time(batch, cost)
    for m, (expert, devices) in enumerate(moves):
        alone = placement.with_replicas(expert, placement.replicas[expert] + devices)
        assert _same_loads(batch.at(m), DeviceLoads.of(counts, alone))
        modelled = layer_time(counts, alone, cost)
        for term in fields(LayerTime):
            assert getattr(batched, term.name)[m] == pytest.approx(getattr(modelled, term.name))


def test_candidate_moves_are_the_fresh_devices_of_every_cut():
    order = np.array([[2, 0, 3], [3, 1, 0]])  # [E = 2, D − 1 = 3], most tokens first
    fresh = np.array([[True, False, True], [False, True, True]])
    experts, added = _candidate_moves(order, fresh, None)
    as_sets = [(int(e), tuple(np.flatnonzero(row))) for e, row in zip(experts, added, strict=True)]
    # expert 0: cuts after device 2, then 2 (0 is held), then 2 and 3; expert 1 alike
    assert as_sets == [(0, (2,)), (0, (2, 3)), (1, (1,)), (1, (0, 1))]
    experts, added = _candidate_moves(order, fresh, 1)  # all devices but the one with fewest
    as_sets = [(int(e), tuple(np.flatnonzero(row))) for e, row in zip(experts, added, strict=True)]
    assert as_sets == [(0, (2,)), (1, (1,))]
    experts, _ = _candidate_moves(order, np.zeros_like(fresh), None)
    assert len(experts) == 0


def test_fit_line_recovers_synthetic_timings():
    rng = random.Random(0)
    xs = [256, 1024, 4096, 8192]
    ys = [0.0003 + 5e-6 * x * (1 + rng.uniform(-0.01, 0.01)) for x in xs]
    intercept, slope = fit_line(xs, ys)
    assert slope == pytest.approx(5e-6, rel=0.02)
    assert intercept == pytest.approx(0.0003, abs=2e-4)
    # a burst allowance makes small messages faster than the rate: the intercept would be
    # negative, so the fit goes through 0 (least squares slope Σxy / Σx²)
    xs, ys = [1.0, 2.0, 3.0], [0.5, 1.8, 2.9]
    assert fit_line(xs, ys) == pytest.approx((0.0, (0.5 + 3.6 + 8.7) / 14))
    with pytest.raises(ValueError, match="distinct x"):
        fit_line([1.0, 1.0], [2.0, 3.0])


def test_layer_cost_takes_every_calibrated_term():
    cal = {
        "link_Bps": 1e8,
        "expert_tokens_per_s": 1e5,
        "latency_s": 1e-4,
        "send_share": 0.9,
        "expert_latency_s": 2e-4,
        "backward_ratio": 1.7,
        "cores": 2.0,
    }
    assert layer_cost(cal, ExpertSize(512, 4096, 100)).hidden_share == 1.0  # not measured
    cost = layer_cost(cal | {"hidden_share": 0.3}, ExpertSize(512, 4096, 100), route_time=3e-6)
    assert cost.hidden_share == 0.3
    assert (cost.bandwidth, cost.throughput, cost.latency, cost.send_share) == (1e8, 1e5, 1e-4, 0.9)
    assert (cost.expert_latency, cost.backward_ratio, cost.cores, cost.route_time) == (
        2e-4,
        1.7,
        2.0,
        3e-6,
    )
    assert cost.exchange and (cost.token_bytes, cost.expert_bytes) == (512, 4096)


def test_a_strategy_searches_with_a_measured_model_when_given_one():
    measured = LayerCost(
        token_bytes=1, expert_bytes=1, bandwidth=7.0, throughput=3.0, latency=0.25, send_share=1.0
    )
    size = ExpertSize(token_bytes=16, expert_bytes=4096, flops_per_token=64)
    cost = Prophet(measured=measured, overlap=True).cost(size)
    assert (cost.token_bytes, cost.expert_bytes, cost.grad_bytes) == (16, 4096, None)
    assert (cost.bandwidth, cost.throughput, cost.latency, cost.send_share) == (7, 3, 0.25, 1)
    assert cost.overlap and not Shadow(measured=measured).cost(size).overlap
    paper = Prophet(bandwidth=7.0, flops=3.0 * 64).cost(size)
    assert (paper.latency, paper.send_share, paper.throughput) == (0.0, 0.0, 3.0)
