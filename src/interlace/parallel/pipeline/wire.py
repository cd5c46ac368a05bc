"""What crosses a pipeline stage boundary: activations in the run's compute dtype.

Under bf16 or fp16 autocast the residual stream keeps the parameters' dtype (fp32): each block
adds its low-precision matmul outputs to an fp32 stream. A stage that sent its output as
computed would put fp32 activations on the wire, and receive fp32 gradients back. `StageWire`
casts a stage's output to the compute dtype before it leaves (`send`) and a received input back
to the stage's own dtype (`receive`). Both casts are `Tensor.to`, whose backward casts the
gradient to the source dtype, so the gradient a stage sends back travels in the compute dtype
too and arrives in the sender's fp32. Under fp32 both casts return their input unchanged.

torch.distributed.pipelining sends whatever dtype a stage module returns (the receive buffers
take the dtype of the first micro-batch's outputs) and has no option to cast at the boundary,
so the cast is part of the stage: `WiredStage` for torch's schedules, `StageWire.send` /
`receive` around the pieces in the shifted executor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from interlace.precision import DTYPES


@dataclass(frozen=True)
class StageWire:
    """The two boundaries of one stage: activations leave and enter in `dtype` (the compute
    dtype) and are used inside in `inner` (the stage's parameter dtype). The first stage
    receives token ids and the last one returns logits: neither is cast."""

    dtype: torch.dtype
    inner: torch.dtype
    first: bool
    last: bool

    @classmethod
    def of(cls, stage: nn.Module, precision: str) -> StageWire:
        """The wire of `stage` (a GPTStage or HFStage: `is_first`, `is_last`, parameters) in
        a run computing in `precision` ("bf16", "fp16", "fp32")."""
        inner = next(stage.parameters()).dtype
        return cls(DTYPES[precision], inner, stage.is_first, stage.is_last)

    def receive(self, h: torch.Tensor) -> torch.Tensor:
        """A received activation h [b, T, d] (wire dtype) in the stage's dtype; the first
        stage's token ids [b, T] unchanged."""
        return h if self.first else h.to(self.inner)

    def send(self, h: torch.Tensor) -> torch.Tensor:
        """The stage's output h [b, T, d] in the wire dtype; the last stage's logits
        unchanged."""
        return h if self.last else h.to(self.dtype)


class WiredStage(nn.Module):
    """A stage module between its two casts, as torch's PipelineStage runs it:
    forward(x [b, T] ids or [b, T, d] wire dtype) → [b, T, d] wire dtype, or logits.

    A received activation is torch's receive buffer itself, and the gradient a stage sends back
    is that buffer's: a training forward makes the buffer require grad if it does not yet.
    torch allocates the buffers when a schedule first runs and marks them then only if that
    run has a backward; torch 2.11 keeps them across later runs, so after an `eval()` that ran
    before the first `step()` every later step's input gradient would be None (torch 2.13
    reallocates them when a schedule switches between eval and step)."""

    def __init__(self, stage: nn.Module, wire: StageWire) -> None:
        super().__init__()
        self.stage, self.wire = stage, wire

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for the shapes."""
        if not self.wire.first and torch.is_grad_enabled() and x.is_leaf and not x.requires_grad:
            x.requires_grad_(True)
        return self.wire.send(self.stage(self.wire.receive(x)))
