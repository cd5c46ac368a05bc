"""Expert parallelism inside 3D tensor parallelism (`dp=2,ep=2,tp3d=2x1x1`, `1x2x1` and
`1x1x2` on 4 ranks, `2x1x2` on 8): attention and dense feed-forwards split over the grid, each
MoE layer whole on its owners, its input gathered over x and its tokens shared by the x·y ranks
(each dispatches its chunk once), the z slices routing their own rows (experts summed over z,
the aux loss averaged over it); under sequence parallelism (`tp3d=1x2x1,sequence_parallel=
true`) the y ranks route their own parts of the sequences, the x ranks sharing each part.
Trains step for step as one process on the same global batch (dropless routing, no aux loss:
losses and pre-clipping gradient norms over four steps; also under dp_shard and inside a
pipeline), sends the all-to-all bytes of `ep=2` alone, and equals `dp=4,ep=2` with capacity
drops and the aux loss too (each grid rank's tokens are that plan's rank's rows); experts
replicated by Pro-Prophet keep the serial run."""

import dataclasses

import pytest

from interlace import comm
from interlace.mesh import build_mesh
from interlace.moe.balance import Prophet
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig
from test_expert_tensor_parallel import BASE, FAST_LINK, _model_file

STEPS = 4
GRIDS = ["dp=2,ep=2,tp3d=2x1x1", "dp=2,ep=2,tp3d=1x2x1", "dp=2,ep=2,tp3d=1x1x2"]
Z_GRID = GRIDS[2]


def _run(config: TrainConfig, plan_text: str, balancer=None) -> dict:
    """Every step's loss, pre-clipping norm and all-to-all bytes on "ep" of this rank."""
    if balancer is not None:
        from interlace.parallel.expert import apply

        apply.make_balancer = lambda name: balancer
    plan = Plan.parse(plan_text)
    mesh = build_mesh(plan) if plan.world_size > 1 else None
    trainer = Trainer(prepare_run(config, plan, plan.world_size), mesh)
    rows, sent = [], []
    while trainer.step < config.steps:
        rows.append(trainer.train_step())
        sent.append(comm.meter.snapshot().get("ep", {}).get("all_to_all", {}).get("bytes", 0))
    return {"rows": rows, "all_to_all": sent, "report": trainer.parallel.report}


def _ranks(config: TrainConfig, plan_text: str, balancer=None) -> list[dict]:
    world_size = Plan.parse(plan_text).world_size
    if world_size == 1:
        return [_run(config, plan_text)]
    return run_ranks(world_size, _run, config, plan_text, balancer)


def _assert_same(result: dict, reference: dict, what: str) -> None:
    for key, tolerance in (("loss", {"abs": 1e-5}), ("grad_norm", {"rel": 1e-5})):
        got = [r[key] for r in result["rows"]]
        assert got == pytest.approx([r[key] for r in reference["rows"]], **tolerance), what


@pytest.fixture(scope="module")
def dropless(tmp_path_factory) -> TrainConfig:
    folder = tmp_path_factory.mktemp("dropless")
    model = _model_file(folder, dropless=True, aux_loss_coef=0.0)
    return dataclasses.replace(BASE, model=model, steps=STEPS)


@pytest.fixture(scope="module")
def serial(dropless) -> dict:
    return _run(dropless, "dp=1")


@pytest.mark.parametrize(
    "plan_text",
    [
        *GRIDS,
        "dp=2,ep=2,tp3d=2x1x2",
        "dp=2,ep=2,tp3d=1x2x1,sequence_parallel=true",
        pytest.param("dp=2,ep=2,tp3d=2x2x1,sequence_parallel=true", marks=pytest.mark.slow),
    ],
)
def test_expert_and_3d_tensor_parallel_training_equals_serial(dropless, serial, plan_text):
    results = _ranks(dropless, plan_text)
    for rank, result in enumerate(results):
        _assert_same(result, serial, f"{plan_text}, rank {rank}")
    assert any("gathered over tp_x" in line for line in results[0]["report"])
    # rank = dp index · grid + grid index: the grid ranks of a dp rank dispatch its tokens once
    # between them (x·y ranks a share each, z slices their rows; under sequence parallelism
    # the y ranks their parts of the sequences, the x ranks a share of those), the rows
    # `ep=2` alone dispatches from that dp rank
    alone = _ranks(dropless, "dp=2,ep=2")
    size = len(results) // 2
    for dp_index, expert_only in enumerate(alone):
        grid = results[size * dp_index : size * (dp_index + 1)]
        per_step = [sum(steps) for steps in zip(*(r["all_to_all"] for r in grid), strict=True)]
        assert per_step == expert_only["all_to_all"]
        assert min(per_step) > 0


@pytest.mark.parametrize(
    "plan_text",
    [
        "dp_shard=2,ep=2,tp3d=2x1x1",
        "dp_shard=2,ep=2,tp3d=1x1x2,tp3d_prefetch=false",
        pytest.param("dp_shard=2,ep=2,tp3d=1x1x2", marks=pytest.mark.slow),
        "pp=2,dp=2,ep=2,tp3d=2x1x1,micro_batches=2",
        "pp=2,dp=2,ep=2,tp3d=1x1x2,micro_batches=2",
        pytest.param("dp_shard=2,ep=2,tp3d=1x2x1,sequence_parallel=true", marks=pytest.mark.slow),
    ],
)
def test_sharded_and_pipelined_expert_3d_layouts_equal_serial(dropless, serial, plan_text):
    # FSDP2 shards the experts over ep_dp and the grid's pieces over dp_shard; pipeline stages
    # hold MoE layers and carry the aux loss to the last
    for rank, result in enumerate(_ranks(dropless, plan_text)):
        _assert_same(result, serial, f"{plan_text}, rank {rank}")


@pytest.fixture(scope="module")
def capacity(tmp_path_factory) -> TrainConfig:
    model = _model_file(tmp_path_factory.mktemp("capacity"), capacity_factor=1.0)
    return dataclasses.replace(BASE, model=model, steps=STEPS)


@pytest.mark.parametrize("grid", [GRIDS[0], Z_GRID])
def test_capacity_and_aux_loss_follow_the_data_parallel_twin(capacity, grid):
    # each grid rank routes the rows a dp=4 rank gets: the same capacity drops and aux losses
    twin = _ranks(capacity, "dp=4,ep=2")[0]
    assert twin["rows"][0]["loss"] != pytest.approx(_run(capacity, "dp=1")["rows"][0]["loss"])
    for rank, result in enumerate(_ranks(capacity, grid)):
        _assert_same(result, twin, f"{grid}, rank {rank}")


@pytest.mark.parametrize(
    "grid",
    [
        GRIDS[0],
        Z_GRID,
        pytest.param("dp=2,ep=2,tp3d=1x2x1,sequence_parallel=true", marks=pytest.mark.slow),
    ],
)
def test_experts_replicated_by_prophet_keep_the_serial_run(dropless, serial, grid):
    plan_text = f"{grid},moe_balance=prophet"
    results = _ranks(dropless, plan_text, Prophet(**FAST_LINK))
    for rank, result in enumerate(results):
        _assert_same(result, serial, f"{plan_text}, rank {rank}")
    replicated = [layer["replicated"] for r in results for row in r["rows"] for layer in row["moe"]]
    assert any(replicated)
