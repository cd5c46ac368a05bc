"""Mixture-of-Experts load-balancing losses inside pipeline stages.

The built-in GPT's loss is cross-entropy + coef · Σ_l aux_l, one aux_l per MoE layer: the
load-balancing loss of that layer's router on the tokens it saw. In a pipeline the last stage
scores the logits, but the MoE layers live in every stage. Rather than send each aux_l to the
last stage, every stage adds its own layers' terms where they arise:

- **Gradient.** After each MoE block the stage passes its hidden state through `carry`: the
  identity in forward, whose backward also hands aux_l the gradient the loss gives it,
  coef · loss_scale / M (M micro-batches: each micro-batch's loss counts 1/M, as the runner's
  cross-entropy does). Autograd takes it from there into the router and, through the hidden
  state, into every earlier block and stage: the gradients one serial backward computes.
- **Value.** Each stage forward records Σ_l aux_l of its blocks (detached); the step's loss
  adds coef · the mean over the micro-batches, summed over the pipeline's stages.

torch's pipeline stages back-propagate from a stage's output alone, so a second output per
stage (the aux loss) would need a stage API of two outputs; the identity with a second gradient
keeps one tensor crossing each boundary.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class _Carry(torch.autograd.Function):
    """hidden, aux → hidden; backward: (grad of hidden, weight for aux)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor, weight) -> torch.Tensor:
        ctx.weight = weight
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the aux loss is 0-d: one gradient value, `weight`
        return grad, torch.ones((), device=grad.device) * ctx.weight, None


class StageAuxLoss:
    """The load-balancing losses of one stage's MoE layers (`layers`: modules that set an
    `aux_loss` 0-d tensor in each forward), weighted by `coef` in the model's loss.

    `weight`: the gradient the current step gives Σ aux (coef · loss_scale / M; the runner sets
    it before each step). `values`: Σ aux of each recorded forward, newest last."""

    def __init__(self, layers: Iterable[nn.Module], coef: float) -> None:
        self.layers = list(layers) if coef > 0 else []
        self.coef = coef
        self.weight: float | torch.Tensor = coef
        self.values: list[torch.Tensor] = []

    @classmethod
    def of_blocks(cls, blocks: Iterable[nn.Module], coef: float) -> StageAuxLoss:
        """The MoE layers of GPT `blocks` (a block's `mlp` with an `aux_loss`)."""
        return cls((b.mlp for b in blocks if hasattr(b.mlp, "aux_loss")), coef)

    def carry(self, hidden: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        """`hidden` [b, T, d] unchanged; in backward `layer`'s aux loss also receives `weight`
        (module docstring). Outside autograd (evaluation, a no-grad forward) the identity."""
        if layer not in self.layers or not (torch.is_grad_enabled() and hidden.requires_grad):
            return hidden
        return _Carry.apply(hidden, layer.aux_loss, self.weight)

    def record(self) -> None:
        """Keep Σ aux of the layers' last forward (call once per stage forward)."""
        if self.layers:
            total = sum(layer.aux_loss.detach().float().sum() for layer in self.layers)
            self.values.append(total)

    def take_mean(self, count: int, device: torch.device) -> torch.Tensor:
        """coef · the mean Σ aux over the newest `count` forwards (0 without MoE layers), and
        forget them all: the stage's share of the step's loss."""
        values, self.values = self.values[-count:], []
        if not values:
            return torch.zeros((), device=device)
        return self.coef * torch.stack([v.to(device) for v in values]).mean()
