"""Calibration of the MoE performance model's constants on the live group (`bench moe`).

Every figure is the median over samples of the slowest rank (`bench.timing`), a few tenths of
a second each:

- link: one-way all-to-alls (rank 0 sends m rows to rank 1, the rest send nothing) at three
  sizes, fitted as α + bytes / B̄ (`fit_line`); then the benchmark's even all-to-all of one
  batch, in which every device sends and receives as much, gives γ, the share of the sent
  bytes that also occupies a device's link: T = α + (1 + γ) · received / B̄.
- expert: one expert's forward on rank 0 alone (the others wait) at three token counts,
  fitted as a + n / t; forward + backward at the same counts gives ρ = backward / forward;
  the forward of one batch on every rank at once against rank 0 alone gives the compute units
  C the ranks share: C = D · alone / together (between 1 and D).
- overlap: h, the share of an overlapped Trans/Agg that really hides, measured on the layer
  itself (`moe_overlap`).

The benchmark's original constants stay beside them (`bandwidth_Bps`: received bytes / s of
the even all-to-all; `throughput_tokens_per_s`: tokens / s of the forward on every rank at
once): the placement searches use those.
"""

from __future__ import annotations

from typing import Any

import torch

from interlace import comm
from interlace.bench.timing import median, sample
from interlace.models.mlp import MLP
from interlace.moe.balance import ExpertSize, LayerCost

_QUIET = comm.CommMeter()  # calibration traffic stays out of every reported meter
_MIN_SECONDS = 0.2


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys ≈ intercept + slope · xs with intercept ≥ 0 (a
    negative intercept, which noise or a burst allowance gives, is refitted through 0)."""
    if len(xs) != len(ys) or len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError(f"fit_line needs >= 2 points with distinct x, got xs={xs}")
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx = sum(x * x for x in xs)
    sxy = sum(x * y for x, y in zip(xs, ys, strict=True))
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    intercept = (sy - slope * sx) / n
    if intercept < 0:
        return 0.0, sxy / sxx
    return intercept, slope


def _exchange_seconds(group: comm.Group, rows: list[list[int]], d_model: int) -> float:
    """Median seconds of an all-to-all in which rank i sends rows[i][j] rows to rank j."""
    me = group.rank
    send = [rows[me][j] for j in range(group.size)]
    recv = [rows[j][me] for j in range(group.size)]
    x, out = torch.randn(sum(send), d_model), torch.empty(sum(recv), d_model)
    return median(
        sample(
            lambda: comm.all_to_all(out, x, group, recv, send, meter=_QUIET),
            group,
            min_seconds=_MIN_SECONDS,
        )
    )


def measure_link(group: comm.Group, tokens: int, d_model: int) -> dict[str, Any]:
    """α (`latency_s`), B̄ (`link_Bps`, one way) and γ (`send_share`) of the group's
    all-to-all (module docstring), and the even all-to-all of `tokens` rows of fp32 d_model."""
    d = group.size
    row = d_model * 4
    even = [[0 if i == j else tokens // d for j in range(d)] for i in range(d)]
    even_s = _exchange_seconds(group, even, d_model) if d > 1 else 0.0
    received = tokens // d * (d - 1) * row
    if d == 1:
        return {"latency_s": 0.0, "link_Bps": 1e12, "send_share": 0.0, "bandwidth_Bps": 1e12}
    sizes = [max(1, tokens // 16), max(1, tokens // 4), max(1, tokens // 2)]
    one_way = []
    for m in sizes:
        rows = [[0] * d for _ in range(d)]
        rows[0][1] = m
        one_way.append(_exchange_seconds(group, rows, d_model))
    latency, per_byte = fit_line([m * row for m in sizes], one_way)
    link = 1 / per_byte if per_byte > 0 else 1e12
    share = (even_s - latency) * link / received - 1 if received else 0.0
    return {
        "latency_s": latency,
        "link_Bps": link,
        "send_share": min(1.0, max(0.0, share)),
        "one_way_rows": sizes,
        "one_way_s": one_way,
        "bandwidth_Bps": received / even_s,
        "a2a_probe_bytes": tokens * row,
        "a2a_probe_s": even_s,
    }


def measure_expert(group: comm.Group, tokens: int, d_model: int, ffn: int) -> dict[str, Any]:
    """a (`expert_latency_s`), t (`expert_tokens_per_s`, alone), ρ (`backward_ratio`) and C
    (`cores`) of one expert MLP(d_model, ffn) (module docstring), and its forward of
    `tokens` tokens on every rank at once."""
    expert = MLP(d_model, ffn)
    alone = group.rank == 0

    def timed(n: int, backward: bool, everyone: bool = False) -> float:
        x = torch.randn(n, d_model, requires_grad=backward)

        def run() -> None:
            if not (alone or everyone):
                return
            if backward:
                expert(x).sum().backward()
            else:
                with torch.no_grad():
                    expert(x)

        return median(sample(run, group, min_seconds=_MIN_SECONDS))

    sizes = [max(1, tokens // 16), max(1, tokens // 4), tokens]
    forward = [timed(n, False) for n in sizes]
    both = [timed(n, True) for n in sizes]
    together = timed(tokens, False, everyone=True)
    latency, per_token = fit_line(sizes, forward)
    if per_token <= 0:  # noise made more tokens no slower: charge the largest count per token
        latency, per_token = 0.0, forward[-1] / sizes[-1]
    ratio = sum(b - f for b, f in zip(both, forward, strict=True)) / sum(forward)
    return {
        "expert_latency_s": latency,
        "expert_tokens_per_s": 1 / per_token,
        "backward_ratio": max(ratio, 1e-3),
        "cores": min(float(group.size), max(1.0, group.size * forward[-1] / together)),
        "expert_sizes": sizes,
        "expert_forward_alone_s": forward,
        "expert_forward_backward_alone_s": both,
        "throughput_tokens_per_s": tokens / together,
        "expert_forward_s": together,
    }


def layer_cost(cal: dict[str, Any], size: ExpertSize, route_time: float = 0.0) -> LayerCost:
    """The refined performance model (every measured term, Trans/Agg as an all-to-all) for
    experts of `size` from a calibration `cal` (`measure_link` | `measure_expert` |
    `measure_overlap`; without the last, overlapped transfers hide entirely)."""
    return LayerCost(
        token_bytes=size.token_bytes,
        expert_bytes=size.expert_bytes,
        bandwidth=cal["link_Bps"],
        throughput=cal["expert_tokens_per_s"],
        latency=cal["latency_s"],
        send_share=cal["send_share"],
        exchange=True,
        expert_latency=cal["expert_latency_s"],
        backward_ratio=cal["backward_ratio"],
        cores=cal["cores"],
        route_time=route_time,
        hidden_share=cal.get("hidden_share", 1.0),
    )
