"""`profile_steps`: the chosen steps recorded by torch.profiler into the run folder (a Chrome
trace and an operator table per rank), flagged in their rows and left out of the throughput
means; impossible settings refused before any work."""

import gzip
import json

import pytest

from interlace.cli import main
from interlace.errors import ConfigError
from interlace.plan import Plan
from interlace.profiling import profile_window
from interlace.report import summarize
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig
from test_cli import read_rows, train_args


def test_the_window_settles_one_step_then_records_after_the_memory_step():
    assert profile_window(0, 2, 2, 10) == range(3, 6)
    assert profile_window(0, 0, 3, 10) == range(1, 5)  # no memory step: after the first
    assert profile_window(7, 2, 2, 10) == range(7, 10)  # a resumed run starts later
    assert profile_window(0, 2, 4, 6) == range(3, 6)  # cut at the run's end
    assert profile_window(0, 2, 0, 10) == range(0)


def _recorded_steps(trace: dict) -> list[str]:
    return sorted(e["name"] for e in trace["traceEvents"] if e["name"].startswith("ProfilerStep"))


def test_two_profiled_steps_are_written_flagged_and_left_out_of_the_means(tmp_path):
    config = TrainConfig(
        model="tiny",
        steps=7,
        global_batch=4,
        eval_every=0,
        out=str(tmp_path),
        progress=False,
        profile_steps=2,
    )
    report = Trainer(prepare_run(config, Plan(), 1)).fit()
    assert report["profile"] == ["profile/rank0.json.gz", "profile/rank0.txt"]
    assert report["profile_device_time"] is None  # no device: the CPU's table is host time
    trace = json.loads(gzip.decompress((tmp_path / "profile/rank0.json.gz").read_bytes()))
    assert len(_recorded_steps(trace)) == 2
    assert any(e["name"] == "aten::mm" for e in trace["traceEvents"])
    table = (tmp_path / "profile/rank0.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    rows = read_rows(tmp_path)
    # step 1 compiles, step 3 measures memory, step 4 settles the profiler, 5 and 6 recorded
    assert [r["step"] for r in rows if r.get("profiled")] == [4, 5, 6]
    steady = [r for r in rows[1:] if r["step"] not in (3, 4, 5, 6)]
    assert report["mean_step_time_s"] == pytest.approx(
        sum(r["step_time_s"] for r in steady) / len(steady)
    )
    assert summarize(rows)["mean_step_time_s"] == report["mean_step_time_s"]
    assert not list((tmp_path / "profile").glob(".*"))  # no temporaries left


def test_every_rank_writes_its_own_profile(tmp_path, capfd):
    out = tmp_path / "run"
    args = train_args(out, 5, "--nproc", "2", "--profile-steps", "1")
    assert main(args) == 0, capfd.readouterr().err
    for rank in (0, 1):
        trace = json.loads(gzip.decompress((out / f"profile/rank{rank}.json.gz").read_bytes()))
        assert len(_recorded_steps(trace)) == 1
    report = json.loads((out / "report.json").read_text())
    assert len(report["profile"]) == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"out": None}, "profile_steps needs a run folder"),
        ({"steps": 5}, r"profile_steps=2 needs steps >= 6 \(the first step and the memory"),
        ({"steps": 3, "measure_memory": False}, "profile_steps=2 needs steps >= 4"),
        ({"profile_steps": -1}, "profile_steps=-1 must be >= 0"),
    ],
)
def test_a_profile_that_cannot_happen_is_refused(change, message, tmp_path):
    settings = {"model": "tiny", "steps": 10, "out": str(tmp_path), "profile_steps": 2}
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{**settings, **change}).validate()


def test_the_cli_refuses_it_before_writing_anything(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(out, 3, "--profile-steps", "2")) != 0
    assert "profile_steps=2 needs steps >= 6" in capsys.readouterr().err
    assert not out.exists()
