"""Optimizer and learning-rate schedule: AdamW with decoupled weight decay on matrices only,
linear warmup then cosine decay to a floor."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)
) -> torch.optim.AdamW:
    """AdamW over `model`'s parameters: weight decay on tensors with >= 2 dims (weights,
    embeddings), none on biases and norms. Tied parameters appear once. On CUDA torch's fused
    kernel updates every tensor in one launch (elsewhere torch's default, foreach)."""
    decay, no_decay = [], []
    for param in model.parameters():  # parameters() yields shared tensors once
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_cuda = all(p.is_cuda for group in groups for p in group["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=on_cuda or None)


def lr_at(
    step: int, total_steps: int, peak_lr: float, warmup_steps: int, min_lr_ratio: float
) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup over `warmup_steps` to
    `peak_lr`, then cosine decay to `min_lr_ratio · peak_lr` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    floor = min_lr_ratio * peak_lr
    return floor + 0.5 * (peak_lr - floor) * (1 + math.cos(math.pi * progress))
