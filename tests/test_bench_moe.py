"""MoE routing workloads (skewed, recorded) and the `moe` benchmark's loopback smoke run."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from interlace import comm
from interlace.bench import get_benchmark, moe_calibrate, moe_deepspeed
from interlace.bench.moe_forced import ForcedRouter
from interlace.bench.moe_routing_workloads import (
    SkewedRouting,
    record_routing,
    sample_assignments,
)
from interlace.bench.runner import parse_options, run_benchmark
from interlace.errors import ConfigError


def _tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p - q).abs().sum()) / 2


def test_skewed_popularity_is_zipf_like_and_exponent_controls_it():
    def top_quarter(exponent: float) -> float:
        p = SkewedRouting(16, exponent=exponent, drift=0.0, locality=0.0).popularity(0)
        return float(p.sort(descending=True).values[:4].sum())

    assert abs(top_quarter(0.0) - 0.25) < 1e-9  # exponent 0: uniform
    assert top_quarter(1.2) > 0.5  # the top 4 of 16 experts take more than half
    assert top_quarter(2.0) > top_quarter(1.2) > top_quarter(0.6)
    p = SkewedRouting(16, seed=3).popularity(7, source=1, layer=2)
    assert p.shape == (16,) and abs(float(p.sum()) - 1) < 1e-9 and bool((p > 0).all())


def test_skewed_popularity_drifts_slowly_and_is_reproducible():
    work = SkewedRouting(16, exponent=1.2, drift=0.05, reversion=0.0, locality=0.0)
    adjacent = [_tv(work.popularity(t), work.popularity(t + 1)) for t in range(30)]
    assert max(adjacent) < 0.05  # neighbouring iterations look alike
    assert _tv(work.popularity(0), work.popularity(200)) > 3 * max(adjacent)  # but it moves
    again = SkewedRouting(16, exponent=1.2, drift=0.05, reversion=0.0, locality=0.0)
    assert torch.equal(again.popularity(30), work.popularity(30))
    still = SkewedRouting(16, drift=0.0, locality=0.0)
    assert torch.equal(still.popularity(0), still.popularity(50))
    tilted = SkewedRouting(16, locality=0.5)
    assert _tv(tilted.popularity(4, source=0), tilted.popularity(4, source=1)) > 0.01
    with pytest.raises(ConfigError):
        SkewedRouting(4, exponent=-1.0)


def test_sampled_assignments_follow_popularity_and_the_router_takes_them():
    popularity = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64)
    chosen = sample_assignments(popularity, 4000, 2, torch.Generator().manual_seed(0))
    assert chosen.shape == (4000, 2) and bool((chosen[:, 0] != chosen[:, 1]).all())
    share = torch.bincount(chosen[:, 0], minlength=4).double() / 4000
    assert abs(float(share[0]) - 0.7) < 0.05
    router = ForcedRouter(8, 4, top_k=2, capacity_factor=1.0)
    router.choices = chosen
    routing = router(torch.randn(4000, 8))
    assert torch.equal(routing.expert_index, chosen)
    assert torch.allclose(routing.gate_weight.sum(dim=1), torch.ones(4000))
    assert int(routing.tokens_per_expert[0]) == int((chosen == 0).sum())
    assert int(routing.keep.sum()) == int(router.last_kept.sum()) < 8000  # expert 0 overflows


def test_recorded_routing_has_one_count_row_per_step_and_layer():
    recorded = record_routing("moe-tiny", steps=2, global_batch=2, seq_len=16)
    assert recorded.counts.shape == (2, 1, 4)  # moe-tiny: 1 MoE layer of 4 experts
    assert recorded.top_k == 2
    assert bool((recorded.counts.sum(dim=-1) == 2 * 16 * 2).all())  # tokens · top_k
    p = recorded.popularity(5, layer=3)  # cycles over steps and layers
    assert abs(float(p.sum()) - 1) < 1e-9
    with pytest.raises(ConfigError, match="no MoE layer"):
        record_routing("tiny", steps=1)


@pytest.mark.parametrize("noisy", [False, True])
def test_expert_calibration_fits_a_positive_throughput(monkeypatch, noisy):
    """measure_expert fits forward seconds = a + n / t over three token counts; when noise makes
    the larger counts no slower (a busy machine), t must stay positive: the largest count's
    seconds per token, with a = 0 (a negative t once failed the whole `moe` benchmark)."""
    tokens, latency, per_token = 128, 1e-4, 1e-5
    sizes = [tokens // 16, tokens // 4, tokens]
    forward = [3e-3, 2e-3, 1e-3] if noisy else [latency + n * per_token for n in sizes]
    seconds = iter([*forward, *(3 * f for f in forward), forward[-1] / 2])  # then both, together
    monkeypatch.setattr(moe_calibrate, "sample", lambda fn, group, **_: [next(seconds)])
    cal = moe_calibrate.measure_expert(comm.Group("ep", None, 2, 0), tokens, 8, 16)
    assert cal["expert_sizes"] == sizes and cal["expert_forward_alone_s"] == forward
    if noisy:
        assert cal["expert_latency_s"] == 0.0
        assert cal["expert_tokens_per_s"] == pytest.approx(tokens / forward[-1])
    else:
        assert cal["expert_latency_s"] == pytest.approx(latency)
        assert cal["expert_tokens_per_s"] == pytest.approx(1 / per_token)
    assert cal["backward_ratio"] == pytest.approx(2.0) and cal["cores"] == pytest.approx(2.0)


def test_moe_options_are_checked():
    bench = get_benchmark("moe")
    for bad in (["strategies=none,magic"], ["top_k=3"], ["tokens=0"], ["recorded_model=tiny"]):
        with pytest.raises(ConfigError):
            bench.check(parse_options(bench, bad))


def test_moe_benchmark_loopback_smoke(tmp_path):
    options = [
        "tokens=128",
        "d_model=32",
        "ffn=64",
        "experts=4",
        "layers=1",
        "steps=2",
        "warmup=1",
        "layer_samples=1",
        "top_k=1",
        "exponent=2.0",
        "recorded_model=moe-tiny",
        "recorded_steps=2",
        "recorded_batch=2",
    ]
    doc = run_benchmark("moe", 2, "loopback", tmp_path, options, command="interlace bench moe t")
    saved = json.loads((tmp_path / "moe.json").read_text())
    result = saved["result"]
    assert set(result["workloads"]) == {"skewed", "recorded"}
    assert result["calibration"]["bandwidth_Bps"] > 0
    assert 0 <= result["calibration"]["hidden_share"] <= 1
    assert result["calibration"]["overlap_sync_s"] > 0
    assert result["model_error"]["count"] == 8
    peer = moe_deepspeed.unavailable() is None
    assert ("ran" if peer else "skipped") in result["peers"]["deepspeed_moe"]
    recorded = result["workloads"]["recorded"]["workload"]
    assert len(recorded["counts"]) == 2 and recorded["experts"] == 4
    skewed = result["workloads"]["skewed"]["top1"]
    strategies = skewed["strategies"]
    peers = {"deepspeed_drop", "deepspeed_dropless"} if peer else set()
    assert set(strategies) == {"none", "dropless", "shadow", "prophet"} | peers
    for name, m in strategies.items():
        assert m["step_median_s"] > 0 and m["layer_s"] > 0
        assert (m["model_layer_s"] is None) == (name in peers)
        assert m["all_to_all_bytes"] > 0 and m["balance_degree"] >= 0
    if peer:  # DeepSpeed drops where interlace's capacity rule does, and is unbalanced alike
        ds = strategies["deepspeed_drop"]
        assert ds["dropped_fraction"] == pytest.approx(strategies["none"]["dropped_fraction"])
        assert strategies["deepspeed_dropless"]["dropped_fraction"] == 0
    assert strategies["none"]["dropped_fraction"] > 0  # capacity drops under skew
    for s in ("dropless", "shadow", "prophet"):
        assert strategies[s]["dropped_fraction"] == 0
    assert strategies["dropless"]["trans_bytes"] == 0
    assert strategies["dropless"]["plan_s_per_step"] == 0  # never searches
    assert strategies["prophet"]["plan_s_per_step"] > 0
    assert set(skewed["targets"]) == {
        "balance_vs_shadow",
        "speedup_vs_dropless",
        "speedup_vs_shadow",
    }
    assert "prophet balance" in get_benchmark("moe").headline(doc)
    assert (tmp_path / "moe.png").read_bytes()[:4] == b"\x89PNG"


class _LinearGate(nn.Module):
    """Stands in for DeepSpeed's TopKGate: logits = x · wgᵀ."""

    def __init__(self, d: int, experts: int):
        super().__init__()
        self.wg = nn.Linear(d, experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.wg.weight)


def test_forced_gate_logits_pick_the_workload_choices():
    d, experts = 8, 6
    gate = moe_deepspeed.ForcedGate(_LinearGate(d, experts), d, experts)
    choices = torch.multinomial(
        torch.ones(50, experts), 2, generator=torch.Generator().manual_seed(0)
    )
    gate.choices = choices
    logits = gate(torch.randn(50, d))
    top2 = logits.topk(2, dim=-1).indices
    assert torch.equal(top2, choices)
    assert torch.equal(logits.sum(-1), torch.full((50,), 30.0))  # x itself has no say
