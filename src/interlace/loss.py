"""The training loss of a causal language model, kept out of the model: models return logits and
the loop scores them, so the same model serves every plan (under a split head the plan's
vocabulary-parallel cross-entropy takes the place of `cross_entropy`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

CrossEntropy = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits [..., V] or this rank's vocabulary slice, targets [...]) → mean loss, a 0-d tensor."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of logits [..., V] against ids targets [...], in fp32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def aux_loss(model: nn.Module) -> torch.Tensor | float:
    """`model`'s weighted auxiliary loss of its last forward (MoE load balancing:
    `aux_loss_coef · aux_loss`), 0 for a model without one."""
    value = getattr(model, "aux_loss", None)
    return 0.0 if value is None else getattr(model, "aux_loss_coef", 0.0) * value


def causal_lm_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    model: nn.Module | None = None,
    scores: CrossEntropy = cross_entropy,
) -> torch.Tensor:
    """The loss a step back-propagates: `scores(logits, targets)` (mean cross-entropy of logits
    [B, T, V] against next-token ids [B, T]) plus `model`'s weighted auxiliary loss."""
    loss = scores(logits, targets)
    return loss if model is None else loss + aux_loss(model)
