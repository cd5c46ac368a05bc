"""Prefetch of 3D tensor parallel weights (AxoNN): the Z all-gather of the next layer's weight is
issued asynchronously while the current layer computes.

A `Linear3D` holds only its Z piece of a weight block and all-gathers the block over Z each
time it is used: once in forward and once more in backward (`comm.linear3d`). Which
layer gathers next is fixed by the model, identical on every rank and the same every step, so a
`WeightPrefetcher` shared by a model's 3D linears learns it and gathers one layer ahead:

- **Passes.** A pass starts at the model's forward (a forward pre-hook on the model) and runs
  through its backward. Every gather of the pass is numbered; gathers inside the autograd
  engine (backward, and the forward of a layer recomputed under activation checkpointing) are
  marked as backward, the others as forward.
- **Recording.** The first pass gathers synchronously and is recorded: the sequence of (layer,
  backward?) of its gathers. A later pass whose sequence turns out not to be a prefix of the
  record (another model path) replaces it at the start of the next pass; a prefix (an
  evaluation forward without backward) keeps it.
- **Prefetch.** When gather k of a pass is consumed and matches the record, the all-gather of
  record k+1 is issued asynchronously (`comm.all_gather(..., async_op=True)`, so the comm meter
  counts it), if it belongs to the same half of the pass (forward or backward): the next layer
  in forward order while a layer's forward computes, the previous one (in the engine's backward
  order) while its backward computes. Gather k+1 then waits on that work instead of
  communicating. No prefetch crosses from forward into backward, so an evaluation forward
  leaves nothing unused.
- **Under FSDP2** (`dp_shard > 1`) a layer's piece is a DTensor shard over dp_shard until
  FSDP2 gathers its block (in the block's pre-forward or pre-backward): the next layer's
  gather is issued ahead only if its block is gathered already, within a block therefore, and
  the first linear of each block (forward) and the last (backward) gather on the spot.
- **Bytes.** Each gather is served by exactly one all-gather of the same block, issued ahead or
  on the spot, so the bytes and the number of all-gathers per step are unchanged. Only a pass
  that leaves the record (not the steady state) drops its pending prefetch, a wasted gather.
- **Freshness.** Weights change only between passes (the optimizer step), and a pending
  prefetch never outlives its pass: the next pass's start waits for it and drops it.

Collectives are issued in the same order on every rank, because every rank runs the same
sequence and the same record. With z = 1 nothing is gathered and no prefetcher is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from interlace.comm import Group
from interlace.parallel.tensor3d.comm import gather_weight, start_gather


@dataclass(frozen=True)
class _Gather:
    """One gather of a pass: whose weight, and whether inside the autograd engine."""

    layer: nn.Module  # compared by identity (nn.Module's equality)
    backward: bool


@dataclass(frozen=True)
class _Prefetch:
    """An all-gather in flight for gather `index` of the pass."""

    index: int
    block: torch.Tensor
    work: dist.Work


def in_backward() -> bool:
    """True while the autograd engine runs (backward, or a checkpointed layer's recomputation).
    torch has no public query for this; its engine's current graph task id is -1 outside."""
    return torch._C._current_graph_task_id() >= 0


class WeightPrefetcher:
    """Serves the Z all-gathers of a model's 3D linears (each with a `weight` piece
    [rows/z, cols]), one layer ahead after the first pass. See the module docstring."""

    def __init__(self, z: Group):
        self.z = z
        self.record: list[_Gather] = []
        self.seen: list[_Gather] = []
        self.on_record = True
        self.pending: _Prefetch | None = None

    def start_pass(self, *_: object) -> None:
        """Start a pass (a forward pre-hook of the model): keep or replace the record by the last
        pass, and drop (after waiting for it) a prefetch the last pass left unused."""
        if self.seen != self.record[: len(self.seen)]:
            self.record = self.seen
        self.seen = []
        self.on_record = True
        self._drop_pending()

    def gather(self, layer: nn.Module) -> torch.Tensor:
        """The whole weight block [rows, cols] of `layer` (its `weight` is the piece
        [rows/z, cols]): prefetched if the record foresaw this gather, else gathered now; then
        the all-gather of the record's next gather is issued, if in the same half of the pass."""
        index, step = len(self.seen), _Gather(layer, in_backward())
        self.seen.append(step)
        self.on_record = self.on_record and self.record[index : index + 1] == [step]
        block = self._take(index)
        if block is None:
            block = gather_weight(layer.weight, self.z)
        ahead = self.record[index + 1 : index + 2]
        if self.on_record and ahead and ahead[0].backward == step.backward:
            weight = ahead[0].layer.weight
            if not isinstance(weight, DTensor):  # else still sharded by FSDP2: gathered later
                self.pending = _Prefetch(index + 1, *start_gather(weight, self.z))
        return block

    def _take(self, index: int) -> torch.Tensor | None:
        """The prefetched block of gather `index`, or None (the pending one, if any, dropped)."""
        pending = self.pending
        if pending is None or not self.on_record or pending.index != index:
            self._drop_pending()
            return None
        self.pending = None
        pending.work.wait()
        return pending.block

    def _drop_pending(self) -> None:
        if self.pending is not None:
            self.pending.work.wait()
            self.pending = None


def attach_prefetcher(model: nn.Module, layers: list[nn.Module], z: Group) -> WeightPrefetcher:
    """Serve the weight gathers of `layers` (Linear3D modules of `model`, z > 1) by one shared
    WeightPrefetcher, whose passes start at `model`'s forward."""
    prefetcher = WeightPrefetcher(z)
    for layer in layers:
        layer.prefetcher = prefetcher
    model.register_forward_pre_hook(prefetcher.start_pass)
    return prefetcher
