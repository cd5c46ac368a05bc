"""The `memory` benchmark on 4 forked ranks with the tiny model: every plan measured, FSDP
holding a quarter of DDP's state, recomputation cutting activations, and the planner's memory
and step-time predictions beside each measurement."""

import dataclasses
import json

import pytest
import torch.distributed as dist

from interlace.bench import get_benchmark
from interlace.bench.base import RankContext
from interlace.bench.cluster_calibration import cluster_hardware
from interlace.bench.memory_report import PARTS, heaviest_rank, predicted_parts
from interlace.comm import Group
from interlace.errors import ConfigError
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.cost import estimate
from interlace.testing import run_ranks

NOMINAL_CALIBRATION = {
    "link_latency_s": 1e-5,
    "link_bandwidth_Bps": 1e8,
    "matmul_flops": 1e10,
    "matmul_efficiency": 0.5,
    "matmul_half_rows": 0.0,
    "overlap_efficiency": 0.5,
    "memory_bandwidth_Bps": 1e10,
    "idle_speedup": 1.0,
}
"""Stands in for the cluster's calibration, whose measurement takes seconds."""


def _rank(options):
    import interlace.bench.memory as bench_memory

    bench_memory.calibrate_cluster = lambda ctx, config, rows: NOMINAL_CALIBRATION  # this rank's
    group = Group("world", dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    return bench_memory.run_rank(RankContext(group, None, "lo", options))


@pytest.fixture(scope="module")
def run():
    bench = get_benchmark("memory")
    options = {**bench.options, "model": "tiny", "global_batch": 8, "steps": 1}
    bench.check(options)
    result = run_ranks(4, _rank, options, timeout=120)[0]
    doc = {
        "benchmark": "memory",
        "options": options,
        "environment": {"ranks": 4, "network": "loopback"},
        "result": json.loads(json.dumps(result)),  # as the JSON holds it
    }
    return bench, doc


def test_every_plan_is_measured_with_its_prediction_beside_it(run):
    _, doc = run
    runs = doc["result"]["plans"]
    assert list(runs) == [
        "dp=4",
        "dp=4,recompute=selective",
        "dp=4,recompute=full",
        "dp_shard=4",
        "dp_shard=4,reshard_after_forward=false",
        "dp_shard=4,recompute=full",
        "dp_shard=2,tp=2",
    ]
    config = dataclasses.replace(get_preset("tiny"), seq_len=doc["options"]["seq_len"])
    hardware = cluster_hardware(NOMINAL_CALIBRATION, 4, NOMINAL_CALIBRATION["matmul_flops"])
    for name, row in runs.items():
        assert len(row["memory"]["per_rank"]) == 4 and row["step_s"] > 0
        mine, predicted = heaviest_rank(row["memory"]), predicted_parts(row["memory"])
        state = sum(mine[part] for part in PARTS[:3])
        assert state == pytest.approx(predicted["state"], rel=0.05), name
        assert mine["activations"] > 0 and predicted["activations"] > 0
        cost = estimate(Plan.parse(name), config, hardware, 8, dtype="fp32")
        assert row["predicted_step_s"] == pytest.approx(cost.step_seconds), name


def test_fsdp_keeps_a_quarter_of_the_state_and_recomputation_cuts_activations(run):
    """Under DDP full recomputation keeps the least; under FSDP the gathered blocks count too,
    so keeping them through the forward (reshard_after_forward=false) holds the most (on this
    small model they outweigh what recomputation saves, so FSDP's two are not ordered)."""
    _, doc = run
    runs = doc["result"]["plans"]
    ddp = heaviest_rank(runs["dp=4"]["memory"])
    for plan in (
        "dp_shard=4",
        "dp_shard=4,reshard_after_forward=false",
        "dp_shard=4,recompute=full",
    ):
        for rank in runs[plan]["memory"]["per_rank"]:
            for part in PARTS[:3]:
                assert rank[part] == pytest.approx(ddp[part] / 4, rel=0.05), (plan, part)
    activations = {
        mode: heaviest_rank(runs[f"dp=4{mode}"]["memory"])["activations"]
        for mode in ("", ",recompute=selective", ",recompute=full")
    }
    assert activations[",recompute=full"] < activations[",recompute=selective"]
    assert activations[",recompute=selective"] < activations[""]
    fsdp = heaviest_rank(runs["dp_shard=4"]["memory"])["activations"]
    kept = heaviest_rank(runs["dp_shard=4,reshard_after_forward=false"]["memory"])["activations"]
    assert kept > fsdp


def test_table_headline_and_plot(run, tmp_path):
    bench, doc = run
    lines = bench.table(doc).splitlines()
    for name in doc["result"]["plans"]:
        assert any(line.startswith(f"{name} ") for line in lines), name
    ratio = (
        doc["result"]["plans"]["dp_shard=4"]["step_s"] / doc["result"]["plans"]["dp=4"]["step_s"]
    )
    assert f"{ratio:.2f}x" in bench.headline(doc)
    assert bench.key_numbers(doc["result"])["fsdp/ddp"] == pytest.approx(ratio)
    bench.plot(doc, tmp_path / "memory.png")
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ConfigError, match="steps=0"):
        bench.check({**doc["options"], "steps": 0})
