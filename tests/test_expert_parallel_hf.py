"""Expert parallelism inside `parallelize` for Hugging Face Mixtral-style models (fused experts):
dp=2, ep=2 equals the serial model (loss and every gradient, two SGD steps, fp32), and
Pro-Prophet's replicas leave loss and gradients those of dropless, step for step.

Each rank trains on its own batch; the serial model averages the ranks' losses, as data
parallelism does. A local expert's gradient (`...mlp.experts.experts.<e>.<name>`, reduced over
ep_dp) is compared with slice e of the serial fused gradient, every other gradient (averaged
over dp) with the serial one of the same name.
"""

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import assert_grads_close
from hf_models import needs_hf, tiny_hf_model
from interlace.errors import PlanError
from interlace.mesh import build_mesh
from interlace.moe.balance import Prophet
from interlace.parallel.expert.apply import parallelize_experts
from interlace.parallel.expert.grads import expert_parameter_names, reduce_expert_gradients
from interlace.parallel.expert.groups import build_expert_groups
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.parallel.parallelize import parallelize
from interlace.plan import Plan
from interlace.testing import run_ranks

pytestmark = needs_hf

B, T, VOCAB, D = 2, 16, 256, 64
ATOL = 1e-5
LR = 0.5
LOCAL_EXPERT = re.compile(r"^(.*\.experts)\.experts\.(\d+)\.(\w+)$")
FAST_LINK = {"replan_every": 1, "bandwidth": 1e9, "flops": 1e6}  # compute-bound: replicas pay


def _model(kind: str) -> nn.Module:
    model = tiny_hf_model(kind, D, 2, VOCAB, positions=64)
    with torch.no_grad():  # decisive routing, tilted towards expert 0: prophet has work to do
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20.0)
                p[0] += 0.3
    return model


def _batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (B, T), generator=gen)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def _serial_piece(serial: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The serial tensor a parallel parameter `name` stands for (expert e: slice e)."""
    match = LOCAL_EXPERT.match(name)
    if match is None:
        return serial[name]
    fused, expert, param = match.groups()
    return serial[f"{fused}.{param}"][int(expert)]


def _average_non_expert_grads(model: nn.Module, dp: dist.ProcessGroup, dp_size: int) -> None:
    experts = set(expert_parameter_names(model))
    for name, p in model.named_parameters():
        if name not in experts and p.grad is not None:
            dist.all_reduce(p.grad, group=dp)
            p.grad /= dp_size


def _steps(model: nn.Module, mesh, sync, steps: int, module: nn.Module | None = None) -> list:
    """`steps` SGD steps of the expert-parallel `model` (run as `module`, default itself) on
    this rank's batches, `sync()` making the gradients data parallel: per step the loss
    averaged over dp, every gradient and the placements used."""
    rows = []
    for step in range(steps):
        loss = _loss(module or model, _batch(step, mesh.rank("dp")))
        loss.backward()
        sync()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.group("dp").pg)
        layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
        rows.append(
            {
                "loss": mean / mesh.size("dp"),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "replicated": [layer.placement.replicated for layer in layers],
            }
        )
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        model.zero_grad(set_to_none=True)
    return rows


def _serial_steps(model: nn.Module, ranks: int, steps: int) -> list[dict]:
    rows = []
    for step in range(steps):
        loss = sum(_loss(model, _batch(step, r)) for r in range(ranks)) / ranks
        loss.backward()
        rows.append(
            {
                "loss": loss.detach(),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            }
        )
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        model.zero_grad(set_to_none=True)
    return rows


def _differences(rows: list[dict], reference: list[dict]) -> dict[str, float]:
    errors = {}
    for step, (row, ref) in enumerate(zip(rows, reference, strict=True)):
        errors[f"loss {step}"] = float((row["loss"] - ref["loss"]).abs())
        expected = {name: _serial_piece(ref["grads"], name) for name in row["grads"]}
        assert_grads_close(row["grads"], expected, what=f"step {step}")
    return errors


def _dropless_vs_serial(kind: str, model: nn.Module, reference: list[dict], steps: int):
    plan = Plan(dp=2, ep=2, moe_balance="dropless")
    mesh = build_mesh(plan)
    par = parallelize(model, plan, mesh)
    rows = _steps(par.model, mesh, par.sync_gradients, steps, module=par.module)
    experts = sorted({m.group(2) for n in rows[0]["grads"] if (m := LOCAL_EXPERT.match(n))})
    n_params = len(rows[0]["grads"])
    return _differences(rows, reference), experts, n_params, par.report


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_dropless_expert_parallel_equals_serial(kind):
    model = _model(kind)
    reference = _serial_steps(copy.deepcopy(model), ranks=2, steps=2)
    results = run_ranks(2, _dropless_vs_serial, kind, model, reference, 2)
    for rank, (errors, experts, n_params, report) in enumerate(results):
        bad = {k: v for k, v in errors.items() if not v <= ATOL}
        assert not bad, f"rank {rank} differs from serial: {bad}"
        assert experts == (["0", "1"] if rank == 0 else ["2", "3"])
        # every serial parameter but the fused pair, plus this rank's 2 experts × 2 per layer
        assert n_params == len(reference[0]["grads"]) - 2 * 2 + 2 * 2 * 2
        assert f"model.layers.1.mlp.experts: experts {2 * rank}-{2 * rank + 1} of 4" in report[1]


def _prophet_vs_dropless(model: nn.Module, steps: int):
    mesh = build_mesh(Plan(dp=2, ep=2))
    ep, ep_dp = build_expert_groups(mesh, 2)
    runs = {}
    for name, balance in (("dropless", "dropless"), ("prophet", Prophet(**FAST_LINK))):
        parallel = copy.deepcopy(model)
        parallelize_experts(parallel, ep, balance)

        def sync(parallel: nn.Module = parallel) -> None:
            reduce_expert_gradients(parallel, ep_dp, dp_size=mesh.size("dp"))
            _average_non_expert_grads(parallel, mesh.group("dp").pg, mesh.size("dp"))

        runs[name] = _steps(parallel, mesh, sync, steps)
    return runs


def test_prophet_replicas_keep_loss_and_gradients_of_dropless_step_for_step():
    runs = run_ranks(2, _prophet_vs_dropless, _model("mixtral"), 3)
    replicated = False
    for rank, run in enumerate(runs):
        for step, (plain, balanced) in enumerate(zip(run["dropless"], run["prophet"], strict=True)):
            torch.testing.assert_close(balanced["loss"], plain["loss"], atol=ATOL, rtol=ATOL)
            assert balanced["grads"].keys() == plain["grads"].keys()
            assert_grads_close(balanced["grads"], plain["grads"], what=f"rank {rank}")
            if step == 0:
                assert balanced["replicated"] == [(), ()]  # nothing to plan from yet
            replicated |= any(balanced["replicated"])
    assert replicated


def _refused():
    model = tiny_hf_model("mixtral", D, 1, VOCAB, positions=64, experts=6)
    mesh = build_mesh(Plan(dp=4, ep=4))
    with pytest.raises(PlanError, match=r"6 experts cannot be split over ep=4 ranks; use ep in"):
        parallelize(model, Plan(dp=4, ep=4), mesh)
    return True


def test_experts_not_divisible_by_ep_are_refused():
    assert run_ranks(4, _refused) == [True] * 4


def _router_aux_loss(model: nn.Module) -> tuple[float, float]:
    tokens = _batch(0, dist.get_rank())
    kwargs = {"input_ids": tokens, "use_cache": False, "output_router_logits": True}
    serial = float(model(**kwargs).aux_loss)
    plan = Plan(dp=2, ep=2)
    par = parallelize(model, plan, build_mesh(plan))
    return float(par.module(**kwargs).aux_loss), serial


def test_the_models_own_load_balancing_loss_is_kept_on_each_ranks_tokens():
    for parallel, serial in run_ranks(2, _router_aux_loss, _model("qwen2_moe")):
        assert parallel == pytest.approx(serial, abs=1e-6)
