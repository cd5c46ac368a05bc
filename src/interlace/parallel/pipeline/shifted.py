"""Merak's shifted critical-path schedule: 1F1B whose recomputation leaves the critical path.

Under 1F1B with activation checkpointing, a stage's backward of micro-batch i waits for the
gradient from the next stage and only then replays the checkpointed forward: the replay sits on
the critical path. This executor splits each backward into

    R(i): replay the checkpointed prefix of the stage (its first layers) from the saved input
    B(i): receive the output gradient, backward through the rest, then through the replay

and always runs R(i) *before* blocking on the receive, so the replay fills time the stage
would otherwise spend waiting (the cool-down bubbles above all). The last stage runs each
backward right after its forward and needs no checkpointing (stage-aware recomputation gives
it ratio 0). With M ≥ 4 micro-batches, stage P − 2 runs its third forward in its first
backward slot (one more warm-up forward: it would otherwise wait for the last stage's
forward + backward of micro-batch 0), so the start times behind it shift earlier; stage
P − 3's first backward is then pre-recomputed by the rule above.

Order of stage s (P stages, M micro-batches): w = min(M, P − 1 − s) forwards (+1 for
s = P − 2 when M ≥ 4), then alternately one forward and one backward, then the remaining
backwards. Every receive's matching send is issued earlier in its sender's order, so the
pipeline cannot deadlock.

Written by hand because torch.distributed.pipelining has no recompute action that a schedule
can place before the gradient receive (its stages recompute inside autograd's backward). The
point-to-point activations and gradients use `torch.distributed.isend/recv` on the "pp"
group directly: interlace's comm meter counts collectives only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from interlace.comm import Group
from interlace.parallel.pipeline.hf_stage import HFStage
from interlace.parallel.pipeline.stage import GPTStage
from interlace.parallel.pipeline.wire import StageWire
from interlace.parallel.replay import ReductionReplay
from interlace.precision import autocast


def shifted_order(stage: int, pp: int, micro_batches: int) -> list[tuple[str, int]]:
    """The ("F" | "B", micro-batch) actions of `stage` in execution order (module docstring)."""
    warmup = min(micro_batches, pp - 1 - stage)
    if stage == pp - 2 and micro_batches >= 4:
        warmup = min(micro_batches, warmup + 1)
    order = [("F", i) for i in range(warmup)]
    forwards = warmup
    for backward in range(micro_batches):
        if forwards < micro_batches:
            order.append(("F", forwards))
            forwards += 1
        order.append(("B", backward))
    return order


@dataclass
class _InFlight:
    """What a forward keeps for its backward."""

    inputs: torch.Tensor  # the stage input (requires grad unless token ids)
    output: torch.Tensor  # suffix output, or the scaled loss on the last stage
    boundary: torch.Tensor | None  # detached prefix output feeding the suffix (None: no prefix)
    rng: tuple[torch.Tensor, torch.Tensor | None] | None  # RNG state at the prefix's start
    replay: ReductionReplay | None  # the prefix's tensor parallel reductions, for its replay


class ShiftedSchedule:
    """Runs one stage (`GPTStage` or `HFStage`) per rank under the shifted critical-path order.

    `stage`'s checkpointed blocks (its first ones) form the recomputed prefix, with the
    embedding on the first stage; under `recompute_mode` "selective" there is none: those
    blocks run under torch's checkpoint (`run_piece`), which keeps their matmul outputs and
    replays the rest inside the backward, where it is cheap (elementwise work only). Prefix
    and suffix run as calls of the stage module (`run_span`), so its hooks run for each (FSDP2
    gathers a sharded stage's parameters there). Each step's first activation crossing a
    boundary is preceded by its shape [b, T, d] (the splits' own: d/x under 3D tensor
    parallelism, T/y with its sequence parallelism), so the receiver sizes its buffers from it.
    `loss_fn(logits, targets)` returns the micro-batch's loss as it should be differentiated
    (already divided by M). `trace` lists the last step's actions
    ("F" | "R" | "recv_grad" | "B", micro-batch) in the order they ran. `on_compute`, when set,
    is called as on_compute(kind "F" | "R" | "B", micro-batch, start, end) with
    `time.perf_counter` seconds around each action's computation (receives excluded); the
    step timeline recorder (`trace.py`) sets it. Forwards and their replays run under
    `precision`'s autocast (it calls the stage's pieces, not the stage), and activations and
    their gradients cross the boundaries in its dtype (`wire.StageWire`).
    """

    def __init__(
        self,
        stage: GPTStage | HFStage,
        index: int,
        group: Group,
        micro_batches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        precision: str = "fp32",
    ) -> None:
        self.stage, self.index, self.group = stage, index, group
        self.precision = precision
        self.pp, self.micro_batches = group.size, micro_batches
        self.loss_fn, self.device = loss_fn, device
        self.wire = StageWire.of(stage, precision)
        # the prefix ends with the last checkpointed block; what comes before the checkpointed
        # blocks (the receive cast, the embedding on the first stage) is replayed with them.
        # Under selective there is none: torch's checkpoint keeps the matmul outputs.
        n = max((i + 1 for i, (_, ck) in enumerate(stage.pieces()) if ck), default=0)
        n = 0 if stage.recompute_mode == "selective" else n
        # every part runs as a call of the stage module, whose hooks (FSDP2's) then run
        self.prefix = [self.wire.receive, lambda h: stage(h, 0, n, checkpoint=False)] if n else []
        self.suffix = [*([] if n else [self.wire.receive]), lambda h: stage(h, n), self.wire.send]
        self.trace: list[tuple[str, int]] = []
        self.on_compute: Callable[[str, int, float, float], None] | None = None
        self._shape: tuple[int, ...] = ()  # [b, T, d] of this step's activations as they cross
        self._shape_sent = False
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, backward: bool = True) -> None:
        """Run every micro-batch of x, y [B, T] (every rank passes the same batch) forward,
        and backward unless `backward` is False; gradients accumulate in the stage."""
        self.trace = []
        xs, ys = x.chunk(self.micro_batches), y.chunk(self.micro_batches)
        self._shape = ()  # comes with the step's first activation
        self._shape_sent = False
        kept: dict[int, _InFlight] = {}
        if backward:
            order = shifted_order(self.index, self.pp, self.micro_batches)
        else:
            order = [("F", i) for i in range(self.micro_batches)]
        for action, i in order:
            if action == "F":
                kept[i] = self._forward(xs[i], ys[i], i, keep_graph=backward)
            else:
                self._backward(kept.pop(i), i)
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    # ------------------------------------------------------------------ actions
    def _forward(self, x: torch.Tensor, y: torch.Tensor, i: int, keep_graph: bool) -> _InFlight:
        self.trace.append(("F", i))
        if self.stage.is_first:
            inputs = x.to(self.device)
        else:
            if not self._shape:  # the step's first activation: its shape first
                shape = torch.empty(3, dtype=torch.long, device=self.device)
                dist.recv(shape, group=self.group.pg, group_src=self.group.rank - 1)
                self._shape = tuple(int(n) for n in shape.tolist())
            inputs = torch.empty(self._shape, device=self.device, dtype=self.wire.dtype)
            dist.recv(inputs, group=self.group.pg, group_src=self.group.rank - 1)
            inputs.requires_grad_(keep_graph)
        rng, boundary, replay = None, None, None
        with (
            self._timed("F", i),
            torch.set_grad_enabled(keep_graph),
            autocast(self.precision, self.device.type),
        ):
            h = inputs
            if self.prefix and keep_graph:
                rng = _rng_state(self.device)
                replay = ReductionReplay()
                with torch.no_grad(), replay.recording():
                    h = _run(self.prefix, inputs)
                boundary = h.requires_grad_()
            else:
                h = _run(self.prefix, h)
            out = _run(self.suffix, h)
            if self.stage.is_last:
                out = self.loss_fn(out, y.to(self.device))
        if not self.stage.is_last:
            if not self._shape_sent:
                shape = torch.tensor(list(out.shape), dtype=torch.long, device=self.device)
                self._send(shape, self.group.rank + 1)
                self._shape_sent = True
            self._send(out.detach(), self.group.rank + 1)
        return _InFlight(inputs, out, boundary, rng, replay)

    def _backward(self, kept: _InFlight, i: int) -> None:
        replay = None
        if kept.boundary is not None:
            self.trace.append(("R", i))
            with self._timed("R", i), torch.random.fork_rng(devices=_rng_devices(self.device)):
                _set_rng_state(kept.rng, self.device)
                assert kept.replay is not None
                with kept.replay.replaying(), autocast(self.precision, self.device.type):
                    replay = _run(self.prefix, kept.inputs)
        grad = None
        if not self.stage.is_last:
            self.trace.append(("recv_grad", i))
            grad = torch.empty_like(kept.output)
            dist.recv(grad, group=self.group.pg, group_src=self.group.rank + 1)
        self.trace.append(("B", i))
        with self._timed("B", i):
            torch.autograd.backward(kept.output, grad)
            if replay is not None:
                torch.autograd.backward(replay, kept.boundary.grad)
        if not self.stage.is_first:
            self._send(kept.inputs.grad, self.group.rank - 1)

    @contextmanager
    def _timed(self, kind: str, i: int) -> Iterator[None]:
        """Report the enclosed computation to `on_compute` (nothing when it is unset)."""
        if self.on_compute is None:
            yield
            return
        start = time.perf_counter()
        yield
        self.on_compute(kind, i, start, time.perf_counter())

    def _send(self, tensor: torch.Tensor, peer: int) -> None:
        tensor = tensor.contiguous()  # kept alive until the send completes
        work = dist.isend(tensor, group=self.group.pg, group_dst=peer)
        self._sends.append((work, tensor))


def _run(pieces: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    for piece in pieces:
        x = piece(x)
    return x


def _rng_devices(device: torch.device) -> list[torch.device]:
    return [device] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CPU (and CUDA) RNG state, so a replay draws the same dropout masks as the forward."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(
    state: tuple[torch.Tensor, torch.Tensor | None] | None, device: torch.device
) -> None:
    assert state is not None
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
