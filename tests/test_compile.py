"""Compiled blocks: a run with every block compiled follows the same run uncompiled (fp32,
losses and gradient norms step by step), one process and a pipeline; plans that cannot be
compiled are refused before any work."""

import pytest
import torch
import torch._dynamo
import torch._inductor.config

from interlace.compile import resolve_compile
from interlace.errors import ConfigError
from interlace.mesh import build_mesh
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

# Inductor compiles in a pool of worker processes started on first use; a rank forked after
# that inherits a pool whose workers belong to its parent and waits on it forever. Compiling
# in the calling process keeps forked ranks independent of what ran before them.
torch._inductor.config.compile_threads = 1

CONFIG = TrainConfig(
    model="tiny", steps=3, global_batch=8, eval_every=0, out=None, progress=False, lr=5e-4
)


def _run(compile: str, plan_text: str = "dp=1", model: str = "tiny") -> dict:
    """Every step's (loss, grad_norm), the parallel report, the frames dynamo compiled and the
    reasons of its graph breaks."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plan = Plan.parse(plan_text)
    mesh = build_mesh(plan) if plan.world_size > 1 else None
    config = TrainConfig(**{**CONFIG.to_dict(), "compile": compile, "model": model})
    trainer = Trainer(prepare_run(config, plan, plan.world_size), mesh)
    rows = [(r["loss"], r["grad_norm"]) for r in (trainer.train_step() for _ in range(3))]
    counters = torch._dynamo.utils.counters
    return {
        "rows": rows,
        "report": trainer.parallel.report,
        "frames": counters["stats"]["unique_graphs"],
        "breaks": list(counters["graph_break"]),
    }


def _assert_same(compiled: dict, eager: dict) -> None:
    for (loss, norm), (eager_loss, eager_norm) in zip(compiled["rows"], eager["rows"], strict=True):
        assert loss == pytest.approx(eager_loss, abs=1e-5)
        assert norm == pytest.approx(eager_norm, rel=1e-4)


@pytest.mark.slow
def test_compiled_blocks_follow_the_eager_run():
    eager, compiled = _run("off"), _run("on")
    assert eager["frames"] == 0 and compiled["frames"] > 0
    assert "blocks: 2 blocks compiled (torch.compile, one per block)" in compiled["report"]
    _assert_same(compiled, eager)


@pytest.mark.slow
def test_compiled_pipeline_stages_follow_the_eager_pipeline():
    plan = "pp=2,micro_batches=2,recompute=full"
    eager = run_ranks(2, _run, "off", plan)
    for compiled, reference in zip(run_ranks(2, _run, "on", plan), eager, strict=True):
        assert compiled["frames"] > 0
        _assert_same(compiled, reference)


@pytest.mark.parametrize(
    ("plan_text", "reason"),
    [
        ("tp=2,tp_subbatches=2", "tp_subbatches=2"),
        ("tp3d=2x1x1", "tp3d"),
        ("tp=2,recompute=full", "tp=2 and recompute=full"),
    ],
)
def test_compile_on_refuses_plans_it_cannot_run_and_auto_leaves_them_eager(plan_text, reason):
    plan = Plan.parse(plan_text)
    with pytest.raises(ConfigError, match=f"compile=on cannot run with {reason}"):
        resolve_compile("on", torch.device("cuda"), plan)
    assert resolve_compile("auto", torch.device("cuda"), plan) is False


def test_compile_auto_is_on_for_cuda_and_off_for_the_cpu():
    assert resolve_compile("auto", torch.device("cuda"), Plan.parse("tp=2")) is True
    assert resolve_compile("auto", torch.device("cpu"), Plan.parse("tp=2")) is False
    with pytest.raises(ConfigError, match="compile='yes' is not one of auto, on, off"):
        resolve_compile("yes", torch.device("cpu"), Plan())


@pytest.mark.slow
@pytest.mark.parametrize("plan_text", ["recompute=full", "recompute=selective"])
def test_compiled_recomputed_blocks_follow_the_eager_run(plan_text):
    plan = Plan.parse(plan_text)
    if plan.world_size == 1:
        eager, compiled = [_run("off", plan_text)], [_run("on", plan_text)]
    else:
        eager = run_ranks(plan.world_size, _run, "off", plan_text)
        compiled = run_ranks(plan.world_size, _run, "on", plan_text)
    for result, reference in zip(compiled, eager, strict=True):
        assert result["frames"] > 0
        _assert_same(result, reference)


@pytest.mark.slow
def test_compiled_blocks_run_expert_parallel_layers_eagerly_between_their_graphs():
    plan = "dp=2,ep=2"
    eager = run_ranks(2, _run, "off", plan, "moe-tiny")
    for compiled, reference in zip(run_ranks(2, _run, "on", plan, "moe-tiny"), eager, strict=True):
        assert compiled["frames"] > 0
        assert all("ExpertParallelMoE.forward" in reason for reason in compiled["breaks"])
        assert "blocks: expert-parallel layers run eagerly inside their compiled blocks" in (
            " ".join(compiled["report"])
        )
        _assert_same(compiled, reference)


@pytest.mark.slow
def test_recomputed_moe_blocks_compile_whole_and_follow_the_eager_run():
    eager, compiled = (
        _run("off", "recompute=full", "moe-tiny"),
        _run("on", "recompute=full", "moe-tiny"),
    )
    assert compiled["frames"] > 0 and compiled["breaks"] == []
    _assert_same(compiled, eager)


@pytest.mark.slow
@pytest.mark.parametrize("plan_text", ["cp=2", "cp=2,cp_mode=alltoall"])
def test_compiled_blocks_run_context_parallel_attention_eagerly_between_their_graphs(plan_text):
    eager = run_ranks(2, _run, "off", plan_text)
    for compiled, reference in zip(run_ranks(2, _run, "on", plan_text), eager, strict=True):
        assert compiled["frames"] > 0
        assert compiled["breaks"] and all("context_attend" in r for r in compiled["breaks"])
        assert any("context-parallel attention" in line for line in compiled["report"])
        _assert_same(compiled, reference)
