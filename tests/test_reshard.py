"""Resume under another plan: a checkpoint taken under any plan resumes under any other the model
supports, on another world size, and the next steps' losses equal those of continuing under the
original plan (fp32; the checkpoint stores the pieces of split tensors as full tensors, DCP
reshards them). Pieces no other split can read are refused (a CheckpointError naming the
checkpoint's plan)."""

import dataclasses
import json

import pytest

from helpers import TINY_RUN, pieces_under_own_keys, train_steps
from hf_models import needs_hf, saved_tiny_model
from interlace.checkpoint import checkpoint_name
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.testing import RankFailed, run_ranks
from interlace.train_config import TrainConfig

BASE = dataclasses.replace(TINY_RUN, steps=5, measure_memory=False)
SAVED_AT = 2

DENSE = ["dp=2", "tp=2", "pp=2,micro_batches=2", "tp3d=2x1x1", "dp_shard=2"]
MOE = ["dp=2,ep=2", "dp=2", "dp_shard=2,ep=2"]


def _losses(config: TrainConfig, plan_text: str, resume_from=None) -> list[float]:
    """The losses of the steps this run takes; with `config.out`, a checkpoint at SAVED_AT."""
    return train_steps(config, plan_text, resume_from, SAVED_AT)[0]


def _run(config: TrainConfig, plan_text: str, resume_from=None) -> list[float]:
    world_size = Plan.parse(plan_text).world_size
    if world_size == 1:
        return _losses(config, plan_text, resume_from)
    return run_ranks(world_size, _losses, config, plan_text, resume_from)[0]


def _moe_file(tmp_path) -> str:
    spec = dataclasses.replace(get_preset("moe-tiny"), dropless=True, aux_loss_coef=0.0)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(spec.to_dict()))
    return str(path)


def _check_matrix(tmp_path, config: TrainConfig, plans: list[str], targets: list[str]) -> None:
    for source in plans:
        saved = dataclasses.replace(config, out=str(tmp_path / source))
        continued = _run(saved, source)[SAVED_AT:]
        checkpoint = tmp_path / source / "checkpoints" / checkpoint_name(SAVED_AT)
        for target in targets:
            if target == source:
                continue
            resumed = _run(config, target, checkpoint)
            assert resumed == pytest.approx(continued, abs=1e-5), f"{source} -> {target}"


def test_dense_checkpoints_resume_under_every_other_plan(tmp_path):
    # 2-rank plans, one process and 4 ranks (dp=2 × tp=2) as targets
    _check_matrix(tmp_path, BASE, DENSE, [*DENSE, "dp=1", "dp=2,tp=2"])


def test_expert_parallel_checkpoints_resume_under_other_plans(tmp_path):
    config = dataclasses.replace(BASE, model=_moe_file(tmp_path))
    _check_matrix(tmp_path, config, MOE, MOE)


@pytest.mark.slow
def test_expert_and_tensor_parallel_checkpoints_resume_elsewhere_and_back(tmp_path):
    # ep × tp: the tp ranks of an expert hold it whole and alike, stored under its own key
    config = dataclasses.replace(BASE, model=_moe_file(tmp_path))
    plans = ["dp=2,ep=2,tp=2", "dp=2,ep=2"]
    _check_matrix(tmp_path, config, plans, [*plans, "tp=2"])


@pytest.mark.slow
def test_experts_split_over_tp_resume_elsewhere_and_back(tmp_path):
    # etp: each tp rank's piece of an expert is stored as its place in the whole expert
    config = dataclasses.replace(BASE, model=_moe_file(tmp_path))
    split = "dp=2,ep=2,tp=2,etp=2"
    _check_matrix(tmp_path, config, [split], ["dp=2,ep=2", "dp=2,ep=2,tp=2", "dp=1"])
    _check_matrix(tmp_path, config, ["dp=2,ep=2"], [split])


@pytest.mark.slow
def test_expert_and_3d_tensor_parallel_checkpoints_resume_elsewhere_and_back(tmp_path):
    # ep × tp3d: the grid's pieces under their 3D keys (z > 1: alike on every z slice), each
    # expert whole on its owners
    config = dataclasses.replace(BASE, model=_moe_file(tmp_path))
    plans = ["dp=2,ep=2,tp3d=2x1x1", "dp=2,ep=2,tp3d=1x1x2", "dp=2,ep=2"]
    _check_matrix(tmp_path, config, plans, [*plans, "dp=1", "dp=2,ep=2,tp=2"])


@pytest.mark.slow
@needs_hf
def test_hf_fused_experts_resume_between_expert_layouts_with_tensor_splits(tmp_path):
    # a Qwen2-MoE folder (fused experts, shared expert): each expert stored under its own key
    # whole, beside the tensor split's pieces; multi-head attention, whose split pieces reshard
    model = saved_tiny_model("qwen2_moe", tmp_path / "model", 320, kv_heads=4)
    config = dataclasses.replace(BASE, model=model)
    plans = ["dp=2,ep=2,tp=2", "dp=2,ep=2,tp3d=2x1x1", "dp=2,ep=2"]
    _check_matrix(tmp_path, config, plans, plans)
    # experts split over tp: gate|up's pieces are two runs (gate rows, up rows), gathered into
    # the full expert on saving and cut from it on loading, as fused q|k|v's are
    split = ["dp=2,ep=2,tp=2,etp=2"]
    _check_matrix(tmp_path, config, split, ["dp=2,ep=2", "dp=2,ep=2,tp=2"])
    _check_matrix(tmp_path, config, ["dp=2,ep=2"], split)


def test_sharded_stacked_experts_resume_under_expert_parallelism_and_back(tmp_path):
    # dp_shard=2 shards each stacked expert tensor's rows (FSDP2), each rank storing the
    # experts it holds under their own keys: the keys expert parallelism stores them under
    config = dataclasses.replace(BASE, model=_moe_file(tmp_path))
    plans = ["dp_shard=2", "dp=2,ep=2"]
    _check_matrix(tmp_path, config, plans, plans)


def test_a_changed_global_batch_resumes_with_a_warning(tmp_path, capfd):
    saved = dataclasses.replace(BASE, out=str(tmp_path / "a"), steps=3)
    _run(saved, "dp=2")
    checkpoint = tmp_path / "a" / "checkpoints" / checkpoint_name(SAVED_AT)
    _run(dataclasses.replace(BASE, global_batch=16, steps=3), "tp=2", checkpoint)
    err = capfd.readouterr().err
    assert "resuming a checkpoint of plan 'dp=2' under plan 'tp=2'" in err
    assert "warning: the global batch changed from 8 to 16" in err


def test_3d_pieces_cut_twice_are_stored_whole(tmp_path):
    # tp3d=1x2x2 cuts the rows of every linear over y, then again over z: each piece written
    # at its runs into the full tensor on saving, cut from it on loading
    _check_matrix(tmp_path, BASE, ["tp3d=1x2x2"], ["dp=2"])


def test_pieces_no_other_split_can_read_are_refused_naming_the_plan(tmp_path):
    # a checkpoint written before pieces were stored whole keeps them under keys of their own
    saved = dataclasses.replace(BASE, out=str(tmp_path / "a"), steps=3)
    run_ranks(4, _losses_written_as_before, saved, "tp3d=1x2x2")
    checkpoint = tmp_path / "a" / "checkpoints" / checkpoint_name(SAVED_AT)
    with pytest.raises(RankFailed, match=r"\(plan tp3d=1x2x2\) cannot be read under this split"):
        _run(BASE, "dp=2", checkpoint)
    assert len(_run(BASE, "tp3d=1x2x2", checkpoint)) == BASE.steps - SAVED_AT  # its own plan


def _losses_written_as_before(config: TrainConfig, plan_text: str) -> list[float]:
    """`_losses` of a run whose checkpoint holds each rank's tensor parallel pieces under their
    own keys, as checkpoints were written before those pieces were stored whole."""
    with pieces_under_own_keys():
        return _losses(config, plan_text)


def test_fsdp2_shards_of_tensor_parallel_pieces_resume_elsewhere_and_back(tmp_path):
    # dp_shard=2 with tp=2: each rank's FSDP2 shard of its tp piece is stored as its place in
    # the full tensor, FSDP2's cut after tp's (a wrong order of the two fails this)
    _check_matrix(tmp_path, BASE, ["dp_shard=2,tp=2"], ["dp=2", "dp=1"])
    _check_matrix(tmp_path, BASE, ["dp=2"], ["dp_shard=2,tp=2"])


@needs_hf
@pytest.mark.slow
def test_fsdp2_shards_of_fused_pieces_resume_under_their_own_plan(tmp_path):
    # GPT-2's fused q|k|v pieces sharded again by FSDP2 stay under their own keys (gathering
    # them whole would hold the sharded model whole on every rank)
    config = dataclasses.replace(BASE, model=saved_tiny_model("gpt2", tmp_path / "model", 320))
    sharded = "dp_shard=2,tp=2"
    saved = dataclasses.replace(config, out=str(tmp_path / "a"))
    continued = _run(saved, sharded)[SAVED_AT:]
    checkpoint = tmp_path / "a" / "checkpoints" / checkpoint_name(SAVED_AT)
    assert _run(config, sharded, checkpoint) == pytest.approx(continued, abs=1e-5)
    with pytest.raises(RankFailed, match=r"\(plan dp_shard=2,tp=2\) cannot be read"):
        _run(config, "dp=2", checkpoint)


@needs_hf
@pytest.mark.slow
@pytest.mark.parametrize(("kind", "kv_heads"), [("gpt2", 4), ("llama", 1)])
def test_fused_and_shared_kv_pieces_resume_under_other_plans_and_back(tmp_path, kind, kv_heads):
    # GPT-2's fused q|k|v pieces are three runs each; Llama's one kv head is held by both tp
    # ranks: stored as full tensors, gathered on saving and cut on loading
    config = dataclasses.replace(
        BASE, model=saved_tiny_model(kind, tmp_path / "model", 320, kv_heads=kv_heads)
    )
    _check_matrix(tmp_path, config, ["tp=2"], ["dp=1", "dp=2"])
    _check_matrix(tmp_path, config, ["dp=2"], ["tp=2"])


def test_a_pipeline_of_tensor_parallel_stages_resumes_elsewhere(tmp_path):
    # the last stage's piece of the tied head is stored as the embedding's, like stage 0's
    _check_matrix(tmp_path, BASE, ["pp=2,tp=2,micro_batches=2"], ["dp=1", "tp=2"])


@pytest.mark.slow  # 10 runs
def test_context_parallel_checkpoints_resume_under_other_plans_and_back(tmp_path):
    _check_matrix(
        tmp_path, BASE, ["cp=2", "dp=2"], ["cp=2", "dp=1", "cp=2,tp=2", "cp=2,dp_shard=2"]
    )


@pytest.mark.slow  # 4-rank runs
def test_the_newer_layouts_resume_under_one_process_and_back(tmp_path):
    # MoE layers in pipeline stages (with experts over ep), sequences split inside stages, 3D
    # tensor parallel stages (z = 1, and z > 1: rows over z), a 3D grid's sequence split over y
    # (dense, and with experts over ep); 3D pieces sharded by FSDP2 (z = 1 and z > 1: the
    # shards of row pieces stored with FSDP2's cut after z's)
    moe = dataclasses.replace(BASE, model=_moe_file(tmp_path))
    moe_plans = ["dp=2,ep=2,pp=2,micro_batches=2", "dp=2,ep=2,tp3d=1x2x1,sequence_parallel=true"]
    _check_matrix(tmp_path, moe, moe_plans, ["dp=1", "dp=2,ep=2"])
    dense = [
        "cp=2,pp=2,micro_batches=2",
        "pp=2,tp3d=2x1x1,micro_batches=2",
        "pp=2,tp3d=1x1x2,micro_batches=2",
        "tp3d=1x2x1,sequence_parallel=true",
        "dp_shard=2,tp3d=2x1x1",
        "dp_shard=2,tp3d=1x1x2",
    ]
    _check_matrix(tmp_path, BASE, dense, ["dp=1"])
    _check_matrix(tmp_path, BASE, ["dp=1"], dense)


@pytest.mark.slow
def test_interleaved_checkpoints_resume_under_other_stages_per_rank(tmp_path):
    # the stages store their layers under the whole model's names, wherever the layers ran
    spec = dataclasses.replace(get_preset("tiny"), n_layers=6)
    path = tmp_path / "six.json"
    path.write_text(json.dumps(spec.to_dict()))
    config = dataclasses.replace(BASE, model=str(path))
    plans = [
        "pp=2,micro_batches=2,schedule=interleaved,virtual_stages=3",
        "pp=2,micro_batches=2,schedule=interleaved",
    ]
    _check_matrix(tmp_path, config, plans, [*plans, "dp=1"])
