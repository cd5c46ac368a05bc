"""Clipping inside the fused optimizer's step (`GradNorm.clip_` handed the optimizer): the
weights follow torch's own `clip_grad_norm_` followed by the same fused step, `.grad` is left
as backward made it, and a coefficient no step took is never applied later."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers import tiny_config
from interlace.mesh import build_mesh
from interlace.models.gpt import GPT
from interlace.optim import build_optimizer
from interlace.parallel.grad_norm import GradNorm
from interlace.parallel.parallelize import parallelize
from interlace.plan import Plan
from interlace.precision import reads_amp_hooks
from interlace.testing import run_ranks

MAX_NORM = 0.5
LR = 1e-2
"""AdamW's learning rate: weights move by up to LR a step. Dividing by 1/c instead of
multiplying by c rounds a gradient differently by an ulp, which Adam's normalisation lifts to
about 1e-4 of LR where a gradient is small; an unclipped step differs by about LR."""


def _model() -> nn.Module:
    """Tiny GPT without biases: a key projection's bias has a gradient of zero in exact
    arithmetic, whose rounding noise Adam's normalisation would lift to a full step."""
    torch.manual_seed(0)
    return GPT(tiny_config(n_layers=2, bias=False))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids x and targets y [4, T] of step `step`."""
    generator = torch.Generator().manual_seed(100 + step)
    config = tiny_config(n_layers=2)
    tokens = torch.randint(config.vocab_size, (4, config.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    """Mean cross-entropy times a weight growing with the step (the clip acts every step)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) * 10 * (step + 1)


def _backward(model: nn.Module, step: int) -> None:
    x, y = _batch(step)
    _loss(model(x), y, step).backward()


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return build_optimizer(model, lr=LR, weight_decay=0.1)


def _torch_clipped(steps: int) -> list[torch.Tensor]:
    """Weights after `steps` of torch's clipping (gradients scaled in place), then the step."""
    model = _model()
    optimizer = _adamw(model)
    for step in range(steps):
        _backward(model, step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _weights(model)


def test_the_built_optimizer_is_fused_and_divides_its_gradients_itself():
    optimizer = build_optimizer(_model(), lr=1e-3, weight_decay=0.0)
    assert optimizer.defaults["fused"] and reads_amp_hooks(optimizer)
    assert not reads_amp_hooks(torch.optim.AdamW(_model().parameters(), foreach=True))
    unfused = optimizer.state_dict()  # a state saved by a foreach AdamW
    for group in unfused["param_groups"]:
        group["fused"], group["foreach"] = None, True
    optimizer.load_state_dict(unfused)  # takes the groups' settings: its step is foreach now
    assert not reads_amp_hooks(optimizer)


def test_the_step_applies_the_clip_and_leaves_the_gradients_as_backward_made_them():
    model = _model()
    optimizer = _adamw(model)
    clipping = GradNorm(model.parameters())
    norms = []
    for step in range(3):
        _backward(model, step)
        raw = [p.grad.clone() for p in model.parameters()]
        norms.append(clipping.clip_(MAX_NORM, optimizer).item())
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), raw, strict=True))
        optimizer.step()
        assert "grad_scale" not in vars(optimizer)  # taken by this step only
        optimizer.zero_grad(set_to_none=True)
    assert min(norms) > 4 * MAX_NORM  # the clip acts at every step
    for ours, reference in zip(_weights(model), _torch_clipped(3), strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=LR / 1000)


def test_a_coefficient_no_step_took_is_withdrawn():
    """A step skipped (non-finite loss) leaves its coefficient unused; the next clip replaces
    it, and a measure-only call (max_norm inf) leaves none."""
    model = _model()
    optimizer = build_optimizer(model, lr=LR, weight_decay=0.0)
    clipping = GradNorm(model.parameters())
    _backward(model, 0)
    clipping.clip_(MAX_NORM, optimizer)
    assert "grad_scale" in vars(optimizer)
    clipping.clip_(float("inf"), optimizer)
    assert "grad_scale" not in vars(optimizer)
    before = _weights(model)
    optimizer.step()  # unclipped: the step of the raw gradient
    reference = _model()
    reference_optimizer = build_optimizer(reference, lr=LR, weight_decay=0.0)
    _backward(reference, 0)
    reference_optimizer.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    for ours, theirs in zip(_weights(model), _weights(reference), strict=True):
        assert torch.equal(ours, theirs)


def test_an_optimizer_without_the_fused_step_gets_its_gradients_scaled():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    _backward(model, 0)
    norm = GradNorm(model.parameters()).clip_(MAX_NORM, optimizer)
    assert "grad_scale" not in vars(optimizer)
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert clipped.item() == pytest.approx(MAX_NORM, rel=1e-5) and norm > 4 * MAX_NORM


def _sharded_weights() -> list[torch.Tensor]:
    """Weights after 3 clipped steps of `_model` under dp_shard=2, each rank half the rows."""
    plan = Plan.parse("dp_shard=2")
    par = parallelize(_model(), plan, build_mesh(plan))
    optimizer = _adamw(par.module)
    half = slice(0, 2) if dist.get_rank() == 0 else slice(2, 4)
    for step in range(3):
        x, y = _batch(step)
        _loss(par.module(x[half]), y[half], step).backward()
        par.sync_gradients()
        par.clip_grad_norm_(MAX_NORM, optimizer)
        par.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    return [p.full_tensor().detach() for p in par.module.parameters()]


def test_sharded_parameters_step_with_the_clip_as_torch_clips_one_process():
    # LR / 100: AdamW divides by sqrt(v), so a weight whose gradient is near zero moves by up
    # to LR on rounding alone; the sums over two ranks round otherwise than one process's, and
    # with torch 2.11 one weight of 16384 ended 1.46e-5 away. Unclipped steps differ by ~2 LR.
    results = run_ranks(2, _sharded_weights)
    for ours, reference in zip(results[0], _torch_clipped(3), strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=LR / 100)
