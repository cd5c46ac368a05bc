"""Pipeline parallelism: every schedule equals the serial model (loss and every gradient), with
data-parallel replicas, accumulation, clipping and optimizer steps; recomputation replays the
same dropout masks; bad batches and models are refused; the shifted order and the schedule
checks. The partitioner's tests: test_pipeline_partition.py."""

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import assert_grads_close, tiny_config
from interlace.errors import PlanError
from interlace.loss import cross_entropy
from interlace.mesh import build_mesh
from interlace.models.gpt import build_model
from interlace.optim import build_optimizer
from interlace.parallel.grad_norm import clip_grad_norm_
from interlace.parallel.parallelize import parallelize
from interlace.parallel.pipeline.options import check_schedule
from interlace.parallel.pipeline.partition import (
    partition,
)
from interlace.parallel.pipeline.recompute import (
    ratio_for_budget,
)
from interlace.parallel.pipeline.runner import PipelineRunner
from interlace.parallel.pipeline.shifted import shifted_order
from interlace.plan import Plan
from interlace.testing import run_ranks

ROWS, LENGTH = 8, 16


def _model(config):
    torch.manual_seed(0)
    return build_model(config)


def _batch(config, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, config.vocab_size, (ROWS, LENGTH), generator=g)
    y = torch.randint(0, config.vocab_size, (ROWS, LENGTH), generator=g)
    return x, y


def _serial_grads(config, batches=((1, 1.0),)):
    """Loss of the first batch and gradients of Σ scale · loss(batch seed) of a serial model."""
    model = _model(config)
    losses = []
    for seed, scale in batches:
        x, y = _batch(config, seed)
        loss = cross_entropy(model(x), y)
        (loss * scale).backward()
        losses.append(loss.item())
    return losses[0], {n: p.grad.clone() for n, p in model.named_parameters()}


def _serial_name(name, tied=True):
    """A pipeline parameter's name in the serial model: a tied head's copy is the embedding."""
    return "wte.weight" if tied and name == "lm_head.weight" else name


# --------------------------------------------------------------------------- parallel = serial
def _pipeline_grads(config, plan_text, recompute_list):
    plan = Plan.parse(plan_text)
    model = _model(config)
    calls = {i: 0 for i in range(config.n_layers)}
    for i, block in enumerate(model.blocks):
        # a pre-hook: recomputation stops early, after the block's last saved tensor
        block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    runner = PipelineRunner(model, plan, build_mesh(plan), recompute=recompute_list)
    x, y = _batch(config)
    runner.step(x, y)  # first step: torch infers stage shapes (extra forwards); then start clean
    runner.zero_grad()
    calls.update(dict.fromkeys(calls, 0))
    with _MatmulCount() as matmuls:
        loss = runner.step(x, y)
    checkpointed = set().union(*(stage.checkpointed for stage in runner.stages))
    local = [int(i) for stage in runner.stages for i in stage.blocks]
    return {
        "loss": float(loss),
        "grads": {n: p.grad.clone() for n, p in runner.named_parameters()},
        "calls": {i: calls[i] for i in local},
        "checkpointed": checkpointed,
        "ratios": runner.recompute_ratios,
        "trace": getattr(runner.schedule, "trace", None),  # the shifted schedule's actions
        "matmuls": matmuls.count,
        "stages": len(runner.stages),
    }


class _MatmulCount(TorchDispatchMode):
    """Counts the matrix products run inside (forward, recomputation and backward)."""

    OPS = frozenset(
        {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    )

    def __enter__(self):
        self.count = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.OPS
        return func(*args, **(kwargs or {}))


CASES = [
    # (plan, n_layers, explicit per-rank ratios or None)
    ("pp=2,micro_batches=4,schedule=gpipe", 4, None),
    ("pp=2,micro_batches=4,schedule=gpipe,recompute=full", 4, None),
    ("pp=2,micro_batches=4,schedule=1f1b", 4, None),
    ("pp=2,micro_batches=4,schedule=1f1b,recompute=full", 4, None),
    ("pp=2,micro_batches=4,schedule=1f1b,recompute=selective", 4, None),
    ("pp=2,micro_batches=4,schedule=interleaved", 4, None),
    ("pp=2,micro_batches=4,schedule=interleaved,recompute=full", 4, None),
    ("pp=2,micro_batches=4,schedule=interleaved,virtual_stages=3", 6, None),
    ("pp=4,micro_batches=4,schedule=gpipe", 4, None),
    ("pp=4,micro_batches=4,schedule=gpipe,recompute=full", 4, None),
    ("pp=4,micro_batches=4,schedule=1f1b", 4, None),
    ("pp=4,micro_batches=4,schedule=1f1b,recompute=stage-aware", 8, None),
    ("pp=4,micro_batches=4,schedule=1f1b", 8, (0.5, 0.5, 1.0, 0.0)),
    ("pp=4,micro_batches=4,schedule=interleaved", 8, None),
    ("pp=4,micro_batches=4,schedule=interleaved,recompute=full", 8, None),
    ("pp=2,micro_batches=4,schedule=shifted", 4, None),
    ("pp=2,micro_batches=4,schedule=shifted,recompute=full", 4, None),
    ("pp=2,micro_batches=4,schedule=shifted,recompute=selective", 4, None),
    ("pp=4,micro_batches=4,schedule=shifted,recompute=full", 4, None),
    ("pp=4,micro_batches=8,schedule=shifted,recompute=stage-aware", 8, None),
    ("pp=4,micro_batches=4,schedule=shifted", 8, (0.5, 0.5, 1.0, 0.0)),
]


@pytest.mark.parametrize(("plan_text", "n_layers", "ratios"), CASES)
def test_pipeline_loss_and_every_gradient_equal_serial(plan_text, n_layers, ratios):
    config = tiny_config(n_layers)
    plan = Plan.parse(plan_text)
    serial_loss, serial = _serial_grads(config)
    results = run_ranks(plan.pp, _pipeline_grads, config, plan_text, ratios, timeout=60)

    seen = set()
    for i, rank in enumerate(results):
        assert rank["loss"] == pytest.approx(serial_loss, abs=1e-5)
        expected = {name: serial[_serial_name(name)] for name in rank["grads"]}
        assert_grads_close(rank["grads"], expected, what=f"rank {i}")
        seen |= {_serial_name(name) for name in rank["grads"]}
        # a checkpointed block runs its forward twice per micro-batch (forward + recompute)
        for i, count in rank["calls"].items():
            assert count == plan.micro_batches * (1 + (i in rank["checkpointed"])), (i, rank)
    assert seen == set(serial)
    assert all(rank["stages"] == plan.stages_per_rank for rank in results)
    if plan.virtual_stages:  # the count the plan names, not the schedule's own
        assert results[0]["stages"] == plan.virtual_stages
    if plan.schedule == "shifted":  # every replay runs before its gradient receive
        for rank in results[:-1]:
            trace = rank["trace"]
            for i in range(plan.micro_batches):
                if rank["checkpointed"] and plan.recompute != "selective":
                    assert trace.index(("R", i)) < trace.index(("recv_grad", i))
                assert trace.index(("recv_grad", i)) < trace.index(("B", i))
    n_ckpt = sum(len(r["checkpointed"]) for r in results)
    if plan.recompute in ("full", "selective"):
        assert n_ckpt == n_layers
    elif plan.recompute == "none" and ratios is None:
        assert n_ckpt == 0
    else:  # stage-aware with r0 = 1, or the explicit list: the last rank checkpoints nothing
        assert 0 < n_ckpt < n_layers and not results[-1]["checkpointed"]


def test_selective_recomputation_in_stages_replays_no_matrix_product():
    config = tiny_config(4)
    counts = {
        mode: [
            rank["matmuls"]
            for rank in run_ranks(
                2,
                _pipeline_grads,
                config,
                f"pp=2,micro_batches=4,schedule=1f1b,recompute={mode}",
                None,
                timeout=60,
            )
        ]
        for mode in ("none", "selective", "full")
    }
    # selective keeps every matmul output: its stages run the products of no recomputation,
    # full replays each block's forward products once more
    assert counts["selective"] == counts["none"]
    assert all(f > n for f, n in zip(counts["full"], counts["none"], strict=True))


def test_pipeline_with_two_data_parallel_replicas_equals_serial():
    """pp=3 × dp=2: two pipelines, each with its own {first, last} tied-embedding group."""
    config = tiny_config(4)
    serial_loss, serial = _serial_grads(config)
    plan_text = "dp=2,pp=3,micro_batches=4,schedule=1f1b"
    results = run_ranks(6, _pipeline_grads, config, plan_text, None, timeout=60)
    for i, rank in enumerate(results):
        assert rank["loss"] == pytest.approx(serial_loss, abs=1e-5)
        expected = {name: serial[_serial_name(name)] for name in rank["grads"]}
        assert_grads_close(rank["grads"], expected, what=f"rank {i}")


def test_untied_head_is_an_ordinary_last_stage_parameter():
    config = tiny_config(4, tie_embeddings=False)
    serial_loss, serial = _serial_grads(config)
    plan_text = "pp=2,micro_batches=4,schedule=1f1b"
    first, last = run_ranks(2, _pipeline_grads, config, plan_text, None, timeout=60)
    assert "lm_head.weight" in last["grads"] and "wte.weight" in first["grads"]
    for rank in (first, last):
        assert rank["loss"] == pytest.approx(serial_loss, abs=1e-5)
        assert_grads_close(rank["grads"], {name: serial[name] for name in rank["grads"]})
    assert set(first["grads"]) | set(last["grads"]) == set(serial)


def _dropout_grads(config, schedule):
    grads = {}
    for recompute in ("none", "full"):
        plan = Plan.parse(f"pp=2,micro_batches=4,schedule={schedule},recompute={recompute}")
        runner = PipelineRunner(_model(config), plan, build_mesh(plan))
        torch.manual_seed(100 + torch.distributed.get_rank())  # the same masks for both
        runner.step(*_batch(config))
        grads[recompute] = {n: p.grad.clone() for n, p in runner.named_parameters()}
    return grads


@pytest.mark.parametrize("schedule", ["1f1b", "shifted"])
def test_recomputation_replays_the_same_dropout_masks(schedule):
    config = tiny_config(4, dropout=0.2)
    for i, rank in enumerate(run_ranks(2, _dropout_grads, config, schedule, timeout=60)):
        assert_grads_close(rank["full"], rank["none"], what=f"rank {i}")


def _grads_after_evaluate(config, plan_text):
    """Gradients of one step, on a fresh runner and on one whose first run was `evaluate`."""
    plan = Plan.parse(plan_text)
    grads = []
    for evaluate_first in (False, True):
        runner = PipelineRunner(_model(config), plan, build_mesh(plan))
        if evaluate_first:
            runner.evaluate(*_batch(config, 2))
        runner.step(*_batch(config))
        grads.append({n: p.grad.clone() for n, p in runner.named_parameters()})
    return grads


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_evaluate_before_the_first_step_leaves_its_gradients_unchanged(schedule):
    """torch's schedules allocate the stages' receive buffers on their first run: an
    evaluation first must not cut the gradient a stage sends back."""
    config = tiny_config(4)
    plan_text = f"pp=2,micro_batches=4,schedule={schedule}"
    for i, (fresh, after) in enumerate(run_ranks(2, _grads_after_evaluate, config, plan_text)):
        assert set(after) == set(fresh)
        assert_grads_close(after, fresh, what=f"rank {i}")


def _budget_ratios(config, budget, tokens):
    plan = Plan.parse("pp=2,micro_batches=4,schedule=1f1b,recompute=stage-aware")
    runner = PipelineRunner(
        _model(config),
        plan,
        build_mesh(plan),
        memory_budget_bytes=budget,
        micro_batch_tokens=tokens,
    )
    return runner.recompute_ratios


def test_stage_aware_ratio_from_a_memory_budget():
    config = tiny_config(8)
    guess = partition(build_model(config, device="meta"), 2, recompute_ratios=[1.0, 1.0])
    tokens = 2 * LENGTH
    budget = (guess.stage_memory(0, tokens, 2, 0.0) + guess.stage_memory(0, tokens, 2, 1.0)) / 2
    r0 = ratio_for_budget(guess, budget, tokens, 2)
    assert 0 < r0 < 1
    for ratios in run_ranks(2, _budget_ratios, config, budget, tokens, timeout=60):
        assert ratios == (r0, 0.0)


def _trainer(config, plan, mesh, via):
    """(module for the optimizer, step, evaluate, clip, sync) of a pipeline built directly as a
    PipelineRunner (clipped by the one `clip_grad_norm_` with the runner's share) or by
    `parallelize` (its `Parallelized` steps, clips and reduces over dp)."""
    if via == "runner":
        runner = PipelineRunner(_model(config), plan, mesh)

        def clip(max_norm):
            return clip_grad_norm_(runner.parameters(), max_norm, [runner.norm_share()])

        return runner.module, runner.step, runner.evaluate, clip, lambda: None
    par = parallelize(_model(config), plan, mesh)
    assert isinstance(par.executor, PipelineRunner) and par.model is par.executor.module
    return par.model, par.forward_backward, par.evaluate, par.clip_grad_norm_, par.sync_gradients


def _train_two_steps(config, plan_text, via):
    plan = Plan.parse(plan_text)
    mesh = build_mesh(plan)
    dp = mesh.group("dp")
    rows = slice(dp.rank * ROWS // dp.size, (dp.rank + 1) * ROWS // dp.size)  # this replica's

    def batch(seed):
        return tuple(t[rows] for t in _batch(config, seed))

    module, step, evaluate, clip, sync = _trainer(config, plan, mesh, via)
    eval_loss = float(evaluate(*batch(1)))
    optimizer = build_optimizer(module, lr=5e-4, weight_decay=0.1)
    norms, losses = [], []
    for i in range(2):
        for k, seed in enumerate((2 * i + 1, 2 * i + 2)):  # two accumulated batches
            loss = step(*batch(seed), loss_scale=0.5, sync=k == 1)
            losses.append(loss.item())
        sync()
        norms.append(float(clip(0.5)))
        optimizer.step()
        module.zero_grad(set_to_none=True)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    return {"dp": dp.rank, "eval": eval_loss, "losses": losses, "norms": norms, "state": state}


def _replica_mean(results, what, dp):
    """`what` of each data parallel replica (equal on its pipeline ranks), averaged over them."""
    per_replica = []
    for d in range(dp):
        values = [r[what] for r in results if r["dp"] == d]
        assert all(value == pytest.approx(values[0], abs=1e-6) for value in values), (what, d)
        per_replica.append(torch.tensor(values[0], dtype=torch.float64))
    return torch.stack(per_replica).mean(0).tolist()


@pytest.mark.parametrize(
    ("plan_text", "via"),
    [
        ("pp=4,micro_batches=4,schedule=1f1b,recompute=full", "runner"),
        ("pp=4,micro_batches=4,schedule=shifted,recompute=full", "runner"),
        ("dp=2,pp=2,micro_batches=2,schedule=1f1b,recompute=full", "parallelize"),
    ],
)
def test_accumulation_clipping_and_optimizer_steps_equal_serial(plan_text, via):
    config = tiny_config(4)
    model = _model(config)
    with torch.no_grad():
        serial_eval = float(cross_entropy(model(_batch(config, 1)[0]), _batch(config, 1)[1]))
    optimizer = build_optimizer(model, lr=5e-4, weight_decay=0.1)
    norms, losses = [], []
    for step in range(2):
        for seed in (2 * step + 1, 2 * step + 2):
            x, y = _batch(config, seed)
            loss = cross_entropy(model(x), y)
            (0.5 * loss).backward()
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad()
    assert min(norms) > 0.5  # clipping really scaled the gradients

    plan = Plan.parse(plan_text)
    results = run_ranks(plan.world_size, _train_two_steps, config, plan_text, via, timeout=60)
    serial_state = model.state_dict()
    keys = [set(r["state"]) for r in results]
    assert set().union(*keys) == set(serial_state)
    # each name on exactly one stage of each replica
    assert sum(len(k) for k in keys) == plan.dp * len(serial_state)
    # a replica's loss is that of its rows: the replicas' mean is the serial batch's
    assert _replica_mean(results, "eval", plan.dp) == pytest.approx(serial_eval, abs=1e-5)
    assert _replica_mean(results, "losses", plan.dp) == pytest.approx(losses, abs=1e-5)
    for rank in results:
        assert rank["norms"] == pytest.approx(norms, abs=1e-5)
        for name, value in rank["state"].items():
            torch.testing.assert_close(value, serial_state[name], atol=1e-5, rtol=0)
    # the copies of the tied embedding (both ends of every replica) stayed identical
    ends = [r["state"] for r in results if {"wte.weight", "lm_head.weight"} & set(r["state"])]
    copies = [state.get("wte.weight", state.get("lm_head.weight")) for state in ends]
    assert len(copies) == 2 * plan.dp
    for copy in copies:
        torch.testing.assert_close(copy, copies[0], atol=0, rtol=0)


def _bad_batch(config):
    plan = Plan.parse("pp=2,micro_batches=3,schedule=gpipe")
    runner = PipelineRunner(_model(config), plan, build_mesh(plan))
    try:
        runner.step(*_batch(config))  # 8 rows into 3 micro-batches
    except PlanError as exc:
        return str(exc)
    return None


def test_batch_not_divisible_by_micro_batches_is_refused_before_any_work():
    messages = run_ranks(2, _bad_batch, tiny_config(4), timeout=60)
    assert all(m is not None and "micro_batches=3" in m for m in messages)


def _refusals():
    """The runner's error for each unsupported model or plan (None: it built), on 4 ranks."""
    cases = [
        (_model(tiny_config(4)), "pp=2,tp=2,micro_batches=2"),
    ]
    messages = []
    for model, plan_text in cases:
        plan = Plan.parse(plan_text)
        try:
            PipelineRunner(model, plan, build_mesh(plan))
        except PlanError as exc:
            messages.append(str(exc))
        else:
            messages.append(None)
    return messages


def test_runner_refuses_an_unsplit_model_before_building():
    for (unsplit,) in run_ranks(4, _refusals, timeout=60):
        assert unsplit is not None and re.search(r"interlace\.parallelize", unsplit)


# --------------------------------------------------------------------------- schedules
def test_shifted_order_moves_a_forward_into_stage_p_minus_2s_first_backward_slot():
    f = [("F", i) for i in range(4)]
    b = [("B", i) for i in range(4)]
    assert shifted_order(3, 4, 4) == [f[0], b[0], f[1], b[1], f[2], b[2], f[3], b[3]]
    assert shifted_order(2, 4, 4) == [f[0], f[1], f[2], b[0], f[3], b[1], b[2], b[3]]
    assert shifted_order(1, 4, 4) == [f[0], f[1], f[2], b[0], f[3], b[1], b[2], b[3]]
    assert shifted_order(0, 4, 4) == f + b
    # fewer than 4 micro-batches: plain 1F1B order
    assert shifted_order(0, 2, 3) == [f[0], f[1], b[0], f[2], b[1], ("B", 2)]


@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_shifted_order_cannot_deadlock(pp):
    """Simulate blocking receives: F(i) needs F(i) of the stage before, B(i) needs B(i) of
    the stage after; some stage can always move until every action has run."""
    for micro in range(pp, 11):
        orders = [shifted_order(s, pp, micro) for s in range(pp)]
        for order in orders:
            assert sorted(order) == sorted([(a, i) for a in "FB" for i in range(micro)])
            assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(micro))
        done, position = set(), [0] * pp
        while any(position[s] < len(orders[s]) for s in range(pp)):
            moved = False
            for s in range(pp):
                if position[s] == len(orders[s]):
                    continue
                action, i = orders[s][position[s]]
                needs = (s - 1, "F", i) if action == "F" else (s + 1, "B", i)
                if 0 <= needs[0] < pp and needs not in done:
                    continue
                done.add((s, action, i))
                position[s] += 1
                moved = True
            assert moved, (pp, micro, position)


@pytest.mark.parametrize(
    ("schedule", "pp", "micro", "layers", "virtual", "match"),
    [
        ("1f1b", 4, 2, 8, 1, "micro_batches >= pp"),
        ("shifted", 4, 2, 4, 1, "micro_batches >= pp"),
        ("interleaved", 4, 4, 4, 2, "at least 8 layers"),
        ("interleaved", 4, 9, 8, 2, "multiple of 2"),
        ("gpipe", 4, 1, 3, 1, "at least 4 layers"),
    ],
)
def test_schedule_checks_name_the_fix(schedule, pp, micro, layers, virtual, match):
    with pytest.raises(PlanError, match=match):
        check_schedule(schedule, pp, micro, layers, virtual)


def test_valid_schedules_pass_the_check():
    check_schedule("gpipe", 4, 1, 4)
    check_schedule("1f1b", 4, 4, 4)
    check_schedule("interleaved", 4, 8, 8, 2)


# --------------------------------------------------------------------------- partitioner
