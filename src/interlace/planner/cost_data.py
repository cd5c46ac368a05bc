"""Cost terms of data parallelism (`plan.dp`, `plan.dp_shard`), for `planner.step.step_terms`.

Replicated (`dp_shard = 1`): one all_reduce of the largest stage's non-expert fp32 gradients
per step over the dp group (ranks tp apart; under 3D tensor parallelism the replicated
embedding and head in full; under context parallelism over the dp · cp ranks of `dp_cp`, which
hold the same parameters, as `mesh.data_group_name` names it), and of its expert gradients
over the `ep_dp` = dp / ep ranks holding the same experts (ranks tp · ep apart; `_expert_terms`:
reduce-scattered and gathered where sharded data parallelism shards them, summed over tp
under ep × tp). DDP (pp = 1,
1D or no tensor parallelism, `dp_overlap`) runs buckets during the backward: exposed =
max(all_reduce − backward, last bucket), everything but the last bucket can hide behind the
backward and the last cannot; of the hideable part only `hardware.overlap_efficiency` hides.
With pp > 1, 3D tensor parallelism or dp_overlap=false, and for expert gradients, the
all-reduce follows the backward and is fully exposed.

Sharded (`dp_shard > 1`, FSDP2; ranks tp apart): per step, every parameter all-gathered in the
compute dtype before the forward (`dp_shard.all_gather`), again before the backward with
`reshard_after_forward`, and every fp32 gradient reduce-scattered during the backward
(`dp_shard.reduce_scatter`); with dp > 1 (HSDP) the 1/dp_shard gradient shards all-reduced over
`dp_replicate` (ranks tp · dp_shard apart), after the backward. FSDP2 prefetches the next
block's gather under the current block's compute: the forward's gathers hide behind the
forward but for the first block's, the backward's gathers and reduce-scatters behind the
backward but for the last block's reduce-scatter (of the hideable part,
`overlap_efficiency` hides).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from interlace.mesh import data_group_name
from interlace.parallel.expert.options import expert_split
from interlace.plan import Plan
from interlace.planner.bytes import GRAD_BYTES
from interlace.planner.collective_cost import (
    collective_seconds,
    exposed_after_overlap,
    group_inside_node,
)
from interlace.planner.cost3d import ends_z_sum_seconds
from interlace.planner.hardware import Hardware
from interlace.planner.profile import Stage, dense_params, split_group


@dataclass(frozen=True)
class DataTerms:
    """Seconds of a step's data-parallel collectives per term (`dp.all_reduce` or
    `dp_cp.all_reduce`, `ep_dp.all_reduce`, `dp_shard.all_gather`, `dp_shard.reduce_scatter`,
    `dp_replicate.all_reduce`): on the critical path (`exposed`) and hidden under compute
    (`hidden`)."""

    exposed: dict[str, float] = field(default_factory=dict)
    hidden: dict[str, float] = field(default_factory=dict)


def data_terms(
    plan: Plan, stages: tuple[Stage, ...], compute: float, hardware: Hardware, param_bytes: int
) -> DataTerms:
    """The gradient reductions (and FSDP's gathers, parameters of `param_bytes` each) of `plan`
    over its `stages`, hidden under the micro-batches' `compute` seconds each (forward and
    backward, of which the backward is 2/3; see the module docstring)."""
    terms = DataTerms()
    dense = max(dense_params(st, plan) for st in stages)
    if plan.sharded_data_parallel:
        _sharded_terms(terms, plan, stages, dense, compute, hardware, param_bytes)
    elif plan.dp_size * plan.cp > 1:
        _replicated_terms(terms, plan, dense * GRAD_BYTES, compute, hardware)
    _expert_terms(terms, plan, stages, hardware, param_bytes)
    return terms


def _expert_terms(
    terms: DataTerms,
    plan: Plan,
    stages: tuple[Stage, ...],
    hardware: Hardware,
    param_bytes: int,
) -> None:
    """The expert gradients' reduction over ep_dp (the ranks holding the same experts, tp · ep
    apart): an all_reduce, or where sharded data parallelism shards the experts
    (`expert.options.expert_split`) a reduce_scatter and their gathers before the forward and
    (with `reshard_after_forward`) the backward, none prefetched; under ep × tp the tp ranks'
    expert gradients summed over tp too (`tp.all_reduce`; under ep × tp3d over the x·y ranks,
    `tp_xy.all_reduce`, then over z, `tp_z.all_reduce`); under etp = tp each rank's pieces,
    1/tp of its experts, are its own (the down biases' sum over tp, d per expert, is not
    priced). All after or outside the backward's overlap: exposed."""
    ep_dp, tp = plan.dp_size // plan.ep, plan.tp_size
    if not plan.expert_parallel:
        return
    pieces = plan.ep * plan.etp  # etp: each device holds 1/tp of each of its experts
    whole = max(st.expert_params for st in stages) / pieces  # one device's, before FSDP2
    split = expert_split(plan) // pieces  # 1, or ep_dp where sharded
    if not whole:
        return
    inside = group_inside_node(ep_dp, tp * plan.ep, hardware.devices_per_node)
    if split > 1:
        gathers = 2 if plan.reshard_after_forward else 1
        terms.exposed["ep_dp.all_gather"] = gathers * collective_seconds(
            "all_gather", whole / split * param_bytes, ep_dp, inside, hardware
        )
        terms.exposed["ep_dp.reduce_scatter"] = collective_seconds(
            "reduce_scatter", whole * GRAD_BYTES, ep_dp, inside, hardware
        )
    elif ep_dp > 1:
        terms.exposed["ep_dp.all_reduce"] = collective_seconds(
            "all_reduce", whole * GRAD_BYTES, ep_dp, inside, hardware
        )
    if plan.etp > 1:  # each piece is its rank's own: not summed over tp
        return
    sharing, ranks = split_group(plan)
    z = tp // ranks  # tp3d's z slices (1 otherwise), x·y ranks apart
    for name, size, stride in ((sharing, ranks, 1), ("tp_z", z, ranks)):
        if size > 1:
            inside = group_inside_node(size, stride, hardware.devices_per_node)
            key = f"{name}.all_reduce"  # tp_z: the 3D grid's ends may sum there too
            terms.exposed[key] = terms.exposed.get(key, 0.0) + collective_seconds(
                "all_reduce", whole / split * GRAD_BYTES, size, inside, hardware
            )


def _replicated_terms(
    terms: DataTerms, plan: Plan, grad: float, compute: float, hardware: Hardware
) -> None:
    ranks = plan.dp * plan.cp
    inside = group_inside_node(ranks, plan.tp_size, hardware.devices_per_node)
    full = collective_seconds("all_reduce", grad, ranks, inside, hardware)
    exposed = full
    if plan.dp_overlapped:
        bucket = min(grad, plan.overlap.dp_bucket_mb * 2**20)
        last = collective_seconds("all_reduce", bucket, ranks, inside, hardware)
        backward = 2 / 3 * plan.micro_batches * compute
        exposed = exposed_after_overlap(full, max(full - backward, last), hardware)
    name = f"{data_group_name(plan)}.all_reduce"
    terms.exposed[name] = exposed
    if full > exposed:
        terms.hidden[name] = full - exposed


def _sharded_terms(
    terms: DataTerms,
    plan: Plan,
    stages: tuple[Stage, ...],
    params: float,
    compute: float,
    hardware: Hardware,
    param_bytes: int,
) -> None:
    shard, dpn = plan.shard_ranks, hardware.devices_per_node  # dp_shard, × cp under cp
    inside = group_inside_node(shard, plan.tp_size, dpn)
    layer = max(s.params for st in stages for s in st.shards if s.kind == "layer") / plan.tp_size
    # kept gathered: the ends, split by vocabulary rows over tp (a 3D grid's x·y ranks)
    root = max(st.params - st.layer_params for st in stages) / split_group(plan)[1]

    def gather(n: float) -> float:  # the payload of an all_gather is each rank's shard
        return collective_seconds("all_gather", n / shard * param_bytes, shard, inside, hardware)

    def scatter(n: float) -> float:
        return collective_seconds("reduce_scatter", n * GRAD_BYTES, shard, inside, hardware)

    forward, backward = compute / 3 * plan.micro_batches, 2 * compute / 3 * plan.micro_batches
    gather_forward = gather(params)
    gather_backward = gather(params - root) if plan.reshard_after_forward else 0.0
    reduce = scatter(params)
    exposed_forward = exposed_after_overlap(
        gather_forward, max(gather_forward - forward, gather(layer)), hardware
    )
    in_backward = gather_backward + reduce
    exposed_backward = exposed_after_overlap(
        in_backward, max(in_backward - backward, scatter(layer)), hardware
    )
    # split each window's exposed share between its collectives by their size
    exposed_gather = exposed_forward + exposed_backward * gather_backward / in_backward
    exposed_reduce = exposed_backward * reduce / in_backward
    terms.exposed["dp_shard.all_gather"] = exposed_gather
    terms.exposed["dp_shard.reduce_scatter"] = exposed_reduce
    terms.hidden["dp_shard.all_gather"] = gather_forward + gather_backward - exposed_gather
    terms.hidden["dp_shard.reduce_scatter"] = reduce - exposed_reduce
    z_sum = max(ends_z_sum_seconds(plan, st, hardware, shard) for st in stages)
    if z_sum:  # 3D grids' ends: each shard summed over z once a step
        terms.exposed["tp_z.all_reduce"] = z_sum
    if plan.dp > 1:
        inside = group_inside_node(plan.dp, plan.tp_size * shard, dpn)
        terms.exposed["dp_replicate.all_reduce"] = collective_seconds(
            "all_reduce", params / shard * GRAD_BYTES, plan.dp, inside, hardware
        )
