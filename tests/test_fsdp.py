"""Sharded data parallelism (`dp_shard`, FSDP2): every sharded plan trains step for step as one
process on the same global batch (fp32: losses, pre-clipping norms, the first step's gradients
and the weights after three steps; bf16 within the precision tests' tolerance), resumes
exactly; its memory per rank is tested in test_memory.py."""

import dataclasses
import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from helpers import TINY_RUN, assert_grads_close, per_expert
from hf_models import needs_hf, saved_tiny_model
from interlace.checkpoint import checkpoint_name
from interlace.errors import PlanError
from interlace.mesh import build_mesh
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig
from test_precision import BASE as BF16
from test_precision import _assert_follows
from test_precision import _run as _bf16_run

BASE = TINY_RUN


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor a DTensor shards (this rank's tensor-parallel piece), or the tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def _run(
    config: TrainConfig, plan_text: str, world_size: int, resume_from=None, observe=None
) -> dict:
    """Every step's row, the first step's unclipped synced gradients (whole) and the weights at
    the end (whole), stacked experts as expert parallelism names them (`per_expert`), and
    `observe(trainer)` after the last step, before its gradients are dropped ("observed")."""
    plan = Plan.parse(plan_text)
    mesh = build_mesh(plan) if world_size > 1 else None
    trainer = Trainer(prepare_run(config, plan, world_size), mesh)
    if resume_from is not None:
        trainer.resume(resume_from)
    rows, grads, observed = [], None, None
    zero_grad = trainer.optimizer.zero_grad
    trainer.optimizer.zero_grad = lambda set_to_none=True: None  # keep the synced gradients
    while trainer.step < config.steps:
        rows.append(trainer.train_step())
        if grads is None:
            named = trainer.model.named_parameters()
            grads = per_expert({n: _full(p.grad).clone() for n, p in named})
        observed = observe(trainer) if observe is not None else None
        zero_grad()
        if config.out and trainer.step % config.ckpt_every == 0:
            trainer.save()
    params = per_expert({n: _full(p).clone() for n, p in trainer.model.named_parameters()})
    return {"rows": rows, "grads": grads, "params": params, "observed": observed}


def _tied_copy(run: dict) -> dict:
    """`run` with the tied LM head's gradient and weight named as a pipeline's last stage names
    its copy of the embedding (`lm_head.weight`)."""
    for part in ("grads", "params"):
        run[part].setdefault("lm_head.weight", run[part]["wte.weight"])
    return run


def _assert_same(result: dict, reference: dict, what: str = "") -> None:
    losses = [r["loss"] for r in result["rows"]]
    assert losses == pytest.approx([r["loss"] for r in reference["rows"]], abs=1e-5), what
    norms = [r["grad_norm"] for r in result["rows"]]
    assert norms == pytest.approx([r["grad_norm"] for r in reference["rows"]], rel=1e-5), what
    held = result["grads"].keys()  # a pipeline rank: its stages' parameters
    assert_grads_close(result["grads"], {n: reference["grads"][n] for n in held}, what=what)
    # Adam turns rounding noise in a gradient that is zero in exact arithmetic (k's bias) into
    # updates of ~lr: weights are compared absolutely, as in test_train
    for name, value in result["params"].items():
        torch.testing.assert_close(value, reference["params"][name], atol=1e-5, rtol=0)
    assert result["params"].keys() == held


@pytest.fixture(scope="module")
def serial():
    return _tied_copy(_run(dataclasses.replace(BASE, grad_clip=0.0), "dp=1", 1))


@pytest.mark.parametrize(
    "plan_text",
    [
        "dp_shard=2",
        "dp_shard=4",
        "dp=2,dp_shard=2",
        "dp_shard=2,pp=2,micro_batches=2",
        "dp_shard=2,pp=2,micro_batches=2,schedule=gpipe,recompute=full",
        "dp_shard=2,pp=2,micro_batches=2,schedule=shifted,recompute=full",
        pytest.param("dp_shard=2,pp=2,micro_batches=2,schedule=shifted", marks=pytest.mark.slow),
    ],
)
def test_sharded_data_parallel_equals_serial(serial, plan_text):
    config = dataclasses.replace(BASE, grad_clip=0.0)
    world_size = Plan.parse(plan_text).world_size
    for rank, result in enumerate(run_ranks(world_size, _run, config, plan_text, world_size)):
        _assert_same(result, serial, f"{plan_text}, rank {rank}")


@pytest.mark.parametrize(
    "plan_text",
    [
        "{}=2,tp=2",
        "{}=2,tp=2,sequence_parallel=true",  # the norms' gradients summed over tp after FSDP2
        "{}=2,pp=2,tp=2,micro_batches=2,schedule=gpipe",
    ],
)
def test_sharding_with_tensor_parallelism_equals_replicas_with_it(plan_text):
    # each rank's tensor-parallel pieces, whole over dp_shard, against the same plan with
    # dp=2 (which test_train checks against one process)
    config = dataclasses.replace(BASE, grad_clip=0.0)
    world_size = Plan.parse(plan_text.format("dp")).world_size
    replicated = run_ranks(world_size, _run, config, plan_text.format("dp"), world_size)
    sharded = run_ranks(world_size, _run, config, plan_text.format("dp_shard"), world_size)
    for rank, (result, reference) in enumerate(zip(sharded, replicated, strict=True)):
        _assert_same(result, reference, f"rank {rank}")


@pytest.mark.parametrize("plan_text", ["dp_shard=2", "dp_shard=2,reshard_after_forward=false"])
def test_accumulation_and_clipping_follow_serial(plan_text):
    # 4 micro-batches per rank (no gradient reduction before the last), clipping at 1.0 over
    # the sharded gradients' norm
    config = dataclasses.replace(BASE, micro_batch=1)
    serial_run = _tied_copy(_run(config, "dp=1", 1))
    assert serial_run["rows"][0]["grad_norm"] > 1.0  # the clip acts
    for rank, result in enumerate(run_ranks(2, _run, config, plan_text, 2)):
        _assert_same(result, serial_run, f"rank {rank}")


def _moe_file(tmp_path) -> str:
    """moe-tiny with dropless routing and no auxiliary loss (see the expert test below)."""
    spec = dataclasses.replace(get_preset("moe-tiny"), dropless=True, aux_loss_coef=0.0)
    model = tmp_path / "moe.json"
    model.write_text(json.dumps(spec.to_dict()))
    return str(model)


@pytest.mark.parametrize(
    "plan_text", ["dp_shard=2", "dp_shard=2,pp=2,micro_batches=2", "dp_shard=2,ep=2"]
)
def test_sharded_run_resumes_exactly(tmp_path, plan_text):
    config = dataclasses.replace(BASE, steps=4, ckpt_every=2, out=str(tmp_path / "full"))
    if "ep" in plan_text:
        config = dataclasses.replace(config, model=_moe_file(tmp_path))
    world_size = Plan.parse(plan_text).world_size
    full = run_ranks(world_size, _run, config, plan_text, world_size)
    checkpoint = tmp_path / "full" / "checkpoints" / checkpoint_name(2)
    resumed_config = dataclasses.replace(config, out=str(tmp_path / "resumed"))
    resumed = run_ranks(world_size, _run, resumed_config, plan_text, world_size, checkpoint)
    for before, after in zip(full, resumed, strict=True):
        assert [r["step"] for r in after["rows"]] == [3, 4]
        assert [r["loss"] for r in after["rows"]] == [r["loss"] for r in before["rows"][2:]]
        for name, value in after["params"].items():
            torch.testing.assert_close(value, before["params"][name], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "plan_text",
    [
        "dp_shard=2",
        "dp=2,dp_shard=2",
        "dp_shard=2,tp=2",
        "dp_shard=2,pp=2,micro_batches=2",
        "dp_shard=2,ep=2",
    ],
)
def test_bf16_sharded_plan_follows_the_serial_bf16_run(tmp_path, plan_text):
    config = BF16
    if "ep" in plan_text:
        config = dataclasses.replace(BF16, model=_moe_file(tmp_path))
    serial_run = _bf16_run(config, "dp=1", 1)
    world_size = Plan.parse(plan_text).world_size
    for result in run_ranks(world_size, _bf16_run, config, plan_text, world_size):
        _assert_follows(result, serial_run)


@pytest.mark.parametrize(
    ("plan_text", "words"),
    [
        ("dp_shard=2,grad_compression=sketch", "reduce-scatters its gradients instead"),
        ("dp=2,reshard_after_forward=false", "reshard_after_forward=false applies to sharded"),
    ],
)
def test_sharded_plans_that_cannot_run_are_refused(plan_text, words):
    plan = Plan.parse(plan_text)
    with pytest.raises(PlanError, match=words):
        plan.validate(plan.world_size)


@pytest.mark.parametrize("plan_text", ["dp_shard=2,ep=2", "dp=2,dp_shard=2,ep=2"])
def test_sharding_with_expert_parallelism_equals_serial(tmp_path, plan_text):
    # non-expert parameters sharded over dp_shard, experts placed by expert parallelism and
    # reduced over their replicas; dropless routing without the auxiliary loss, whose per-rank
    # statistics differ from serial by design (as in test_train)
    config = dataclasses.replace(BASE, model=_moe_file(tmp_path), grad_clip=0.0)
    serial_run = _tied_copy(_run(config, "dp=1", 1))
    world_size = Plan.parse(plan_text).world_size
    for rank, result in enumerate(run_ranks(world_size, _run, config, plan_text, world_size)):
        _assert_same(result, serial_run, f"{plan_text}, rank {rank}")


@needs_hf
def test_a_kv_head_several_tp_ranks_hold_sums_its_gradient_among_them_under_fsdp2(tmp_path):
    # Llama with one kv head under tp=2: both tp ranks hold it, and its gradient is the sum of
    # theirs; FSDP2 computes gradients on parameters of its own, where a hook on the original
    # never runs, so the sum is made on the reduce-scattered shards instead
    model = saved_tiny_model("llama", tmp_path / "model", 320, kv_heads=1)
    config = dataclasses.replace(BASE, model=model, steps=3)
    reference = run_ranks(2, _run, config, "tp=2", 2)
    for rank, result in enumerate(run_ranks(4, _run, config, "dp_shard=2,tp=2", 4)):
        _assert_same(result, reference[rank % 2], f"dp_shard=2,tp=2 rank {rank}")
