"""Trainer: data parallel equals one process on the same global batch; resume equals an
uninterrupted run; the comm meter counts exactly the gradient bytes."""

import dataclasses
import json
import math
from pathlib import Path
from unittest import mock

import pytest
import torch

from helpers import TINY_RUN, assert_grads_close, per_expert
from interlace.checkpoint import checkpoint_name
from interlace.compress import make_comm_hook
from interlace.errors import CheckpointError
from interlace.mesh import build_mesh
from interlace.parallel.data import apply as data_apply
from interlace.plan import Plan
from interlace.report import read_metrics
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

# lr=5e-4 (TINY_RUN) keeps Adam's amplified rounding below 1e-5; the gradients themselves are
# compared, unclipped and relative to each tensor's scale, in
# test_data_parallel_gradients_equal_serial, and every run's pre-clipping norm step by step.
BASE = TINY_RUN


def _train(config: TrainConfig, plan_text: str, world_size: int, resume_from=None):
    """The run's metrics rows, final parameters and size, and the path each gradient bucket of a
    compressing comm hook took last ("sketch", "dense", ...; none without compression)."""
    states = []

    def kept_hook(kind, group):
        state, hook = make_comm_hook(kind, group)
        states.append(state)
        return state, hook

    with mock.patch.object(data_apply, "make_comm_hook", kept_hook):
        result = _run(config, plan_text, world_size, resume_from)
    compressing = [state for state in states if hasattr(state, "summary")]
    result["bucket_paths"] = [b.path for state in compressing for b in state.stats.values()]
    return result


def _run(config: TrainConfig, plan_text: str, world_size: int, resume_from=None):
    plan = Plan.parse(plan_text)
    setup = prepare_run(config, plan, world_size)
    mesh = build_mesh(plan) if world_size > 1 else None
    trainer = Trainer(setup, mesh)
    if resume_from is not None:
        trainer.resume(resume_from)
    if config.out:  # the full loop: checkpoints and metrics.jsonl
        trainer.fit()
        rows = read_metrics(Path(config.out) / "metrics.jsonl")
    else:
        rows = [trainer.train_step() for _ in range(config.steps - trainer.step)]
    return {
        "rows": rows,
        "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "num_params": setup.model_config.num_params(),
    }


def _assert_same_run(a, b, atol=1e-5):
    assert [r["loss"] for r in a["rows"]] == pytest.approx([r["loss"] for r in b["rows"]], abs=atol)
    # The norm is taken before clipping, so it sees the gradients' scale (a sum over ranks or
    # micro-batches instead of a mean), which clipping and Adam hide from losses and weights.
    assert [r["grad_norm"] for r in a["rows"]] == pytest.approx(
        [r["grad_norm"] for r in b["rows"]], rel=1e-5
    )
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        torch.testing.assert_close(
            a["params"][name],
            b["params"][name],
            atol=atol,
            rtol=0,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def _step_gradients(config: TrainConfig, plan_text: str, world_size: int, steps: int = 1):
    """The synced gradients of step `steps` and every step's row, without clipping (grad_clip=0),
    which would rescale the gradients to one norm whatever their scale."""
    plan = Plan.parse(plan_text)
    config = dataclasses.replace(config, grad_clip=0.0)
    trainer = Trainer(
        prepare_run(config, plan, world_size), build_mesh(plan) if world_size > 1 else None
    )
    rows = [trainer.train_step() for _ in range(steps - 1)]
    trainer.optimizer.zero_grad = lambda set_to_none=True: None  # keep the synced gradients
    rows.append(trainer.train_step())
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
    return {"grads": grads, "rows": rows}


@pytest.mark.parametrize(
    ("plan_text", "micro_batch"),
    [("dp=2", None), ("dp=4", None), ("dp=2,dp_overlap=false", None), ("dp=2", 1), ("dp=1", 2)],
)
def test_data_parallel_gradients_equal_serial(plan_text, micro_batch):
    # micro_batch set: each rank accumulates global_batch / dp / micro_batch micro-batches
    config = dataclasses.replace(BASE, micro_batch=micro_batch)
    world_size = Plan.parse(plan_text).world_size
    serial = _step_gradients(BASE, "dp=1", 1)
    if world_size == 1:
        results = [_step_gradients(config, plan_text, 1)]
    else:
        results = run_ranks(world_size, _step_gradients, config, plan_text, world_size)
    for rank, result in enumerate(results):
        assert_grads_close(result["grads"], serial["grads"], what=f"rank {rank}")
        assert result["rows"][0]["grad_norm"] == pytest.approx(
            serial["rows"][0]["grad_norm"], rel=1e-5
        )


@pytest.fixture(scope="module")
def serial():
    return _train(BASE, "dp=1", 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_equals_serial(serial, world_size):
    results = run_ranks(world_size, _train, BASE, f"dp={world_size}", world_size)
    for result in results:
        _assert_same_run(result, serial)


def test_sketch_compressed_training_follows_serial_and_keeps_ranks_identical(tmp_path):
    # Untied embeddings: rows of bytes absent from a batch get exactly zero gradient, so the
    # embedding's bucket is sparse and goes through the sketch. The
    # peel decoder recovers almost every entry exactly; the few it cannot fall back to the
    # count-sketch median, so the criterion is the loss and gradient norm within 1% of serial.
    config = dataclasses.replace(BASE, model=_model_file(tmp_path, tie_embeddings=False))
    serial_run = _train(config, "dp=1", 1)
    rank0, rank1 = run_ranks(2, _train, config, "dp=2,grad_compression=sketch,dp_bucket_mb=0.05", 2)
    for key in ("loss", "grad_norm"):  # the norm, before clipping, sees the gradients' scale
        assert [r[key] for r in rank0["rows"]] == pytest.approx(
            [r[key] for r in serial_run["rows"]], rel=0.01
        ), key
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name
    assert "sketch" in rank0["bucket_paths"]  # the embedding's bucket went through the sketch
    assert rank0["rows"][-1]["compression_ratio"] > 0


@pytest.mark.parametrize("kind", ["topk", "powersgd"])
def test_lossy_compression_keeps_ranks_identical(kind):
    rank0, rank1 = run_ranks(2, _train, BASE, f"dp=2,grad_compression={kind}", 2)
    assert all(math.isfinite(row["loss"]) for row in rank0["rows"])
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()]).double()


def test_topk_compression_sends_the_largest_entries_of_the_mean_gradient():
    # Each rank sends the top 1 % (by magnitude) of each bucket of its own gradient; an entry in
    # every rank's top-k arrives as the exact mean, one in a single rank's as half that rank's.
    serial = _flat(_step_gradients(BASE, "dp=1", 1)["grads"])
    for result in run_ranks(2, _step_gradients, BASE, "dp=2,grad_compression=topk", 2):
        sent = _flat(result["grads"])
        # at most ceil(1 % of a bucket) per rank and bucket, and a bucket holds >= 1 parameter
        assert 0 < int((sent != 0).sum()) <= 2 * (0.01 * sent.numel() + len(result["grads"]))
        # the largest entries stand out on both ranks: both send them, so they arrive exact
        largest = sent.abs().topk(10).indices
        torch.testing.assert_close(sent[largest], serial[largest], rtol=1e-5, atol=0)
        left_out = float((sent - serial).norm() / serial.norm())
        assert left_out < 0.5  # the small tail: measured 0.37 of the mean's norm


def test_powersgd_compression_projects_the_mean_gradient():
    # Steps 1-2 are plain all-reduces (start_powerSGD_iter=2), so step 3 starts from the serial
    # run's weights. PowerSGD then returns P·Pᵀ·M for each matrix M of the mean gradient (P: an
    # orthonormal basis of M·Q, Q shared by the ranks): an orthogonal projection, whose inner
    # product with M equals its squared norm; vectors (biases, norms) are all-reduced exactly.
    serial = _step_gradients(BASE, "dp=1", 1, steps=3)
    results = run_ranks(2, _step_gradients, BASE, "dp=2,grad_compression=powersgd", 2, 3)
    for result in results:
        rows, grads = result["rows"], result["grads"]
        assert [r["grad_norm"] for r in rows[:2]] == pytest.approx(
            [r["grad_norm"] for r in serial["rows"][:2]], rel=1e-5
        )
        vectors = {n: g for n, g in grads.items() if g.dim() == 1}
        assert_grads_close(vectors, {n: serial["grads"][n] for n in vectors})
        errors = {}
        for name, sent in grads.items():
            if sent.dim() == 1:
                continue
            mean = serial["grads"][name].double().flatten()
            sent = sent.double().flatten()
            assert float(sent @ mean) == pytest.approx(float(sent @ sent), rel=1e-4), name
            errors[name] = float((sent - mean).norm() / mean.norm())
        assert max(errors.values()) > 0.05, errors  # the matrices really went through rank 4
        mean = _flat(serial["grads"])
        left_out = float((_flat(grads) - mean).norm() / mean.norm())
        assert left_out < 0.4  # rank 4 of 64-wide matrices: measured 0.21 of the mean's norm


def test_data_parallel_without_overlap_equals_serial(serial):
    results = run_ranks(2, _train, BASE, "dp=2,dp_overlap=false", 2)
    for result in results:
        _assert_same_run(result, serial)


def test_gradient_accumulation_equals_serial(serial):
    accumulating = dataclasses.replace(BASE, micro_batch=1)  # 4 micro-batches per rank
    results = run_ranks(2, _train, accumulating, "dp=2", 2)
    _assert_same_run(results[0], serial)


def test_training_moves_parameters(serial):
    fresh = _train(dataclasses.replace(BASE, steps=1, lr=1e-12), "dp=1", 1)
    moved = max((serial["params"][k] - fresh["params"][k]).abs().max() for k in fresh["params"])
    assert moved > 1e-4  # the equality tests above compare trained, not initial, weights


@pytest.mark.parametrize("plan_text", ["dp=2", "dp=2,dp_overlap=false"])
def test_meter_counts_gradient_bytes_per_step(plan_text):
    rows = run_ranks(2, _train, BASE, plan_text, 2)[0]["rows"]
    num_params = _train(dataclasses.replace(BASE, steps=1), "dp=1", 1)["num_params"]
    loss_bytes = 4  # the logged loss is averaged over dp with one float32 all-reduce
    for row in rows:
        assert row["comm_bytes"] == {"dp": num_params * 4 + loss_bytes}


def _model_file(tmp_path, **changes):
    """A JSON model config: the tiny preset with `changes`."""
    from interlace.models.presets import get_preset

    config = dataclasses.replace(get_preset("tiny"), **changes)
    path = tmp_path / "tiny-changed.json"
    path.write_text(json.dumps(config.to_dict()))
    return str(path)


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_continues_the_same_trajectory(tmp_path, world_size):
    # dropout > 0 so the restored RNG state matters
    config = dataclasses.replace(
        BASE,
        model=_model_file(tmp_path, dropout=0.1),
        steps=6,
        ckpt_every=3,
        out=str(tmp_path / "full"),
    )
    plan = f"dp={world_size}"

    def run(cfg, resume_from=None):
        if world_size == 1:
            return [_train(cfg, plan, 1, resume_from)]
        return run_ranks(world_size, _train, cfg, plan, world_size, resume_from)

    full = run(config)[0]
    checkpoint = tmp_path / "full" / "checkpoints" / checkpoint_name(3)
    resumed = run(dataclasses.replace(config, out=str(tmp_path / "resumed")), checkpoint)[0]
    assert [r["step"] for r in resumed["rows"]] == [4, 5, 6]
    full_tail = {"rows": full["rows"][3:], "params": full["params"]}
    _assert_same_run(resumed, full_tail, atol=1e-6)


def test_resume_refuses_a_different_run(tmp_path):
    config = dataclasses.replace(BASE, steps=2, out=str(tmp_path / "a"))
    _train(config, "dp=1", 1)
    checkpoint = tmp_path / "a" / "checkpoints" / checkpoint_name(2)
    other = dataclasses.replace(config, seed=1, out=str(tmp_path / "b"))
    with pytest.raises(CheckpointError, match="does not match this run: its data"):
        _train(other, "dp=1", 1, checkpoint)


def test_fit_writes_metrics_report_and_final_checkpoint(tmp_path):
    config = dataclasses.replace(BASE, steps=4, eval_every=2, out=str(tmp_path))
    setup = prepare_run(config, Plan(), 1)
    report = Trainer(setup).fit()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["final_loss"] == rows[-1]["loss"] == report["final_loss"]
    assert saved["final_eval_loss"] == rows[-1]["eval_loss"]
    assert (tmp_path / "checkpoints" / checkpoint_name(4) / "manifest.json").exists()
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def _eval_loss(config: TrainConfig, world_size: int) -> float:
    plan = Plan(dp=world_size)
    trainer = Trainer(
        prepare_run(config, plan, world_size), build_mesh(plan) if world_size > 1 else None
    )
    return trainer.evaluate()


def test_held_out_loss_does_not_depend_on_the_rank_count():
    config = dataclasses.replace(BASE, eval_batches=2)
    serial = _eval_loss(config, 1)
    for world_size in (2, 4):
        assert run_ranks(world_size, _eval_loss, config, world_size) == pytest.approx(
            [serial] * world_size, abs=1e-6
        )


def _tensor_parallel_run(config: TrainConfig, plan_text: str, world_size: int):
    from interlace.parallel.tensor.shard import gather_full, sharded_parameter_names

    plan = Plan.parse(plan_text)
    mesh = build_mesh(plan)
    trainer = Trainer(prepare_run(config, plan, world_size), mesh)
    rows = [trainer.train_step() for _ in range(config.steps)]
    specs = sharded_parameter_names(trainer.model)
    full = {
        name: gather_full(p, specs[name], mesh.group("tp")) if name in specs else p.detach()
        for name, p in trainer.model.state_dict(keep_vars=True).items()
    }
    return {"rows": rows, "params": {k: v.clone() for k, v in full.items()}}


@pytest.mark.parametrize(
    "plan_text",
    [
        "tp=2",
        "tp=4",
        "dp=2,tp=2",
        "tp=2,sequence_parallel=true",
        "tp=2,tp_subbatches=2",
        "dp=2,tp=2,tp_subbatches=2",
    ],
)
def test_tensor_parallel_training_equals_serial(serial, plan_text):
    world_size = Plan.parse(plan_text).world_size
    for result in run_ranks(world_size, _tensor_parallel_run, BASE, plan_text, world_size):
        _assert_same_run(result, serial)  # grad_norm included


def test_tensor_parallel_resume_continues_the_same_trajectory(tmp_path):
    config = dataclasses.replace(BASE, steps=4, ckpt_every=2, out=str(tmp_path / "full"))
    full = run_ranks(2, _train, config, "tp=2", 2)
    checkpoint = tmp_path / "full" / "checkpoints" / checkpoint_name(2)
    resumed_config = dataclasses.replace(config, out=str(tmp_path / "resumed"))
    resumed = run_ranks(2, _train, resumed_config, "tp=2", 2, checkpoint)
    for before, after in zip(full, resumed, strict=True):
        assert [r["step"] for r in after["rows"]] == [3, 4]
        _assert_same_run(after, {"rows": before["rows"][2:], "params": before["params"]}, 1e-6)


PARAM_ATOL = 2e-5
"""Parameters after TINY_RUN's 3 steps: an update is up to lr = 5e-4 per step, and Adam turns
the rounding of a near-zero gradient element into an update difference (1.4e-5 at most seen, on
one element of 16384, under torch 2.11's kernels); a wrong gradient moves them by ~lr."""


def _assert_follows_serial(result, serial_run):
    """Same losses and gradient norms per step and same values of every parameter this rank
    holds (a subset of the serial model's, under the same names: stacked experts as expert
    parallelism names them, `per_expert`)."""
    assert [r["loss"] for r in result["rows"]] == pytest.approx(
        [r["loss"] for r in serial_run["rows"]], abs=1e-5
    )
    assert [r["grad_norm"] for r in result["rows"]] == pytest.approx(
        [r["grad_norm"] for r in serial_run["rows"]], rel=1e-5
    )
    serial_params = per_expert(serial_run["params"])
    for name, value in result["params"].items():
        torch.testing.assert_close(value, serial_params[name], atol=PARAM_ATOL, rtol=0)


def _dropless_moe_file(tmp_path):
    """moe-tiny without token dropping (so per-rank routing equals serial routing) and without
    the auxiliary loss, which every rank computes from its own tokens' statistics: its mean
    over ranks differs from the serial value by design (as in DeepSpeed and Megatron)."""
    from interlace.models.presets import get_preset

    config = dataclasses.replace(get_preset("moe-tiny"), dropless=True, aux_loss_coef=0.0)
    path = tmp_path / "moe-dropless.json"
    path.write_text(json.dumps(config.to_dict()))
    return str(path)


@pytest.mark.parametrize(
    "plan_text",
    [
        "dp=2,ep=2",
        "dp=2,ep=2,dp_overlap=false",
        "dp=4,ep=2,moe_balance=prophet",
        "dp=4,ep=4,moe_balance=shadow",
    ],
)
def test_expert_parallel_training_equals_serial(tmp_path, plan_text):
    config = dataclasses.replace(BASE, model=_dropless_moe_file(tmp_path))
    serial_run = _train(config, "dp=1", 1)
    world_size = Plan.parse(plan_text).world_size
    for result in run_ranks(world_size, _train, config, plan_text, world_size):
        _assert_follows_serial(result, serial_run)  # replicated and locally held experts
        assert "ep" in result["rows"][-1]["comm_bytes"]


@pytest.mark.parametrize(
    "plan_text",
    [
        "pp=2,micro_batches=2",
        "pp=2,dp=2,micro_batches=2,schedule=gpipe",
        "pp=4,micro_batches=4,schedule=shifted,recompute=stage-aware",
        "pp=2,micro_batches=4,schedule=interleaved,recompute=full",
        # with 1D tensor parallelism: each stage's tensor-parallel shards gathered whole
        "pp=2,tp=2,micro_batches=2",
        "pp=2,tp=2,micro_batches=4,schedule=shifted,recompute=full",
        "pp=2,tp=2,micro_batches=2,sequence_parallel=true,schedule=gpipe",
        # the shifted schedule sizes its receive buffers from the first activation's shape
        "pp=2,tp=2,micro_batches=2,sequence_parallel=true,schedule=shifted,recompute=full",
        "pp=2,tp=2,micro_batches=2,tp_subbatches=2,schedule=interleaved",
        "pp=2,tp=2,micro_batches=2,tp_subbatches=2,recompute=full",
        "pp=2,tp=2,dp=2,micro_batches=2",
    ],
)
def test_pipeline_training_equals_serial(tmp_path, plan_text):
    config = dataclasses.replace(BASE, model=_model_file(tmp_path, n_layers=4))
    serial_run = _train(config, "dp=1", 1)
    world_size = Plan.parse(plan_text).world_size
    for result in run_ranks(world_size, _tensor_parallel_run, config, plan_text, world_size):
        assert result["params"]  # this stage's parameters, under the serial model's names
        _assert_follows_serial(result, serial_run)


def test_pipeline_resume_continues_the_same_trajectory(tmp_path):
    config = dataclasses.replace(BASE, steps=4, ckpt_every=2, out=str(tmp_path / "full"))
    plan = "pp=2,micro_batches=2"
    full = run_ranks(2, _train, config, plan, 2)
    checkpoint = tmp_path / "full" / "checkpoints" / checkpoint_name(2)
    resumed_config = dataclasses.replace(config, out=str(tmp_path / "resumed"))
    resumed = run_ranks(2, _train, resumed_config, plan, 2, checkpoint)
    for before, after in zip(full, resumed, strict=True):
        assert [r["step"] for r in after["rows"]] == [3, 4]
        _assert_same_run(after, {"rows": before["rows"][2:], "params": before["params"]}, 1e-6)


def _tp_bytes_per_step(config: TrainConfig, plan_text: str, world_size: int) -> int:
    plan = Plan.parse(plan_text)
    trainer = Trainer(prepare_run(config, plan, world_size), build_mesh(plan))
    trainer.train_step()
    return trainer.train_step()["comm_bytes"]["tp"]


def test_recomputation_replays_the_forward_reductions_without_communicating(tmp_path):
    config = dataclasses.replace(BASE, model=_model_file(tmp_path, n_layers=4))
    plain = "pp=2,tp=2,micro_batches=2"
    plans = [plain, f"{plain},recompute=full", f"{plain},schedule=shifted,recompute=full"]
    tp_bytes = [run_ranks(4, _tp_bytes_per_step, config, text, 4)[0] for text in plans]
    # recomputing every block (first stage) moves no more tensor-parallel bytes than not
    assert tp_bytes[0] > 0 and tp_bytes == [tp_bytes[0]] * 3


def _stage_blocks(config: TrainConfig) -> list[int]:
    plan = Plan.parse("pp=2,micro_batches=2")
    trainer = Trainer(prepare_run(config, plan, 2), build_mesh(plan))
    return sorted(int(i) for i in trainer.model.blocks)


@pytest.mark.parametrize("split", [{"split_points": ("blocks.1",)}, {"layers_per_stage": (1, 3)}])
def test_pipeline_split_overrides_reach_the_stages(tmp_path, split):
    config = dataclasses.replace(BASE, model=_model_file(tmp_path, n_layers=4), **split)
    assert run_ranks(2, _stage_blocks, config) == [[0], [1, 2, 3]]
