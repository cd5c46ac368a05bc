"""Documented kinds of run, from the command line as a user starts them, past the step whose
memory is measured: every MoE balancing mode under expert parallelism (Pro-Prophet with one
expert per rank included), every dimension's own metrics (compression ratio, pipeline, FSDP
memory), and every recomputation mode under each layout that takes it. Each run must exit 0
and leave metrics.jsonl and report.json that strict JSON parsing reads (no NaN, no Infinity,
every line); its report must hold the measured memory of every rank.

Each run launches its ranks as `interlace train --nproc N` does (20-30 s on 2 cores), so the
matrix sits in the slow set that CI runs after `make test`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from interlace.cli import main
from interlace.errors import PlanError
from interlace.memory import MEASURED_STEP
from interlace.parallel.expert.options import MOE_BALANCES
from interlace.plan import RECOMPUTE_MODES, Plan

pytestmark = pytest.mark.slow

STEPS = MEASURED_STEP + 1
"""The measured step is the last: a run that fails there fails the test."""

FAST = ["--global-batch", "4", "--eval-batches", "1", "--no-progress", "--steps", str(STEPS)]


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def strict_loads(text: str):
    """`json.loads` that refuses NaN and Infinity, which Python's parser accepts by default."""
    return json.loads(text, parse_constant=_refuse_constant)


def _train(
    out: Path, model: str, plan_text: str, capfd: pytest.CaptureFixture[str], nproc: int = 0
):
    """Run `interlace train --nproc nproc` (0: the plan's world size) for `plan_text` into
    `out`; its metric rows and report, both parsed strictly."""
    nproc = nproc or Plan.parse(plan_text).world_size
    argv = ["train", "--model", model, *FAST, "--nproc", str(nproc), "--plan", plan_text]
    code = main([*argv, "--out", str(out)])
    assert code == 0, capfd.readouterr().err[-4000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [strict_loads(line) for line in lines]
    report = strict_loads((out / "report.json").read_text())
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(row["loss"]) for row in rows)
    memory = report["memory"]
    assert memory["step"] == STEPS and len(memory["per_rank"]) == nproc
    assert all(rank["activations"] > 0 for rank in memory["per_rank"]), memory
    assert rows[-1]["memory_measured"] is True
    return rows, report


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the launcher would set it in this process


@pytest.mark.parametrize("balance", MOE_BALANCES)
def test_every_balancing_mode_writes_strict_metrics_with_one_expert_per_rank(
    tmp_path, capfd, balance
):
    # moe-tiny has 4 experts: ep=4 puts one on each rank, Pro-Prophet's own setting
    rows, report = _train(tmp_path, "moe-tiny", f"ep=4,moe_balance={balance}", capfd, nproc=4)
    for row in rows:
        assert len(row["moe"]) > 0
        for layer in row["moe"]:
            assert len(layer["tokens"]) == 4 and sum(map(sum, layer["counts"])) > 0
    assert report["moe_load"]["steps"] == STEPS


def test_compressed_data_parallel_writes_its_ratio(tmp_path, capfd):
    rows, _ = _train(tmp_path, "tiny", "dp=2,grad_compression=sketch", capfd)
    assert all(row["compression_ratio"] > 0 for row in rows)


def test_pipeline_writes_strict_metrics(tmp_path, capfd):
    rows, report = _train(tmp_path, "tiny", "pp=2,micro_batches=2", capfd)
    assert report["world_size"] == 2 and report["plan"]["pp"] == 2
    assert all(row["comm_bytes"].get("pp", 0) > 0 for row in rows)


LAYOUTS = ("dp=2", "dp_shard=2", "dp_shard=2,tp=2", "tp=2", "pp=2,micro_batches=2")


def _runnable(layout: str, mode: str) -> bool:
    try:
        Plan.parse(f"{layout},recompute={mode}").validate(Plan.parse(layout).world_size)
    except PlanError:
        return False
    return True


@pytest.mark.parametrize(
    ("layout", "mode"),
    [(layout, mode) for layout in LAYOUTS for mode in RECOMPUTE_MODES if _runnable(layout, mode)],
)
def test_every_recompute_mode_runs_past_the_measured_step(tmp_path, capfd, layout, mode):
    _, report = _train(tmp_path, "tiny", f"{layout},recompute={mode}", capfd)
    assert report["plan"]["recompute"] == mode
