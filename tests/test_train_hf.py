"""Hugging Face causal LMs as a run's model (`--model hf:PATH`): tiny GPT-2, Llama, Mixtral and
Qwen2-MoE folders written by `save_pretrained` train through the Trainer under dp=2, tp=2, pp=2
and (the MoE models) ep=2, and ep=2 with tp=2 or a 3D grid (experts whole on their owners, the
block's tokens shared by the tensor-parallel ranks; under tp the shared expert split as a dense
feed-forward) or with each expert split over tp (etp=2), with the losses of the single-process
run step for step; the folder's weights are the ones trained (the first loss is the HF model's
own on the same batch); what cannot run is refused before any rank starts."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY_RUN
from hf_models import needs_hf, saved_tiny_model, transformers
from interlace.cli import main
from interlace.errors import ConfigError, DataError, PlanError
from interlace.mesh import build_mesh
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run

pytestmark = needs_hf

VOCAB = 320  # above the byte tokenizer's 256 ids, apart from every feed-forward width
PLANS = {
    "gpt2": ["dp=2", "tp=2", "pp=2,micro_batches=2"],
    "llama": [
        "dp=2",
        "tp=2,sequence_parallel=true",
        "pp=2,micro_batches=2",
        "dp_shard=2",
        "tp3d=2x1x1",
    ],
    "mixtral": ["dp=2", "dp=2,ep=2", "pp=2,micro_batches=2"],
    "qwen2_moe": ["dp=2,ep=2"],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """{kind: hf:PATH} of the tiny saved models."""
    root = tmp_path_factory.mktemp("hf")
    return {kind: saved_tiny_model(kind, root / kind, VOCAB) for kind in PLANS}


def _rows(model: str, plan_text: str, world_size: int) -> tuple[list[dict], list[str]]:
    """Each step's metrics, and the report of the split."""
    plan = Plan.parse(plan_text)
    config = dataclasses.replace(TINY_RUN, model=model)
    mesh = build_mesh(plan) if world_size > 1 else None
    trainer = Trainer(prepare_run(config, plan, world_size), mesh)
    return [trainer.train_step() for _ in range(config.steps)], trainer.parallel.report


def _losses(model: str, plan_text: str, world_size: int) -> list[float]:
    return [row["loss"] for row in _rows(model, plan_text, world_size)[0]]


@pytest.mark.parametrize(
    ("kind", "plan_text"), [(kind, plan) for kind, plans in PLANS.items() for plan in plans]
)
def test_hf_model_trains_under_the_plan_as_in_one_process(folders, kind, plan_text):
    serial = _losses(folders[kind], "dp=1", 1)
    for losses in run_ranks(2, _losses, folders[kind], plan_text, 2, timeout=120):
        assert losses == pytest.approx(serial, abs=1e-5)


@pytest.mark.parametrize(
    ("kind", "plan_text"),
    [
        ("mixtral", "dp=2,ep=2,tp=2"),
        ("qwen2_moe", "dp=2,ep=2,tp=2"),
        ("qwen2_moe", "dp_shard=2,ep=2,tp=2"),
        ("qwen2_moe", "dp=2,ep=2,tp=2,sequence_parallel=true"),
        ("mixtral", "dp=2,ep=2,tp=2,moe_balance=prophet"),
        ("mixtral", "dp=2,ep=2,tp3d=2x1x1"),
        ("qwen2_moe", "dp=2,ep=2,tp3d=1x1x2"),
        ("mixtral", "dp=2,ep=2,tp3d=1x2x1,sequence_parallel=true"),
        ("qwen2_moe", "dp=2,ep=2,tp=2,etp=2"),
        ("qwen2_moe", "dp=2,ep=2,tp=2,etp=2,sequence_parallel=true"),
        pytest.param("mixtral", "dp=2,ep=2,tp=2,etp=2,moe_balance=prophet", marks=pytest.mark.slow),
    ],
)
def test_hf_experts_split_over_ep_beside_tensor_parallelism_train_as_in_one_process(
    folders, kind, plan_text
):
    # losses and pre-clipping gradient norms: Adam's update would hide a gradient scaled by tp
    serial = _rows(folders[kind], "dp=1", 1)[0]
    for rows, report in run_ranks(4, _rows, folders[kind], plan_text, 4, timeout=180):
        assert sum("of 4 on this rank (ep=2" in line for line in report) == 2  # both layers
        split = any(line.startswith("etp=2: each expert of 2") for line in report)
        assert split == ("etp=2" in plan_text)
        for key, tolerance in (("loss", {"abs": 1e-5}), ("grad_norm", {"rel": 1e-5})):
            assert [r[key] for r in rows] == pytest.approx([r[key] for r in serial], **tolerance)


@pytest.mark.slow
def test_hf_experts_split_over_ep_inside_pipeline_stages_train_as_in_one_process(folders):
    serial = _losses(folders["mixtral"], "dp=1", 1)
    plan_text = "dp=2,ep=2,pp=2,micro_batches=2,moe_balance=prophet"
    for losses in run_ranks(4, _losses, folders["mixtral"], plan_text, 4, timeout=180):
        assert losses == pytest.approx(serial, abs=1e-5)


def test_the_folder_weights_are_trained_from_their_own_first_loss(folders):
    """The Trainer's first loss is the HF model's own (loaded by transformers) on that batch."""
    setup = prepare_run(dataclasses.replace(TINY_RUN, model=folders["llama"]), Plan(), 1)
    trainer = Trainer(setup)
    (x, y), *_ = trainer.batches.micro_batches(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"][3:])
    with torch.no_grad():
        expected = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
    assert trainer.train_step()["loss"] == pytest.approx(expected.item(), abs=1e-6)


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"no config\.json"):
        prepare_run(dataclasses.replace(TINY_RUN, model=f"hf:{tmp_path}"), Plan(), 1)


def test_a_tokenizer_larger_than_the_embedding_is_refused(folders):
    config = dataclasses.replace(TINY_RUN, model=folders["gpt2"], tokenizer="bpe")
    with pytest.raises(DataError, match=f"the model's embedding only {VOCAB}"):
        prepare_run(config, Plan(), 1)


def test_a_split_the_model_cannot_run_is_refused_before_launch(folders, tmp_path, capsys):
    """pipeline × tensor parallelism (1D or 3D) of a HF model: exit 2, one line, no rank, no
    files."""
    with pytest.raises(PlanError, match="use tp=1 for Hugging Face models"):
        prepare_run(
            dataclasses.replace(TINY_RUN, model=folders["gpt2"]),
            Plan.parse("pp=2,tp=2,micro_batches=2"),
            4,
        )
    out = tmp_path / "run"
    argv = ["train", "--model", folders["gpt2"], "--plan", "pp=2,tp=2,micro_batches=2"]
    assert main([*argv, "--nproc", "4", "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not out.exists()
    with pytest.raises(PlanError, match="use tp3d without pp for Hugging Face models"):
        prepare_run(
            dataclasses.replace(TINY_RUN, model=folders["llama"]),
            Plan.parse("pp=2,tp3d=2x1x1,micro_batches=2"),
            4,
        )


def test_the_planner_prices_a_hf_model_by_its_shape(folders, capsys):
    """`interlace plan --model hf:PATH` reads the folder's config: its parameters, as the
    built-in GPT of the same shape counts them (Mixtral: every expert)."""
    assert main(["plan", "--model", folders["mixtral"], "--plan", "dp=2,ep=2", "--nproc", "2"]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folders["mixtral"][3:])
    counted = int(capsys.readouterr().out.split(": ")[1].split(" parameters")[0].replace(",", ""))
    assert counted == pytest.approx(sum(p.numel() for p in hf_model.parameters()), rel=0.05)


def test_interlace_train_launches_a_hf_model_on_two_ranks(folders, tmp_path, monkeypatch, capfd):
    """The command itself (launcher, ranks, report): tp=2 of the Llama folder follows the
    single-process losses; the report names the folder."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the launcher would set it in this process
    out = tmp_path / "run"
    argv = ["train", "--model", folders["llama"], "--plan", "tp=2", "--nproc", "2"]
    fast = ["--steps", "3", "--global-batch", "8", "--warmup-steps", "1", "--lr", "5e-4"]
    assert main([*argv, *fast, "--eval-every", "0", "--out", str(out)]) == 0, capfd.readouterr()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    serial = _losses(folders["llama"], "dp=1", 1)
    assert [row["loss"] for row in rows] == pytest.approx(serial, abs=1e-5)
    assert json.loads((out / "report.json").read_text())["model"]["hf"] == folders["llama"]
