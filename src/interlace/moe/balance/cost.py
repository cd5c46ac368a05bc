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

**Measured refinements.** The terms above are exact for the paper's setting (one link per
device, one GPU per device, expert compute the only compute). Measured on a real cluster each
term carries more; `LayerCost`'s further constants add it, and at their defaults (all zero, 2,
None, False) the model is exactly the one above:

- α (`latency`): seconds every all-to-all costs whatever it moves (a collective's start-up).
- γ (`send_share`): how much of what a device sends occupies its link's receive direction.
  An all-to-all then takes α + max_i (R_i + γ · S_i) · token_bytes / B̄ with S_i the tokens
  device i sends: γ = 0 on a full-duplex link (the paper's max_i R_i), 1 where sending and
  receiving share the link (an emulated veth link, or a host's one network stack).
- `exchange`: Trans and Agg priced as the one all-to-all that moves them (how the
  expert-parallel layer issues them), α + max_i (P · in_i + γ · P · out_i) / B̄ with in_i the
  replicas device i receives and out_i those it sends (Agg: the reverse), instead of the
  paper's even spread Σ_e (D − n_e) · P / (D · B̄).
- a (`expert_latency`): seconds per expert call, so device i's forward takes H_i / t + a ·
  (its E / D experts + the replicas it holds); with t this is the linear fit a + n / t of one
  expert's forward time over its token count n.
- ρ (`backward_ratio`): T_BEC = ρ · T_FEC (2 for matmuls; less where the forward carries
  overheads the backward does not).
- C (`cores`): compute units the D devices share (ranks on one host's cores); None = one per
  device. With C < D a device computes at full speed only while at most C devices work, so
  T_FEC is the finish time of processor sharing: with the per-device times sorted,
  w_(1) ≤ … ≤ w_(D), T_FEC = Σ_k (w_(k) − w_(k−1)) · max(1, (D − k + 1) / C), which is
  max_i w_i when C ≥ D.
- h (`hidden_share`): how much of a transfer that overlaps compute really hides under it.
  The overlap-adjusted Trans becomes max(0, T_Trans − W) + (1 − h) · min(T_Trans, W) with
  W = T_FEC + T_FNEC the compute it flies under (Agg alike with W = T_BEC + T_BNEC): h = 1
  is the paper's form (a copy engine or spare link moves it for free); h = 0 where moving
  bytes competes with the compute for the same processors or the link is busy anyway (gloo's
  TCP sends on shared CPU cores), so overlapping hides nothing.
- c (`route_time`): seconds per routed assignment for the rest of the layer on a device (the
  router, the count all-gather, sorting tokens by expert, the gate-weighted combine, forward
  and backward): T_LOC = c · max_i A_i with A_i the assignments device i routes. It does not
  depend on the placement, so it never changes a search's choice.

With them T = 4 · T_A2A + T_FEC + T_BEC + T_Trans + T_Agg + T_LOC (overlap form unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import numpy as np
import torch
from numpy.typing import ArrayLike

from interlace.moe.balance.placement import Placement, table_loads

FloatOrArray = float | np.ndarray


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
    latency, send_share, exchange, expert_latency, backward_ratio, cores, route_time,
        hidden_share: the measured refinements α, γ, Trans/Agg as an all-to-all, a, ρ, C, c
        and h (module docstring); the defaults give Pro-Prophet's model.
    """

    token_bytes: float
    expert_bytes: float
    bandwidth: float
    throughput: float
    grad_bytes: float | None = None
    fnec: float = 0.0
    bnec: float = 0.0
    overlap: bool = False
    latency: float = 0.0
    send_share: float = 0.0
    exchange: bool = False
    expert_latency: float = 0.0
    backward_ratio: float = 2.0
    cores: float | None = None
    route_time: float = 0.0
    hidden_share: float = 1.0

    def __post_init__(self) -> None:
        for name in ("token_bytes", "expert_bytes", "bandwidth", "throughput", "backward_ratio"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LayerCost.{name}={getattr(self, name)} must be > 0")
        for name in ("latency", "expert_latency", "route_time"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"LayerCost.{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.send_share <= 1:
            raise ValueError(
                f"LayerCost.send_share={self.send_share} must be in [0, 1] (0: full-duplex "
                "link, 1: sending and receiving share it)"
            )
        if not 0 <= self.hidden_share <= 1:
            raise ValueError(
                f"LayerCost.hidden_share={self.hidden_share} must be in [0, 1] (1: overlapped "
                "transfers hide entirely, 0: overlapping hides nothing)"
            )
        if self.cores is not None and not self.cores > 0:
            raise ValueError(f"LayerCost.cores={self.cores} must be > 0, or None (one per device)")


@dataclass(frozen=True)
class LayerTime:
    """Modelled seconds of one MoE layer (forward + backward); see the module docstring.

    Each term is a float for one placement, or an array [M] for a batch of M placements
    (`loads_time` on batched loads)."""

    a2a: FloatOrArray
    fec: FloatOrArray
    bec: FloatOrArray
    trans: FloatOrArray
    agg: FloatOrArray
    local: FloatOrArray = 0.0

    @property
    def total(self) -> FloatOrArray:
        """T = 4 · T_A2A + T_FEC + T_BEC + T_Trans + T_Agg + T_LOC (Trans, Agg as adjusted)."""
        return 4 * self.a2a + self.fec + self.bec + self.trans + self.agg + self.local


@dataclass(frozen=True, eq=False)
class DeviceLoads:
    """What the model reads of a count matrix under a placement, per device i: arrays
    [..., D] (a leading batch axis holds several placements at once, as the search scores its
    candidate moves).

    computed: H_i tokens computed; received: R_i tokens received from other devices;
    sent: S_i of its own tokens sent to other devices; routed: A_i assignments it routed;
    replicas_in / replicas_out: replicas it receives / sends (experts); holders [...]: devices
    holding replicated experts, owners included (Σ_e (D − n_e)); local_experts: E / D.
    """

    computed: np.ndarray
    received: np.ndarray
    sent: np.ndarray
    routed: np.ndarray
    replicas_in: np.ndarray
    replicas_out: np.ndarray
    holders: np.ndarray
    local_experts: int

    PER_PLACEMENT: ClassVar[tuple[str, ...]] = (
        "computed",
        "received",
        "sent",
        "replicas_in",
        "replicas_out",
        "holders",
    )
    """The fields that differ between placements (a batch's leading axis); the others are
    the count matrix's."""

    @classmethod
    def of(cls, counts: torch.Tensor, placement: Placement) -> DeviceLoads:
        """The loads of `placement` for counts [D, E] (tokens device s routed to expert e)."""
        table = counts.to(torch.float64).numpy()
        at_source = placement.at_source_array()
        computed, received = table_loads(table, placement, at_source)
        replicas = placement.replica_array().astype(np.float64)  # [D, E]
        per_expert = replicas.sum(axis=0)
        return cls(
            computed=computed,
            received=received,
            sent=np.where(at_source, 0.0, table).sum(axis=1),
            routed=table.sum(axis=1),
            replicas_in=replicas.sum(axis=1),
            replicas_out=np.bincount(
                placement.owner, weights=per_expert, minlength=placement.num_devices
            ),
            holders=np.asarray(per_expert.sum() + np.count_nonzero(per_expert)),
            local_experts=placement.num_experts // placement.num_devices,
        )

    def at(self, index: int) -> DeviceLoads:
        """The loads of placement `index` of a batch [M, D]."""
        return replace(self, **{name: getattr(self, name)[index] for name in self.PER_PLACEMENT})

    def spread(self) -> np.ndarray:
        """[...] the balance degree: population standard deviation of `computed`."""
        return self.computed.std(axis=-1)


def layer_time(counts: torch.Tensor, placement: Placement, cost: LayerCost) -> LayerTime:
    """Model the layer for routing counts [D, E] (tokens from device s to expert e) under
    `placement`; Trans and Agg are overlap-adjusted when `cost.overlap`."""
    modelled = loads_time(DeviceLoads.of(counts, placement), cost)
    return LayerTime(*(float(getattr(modelled, f.name)) for f in fields(LayerTime)))


def loads_time(loads: DeviceLoads, cost: LayerCost) -> LayerTime:
    """Model the layer from its per-device loads [..., D] (module docstring); each term [...]."""
    a2a = exchange_time(loads.received, loads.sent, cost.token_bytes, cost)
    work = loads.computed / cost.throughput + cost.expert_latency * (
        loads.local_experts + loads.replicas_in
    )
    fec = shared_finish(work, cost.cores)
    bec = cost.backward_ratio * fec
    grad_bytes = cost.expert_bytes if cost.grad_bytes is None else cost.grad_bytes
    if cost.exchange:
        trans = exchange_time(loads.replicas_in, loads.replicas_out, cost.expert_bytes, cost)
        agg = exchange_time(loads.replicas_out, loads.replicas_in, grad_bytes, cost)
    else:
        spread = loads.holders / (loads.computed.shape[-1] * cost.bandwidth)
        trans, agg = spread * cost.expert_bytes, spread * grad_bytes
    moved = loads.holders > 0
    trans, agg = np.where(moved, trans, 0.0), np.where(moved, agg, 0.0)
    if cost.overlap:
        trans = _exposed(trans, fec + cost.fnec, cost.hidden_share)
        agg = _exposed(agg, bec + cost.bnec, cost.hidden_share)
    local = np.broadcast_to(cost.route_time * loads.routed.max(axis=-1), np.shape(fec))
    return LayerTime(a2a=a2a, fec=fec, bec=bec, trans=trans, agg=agg, local=local)


def _exposed(transfer: np.ndarray, cover: np.ndarray, hidden_share: float) -> np.ndarray:
    """Seconds of a `transfer` left exposed when it flies under `cover` seconds of compute of
    which it hides a share `hidden_share`: max(0, T − W) + (1 − h) · min(T, W)."""
    return np.maximum(0.0, transfer - cover) + (1.0 - hidden_share) * np.minimum(transfer, cover)


def exchange_time(
    received: ArrayLike, sent: ArrayLike, row_bytes: float, cost: LayerCost
) -> np.ndarray:
    """Seconds of one all-to-all in which device i receives received[..., i] and sends
    sent[..., i] rows of `row_bytes`: α + max_i (received_i + γ · sent_i) · row_bytes / B̄;
    shape [...]."""
    received, sent = np.asarray(received, dtype=np.float64), np.asarray(sent, dtype=np.float64)
    if received.shape != sent.shape:
        raise ValueError(f"received counts of shape {received.shape} but sent {sent.shape}")
    busiest = (received + cost.send_share * sent).max(axis=-1)
    return cost.latency + busiest * row_bytes / cost.bandwidth


def shared_finish(work: ArrayLike, cores: float | None) -> np.ndarray:
    """When the last device finishes, each with `work` [..., D] seconds of compute alone, if
    the D devices share `cores` compute units evenly (processor sharing; None: one each):
    with w sorted, Σ_k (w_(k) − w_(k−1)) · max(1, (D − k + 1) / C); shape [...]."""
    work = np.asarray(work, dtype=np.float64)
    devices = work.shape[-1]
    if cores is None or cores >= devices:
        return work.max(axis=-1)
    ordered = np.sort(work, axis=-1)
    steps = ordered.copy()
    steps[..., 1:] -= ordered[..., :-1]
    sharing = np.maximum(1.0, (devices - np.arange(devices)) / cores)
    return (steps * sharing).sum(axis=-1)
