"""The planner's credit for 3D tensor parallelism's weight prefetch (`Overlap.tp3d_prefetch`):
each Z all-gather but the first of a pass hides under the previous linear's compute, worked
out here by hand for a z-only grid."""

import pytest

from interlace.models.config import GPTConfig
from interlace.plan import Overlap, Plan
from interlace.planner.cost import estimate
from interlace.planner.hardware import local

D, F = 64, 256
CONFIG = GPTConfig(vocab_size=256, seq_len=64, d_model=D, n_layers=2, n_heads=4)
RATE, BW, ALPHA = 5e10, 1e8, 1e-5
Z, BATCH = 2, 8
T = BATCH * CONFIG.seq_len / Z  # tokens per rank and micro-batch
# the block's linears in execution order: q, k, v, out, up, down (n_in, n_out)
LINEARS = [(D, D), (D, D), (D, D), (D, D), (D, F), (F, D)]


def hw(efficiency):
    return local(RATE, BW, latency=ALPHA, devices_per_node=8, overlap_efficiency=efficiency)


def price(prefetch, efficiency=1.0, recompute="none"):
    plan = Plan(tp3d=(1, 1, Z), recompute=recompute, overlap=Overlap(tp3d_prefetch=prefetch))
    return estimate(plan, CONFIG, hw(efficiency), BATCH, dtype="fp32")


def gather(n_in, n_out):
    """all_gather over z = 2 of this rank's half of the fp32 weight: α + shard / bandwidth."""
    return ALPHA + n_in * n_out * 4 / Z / BW


def exposed(seconds, compute, efficiency):
    ideal = max(0.0, seconds - compute)
    return seconds - efficiency * (seconds - ideal)


def hand(efficiency):
    """Per layer: whole gathers, and the exposed forward and backward gathers."""
    whole = [gather(*lin) for lin in LINEARS]
    forward = [
        exposed(g, 2 * T * LINEARS[j - 1][0] * LINEARS[j - 1][1] / RATE, efficiency)
        for j, g in enumerate(whole)
    ]
    backward = [
        exposed(g, 4 * T * LINEARS[(j + 1) % 6][0] * LINEARS[(j + 1) % 6][1] / RATE, efficiency)
        for j, g in enumerate(whole)
    ]
    return whole, forward, backward


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_prefetch_off_prices_every_gather_exposed(recompute):
    whole, _, _ = hand(1.0)
    layers, replays = CONFIG.n_layers, CONFIG.n_layers if recompute == "full" else 0
    cost = price(False, recompute=recompute)
    expected = layers * 2 * sum(whole) + replays * sum(whole)
    assert cost.breakdown["tp_z.all_gather"] == pytest.approx(expected, rel=1e-12)
    assert "tp_z.all_gather" not in cost.hidden


@pytest.mark.parametrize("efficiency", [1.0, 0.6])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_prefetch_hides_all_but_the_first_gather_of_each_pass(efficiency, recompute):
    whole, forward, backward = hand(efficiency)
    # the chosen sizes leave some gathers partly exposed and hide others
    assert any(0 < f < g for f, g in zip(forward, whole, strict=True))
    layers = CONFIG.n_layers
    replays = layers if recompute == "full" else 0
    first_forward = whole[0] - forward[0]
    # the backward pass starts at the last layer's down, or at its recomputed q
    first_backward = first_forward if replays else whole[-1] - backward[-1]
    expected = layers * (sum(forward) + sum(backward)) + replays * sum(forward)
    expected += first_forward + first_backward
    cost = price(True, efficiency, recompute)
    assert cost.breakdown["tp_z.all_gather"] == pytest.approx(expected, rel=1e-12)
    total = (2 * layers + replays) * sum(whole)
    assert cost.hidden["tp_z.all_gather"] == pytest.approx(total - expected, rel=1e-12)
    off = price(False, efficiency, recompute)
    assert off.step_seconds - cost.step_seconds == pytest.approx(total - expected, rel=1e-9)
