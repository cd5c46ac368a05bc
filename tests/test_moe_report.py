"""The expert load heat-map of an expert-parallel run: the PNG is written and listed in
report.json, and the numbers behind it are the recorded routing counts, placed by hand."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from interlace.mesh import build_mesh
from interlace.models.presets import get_preset
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.plan import Plan
from interlace.report import read_metrics, strict_json
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

PLAN = "dp=2,ep=2,moe_balance=shadow"
CONFIG = TrainConfig(
    model="moe-tiny", steps=4, global_batch=32, eval_every=0, progress=False, warmup_steps=1
)


def _route_to_the_first_rank(model: nn.Module) -> None:
    """Make every MoE router send each token to experts 0 and 1 (the first rank's), whatever
    the token, so that the first step's routing is as unbalanced as it gets and shadowing
    replicates from the second step on, under any kernel's rounding.

    The block's ln_2 gives γ ⊙ x̂ + β with x̂ the normalised token (zero mean over its d
    features); with γ = 1, β = 1 and router rows +1/√d for experts 0, 1 and −1/√d for 2, 3,
    the router's logits are ±(Σ x̂ + d)/√d = ±√d for every token: a margin of 2√d."""
    for block in model.modules():
        moe = getattr(block, "mlp", None)
        if not isinstance(moe, ExpertParallelMoE):
            continue
        weight = moe.router.proj.weight  # [E, d]
        experts, d = weight.shape
        sign = torch.tensor([1.0 if e < experts // 2 else -1.0 for e in range(experts)])
        with torch.no_grad():
            block.ln_2.weight.fill_(1.0)
            block.ln_2.bias.fill_(1.0)
            weight.copy_(sign[:, None].expand(experts, d) / math.sqrt(d))


def _fit(out: Path):
    """Train PLAN on 2 ranks into `out`, every token of the first step routed to the first
    rank's experts; this rank's newest routed count matrix per layer."""
    plan = Plan.parse(PLAN)
    setup = prepare_run(dataclasses.replace(CONFIG, out=str(out)), plan, 2)
    trainer = Trainer(setup, build_mesh(plan))
    _route_to_the_first_rank(trainer.model)
    trainer.fit()
    layers = [m for m in trainer.model.modules() if isinstance(m, ExpertParallelMoE)]
    return [m.routing_history[-1].tolist() for m in layers]


def _computed(counts: list[list[int]], replicas: dict[int, list[int]]) -> list[int]:
    """Tokens each device computes: a token is computed where it is if that device owns its
    expert (blocked owners) or holds a replica of it, else at the expert's owner."""
    devices, experts = len(counts), len(counts[0])
    tokens = [0] * devices
    for source in range(devices):
        for expert in range(experts):
            owner = expert // (experts // devices)
            here = source == owner or source in replicas.get(expert, [])
            tokens[source if here else owner] += counts[source][expert]
    return tokens


def test_run_report_has_a_load_heat_map_of_the_recorded_routing(tmp_path):
    last_counts = run_ranks(2, _fit, tmp_path)[0]  # rank 0 writes the report
    report = json.loads((tmp_path / "report.json").read_text())
    load = report["moe_load"]
    assert load["plot"] == "moe_load.png"
    assert (tmp_path / "moe_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert load["steps"] == len(rows) == CONFIG.steps
    assert [layer["counts"] for layer in rows[-1]["moe"]] == last_counts
    model = get_preset("moe-tiny")
    tokens_per_rank = CONFIG.global_batch // 2 * model.seq_len * model.top_k
    replicated = False
    for row in rows:
        for layer in row["moe"]:
            assert sum(map(sum, layer["counts"])) == 2 * tokens_per_rank  # both ranks, routed
            replicas = dict(zip(layer["replicated"], layer["replicas"], strict=True))
            replicated |= bool(replicas)
            assert layer["tokens_base"] == _computed(layer["counts"], {})
            assert layer["tokens"] == _computed(layer["counts"], replicas)
    assert replicated  # the balanced panel differs from the base one somewhere
    layers = len(rows[0]["moe"])
    for key in ("tokens_base", "tokens"):
        expected = [
            [sum(row["moe"][i][key][d] for row in rows) / len(rows) for d in range(2)]
            for i in range(layers)
        ]
        assert load[key] == expected


def test_plan_without_dp_fills_the_ranks():
    assert Plan.parse_for("ep=4,moe_balance=prophet", 4) == Plan(dp=4, ep=4, moe_balance="prophet")
    assert Plan.parse_for("", 3) == Plan(dp=3)
    assert Plan.parse_for("dp=2,ep=2", 4).dp == 2  # named: kept, validate then rejects it
    assert Plan.parse_for("tp=2", 4) == Plan(dp=2, tp=2)


def test_strict_json_names_the_field_json_cannot_hold():
    row = {"step": 1, "moe": [{"replicas": [[1, np.int64(3)]]}]}
    with pytest.raises(TypeError, match=r"metrics row field 'moe\.0\.replicas\.0\.1' .*numpy"):
        strict_json(row)
    with pytest.raises(
        TypeError, match=r"report.json field 'load' holds a key of type int .*valid: str \("
    ):
        strict_json({"load": {0: 1.0}}, "report.json")
    plain = {"step": 1, "loss": np.float64(2.5), "flags": [True, None, "x"]}
    assert strict_json(plain) == plain
