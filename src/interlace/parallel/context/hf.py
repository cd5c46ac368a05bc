"""Context parallelism for Hugging Face decoders (Llama family with rotary positions and
grouped-query attention, GPT-2 with learned positions): their seams are transformers' own.

- **Attention.** transformers looks each attention module's kernel up by the model config's
  `_attn_implementation` in its `AttentionInterface`. `CONTEXT_PARALLEL` is registered there
  (and, as no mask at all, in its `AttentionMaskInterface`: causality comes from the zig-zag
  chunks' global order); the kernel calls the module's `context_attend` (set per attention
  module by `apply_context_hf`), which receives q [B, H, T/cp, hd] and k, v [B, Hk, T/cp, hd]
  after the rotary embedding.
- **Positions.** A forward pre-hook on the model hands it `position_ids` [1, T/cp]: this
  rank's zig-zag share's global positions, which the rotary embedding (or GPT-2's position
  table) reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from interlace.errors import PlanError

CONTEXT_PARALLEL = "interlace_context_parallel"
"""The attention implementation name a context-parallel Hugging Face model is switched to."""


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention kernel signature → ([B, T/cp, H, hd], None) by the module's
    `context_attend`."""
    attend = getattr(module, "context_attend", None)
    if attend is None:
        raise RuntimeError(
            f"{type(module).__name__} runs under {CONTEXT_PARALLEL} but was not split over cp "
            "(apply_context_hf sets each attention module's context_attend)"
        )
    head_dim = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, head_dim**-0.5):
        raise PlanError(
            f"context parallelism scales attention scores by 1/sqrt(head_dim); this model's "
            f"attention scales by {scaling}: use cp=1"
        )
    if dropout:
        raise PlanError(f"context parallelism has no attention dropout ({dropout}); use cp=1")
    return attend(query, key, value).transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def _register() -> None:
    """Register `CONTEXT_PARALLEL` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CONTEXT_PARALLEL, _attention)
    AttentionMaskInterface.register(CONTEXT_PARALLEL, _no_mask)


def is_hf_model(model: nn.Module) -> bool:
    """A transformers model whose attention kernels are looked up by name."""
    return hasattr(getattr(model, "config", None), "_attn_implementation")


def apply_context_hf(
    model: nn.Module,
    attentions: list[nn.Module],
    attend: Callable[..., torch.Tensor],
    positions: Callable[[int, torch.device], torch.Tensor],
) -> None:
    """Switch the transformers `model` to context parallelism, in place: each of `attentions`
    attends by `attend(q, k, v)`, and the model reads `positions(T/cp, device)` as its
    position ids."""
    _register()
    for module in attentions:
        module.context_attend = attend
    model.config._attn_implementation = CONTEXT_PARALLEL

    def with_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = args[0] if args else kwargs["input_ids"]
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = positions(ids.shape[1], ids.device).unsqueeze(0)
        return args, kwargs

    model.register_forward_pre_hook(with_positions, with_kwargs=True)
