"""Pro-Prophet's planning overlapped with the all-to-all: the placement search runs on a
background thread from the gathered counts and is applied at the next training iteration; the
loss, gradients and placements are those of the synchronous search. And the strategy's overlap
flag follows the layer's scheduler."""

import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

from helpers import assert_grads_close
from interlace import comm
from interlace.comm import CommMeter, Group
from interlace.moe import MoELayer
from interlace.moe.balance import BackgroundSearch, ExpertSize, Placement, Prophet, Shadow
from interlace.parallel.expert.apply import parallelize_experts
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.testing import run_ranks
from test_expert_balance import OVERSHOOT, _fake_group
from test_expert_parallel import FAST_LINK, _balanced_steps, _moe, _rank_inputs, _world_group


def test_prophet_with_background_planning_equals_dropless_and_the_synchronous_search():
    balancer = Prophet(**FAST_LINK)
    results = run_ranks(2, _balanced_steps, balancer, steps=4)
    # the synchronous search, run here on the counts each step gathered
    reference = ExpertParallelMoE(_moe(4, 2, skew=3.0), _fake_group(2, 0), balancer)
    base = Placement.blocked(4, 2)
    replicated_somewhere = False
    for rows in results:
        for step, row in enumerate(rows):
            plain, balanced = row["dropless"], row["balanced"]
            torch.testing.assert_close(balanced["loss"], plain["loss"], atol=1e-5, rtol=1e-5)
            assert balanced["grads"].keys() == plain["grads"].keys()
            assert_grads_close(balanced["grads"], plain["grads"], what=f"step {step}")
            if step == 0:
                assert balanced["placement"] == base  # nothing to plan from yet
                assert "plan_search_s" not in balanced["summary"]
                continue
            counts = rows[step - 1]["balanced"]["counts"]
            expected = reference.balancer.search(counts, base, reference.expert_size)
            assert balanced["placement"] == expected
            summary = balanced["summary"]
            assert summary["plan_iteration"] == step
            assert summary["plan_search_s"] > 0
            assert summary["plan_wait_s"] >= 0 and summary["plan_hidden_s"] >= 0
            replicated_somewhere |= bool(expected.replicated)
    assert replicated_somewhere


class _Probe:
    """Per rank: set when the layer issues an all-to-all after its count all-gather (the
    dispatch); what each search saw."""

    dispatched: ClassVar[threading.Event] = threading.Event()
    searches: ClassVar[list[dict]] = []


class _ProbeMeter(CommMeter):
    """A meter that flags the dispatch that follows each count all-gather to `_Probe`."""

    def record(self, op: str, group: Group, payload: int, seconds: float | None = None) -> None:
        """Count the call; an all-gather re-arms the flag, the next all-to-all sets it."""
        super().record(op, group, payload, seconds)
        if op == "all_gather":
            _Probe.dispatched.clear()
        elif op == "all_to_all":
            _Probe.dispatched.set()


SEARCH_SLEEP = 0.3


@dataclass(frozen=True)
class _SlowProphet(Prophet):
    """Prophet whose search first waits (at most 5 s) for the layer's dispatch, then sleeps."""

    def search(self, counts, base, size):
        """Prophet's placement, after the wait; notes its thread and what it saw."""
        saw_dispatch = _Probe.dispatched.wait(timeout=5.0)
        time.sleep(SEARCH_SLEEP)
        _Probe.searches.append(
            {
                "main_thread": threading.current_thread() is threading.main_thread(),
                "saw_dispatch": saw_dispatch,
                "end": time.perf_counter(),
            }
        )
        return super().search(counts, base, size)


def _slow_search_steps():
    """Two training steps of one ep=2 layer whose search waits for the dispatch, then sleeps."""
    group = _world_group()
    balancer = _SlowProphet(**(FAST_LINK | {"replan_every": 10}))  # one search: for step 1
    layer = ExpertParallelMoE(_moe(4, 2, skew=3.0), group, balancer)
    default, comm.meter = comm.meter, _ProbeMeter()
    forward_ends = []
    try:
        for step in range(2):
            x, w = _rank_inputs(group.rank + 10 * step, shift=1.5)
            out = layer(x)
            forward_ends.append(time.perf_counter())
            (out * w).sum().backward()
            layer.zero_grad(set_to_none=True)
    finally:
        comm.meter = default
    return _Probe.searches, forward_ends, layer.plan_timing


def test_the_search_runs_on_another_thread_while_the_layer_communicates():
    for searches, forward_ends, timing in run_ranks(2, _slow_search_steps):
        assert len(searches) == 1
        (search,) = searches
        assert not search["main_thread"]
        assert search["saw_dispatch"]  # it was running when the dispatch all-to-all was issued
        assert forward_ends[0] < search["end"]  # the forward did not wait for it
        assert timing.iteration == 1
        assert timing.search_s >= SEARCH_SLEEP
        assert timing.wait_s < timing.search_s and timing.hidden_s > 0


@dataclass(frozen=True)
class _FailingProphet(Prophet):
    def search(self, counts, base, size):
        """Always fails."""
        raise RuntimeError("search failed on purpose")


def _failing_search_steps():
    group = _world_group()
    layer = ExpertParallelMoE(_moe(4, 2), group, _FailingProphet(replan_every=1))
    x, _ = _rank_inputs(group.rank)
    layer(x)  # starts the search for the next iteration
    try:
        layer(x)
    except RuntimeError as exc:
        dist.barrier()  # both ranks raised at the same point
        return str(exc)
    return None


def test_an_exception_in_the_search_surfaces_at_the_next_forward():
    assert run_ranks(2, _failing_search_steps) == ["search failed on purpose"] * 2


def test_background_search_returns_its_placement_or_raises_on_the_joining_thread():
    base = Placement.blocked(2, 2)
    placement, timing = BackgroundSearch(lambda: base, "test-plan").result(iteration=3)
    assert placement == base and timing.iteration == 3

    def fail() -> Placement:
        raise ValueError("bad counts")

    with pytest.raises(ValueError, match="bad counts"):
        BackgroundSearch(fail, "test-plan").result(iteration=1)


# On OVERSHOOT, replicating expert 1 on device 1 pays only when Trans and Agg hide under
# compute (test_prophet_replicates_when_trans_and_agg_hide_under_compute).
HEAVY_EXPERT = ExpertSize(token_bytes=1, expert_bytes=150, flops_per_token=2)


def _layer(balance, overlap: bool) -> ExpertParallelMoE:
    return ExpertParallelMoE(MoELayer(8, 16, 4, top_k=2), _fake_group(2, 0), balance, 4, overlap)


def test_prophet_prices_trans_and_agg_as_the_layer_schedules_them():
    assert Prophet().overlap is None  # follows the layer
    assert _layer("prophet", overlap=True).balancer.overlap is True
    assert _layer("prophet", overlap=False).balancer.overlap is False
    # an explicit choice is kept; shadow prices FasterMoE's broadcasts in full
    assert _layer(Prophet(overlap=True), overlap=False).balancer.overlap is True
    assert _layer(Prophet(overlap=False), overlap=True).balancer.overlap is False
    assert _layer("shadow", overlap=True).balancer.overlap is False
    assert _layer(Shadow(overlap=True), overlap=False).balancer.overlap is True

    prophet = Prophet(replan_every=1, bandwidth=1, flops=2)  # throughput 1 token/s
    base = Placement.blocked(4, 2)
    hidden = _layer(prophet, overlap=True).balancer.search(OVERSHOOT, base, HEAVY_EXPERT)
    exposed = _layer(prophet, overlap=False).balancer.search(OVERSHOOT, base, HEAVY_EXPERT)
    assert hidden.replicated and exposed == base


def test_parallelize_experts_binds_every_layer_to_its_overlap():
    model = torch.nn.Sequential(MoELayer(8, 16, 4), MoELayer(8, 16, 4))
    parallelize_experts(model, _fake_group(2, 1), "prophet", overlap=False)
    assert [m.balancer.overlap for m in model] == [False, False]
