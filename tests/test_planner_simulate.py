"""The step simulator: schedule orders, agreement with cost.estimate, spans and --trace."""

from __future__ import annotations

import json

import pytest

from interlace.cli import main
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.cost import estimate
from interlace.planner.hardware import local
from interlace.planner.profile import model_profile, stages_of
from interlace.planner.simulate import schedule_order, simulate

SPEC = get_preset("bench-25m")
FREE_LINKS = local(5e10, 1e15, latency=0.0, devices_per_node=8)
SLOW_LINKS = local(5e10, 125e6, latency=1e-4, devices_per_node=8)
PLANS = [
    "dp=2",
    "dp=2,dp_overlap=false",
    "tp=2",
    "tp=2,tp_subbatches=2",
    "tp=2,sequence_parallel=true",
    "pp=2,micro_batches=4",
    "pp=2,micro_batches=4,schedule=gpipe",
    "pp=2,micro_batches=4,recompute=full",
    "pp=2,micro_batches=4,schedule=interleaved",
    "pp=4,micro_batches=8,schedule=interleaved",
    "pp=2,micro_batches=4,schedule=interleaved,virtual_stages=4",
    "pp=2,micro_batches=1,schedule=interleaved,virtual_stages=4",
    "pp=2,micro_batches=4,schedule=shifted,recompute=full",
    "pp=4,micro_batches=8,schedule=shifted,recompute=full",
    "dp=2,pp=2,micro_batches=2",
]


def test_schedule_orders():
    assert schedule_order("gpipe", 2, 0, 2) == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]
    # 1F1B, stage 0 of 2: one warm-up forward, then alternate, then the last backward
    assert schedule_order("1f1b", 2, 0, 3) == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("B", 0, 0),
        ("F", 2, 0),
        ("B", 1, 0),
        ("B", 2, 0),
    ]
    assert schedule_order("1f1b", 2, 1, 2) == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
    # interleaved, 2 ranks, 2 chunks, 2 micro-batches: chunk 0 of both, then chunk 1
    order = schedule_order("interleaved", 2, 0, 2, 2)
    assert order[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]
    assert sorted(order) == sorted([(k, mb, c) for k in "FB" for mb in range(2) for c in range(2)])


def free_links_step(plan: Plan, global_batch: int) -> float:
    """The step on free links by hand: the slowest stage's 3F + R FLOPs per token (R: its
    checkpointed forward) over a micro-batch's tokens, split by tp, at the fixed matmul rate,
    is T_mb; the step runs m of them plus the bubble (p − 1)/v · T_mb (v = 2 interleaved unless
    the plan names its virtual_stages), but never less than p · T_mb: with fewer micro-batches
    than stages one micro-batch still passes every rank in turn. The shifted schedule
    recomputes min(m, p − 1) micro-batches inside the bubble instead."""
    m, p = plan.micro_batches, plan.pp
    ratios = (1.0 if plan.recompute == "full" else 0.0,) * p
    stage = max(
        stages_of(model_profile(SPEC), p, ratios), key=lambda st: 3 * st.flops + st.recompute_flops
    )
    tokens = global_batch // plan.dp // m * SPEC.seq_len
    per_flop = tokens / plan.tp / FREE_LINKS.peak("fp32")
    work, replay = 3 * stage.flops * per_flop, stage.recompute_flops * per_flop
    if plan.schedule == "shifted":
        return (m + p - 1) * work + (m - min(m, p - 1) + p - 1) * replay
    v = (plan.virtual_stages or 2) if plan.schedule == "interleaved" else 1
    return max(m + (p - 1) / v, p) * (work + replay)


@pytest.mark.parametrize("plan", PLANS)
def test_simulation_and_estimate_match_the_hand_step_when_transfers_are_free(plan):
    sim = simulate(Plan.parse(plan), SPEC, FREE_LINKS, 8, dtype="fp32")
    cost = estimate(Plan.parse(plan), SPEC, FREE_LINKS, 8, dtype="fp32")
    expected = free_links_step(Plan.parse(plan), 8)
    assert cost.step_seconds == pytest.approx(expected, rel=1e-6)
    # uniform stages, m a multiple of p: the schedules reproduce (m + (p − 1)/v) · T_mb
    assert sim.step_seconds == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("plan", PLANS)
def test_simulation_within_a_few_percent_on_slow_links(plan):
    """The estimate charges every pipeline transfer serially; the simulation only those on
    the critical path, so it is shorter by at most the pp.send_recv term."""
    sim = simulate(Plan.parse(plan), SPEC, SLOW_LINKS, 8, dtype="fp32")
    cost = estimate(Plan.parse(plan), SPEC, SLOW_LINKS, 8, dtype="fp32")
    send = cost.breakdown.get("pp.send_recv", 0.0)
    assert cost.step_seconds - send - 1e-9 <= sim.step_seconds <= cost.step_seconds + 1e-9
    assert sim.step_seconds == pytest.approx(cost.step_seconds, rel=0.06)


def test_hand_computed_pipeline_timeline():
    """pp=2, m=2, GPipe, free links: each stage's forward f and backward b per micro-batch
    are the estimate's compute/m split 1:2; the step is (m + p − 1)(f + b)."""
    plan = Plan.parse("pp=2,micro_batches=2,schedule=gpipe")
    sim = simulate(plan, SPEC, FREE_LINKS, 4, dtype="fp32")
    cost = estimate(plan, SPEC, FREE_LINKS, 4, dtype="fp32")
    per_mb = cost.breakdown["compute"] / 2
    f, b = per_mb / 3, 2 * per_mb / 3
    assert sim.step_seconds == pytest.approx(3 * (f + b), rel=1e-6)
    stage1 = sorted(
        (s for s in sim.spans if s.rank == 1 and s.lane == "compute"), key=lambda s: s.start
    )
    assert [s.name for s in stage1] == ["F0.0", "F1.0", "B0.0", "B1.0"]
    assert stage1[0].start == pytest.approx(f, rel=1e-6)  # waits for stage 0's first forward
    assert {s.rank for s in sim.spans} == {0, 1}


def test_spans_show_hidden_and_exposed_communication():
    sim = simulate(Plan.parse("dp=2"), SPEC, SLOW_LINKS, 8, dtype="fp32")
    names = {s.name for s in sim.spans}
    assert {"dp.all_reduce", "dp.all_reduce (hidden)"} <= names
    tp = simulate(Plan.parse("tp=2,tp_subbatches=2"), SPEC, SLOW_LINKS, 8, dtype="fp32")
    lanes = {(s.lane, s.category) for s in tp.spans}
    assert ("comm", "comm") in lanes and ("compute", "forward") in lanes
    shifted = simulate(
        Plan.parse("pp=2,micro_batches=4,schedule=shifted,recompute=full"),
        SPEC,
        FREE_LINKS,
        8,
        dtype="fp32",
    )
    assert any(s.category == "recompute" for s in shifted.spans)


def test_plan_trace_cli(tmp_path, capsys):
    out = tmp_path / "step.json"
    argv = ["plan", "--model", "bench-25m", "--hardware", "dgx-a100", "--global-batch", "8"]
    assert main([*argv, "--plan", "pp=2,micro_batches=4", "--trace", str(out)]) == 0
    assert "simulated step" in capsys.readouterr().out
    events = json.loads(out.read_text())["traceEvents"]
    assert any(e["ph"] == "X" and e["name"].startswith("F0") for e in events)
    assert out.with_suffix(".png").stat().st_size > 0
