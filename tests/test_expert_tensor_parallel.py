"""Expert parallelism inside 1D tensor parallelism (`ep=2,tp=2` on 4 ranks, with and without
sequence parallelism) trains step for step as one process on the same global batch (dropless
routing, no aux loss: losses, pre-clipping norms, the first step's gradients, the weights after
three steps), dispatches every token once per tp group (the all-to-all bytes of a tp group are
those of `ep=2` alone on its tokens), and, without sequence parallelism, equals `dp=4,ep=2` with
capacity drops and the aux loss too (each tp rank's tokens are that plan's rank's rows); experts
replicated by a balancing strategy keep the serial run. With each expert split over tp (`etp=2`)
the same holds: the tp ranks share the tokens out as with `etp=1` and gather the rows they
received for their halves of the experts."""

import dataclasses
import json

import pytest
import torch

from helpers import TINY_RUN, assert_grads_close, per_expert
from interlace import comm
from interlace.mesh import build_mesh
from interlace.models.presets import get_preset
from interlace.moe.balance import Prophet, Shadow
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

BASE = dataclasses.replace(TINY_RUN, grad_clip=0.0)
EP_TP = "dp=2,ep=2,tp=2"
EP_TP_SP = "dp=2,ep=2,tp=2,sequence_parallel=true"
ETP = "dp=2,ep=2,tp=2,etp=2"
ETP_SP = "dp=2,ep=2,tp=2,etp=2,sequence_parallel=true"
PARAM_ATOL = 2e-5  # as test_train's: Adam turns rounding of near-zero gradients into ~lr


def _model_file(tmp_path, **changes) -> str:
    spec = dataclasses.replace(get_preset("moe-tiny"), **changes)
    path = tmp_path / f"moe-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(spec.to_dict()))
    return str(path)


def _run(config: TrainConfig, plan_text: str) -> dict:
    """Every step's row and all-to-all bytes on "ep", the first step's synced gradients and the
    weights at the end, whole (tensor-parallel pieces gathered, stacked experts `per_expert`)."""
    from interlace.parallel.tensor.shard import gather_full, sharded_parameter_names

    plan = Plan.parse(plan_text)
    mesh = build_mesh(plan) if plan.world_size > 1 else None
    trainer = Trainer(prepare_run(config, plan, plan.world_size), mesh)
    specs = sharded_parameter_names(trainer.model)

    def whole(named) -> dict[str, torch.Tensor]:
        return per_expert(
            {
                n: gather_full(t, specs[n], mesh.group("tp")) if n in specs else t.detach().clone()
                for n, t in named
            }
        )

    rows, sent, grads = [], [], None
    zero_grad = trainer.optimizer.zero_grad
    trainer.optimizer.zero_grad = lambda set_to_none=True: None  # keep the synced gradients
    while trainer.step < config.steps:
        rows.append(trainer.train_step())
        sent.append(comm.meter.snapshot().get("ep", {}).get("all_to_all", {}).get("bytes", 0))
        if grads is None:
            grads = whole((n, p.grad) for n, p in trainer.model.named_parameters())
        zero_grad()
    params = whole(trainer.model.named_parameters())
    local = {  # the rows of each expert up projection this rank holds
        n: p.shape[0]
        for n, p in trainer.model.named_parameters()
        if ".experts." in n and n.endswith("up.weight")
    }
    return {"rows": rows, "all_to_all": sent, "grads": grads, "params": params, "local": local}


def _ranks(config: TrainConfig, plan_text: str) -> list[dict]:
    world_size = Plan.parse(plan_text).world_size
    if world_size == 1:
        return [_run(config, plan_text)]
    return run_ranks(world_size, _run, config, plan_text)


def _merged(ranks: list[dict]) -> dict:
    """A twin's ranks as one reference: their (common) rows, and every rank's gradients and
    weights by name (a one-process twin's tied head under its own name too)."""
    merged: dict = {"rows": ranks[0]["rows"]}
    for part in ("grads", "params"):
        merged[part] = {k: v for r in ranks for k, v in r[part].items()}
        merged[part].setdefault("lm_head.weight", merged[part]["wte.weight"])
    return merged


def _assert_same(result: dict, reference: dict, what: str) -> None:
    """Same losses and norms per step; the gradients and weights `result` holds equal the
    reference's of the same names."""
    losses = [r["loss"] for r in result["rows"]]
    assert losses == pytest.approx([r["loss"] for r in reference["rows"]], abs=1e-5), what
    norms = [r["grad_norm"] for r in result["rows"]]
    assert norms == pytest.approx([r["grad_norm"] for r in reference["rows"]], rel=1e-5), what
    held = result["grads"].keys()
    assert_grads_close(result["grads"], {n: reference["grads"][n] for n in held}, what=what)
    for name, value in result["params"].items():
        torch.testing.assert_close(value, reference["params"][name], atol=PARAM_ATOL, rtol=0)


@pytest.fixture(scope="module")
def dropless(tmp_path_factory) -> TrainConfig:
    folder = tmp_path_factory.mktemp("dropless")
    return dataclasses.replace(BASE, model=_model_file(folder, dropless=True, aux_loss_coef=0.0))


@pytest.fixture(scope="module")
def serial(dropless):
    return _merged([_run(dropless, "dp=1")])


@pytest.fixture(scope="module")
def expert_only(dropless):
    return _ranks(dropless, "dp=2,ep=2")


@pytest.mark.parametrize("plan_text", [EP_TP, EP_TP_SP])
def test_expert_and_tensor_parallel_training_equals_serial(
    dropless, serial, expert_only, plan_text
):
    results = _ranks(dropless, plan_text)
    for rank, result in enumerate(results):
        _assert_same(result, serial, f"{plan_text}, rank {rank}")
        assert any(".experts.0." in n for n in result["params"]) == (rank // 2 == 0)
    _assert_dispatched_once(results, expert_only, plan_text)


def _assert_dispatched_once(results: list[dict], expert_only: list[dict], what: str) -> None:
    """rank = dp index · 2 + tp index: the two tp ranks of a dp rank dispatch its tokens once
    between them, the rows `ep=2` alone dispatches from that dp rank (forward and backward)."""
    for dp_index, alone in enumerate(expert_only):
        tp_group = results[2 * dp_index : 2 * dp_index + 2]
        per_step = [sum(steps) for steps in zip(*(r["all_to_all"] for r in tp_group), strict=True)]
        assert per_step == alone["all_to_all"], what
        assert min(alone["all_to_all"]) > 0
        assert all(0 < r["all_to_all"][0] < alone["all_to_all"][0] for r in tp_group), what


@pytest.mark.parametrize("plan_text", [ETP, ETP_SP])
def test_experts_split_over_tp_train_as_serial_and_hold_half_of_each_expert(
    dropless, serial, expert_only, plan_text
):
    results = _ranks(dropless, plan_text)
    for rank, result in enumerate(results):
        _assert_same(result, serial, f"{plan_text}, rank {rank}")
        pieces = result["local"]
        assert pieces and all(rows == 128 for rows in pieces.values())  # 256 / etp
    assert {n for n in results[0]["local"]} == {n for n in results[1]["local"]}
    _assert_dispatched_once(results, expert_only, plan_text)  # as with etp=1


def test_split_experts_route_each_tp_ranks_share_capacity_and_aux_loss_included(tmp_path):
    # each tp rank routes the rows a dp=4 rank gets, as with etp=1: the same drops and aux losses
    config = dataclasses.replace(BASE, model=_model_file(tmp_path, capacity_factor=1.0))
    reference = _merged(_ranks(config, "dp=4,ep=2"))
    for rank, result in enumerate(_ranks(config, ETP)):
        _assert_same(result, reference, f"{ETP}, rank {rank}")


@pytest.mark.parametrize(
    ("plan_text", "twin_text"),
    [("tp=2,tp_subbatches=2", "dp=1"), (f"{EP_TP},tp_subbatches=2", "dp=4,ep=2")],
)
def test_sub_batches_overlap_the_dense_layers_and_leave_moe_layers_whole(
    tmp_path, plan_text, twin_text
):
    # capacity and aux loss on: an MoE layer sub-batched would route each half on its own
    config = dataclasses.replace(BASE, model=_model_file(tmp_path, capacity_factor=1.0))
    twin = _ranks(config, twin_text)
    reference = _merged(twin)
    for rank, result in enumerate(_ranks(config, plan_text)):
        _assert_same(result, reference, f"{plan_text}, rank {rank}")


def test_sub_batches_need_a_layer_without_experts(tmp_path):
    from interlace.errors import PlanError

    config = dataclasses.replace(BASE, model=_model_file(tmp_path, moe_every=1))
    with pytest.raises(PlanError, match="every layer of this model has one"):
        Plan.parse("tp=2,tp_subbatches=2").validate(2, prepare_run(config, Plan(), 1).model_config)


def test_without_sequence_parallelism_capacity_and_aux_loss_follow_dp_times_tp(tmp_path):
    # each tp rank routes the rows a dp=4 rank gets: the same capacity drops and aux losses
    config = dataclasses.replace(BASE, model=_model_file(tmp_path, capacity_factor=1.0))
    twin = _ranks(config, "dp=4,ep=2")
    assert twin[0]["rows"][0]["loss"] != pytest.approx(_run(config, "dp=1")["rows"][0]["loss"])
    reference = _merged(twin)
    for rank, result in enumerate(_ranks(config, EP_TP)):
        _assert_same(result, reference, f"rank {rank}")


def _split_and_gather(n: int) -> tuple:
    """Rows [n, 3] split over the 2 ranks, doubled, gathered back; and the rows' gradient."""
    import torch.distributed as dist

    from interlace.comm import Group
    from interlace.parallel.expert.tp_tokens import gather_tokens, split_tokens

    group = Group("tp", dist.group.WORLD, 2, dist.get_rank())
    rows = torch.arange(3.0 * n).view(n, 3).requires_grad_()
    chunk = split_tokens(rows, group)
    out = gather_tokens(2 * chunk, group, n)
    (out * rows.detach()).sum().backward()
    return chunk.shape[0], out.detach(), rows.grad


@pytest.mark.parametrize("n", [4, 5])
def test_token_chunks_split_and_gather_back_with_their_gradients(n):
    ranks = run_ranks(2, _split_and_gather, n)
    assert [length for length, _, _ in ranks] == [n - n // 2, n // 2]
    rows = torch.arange(3.0 * n).view(n, 3)
    for _, out, grad in ranks:
        torch.testing.assert_close(out, 2 * rows)
        torch.testing.assert_close(grad, 2 * rows)  # every chunk's gradient, gathered


def _balanced_run(config: TrainConfig, plan_text: str, balancer) -> dict:
    """`_run` with `balancer` in place of the plan's strategy of the same name."""
    from interlace.parallel.expert import apply

    apply.make_balancer = lambda name: balancer
    return _run(config, plan_text)


FAST_LINK = {"replan_every": 1, "bandwidth": 1e9, "flops": 1e6}  # compute-bound: replicas pay


@pytest.mark.parametrize(
    ("plan_text", "balancer"),
    [
        (f"{EP_TP},moe_balance=shadow", Shadow(**FAST_LINK)),
        (f"{EP_TP_SP},moe_balance=prophet", Prophet(**FAST_LINK)),
        (f"{ETP},moe_balance=prophet", Prophet(**FAST_LINK)),
    ],
)
def test_replicated_experts_keep_the_serial_run(dropless, serial, plan_text, balancer):
    results = run_ranks(4, _balanced_run, dropless, plan_text, balancer)
    for rank, result in enumerate(results):
        _assert_same(result, serial, f"{plan_text}, rank {rank}")
    replicated = [layer["replicated"] for r in results for row in r["rows"] for layer in row["moe"]]
    assert any(replicated)
