"""Cost terms of 1D (Megatron) tensor parallelism (`plan.tp`), for `planner.step.step_terms`.

Per layer and micro-batch one all_reduce of the [tokens, d] activation after attention and
one after the MLP, the same two in backward; a recomputed layer reuses its forward's reduced
outputs (`parallel.replay.ReductionReplay`), except under sequence parallelism, where the replayed
forward repeats its two; the vocab-parallel embedding adds one forward and the head's input
one backward all_reduce. With `sequence_parallel` each becomes an all_gather plus a
reduce_scatter (same bytes).

With `tp_subbatches` s > 1 the layers' all-reduces (those without an MoE layer, which run
whole) run under the other sub-batches' compute
(a checkpointed layer's recomputation included: each sub-batch checkpoints itself and
recomputes inside its backward): exposed = max(comm / s − b, comm − compute), where b, with
`tp_block_boundary` (not under FSDP2: `tensor.options.defers_block_boundary`), is one
sub-batch all-reduce for each layer but the stage's last (its forward boundary reduction runs
under the next layer's first compute). Of the hideable part
only `hardware.overlap_efficiency` hides.

The tp group is the innermost (stride 1): inside a node iff tp ≤ devices_per_node.
"""

from __future__ import annotations

from interlace.parallel.tensor.options import defers_block_boundary
from interlace.plan import Plan
from interlace.planner.collective_cost import (
    CommTerms,
    collective_seconds,
    exposed_after_overlap,
    group_inside_node,
)
from interlace.planner.cost_work import StageWork
from interlace.planner.hardware import Hardware
from interlace.planner.profile import Stage


def exposed_under_subbatches(
    split: float, s: int, boundary: float, work: StageWork, hardware: Hardware
) -> float:
    """Seconds left exposed of `split`, the collectives issued on `s` sub-batch threads (1D or
    3D tensor parallelism under `tp_subbatches`), which fly under the other sub-batches'
    compute (`work`'s, its recomputation included): max(split / s − `boundary`, split −
    compute) ideally (`boundary`: the block-boundary reductions hidden under the next layer),
    of whose hideable part `hardware.overlap_efficiency` hides."""
    ideal = max(split / s - boundary, split - (work.compute + work.recompute))
    return exposed_after_overlap(split, ideal, hardware)


def tensor_terms(
    plan: Plan,
    stage: Stage,
    tokens: int,
    act_bytes: int,
    d: int,
    work: StageWork,
    hardware: Hardware,
) -> CommTerms:
    """The 1D tensor parallel collectives of `stage` per micro-batch of `tokens` tokens of width
    `d` at `act_bytes` bytes per element, the sub-batched all-reduces hidden under `work`'s
    compute (see the module docstring); empty without 1D tensor parallelism."""
    if not plan.tensor_parallel:
        return CommTerms()
    tp = plan.tp_size
    count = 4 * stage.n_layers + int(stage.has_embed) + int(stage.has_head)
    count += 2 * stage.n_checkpointed if plan.sequence_parallel else 0
    forward_calls = 2 * stage.n_layers + int(stage.has_embed)
    payload = tokens * d * act_bytes
    inside = group_inside_node(tp, 1, hardware.devices_per_node)
    if plan.sequence_parallel:
        exposed = {
            "tp.all_gather": count
            * collective_seconds("all_gather", payload / tp, tp, inside, hardware),
            "tp.reduce_scatter": count
            * collective_seconds("reduce_scatter", payload, tp, inside, hardware),
        }
        return CommTerms(exposed, {}, forward_calls, count)
    s = plan.overlap.tp_subbatches
    split_layers = stage.n_layers - stage.n_moe if s > 1 else 0  # MoE layers run whole
    one = collective_seconds("all_reduce", payload, tp, inside, hardware)
    piece = collective_seconds("all_reduce", payload / s, tp, inside, hardware)
    split = 4 * split_layers * s * piece  # on the sub-batch threads: hideable
    reduce = (count - 4 * split_layers) * one + split
    if not split:
        return CommTerms({"tp.all_reduce": reduce}, {}, forward_calls, count)
    boundary = max(0, split_layers - 1) * piece if defers_block_boundary(plan) else 0.0
    hidden = split - exposed_under_subbatches(split, s, boundary, work, hardware)
    return CommTerms(
        {"tp.all_reduce": reduce - hidden}, {"tp.all_reduce": hidden}, forward_calls, count
    )
