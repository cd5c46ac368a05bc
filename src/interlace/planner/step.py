"""The cost model's terms of one training step, before they are summed: `step_terms` prices each
parallel dimension in its own module and assembles them into `StepTerms`, which
`planner.cost.estimate` sums and `planner.simulate` lays out on a timeline (one source for
both).

In order, on the pipeline's slowest stage per micro-batch (under context parallelism, of this
rank's T/cp tokens of each sequence): the compute (`cost_work`), the 1D and 3D tensor parallel
collectives (`cost_tensor`, `cost3d`, hidden under that compute), the context parallel ring or
all-to-all (`cost_context`, the ring hidden under attention), the expert parallel
collectives and load imbalance (`cost_moe`, whose extra expert compute joins the stage's);
then per step the pipeline (`cost_pipeline`), the gradient all-reduces (`cost_data`, hidden
under the backward) and the optimizer step (`cost_optimizer`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from interlace.models.config import GPTConfig
from interlace.plan import Plan
from interlace.planner.bytes import activation_bytes
from interlace.planner.cost3d import tensor3d_terms
from interlace.planner.cost_context import context_terms
from interlace.planner.cost_data import data_terms
from interlace.planner.cost_moe import check_expert_skew, expert_terms
from interlace.planner.cost_optimizer import optimizer_seconds
from interlace.planner.cost_pipeline import (
    boundary_transfers,
    bubble_stage_times,
    pipeline_stages,
    pipeline_terms,
)
from interlace.planner.cost_tensor import tensor_terms
from interlace.planner.cost_work import stage_work
from interlace.planner.hardware import Hardware
from interlace.planner.profile import ModelProfile, Stage, model_profile


def micro_batch_rows(plan: Plan, global_batch: int) -> int:
    """Sequences per micro-batch: global_batch / (dp · micro_batches), the runtime's rule
    (`Plan.micro_batch_rows`, no accumulation); PlanError if uneven."""
    return plan.micro_batch_rows(global_batch)


@dataclass(frozen=True)
class StepTerms:
    """The cost model's terms of one step, before they are summed (see the module docstring).

    Per micro-batch on the slowest stage (seconds): `forward` and `backward` compute (1/3 and
    2/3 of 3F), `recompute` (the checkpointed forward); `comm` the exposed tp/cp/ep collectives
    per term, `comm_hidden` the part hidden under compute, and `comm_forward_share` the
    fraction of each term's calls issued in the forward (the rest in backward and
    recomputation). Per step: `moe` what the expert-parallel terms assumed and found
    (`cost_moe`): the skew, the hottest device's load over the balanced one, experts replicated
    per layer, seconds of dispatch/combine, exposed Trans and Agg (all three in
    `ep.all_to_all`) and of expert compute beyond the balanced load (in `compute` and
    `recompute`); `send_recv_one` one boundary transfer; `data`/`data_hidden` the
    data-parallel collectives per term, exposed and hidden (`cost_data`: `dp.all_reduce`, or
    `dp_cp.all_reduce` under context parallelism, `ep_dp.all_reduce`, FSDP's `dp_shard.*` and
    `dp_replicate.all_reduce`); `optimizer` the optimizer step (with gradient clipping) of the
    device's parameters; `compute_rate` the FLOP/s the slowest stage's matmuls were priced at,
    `shape_factor` the part of it their shapes cost (`gemm`).
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
    data: dict[str, float]
    data_hidden: dict[str, float]
    optimizer: float
    idle_speedup: float
    recompute_runs: int
    profile: ModelProfile
    stages: tuple[Stage, ...]
    moe: dict[str, float] = field(default_factory=dict)
    compute_rate: float = 0.0
    shape_factor: float = 1.0

    @property
    def stage_micro_batch(self) -> float:
        """Seconds of one micro-batch on the slowest stage: compute, recompute, exposed comm."""
        return self.forward + self.backward + self.recompute + sum(self.comm.values())

    def breakdown(self) -> tuple[dict[str, float], dict[str, float]]:
        """(seconds on the critical path per term, seconds hidden per term) of the step."""
        m, pp = self.micro_batches, self.plan.pp
        breakdown = {
            "compute": m * (self.forward + self.backward),
            "recompute": self.recompute_runs * self.recompute,
        }
        breakdown.update({k: m * t for k, t in self.comm.items()})
        hidden = {k: m * t for k, t in self.comm_hidden.items()}
        if pp > 1:
            work = self.stage_micro_batch - self.forward - self.backward - self.recompute
            work += (self.forward + self.backward + self.recompute) / self.idle_speedup
            breakdown["pp.bubble"] = bubble_stage_times(pp, m, self.virtual_stages) * work
            transfers = boundary_transfers(pp, m, self.virtual_stages)
            breakdown["pp.send_recv"] = transfers * self.send_recv_one
        for name, seconds in self.data.items():  # ep × tp's experts add to tp.all_reduce
            breakdown[name] = breakdown.get(name, 0.0) + seconds
        hidden.update({k: t for k, t in self.data_hidden.items() if t})
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
    optimizer_state: str = "fp32",
) -> StepTerms:
    """The terms of one step of `config` under `plan` with `global_batch` sequences of `seq_len`
    tokens (default: the config's) in `dtype` (see `StepTerms` and the module docstring),
    experts' popularity Zipf with exponent `expert_skew` (0 = balanced), AdamW's moments in
    `optimizer_state`'s dtype. PlanError for a batch the plan cannot split or a bad skew."""
    check_expert_skew(expert_skew)
    seq = seq_len or config.seq_len
    profile = model_profile(replace(config, seq_len=seq) if seq != config.seq_len else config)
    config = profile.config
    act_bytes = activation_bytes(dtype)
    tokens = micro_batch_rows(plan, global_batch) * seq // plan.cp
    stages = pipeline_stages(profile, plan)
    slowest = max(stages, key=lambda st: 3 * st.flops + st.recompute_flops)
    work = stage_work(plan, config, slowest, tokens, hardware, dtype)
    d = config.d_model
    comms = (
        tensor_terms(plan, slowest, tokens, act_bytes, d, work, hardware),
        tensor3d_terms(plan, slowest, config, tokens, act_bytes, work, hardware),
        context_terms(plan, slowest, config, tokens, act_bytes, work.rate, hardware),
    )
    expert = expert_terms(plan, config, slowest, tokens, act_bytes, work, hardware, expert_skew)
    comms += (expert.comm,)
    compute = work.compute + expert.compute
    pipeline = pipeline_terms(plan, tokens, d, act_bytes, hardware)
    data = data_terms(plan, stages, compute, hardware, act_bytes)
    calls = sum(c.calls for c in comms)
    return StepTerms(
        plan=plan,
        micro_batches=plan.micro_batches,
        virtual_stages=pipeline.virtual_stages,
        tokens=tokens,
        forward=compute / 3,
        backward=2 * compute / 3,
        recompute=work.recompute + expert.recompute,
        comm=_summed(c.exposed for c in comms),
        comm_hidden=_summed(c.hidden for c in comms),
        comm_forward_share=sum(c.forward_calls for c in comms) / calls if calls else 0.0,
        send_recv_one=pipeline.send_recv_one,
        data=data.exposed,
        data_hidden=data.hidden,
        optimizer=optimizer_seconds(plan, stages, hardware, optimizer_state),
        idle_speedup=hardware.idle_speedup,
        recompute_runs=pipeline.recompute_runs,
        profile=profile,
        stages=stages,
        moe=expert.summary,
        compute_rate=work.rate,
        shape_factor=work.shape_factor,
    )


def _summed(terms: Iterable[dict[str, float]]) -> dict[str, float]:
    """Seconds per term over several dimensions' terms (two may price the same group's op:
    ep × tp's expert gathers and the tensor layers' are both `tp.all_gather`)."""
    total: dict[str, float] = {}
    for part in terms:
        for name, seconds in part.items():
            total[name] = total.get(name, 0.0) + seconds
    return total
