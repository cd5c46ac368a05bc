"""MoE load balancing for expert parallelism: placements, Pro-Prophet's performance model,
greedy placement searches and the `plan.moe_balance` strategies built on them.

- `placement`: owners and replicas of experts; tokens computed / received per device; the
  balance degree (standard deviation of tokens per device).
- `cost`: the performance model T = 4·T_A2A + T_FEC + T_BEC + T_Trans + T_Agg.
- `search`: FasterMoE shadowing and Pro-Prophet's greedy search, pure functions of a count
  matrix.
- `policy`: the strategies none / dropless / shadow / prophet and when they replan.
- `background`: a search run on a background thread, timed (planning overlapped with the
  layer's all-to-alls).
"""

from interlace.moe.balance.background import BackgroundSearch, PlanTiming
from interlace.moe.balance.cost import LayerCost, LayerTime, layer_time
from interlace.moe.balance.placement import Placement, balance_degree, device_loads
from interlace.moe.balance.policy import (
    BALANCERS,
    Balancer,
    Dropless,
    ExpertSize,
    Prophet,
    Shadow,
    make_balancer,
)
from interlace.moe.balance.search import prophet_search, shadow_search

__all__ = [
    "BALANCERS",
    "BackgroundSearch",
    "Balancer",
    "Dropless",
    "ExpertSize",
    "LayerCost",
    "LayerTime",
    "Placement",
    "PlanTiming",
    "Prophet",
    "Shadow",
    "balance_degree",
    "device_loads",
    "layer_time",
    "make_balancer",
    "prophet_search",
    "shadow_search",
]
