"""What a 3D grid x·y·z must divide, without torch: the one rule behind both the plan's check
of a model config (`Plan.check_model`) and the runtime's check of a model found by structure
(`apply.check_tensor3d`).

The residual width d is split over x, then each transposed layer's [d/x] rows over z; heads and
feed-forward features over y, then each normal layer's rows (query width / y, kv width per y
rank, ffn / y) over z. Grouped-query kv heads split over y, or y over them (replicated).
"""

from __future__ import annotations

from collections.abc import Sequence

from interlace.divisors import divisors
from interlace.errors import PlanError

Attention = tuple[str, int, int, int]
"""(name, n_heads, head_dim, n_kv_heads) of one attention module."""
FeedForward = tuple[str, int]
"""(name, ffn_dim) of one feed-forward module."""


def check_grid(
    grid: tuple[int, int, int],
    d_model: int,
    attentions: Sequence[Attention],
    feed_forwards: Sequence[FeedForward],
) -> None:
    """PlanError naming the first size that the grid (x, y, z) cannot split, and a fix."""
    x, y, z = grid
    where = f"tp3d={x}x{y}x{z}"
    sizes = [
        ("the model", "d_model", d_model, "x", x),
        ("the model", "d_model / x", d_model // x, "z", z),
    ]
    for name, heads, head_dim, kv_heads in attentions:
        kv_local = kv_heads // y if kv_heads % y == 0 else 1
        sizes += [
            (name, "n_heads", heads, "y", y),
            (name, "query width / y", heads * head_dim // y, "z", z),
            (name, "kv width per y rank", kv_local * head_dim, "z", z),
        ]
    for name, ffn in feed_forwards:
        sizes += [(name, "ffn_dim", ffn, "y", y), (name, "ffn_dim / y", ffn // y, "z", z)]
    for part, what, value, axis, k in sizes:
        if value % k:
            raise PlanError(
                f"{part}: {what}={value} is not divisible by {k}, the {where} factor {axis}; "
                f"use {axis} in {divisors(value)[:8]}"
            )
    for name, _, _, kv_heads in attentions:
        if kv_heads % y and y % kv_heads:
            raise PlanError(
                f"{name}: n_kv_heads={kv_heads} is not divisible by {where}'s y={y}, nor "
                f"y by it; use y dividing or divided by {kv_heads}"
            )
