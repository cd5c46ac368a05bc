"""`interlace export RUN --to hf OUT`: a checkpoint of the tiny built-in GPT taken under dp, tp
and pp loads as `transformers.GPT2LMHeadModel`, whose logits equal those of the interlace model
resumed from the same checkpoint on one process (fp32); 1D tensor-parallel pieces kept per rank
(dp_shard with tp) are joined back; what GPT-2 cannot express, pieces that cannot be joined and
bad input are refused with one line (exit code 2) and nothing written; a failed write (exit
code 3) leaves OUT as it was. No network."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import TINY_RUN, pieces_under_own_keys
from hf_models import saved_tiny_model
from interlace.checkpoint import checkpoint_name
from interlace.cli import main
from interlace.data.corpus import load_corpus
from interlace.data.tokenizer import get_tokenizer
from interlace.export import hf_folder
from interlace.mesh import build_mesh
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig
from test_cli import checkpoint_dir, corrupt_a_shard, expect_usage_error

transformers = pytest.importorskip("transformers")

BASE = dataclasses.replace(TINY_RUN, steps=2, measure_memory=False)
ROUND_TRIP = ["dp=2", "tp=2", "pp=2,micro_batches=2", "pp=2,tp=2,micro_batches=2"]


def _fit(config: TrainConfig, plan_text: str) -> None:
    plan = Plan.parse(plan_text)
    mesh = build_mesh(plan) if plan.world_size > 1 else None
    Trainer(prepare_run(config, plan, plan.world_size), mesh).fit()


def _trained(folder: Path, plan_text: str, config: TrainConfig = BASE) -> Path:
    """The run folder of `config` trained under `plan_text` (a checkpoint at its last step)."""
    config = dataclasses.replace(config, out=str(folder))
    world_size = Plan.parse(plan_text).world_size
    if world_size == 1:
        _fit(config, plan_text)
    else:
        run_ranks(world_size, _fit, config, plan_text)
    return folder


def _fit_written_as_before(config: TrainConfig, plan_text: str) -> None:
    with pieces_under_own_keys():
        _fit(config, plan_text)


def _export(capsys, run: Path, out: Path, *extra: str) -> str:
    """`interlace export run --to hf out`, which must succeed; returns its stdout."""
    capsys.readouterr()
    code = main(["export", str(run), "--to", "hf", str(out), *extra])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    return printed.out


def _tokens(vocab_size: int, seq_len: int) -> torch.Tensor:
    return torch.randint(vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _interlace_logits(config: TrainConfig, run: Path, idx: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of the model resumed from `run`'s latest checkpoint on one process."""
    trainer = Trainer(prepare_run(config, Plan(), 1))
    trainer.resume(run)
    return trainer.model.eval()(idx)


@torch.no_grad()
def _hf_logits(out: Path, idx: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of the exported folder loaded by transformers, which must find every
    weight it expects and no other."""
    model, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()(idx).logits


@pytest.mark.parametrize("plan_text", ROUND_TRIP)
def test_exported_gpt2_gives_the_trained_models_logits(plan_text, tmp_path, capsys):
    run = _trained(tmp_path / "run", plan_text)
    out = tmp_path / "hf"
    printed = _export(capsys, run, out)
    assert f"step {BASE.steps}, plan {plan_text}" in printed
    assert "byte tokenizer has no Hugging Face tokenizer file" in printed
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    idx = _tokens(256, 64)
    expected = _interlace_logits(BASE, run, idx)
    actual = _hf_logits(out, idx)
    assert actual.shape == expected.shape == (2, 64, 256)
    assert (actual - expected).abs().max() <= 1e-5


def test_tensor_parallel_pieces_under_dp_shard_are_joined(tmp_path, capsys):
    # dp_shard with tp stores each rank's shard as its place in the full tensor; a checkpoint
    # written before keeps each rank's piece under its own key (`.tp<rank>`), joined on export.
    # The runs follow the tp=2 run's trajectory, whose weights agree with theirs to float
    # rounding after 2 steps
    idx = _tokens(256, 64)
    logits = {}
    runs = {
        "dp_shard=2,tp=2": lambda folder: _trained(folder, "dp_shard=2,tp=2"),
        "as before": lambda folder: run_ranks(
            4, _fit_written_as_before, dataclasses.replace(BASE, out=str(folder)), "dp_shard=2,tp=2"
        ),
        "tp=2": lambda folder: _trained(folder, "tp=2"),
    }
    for name, train in runs.items():
        train(tmp_path / name)
        _export(capsys, tmp_path / name, tmp_path / f"hf-{name}")
        logits[name] = _hf_logits(tmp_path / f"hf-{name}", idx)
    for name, own_keys in (("dp_shard=2,tp=2", False), ("as before", True)):
        assert (logits[name] - logits["tp=2"]).abs().max() <= 1e-4, name
        checkpoint = tmp_path / name / "checkpoints" / checkpoint_name(BASE.steps)
        keys = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
        assert any(".tp1" in key for key in keys) == own_keys, name


def test_an_untied_head_is_exported_as_its_own_weight(tmp_path, capsys):
    spec = dataclasses.replace(get_preset("tiny"), tie_embeddings=False)
    (tmp_path / "untied.json").write_text(json.dumps(spec.to_dict()))
    config = dataclasses.replace(BASE, model=str(tmp_path / "untied.json"))
    run = _trained(tmp_path / "run", "dp=1", config)
    out = tmp_path / "hf"
    _export(capsys, run, out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    idx = _tokens(256, 64)
    assert (_hf_logits(out, idx) - _interlace_logits(config, run, idx)).abs().max() <= 1e-5


@pytest.mark.parametrize("plan_text", ["tp=2", "pp=2,micro_batches=2"])
def test_a_llama_shaped_run_exports_as_llama_with_its_logits(plan_text, tmp_path, capsys):
    config = dataclasses.replace(BASE, model="llama-tiny")
    run = _trained(tmp_path / "run", plan_text, config)
    out = tmp_path / "hf"
    assert "LlamaForCausalLM" in _export(capsys, run, out)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM" and not any(info.values()), info
    idx = _tokens(256, 64)
    with torch.no_grad():
        actual = model.eval()(idx).logits
    assert (actual - _interlace_logits(config, run, idx)).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"position_encoding": "learned"}, "learned positions but norm='rmsnorm'"),
        ({"norm": "layernorm"}, "rotary positions but norm='layernorm'"),
    ],
)
def test_a_shape_between_gpt2_and_llama_is_refused(changes, message, capsys, tmp_path):
    spec = dataclasses.replace(get_preset("llama-tiny"), **changes)
    (tmp_path / "mixed.json").write_text(json.dumps(spec.to_dict()))
    config = dataclasses.replace(BASE, model=str(tmp_path / "mixed.json"), steps=1)
    run = _trained(tmp_path / "run", "dp=1", config)
    argv = ["export", str(run), "--to", "hf", str(tmp_path / "hf")]
    expect_usage_error(capsys, argv, message)
    assert not (tmp_path / "hf").exists()


def test_a_bpe_runs_tokenizer_is_copied_and_encodes_alike(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("INTERLACE_CACHE", str(tmp_path / "cache"))
    config = dataclasses.replace(BASE, tokenizer="bpe", steps=1)
    run = _trained(tmp_path / "run", "dp=1", config)
    out = tmp_path / "hf"
    assert "tokenizer: tokenizer.json, the run's, of" in _export(capsys, run, out)
    text = "def export(run):\n    return run  # ünïcode"
    ours = get_tokenizer("bpe", load_corpus())
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.decode(ours.encode(text)) == text


# ---------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run of the tiny GPT on one process; copy it before changing it."""
    return _trained(tmp_path_factory.mktemp("export") / "run", "dp=1")


def test_a_run_without_checkpoints_is_refused(capsys, tmp_path):
    (tmp_path / "run").mkdir()
    argv = ["export", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]
    expect_usage_error(capsys, argv, "holds no checkpoint")
    assert not (tmp_path / "hf").exists()


def test_a_missing_step_is_refused_naming_the_kept_steps(capsys, tiny_run, tmp_path):
    argv = ["export", str(tiny_run), "--checkpoint", "7", "--to", "hf", str(tmp_path / "hf")]
    expect_usage_error(capsys, argv, "no checkpoint of step 7; steps kept: 2")
    assert not (tmp_path / "hf").exists()


def test_a_corrupt_checkpoint_is_refused(capsys, tiny_run, tmp_path):
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    corrupt_a_shard(run)
    argv = ["export", str(run), "--checkpoint", "2", "--to", "hf", str(tmp_path / "hf")]
    expect_usage_error(capsys, argv, str(checkpoint_dir(run)), "corrupt")
    assert not (tmp_path / "hf").exists()


def test_a_non_empty_out_is_kept_unless_overwrite(capsys, tiny_run, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["export", str(tiny_run), "--to", "hf", str(out)]
    expect_usage_error(capsys, argv, f"output folder '{out}' is not empty", "--overwrite")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    _export(capsys, tiny_run, out, "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary left beside it


def test_a_failed_write_leaves_out_as_it_was(capsys, tiny_run, tmp_path, monkeypatch):
    def disk_full(weights, file):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))

    monkeypatch.setattr(hf_folder, "_save_safetensors", disk_full)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["export", str(tiny_run), "--to", "hf", str(out), "--overwrite"]) == 3
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "No space left on device" in err[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_an_out_holding_the_run_is_refused_even_with_overwrite(capsys, tiny_run):
    argv = ["export", str(tiny_run), "--to", "hf", str(tiny_run.parent), "--overwrite"]
    expect_usage_error(capsys, argv, "holds the run")
    assert checkpoint_dir(tiny_run).is_dir()


def test_a_mixture_of_experts_model_is_refused(capsys, tmp_path):
    run = _trained(tmp_path / "run", "dp=1", dataclasses.replace(BASE, model="moe-tiny", steps=1))
    argv = ["export", str(run), "--to", "hf", str(tmp_path / "hf")]
    expect_usage_error(capsys, argv, "Mixture-of-Experts layers (n_experts=4 in layers [1])")
    assert not (tmp_path / "hf").exists()


def test_a_model_without_biases_is_refused(capsys, tmp_path):
    spec = dataclasses.replace(get_preset("tiny"), bias=False)
    (tmp_path / "no-bias.json").write_text(json.dumps(spec.to_dict()))
    config = dataclasses.replace(BASE, model=str(tmp_path / "no-bias.json"), steps=1)
    run = _trained(tmp_path / "run", "dp=1", config)
    argv = ["export", str(run), "--to", "hf", str(tmp_path / "hf")]
    expect_usage_error(capsys, argv, "the model has no biases (bias=false)")
    assert not (tmp_path / "hf").exists()


def test_pieces_of_a_3d_grid_cutting_a_dimension_twice_are_assembled(tmp_path, capsys):
    # tp3d=1x2x2 cuts the rows of q, k, v and up over y, then again over z: each stored whole,
    # its Shard3D recorded; the run follows one process to float rounding
    config = dataclasses.replace(BASE, steps=1)
    run = _trained(tmp_path / "run", "tp3d=1x2x2", config)
    stored = json.loads((checkpoint_dir(run) / "meta.json").read_text())["assembly"]
    assert stored["blocks.0.attn.q_proj.weight"]["flat"] is not None  # rows cut twice
    _export(capsys, run, tmp_path / "hf")
    idx = _tokens(256, 64)
    expected = _interlace_logits(config, _trained(tmp_path / "serial", "dp=1", config), idx)
    assert (_hf_logits(tmp_path / "hf", idx) - expected).abs().max() <= 1e-5


def test_pieces_with_no_recorded_assembly_are_refused_naming_plan_and_parameter(
    capsys, tmp_path, monkeypatch
):
    # a checkpoint written before checkpoints recorded how their pieces assemble, nor stored
    # them whole (tp3d=1x2x2: each rank's piece of q, k, v and up under its own key)
    config = dataclasses.replace(BASE, steps=1, out=str(tmp_path / "run"))
    run_ranks(4, _fit_written_as_before, config, "tp3d=1x2x2")
    run = tmp_path / "run"
    real = hf_folder.read_full_state

    def without_assembly(checkpoint, meta, shapes):
        return real(checkpoint, {k: v for k, v in meta.items() if k != "assembly"}, shapes)

    monkeypatch.setattr(hf_folder, "read_full_state", without_assembly)
    argv = ["export", str(run), "--to", "hf", str(tmp_path / "hf")]
    needle = "plan 'tp3d=1x2x2' stores blocks.0.attn.q_proj.weight as per-rank pieces"
    expect_usage_error(capsys, argv, needle)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("kind", "plan_text", "reference"),
    [
        ("llama", "dp=2", "dp=2"),
        ("gpt2", "pp=2,micro_batches=2", "pp=2,micro_batches=2"),
        ("mixtral", "dp=2,ep=2", "dp=2"),
        ("gpt2", "tp=2", "dp=2"),  # fused q|k|v pieces cut per head
        ("llama", "tp=4", "dp=2"),  # grouped-query kv pieces held by two ranks each
    ],
)
def test_a_hugging_face_model_exports_as_itself_and_trains_on(
    kind, plan_text, reference, tmp_path, capsys
):
    """A `hf:PATH` run's checkpoint: the exported folder loads with every weight found under
    its own name (experts split one per module by expert parallelism stacked back), gives the
    trained model's logits, and `--model hf:OUT` starts from them. The trained model is the
    run's own resumed on one process, or (expert parallel, and tensor parallel pieces cut per
    head: their checkpoints resume under their own plan only) the same training under dp=2,
    equal to float rounding."""
    config = dataclasses.replace(BASE, model=saved_tiny_model(kind, tmp_path / "model"))
    run = _trained(tmp_path / "run", plan_text, config)
    out = tmp_path / "hf"
    _export(capsys, run, out)
    idx = _tokens(256, 32)
    if reference != plan_text:
        run = _trained(tmp_path / "reference", reference, config)
    expected = _interlace_logits(config, run, idx)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert (model.eval()(idx).logits - expected).abs().max() <= 1e-5
    trained_on = Trainer(prepare_run(dataclasses.replace(config, model=f"hf:{out}"), Plan(), 1))
    with torch.no_grad():
        assert (trained_on.model.eval()(idx) - expected).abs().max() <= 1e-5
