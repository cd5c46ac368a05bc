"""`apply_context`: the step of `parallelize` that splits a model's sequences over "cp".

It finds the model's seams by structure: every module with an `attend` attribute (the built-in
GPT's `CausalSelfAttention`) gets the plan's attention over the cp group in its place (`ring`,
or `alltoall`: heads ↔ sequence), and the model's
`positions` gives each rank its zig-zag share's global positions. The batch itself is cut by
`Parallelized.rows` (`zigzag.shard_sequence`), inputs and targets alike.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from interlace.comm import Group
from interlace.errors import PlanError
from interlace.parallel.context.alltoall import alltoall_attention
from interlace.parallel.context.ring import ring_attention
from interlace.parallel.context.zigzag import zigzag_positions

ATTENTIONS = {"ring": ring_attention, "alltoall": alltoall_attention}
"""Context-parallel attention by `cp_mode`: (q, k, v, group) → this rank's output."""


def context_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    group: Group,
    mode: str,
) -> torch.Tensor:
    """The `attend` seam as `mode`'s attention over `group`: q [B, H, T/cp, hd], k, v
    [B, Hk, T/cp, hd] (this rank's zig-zag share) → [B, H, T/cp, hd]."""
    if dropout_p:
        raise PlanError(f"cp_mode={mode} has no attention dropout (dropout_p={dropout_p})")
    return ATTENTIONS[mode](q, k, v, group)


def share_positions(length: int, device: torch.device, group: Group) -> torch.Tensor:
    """Global positions [length] of the `length` tokens of this rank's zig-zag share."""
    return zigzag_positions(length * group.size, group.size, group.rank, device)


def apply_context(model: nn.Module, cp: Group, mode: str = "ring") -> list[str]:
    """Make `model` attend (`mode`: "ring" or "alltoall") and place its tokens as one rank of
    the context parallel group `cp`, in place; returns the report lines. PlanError, before
    changing anything, when the model has no attention seam (`attend`) or no `positions`."""
    attentions = [m for m in model.modules() if hasattr(m, "attend")]
    if not attentions or not hasattr(model, "positions"):
        raise PlanError(
            f"cp={cp.size}: context parallelism splits models with the built-in GPT's attention "
            "seam (`attend`, `positions`); this model has none (Hugging Face models are not "
            "split over cp yet): use cp=1"
        )
    for attention in attentions:
        attention.attend = functools.partial(context_attend, group=cp, mode=mode)
    model.positions = functools.partial(share_positions, group=cp)
    how = "by ring" if mode == "ring" else "by heads-sequence all-to-all"
    return [
        f"context: {len(attentions)} attention modules attend {how} over cp={cp.size}, "
        f"each rank holding 2 zig-zag chunks of every sequence"
    ]
