"""What a 3D grid x·y·z must divide, without torch: the one rule behind both the plan's check
of a model config (`Plan.check_model`) and the runtime's check of a model found by structure
(`apply.check_tensor3d`).

The residual width d is split over x, then each transposed layer's [d/x] rows over z; heads and
feed-forward features over y, then each normal layer's rows (query width / y, kv width per y
rank, ffn / y) over z. Grouped-query kv heads split over y, or y over them (replicated).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from interlace.divisors import divisors
from interlace.errors import PlanError
from interlace.plan_pending import fmt_tp3d

Attention = tuple[str, int, int, int]
"""(name, n_heads, head_dim, n_kv_heads) of one attention module."""
FeedForward = tuple[str, int]
"""(name, ffn_dim) of one feed-forward module."""


def mesh_dims(plan: Any) -> tuple[tuple[str, int], ...]:
    """The 3D grid's mesh dimensions of `plan` (a Plan), outermost first: ("tp_z", z),
    ("tp_y", y), ("tp_x", x), so that x varies fastest; none without a grid."""
    if plan.tp3d is None:
        return ()
    x, y, z = plan.tp3d
    return (("tp_z", z), ("tp_y", y), ("tp_x", x))


def check_grid(
    grid: tuple[int, int, int],
    d_model: int,
    attentions: Sequence[Attention],
    feed_forwards: Sequence[FeedForward],
    vocab: tuple[str, int] | None = None,
) -> None:
    """PlanError naming the first size that the grid (x, y, z) cannot split, and a fix;
    `vocab` (embedding name, vocabulary size): its rows are split over the x·y ranks."""
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
    if vocab is not None:
        sizes.append((vocab[0], "vocab_size", vocab[1], "x·y", x * y))
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


def check_values(plan: Any) -> None:
    """PlanError naming the fix for a bad 3D grid option of `plan`: three positive sizes, not
    with 1D `tp`; `tp3d_prefetch` a bool, with a grid; sequence parallelism over y > 1."""
    prefetch = plan.overlap.tp3d_prefetch
    if not isinstance(prefetch, bool):
        raise PlanError(
            f"tp3d_prefetch={prefetch!r} must be true or false, e.g. tp3d_prefetch=false"
        )
    if plan.tp3d is None:
        if not prefetch:
            raise PlanError(
                "tp3d_prefetch=false applies to 3D tensor parallelism; use it with tp3d=XxYxZ "
                "or drop it"
            )
        return
    if len(plan.tp3d) != 3 or any(not isinstance(d, int) or d < 1 for d in plan.tp3d):
        raise PlanError(f"tp3d={plan.tp3d!r} must be three positive integers, e.g. 2x2x1")
    if plan.tp != 1:
        raise PlanError(
            f"tp={plan.tp} and tp3d={fmt_tp3d(plan.tp3d)} are exclusive; use one of them"
        )
    if plan.sequence_parallel and plan.tp3d[1] == 1:
        raise PlanError(
            f"sequence_parallel=true splits the sequence over tp3d's y, which is 1 in "
            f"tp3d={fmt_tp3d(plan.tp3d)}; use a grid with y > 1, or sequence_parallel=false"
        )


def check_model(plan: Any, spec: Any) -> None:
    """PlanError unless `plan`'s grid splits model `spec` (GPTConfig-like; `check_grid`, the
    runtime's rule) and, under sequence parallelism, y its sequence; experts are not split:
    a Mixture-of-Experts model needs ep > 1, which keeps them whole on their owners."""
    if plan.tp3d is None:
        return
    if spec.n_experts and plan.ep == 1:
        raise PlanError(
            f"tp3d={fmt_tp3d(plan.tp3d)} does not split Mixture-of-Experts layers; use ep > 1 "
            "(experts whole on their owners), a dense model, or tp=N"
        )
    y = plan.tp3d[1]
    if plan.sequence_parallel and spec.seq_len % y:
        raise PlanError(
            f"seq_len={spec.seq_len} is not divisible by tp3d's y={y}, as sequence_parallel "
            f"needs; use a seq_len that is a multiple of {y}"
        )
    head_dim = spec.d_model // spec.n_heads
    check_grid(
        plan.tp3d,
        spec.d_model,
        [("the model", spec.n_heads, head_dim, spec.n_heads)],
        [("the model", spec.ffn_dim)],
        ("the model", spec.vocab_size),
    )
