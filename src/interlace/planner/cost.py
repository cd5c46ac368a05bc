"""Analytical cost of one training step of a Plan: time per runtime op, and memory per device.

Every term is named after the runtime operation the comm meter (`interlace.comm`) records, as
`<group>.<op>` (`tp.all_reduce`, `dp.all_reduce`, `ep.all_to_all`, `ep_dp.all_reduce`, ...),
plus `compute`, `recompute`, `pp.bubble` and `pp.send_recv`, so a prediction can be set beside a
measurement term by term. The terms are seconds on the critical path; they sum to
`step_seconds`. Parts hidden under computation are reported separately in `hidden`.

**Work.** FLOPs per token of each layer, the embeddings and the head come from
`interlace.parallel.pipeline.partition.model_shards` on a `meta`-device model (the same counts
the pipeline partitioner balances): forward F, backward 2F, a checkpointed layer's recomputed
forward +F. Time = FLOPs / (peak(dtype) · `hardware.efficiency(rows)`), at the rows each matmul
sees: the micro-batch's tokens (3D: tokens / z), a layer's tokens / s under `tp_subbatches` s,
and for each expert its share tokens · top_k · ep / E (balanced); tensor parallelism divides a
layer's FLOPs by tp. Pipeline stages are the partitioner's `balance` of the layers; the slowest
stage sets the pace.

**Collectives** (ring algorithm, `interlace.comm.wire_bytes` factors): a collective over p ranks
takes α·steps + wire_bytes / bandwidth, with steps = 2(p−1) for all_reduce and p−1 for the
others (one α per ring step). A group is inside a node when all its ranks share one: in the
mesh order (outermost first) pp, dp, tp, a group of `size` ranks whose consecutive members are
`stride` ranks apart spans size·stride consecutive ranks, inside a node iff that is at most
devices_per_node (tp: stride 1; dp and ep: stride tp; ep_dp: stride tp·ep; pp: stride tp·dp).

- **tp** (1D, Megatron): per layer and micro-batch one all_reduce of the [tokens, d] activation
  after attention and one after the MLP, the same two in backward; a recomputed layer reuses
  its forward's reduced outputs (`tp_comm.ReductionReplay`), except under sequence parallelism,
  where the replayed forward repeats its two; the vocab-parallel
  embedding adds one forward and the head's input one backward all_reduce. With
  `sequence_parallel` each becomes an all_gather plus a reduce_scatter (same bytes). With
  `tp_subbatches` s > 1 the layers' all-reduces run under the other sub-batches' compute
  (a checkpointed layer's recomputation included: each sub-batch checkpoints itself and
  recomputes inside its backward): exposed = max(comm / s − b, comm − compute), where b,
  with `tp_block_boundary`, is one sub-batch all-reduce for each layer but the stage's last
  (its forward boundary reduction runs under the next layer's first compute).
- **ep** (`interlace.planner.cost_moe`): per MoE layer and micro-batch a dispatch and a
  combine all_to_all forward and both again backward (+2 when recomputed), and one all_gather
  of the [E] routing counts. Expert popularity is Zipf with exponent `expert_skew` (0, the
  default: balanced). Under `moe_balance=none` with a capacity each all_to_all moves
  tokens·top_k·capacity_factor rows of d and the capacity caps the hottest device's expert
  compute; otherwise (dropless) the busiest link sets the all_to_all and the busiest device
  the expert compute, after `shadow` / `prophet` replicas chosen by the runtime's own
  searches on the expected count matrix. Replicas add Trans (forward) and Agg (backward),
  both `ep.all_to_all` calls, hidden under the block's compute by Pro-Prophet's overlap form
  (`hidden`). Expert compute beyond the balanced load goes to `compute` and `recompute`.
- **dp**: one all_reduce of the stage's non-expert fp32 gradients (expert gradients over
  `ep_dp`). DDP (pp = 1, dp_overlap) runs buckets during backward: exposed = max(all_reduce −
  backward, last bucket) — everything but the last bucket can hide behind the backward, the
  last bucket cannot. With pp > 1 or dp_overlap=false, and for expert gradients, the
  all-reduce follows the backward and is fully exposed.
- **pp**: a micro-batch's time on the slowest stage T_mb (compute, recompute, tp and ep) runs
  m times, and the bubble adds (p − 1)/v · T_mb (GPipe and 1F1B v = 1; interleaved v = 2), i.e. a
  bubble fraction (p − 1)/(m + p − 1); while the bubble leaves devices idle, the busy ones
  compute `hardware.idle_speedup` times faster (CPU ranks sharing cores). The shifted
  schedule moves the recomputation of the last min(m, p − 1) micro-batches into the bubble.
  `pp.send_recv`: each micro-batch's boundary activation forward and its gradient backward,
  2·(v·m + p − 1) transfers, not overlapped (an upper bound).

**Memory** per device, the largest stage: parameters × 16 bytes (fp32 weight, gradient, two
AdamW moments), non-expert parameters divided by tp, expert parameters by tp·ep; activations:
the layers' saved elements per token (from the shards: under 1D TP the norms' inputs and each
block's shared producer input stay whole, the rest is divided by tp; all of it with sequence
parallel; a checkpointed layer keeps its d-wide input, divided by tp only with sequence
parallel) × tokens per micro-batch ×
micro-batches in flight (`micro_batches_in_flight`: all m under GPipe, ≤ p − s under 1F1B)
in the compute dtype, plus one layer's full activations as the working set of a recomputation.

- **tp_x / tp_y / tp_z** (3D, AxoNN): per layer the weight all-gathers over Z (with
  `tp3d_prefetch`, each but the first of a pass hidden under the previous linear's compute),
  the output all-reduces and the asynchronous input-gradient all-reduces (hidden under the dW
  matmul) and dW reduce-scatters (hidden under the backward), LayerNorm statistics; see
  `interlace.planner.cost3d`. The embedding and head are replicated (compute split by z only),
  and the dp all-reduce follows the backward, exposed.

**Optimizer** (`optimizer`): after the gradient all-reduces, every device steps its own
parameters: OPTIMIZER_BYTES_PER_PARAM bytes per parameter streamed at the hardware's
`memory_bandwidth`.

Not modelled yet: gradient compression (priced as dense), routing that differs between
devices or drifts between iterations (the skew is one fixed popularity), kernel efficiency
falling with narrow matmuls (tensor parallelism's widths: only rows are modelled), and
contention between groups sharing a link.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from interlace.errors import PlanError
from interlace.models.config import GPTConfig
from interlace.plan import Plan
from interlace.planner.collective_cost import (
    collective_seconds,
    exposed_after_overlap,
    group_inside_node,
)
from interlace.planner.hardware import Hardware
from interlace.planner.profile import (
    ModelProfile,
    Stage,
    model_profile,
    stage_memory,
    stages_of,
)

GRAD_BYTES = 4
"""Bytes per gradient element in the data parallel all-reduce (fp32)."""
OPTIMIZER_BYTES_PER_PARAM = 32
"""Memory traffic of one parameter's optimizer step: AdamW reads the fp32 weight, gradient and
two moments (16 bytes) and writes the weight and moments (12), and gradient clipping reads the
gradient once more (4)."""
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "tf32": 4, "fp32": 4}
"""Bytes per activation element of each compute dtype."""
INTERLEAVED_VIRTUAL_STAGES = 2
"""Virtual stages per rank the interleaved schedule uses (torch's default here)."""


# --------------------------------------------------------------------------- result
@dataclass(frozen=True)
class PlanCost:
    """The estimate for one plan: seconds per term (`breakdown`, summing to `step_seconds`),
    seconds hidden under compute per term (`hidden`), throughput and memory per device, and
    the expert-parallel details (`moe`, see `StepTerms`)."""

    plan: Plan
    hardware: str
    n_devices: int
    global_batch: int
    seq_len: int
    breakdown: dict[str, float]
    hidden: dict[str, float]
    step_seconds: float
    tflops_per_device: float
    mfu: float
    memory_bytes_per_device: float
    memory: dict[str, float] = field(default_factory=dict)
    memory_limit_bytes: float = 0.0
    moe: dict[str, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """True when the estimated memory fits the device."""
        return self.memory_bytes_per_device <= self.memory_limit_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: the plan string and every number."""
        return {
            "plan": str(self.plan),
            "hardware": self.hardware,
            "n_devices": self.n_devices,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "step_seconds": self.step_seconds,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "memory_bytes_per_device": self.memory_bytes_per_device,
            "memory_limit_bytes": self.memory_limit_bytes,
            "breakdown": dict(self.breakdown),
            "hidden": dict(self.hidden),
            "memory": dict(self.memory),
            "moe": dict(self.moe),
        }


# --------------------------------------------------------------------------- estimate
def recompute_ratios(plan: Plan) -> list[float]:
    """Checkpointed fraction of each stage's layers: none 0, full 1, stage-aware 1 on every
    stage but the last (Merak's rule with r0 = 1: the last stage runs each backward right after
    its forward and keeps nothing extra)."""
    if plan.recompute == "full":
        return [1.0] * plan.pp
    if plan.recompute == "stage-aware":
        return [1.0] * (plan.pp - 1) + [0.0]
    return [0.0] * plan.pp


def micro_batch_rows(plan: Plan, global_batch: int) -> int:
    """Sequences per micro-batch: global_batch / (dp · micro_batches); PlanError if uneven."""
    if global_batch < 1:
        raise PlanError(f"global batch {global_batch} must be a positive number of sequences")
    if global_batch % plan.dp:
        raise PlanError(
            f"global batch {global_batch} is not divisible by dp={plan.dp}; use a global batch "
            f"that is a multiple of {plan.dp}, e.g. {plan.dp * max(1, global_batch // plan.dp)}"
        )
    per_dp = global_batch // plan.dp
    if per_dp % plan.micro_batches:
        raise PlanError(
            f"the {per_dp} sequences per data parallel rank (global batch {global_batch} / "
            f"dp={plan.dp}) do not split into micro_batches={plan.micro_batches}; use "
            f"micro_batches dividing {per_dp}"
        )
    rows = per_dp // plan.micro_batches
    if plan.overlap.tp_subbatches > 1 and rows % plan.overlap.tp_subbatches:
        raise PlanError(
            f"tp_subbatches={plan.overlap.tp_subbatches} must divide the {rows} sequences of a "
            "micro-batch"
        )
    return rows


@dataclass(frozen=True)
class StepTerms:
    """The cost model's terms of one step, before they are summed: what `estimate` adds up and
    what `interlace.planner.simulate` lays out on a timeline (one source for both).

    Per micro-batch on the slowest stage (seconds): `forward` and `backward` compute (1/3 and
    2/3 of 3F), `recompute` (the checkpointed forward); `comm` the exposed tp/ep collectives per
    term, `comm_hidden` the part hidden under compute, and `comm_forward_share` the fraction of
    each term's calls issued in the forward (the rest in backward and recomputation).
    Per step: `moe` what the expert-parallel terms assumed and found (`cost_moe`): the skew,
    the hottest device's load over the balanced one, experts replicated per layer, seconds of
    dispatch/combine, exposed Trans and Agg (all three in `ep.all_to_all`) and of expert
    compute beyond the balanced load (in `compute` and `recompute`); `send_recv_one` one
    boundary transfer; `dp_exposed`/`dp_hidden` the gradient
    all-reduce (`dp.all_reduce`); `ep_dp` the expert gradient all-reduce; `optimizer` the
    optimizer step (with gradient clipping) of the device's parameters.
    """

    plan: Plan
    micro_batches: int
    virtual_stages: int
    tokens: int
    forward: float
    backward: float
    recompute: float
    comm: dict[str, float]
    comm_hidden: dict[str, float]
    comm_forward_share: float
    send_recv_one: float
    dp_exposed: float
    dp_hidden: float
    ep_dp: float
    optimizer: float
    idle_speedup: float
    recompute_runs: int
    profile: ModelProfile
    stages: tuple[Stage, ...]
    moe: dict[str, float] = field(default_factory=dict)

    @property
    def stage_micro_batch(self) -> float:
        """Seconds of one micro-batch on the slowest stage: compute, recompute, exposed comm."""
        return self.forward + self.backward + self.recompute + sum(self.comm.values())

    def breakdown(self) -> tuple[dict[str, float], dict[str, float]]:
        """(seconds on the critical path per term, seconds hidden per term) of the step."""
        plan, m, pp = self.plan, self.micro_batches, self.plan.pp
        breakdown = {
            "compute": m * (self.forward + self.backward),
            "recompute": self.recompute_runs * self.recompute,
        }
        breakdown.update({k: m * t for k, t in self.comm.items()})
        hidden = {k: m * t for k, t in self.comm_hidden.items()}
        if pp > 1:
            work = self.stage_micro_batch - self.forward - self.backward - self.recompute
            work += (self.forward + self.backward + self.recompute) / self.idle_speedup
            breakdown["pp.bubble"] = (pp - 1) / self.virtual_stages * work
            breakdown["pp.send_recv"] = 2 * (self.virtual_stages * m + pp - 1) * self.send_recv_one
        if plan.dp > 1:
            breakdown["dp.all_reduce"] = self.dp_exposed
            if self.dp_hidden:
                hidden["dp.all_reduce"] = self.dp_hidden
        if self.ep_dp:
            breakdown["ep_dp.all_reduce"] = self.ep_dp
        if self.optimizer:
            breakdown["optimizer"] = self.optimizer
        return breakdown, hidden


def step_terms(
    plan: Plan,
    config: GPTConfig,
    hardware: Hardware,
    global_batch: int,
    seq_len: int | None = None,
    dtype: str = "bf16",
    expert_skew: float = 0.0,
) -> StepTerms:
    """The terms of one step of `config` under `plan` (see `StepTerms` and the module
    docstring), experts' popularity Zipf with exponent `expert_skew` (0 = balanced). PlanError
    for a batch the plan cannot split or a bad skew."""
    from interlace.planner.cost_moe import check_expert_skew  # builds on this module

    check_expert_skew(expert_skew)
    seq = seq_len or config.seq_len
    profile = model_profile(replace(config, seq_len=seq) if seq != config.seq_len else config)
    act_bytes = DTYPE_BYTES.get(dtype, 2)
    rows = micro_batch_rows(plan, global_batch)
    tokens = rows * seq
    batch_split = plan.tp3d[2] if plan.tp3d is not None else 1  # 3D: z splits the tokens
    rate = hardware.matmul_flops(dtype, tokens / batch_split)
    tp, pp, m = plan.tp_size, plan.pp, plan.micro_batches
    v = INTERLEAVED_VIRTUAL_STAGES if plan.schedule == "interleaved" else 1
    stages = stages_of(profile, pp, tuple(recompute_ratios(plan)))
    dpn = hardware.devices_per_node
    d = profile.config.d_model

    # ---- the slowest stage's work per micro-batch
    slowest = max(stages, key=lambda st: 3 * st.flops + st.recompute_flops)
    compute_mb = 3 * slowest.flops * tokens / tp / rate
    recompute_mb = slowest.recompute_flops * tokens / tp / rate
    if plan.tp3d is not None:  # the embedding and head are replicated: only z splits them
        ends = slowest.flops - slowest.layer_flops
        compute_mb = 3 * (slowest.layer_flops / tp + ends / batch_split) * tokens / rate
    subbatches = plan.overlap.tp_subbatches if plan.tp > 1 else 1
    if subbatches > 1:  # each layer runs on tokens / s rows at a time
        sub_rate = hardware.matmul_flops(dtype, tokens / subbatches)
        compute_mb += _slower(3 * slowest.layer_flops * tokens / tp, sub_rate, rate)
        recompute_mb += _slower(slowest.recompute_flops * tokens / tp, sub_rate, rate)
    expert_rate = rate
    if slowest.n_moe:  # an expert computes its share of the ep group's tokens
        expert_rate = hardware.matmul_flops(
            dtype, tokens * config.top_k * plan.ep / config.n_experts
        )
        expert = tokens * config.top_k * 4 * d * config.ffn_dim / tp  # forward, per MoE layer
        compute_mb += _slower(3 * slowest.n_moe * expert, expert_rate, rate)
        recompute_mb += _slower(slowest.n_moe_checkpointed * expert, expert_rate, rate)

    # ---- tensor parallel collectives per micro-batch
    comm: dict[str, float] = {}
    forward_calls = total_calls = 0
    tp_split = tp_piece = 0.0  # all-reduces on sub-batch threads (hideable), one of them
    if plan.tp > 1:
        # a recomputation replays the forward's all-reduced outputs (ReductionReplay) unless
        # they run as sequence-parallel gathers; with sub-batches, checkpointed layers
        # checkpoint each sub-batch, their recomputation inside its interleaved backward
        s = plan.overlap.tp_subbatches
        split_layers = slowest.n_layers if s > 1 else 0
        count = 4 * slowest.n_layers + int(slowest.has_embed) + int(slowest.has_head)
        count += 2 * slowest.n_checkpointed if plan.sequence_parallel else 0
        forward_calls += 2 * slowest.n_layers + int(slowest.has_embed)
        total_calls += count
        payload = tokens * d * act_bytes
        inside = group_inside_node(tp, 1, dpn)
        if plan.sequence_parallel:
            shard = payload / tp
            comm["tp.all_gather"] = count * collective_seconds(
                "all_gather", shard, tp, inside, hardware
            )
            comm["tp.reduce_scatter"] = count * collective_seconds(
                "reduce_scatter", payload, tp, inside, hardware
            )
        else:
            one = collective_seconds("all_reduce", payload, tp, inside, hardware)
            tp_piece = collective_seconds("all_reduce", payload / s, tp, inside, hardware)
            tp_split = 4 * split_layers * s * tp_piece
            comm["tp.all_reduce"] = (count - 4 * split_layers) * one + tp_split
    hidden: dict[str, float] = {}
    if plan.tp3d is not None:
        forward_share = _add_tp3d(
            comm, hidden, plan, slowest, config, tokens, act_bytes, rate, hardware
        )
        forward_calls, total_calls = forward_share, 1.0
    if tp_split:
        s = plan.overlap.tp_subbatches
        floor = tp_split / s
        if plan.overlap.tp_block_boundary:  # each forward boundary but the stage's last hides
            floor -= (slowest.n_layers - 1) * tp_piece
        split_compute = compute_mb + recompute_mb
        exposed = exposed_after_overlap(tp_split, max(floor, tp_split - split_compute), hardware)
        hidden["tp.all_reduce"] = tp_split - exposed
        comm["tp.all_reduce"] -= tp_split - exposed

    # ---- expert parallel collectives per micro-batch (`planner.cost_moe`)
    moe: dict[str, float] = {}
    if plan.ep > 1 and slowest.n_moe:
        from interlace.planner.cost_moe import moe_layer_terms  # builds on this module

        n_moe, n_ckpt = slowest.n_moe, slowest.n_moe_checkpointed
        inside = group_inside_node(plan.ep, tp, dpn)
        expert_forward = tokens * config.top_k * 4 * d * config.ffn_dim / (tp * expert_rate)
        layer = moe_layer_terms(
            plan,
            config,
            hardware,
            tokens,
            act_bytes,
            expert_rate,
            expert_params=slowest.expert_params / (n_moe * config.n_experts),
            block_forward=(compute_mb / 3 - n_moe * expert_forward) / n_moe,
            skew=expert_skew,
        )
        a2a_count = n_moe * 4 + 2 * n_ckpt
        transfers = n_moe * (layer.trans + layer.agg)
        comm["ep.all_to_all"] = a2a_count * layer.all_to_all + transfers
        if layer.trans_hidden + layer.agg_hidden:
            hidden["ep.all_to_all"] = n_moe * (layer.trans_hidden + layer.agg_hidden)
        comm["ep.all_gather"] = n_moe * collective_seconds(
            "all_gather", 8 * config.n_experts, plan.ep, inside, hardware
        )
        compute_mb += 3 * n_moe * layer.extra_forward
        recompute_mb += n_ckpt * layer.extra_forward
        replicated = 2 * n_moe if layer.replicated else 0  # Trans forward, Agg backward
        forward_calls += 3 * n_moe + replicated // 2
        total_calls += a2a_count + n_moe + replicated
        moe = {
            "expert_skew": expert_skew,
            "hottest_device_load": layer.hottest,
            "replicated_experts": float(layer.replicated),
            "dispatch_combine": m * a2a_count * layer.all_to_all,
            "trans": m * n_moe * layer.trans,
            "agg": m * n_moe * layer.agg,
            "imbalance_compute": m * (3 * n_moe + n_ckpt) * layer.extra_forward,
        }

    recompute_runs = m
    if plan.schedule == "shifted" and pp > 1:
        recompute_runs = m - min(m, pp - 1)
    send_one = 0.0
    if pp > 1:
        inside = group_inside_node(pp, tp * plan.dp, dpn)
        alpha, bandwidth = hardware.link(inside)
        send_one = alpha + tokens * d * act_bytes / bandwidth

    # ---- data parallel gradient all-reduce
    dp_exposed = dp_hidden = 0.0
    dense_params = max(st.params - st.expert_params for st in stages) / tp
    if plan.tp3d is not None:
        dense_params = max(st.layer_params / tp + st.params - st.layer_params for st in stages)
    if plan.dp > 1:
        grad = dense_params * GRAD_BYTES
        inside = group_inside_node(plan.dp, tp, dpn)
        dp_exposed = collective_seconds("all_reduce", grad, plan.dp, inside, hardware)
        if plan.overlap.dp_overlap and pp == 1 and plan.tp3d is None:
            bucket = min(grad, plan.overlap.dp_bucket_mb * 2**20)
            last = collective_seconds("all_reduce", bucket, plan.dp, inside, hardware)
            full, backward = dp_exposed, 2 / 3 * m * compute_mb
            dp_exposed = exposed_after_overlap(full, max(full - backward, last), hardware)
            dp_hidden = full - dp_exposed
    ep_dp_seconds = 0.0
    ep_dp = plan.dp // plan.ep
    expert_params = max(st.expert_params for st in stages) / (tp * plan.ep)
    if ep_dp > 1 and expert_params:
        inside = group_inside_node(ep_dp, tp * plan.ep, dpn)
        ep_dp_seconds = collective_seconds(
            "all_reduce", expert_params * GRAD_BYTES, ep_dp, inside, hardware
        )
    return StepTerms(
        plan=plan,
        micro_batches=m,
        virtual_stages=v,
        tokens=tokens,
        forward=compute_mb / 3,
        backward=2 * compute_mb / 3,
        recompute=recompute_mb,
        comm=comm,
        comm_hidden=hidden,
        comm_forward_share=forward_calls / total_calls if total_calls else 0.0,
        send_recv_one=send_one,
        dp_exposed=dp_exposed,
        dp_hidden=dp_hidden,
        ep_dp=ep_dp_seconds,
        optimizer=max(_device_params(st, plan) for st in stages)
        * OPTIMIZER_BYTES_PER_PARAM
        / hardware.memory_bandwidth,
        idle_speedup=hardware.idle_speedup,
        recompute_runs=recompute_runs,
        profile=profile,
        stages=stages,
        moe=moe,
    )


def _slower(flops: float, rate_at: float, rate: float) -> float:
    """Extra seconds of `flops` run at `rate_at` FLOP/s instead of `rate` (0.0 when equal)."""
    return flops * (1 / rate_at - 1 / rate)


def _device_params(stage: Stage, plan: Plan) -> float:
    """Parameters one device of `stage` holds: the layers' split by tp (3D: x·y·z, with the
    embedding and head replicated), expert parameters by tp·ep."""
    tp, dense = plan.tp_size, stage.params - stage.expert_params
    if plan.tp3d is not None:
        return stage.layer_params / tp + dense - stage.layer_params
    return dense / tp + stage.expert_params / (tp * plan.ep)


def estimate(
    plan: Plan,
    config: GPTConfig,
    hardware: Hardware,
    global_batch: int,
    seq_len: int | None = None,
    dtype: str = "bf16",
    expert_skew: float = 0.0,
) -> PlanCost:
    """Estimate one optimizer step of `config` under `plan` on `hardware` with `global_batch`
    sequences of `seq_len` tokens (default: the config's) and expert popularity Zipf with
    exponent `expert_skew`: `step_terms`, summed. The plan's tp may be 1D or 3D. Raises
    PlanError for a batch the plan cannot split or a bad skew."""
    terms = step_terms(plan, config, hardware, global_batch, seq_len, dtype, expert_skew)
    breakdown, hidden = terms.breakdown()
    profile = terms.profile
    seq = profile.config.seq_len
    act_bytes = DTYPE_BYTES.get(dtype, 2)
    memory = max(
        (
            stage_memory(
                st, plan, terms.tokens, act_bytes, profile.config.d_model, s, terms.virtual_stages
            )
            for s, st in enumerate(terms.stages)
        ),
        key=lambda mem: mem["total"],
    )
    step = sum(breakdown.values())
    n_devices = plan.world_size
    model_flops = 3 * profile.forward_flops_per_token * global_batch * seq
    tflops = model_flops / step / n_devices / 1e12
    return PlanCost(
        plan=plan,
        hardware=hardware.name,
        n_devices=n_devices,
        global_batch=global_batch,
        seq_len=seq,
        breakdown=breakdown,
        hidden=hidden,
        step_seconds=step,
        tflops_per_device=tflops,
        mfu=tflops * 1e12 / hardware.peak(dtype),
        memory_bytes_per_device=memory.pop("total"),
        memory=memory,
        memory_limit_bytes=hardware.memory_bytes,
        moe=dict(terms.moe),
    )


def _add_tp3d(
    comm: dict[str, float],
    hidden: dict[str, float],
    plan: Plan,
    stage: Stage,
    config: GPTConfig,
    tokens: int,
    act_bytes: int,
    rate: float,
    hardware: Hardware,
) -> float:
    """Add the 3D tensor parallel terms of `stage` per micro-batch (`planner.cost3d`) to
    `comm` (exposed) and `hidden`; return the exposed share issued in forward."""
    # imported here: cost3d builds on this module's collective pricing
    from interlace.planner.cost3d import ends_seconds, layer_cost

    assert plan.tp3d is not None
    prefetch = plan.overlap.tp3d_prefetch
    layer = layer_cost(config, plan.tp3d, tokens, act_bytes, rate, hardware, prefetch)
    forward = 0.0
    for key, seconds in layer.exposed.items():
        comm[key] = comm.get(key, 0.0) + stage.n_layers * seconds
    for key, seconds in layer.forward.items():
        comm[key] = comm.get(key, 0.0) + stage.n_checkpointed * seconds
        forward += (stage.n_layers + stage.n_checkpointed) * seconds
    for key, seconds in layer.hidden.items():
        hidden[key] = hidden.get(key, 0.0) + stage.n_layers * seconds
    if prefetch and stage.n_layers:
        # the first gather of the forward and of the backward pass has nothing to hide under;
        # a checkpointed stage's backward starts with the recomputed first linear
        gather = "tp_z.all_gather"
        replayed = stage.n_checkpointed * layer.replay_hidden
        start = layer.first_forward
        start += layer.first_forward if stage.n_checkpointed else layer.first_backward
        if replayed + start:
            comm[gather] = comm.get(gather, 0.0) + start
            hidden[gather] = hidden.get(gather, 0.0) + replayed - start
            forward += layer.first_forward
    ends = (int(stage.has_embed) + int(stage.has_head)) * ends_seconds(
        config, plan.tp3d, tokens, act_bytes, hardware
    )
    if ends:
        comm["tp_x.all_gather"] = comm.get("tp_x.all_gather", 0.0) + ends
        forward += int(stage.has_head) * ends / (int(stage.has_embed) + int(stage.has_head))
    total = sum(comm.values())
    return forward / total if total else 0.0


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Share of a pipelined step spent idle: (p − 1)/(v·m + p − 1) (1F1B/GPipe v = 1)."""
    bubble = (pp - 1) / virtual_stages
    return bubble / (micro_batches + bubble) if pp > 1 else 0.0


__all__ = [
    "PlanCost",
    "StepTerms",
    "bubble_fraction",
    "estimate",
    "micro_batch_rows",
    "recompute_ratios",
    "step_terms",
]
