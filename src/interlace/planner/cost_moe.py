"""Expert parallel cost terms under skewed expert popularity, for `planner.step.step_terms`:
one MoE layer's (`moe_layer_terms`) and a stage's (`expert_terms`).

**Popularity.** `expert_skew` s is a Zipf exponent: the expert of popularity rank r (0 =
hottest) receives a share (r + 1)^−s / Σ_j (j + 1)^−s of the assignments; s = 0 is the
balanced load the model assumed before. The ranks are dealt round-robin over the ep devices
(rank r on device r mod D), so with several experts per device the hottest ones sit on
different devices; with one expert per device (Pro-Prophet's setting) the order does not
matter. Every device routes its N tokens · top_k assignments with the same popularity: the
expected count matrix is C[s, e] = N · k · p_e, [D, E].

**Per strategy** (`plan.moe_balance`), the runtime's own code prices and places
(`interlace.moe.balance`): `Placement.blocked` owners, `layer_time` for the tokens each device
computes (H) and receives (R), and the strategy's `search` for the replicas.

- `none` with a capacity (the router's `capacity_factor`, not dropless): each device keeps at
  most ceil(capacity_factor · N · k / E) assignments per expert and drops the rest, so the
  hottest device's load is capped. The all-to-all is priced as before, N · k ·
  capacity_factor rows, the most the capacity lets a device receive (an upper bound).
- `dropless` (and `none` on a dropless router): no capacity; the busiest link sets the
  all-to-all, α · (D − 1) + max_i R_i · row_bytes / bandwidth, and the busiest device the
  expert compute.
- `shadow`: FasterMoE shadowing (`shadow_search`, Trans and Agg priced in full as the runtime's
  balancer does) picks hottest experts to replicate on every device.
- `prophet`: Pro-Prophet's greedy placement (`prophet_search` with the overlap-adjusted model,
  as the runtime's balancer under the overlapping layer) on the same count matrix.

Both searches run with this hardware's ep link bandwidth and its matmul rate at the rows one
expert sees (tokens · top_k · ep / E, `Hardware.efficiency`). Replicas add Trans
(the replicated experts' fp32 parameters, owners to replicas, once per layer forward) and Agg
(their gradients back, once per layer backward), both `ep.all_to_all` calls in the comm meter:
α · (D − 1) + `layer_time`'s T_Trans / T_Agg each. The expert-parallel layer issues both
asynchronously under either strategy, so each hides as Pro-Prophet's overlap form allows:
the ideal exposed part is α · (D − 1) + max(0, T_Trans − T_FEC − T_FNEC) (Agg: T_BEC,
T_BNEC), with T_FNEC the block's non-MoE forward compute (T_BNEC twice it), and only
`hardware.overlap_efficiency` of the hideable part hides.

Expert compute: the balanced forward N · k · F_e / (tp · rate) is already in the layer's FLOPs
(F_e = 2 · the expert's matmul weights per token); the hottest device adds (max_i H_i − N · k) ·
F_e / (tp · rate) forward, twice that backward (negative when capacity drops tokens).

**Under ep × tp** each expert is whole on its owner and each tp rank dispatches its 1/tp share
of the micro-batch's tokens (so every count above is of tokens / tp); without sequence
parallelism the tp group all-gathers the combined shares after each layer (and the input
gradient's in backward, and again when a layer is replayed): `tp.all_gather`. **Under ep ×
tp3d** each z slice routes its own tokens / z and its x·y ranks share them the same way
(`tp_xy.all_gather`; counts of tokens / (x·y·z)), and each layer's input [T/z, d/x] is
all-gathered over x as often (its output's gradient in backward): `tp_x.all_gather`. With
tp3d's sequence parallelism the y ranks hold other parts of the sequences: the x ranks alone
share each part (`tp_x.all_gather` of the same tokens / (x·y·z) shares), and the input
gathered over x is [T/(y·z), d/x].

**Under etp = tp** each expert is split over the tp group (F/tp of its features on each
rank): the tp ranks share the tokens out as above, and an owner's tp ranks all-gather the
rows they received (top_k · tokens / tp each, balanced), each computes its part of every
row (its throughput tp times a whole expert's; Trans moves its pieces, expert parameters /
tp) and the parts are reduce-scattered back: `tp.all_gather` and `tp.reduce_scatter`
forward, again backward (the rows' gradients reduce-scattered, the results' gathered) and
when replayed.

**Per stage** and micro-batch, each MoE layer runs a dispatch and a combine all_to_all forward
and both again backward (+2 when recomputed), plus the replicas' Trans and Agg, and one
all_gather of the [E] routing counts. The ep group holds ranks tp apart: inside a node iff
ep · tp ≤ devices_per_node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from interlace.errors import PlanError
from interlace.models.config import GPTConfig
from interlace.moe.balance import ExpertSize, LayerCost, Placement, layer_time, make_balancer
from interlace.plan import Plan
from interlace.planner.bytes import GRAD_BYTES
from interlace.planner.collective_cost import (
    CommTerms,
    collective_seconds,
    exposed_after_overlap,
    group_inside_node,
)
from interlace.planner.cost_work import StageWork
from interlace.planner.hardware import Hardware
from interlace.planner.profile import Stage, split_group

MODELLED_BALANCES = ("shadow", "prophet")
"""Strategies whose placements come from a search driven by the performance model."""


def check_expert_skew(skew: float) -> None:
    """PlanError unless `skew` (a Zipf exponent) is a finite number >= 0."""
    if isinstance(skew, bool) or not isinstance(skew, int | float) or not math.isfinite(skew):
        raise PlanError(
            f"expert skew {skew!r} is not a finite number; give a Zipf exponent >= 0, e.g. 1.2 "
            "(0 = balanced experts)"
        )
    if skew < 0:
        raise PlanError(
            f"expert skew {skew} is negative; give a Zipf exponent >= 0, e.g. 1.2 "
            "(0 = balanced experts, larger = hotter hottest experts)"
        )


def zipf_popularity(n_experts: int, n_devices: int, skew: float) -> torch.Tensor:
    """[E] share of assignments per expert: Zipf with exponent `skew` over popularity ranks,
    rank r placed on expert (r mod D) · E/D + r // D (round-robin over D blocked devices)."""
    per_device = n_experts // n_devices
    ranks = torch.arange(n_experts, dtype=torch.float64)
    weights = (ranks + 1) ** -skew
    experts = (ranks.long() % n_devices) * per_device + ranks.long() // n_devices
    popularity = torch.empty(n_experts, dtype=torch.float64)
    popularity[experts] = weights / weights.sum()
    return popularity


@dataclass(frozen=True)
class MoELayerTerms:
    """Seconds of one MoE layer per micro-batch on the slowest device (see module docstring).

    all_to_all: one dispatch or combine; extra_forward: expert forward compute beyond the
    balanced load (backward: twice); trans / agg: exposed Trans and Agg, with their hidden
    parts; replicated: experts with replicas; hottest: max_i H_i over the balanced N · k.
    """

    all_to_all: float
    extra_forward: float
    trans: float
    trans_hidden: float
    agg: float
    agg_hidden: float
    replicated: int
    hottest: float


def moe_layer_terms(
    plan: Plan,
    config: GPTConfig,
    hardware: Hardware,
    tokens: int,
    act_bytes: int,
    rate: float,
    expert_params: float,
    block_forward: float,
    skew: float,
) -> MoELayerTerms:
    """The terms of one MoE layer for `tokens` tokens per device and micro-batch, `rate` FLOP/s
    per device on the experts' matmuls (at the rows one expert sees), `expert_params`
    parameters per expert and `block_forward` seconds of the block's non-MoE forward compute
    (T_FNEC), at popularity skew `skew`."""
    d_count, n_experts, k = plan.ep, config.n_experts, config.top_k
    inside = group_inside_node(d_count, plan.tp_size, hardware.devices_per_node)
    alpha, bandwidth = hardware.link(inside)
    latency = alpha * (d_count - 1)
    row_bytes = config.d_model * act_bytes
    # per token of this device's share; under etp its F/tp of the tp group's tp times as many
    flops_per_token = 2 * 2 * config.d_model * config.ffn_dim
    throughput = rate / flops_per_token
    assignments = tokens * k
    counts = assignments * zipf_popularity(n_experts, d_count, skew).expand(d_count, -1)
    capped = plan.moe_balance == "none" and not config.dropless
    if capped:
        counts = counts.clamp(max=math.ceil(config.capacity_factor * assignments / n_experts))
    base = Placement.blocked(n_experts, d_count)
    placement = base
    if plan.moe_balance in MODELLED_BALANCES:
        balancer = make_balancer(plan.moe_balance, bandwidth=bandwidth, flops=rate)
        size = ExpertSize(row_bytes, expert_params * GRAD_BYTES, flops_per_token)
        placement = balancer.for_layer(True).search(counts, base, size)
    cost = LayerCost(row_bytes, expert_params * GRAD_BYTES, bandwidth, throughput)
    full = layer_time(counts, placement, cost)
    if capped:
        rows = assignments * config.capacity_factor
        all_to_all = collective_seconds("all_to_all", rows * row_bytes, d_count, inside, hardware)
    else:
        all_to_all = latency + full.a2a
    trans = agg = trans_exposed = agg_exposed = 0.0
    if placement.replicated:
        ideal = layer_time(
            counts,
            placement,
            replace(cost, fnec=block_forward, bnec=2 * block_forward, overlap=True),
        )
        trans, agg = latency + full.trans, latency + full.agg
        trans_exposed = exposed_after_overlap(trans, latency + ideal.trans, hardware)
        agg_exposed = exposed_after_overlap(agg, latency + ideal.agg, hardware)
    return MoELayerTerms(
        all_to_all=all_to_all,
        extra_forward=full.fec - assignments / throughput,
        trans=trans_exposed,
        trans_hidden=trans - trans_exposed,
        agg=agg_exposed,
        agg_hidden=agg - agg_exposed,
        replicated=len(placement.replicated),
        hottest=full.fec * throughput / assignments,
    )


@dataclass(frozen=True)
class ExpertTerms:
    """The expert parallel terms of a stage per micro-batch: its collectives (`comm`), the
    expert compute beyond the balanced load added to its forward and backward (`compute`) and
    to its recomputation (`recompute`), and per step what the terms assumed and found
    (`summary`, see `StepTerms.moe`). Empty: no expert parallelism on the stage."""

    comm: CommTerms = field(default_factory=CommTerms)
    compute: float = 0.0
    recompute: float = 0.0
    summary: dict[str, float] = field(default_factory=dict)


def expert_terms(
    plan: Plan,
    config: GPTConfig,
    stage: Stage,
    tokens: int,
    act_bytes: int,
    work: StageWork,
    hardware: Hardware,
    skew: float,
) -> ExpertTerms:
    """The expert parallel terms of `stage` per micro-batch of `tokens` tokens at `act_bytes`
    bytes per element, popularity skew `skew`, the block's non-MoE forward taken from `work`
    (see the module docstring); empty without ep > 1 or MoE layers on the stage."""
    n_moe, n_ckpt = stage.n_moe, stage.n_moe_checkpointed
    if plan.ep == 1 or not n_moe:
        return ExpertTerms()
    tp, m = plan.tp_size, plan.micro_batches
    inside = group_inside_node(plan.ep, tp, hardware.devices_per_node)
    expert_forward = (
        tokens * config.top_k * 4 * config.d_model * config.ffn_dim / (tp * work.expert_rate)
    )
    layer = moe_layer_terms(
        plan,
        config,
        hardware,
        tokens / tp,  # ep × tp: each tp rank dispatches its share
        act_bytes,
        work.expert_rate,
        expert_params=stage.expert_params / (n_moe * config.n_experts * plan.etp),
        block_forward=(work.compute / 3 - n_moe * expert_forward) / n_moe,
        skew=skew,
    )
    a2a_count = n_moe * 4 + 2 * n_ckpt
    exposed = {
        "ep.all_to_all": a2a_count * layer.all_to_all + n_moe * (layer.trans + layer.agg),
        "ep.all_gather": n_moe
        * collective_seconds("all_gather", 8 * config.n_experts, plan.ep, inside, hardware),
    }
    gathers = 0
    sharing, ranks = split_group(plan)  # the ranks sharing the tokens
    if plan.etp > 1:  # the rows an owner's tp ranks received, gathered and scattered back
        tp_inside = group_inside_node(tp, 1, hardware.devices_per_node)
        rows = tokens * config.top_k * config.d_model * act_bytes  # a tp group's, balanced
        exchanges = 2 * n_moe + n_ckpt
        for op, payload in (("all_gather", rows / tp), ("reduce_scatter", rows)):
            seconds = collective_seconds(op, payload, tp, tp_inside, hardware)
            exposed[f"tp.{op}"] = exchanges * seconds
    if plan.tp3d is not None or (plan.tensor_parallel and not plan.sequence_parallel):
        gathers = 2 * n_moe + n_ckpt  # output forward (and replayed), input gradient backward
        if plan.tp3d is not None and plan.sequence_parallel:  # y ranks: other sequence parts
            sharing, ranks = "tp_x", plan.tp3d[0]
        tp_inside = group_inside_node(ranks, 1, hardware.devices_per_node)
        share = tokens / tp * config.d_model * act_bytes
        key = f"{sharing}.all_gather"  # beside etp's rows, gathered over the same ranks
        exposed[key] = exposed.get(key, 0.0) + gathers * collective_seconds(
            "all_gather", share, ranks, tp_inside, hardware
        )
    if plan.tp3d is not None:  # the input gathered over x (and replayed), its gradient too
        x, y, z = plan.tp3d
        x_inside = group_inside_node(x, 1, hardware.devices_per_node)
        rows = tokens / z / (y if plan.sequence_parallel else 1)
        residual = rows * config.d_model / x * act_bytes
        exposed["tp_x.all_gather"] = exposed.get("tp_x.all_gather", 0.0) + gathers * (
            collective_seconds("all_gather", residual, x, x_inside, hardware)
        )
    hidden = {}
    if layer.trans_hidden + layer.agg_hidden:
        hidden["ep.all_to_all"] = n_moe * (layer.trans_hidden + layer.agg_hidden)
    replicated = 2 * n_moe if layer.replicated else 0  # Trans forward, Agg backward
    split = 2 * n_moe if plan.etp > 1 else 0  # its gather and scatter, forward
    forward_calls = 3 * n_moe + replicated // 2 + (n_moe if gathers else 0) + split
    calls = a2a_count + n_moe + replicated + gathers + 2 * split
    comm = CommTerms(exposed, hidden, forward_calls, calls)
    summary = {
        "expert_skew": skew,
        "hottest_device_load": layer.hottest,
        "replicated_experts": float(layer.replicated),
        "dispatch_combine": m * a2a_count * layer.all_to_all,
        "trans": m * n_moe * layer.trans,
        "agg": m * n_moe * layer.agg,
        "imbalance_compute": m * (3 * n_moe + n_ckpt) * layer.extra_forward,
    }
    return ExpertTerms(comm, 3 * n_moe * layer.extra_forward, n_ckpt * layer.extra_forward, summary)
