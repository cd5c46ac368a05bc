"""Activation recomputation of transformer blocks, for every plan: a step of `parallelize`, and
the one checkpointed call a pipeline stage makes too.

A recomputed block runs its forward under `torch.utils.checkpoint` (non-reentrant) and runs it
again during backward; what it keeps in between depends on the mode:

- `full`: only the block's input, [tokens, d]. Backward replays the whole forward: the block's
  compute rises from 3F to 4F.
- `selective`: the block's input plus the outputs of its matrix products (`mm`, `addmm`, `bmm`,
  the grouped expert products) and of fused attention (`scaled_dot_product_attention` and its
  log-sum-exp): the tensors whose recomputation costs FLOPs. Everything else — layer norms,
  activations, dropout masks, softmax, residual adds, casts, the MoE permutation — is
  recomputed (elementwise work, no matmul FLOPs: the step's FLOPs stay 3F). A GPT block then
  keeps about 10·d per token (q, k, v, attention output and its projection, the 4d hidden
  of the MLP, its down projection) against about 18·d without recomputation and d for `full`.
  Built on torch's selective checkpoint policy (`create_selective_checkpoint_contexts`).
- `stage-aware` and explicit ratios are the pipeline's (`parallel/pipeline/recompute.py`):
  whole blocks of a stage under `full`.

Under 1D tensor parallelism the replayed forward never repeats an all-reduce: its reductions
hand back the first forward's results (`ReductionReplay`, Oases' rule); the selective policy
and the replay run side by side.

The block's forward is replaced in place (as precision and compilation do), so parameter names,
checkpoints and the modules other steps find are unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from interlace.parallel.replay import ReductionReplay

KEPT_BY_SELECTIVE = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_grouped_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
)
"""The ops whose outputs `selective` keeps: the matrix products and fused attention."""


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in KEPT_BY_SELECTIVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_contexts(
    mode: str, replay_reductions: bool = True
) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(forward, recompute) contexts of one checkpointed call in `mode` ("full" or "selective"):
    the tensor-parallel reduction replay (`replay_reductions`), and for `selective` torch's
    policy keeping matmul and attention outputs (one of the two at least)."""
    contexts = []
    if replay_reductions:
        contexts.append(ReductionReplay.contexts())
    if mode == "selective":
        contexts.append(create_selective_checkpoint_contexts(_keep_matmuls))
    if len(contexts) == 1:
        return contexts[0]
    (record, replay), (keep_forward, keep_recompute) = contexts
    return _both(record, keep_forward), _both(replay, keep_recompute)


@contextlib.contextmanager
def _both(first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager):
    with first, second:
        yield


def checkpointed(
    function: Callable[..., torch.Tensor],
    mode: str,
    *args,
    replay_reductions: bool = True,
    **kwargs,
) -> torch.Tensor:
    """`function(*args, **kwargs)` under activation checkpointing in `mode` ("full" or
    "selective"; see the module docstring): the same result and gradients, other memory and
    compute. `replay_reductions=False` leaves out the tensor-parallel replay (a model without
    1D tensor parallelism), so that torch.compile can trace the checkpoint: it admits only
    torch's own selective contexts."""
    if mode == "full" and not replay_reductions:
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    return checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=functools.partial(checkpoint_contexts, mode, replay_reductions),
        **kwargs,
    )


def recompute_blocks(
    model: nn.Module, layers: str, mode: str, replay_reductions: bool = True
) -> list[str]:
    """Make every block of `model`'s layer list `layers` (an nn.ModuleList's name) recompute its
    activations in `mode` ("none": nothing) from now on, in place, replaying its tensor-parallel
    reductions if `replay_reductions`; returns the report lines."""
    if mode == "none":
        return []
    blocks = model.get_submodule(layers)
    for block in blocks:
        block.forward = functools.partial(
            checkpointed, block.forward, mode, replay_reductions=replay_reductions
        )
    return [f"{layers}: {len(blocks)} blocks recompute their activations ({mode})"]
