"""Compiled blocks: `torch.compile` of each transformer block in place, as a step of
`parallelize`.

Each block (an entry of the model's layer list, found by structure) is compiled on its own
(`nn.Module.compile`, so parameter names and checkpoints are unchanged): the blocks of a model
share one graph, compile time does not grow with depth, and pipeline stages, recomputation and
1D tensor parallelism (whose collectives become graph breaks) keep working on the same modules.
Refused: the threaded sub-batch overlap (`tp_subbatches > 1`, whose threads hand over inside a
block), expert parallelism (its layers run placement searches and all-to-alls on their own
threads), 3D tensor parallelism (its weight prefetcher records the order of gathers at run
time) and 1D tensor parallelism with recomputation outside a pipeline (the checkpoint's
reduction replay is a context torch.compile cannot trace). `auto` leaves those uncompiled
instead.

The loss is compiled too where it is the plain cross-entropy (`compile_loss`): the upcast of
the logits to fp32 fuses into the softmax's reductions, so the fp32 copy of the [tokens, V]
logits is never written (at GPT-2's vocabulary and 16k tokens, 3.3 GB each way). A
vocabulary-parallel loss (a split head) keeps its collectives eager.
"""

from __future__ import annotations

import torch
from torch import nn

from interlace.errors import ConfigError
from interlace.loss import CrossEntropy, cross_entropy
from interlace.plan import Plan

COMPILE_CHOICES = ("auto", "on", "off")


def uncompilable(plan: Plan) -> str | None:
    """Why `plan` cannot run compiled blocks (a phrase), or None if it can."""
    if plan.overlap.tp_subbatches > 1:
        return f"tp_subbatches={plan.overlap.tp_subbatches} (threads hand over inside a block)"
    if plan.expert_parallel:
        return f"ep={plan.ep} (expert layers work on their own threads)"
    if plan.tensor3d_parallel:
        return "tp3d (the weight prefetcher records gathers at run time)"
    if plan.tensor_parallel and plan.recompute != "none" and not plan.pipelined:
        return (
            f"tp={plan.tp} and recompute={plan.recompute} (the replay of tensor-parallel "
            "reductions is not traceable; a pipeline's stages checkpoint outside the compiled "
            "blocks and can)"
        )
    return None


def resolve_compile(choice: str, device: torch.device, plan: Plan) -> bool:
    """Whether blocks are compiled: `on`, `off`, or `auto` (on for CUDA where the plan allows).
    Raises ConfigError for an unknown choice, or `on` with a plan that cannot be compiled."""
    if choice not in COMPILE_CHOICES:
        raise ConfigError(f"compile={choice!r} is not one of {', '.join(COMPILE_CHOICES)}")
    reason = uncompilable(plan)
    if choice == "on" and reason is not None:
        raise ConfigError(f"compile=on cannot run with {reason}; use compile=off or auto")
    if choice == "auto":
        return device.type == "cuda" and reason is None
    return choice == "on"


def compile_blocks(model: nn.Module, layers: str) -> list[str]:
    """Compile every block of `model`'s layer list `layers` (an nn.ModuleList's name) in place;
    returns one report line."""
    blocks = model.get_submodule(layers)
    for block in blocks:
        block.compile()
    return [f"{layers}: {len(blocks)} blocks compiled (torch.compile, one per block)"]


def compile_loss(scores: CrossEntropy) -> tuple[CrossEntropy, list[str]]:
    """`scores` compiled if it is the plain `cross_entropy` (a split head's vocabulary-parallel
    loss is left as it is), with its report line (none when unchanged)."""
    if scores is not cross_entropy:
        return scores, []
    return torch.compile(cross_entropy), ["loss: cross-entropy compiled (logits upcast inside)"]
