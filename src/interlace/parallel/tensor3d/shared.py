"""One gathered weight block for all the sub-batches of an overlapped layer (`tp_subbatches`
with z > 1).

Run in k sub-batches (`parallel.tensor.overlap`), each 3D linear would all-gather its block
over Z once per sub-batch in the forward and again in the backward, and reduce-scatter each
sub-batch's dW over Z: k times Z's bytes. While a layer's sub-batches run, each `Linear3D`
with z > 1 uses a `SharedBlock` instead:

- **Forward.** The first sub-batch to reach the linear gathers the block (through the weight
  prefetcher when there is one, so the gathers of a pass keep the order and count of an
  unsplit run); the others use it. It is released when the layer's forward ends.
- **Backward.** The first use in the backward (the dW and dX matmuls, or a recomputed
  forward) gathers it again; the layer's sub-batch backward passes share it; it is released
  when they end. Between the passes the block is not held, as without sub-batches.
- **Gradient.** Each sub-batch differentiates with respect to `leaf`, a stand-in of the
  block's shape that holds no data (the block itself comes from `get`); the overlapped layer
  sums their gradients and hands the sum to `gradient`: one reduce-scatter over Z per step,
  as an unsplit run's (`comm.weight_grad_over_z`, after the kv head sum of `block_grad_hook`).

Only one sub-batch computes at a time, so the cache needs no lock.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from interlace.parallel.tensor3d.comm import accumulates, weight_grad_over_z
from interlace.parallel.tensor3d.prefetch import in_backward


class SharedBlock:
    """The whole weight block [rows, cols] of `linear` (a `layers.Linear3D`: its `weight` the
    piece [rows/z, cols], its `z` group, `gather_block`, `block_grad_hook` and
    `z_grad_in_backward`) for one sub-batched call of its layer: `get` gathers it once per
    half of the pass, `leaf` is what the sub-batches differentiate for, `gradient` turns
    their summed block gradient into the weight's."""

    def __init__(self, linear: nn.Module):
        self.linear = linear
        self.param = linear.weight
        rows, cols = self.param.shape
        shape = (rows * linear.z.size, cols)
        stand_in = torch.empty((), dtype=self.param.dtype, device=self.param.device)
        self.leaf = stand_in.expand(shape).requires_grad_(self.param.requires_grad)
        self.edge = get_gradient_edge(self.param) if self.param.requires_grad else None
        self._block: torch.Tensor | None = None
        self._in_backward = False

    def get(self) -> torch.Tensor:
        """The whole block [rows, cols], gathered over Z at its first use in this half of the
        pass (forward, or backward with its recomputation)."""
        half = in_backward()
        if self._block is None or self._in_backward != half:
            self._block = self.linear.gather_block()
            self._in_backward = half
        return self._block

    def release(self) -> None:
        """Drop the gathered block (the layer's forward or backward has ended)."""
        self._block = None

    def gradient(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The sub-batches' summed block gradient `grad` [rows, cols] → the weight piece's
        gradient to return to autograd, or None when the reduce-scatter adds it to `.grad` as
        the backward pass ends (`comm.weight_grad_over_z`), or when the running backward
        does not accumulate the weight's gradient."""
        if grad is None or not accumulates(self.edge):
            return None
        linear = self.linear
        return weight_grad_over_z(
            grad, self.param, linear.z, linear.block_grad_hook, linear.z_grad_in_backward
        )
