"""Cost terms of context parallelism (`plan.cp`, `plan.cp_mode`), for `planner.step.step_terms`.

A rank holds T/cp tokens of each sequence (zig-zag, `parallel.context.zigzag`): the `tokens`
of a micro-batch handed here are already that share, and the compute, tensor parallel traffic
and saved activations follow from them; every token still attends to the whole sequence, so a
layer's FLOPs per token (attention's 4 · T · w included) are those of the full length T, and
the zig-zag split gives every rank the same share. What cp adds is each attention layer's
exchange over the cp group (ranks tp apart: inside a node iff cp · tp ≤ devices_per_node), on
the heads of this rank's tensor parallel shard, w = n_heads · head_dim / tp wide (the built-in
GPT's keys and values have as many heads as its queries):

- ring (`cp.ring_pass`, `parallel.context.ring`): this rank's K and V block, 2 · tokens · w
  elements in the compute dtype, goes to the next rank while the block held is attended; one
  block's attention is 1/cp of the layer's, b = 4 · T · w · tokens / cp FLOPs forward and 2b
  backward. Forward: cp − 1 passes, each beside one block: exposed (cp − 1) · max(0, kv − b).
  Backward: cp − 1 K/V passes and cp passes of the blocks' gradients (fp32), a gradient pass
  running beside the next block's backward and the last one after it: exposed
  max(0, kv − 2b) + (cp − 2) · max(0, kv + grad − 2b) + max(0, grad − 2b) + grad.
  A checkpointed layer's replayed forward runs its ring again. Of what could hide, only
  `hardware.overlap_efficiency` hides; the rest of the ring is `hidden`.
- all-to-all (`cp.all_to_all`, heads ↔ sequence, `parallel.context.alltoall`): q, k, v and
  the output, tokens · w elements each, exchanged once in the forward, once in the backward
  and once more in a replayed forward; none hidden.

Not priced: the ring's block buffers and fp32 partial outputs, and the all-to-all's whole
sequence of H/cp heads, beside the activations `profile.stage_memory` counts.
"""

from __future__ import annotations

from interlace.models.config import GPTConfig
from interlace.plan import Plan
from interlace.planner.bytes import DTYPE_BYTES
from interlace.planner.collective_cost import (
    CommTerms,
    collective_seconds,
    exposed_after_overlap,
    group_inside_node,
)
from interlace.planner.hardware import Hardware
from interlace.planner.profile import Stage

RING_GRAD_BYTES = DTYPE_BYTES["fp32"]
"""Bytes per element of the key and value gradients that travel the ring."""


def context_terms(
    plan: Plan,
    stage: Stage,
    config: GPTConfig,
    tokens: int,
    act_bytes: int,
    rate: float,
    hardware: Hardware,
) -> CommTerms:
    """The context parallel exchanges of `stage` per micro-batch of `tokens` tokens (this rank's
    share of its sequences, of `config.seq_len` each) with activations of `act_bytes` bytes,
    attention computed at `rate` FLOP/s (see the module docstring); empty without cp."""
    if not plan.context_parallel:
        return CommTerms()
    cp, layers, replays = plan.cp, stage.n_layers, stage.n_checkpointed
    width = config.n_heads * config.head_dim / plan.tp
    inside = group_inside_node(cp, plan.tp, hardware.devices_per_node)
    if plan.cp_mode == "alltoall":
        one = collective_seconds("all_to_all", tokens * width * act_bytes, cp, inside, hardware)
        calls = 4 * (2 * layers + replays)
        return CommTerms({"cp.all_to_all": calls * one}, {}, 4 * layers, calls)
    block = 4 * config.seq_len * width * tokens / cp / rate
    kv = collective_seconds("ring_pass", 2 * tokens * width * act_bytes, cp, inside, hardware)
    grad = collective_seconds(
        "ring_pass", 2 * tokens * width * RING_GRAD_BYTES, cp, inside, hardware
    )
    forward_total = (cp - 1) * kv
    backward_total = (cp - 1) * kv + cp * grad
    forward = exposed_after_overlap(forward_total, ring_forward_exposed(cp, kv, block), hardware)
    backward = exposed_after_overlap(
        backward_total, ring_backward_exposed(cp, kv, grad, 2 * block), hardware
    )
    exposed = (layers + replays) * forward + layers * backward
    total = (layers + replays) * forward_total + layers * backward_total
    calls = (cp - 1) * (2 * layers + replays) + cp * layers
    return CommTerms(
        {"cp.ring_pass": exposed}, {"cp.ring_pass": total - exposed}, (cp - 1) * layers, calls
    )


def ring_forward_exposed(cp: int, kv: float, block: float) -> float:
    """Seconds of one layer's forward ring left exposed by a perfect overlap: each of the
    cp − 1 K/V passes (`kv` s) runs beside one block's attention (`block` s)."""
    return (cp - 1) * max(0.0, kv - block)


def ring_backward_exposed(cp: int, kv: float, grad: float, block: float) -> float:
    """Seconds of one layer's backward ring left exposed by a perfect overlap, with `block` s of
    backward per block: step 0 sends K/V, steps 1 … cp − 2 K/V and the previous block's
    gradients (`grad` s), step cp − 1 the gradients only, and the last gradients travel
    after the last block."""
    middle = (cp - 2) * max(0.0, kv + grad - block)
    return max(0.0, kv - block) + middle + max(0.0, grad - block) + grad
