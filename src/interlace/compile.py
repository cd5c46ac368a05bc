"""Compiled blocks: `torch.compile` of each transformer block in place, as a step of
`parallelize`.

Each block (an entry of the model's layer list, found by structure) is compiled on its own
(`nn.Module.compile`, so parameter names and checkpoints are unchanged): the blocks of a model
share one graph, compile time does not grow with depth, and pipeline stages, recomputation and
1D tensor parallelism (whose collectives become graph breaks) keep working on the same modules.
An expert-parallel layer is never traced (its all-to-all splits are read on the host, its
placement search runs on a thread): its block compiles around it, one graph before it and one
after, unless the block is recomputed, where torch.compile cannot split the checkpointed
region and runs that block eagerly. A recomputed block with a single-device MoE layer compiles
whole: the layer's record of its aux loss is not replayed in the recomputation.

Refused: the threaded sub-batch overlap (`tp_subbatches > 1`, whose threads hand over inside a
block), 3D tensor parallelism (its weight prefetcher records the order of gathers at run time)
and 1D tensor parallelism with recomputation outside a pipeline (the checkpoint's reduction
replay is a context torch.compile cannot trace). `auto` leaves those uncompiled instead.

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


def compile_blocks(model: nn.Module, layers: str, plan: Plan) -> list[str]:
    """Compile every block of `model`'s layer list `layers` (an nn.ModuleList's name) in place;
    returns the report lines."""
    # An MoE layer records its aux loss and counts on itself: inside a recomputed block that
    # side effect made dynamo run the whole block eagerly. The recomputation need not replay
    # it (the loss holds the first forward's aux loss).
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    blocks = model.get_submodule(layers)
    for block in blocks:
        block.compile()
    lines = [f"{layers}: {len(blocks)} blocks compiled (torch.compile, one per block)"]
    if plan.context_parallel:
        lines.append(
            f"{layers}: context-parallel attention (cp_mode={plan.cp_mode}) runs eagerly "
            "inside the compiled blocks (a graph break each)"
        )
    if plan.expert_parallel:
        lines.append(
            f"{layers}: expert-parallel layers run eagerly inside their compiled blocks "
            + (
                "(a graph break each)"
                if plan.recompute == "none"
                else f"(with recompute={plan.recompute} their blocks run eagerly whole)"
            )
        )
    return lines


def compile_loss(scores: CrossEntropy) -> tuple[CrossEntropy, list[str]]:
    """`scores` compiled if it is the plain `cross_entropy` (a split head's vocabulary-parallel
    loss is left as it is), with its report line (none when unchanged)."""
    if scores is not cross_entropy:
        return scores, []
    return torch.compile(cross_entropy), ["loss: cross-entropy compiled (logits upcast inside)"]
