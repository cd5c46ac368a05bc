"""`interlace train --plan auto`: the planner's choice for this machine, printed and run."""

from __future__ import annotations

import json

import pytest

from helpers import fake_calibration
from interlace.cli import _choose_plan, build_parser, main
from interlace.errors import ConfigError
from interlace.models.presets import get_preset
from interlace.planner import calibrate as cal
from interlace.planner.auto import choose_plan, describe_choice
from interlace.planner.hardware import local
from interlace.planner.profile import model_profile
from interlace.train import prepare_run
from interlace.train_config import TrainConfig


@pytest.fixture
def cached_calibration(tmp_path, monkeypatch):
    calibration = fake_calibration(matmul_flops={"fp32": {"1": 5e10, "2": 9e10}})
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(calibration.to_dict()))
    monkeypatch.setenv(cal.CACHE_ENV, str(path))


def test_choose_plan_is_the_fastest_runnable_plan_the_run_accepts():
    config = TrainConfig(model="demo", global_batch=8, out=None)
    hardware = local(5e10, 1e8, latency=1e-4, devices_per_node=2)
    chosen, ranked = choose_plan(config, 2, hardware)
    assert chosen is ranked[0]
    assert chosen.step_seconds == min(c.step_seconds for c in ranked)
    assert {str(c.plan) for c in ranked} >= {"dp=2", "tp=2"}
    prepare_run(config, chosen.plan, 2)  # runnable as the run is configured
    # priced in fp32 at the run's batch: dp=2 by hand, 4 sequences of 128 tokens per rank at
    # 5e10 FLOP/s, then the fp32 gradients' all-reduce (2 ring steps of α, as many wire bytes
    # as the gradient; one DDP bucket, so it stays exposed); no optimizer term (memory
    # bandwidth unmeasured)
    dp2 = next(c for c in ranked if str(c.plan) == "dp=2")
    spec = get_preset("demo")
    compute = 3 * model_profile(spec).forward_flops_per_token * 4 * 128 / 5e10
    all_reduce = 2 * 1e-4 + 4 * spec.num_params() / 1e8
    assert dp2.breakdown == pytest.approx(
        {"compute": compute, "recompute": 0.0, "dp.all_reduce": all_reduce}, rel=1e-12
    )
    assert dp2.step_seconds == pytest.approx(compute + all_reduce, rel=1e-12)
    text = describe_choice(chosen, ranked)
    assert f"chose {chosen.plan}" in text and "next best" in text
    with pytest.raises(ConfigError, match="none of the"):
        choose_plan(TrainConfig(model="demo", global_batch=4, micro_batch=3, out=None), 2, hardware)


def test_choose_plan_prices_the_run_in_its_precision():
    """A bf16 run is priced at the bf16 matmul rate (4x the fp32 one here), an auto run on the
    CPU in fp32."""
    hardware = local({"fp32": 5e10, "bf16": 2e11}, 1e8, latency=1e-4, devices_per_node=2)
    compute = {}
    for precision in ("auto", "bf16"):
        config = TrainConfig(model="demo", global_batch=8, out=None, precision=precision)
        _, ranked = choose_plan(config, 2, hardware)
        compute[precision] = next(c for c in ranked if str(c.plan) == "dp=2").breakdown["compute"]
    flops = 3 * model_profile(get_preset("demo")).forward_flops_per_token * 4 * 128
    assert compute == pytest.approx({"auto": flops / 5e10, "bf16": flops / 2e11}, rel=1e-12)


def test_choose_plan_replaces_auto_in_the_ranks_argv(cached_calibration, capsys):
    argv = ["--model", "tiny", "--nproc", "2", "--plan", "auto", "--global-batch", "8"]
    args = build_parser().parse_args(["train", *argv])
    config = TrainConfig(model="tiny", global_batch=8, out=None)
    out = _choose_plan(args, argv, config)
    assert args.plan != "auto" and out[out.index("--plan") + 1] == args.plan
    assert "plan auto: chose" in capsys.readouterr().out
    assert _choose_plan(args, ["--plan=auto"], config) == [f"--plan={args.plan}"]


def test_train_plan_auto_runs(cached_calibration, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny", "--plan", "auto", "--steps", "2", "--global-batch", "4"]
    assert main([*argv, "--eval-every", "0", "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "plan auto: chose dp=1" in printed and "done: 2 steps" in printed
    assert json.loads((out / "report.json").read_text())["plan_str"] == "dp=1"
