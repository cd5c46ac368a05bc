"""`Parallelized`: a model split by `parallelize`, with what each applied dimension added to a
training step; the one type every dimension's step writes to."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from interlace.errors import PlanError
from interlace.loss import CrossEntropy, causal_lm_loss
from interlace.parallel.grad_norm import GradNorm, NormShare
from interlace.parallel.storage import Storage
from interlace.plan import Plan
from interlace.precision import FP32, scaled_step


class StepExecutor(Protocol):
    """What runs a training step in place of the model's own forward and backward: a pipeline's
    schedule over this rank's `stages`, the modules that hold its parameters."""

    stages: Sequence[nn.Module]

    def step(
        self, x: torch.Tensor, y: torch.Tensor, loss_scale: float | torch.Tensor, sync: bool
    ) -> torch.Tensor:
        """Forward and backward of this rank's rows x [B, T] against y [B, T]; the loss."""
        ...

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of x [B, T] against y [B, T], forward only."""
        ...

    def rebind_parameters(self) -> None:
        """Take up the parameters a later step replaced (FSDP2's sharded ones)."""
        ...


class Parallelized:
    """A model split by `parallelize`, with what the training loop needs to run it.

    `model`: this rank's part under the full model's parameter names (a pipeline rank's stages),
    for the optimizer and checkpoints. `module`: what to call (`model`, or its DDP wrapper).
    `report`: one line per split module. `layers`: the name of the model's list of blocks, if
    it has one, and `blocks` the blocks themselves (the same modules after every step).
    `storage`: how checkpoints name and place this rank's pieces (`parallel.storage.Storage`):
    a key per piece that differs between ranks of a split (`.tp1`, `.x0.y1`), and for the pieces
    that are one block of the full tensor their place in it (mesh and placements), so that they
    are stored as the full tensor any other split can read (where the parameter is not
    already a DTensor; the key otherwise).

    What the steps add to a training step, run in the order they were added: `row_cuts`, each
    taking this rank's part of a batch (tp3d's z rows, cp's tokens); `gradient_syncs`, the
    reductions after a step's last backward (the data split's, the experts' over their
    replicas); `metric_sources`, each giving entries of the step's metrics row;
    `forward_scopes`, contexts a forward that runs the blocks outside the model's own forward
    (a pipeline stage's) enters (1D tensor parallelism's deferral scope);
    `accumulation_scopes`, contexts a micro-batch that is not its step's last runs in (DDP's
    `no_sync`); `executor`, what runs the step in place of `module` (a pipeline's schedule).
    """

    def __init__(self, model: nn.Module, plan: Plan, scores: CrossEntropy) -> None:
        self.model = model
        self.precision = FP32
        self.scaler: torch.amp.GradScaler | None = None
        self.module = model
        self.plan = plan
        self.scores = scores
        self.report: list[str] = []
        self.storage = Storage()
        self.norm_shares: list[NormShare] = []
        self.executor: StepExecutor | None = None
        self.row_cuts: list[Callable[[torch.Tensor], torch.Tensor]] = []
        self.gradient_syncs: list[Callable[[], None]] = []
        self.metric_sources: list[Callable[[], dict[str, Any]]] = []
        self.forward_scopes: list[Callable[[], contextlib.AbstractContextManager]] = []
        self.accumulation_scopes: list[Callable[[], contextlib.AbstractContextManager]] = []
        self.layers: str | None = None
        self.blocks: list[nn.Module] = []
        self._grad_norm: GradNorm | None = None

    def roots(self) -> list[nn.Module]:
        """The modules that hold this rank's parameters as they run: the executor's stages (a
        pipeline's), else the model."""
        return list(self.executor.stages) if self.executor is not None else [self.model]

    # ------------------------------------------------------------------ one step
    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's part of a batch-major tensor [B, T, ...]: its rows (tp3d: its slice
        over z) and its tokens (cp: its zig-zag share of T)."""
        for cut in self.row_cuts:
            batch = cut(batch)
        return batch

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of this rank's logits against its targets [b, T]: mean cross-entropy (over
        the split vocabulary, the mean over tp3d's z) plus the model's auxiliary loss."""
        return causal_lm_loss(logits, targets, self.model, self.scores)

    def forward_backward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        loss_scale: float | torch.Tensor = 1.0,
        sync: bool = True,
    ) -> torch.Tensor:
        """Forward and backward of token ids x [B, T] against targets y [B, T] (this rank's
        data-parallel rows); gradients of `loss_scale` · loss accumulate in `.grad`. `sync` on
        the last micro-batch of a step (data parallel reduction, tied embeddings). Returns the
        loss, detached, equal on every rank of the model-parallel groups. Under fp16 the
        gradients are those of the loss times the gradient scaler's scale until
        `clip_grad_norm_` unscales them."""
        if self.scaler is not None:
            loss_scale = self.scaler.scale(torch.tensor(loss_scale, device=x.device))
        if self.executor is not None:
            step = self.executor.step(self.rows(x), self.rows(y), loss_scale=loss_scale, sync=sync)
            return step.detach()
        if not self.module.training:  # after `evaluate` (walking every module costs each step)
            self.module.train()
        with contextlib.ExitStack() as scopes:
            for scope in () if sync else self.accumulation_scopes:
                scopes.enter_context(scope())
            loss = self.loss(self.module(self.rows(x)), self.rows(y))
            (loss * loss_scale).backward()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss of x [B, T] against y [B, T], forward only (B a multiple of
        `plan.batch_rows_unit`)."""
        if self.executor is not None:
            return self.executor.evaluate(self.rows(x), self.rows(y))
        self.model.eval()
        return self.loss(self.model(self.rows(x)), self.rows(y))

    def sync_gradients(self) -> None:
        """After a step's last backward: gradients averaged over the data parallel ranks where
        backward did not (no DDP), expert gradients over their replicas (sharded ones: FSDP2
        reduced them over ep_dp, and under ep × tp they are summed over tp here)."""
        for sync in self.gradient_syncs:
            sync()

    def clip_grad_norm_(
        self, max_norm: float, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.Tensor:
        """Clip to `max_norm` by the whole model's gradient norm, counted once over every split;
        returns that norm before clipping (equal on every rank). Under fp16 `optimizer`'s
        gradients are first divided by the scaler's scale (required then). Otherwise a fused
        `optimizer` applies the clip coefficient in its next step (`GradNorm.clip_`)."""
        if self.scaler is not None:
            if optimizer is None:
                raise ValueError("fp16: clip_grad_norm_ needs the optimizer to unscale")
            self.scaler.unscale_(optimizer)
        if self._grad_norm is None:  # the split is final once a step runs
            self._grad_norm = GradNorm(self.model.parameters(), self.norm_shares)
        return self._grad_norm.clip_(max_norm, optimizer if self.scaler is None else None)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.step()`; under fp16 through the gradient scaler, which skips the step on
        every rank when any rank's gradients overflowed, and adapts its scale."""
        if self.scaler is None:
            optimizer.step()
        else:
            scaled_step(self.scaler, optimizer)

    def metrics(self) -> dict[str, Any]:
        """What the plan's dimensions log per step: the gradient compression ratio so far,
        each expert-parallel layer's balance summary."""
        row: dict[str, Any] = {}
        for source in self.metric_sources:
            row |= source()
        return row


def layer_list(result: Parallelized, what: str) -> str:
    """The name of the model's list of blocks, which `what` needs; PlanError without one."""
    if result.layers is None:
        raise PlanError(f"{what}: the model has no layer list (an nn.ModuleList of blocks)")
    return result.layers
