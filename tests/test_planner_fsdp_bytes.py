"""The planner prices FSDP's all-gathers at the bytes each rank sends: (p − 1) shards of
1/dp_shard of the parameters per gather, as torch's all-gather of each rank's shard (and as the
`memory` benchmark measures at the interfaces: each gather (p − 1)/p of the parameters)."""

import pytest

from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.cost import estimate
from interlace.planner.hardware import local

ALPHA, BW = 1e-5, 1e8


@pytest.mark.parametrize("shard", [2, 4])
def test_fsdp_gathers_are_priced_at_each_ranks_shard(shard):
    config = get_preset("tiny")
    hardware = local(1e12, BW, latency=ALPHA, devices_per_node=shard)
    plan = Plan.parse(f"dp_shard={shard},reshard_after_forward=false")  # one gather per step
    cost = estimate(plan, config, hardware, 8, dtype="fp32")
    total = cost.breakdown["dp_shard.all_gather"] + cost.hidden["dp_shard.all_gather"]
    params = config.num_params()  # fp32, no tensor parallelism: the whole model is gathered
    assert total == pytest.approx((shard - 1) * (ALPHA + params / shard * 4 / BW))
