"""Rotary position embedding (RoFormer; Llama's convention): each head's channel pair (i,
i + hd/2) of a query or key at position t is rotated by the angle t · θ^(−2i/hd), so that the
product of a query and a key depends on their positions only through their distance.

Written by hand because torch has no rotary op; the angles are computed from the positions on
every call (no buffer), so the module holds nothing that checkpoints, pipeline stages or FSDP2
would have to place, and context parallelism only changes which positions it is handed.
"""

import torch


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, T, H, hd] rotated at `positions` [T] (base `theta`) → [B, T, H, hd], in x's
    dtype (the angles in float32)."""
    half = x.shape[-1] // 2
    exponents = torch.arange(half, device=x.device, dtype=torch.float32) / half
    angles = positions.to(torch.float32)[:, None] * theta ** (-exponents)  # [T, hd/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :].to(x.dtype)  # [T, 1, hd]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :].to(x.dtype)
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated_half * sin
