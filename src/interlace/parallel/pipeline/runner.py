"""PipelineRunner: one training step of a decoder LM over the mesh's "pp" dimension.

    runner = PipelineRunner(model, plan, mesh)     # every rank passes the same full model
    loss = runner.step(x, y)                       # x, y [B, T]; grads in runner.parameters()
    clip_grad_norm_(runner.parameters(), 1.0, [runner.norm_share()])  # + tp's share under tp
    optimizer.step(); runner.zero_grad()

Construction (identical on every rank): partition the layers into pp · v stages
(`partition`; v = virtual stages per rank, 2 by default for interleaved 1F1B), choose each
stage's checkpointed layers (`recompute`), keep this rank's stages (stage i runs on pipeline
rank i mod pp), and build the schedule: torch's `PipelineStage`s under GPipe, 1F1B or
interleaved 1F1B (`schedule`), or our shifted critical-path executor (`shifted`). Activations
and their gradients travel point-to-point inside torch's schedules (or by isend/recv in the
shifted executor), in the run's compute dtype (`wire`), outside interlace's comm meter; the
tied-embedding all-reduce, the loss broadcast and the clipping all-reduce go through
`interlace.comm`.

The model is the built-in GPT (`GPTStage`, composing with 1D tensor parallelism) or a Hugging
Face decoder LM such as GPT-2 or Llama (`HFStage`, read by structure; tp = 1), under the same
schedules, recomputation and tied-embedding handling.

`step` splits the batch into `plan.micro_batches` equal micro-batches along B. The first rank
feeds x, the last computes `loss_fn(logits, y)` per micro-batch; backward accumulates each
micro-batch's loss / M into `.grad`, i.e. the gradient of the mean loss over the batch, as
one serial `loss.backward()` would. Then the tied embedding's two copies have their gradients
summed, and the mean loss is broadcast from the last pipeline rank, so every rank returns it.
A Mixture-of-Experts GPT's stages carry their layers' load-balancing losses into backward
themselves and add them to the mean loss (`aux_loss`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from interlace import comm
from interlace.errors import ConfigError, PlanError
from interlace.loss import cross_entropy
from interlace.mesh import Mesh
from interlace.models.config import GPTConfig
from interlace.models.gpt import GPT, build_model
from interlace.parallel.grad_norm import NormShare
from interlace.parallel.pipeline.hf_stage import DecoderParts, HFStage, hf_local_module
from interlace.parallel.pipeline.layout import pipeline_layout
from interlace.parallel.pipeline.partition import Partition
from interlace.parallel.pipeline.recompute import checkpointed_layers
from interlace.parallel.pipeline.schedule import build_schedule
from interlace.parallel.pipeline.shifted import ShiftedSchedule
from interlace.parallel.pipeline.stage import GPTStage, TiedEmbedding, local_module
from interlace.parallel.pipeline.wire import StageWire, WiredStage
from interlace.plan import Plan
from interlace.precision import forward_in_precision

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineRunner:
    """This rank's share of a pipeline-parallel decoder LM and the schedule that trains it.

    model: the full built-in GPT or Hugging Face decoder LM (same weights on every rank: build
    it with the same seed), or a GPTConfig to build a GPT from the current RNG state. Only
    this rank's stages are kept; drop other references to the full model to free the rest.
    loss_fn(logits [b, T, V], targets [b, T]) → mean loss of one micro-batch (default:
    `interlace.loss.cross_entropy`; under tp the vocabulary-parallel loss, which `parallelize`
    passes). Options (each overrides the default the Plan implies):
    layers_per_stage / split_points: see `partition.partition` (one entry per virtual stage);
    recompute: a list of per-rank checkpoint ratios instead of `plan.recompute`;
    memory_budget_bytes with micro_batch_tokens (b·T): derive stage-aware recomputation's
    stage-0 ratio from the budget instead of 1.0; precision: "bf16" or "fp16" runs every stage
    forward (and its recomputation) under autocast (`interlace.precision`; default fp32) and
    sends activations and their gradients between stages in that dtype (`wire`);
    forward_scopes: contexts every stage's forward runs inside (`stage.run_span`), from the
    dimensions split before (`Parallelized.forward_scopes`).
    """

    def __init__(
        self,
        model: nn.Module | GPTConfig,
        plan: Plan,
        mesh: Mesh,
        loss_fn: LossFn | None = None,
        *,
        layers_per_stage: Sequence[int] | None = None,
        split_points: Sequence[str] | None = None,
        recompute: Sequence[float] | None = None,
        memory_budget_bytes: float | None = None,
        micro_batch_tokens: int | None = None,
        precision: str = "fp32",
        forward_scopes: Sequence[Callable[[], contextlib.AbstractContextManager]] = (),
    ) -> None:
        if isinstance(model, GPTConfig):
            model = build_model(model, device=mesh.device)
        self.hf = _check_model(model, plan, mesh)  # a HF decoder's parts; None for the GPT
        self.plan, self.mesh = plan, mesh
        if plan.tensor_parallel and loss_fn is None:
            raise PlanError(
                f"plan tp={plan.tp}: the last stage gives this rank's slice of the vocabulary, "
                "which only a vocabulary-parallel loss can score; build the pipeline with "
                "interlace.parallelize(model, plan, mesh), which passes it"
            )
        self.loss_fn = loss_fn or cross_entropy
        self.pp = mesh.group("pp")
        self.device = mesh.device
        self.seq_len = model.config.seq_len if self.hf is None else self.hf.seq_len
        # the partitioner reads layer shapes; under tp (1D or 3D) or ep those of the unsplit model
        split = plan.tp_size > 1 or plan.expert_parallel
        shapes = build_model(model.config, device="meta") if split and self.hf is None else model
        self.layout = pipeline_layout(
            shapes,
            plan,
            layers_per_stage=layers_per_stage,
            split_points=split_points,
            recompute=recompute,
            memory_budget_bytes=memory_budget_bytes,
            micro_batch_tokens=micro_batch_tokens,
        )
        self.partition: Partition = self.layout.partition
        self.recompute_ratios = self.layout.rank_ratios
        n_stages = self.layout.n_stages
        self.stage_indices = self.layout.stages_of(self.pp.rank)
        embedding, head = (
            ("wte", "lm_head") if self.hf is None else (self.hf.embedding, self.hf.head)
        )
        tied = model.get_submodule(head).weight is model.get_submodule(embedding).weight
        self.stages = [self._stage(model, s, n_stages, tied) for s in self.stage_indices]
        self.precision = precision
        for stage in self.stages:
            stage.forward_scopes = tuple(forward_scopes)
            forward_in_precision(stage, precision, self.device.type)
        self.module = (local_module if self.hf is None else hf_local_module)(self.stages)
        self.holds_first = 0 in self.stage_indices
        self.holds_last = n_stages - 1 in self.stage_indices
        # the head's copy of the tied embedding is counted once, at the embedding
        self._tied_names = (embedding, head)
        self.tied = TiedEmbedding(mesh, self._tied_param()) if tied else None
        self.pipeline_stages: list[PipelineStage] = []  # torch's stages (none when shifted)
        self.schedule = self._schedule()
        # the step's loss sums every stage's load-balancing losses (known from the config alike
        # on every rank)
        self.stage_losses = self.hf is None and model.config.is_moe and model.aux_loss_coef > 0
        self._losses: list[torch.Tensor] = []
        self._loss_scale = 1.0

    def _tied_param(self) -> nn.Parameter | None:
        """This rank's copy of the tied embedding: the embedding's on the first rank, the
        head's on the last, None in between."""
        embedding, head = self._tied_names
        if self.holds_first:
            return self.module.get_submodule(embedding).weight
        return self.module.get_submodule(head).weight if self.holds_last else None

    def checkpoint_aliases(self) -> dict[str, str]:
        """{the last stage's copy of the tied embedding: the embedding}, on a rank holding the
        copy but not the embedding: checkpoints store both as the embedding, as an unsplit
        model does, so any other split reads them."""
        embedding, head = self._tied_names
        if self.tied is None or self.holds_first or not self.holds_last:
            return {}
        return {f"{head}.weight": f"{embedding}.weight"}

    def rebind_parameters(self) -> None:
        """Find the tied embedding's copy again after a later step replaced the stages'
        parameters (sharded data parallelism makes each a new DTensor parameter)."""
        if self.tied is not None:
            self.tied.param = self._tied_param()

    # ------------------------------------------------------------------ construction
    def _stage(self, model: nn.Module, index: int, n_stages: int, tied: bool) -> GPTStage | HFStage:
        start, stop = self.partition.bounds[index]
        layers = range(start, stop)
        first, last = index == 0, index == n_stages - 1
        options = {
            "first": first,
            "last": last,
            "checkpointed": checkpointed_layers(layers, self.layout.stage_ratios[index]),
            "recompute_mode": "selective" if self.plan.recompute == "selective" else "full",
            "head_copy": tied and last and not first,
        }
        if self.hf is None:
            stage = GPTStage(model, layers, **options)
        else:
            stage = HFStage(model, self.hf, layers, **options)
        on_meta = any(p.is_meta for p in stage.parameters())  # made real once split
        return stage if on_meta else stage.to(self.device)

    def _schedule(self):
        if self.plan.schedule == "shifted":
            return ShiftedSchedule(
                self.stages[0],
                self.stage_indices[0],
                self.pp,
                self.plan.micro_batches,
                self._micro_batch_loss,
                self.device,
                self.precision,
            )
        n_stages = self.layout.n_stages
        self.pipeline_stages = [
            PipelineStage(
                WiredStage(stage, StageWire.of(stage, self.precision)),
                index,
                n_stages,
                self.device,
                group=self.pp.pg,
            )
            for stage, index in zip(self.stages, self.stage_indices, strict=True)
        ]
        return build_schedule(
            self.plan.schedule,
            self.pipeline_stages,
            self.plan.micro_batches,
            self._micro_batch_loss,
        )

    # ------------------------------------------------------------------ one step
    def _micro_batch_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits, targets)
        self._losses.append(loss.detach())
        return loss * (self._loss_scale / self.plan.micro_batches)

    def step(
        self, x: torch.Tensor, y: torch.Tensor, *, loss_scale: float = 1.0, sync: bool = True
    ) -> torch.Tensor:
        """Forward and backward of token ids x [B, T] against targets y [B, T] through the
        pipeline; returns the mean loss over the batch (a 0-d tensor, on every pipeline rank).

        Gradients of `loss_scale` · mean loss *accumulate* into `.grad` of `parameters()`.
        `sync=True` then sums the tied embedding's two gradients; when accumulating over several
        calls, pass sync=False to all but the last (as DDP's no_sync). Every pipeline rank
        calls `step` with the same batch (only the first and last ranks read it).
        """
        self._check_batch(x, y)
        self._losses, self._loss_scale = [], loss_scale
        for stage in self.stages:
            stage.aux.weight = stage.aux.coef * loss_scale / self.plan.micro_batches
        self._run(x, y, backward=True)
        loss = self._broadcast_mean_loss()
        if sync and self.tied is not None:
            self.tied.sync_grads()
        return loss

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss of x [B, T] against y [B, T], forward only, on every pipeline rank."""
        self._check_batch(x, y)
        self._losses = []
        self._run(x, y, backward=False)
        return self._broadcast_mean_loss()

    def _run(self, x: torch.Tensor, y: torch.Tensor, backward: bool) -> None:
        if isinstance(self.schedule, ShiftedSchedule):
            self.schedule.step(x, y, backward=backward)
            return
        # contiguous: torch's stages compare an input's strides with the first step's
        args = (x.to(self.device).contiguous(),) if self.holds_first else ()
        target = y.to(self.device) if self.holds_last else None
        run = self.schedule.step if backward else self.schedule.eval
        run(*args, target=target, return_outputs=False)

    def _broadcast_mean_loss(self) -> torch.Tensor:
        """The step's mean loss on every pipeline rank: the last stage's cross-entropy, plus
        with MoE layers every stage's load-balancing losses (summed over "pp")."""
        m = self.plan.micro_batches
        if self.holds_last:
            # the last M calls of the loss are the micro-batches; torch's first step also calls
            # the loss once beforehand, to infer gradient shapes
            loss = torch.stack(self._losses[-m:]).mean()
        else:
            loss = torch.zeros((), device=self.device)
        self._losses = []
        if not self.stage_losses:
            comm.broadcast(loss, self.pp.size - 1, self.pp)
            return loss
        loss = loss + sum(stage.aux.take_mean(m, self.device) for stage in self.stages)
        comm.all_reduce(loss, self.pp)
        return loss

    def _check_batch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape != y.shape:
            raise ValueError(
                f"step takes token ids x and targets y of one shape [B, T]; got "
                f"{tuple(x.shape)} and {tuple(y.shape)}"
            )
        rows, length = x.shape
        m = self.plan.micro_batches
        if rows % m:
            raise PlanError(
                f"batch of {rows} rows does not split into micro_batches={m} equal "
                f"micro-batches; use a batch that is a multiple of {m}"
            )
        if length > self.seq_len:
            raise ConfigError(
                f"input has T={length} tokens but the model's seq_len={self.seq_len}; crop the "
                f"input to at most {self.seq_len} tokens"
            )

    # ------------------------------------------------------------------ parameters
    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (each once)."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the full model."""
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights under the full model's state-dict names (the tied head's copy as
        `lm_head.weight`, the embedding as `wte.weight` or e.g. `transformer.wte.weight`):
        distinct keys on distinct stages."""
        return self.module.state_dict()

    def zero_grad(self) -> None:
        """Drop every local gradient (set to None)."""
        self.module.zero_grad(set_to_none=True)

    def norm_share(self) -> NormShare:
        """The pipeline's share of the gradient norm: each stage's parameters are its rank's
        alone in "pp", but the tied embedding's two copies (first and last rank, equal after
        `step`'s sync) count once."""
        return NormShare(
            self.pp, lambda p: 2 if self.tied is not None and p is self.tied.param else 1
        )


def check_pipelined(model: nn.Module, plan: Plan) -> DecoderParts | None:
    """PlanError if the runner cannot run `model` (the whole model, before any split; the
    meta device will do) under `plan`; a HF decoder's parts (None for the built-in GPT)."""
    if not isinstance(model, GPT):
        for active, what, fix in (
            (plan.tensor_parallel, f"tensor parallelism (tp={plan.tp})", "tp=1"),
            (plan.tensor3d_parallel, "3D tensor parallelism (tp3d)", "tp3d without pp"),
            (plan.context_parallel, f"context parallelism (cp={plan.cp})", "cp=1"),
        ):
            if active:
                raise PlanError(
                    f"pipeline × {what} runs the built-in GPT only; got {type(model).__name__}: "
                    f"use {fix} for Hugging Face models"
                )
        return DecoderParts.read(model)
    return None


def _check_model(model: nn.Module, plan: Plan, mesh: Mesh) -> DecoderParts | None:
    """Refuse what the runner cannot run; return a HF decoder's parts (None for the GPT)."""
    parts = check_pipelined(model, plan)
    plan.validate(mesh.device_mesh.size())  # the supported combinations
    whole_head = model.lm_head.weight.shape[0] == model.config.vocab_size
    if plan.tensor_parallel and whole_head:  # a split head holds V/tp rows
        raise PlanError(
            f"plan tp={plan.tp} but the model is not tensor parallel; split it first with "
            "interlace.parallelize(model, plan, mesh), then build the PipelineRunner"
        )
    if plan.pp < 2:
        raise PlanError(f"PipelineRunner needs pp >= 2, got pp={plan.pp}; train the model directly")
    if mesh.size("pp") != plan.pp:
        raise PlanError(
            f"plan pp={plan.pp} but the mesh's pp group has {mesh.size('pp')} ranks; build the "
            "mesh from the same plan (build_mesh(plan))"
        )
    return parts
