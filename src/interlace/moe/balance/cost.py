"""Pro-Prophet's performance model of one expert-parallel MoE layer under a placement.

With H_i and R_i the tokens device i computes and receives (`placement.device_loads`), D
devices, B̄ the bandwidth per device (bytes/s), t the expert throughput of one device
(tokens/s forward), P the bytes of one expert's parameters (gradients alike):

    T_A2A   = max_i R_i · token_bytes / B̄          one all-to-all (dispatch or combine)
    T_FEC   = max_i H_i / t                         expert forward compute
    T_BEC   = 2 · T_FEC                             expert backward compute
    T_Trans = Σ_{e replicated} (D − n_e) · P / (D · B̄)    parameters to the replicas
    T_Agg   = Σ_{e replicated} (D − n_e) · P_grad / (D · B̄)  gradients back to the owner

where D − n_e counts the devices holding expert e (owner and replicas; n_e devices excluded).
With one exclusion count n for all s replicated experts this is Pro-Prophet's
T_Trans = s · (D − n) · P / (D · B̄). The layer takes

    T = 4 · T_A2A + T_FEC + T_BEC + T_Trans + T_Agg

(dispatch and combine, forward and backward). When a scheduler hides Trans under the expert
and following non-MoE forward compute (T_FNEC) and Agg under their backward (T_BNEC), the
overlap-adjusted terms are max(0, T_Trans − T_FEC − T_FNEC) and max(0, T_Agg − T_BEC − T_BNEC).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from interlace.moe.balance.placement import Placement, device_loads


@dataclass(frozen=True)
class LayerCost:
    """The constants of the performance model for one MoE layer on one kind of device.

    token_bytes: bytes of one token's activation row (d_model · element size).
    expert_bytes: bytes of one expert's parameters (P); grad_bytes: of its gradients
        (None = expert_bytes).
    bandwidth: B̄, bytes/s a device sends or receives.
    throughput: t, tokens/s one device pushes through an expert's forward.
    fnec, bnec: seconds of the following non-MoE layer's forward / backward compute.
    overlap: use the overlap-adjusted Trans and Agg terms.
    """

    token_bytes: float
    expert_bytes: float
    bandwidth: float
    throughput: float
    grad_bytes: float | None = None
    fnec: float = 0.0
    bnec: float = 0.0
    overlap: bool = False

    def __post_init__(self) -> None:
        for name in ("token_bytes", "expert_bytes", "bandwidth", "throughput"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LayerCost.{name}={getattr(self, name)} must be > 0")


@dataclass(frozen=True)
class LayerTime:
    """Modelled seconds of one MoE layer (forward + backward); see the module docstring."""

    a2a: float
    fec: float
    bec: float
    trans: float
    agg: float

    @property
    def total(self) -> float:
        """T = 4 · T_A2A + T_FEC + T_BEC + T_Trans + T_Agg (the last two as adjusted)."""
        return 4 * self.a2a + self.fec + self.bec + self.trans + self.agg


def layer_time(counts: torch.Tensor, placement: Placement, cost: LayerCost) -> LayerTime:
    """Model the layer for routing counts [D, E] (tokens from device s to expert e) under
    `placement`; Trans and Agg are overlap-adjusted when `cost.overlap`."""
    computed, received = device_loads(counts, placement)
    holders = sum(1 + len(placement.replicas[e]) for e in placement.replicated)
    return loads_time(
        float(computed.max()), float(received.max()), holders, placement.num_devices, cost
    )


def loads_time(
    max_computed: float, max_received: float, holders: int, num_devices: int, cost: LayerCost
) -> LayerTime:
    """Model the layer from max_i H_i, max_i R_i and the number of devices holding replicated
    experts (owners included, Σ_e (D − n_e)) on `num_devices` devices."""
    a2a = max_received * cost.token_bytes / cost.bandwidth
    fec = max_computed / cost.throughput
    bec = 2 * fec
    trans = holders * cost.expert_bytes / (num_devices * cost.bandwidth)
    grad_bytes = cost.expert_bytes if cost.grad_bytes is None else cost.grad_bytes
    agg = holders * grad_bytes / (num_devices * cost.bandwidth)
    if cost.overlap:
        trans = max(0.0, trans - fec - cost.fnec)
        agg = max(0.0, agg - bec - cost.bnec)
    return LayerTime(a2a=a2a, fec=fec, bec=bec, trans=trans, agg=agg)
