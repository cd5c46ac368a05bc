"""Cost terms of data parallelism (`plan.dp`), for `planner.step.step_terms`.

One all_reduce of the largest stage's non-expert fp32 gradients per step over the dp group
(ranks tp apart; under 3D tensor parallelism the replicated embedding and head in full), and
of its expert gradients over the `ep_dp` = dp / ep ranks holding the same experts (ranks
tp · ep apart). DDP (pp = 1, 1D or no tensor parallelism, `dp_overlap`) runs buckets during
the backward: exposed = max(all_reduce − backward, last bucket), everything but the last
bucket can hide behind the backward and the last cannot; of the hideable part only
`hardware.overlap_efficiency` hides. With pp > 1, 3D tensor parallelism or dp_overlap=false,
and for expert gradients, the all-reduce follows the backward and is fully exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from interlace.plan import Plan
from interlace.planner.bytes import GRAD_BYTES
from interlace.planner.collective_cost import (
    collective_seconds,
    exposed_after_overlap,
    group_inside_node,
)
from interlace.planner.hardware import Hardware
from interlace.planner.profile import Stage


@dataclass(frozen=True)
class DataTerms:
    """Seconds of a step's gradient all-reduces: the dense one exposed (`exposed`) and hidden
    under the backward (`hidden`), and the expert one (`ep_dp`, exposed)."""

    exposed: float = 0.0
    hidden: float = 0.0
    ep_dp: float = 0.0


def data_terms(
    plan: Plan, stages: tuple[Stage, ...], compute: float, hardware: Hardware
) -> DataTerms:
    """The gradient all-reduces of `plan` over its `stages`, DDP's buckets hidden under the
    backward of the micro-batches' `compute` seconds each (forward and backward, of which the
    backward is 2/3; see the module docstring)."""
    tp, dpn = plan.tp_size, hardware.devices_per_node
    exposed = hidden = 0.0
    if plan.data_parallel:
        dense_params = max(st.params - st.expert_params for st in stages) / tp
        if plan.tp3d is not None:
            dense_params = max(st.layer_params / tp + st.params - st.layer_params for st in stages)
        grad = dense_params * GRAD_BYTES
        inside = group_inside_node(plan.dp, tp, dpn)
        exposed = collective_seconds("all_reduce", grad, plan.dp, inside, hardware)
        if plan.dp_overlapped:
            bucket = min(grad, plan.overlap.dp_bucket_mb * 2**20)
            last = collective_seconds("all_reduce", bucket, plan.dp, inside, hardware)
            full, backward = exposed, 2 / 3 * plan.micro_batches * compute
            exposed = exposed_after_overlap(full, max(full - backward, last), hardware)
            hidden = full - exposed
    ep_dp_seconds = 0.0
    ep_dp = plan.dp // plan.ep
    expert_params = max(st.expert_params for st in stages) / (tp * plan.ep)
    if ep_dp > 1 and expert_params:
        inside = group_inside_node(ep_dp, tp * plan.ep, dpn)
        ep_dp_seconds = collective_seconds(
            "all_reduce", expert_params * GRAD_BYTES, ep_dp, inside, hardware
        )
    return DataTerms(exposed, hidden, ep_dp_seconds)
