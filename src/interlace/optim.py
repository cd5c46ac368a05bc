"""Optimizer and learning-rate schedule: AdamW with decoupled weight decay on matrices only,
linear warmup then cosine decay to a floor."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from interlace.models.matrices import matrices
from interlace.optim_lowbit import BF16StateAdamW


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    state: str = "fp32",
    seed: int = 0,
) -> torch.optim.Optimizer:
    """AdamW over `model`'s parameters: weight decay on matrices (weights, embeddings, stacked
    experts' weights: `models.matrices`), none on biases and norms (stacked experts' too).
    Tied parameters appear once. `state`: the dtype of its moments, "fp32" or "bf16"
    (`optim_lowbit.BF16StateAdamW`, its rounding seeded by `seed`). With fp32 moments, on CUDA
    and the CPU torch's fused kernel updates every tensor in one pass (2.4x faster than its
    foreach default over 16 M parameters on two CPU cores) and can apply the clip coefficient
    itself (`parallel.grad_norm.GradNorm.clip_`). torch's default instead on other devices,
    and where DTensors (FSDP's shards) sit beside plain tensors (the experts FSDP leaves to
    expert parallelism): the fused kernel takes a group in one call, which may not mix the
    two, and splitting the groups would change the checkpoint's keys with the plan."""
    matrix = {id(p) for module in model.modules() for p in matrices(module)}
    decay, no_decay = [], []
    for param in model.parameters():  # parameters() yields shared tensors once
        if param.requires_grad:
            (decay if id(param) in matrix else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if state == "bf16":
        return BF16StateAdamW(groups, lr=lr, betas=betas, seed=seed)
    params = decay + no_decay
    fused = all(p.device.type in ("cuda", "cpu") for p in params) and (
        len({isinstance(p, DTensor) for p in params}) == 1
    )
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused or None)


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
