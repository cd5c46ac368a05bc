"""Mixture-of-Experts models in pipelines: with and without expert parallelism, every stage's
load-balancing loss reaches the loss and the gradients, and each plan trains step for step as
one process accumulating the same micro-batches (fp32: losses, pre-clipping norms, the first
step's gradients and the weights after three steps; capacity routing and the auxiliary loss
on)."""

import dataclasses
import json

import pytest

from helpers import TINY_RUN
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.testing import run_ranks
from test_fsdp import _assert_same, _run, _tied_copy


def _moe_model(tmp_path, **changes) -> str:
    """moe-tiny at 4 layers, every one an MoE layer (both stages of pp=2 hold two)."""
    spec = dataclasses.replace(get_preset("moe-tiny"), n_layers=4, moe_every=1, **changes)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(spec.to_dict()))
    return str(path)


def _config(tmp_path, rows_per_forward: int, **changes):
    """Three steps of 8 sequences, `rows_per_forward` sequences per micro-batch."""
    return dataclasses.replace(
        TINY_RUN, model=_moe_model(tmp_path, **changes), grad_clip=0.0, micro_batch=None
    ), rows_per_forward


def _serial(config, rows: int) -> dict:
    """One process accumulating micro-batches of `rows` sequences."""
    return _tied_copy(_run(dataclasses.replace(config, micro_batch=rows), "dp=1", 1))


@pytest.mark.parametrize(
    ("plan_text", "rows"),
    [
        ("pp=2,micro_batches=2", 4),
        ("dp=2,ep=2,pp=2,micro_batches=2", 2),
    ],
)
def test_moe_pipeline_equals_serial_accumulation(tmp_path, plan_text, rows):
    config, rows = _config(tmp_path, rows)
    reference = _serial(config, rows)
    world_size = Plan.parse(plan_text).world_size
    for rank, result in enumerate(run_ranks(world_size, _run, config, plan_text, world_size)):
        _assert_same(result, reference, f"{plan_text}, rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "plan_text",
    [
        "pp=2,micro_batches=4,schedule=1f1b,recompute=full",
        "pp=2,micro_batches=4,schedule=interleaved",
        "pp=2,micro_batches=4,schedule=shifted,recompute=full",
        "pp=2,micro_batches=4,recompute=selective",
    ],
)
def test_moe_pipeline_schedules_equal_serial_accumulation(tmp_path, plan_text):
    config, rows = _config(tmp_path, 2)
    reference = _serial(config, rows)
    for rank, result in enumerate(run_ranks(2, _run, config, plan_text, 2)):
        _assert_same(result, reference, f"{plan_text}, rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("balance", ["dropless", "shadow", "prophet"])
def test_balanced_expert_pipeline_equals_serial_dropless(tmp_path, balance):
    config, rows = _config(tmp_path, 2, dropless=True)
    reference = _serial(config, rows)
    plan_text = f"dp=2,ep=2,pp=2,micro_batches=2,moe_balance={balance}"
    for rank, result in enumerate(run_ranks(4, _run, config, plan_text, 4)):
        _assert_same(result, reference, f"{plan_text}, rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("etp", [1, 2])
def test_experts_over_ep_and_layers_over_tp_inside_pipeline_stages_equal_serial(tmp_path, etp):
    # without sequence parallelism each tp rank routes one of the micro-batch's two rows: a
    # token set of one sequence, as one process accumulating one sequence at a time; so with
    # each expert split over tp (etp=2), whose tp ranks share the dispatch out alike
    config, rows = _config(tmp_path, 1)
    reference = _serial(config, rows)
    plan_text = f"dp=2,ep=2,tp=2,pp=2,micro_batches=2,etp={etp}"
    for rank, result in enumerate(run_ranks(8, _run, config, plan_text, 8, timeout=600)):
        # tensor-parallel pieces are slices of the serial tensors: compared through the losses
        # and the gradient norms, which every piece enters
        rows, expected = result["rows"], reference["rows"]
        assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in expected], abs=1e-5)
        norms = [r["grad_norm"] for r in rows]
        assert norms == pytest.approx([r["grad_norm"] for r in expected], rel=1e-5), rank
