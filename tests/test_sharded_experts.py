"""Experts under sharded data parallelism, sharded by FSDP2 over the ranks holding the same
experts (ep_dp): `ep=2,dp_shard=2` on 4 ranks (dp=2 × dp_shard=2, ep_dp of 2 ranks) trains step
for step as its `ep=2,dp=4` twin, whose experts each of those ranks holds whole (fp32: losses,
pre-clipping norms, the first step's gradients, the weights after four steps), holds half the
experts' state per rank, and its checkpoints resume under the twin and back. Balancing
strategies that send whole experts to other ranks keep them whole, and say so."""

import dataclasses

import pytest
from torch.distributed.tensor import DTensor

from helpers import TINY_RUN
from interlace.memory import storage_bytes
from interlace.parallel.expert.grads import expert_parameters
from interlace.parallel.expert.options import replicated_because
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.train import Trainer
from interlace.train_config import TrainConfig
from test_fsdp import _assert_same, _moe_file
from test_fsdp import _run as _fsdp_run
from test_reshard import BASE as RESUMED
from test_reshard import _check_matrix

SHARDED, TWIN = "dp=2,dp_shard=2,ep=2", "dp=4,ep=2"


def _expert_state(trainer: Trainer) -> dict:
    """Whether the experts are sharded, and the bytes of this rank's expert parameters,
    gradients and AdamW states."""
    experts = expert_parameters(trainer.model)
    states = [s for p in experts for s in trainer.optimizer.state[p].values() if s.dim()]
    return {
        "sharded": all(isinstance(p, DTensor) for p in experts),
        "bytes": storage_bytes([*experts, *(p.grad for p in experts), *states]),
    }


def _run(config: TrainConfig, plan_text: str) -> dict:
    """`test_fsdp._run` of `plan_text` on its world, with the experts' state after the last
    step (`_expert_state`): "sharded" and "bytes"."""
    world_size = Plan.parse(plan_text).world_size
    result = _fsdp_run(config, plan_text, world_size, observe=_expert_state)
    return {**result, **result.pop("observed")}


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> TrainConfig:
    """Four steps of a dropless moe-tiny without the auxiliary loss (as test_fsdp's expert
    tests), clipping off so that the gradients compared are the reduced ones."""
    model = _moe_file(tmp_path_factory.mktemp("moe"))
    return dataclasses.replace(TINY_RUN, steps=4, model=model, grad_clip=0.0)


@pytest.fixture(scope="module")
def twin(config) -> list[dict]:
    return run_ranks(4, _run, config, TWIN)


@pytest.mark.parametrize("plan_text", [SHARDED, "dp_shard=4,ep=2"])
def test_sharded_experts_train_as_whole_ones_in_half_the_memory(config, twin, plan_text):
    # dp_shard=4: no replicas of the rest of the model, whose gradients travel in the background
    sharded = run_ranks(4, _run, config, plan_text)
    for rank, (result, reference) in enumerate(zip(sharded, twin, strict=True)):
        assert result["sharded"] and not reference["sharded"], rank
        _assert_same(result, reference, f"rank {rank}")
        # FSDP2 pads each expert tensor's first dimension to a multiple of 2: within 5 %
        assert result["bytes"] == pytest.approx(reference["bytes"] / 2, rel=0.05), rank


@pytest.mark.slow
def test_sharded_experts_resume_under_whole_ones_and_back(tmp_path):
    resumed = dataclasses.replace(RESUMED, model=_moe_file(tmp_path))
    _check_matrix(tmp_path, resumed, [SHARDED, TWIN], [SHARDED, TWIN])


@pytest.mark.parametrize(
    ("plan_text", "ep_dp", "reason"),
    [
        (SHARDED, 2, None),
        (f"{SHARDED},moe_balance=dropless", 2, None),
        (f"{SHARDED},moe_balance=shadow", 2, "moe_balance=shadow sends whole experts"),
        (f"{SHARDED},moe_balance=prophet", 2, "moe_balance=prophet sends whole experts"),
        ("dp_shard=2,ep=2", 1, "each expert is held by one rank"),
    ],
)
def test_experts_are_kept_whole_only_where_they_must_be_and_say_why(plan_text, ep_dp, reason):
    why = replicated_because(Plan.parse(plan_text), ep_dp)
    assert why == reason if reason is None else reason in why


@pytest.mark.slow
def test_sharded_experts_under_expert_and_tensor_parallelism_follow_the_twin(config, twin):
    # ep × tp × dp_shard on 8 ranks: each tp rank dispatches its share of the tokens, FSDP2
    # reduces the experts over ep_dp and the router over dp_shard, both then summed over tp
    reference = twin[0]["rows"]  # every rank of the twin logs the same rows
    for rank, result in enumerate(run_ranks(8, _run, config, "dp_shard=4,ep=2,tp=2")):
        losses = [r["loss"] for r in result["rows"]]
        assert losses == pytest.approx([r["loss"] for r in reference], abs=1e-5), rank
        norms = [r["grad_norm"] for r in result["rows"]]
        assert norms == pytest.approx([r["grad_norm"] for r in reference], rel=1e-5), rank


@pytest.mark.parametrize(
    "plan_text",
    [
        "dp_shard=2,ep=2,tp=2,etp=2",  # each expert on one rank of ep_dp: FSDP2 keeps it whole
        pytest.param("dp_shard=4,ep=2,tp=2,etp=2", marks=pytest.mark.slow),  # sharded over 2
    ],
)
def test_experts_split_over_tp_under_sharded_data_parallelism_follow_the_twin(config, plan_text):
    # dropless routing without aux loss: every split of the tokens computes the same step, so
    # the twin is the plan without tp
    plan = Plan.parse(plan_text)
    twin_text = f"dp_shard={plan.dp_shard},ep=2"
    reference = run_ranks(plan.dp_shard, _run, config, twin_text)
    results = run_ranks(plan.world_size, _run, config, plan_text)
    for rank, result in enumerate(results):
        expected = reference[rank // 2]["rows"]
        losses = [r["loss"] for r in result["rows"]]
        assert losses == pytest.approx([r["loss"] for r in expected], abs=1e-5), rank
        norms = [r["grad_norm"] for r in result["rows"]]
        assert norms == pytest.approx([r["grad_norm"] for r in expected], rel=1e-5), rank
        assert result["sharded"] == (plan.dp_shard == 4), rank
