"""The planner's expert-parallel terms under skewed expert popularity (`planner.cost_moe`),
against loads and times worked out by hand from the Zipf shares and the placement."""

import argparse
import math
from dataclasses import replace

import pytest

from interlace.errors import ConfigError, PlanError
from interlace.models.config import GPTConfig
from interlace.plan import Plan
from interlace.plan_command import add_plan_args
from interlace.planner.cli import run_planner
from interlace.planner.cost import estimate
from interlace.planner.cost_moe import zipf_popularity
from interlace.planner.hardware import local
from interlace.planner.search import explain

RATE, BW, ALPHA = 1e9, 1e8, 1e-5
D_MODEL, FFN = 32, 128
# two layers, the second an MoE layer of 2 experts, top-1; fp32 activations
MOE = GPTConfig(
    vocab_size=64, seq_len=32, d_model=D_MODEL, n_layers=2, n_heads=2, n_experts=2, top_k=1
)
ROWS = 4  # sequences per rank (global batch 8 over dp=2)
N = ROWS * MOE.seq_len  # tokens per device and micro-batch
ROW_BYTES = D_MODEL * 4
F_E = 4 * D_MODEL * FFN  # forward FLOPs of one expert on one token
EXPERT_BYTES = (2 * D_MODEL * FFN + FFN + D_MODEL) * 4  # fp32 parameters of one expert


def hw(overlap_efficiency=1.0):
    return local(RATE, BW, latency=ALPHA, devices_per_node=8, overlap_efficiency=overlap_efficiency)


def price(config=MOE, skew=0.0, balance="none", ep=2, hardware=None, batch=8):
    plan = Plan(dp=ep, ep=ep, moe_balance=balance)
    return estimate(plan, config, hardware or hw(), batch, dtype="fp32", expert_skew=skew)


def zipf2(skew):
    """Shares of the hotter and the colder of two experts."""
    w1 = 2.0**-skew
    return 1 / (1 + w1), w1 / (1 + w1)


def test_zipf_shares_dealt_round_robin_over_devices():
    # weights 1, 1/2, 1/3, 1/4 (sum 25/12); ranks 0..3 land on experts 0, 2, 1, 3
    shares = zipf_popularity(4, 2, 1.0).tolist()
    assert shares == pytest.approx([12 / 25, 4 / 25, 6 / 25, 3 / 25], rel=1e-12)
    assert zipf_popularity(8, 4, 0.0).tolist() == pytest.approx([1 / 8] * 8)


@pytest.mark.parametrize("config", [MOE, replace(MOE, dropless=True)])
def test_skew_zero_is_the_balanced_model(config):
    cost = price(config)
    capacity = 1.0 if config.dropless else config.capacity_factor
    one = ALPHA + 0.5 * N * capacity * ROW_BYTES / BW  # all_to_all over 2 ranks
    assert cost.breakdown["ep.all_to_all"] == pytest.approx(4 * one, rel=1e-12)
    # the balanced load adds no expert compute: the same as without expert parallelism
    dense = estimate(Plan(dp=2), config, hw(), 8, dtype="fp32")
    assert cost.breakdown["compute"] == pytest.approx(dense.breakdown["compute"], rel=1e-12)
    assert cost.moe["hottest_device_load"] == pytest.approx(1.0)
    assert cost.moe["replicated_experts"] == 0 and "ep.all_to_all" not in cost.hidden
    # every balancing strategy at skew 0 runs dropless and replicates nothing
    for balance in ("dropless", "shadow", "prophet"):
        other = price(config, balance=balance)
        assert other.breakdown["ep.all_to_all"] == pytest.approx(
            4 * (ALPHA + 0.5 * N * ROW_BYTES / BW), rel=1e-12
        )
        assert other.moe["replicated_experts"] == 0


def test_dropless_hottest_device_sets_the_pace():
    skew = 1.0
    p0, _ = zipf2(skew)
    # device 0 owns the hot expert: computes 2·N·p0 tokens, receives N·p0 from device 1
    cost = price(skew=skew, balance="dropless")
    a2a = ALPHA + N * p0 * ROW_BYTES / BW
    assert cost.breakdown["ep.all_to_all"] == pytest.approx(4 * a2a, rel=1e-12)
    extra = (2 * N * p0 - N) * F_E / RATE  # forward beyond the balanced N tokens
    balanced = price(balance="dropless")
    assert cost.breakdown["compute"] - balanced.breakdown["compute"] == pytest.approx(
        3 * extra, rel=1e-9
    )
    assert cost.moe["hottest_device_load"] == pytest.approx(2 * p0, rel=1e-12)


def test_capacity_caps_the_hottest_device():
    skew = 2.0
    p0, _ = zipf2(skew)  # 0.8, 0.2
    capacity = math.ceil(MOE.capacity_factor * N / 2)  # per device and expert
    kept0 = min(N * p0, capacity)
    assert kept0 == capacity < N * p0  # the hot expert overflows
    cost = price(skew=skew)
    # device 0 computes the kept tokens of the hot expert from both devices
    extra = (2 * kept0 - N) * F_E / RATE
    balanced = price()
    assert cost.breakdown["compute"] - balanced.breakdown["compute"] == pytest.approx(
        3 * extra, rel=1e-9
    )
    # the all-to-all stays priced at the capacity, as in the balanced model
    assert cost.breakdown["ep.all_to_all"] == pytest.approx(
        balanced.breakdown["ep.all_to_all"], rel=1e-12
    )
    assert cost.moe["hottest_device_load"] == pytest.approx(2 * kept0 / N, rel=1e-12)
    assert 2 * kept0 / N <= MOE.capacity_factor


@pytest.mark.parametrize("balance", ["shadow", "prophet"])
@pytest.mark.parametrize("efficiency", [1.0, 0.5])
def test_full_replication_of_two_experts_by_hand(balance, efficiency):
    # skew 2: shares 0.8 / 0.2; the expert compute (ms) dwarfs the parameters (µs on the
    # link), so both searches replicate both experts: every device computes its own N tokens
    skew = 2.0
    cost = price(skew=skew, balance=balance, hardware=hw(efficiency))
    assert cost.moe["replicated_experts"] == 2
    assert cost.moe["hottest_device_load"] == pytest.approx(1.0, rel=1e-12)
    dispatch = 4 * ALPHA  # no token crosses the link: latency only
    # Trans: 4 holders · P / (2 devices · B); Agg likewise with the gradients
    transfer = ALPHA + 4 * EXPERT_BYTES / (2 * BW)
    fec = N * F_E / RATE
    dense = estimate(Plan(dp=2), MOE, hw(), 8, dtype="fp32")
    fnec = dense.breakdown["compute"] / 3 - fec  # the block's non-MoE forward
    ideal_trans = ALPHA + max(0.0, transfer - ALPHA - fec - fnec)
    ideal_agg = ALPHA + max(0.0, transfer - ALPHA - 2 * fec - 2 * fnec)
    trans = transfer - efficiency * (transfer - ideal_trans)
    agg = transfer - efficiency * (transfer - ideal_agg)
    assert cost.breakdown["ep.all_to_all"] == pytest.approx(dispatch + trans + agg, rel=1e-12)
    assert cost.hidden["ep.all_to_all"] == pytest.approx(2 * transfer - trans - agg, rel=1e-12)
    assert cost.moe["trans"] == pytest.approx(trans) and cost.moe["agg"] == pytest.approx(agg)
    assert cost.breakdown["compute"] == pytest.approx(dense.breakdown["compute"], rel=1e-12)
    assert sum(cost.breakdown.values()) == pytest.approx(cost.step_seconds)


# 8 experts on 8 devices, top-2, every FFN an MoE layer, on a slow link
WIDE = GPTConfig(
    vocab_size=512,
    seq_len=128,
    d_model=256,
    n_layers=2,
    n_heads=4,
    n_experts=8,
    top_k=2,
    moe_every=1,
)


def wide(skew, balance):
    hardware = local(1e12, 2e9, latency=2e-5, devices_per_node=8, overlap_efficiency=0.8)
    return price(WIDE, skew, balance, ep=8, hardware=hardware, batch=64).step_seconds


def test_more_skew_is_slower_and_balancing_helps():
    dropless = [wide(s, "dropless") for s in (0.0, 0.6, 1.2, 2.0)]
    assert dropless == sorted(dropless) and dropless[0] < dropless[-1]
    for skew in (0.6, 1.2, 2.0):
        d, s, p = wide(skew, "dropless"), wide(skew, "shadow"), wide(skew, "prophet")
        assert p <= s <= d
        assert p < d


def test_explain_names_the_moe_terms():
    text = explain(price(skew=1.0, balance="prophet"))
    assert "MoE (expert skew 1" in text and "moe_balance=prophet" in text
    assert "Trans" in text and "Agg" in text and "hottest device" in text


@pytest.mark.parametrize("skew", [-0.5, math.nan, math.inf, "1"])
def test_bad_skew_is_refused(skew):
    with pytest.raises(PlanError, match="expert skew"):
        price(skew=skew)


def parse(argv):
    parser = argparse.ArgumentParser()
    add_plan_args(parser)  # includes the planner's options
    return parser.parse_args(argv)


def test_cli_prices_the_skew_and_refuses_bad_values(capsys):
    model = "layers=2,hidden=32,heads=2,vocab=64,experts=2,top_k=1,seq=32"
    argv = ["--model", model, "--hardware", "dgx-a100", "--global-batch", "8"]
    argv += ["--plan", "dp=2,ep=2,moe_balance=dropless", "--explain"]
    assert run_planner(parse([*argv, "--expert-skew", "1.2"])) == 0
    assert "MoE (expert skew 1.2, moe_balance=dropless)" in capsys.readouterr().out
    with pytest.raises(PlanError, match=r"expert skew -1\.0 is negative"):
        run_planner(parse([*argv, "--expert-skew", "-1"]))
    dense = ["--model", "tiny", "--plan", "dp=2", "--hardware", "dgx-a100"]
    with pytest.raises(ConfigError, match="has no experts"):
        run_planner(parse([*dense, "--expert-skew", "1"]))
    with pytest.raises(SystemExit):
        parse([*argv, "--expert-skew", "hot"])
