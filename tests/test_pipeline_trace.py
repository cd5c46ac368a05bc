"""The pipeline step recorder: exactly the expected forward / backward spans per rank, in each
schedule's order; no overlap on a rank; recomputations inside their backward (torch) or before
it (shifted); a valid Chrome trace; `--trace` checked before any work."""

import dataclasses
import itertools
import json

import pytest
import torch

from interlace.errors import ConfigError
from interlace.mesh import build_mesh
from interlace.models.gpt import build_model
from interlace.models.presets import get_preset
from interlace.parallel.pipeline.runner import PipelineRunner
from interlace.parallel.pipeline.trace import (
    StepRecorder,
    bubble_fraction,
    busy_seconds,
    check_trace_path,
    gather_spans,
    write_step_trace,
)
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.timeline import Span, spans_from_json, spans_to_json
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

CONFIG = dataclasses.replace(get_preset("tiny"), n_layers=4)
ROWS, LENGTH = 8, 16

# the order each rank runs its micro-batches in, written out by hand (pp=2, M=4)
EXPECTED = {
    "gpipe": {
        0: ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"],
        1: ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"],
    },
    "1f1b": {  # stage 0 warms up with P − s = 2 forwards, the last stage with 1
        0: ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
        1: ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
    },
}


def _recorded_step(plan_text: str, trace_path: str | None = None):
    plan = Plan.parse(plan_text)
    torch.manual_seed(0)
    runner = PipelineRunner(build_model(CONFIG), plan, build_mesh(plan))
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, CONFIG.vocab_size, (ROWS, LENGTH), generator=g) for _ in range(2))
    runner.step(x, y)  # torch's first step infers shapes with extra forwards
    recorder = StepRecorder(runner)
    with recorder.record():
        runner.step(x, y)
    runner.step(x, y)  # not recorded: the hooks are gone
    spans = gather_spans(recorder.spans, runner.pp.pg)
    if spans is not None and trace_path is not None:
        write_step_trace(spans, trace_path, title=plan_text)
    actions = getattr(runner.schedule, "trace", None)
    return {"spans": spans_to_json(spans or []), "actions": actions, "own": len(recorder.spans)}


def _disjoint(spans, rank) -> bool:
    mine = sorted((s for s in spans if s.rank == rank), key=lambda s: s.start)
    return all(a.end <= b.start for a, b in itertools.pairwise(mine))


def _names(spans, rank, categories=("forward", "backward")):
    return [
        s.name
        for s in sorted(spans, key=lambda s: s.start)
        if s.rank == rank and s.category in categories
    ]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_torch_schedules_record_each_forward_and_backward_in_order(schedule, tmp_path):
    path = tmp_path / "step.json"
    rank0, rank1 = run_ranks(
        2, _recorded_step, f"pp=2,micro_batches=4,schedule={schedule}", str(path), timeout=60
    )
    assert rank1["spans"] == [] and rank1["own"] == 8  # gathered on rank 0 only
    spans = spans_from_json(rank0["spans"])
    assert len(spans) == 16  # no recomputation, nothing else
    for rank in (0, 1):
        assert _names(spans, rank) == EXPECTED[schedule][rank]
        assert _disjoint(spans, rank)
        assert all(
            s.args["stage"] == rank and s.args["micro_batch"] == int(s.name[1:])
            for s in spans
            if s.rank == rank
        )
    # stage 1's forward of a micro-batch starts after stage 0's forward of it ended
    for i in range(4):
        f0, f1 = (next(s for s in spans if s.rank == r and s.name == f"F{i}") for r in (0, 1))
        assert f1.start >= f0.end
    document = json.loads(path.read_text())
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 16 and {e["pid"] for e in events} == {0, 1}
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_full_recompute_replays_inside_each_backward():
    rank0, _ = run_ranks(2, _recorded_step, "pp=2,micro_batches=4,schedule=1f1b,recompute=full")
    spans = spans_from_json(rank0["spans"])
    for rank in (0, 1):
        assert _names(spans, rank) == EXPECTED["1f1b"][rank]
        replays = [s for s in spans if s.rank == rank and s.category == "recompute"]
        assert len(replays) == 4 * 2  # every micro-batch, both layers of the stage
        for r in replays:
            b = next(s for s in spans if s.rank == rank and s.name == f"B{r.args['micro_batch']}")
            assert b.start <= r.start and r.end <= b.end


def test_shifted_schedule_spans_follow_its_actions():
    plan = "pp=2,micro_batches=4,schedule=shifted,recompute=full"
    rank0, rank1 = run_ranks(2, _recorded_step, plan, timeout=60)
    spans = spans_from_json(rank0["spans"])
    for rank, result in enumerate((rank0, rank1)):
        expected = [f"{a}{i}" for a, i in result["actions"] if a in ("F", "R", "B")]
        computed = _names(spans, rank, ("forward", "recompute", "backward"))
        assert computed == expected and "R0" in computed
        assert _disjoint(spans, rank)


def test_busy_time_and_bubble_of_hand_made_spans():
    spans = [
        Span(0, "F0", "forward", 0.0, 1.0),
        Span(0, "B0", "backward", 2.0, 2.0),
        Span(0, "R0", "recompute", 2.5, 0.5),  # nested in B0: counted once
        Span(1, "F0", "forward", 1.0, 1.0),
        Span(1, "B0", "backward", 2.0, 1.0),
    ]
    assert busy_seconds(spans, 0) == pytest.approx(3.0)
    assert busy_seconds(spans, 1) == pytest.approx(2.0)
    assert bubble_fraction(spans) == pytest.approx(((1 - 3 / 4) + (1 - 2 / 4)) / 2)


def test_trace_option_is_checked_before_any_work(tmp_path):
    assert check_trace_path(tmp_path / "t.json", pp=2) == tmp_path / "t.json"
    with pytest.raises(ConfigError, match=r"must end in \.json"):
        check_trace_path(tmp_path / "t.png", pp=2)
    with pytest.raises(ConfigError, match="does not exist or is not writable"):
        check_trace_path(tmp_path / "missing" / "t.json", pp=2)
    with pytest.raises(ConfigError, match="needs pp > 1"):
        check_trace_path(tmp_path / "t.json", pp=1)


def _train_traced(path: str):
    config = TrainConfig(
        model="tiny", steps=3, global_batch=8, eval_every=0, out=None, progress=False
    )
    plan = Plan.parse("pp=2,micro_batches=2,schedule=1f1b")
    trainer = Trainer(prepare_run(config, plan, 2), build_mesh(plan), trace=path)
    trainer.fit()


def test_trainer_traces_its_second_step(tmp_path):
    path = tmp_path / "train.json"
    run_ranks(2, _train_traced, str(path), timeout=60)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        names = [e["name"] for e in sorted(events, key=lambda e: e["ts"]) if e["pid"] == rank]
        assert names == [*_one_f_one_b(rank), "optimizer"]
    assert path.with_suffix(".png").exists()


def _one_f_one_b(rank: int) -> list[str]:
    """1F1B with pp=2, M=2: stage 0 warms up with both forwards."""
    return ["F0", "F1", "B0", "B1"] if rank == 0 else ["F0", "B0", "F1", "B1"]
