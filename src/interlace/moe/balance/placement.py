"""Expert placement: where each expert of an expert-parallel MoE layer is computed.

D devices hold E experts; expert e lives on its *owner* device (parameters, gradients after
aggregation, optimizer state). A placement may add *replicas*: devices that receive a copy of
e's parameters for one iteration and compute e on the tokens they routed to e themselves,
instead of sending those tokens to the owner. The owner always computes its own tokens.

Given the routing count matrix C [D, E] (C[s, e] = tokens device s routed to expert e), a
placement fixes per device i
    H_i = tokens device i computes        (its own tokens of experts it owns or replicates,
                                           plus every token other devices send it)
    R_i = tokens device i receives from other devices
which the performance model (`cost`) and the balance metric below read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Placement:
    """Owner and replica devices of each of E experts over `num_devices` devices.

    owner: [E] device owning each expert.
    replicas: [E] sorted devices (owner excluded) computing that expert locally; () if none.
    """

    num_devices: int
    owner: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...]

    @classmethod
    def blocked(cls, num_experts: int, num_devices: int) -> Placement:
        """No replicas; expert e owned by device e // (E / D) (consecutive blocks)."""
        if num_experts % num_devices:
            raise ValueError(
                f"{num_experts} experts cannot be split evenly over {num_devices} devices; "
                f"use a number of experts divisible by {num_devices}"
            )
        per_device = num_experts // num_devices
        owner = tuple(e // per_device for e in range(num_experts))
        return cls(num_devices, owner, ((),) * num_experts)

    @property
    def num_experts(self) -> int:
        """E, the number of experts."""
        return len(self.owner)

    @property
    def replicated(self) -> tuple[int, ...]:
        """Experts that have at least one replica, ascending."""
        return tuple(e for e, devices in enumerate(self.replicas) if devices)

    def without_replicas(self) -> Placement:
        """The same owners, no replicas."""
        return Placement(self.num_devices, self.owner, ((),) * self.num_experts)

    def with_replicas(self, expert: int, devices: Iterable[int]) -> Placement:
        """A copy in which `expert` is replicated on `devices` (its owner is dropped from them;
        NumPy integers become Python ints, so that a placement always reads as plain data)."""
        chosen = tuple(sorted({int(d) for d in devices} - {self.owner[expert]}))
        replicas = list(self.replicas)
        replicas[expert] = chosen
        return Placement(self.num_devices, self.owner, tuple(replicas))

    def replica_mask(self) -> torch.Tensor:
        """[D, E] bool: device s holds a replica of expert e (owners excluded)."""
        return torch.from_numpy(self.replica_array())

    def computed_at_source(self) -> torch.Tensor:
        """[D, E] bool: tokens device s routes to expert e are computed on s (owner or replica)."""
        return torch.from_numpy(self.at_source_array())

    def replica_array(self) -> np.ndarray:
        """`replica_mask` as a NumPy array [D, E] (for the model's arithmetic)."""
        mask = np.zeros((self.num_devices, self.num_experts), dtype=bool)
        for e, devices in enumerate(self.replicas):
            mask[list(devices), e] = True
        return mask

    def at_source_array(self) -> np.ndarray:
        """`computed_at_source` as a NumPy array [D, E] (for the model's arithmetic)."""
        mask = self.replica_array()
        mask[list(self.owner), range(self.num_experts)] = True
        return mask


def device_loads(counts: torch.Tensor, placement: Placement) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, R): tokens each device computes and receives from others, both [D] float64, for the
    count matrix `counts` [D, E] under `placement` (see the module docstring)."""
    table = counts.to(torch.float64).numpy()
    computed, received = table_loads(table, placement, placement.at_source_array())
    return torch.from_numpy(computed), torch.from_numpy(received)


def table_loads(
    table: np.ndarray, placement: Placement, at_source: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`device_loads` on NumPy: counts `table` [D, E] (float64) and its `at_source` mask
    (`Placement.at_source_array`) → (H, R), each [D]."""
    sent = np.where(at_source, 0.0, table).sum(axis=0)  # [E] tokens reaching each owner
    received = np.bincount(placement.owner, weights=sent, minlength=placement.num_devices)
    computed = np.where(at_source, table, 0.0).sum(axis=1) + received
    return computed, received


def balance_degree(counts: torch.Tensor, placement: Placement) -> float:
    """Standard deviation (population) of tokens computed per device, H: lower is better.

    The improvement of placement b over a is balance_degree(a) / balance_degree(b).
    """
    computed, _ = device_loads(counts, placement)
    return float(computed.std(correction=0))
