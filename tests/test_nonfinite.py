"""The non-finite guard: a step whose gradient turns NaN leaves weights and AdamW state bit for
bit as they were, on every rank; `--on-nonfinite stop` and too many skipped steps in a row stop
the run with one line and exit code 4; no checkpoint is written from a bad state, so the good
ones are never rotated out; metrics.jsonl and report.json stay strict JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from interlace.checkpoint import checkpoint_name
from interlace.cli import main
from interlace.mesh import build_mesh
from interlace.nonfinite import NonFiniteGuard
from interlace.parallel.parallelized import Parallelized
from interlace.plan import Plan
from interlace.precision import reads_amp_hooks
from interlace.tensors import local_tensor
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig
from test_cli import checkpoint_dir, train_args

BASE = TrainConfig(
    model="tiny", steps=4, global_batch=8, eval_every=0, out=None, progress=False, warmup_steps=1
)


def strict_rows(out: Path) -> list[dict]:
    """metrics.jsonl's rows, parsed so that a bare NaN or Infinity fails."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=_refuse) for line in lines]


def _refuse(constant: str):
    raise AssertionError(f"{constant} is not JSON")


def _snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Copies of every weight and every entry of the optimizer's state (moments, step counts)."""
    state = {f"weight {k}": v.detach().clone() for k, v in trainer.model.state_dict().items()}
    for index, entry in trainer.optimizer.state_dict()["state"].items():
        state |= {f"optimizer {index}.{k}": torch.as_tensor(v).clone() for k, v in entry.items()}
    return state


def _assert_bit_identical(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, changed


def _poison_in_backward(trainer: Trainer, step: int, rank: int = 0, value=math.nan) -> None:
    """Make one gradient `value` on data-parallel `rank` while step `step` (1-based) runs
    backward, before any gradient reduction, as an overflow in the backward pass would."""
    param = next(trainer.model.parameters())
    poisoned = trainer.dp_rank == rank

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if poisoned and trainer.step == step - 1:
            return torch.full_like(grad, value)
        return grad

    param.register_hook(hook)


def _steps_around_a_poisoned_one(world_size: int):
    plan = Plan(dp=world_size)
    trainer = Trainer(
        prepare_run(BASE, plan, world_size), build_mesh(plan) if world_size > 1 else None
    )
    _poison_in_backward(trainer, step=3, rank=world_size - 1)
    rows = [trainer.train_step() for _ in range(2)]
    before = _snapshot(trainer)
    rows.append(trainer.train_step())
    after = _snapshot(trainer)
    rows.append(trainer.train_step())
    return rows, before, after, _snapshot(trainer)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_nan_gradient_skips_its_step_leaving_weights_and_optimizer_bit_identical(world_size):
    # with 2 ranks the NaN appears on rank 1 alone and reaches rank 0 through the all-reduce
    if world_size == 1:
        results = [_steps_around_a_poisoned_one(1)]
    else:
        results = run_ranks(world_size, _steps_around_a_poisoned_one, world_size)
    for rows, before, after, later in results:
        assert [bool(r.get("skipped")) for r in rows] == [False, False, True, False]
        assert math.isnan(rows[2]["grad_norm"]) and math.isfinite(rows[2]["loss"])
        _assert_bit_identical(before, after)
        assert all(torch.isfinite(v).all() for v in later.values())
        assert any(not torch.equal(later[k], after[k]) for k in after)  # and it goes on
    for rows, *_ in results[1:]:  # every rank takes the same decision
        assert [r.get("skipped") for r in rows] == [r.get("skipped") for r in results[0][0]]


@pytest.fixture
def poison_from(monkeypatch):
    """poison_from(k): every gradient synced from the k-th optimizer step on is NaN."""

    def install(first_step: int) -> None:
        real = Parallelized.sync_gradients
        calls = []

        def sync_gradients(self):
            real(self)
            calls.append(None)
            if len(calls) >= first_step:
                for param in self.model.parameters():
                    param.grad.fill_(math.nan)

        monkeypatch.setattr(Parallelized, "sync_gradients", sync_gradients)

    return install


def _local_snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    """`_snapshot` of this rank's shards: every weight and optimizer state entry, local."""
    state = {
        f"weight {k}": local_tensor(v).detach().clone()
        for k, v in trainer.model.state_dict().items()
    }
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        for key, value in trainer.optimizer.state[param].items():
            state[f"optimizer {index}.{key}"] = local_tensor(value).detach().clone()
    return state


def _sharded_steps_around_a_poisoned_third():
    plan = Plan.parse("dp_shard=2")
    trainer = Trainer(prepare_run(BASE, plan, 2), build_mesh(plan))
    assert reads_amp_hooks(trainer.optimizer)  # every parameter a DTensor: one fused step
    rows = [trainer.train_step() for _ in range(2)]
    before = _local_snapshot(trainer)
    rows.append(trainer.train_step())
    return rows, before, _local_snapshot(trainer)


def test_under_fsdp_the_fused_step_skips_a_nan_gradient_on_the_sharded_parameters(poison_from):
    poison_from(3)
    for rows, before, after in run_ranks(2, _sharded_steps_around_a_poisoned_third):
        assert [bool(r.get("skipped")) for r in rows] == [False, False, True]
        _assert_bit_identical(before, after)


def _error_line(capsys) -> str:
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step-*"))


def test_on_nonfinite_stop_exits_4_with_one_line_and_keeps_the_good_checkpoints(
    capsys, tmp_path, poison_from
):
    poison_from(3)
    out = tmp_path / "run"
    args = train_args(out, 6, "--on-nonfinite", "stop", "--ckpt-every", "1")
    capsys.readouterr()
    assert main(args) == 4
    line = _error_line(capsys)
    assert line.startswith("interlace: error: step 3: the gradient norm is nan (on_nonfinite=stop)")
    assert _checkpoints(out) == [checkpoint_name(1), checkpoint_name(2)]
    assert checkpoint_dir(out).name == checkpoint_name(2)
    rows = strict_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["grad_norm"] is None and rows[2]["nonfinite"] == {"grad_norm": "nan"}
    assert rows[2]["skipped"] is True and "skipped" not in rows[1]


def test_skips_in_a_row_beyond_the_limit_stop_and_never_rotate_out_a_good_checkpoint(
    capsys, tmp_path, poison_from
):
    poison_from(3)
    out = tmp_path / "run"
    args = train_args(out, 10, "--ckpt-every", "1", "--keep-checkpoints", "2")
    capsys.readouterr()
    assert main([*args, "--max-nonfinite-skips", "3"]) == 4
    line = _error_line(capsys)
    assert "step 6: the gradient norm is nan, 4 non-finite steps in a row" in line
    assert "max_nonfinite_skips=3" in line
    # steps 3-5 were skipped and saved nothing: the checkpoints of steps 1 and 2 remain
    assert _checkpoints(out) == [checkpoint_name(1), checkpoint_name(2)]
    assert [bool(r.get("skipped")) for r in strict_rows(out)] == [False] * 2 + [True] * 4


def test_a_weight_gone_infinite_is_never_checkpointed(capsys, tmp_path, monkeypatch):
    real = Parallelized.optimizer_step
    calls = []

    def optimizer_step(self, optimizer):
        real(self, optimizer)
        calls.append(None)
        if len(calls) == 2:  # the update of step 2 overflows one weight
            next(self.model.parameters()).data[0] = math.inf

    monkeypatch.setattr(Parallelized, "optimizer_step", optimizer_step)
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(train_args(out, 4, "--ckpt-every", "1")) == 4
    assert "step 2: a weight is no longer finite" in _error_line(capsys)
    assert _checkpoints(out) == [checkpoint_name(1)]


def test_a_huge_learning_rate_writes_strict_json(capsys, tmp_path):
    out = tmp_path / "run"
    args = train_args(out, 4, "--lr", "1e6", "--max-nonfinite-skips", "9", "--eval-every", "2")
    assert main(args) == 0
    rows = strict_rows(out)
    skipped = [r["step"] for r in rows if r.get("skipped")]
    assert skipped and all(rows[s - 1]["nonfinite"] for s in skipped)
    report = json.loads((out / "report.json").read_text(), parse_constant=_refuse)
    assert report["skipped_steps"] == len(skipped)
    assert f"{len(skipped)} steps skipped (non-finite)" in capsys.readouterr().out
    assert main(train_args(tmp_path / "stops", 8, "--lr", "1e6")) == 4  # 3 skips at most


def test_fp16_overflow_is_left_to_the_scaler_but_a_nan_loss_counts():
    guard = NonFiniteGuard("skip", max_skips=1, scaled=True)
    overflow = {"step": 1, "loss": 2.0, "grad_norm": math.inf}
    assert all(guard.stop_reason({**overflow, "step": s}) is None for s in range(1, 10))
    assert guard.stop_reason({"step": 10, "loss": math.nan, "grad_norm": math.nan}) is None
    assert "2 non-finite steps in a row" in guard.stop_reason(
        {"step": 11, "loss": math.nan, "grad_norm": math.nan}
    )
    unscaled = NonFiniteGuard("skip", max_skips=1, scaled=False)
    assert unscaled.stop_reason(overflow) is None
    assert unscaled.stop_reason({**overflow, "step": 2}) is not None


def test_an_fp16_overflow_is_skipped_by_the_scaler_which_lowers_its_scale():
    trainer = Trainer(prepare_run(dataclasses.replace(BASE, precision="fp16"), Plan(), 1))
    _poison_in_backward(trainer, step=3, value=math.inf)
    rows = [trainer.train_step() for _ in range(2)]
    before, scale = _snapshot(trainer), trainer.parallel.scaler.get_scale()
    rows.append(trainer.train_step())
    _assert_bit_identical(before, _snapshot(trainer))
    assert trainer.parallel.scaler.get_scale() == scale / 2  # the scaler saw the overflow
    rows.append(trainer.train_step())
    assert [bool(r.get("skipped")) for r in rows] == [False, False, True, False]
