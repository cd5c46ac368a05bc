"""`apply_context`: the step of `parallelize` that splits a model's sequences over "cp".

It finds the model's seams: every module with an `attend` attribute (the built-in GPT's
`CausalSelfAttention`) gets the plan's attention over the cp group in its place (`ring`, or
`alltoall`: heads ↔ sequence), and the model's `positions` (and a rotary attention's) gives
each rank its zig-zag share's global positions; a Hugging Face decoder's attention modules,
found by structure, attend the same way through transformers' attention interface, and its
position ids are the share's (`hf.py`). The batch itself is cut by `Parallelized.rows`
(`zigzag.shard_sequence`), inputs and targets alike.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from interlace.comm import Group
from interlace.errors import PlanError
from interlace.parallel.context.alltoall import alltoall_attention
from interlace.parallel.context.hf import apply_context_hf, is_hf_model
from interlace.parallel.context.ring import ring_attention
from interlace.parallel.context.zigzag import zigzag_positions
from interlace.parallel.detect import Structure, find_structure

ATTENTIONS = {"ring": ring_attention, "alltoall": alltoall_attention}
"""Context-parallel attention by `cp_mode`: (q, k, v, group) → this rank's output."""


@torch.compiler.disable  # a compiled block runs its other ops compiled around it
def context_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    group: Group,
    mode: str,
) -> torch.Tensor:
    """The `attend` seam as `mode`'s attention over `group`: q [B, H, T/cp, hd], k, v
    [B, Hk, T/cp, hd] (this rank's zig-zag share) → [B, H, T/cp, hd]. Never traced by
    torch.compile: the ring's transfers and its chunk schedule run on the host."""
    if dropout_p:
        raise PlanError(f"cp_mode={mode} has no attention dropout (dropout_p={dropout_p})")
    return ATTENTIONS[mode](q, k, v, group)


def share_positions(length: int, device: torch.device, group: Group) -> torch.Tensor:
    """Global positions [length] of the `length` tokens of this rank's zig-zag share."""
    return zigzag_positions(length * group.size, group.size, group.rank, device)


def apply_context(
    model: nn.Module, cp: Group, mode: str = "ring", structure: Structure | None = None
) -> list[str]:
    """Make `model` attend (`mode`: "ring" or "alltoall") and place its tokens as one rank of
    the context parallel group `cp`, in place; returns the report lines. `structure`: the
    model's, found before tensor parallelism split it (its embedding no longer an
    nn.Embedding then); None: found here. PlanError, before changing anything, when the model
    has neither the built-in seams (`attend`, `positions`) nor is a Hugging Face decoder
    whose attention modules are found by structure."""
    positions = functools.partial(share_positions, group=cp)
    attentions = [m for m in model.modules() if hasattr(m, "attend")]
    if attentions and hasattr(model, "positions"):
        for attention in attentions:
            attention.attend = functools.partial(context_attend, group=cp, mode=mode)
            if hasattr(attention, "positions"):  # rotary: rotated at the share's positions
                attention.positions = positions
        model.positions = positions
    elif is_hf_model(model):
        try:
            found = (structure or find_structure(model)).attentions
        except ValueError as exc:
            raise PlanError(f"cp={cp.size}: {exc}") from None
        attentions = [model.get_submodule(a.name) for a in found]
        if not attentions:
            raise PlanError(f"cp={cp.size}: no attention module found in this model; use cp=1")
        attend = functools.partial(context_attend, dropout_p=0.0, group=cp, mode=mode)
        apply_context_hf(model, attentions, attend, positions)
    else:
        raise PlanError(
            f"cp={cp.size}: context parallelism splits the built-in GPT (its `attend` and "
            "`positions` seams) and Hugging Face decoders; this model is neither: use cp=1"
        )
    how = "by ring" if mode == "ring" else "by heads-sequence all-to-all"
    return [
        f"context: {len(attentions)} attention modules attend {how} over cp={cp.size}, "
        f"each rank holding 2 zig-zag chunks of every sequence"
    ]
