"""The rules of expert parallelism that hold without a process group (no torch here), so that
the planner prices what the runtime builds: which devices hold one expert's parameters."""

from __future__ import annotations

from typing import Any


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
    ep_dp where it shards experts (`replicated_because`), over dp_shard without ep."""
    if not plan.expert_parallel:
        return plan.tp_size * plan.shard_ranks
    ep_dp = plan.dp_size // plan.ep
    sharded = plan.sharded_data_parallel and replicated_because(plan, ep_dp) is None
    return plan.ep * (ep_dp if sharded else 1)
