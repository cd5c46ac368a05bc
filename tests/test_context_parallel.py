"""Context parallelism in training: `cp=N` splits each sequence zig-zag over N ranks; losses,
gradient norms and every gradient equal the one-process run's (fp32), alone and with dp and
tp (with and without sequence parallelism); plans it does not combine with are refused with
the fix named."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor

from helpers import TINY_RUN, assert_grads_close
from hf_models import needs_hf, saved_tiny_model
from interlace.errors import PlanError
from interlace.mesh import build_mesh
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run

STEPS = 4


def _steps(plan_text: str, world_size: int, model: str = "tiny") -> dict:
    """Four unclipped steps of the tiny GPT (or preset `model`) under `plan_text`: each step's
    loss and gradient norm, and the last step's synced gradients."""
    plan = Plan.parse(plan_text)
    config = dataclasses.replace(TINY_RUN, model=model, steps=STEPS, grad_clip=0.0)
    trainer = Trainer(
        prepare_run(config, plan, world_size), build_mesh(plan) if world_size > 1 else None
    )
    rows = [trainer.train_step() for _ in range(STEPS - 1)]
    trainer.optimizer.zero_grad = lambda set_to_none=True: None  # keep the synced gradients
    rows.append(trainer.train_step())
    return {
        "losses": [row["loss"] for row in rows],
        "norms": [row["grad_norm"] for row in rows],
        "grads": {name: _full(p.grad) for name, p in trainer.model.named_parameters()},
        "comm": rows[-1]["comm_bytes"],
        "report": trainer.parallel.report,
    }


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient whole (an FSDP2 shard gathered), a plain tensor that can leave the rank."""
    return grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()


@pytest.fixture(scope="module")
def serial() -> dict:
    return _steps("dp=1", 1)


SLOW = pytest.mark.slow  # 4 and 8 ranks; `make test` keeps one case of each kind


@pytest.mark.parametrize(
    "plan_text",
    [
        "cp=2",
        "cp=2,recompute=full",
        "cp=2,recompute=selective",
        pytest.param("cp=4", marks=SLOW),
        pytest.param("dp=2,cp=2", marks=SLOW),
        pytest.param("cp=4,cp_mode=alltoall", marks=SLOW),
    ],
)
def test_context_parallel_training_equals_serial(serial, plan_text):
    world_size = Plan.parse(plan_text).world_size
    for rank, result in enumerate(run_ranks(world_size, _steps, plan_text, world_size)):
        assert result["losses"] == pytest.approx(serial["losses"], abs=2e-5), rank
        assert result["norms"] == pytest.approx(serial["norms"], rel=1e-5), rank
        assert_grads_close(result["grads"], serial["grads"], what=f"{plan_text}, rank {rank}")
        assert result["comm"]["cp"] > 0 and result["comm"]["dp_cp"] > 0
        assert any(" over cp=" in line for line in result["report"])


@pytest.mark.parametrize(
    "plan_text",
    [
        "cp=2,tp=2,sequence_parallel=true",
        pytest.param("cp=2,tp=2", marks=SLOW),
        pytest.param("cp=2,tp=2,cp_mode=alltoall", marks=SLOW),
        "cp=2,tp=2,tp_subbatches=2",
        pytest.param("cp=2,tp=2,tp_subbatches=2,cp_mode=alltoall,recompute=full", marks=SLOW),
    ],
)
def test_context_parallel_with_tensor_parallel_equals_serial(serial, plan_text):
    # with tp_subbatches each sub-batch's attention runs its own ring (or all-to-all) on its
    # thread, in the same order on every rank
    results = run_ranks(4, _steps, plan_text, 4)
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(serial["losses"], abs=2e-5), rank
        assert result["norms"] == pytest.approx(serial["norms"], rel=1e-5), rank


@pytest.mark.parametrize(
    "plan_text",
    [
        "cp=2,pp=2,micro_batches=2",
        pytest.param("cp=2,pp=2,micro_batches=4,schedule=shifted,recompute=full", marks=SLOW),
    ],
)
def test_context_parallel_inside_pipeline_stages_equals_serial(serial, plan_text):
    # every pipeline rank holds its stage's parameters; the last stage's copy of the tied
    # embedding is the embedding's gradient
    expected = {**serial["grads"], "lm_head.weight": serial["grads"]["wte.weight"]}
    for rank, result in enumerate(run_ranks(4, _steps, plan_text, 4)):
        assert result["losses"] == pytest.approx(serial["losses"], abs=2e-5), rank
        assert result["norms"] == pytest.approx(serial["norms"], rel=1e-5), rank
        held = {name: expected[name] for name in result["grads"]}
        assert_grads_close(result["grads"], held, what=f"{plan_text}, rank {rank}")
        assert result["comm"]["cp"] > 0 and result["comm"]["dp_cp"] > 0


@pytest.mark.parametrize(
    ("plan_text", "needle"),
    [
        ("cp=2,tp3d=2x1x1", "use 1D tensor parallelism"),
        ("cp_mode=alltoall", "applies to context parallelism; use cp > 1"),
    ],
)
def test_combinations_not_built_yet_are_refused_with_the_fix(plan_text, needle):
    plan = Plan.parse(plan_text)
    with pytest.raises(PlanError, match=needle):
        plan.validate(plan.world_size)


def test_a_sequence_2cp_chunks_cannot_split_is_refused_before_launch():
    spec = dataclasses.replace(get_preset("tiny"), seq_len=36)
    with pytest.raises(PlanError, match=r"seq_len=36 .* divisible by 8"):
        Plan.parse("cp=4").validate(4, spec)
    with pytest.raises(PlanError, match="attention dropout"):
        Plan.parse("cp=2").validate(2, dataclasses.replace(get_preset("tiny"), dropout=0.1))
    with pytest.raises(PlanError, match=r"2 attention heads .* over cp=4"):
        Plan.parse("cp=4,tp=2,cp_mode=alltoall").validate(8, get_preset("tiny"))


def test_cp_counts_in_the_world_size_and_the_plan_text():
    plan = Plan.parse_for("cp=2", 4)
    assert (plan.dp, plan.cp, plan.world_size) == (2, 2, 4)
    assert Plan.parse(str(plan)) == plan


@needs_hf
@pytest.mark.parametrize(
    ("kind", "plan_text"),
    [
        ("llama", "cp=2"),
        pytest.param("llama", "cp=2,cp_mode=alltoall", marks=SLOW),
        pytest.param("gpt2", "cp=2", marks=SLOW),
    ],
)
def test_hugging_face_decoders_train_under_cp_as_in_one_process(tmp_path, kind, plan_text):
    # Llama: rotary positions, 2 key/value heads for 4 query heads; GPT-2: learned positions
    model = saved_tiny_model(kind, tmp_path / kind, vocab=320)
    serial = _hf_losses(model, "dp=1", 1)
    for rank, losses in enumerate(run_ranks(2, _hf_losses, model, plan_text, 2, timeout=120)):
        assert losses == pytest.approx(serial, abs=2e-5), rank


@needs_hf
@pytest.mark.parametrize(
    "plan_text", ["cp=2,tp=2", pytest.param("cp=2,tp=2,tp_subbatches=2", marks=SLOW)]
)
def test_hugging_face_decoders_under_cp_and_tp_train_as_in_one_process(tmp_path, plan_text):
    # the attention modules are found in the structure read before tensor parallelism split
    # the embedding (an nn.Embedding no longer: found after it, none was)
    model = saved_tiny_model("llama", tmp_path / "llama", vocab=320)
    serial = _hf_losses(model, "dp=1", 1)
    for rank, losses in enumerate(run_ranks(4, _hf_losses, model, plan_text, 4, timeout=180)):
        assert losses == pytest.approx(serial, abs=2e-5), rank


def test_alltoall_over_too_few_key_value_heads_is_refused_before_launch():
    # Llama-style 2 kv heads over tp=2: one per rank, which cp=2 cannot split
    spec = dataclasses.replace(get_preset("tiny"), n_kv_heads=2)
    with pytest.raises(PlanError, match=r"splits a rank's 1 key/value heads"):
        Plan.parse("cp=2,tp=2,cp_mode=alltoall").validate(4, spec)
    Plan.parse("cp=2,tp=2").validate(4, spec)  # the ring has no such limit


def _hf_losses(model: str, plan_text: str, world_size: int) -> list[float]:
    plan = Plan.parse(plan_text)
    config = dataclasses.replace(TINY_RUN, model=model)
    trainer = Trainer(
        prepare_run(config, plan, world_size), build_mesh(plan) if world_size > 1 else None
    )
    return [trainer.train_step()["loss"] for _ in range(STEPS)]


def _sharded_rows_and_steps(plan_text: str, world_size: int) -> dict:
    plan = Plan.parse(plan_text)
    mesh = build_mesh(plan)
    return {"rows": mesh.rows("dp_cp"), **_steps(plan_text, world_size)}


@pytest.mark.parametrize(
    "plan_text", ["cp=2,dp_shard=2", pytest.param("cp=2,dp_shard=2,dp=2", marks=SLOW)]
)
def test_fsdp_over_dp_shard_and_cp_equals_serial(serial, plan_text):
    world_size = Plan.parse(plan_text).world_size
    results = run_ranks(world_size, _sharded_rows_and_steps, plan_text, world_size, timeout=120)
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(serial["losses"], abs=2e-5), rank
        assert result["norms"] == pytest.approx(serial["norms"], rel=1e-5), rank
        assert_grads_close(
            {
                k: g.full_tensor() if hasattr(g, "full_tensor") else g
                for k, g in result["grads"].items()
            },
            serial["grads"],
            what=f"{plan_text}, rank {rank}",
        )
    assert results[0]["rows"] == [list(range(world_size))]
