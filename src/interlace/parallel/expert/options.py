"""The rules of expert parallelism that hold without a process group (no torch here): the
plan's options and their checks, and, so that the planner prices what the runtime builds, which
devices hold one expert's parameters. Expert parallelism adds no mesh dimension: its groups are
carved out of "dp" (`groups.build_expert_groups`)."""

from __future__ import annotations

from typing import Any

from interlace.divisors import divisors
from interlace.errors import PlanError, check_plan_choice

MOE_BALANCES = ("none", "dropless", "shadow", "prophet")
"""How expert-parallel layers balance their load (`interlace.moe.balance`)."""


def mesh_dims(plan: Any) -> tuple[tuple[str, int], ...]:
    """None: expert groups live inside the data-parallel dimension."""
    return ()


def check_values(plan: Any) -> None:
    """PlanError naming the fix for a bad expert option of `plan`: the balance's name, the
    replicating balances with ep > 1, ep dividing the data-parallel ranks."""
    check_plan_choice("moe_balance", plan.moe_balance, MOE_BALANCES)
    if plan.moe_balance in ("shadow", "prophet") and plan.ep == 1:
        raise PlanError(
            f"moe_balance={plan.moe_balance} places experts across an expert parallel "
            "group; use ep > 1 (ep divides dp)"
        )
    if plan.etp != 1 and not (plan.expert_parallel and plan.tensor_parallel):
        raise PlanError(
            f"etp={plan.etp} splits each expert over the 1D tensor parallel group of an expert "
            "parallel layer; use etp=1, or ep > 1 with tp > 1 and etp = tp"
        )
    if plan.etp not in (1, plan.tp):
        raise PlanError(
            f"etp={plan.etp} must be 1 (experts whole) or tp={plan.tp} (each expert split over "
            f"the tensor parallel group); use etp=1 or etp={plan.tp}"
        )
    if plan.dp_size % plan.ep:
        raise PlanError(
            f"ep={plan.ep} must divide {plan.dp_text} (expert groups are carved "
            f"out of the data parallel ranks); use ep in {divisors(plan.dp_size)}"
        )


def check_model(plan: Any, spec: Any) -> None:
    """PlanError unless model `spec` (GPTConfig-like) has experts for `plan`'s ep or balance,
    a multiple of ep of them (etp = tp divides the experts' width as the tensor split's own
    check does: it is the model's ffn_dim)."""
    if (plan.ep > 1 or plan.moe_balance != "none") and not spec.n_experts:
        raise PlanError(
            f"ep={plan.ep}, moe_balance={plan.moe_balance} need a Mixture-of-Experts model; "
            "the model has no experts (use e.g. --model moe-tiny)"
        )
    if plan.ep > 1 and spec.n_experts % plan.ep:
        raise PlanError(
            f"n_experts={spec.n_experts} is not divisible by ep={plan.ep}; "
            f"use ep in {divisors(spec.n_experts)}"
        )


def replicated_because(plan: Any, ep_dp_size: int) -> str | None:
    """Why sharded data parallelism leaves `plan`'s experts whole, replicated over their ep_dp
    group of `ep_dp_size` ranks, or None where it shards them (`shard.shard_experts`)."""
    if plan.moe_balance in ("shadow", "prophet"):
        return f"moe_balance={plan.moe_balance} sends whole experts to replica ranks"
    if ep_dp_size == 1:
        return "each expert is held by one rank"
    return None


def expert_split(plan: Any) -> int:
    """Devices one expert's parameters are split over under `plan` (a Plan): its owner alone
    under expert parallelism (ep > 1), over the ep owners; under 1D tensor parallelism without
    it (ep = 1) each expert is split along its width over tp, and with it each tp rank holds
    its owners' experts whole (ep × tp); sharded data parallelism splits them again, over
    ep_dp where it shards experts (`replicated_because`), over dp_shard without ep; etp = tp
    splits each expert's width over the tp group too."""
    if not plan.expert_parallel:
        return plan.tp_size * plan.shard_ranks
    ep_dp = plan.dp_size // plan.ep
    sharded = plan.sharded_data_parallel and replicated_because(plan, ep_dp) is None
    return plan.ep * plan.etp * (ep_dp if sharded else 1)
