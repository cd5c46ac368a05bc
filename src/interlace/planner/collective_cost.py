"""The time of one collective on a hardware description, which groups stay inside a node, and
`CommTerms`, what one parallel dimension's collectives add to a micro-batch: the ring
algorithm's α·steps + wire bytes / bandwidth that every cost module of the planner
(`cost_tensor`, `cost3d`, `cost_context`, `cost_moe`, `cost_pipeline`, `cost_data`) prices
its collectives with."""

from __future__ import annotations

from dataclasses import dataclass, field

from interlace.comm import wire_bytes
from interlace.planner.hardware import Hardware


@dataclass(frozen=True)
class CommTerms:
    """One parallel dimension's collectives per micro-batch on a stage: seconds on the critical
    path (`exposed`) and hidden under compute (`hidden`) per comm-meter term, and the calls
    issued in the forward (`forward_calls`) out of all (`calls`), which places them on a
    timeline. A dimension that does not count calls gives the forward's share of its exposed
    seconds as `forward_calls` with `calls` = 1. Empty: the dimension is not used."""

    exposed: dict[str, float] = field(default_factory=dict)
    hidden: dict[str, float] = field(default_factory=dict)
    forward_calls: float = 0
    calls: float = 0


def ring_steps(op: str, group_size: int) -> int:
    """Messages one rank sends, in sequence, for `op` under the ring algorithm (`ring_pass`,
    one send to the next rank, is a single one)."""
    if group_size <= 1:
        return 0
    if op == "ring_pass":
        return 1
    return 2 * (group_size - 1) if op == "all_reduce" else group_size - 1


def collective_seconds(
    op: str, payload: float, group_size: int, inside_node: bool, hardware: Hardware
) -> float:
    """Seconds of one `op` on `payload` bytes (the tensor handed to the collective, as the comm
    meter counts it) over `group_size` ranks: α·ring_steps + wire_bytes / bandwidth, on the
    intra-node link when `inside_node`, else the inter-node one. 0 for a group of one."""
    if group_size <= 1:
        return 0.0
    alpha, bandwidth = hardware.link(inside_node)
    return alpha * ring_steps(op, group_size) + wire_bytes(op, payload, group_size) / bandwidth


def exposed_after_overlap(total: float, ideal_exposed: float, hardware: Hardware) -> float:
    """Seconds of a collective's `total` left on the critical path where a perfect overlap would
    leave `ideal_exposed`: only `hardware.overlap_efficiency` of the hideable part hides."""
    return total - hardware.overlap_efficiency * (total - ideal_exposed)


def group_inside_node(size: int, stride: int, devices_per_node: int) -> bool:
    """True when a group of `size` ranks `stride` apart (in rank order) fits in one node."""
    return size <= 1 or size * stride <= devices_per_node
