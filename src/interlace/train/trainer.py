"""The Trainer: one plain training loop for every plan, with accumulation, clipping, evaluation,
metrics, checkpoints and a run report.

The model is built identically on every rank (a `hf:PATH` model with weights on the meta
device, each rank then reading only the pieces it keeps) and handed to `parallelize`, which
splits it in its fixed order (tensor, expert, pipeline, data) and returns what differs between
plans: the forward and backward of a micro-batch, the gradient reduction after the last one,
the gradient norm and the checkpoint keys. The loop itself knows no dimension. Every rank draws
the same global batch and takes its data-parallel slice, so a run on R ranks follows the same
trajectory as one process on the whole batch.

Run as `torchrun --nproc-per-node N -m interlace.train [train options]` for many nodes
(`train/__main__.py`); the options are those of `interlace train`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from interlace import __version__, comm
from interlace.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from interlace.data import (
    TrainBatches,
    eval_batches,
    to_device,
)
from interlace.earlier_run import EARLIER_RUN_CHOICES, clear_earlier_run, refuse_earlier_run
from interlace.errors import NonFiniteError, OutputError
from interlace.memory import MEASURED_STEP, measure_step
from interlace.mesh import Mesh, data_group_name, default_device
from interlace.nonfinite import NonFiniteGuard, all_finite, finite_step, skip_if_nonfinite
from interlace.optim import build_optimizer, lr_at
from interlace.parallel.parallelize import parallelize
from interlace.parallel.pipeline.runner import PipelineRunner
from interlace.parallel.pipeline.trace import check_trace_path, trace_to_file
from interlace.planner.cost import plan_memory
from interlace.precision import Precision, reads_amp_hooks
from interlace.profiling import PROFILE_FOLDER, StepProfiler, profile_window
from interlace.report import METRICS, read_metrics, summarize, write_report
from interlace.run_folder import holds_checkpoint, remove_stale
from interlace.throughput import (
    allocator_retries,
    device_peak_tflops,
    model_flops_per_token,
    peak_memory_gib,
    retries_warning,
    synchronize,
)
from interlace.tracking.loggers import RunLoggers, open_loggers
from interlace.train.progress import postfix, progress_bar
from interlace.train.setup import (
    RunSetup,
    layout_changes,
    model_to_split,
    run_identity,
    run_layout,
    run_settings,
)


class Trainer:
    """Trains `setup`'s model under its plan on `mesh` (None = one process, no distribution).

    `trace`: a .json path; the run's second step (its only one if it has one) is recorded on
    every rank and written there as a Chrome trace, with a PNG beside it (pp > 1 only; see
    `parallel/pipeline/trace.py`).
    """

    def __init__(
        self, setup: RunSetup, mesh: Mesh | None = None, trace: str | Path | None = None
    ) -> None:
        self.setup = setup
        self.config = setup.config
        self.plan = setup.plan
        self.mesh = mesh
        self.device = mesh.device if mesh is not None else default_device()
        self.dp = mesh.group("dp") if mesh is not None else None
        # the ranks whose losses make the step's loss: dp, and cp's shares of each sequence
        self.replicas = mesh.group(data_group_name(self.plan)) if mesh is not None else None
        self.dp_size = self.dp.size if self.dp is not None else 1
        self.dp_rank = self.dp.rank if self.dp is not None else 0
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        self.accum = self.config.accumulation(self.dp_size)
        torch.manual_seed(self.config.seed)  # the same initial weights on every rank
        model, weights = model_to_split(setup, mesh, self.device)
        reduce = self.config.grad_reduce_dtype
        self.precision = Precision.of(setup.precision, self.config.fp8_recipe, reduce)
        self.parallel = parallelize(
            model,
            self.plan,
            mesh,
            split_points=self.config.split_points or None,
            layers_per_stage=self.config.layers_per_stage or None,
            precision=self.precision,
            compile=setup.compile,
            weights=weights,
        )
        self.model = self.parallel.model  # this rank's parameters, under the full model's names
        torch.manual_seed(self.config.seed + 1 + self.dp_rank)  # independent dropout per rank
        self.optimizer = build_optimizer(
            self.model,
            self.config.lr,
            self.config.weight_decay,
            state=self.config.optimizer_state,
            seed=self.config.seed,
        )
        self.batches = TrainBatches(setup.data, self.config.global_batch, self.config.seed)
        self.step = 0
        self.memory: dict[str, Any] | None = None  # measured on one step by `fit`
        self.out = Path(self.config.out) if self.config.out else None
        self.trace = check_trace_path(trace, self.plan.pp) if trace is not None else None
        self.guard = NonFiniteGuard(
            self.config.on_nonfinite,
            self.config.max_nonfinite_skips,
            scaled=self.parallel.scaler is not None,
        )
        self.flops_per_token = model_flops_per_token(setup.model_config)
        self.peak_tflops = self.config.peak_tflops or device_peak_tflops(
            self.device, self.precision.compute
        )
        self._retries_before = allocator_retries(self.device) or 0  # this run's own, in rows

    def resume(self, checkpoint: Path) -> None:
        """Continue from `checkpoint` (a checkpoint, `checkpoints/` or run folder): weights,
        optimizer, RNG and data position, under this run's plan, which may differ from the
        checkpoint's (its tensors are resharded; the data continues at the same global sample
        when the global batch is unchanged)."""
        checkpoint = resolve_checkpoint(checkpoint)
        with _output_errors(self):
            meta = load_checkpoint(
                checkpoint,
                self.model,
                self.optimizer,
                run_identity(self.setup),
                self.parallel.storage,
            )
        self.step = meta["step"]
        if self.is_main:
            for line in layout_changes(meta, run_layout(self.setup)):
                print(f"interlace: {line}", file=sys.stderr)

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, Any]:
        """One optimizer step over the global batch of `self.step`; returns its metrics. A step
        whose loss or gradient norm is not finite leaves weights and optimizer state untouched
        and its row says `skipped` (`nonfinite.py`)."""
        comm.meter.reset()
        start = time.perf_counter()
        lr = lr_at(
            self.step,
            self.config.steps,
            self.config.lr,
            self.config.warmup_steps,
            self.config.min_lr_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        micro = self.batches.micro_batches(self.step, self.dp_rank, self.dp_size, self.accum)
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro):
            x, y = to_device((x, y), self.device)
            last = i == len(micro) - 1
            loss_sum += self.parallel.forward_backward(x, y, 1 / self.accum, sync=last)
        self.parallel.sync_gradients()
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        grad_norm = self.parallel.clip_grad_norm_(max_norm, self.optimizer)
        loss_mean = self._dp_mean(loss_sum / self.accum)
        watched = torch.stack([loss_mean, grad_norm.to(loss_mean)])
        if self.parallel.scaler is None and reads_amp_hooks(self.optimizer):
            with skip_if_nonfinite(self.optimizer, watched):  # no sync before the update
                self.parallel.optimizer_step(self.optimizer)
        elif finite_step(*watched.tolist()) or self.parallel.scaler is not None:
            self.parallel.optimizer_step(self.optimizer)  # fp16's scaler skips an overflow
        self.optimizer.zero_grad(set_to_none=True)
        loss, norm = watched.tolist()  # the step's sync, the update queued
        finite = finite_step(loss, norm)
        synchronize(self.device)
        seconds = time.perf_counter() - start
        self.step += 1
        tokens = self.config.global_batch * self.setup.model_config.seq_len
        return {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": norm,
            "step_time_s": seconds,
            "tokens_per_s": tokens / seconds,
            **self._throughput(tokens / seconds),
            "comm_bytes": comm.meter.bytes_per_group(),
            **self.parallel.metrics(),
            **({} if finite else {"skipped": True}),
        }

    def _throughput(self, tokens_per_s: float) -> dict[str, float]:
        """Model TFLOP/s per device, MFU where the device's peak is known, peak device memory
        (GiB) where the device reports it."""
        tflops = self.flops_per_token * tokens_per_s / self.plan.world_size / 1e12
        row = {"model_tflops": tflops}
        if self.peak_tflops:
            row["mfu"] = tflops / self.peak_tflops
        memory = peak_memory_gib(self.device)
        if memory is not None:
            row["peak_memory_gib"] = memory
        retries = allocator_retries(self.device)
        if retries is not None:
            row["alloc_retries"] = retries - self._retries_before
        return row

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of `value` over the data-parallel ranks (and context-parallel ones, whose
        losses are each over an equal share of every sequence's tokens)."""
        if self.replicas is not None and self.replicas.size > 1:
            value = value.clone()
            comm.all_reduce(value, self.replicas)
            value /= self.replicas.size
        return value

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss over `eval_batches` batches, averaged over data-parallel ranks."""
        total, rows = torch.zeros((), device=self.device), 0
        # batches of the serial size: the evaluated windows do not depend on the rank count
        for x, y in eval_batches(
            self.setup.data,
            self.config.global_batch,
            self.config.eval_batches,
            self.dp_rank,
            self.dp_size,
        ):
            usable = len(x) - len(x) % self.plan.batch_rows_unit
            x, y = x[:usable], y[:usable]
            if not usable:
                continue
            x, y = to_device((x, y), self.device)
            loss = self.parallel.evaluate(x, y)
            total += loss * len(x)
            rows += len(x)
        return float(self._dp_mean(total / rows))

    # ------------------------------------------------------------------ the loop
    def fit(self, earlier_run: str = "refuse") -> dict[str, Any]:
        """Train to `config.steps`, evaluating, logging, checkpointing; returns the report.

        A run that did not `resume` and whose `out` holds an earlier run's files: `refuse`
        raises ConfigError (the rule `interlace train` applies before launch), `overwrite`
        removes them first, `keep` leaves the folder as it is (the caller has checked it).
        Raises OutputError (one line) if writing the run's files fails."""
        if earlier_run not in EARLIER_RUN_CHOICES:
            raise ValueError(f"earlier_run={earlier_run!r}: choose one of {EARLIER_RUN_CHOICES}")
        if self.out and self.step == 0 and earlier_run != "keep":
            if earlier_run == "refuse":
                refuse_earlier_run(self.out)
            elif self.is_main:
                clear_earlier_run(self.out)
            if dist.is_initialized():
                dist.barrier()  # no rank looks while the main one writes the new run's files
        with _output_errors(self):
            return self._fit()

    def _fit(self) -> dict[str, Any]:
        cfg = self.config
        log = RunLoggers()
        if self.out and self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            remove_stale(self.out)
            log = open_loggers(cfg, self.out, self.step or None, run_settings(self.setup))
        history: list[dict[str, Any]] = []
        started = time.perf_counter()
        traced_step = min(self.step + 1, cfg.steps - 1)  # after one warm-up step
        measured_step = min(self.step + MEASURED_STEP, cfg.steps - 1) if cfg.measure_memory else -1
        window = profile_window(
            self.step, max(measured_step, self.step), cfg.profile_steps, cfg.steps
        )
        rank = dist.get_rank() if dist.is_initialized() else 0
        profiler = StepProfiler(
            window, self.step, Path(self.out or ".") / PROFILE_FOLDER, rank, self.device
        )
        shown = self.is_main and cfg.progress
        with log, profiler, progress_bar(cfg.steps, self.step, shown) as bar:
            history = self._steps(history, bar, log, traced_step, measured_step, profiler)
        profile = profiler.report(self.plan.world_size)
        return self._finish(history, time.perf_counter() - started, profile)

    def _steps(
        self,
        history: list[dict[str, Any]],
        bar: Any,
        log: RunLoggers,
        traced_step: int,
        measured_step: int,
        profiler: StepProfiler,
    ) -> list[dict[str, Any]]:
        """The training loop of `_fit`: each step, its evaluation, log line, progress, guard
        and checkpoint; returns `history` with every step's row."""
        cfg = self.config
        warned_retries = False
        while self.step < cfg.steps:
            profiled = profiler.covers(self.step)
            with self._traced(traced_step):
                row = self._measured_step() if self.step == measured_step else self.train_step()
            profiler.step()
            if profiled:
                row["profiled"] = True
            final = self.step == cfg.steps
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or final):
                row["eval_loss"] = self.evaluate()
            history.append(row)
            log.log(row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(postfix(row), refresh=False)
            if self.is_main and row.get("alloc_retries") and not warned_retries:
                print(
                    f"interlace: {retries_warning(row['step'], row['alloc_retries'])}",
                    file=sys.stderr,
                )
                warned_retries = True
            reason = self.guard.stop_reason(row)
            if reason is not None:
                raise NonFiniteError(reason)
            due = (cfg.ckpt_every and self.step % cfg.ckpt_every == 0) or final
            if self.out and due and not row.get("skipped"):  # never from a skipped step
                self._save_if_finite()
        return history

    def _measured_step(self) -> dict[str, Any]:
        """`train_step()` with every rank's memory measured (`interlace.memory.measure_step`),
        kept in `self.memory` with the planner's estimate for the plan (collective)."""
        row, mine = measure_step(self.train_step, self.model, self.optimizer)
        row["memory_measured"] = True
        ranks = [mine]
        if dist.is_initialized():
            ranks = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(ranks, mine)
        rows = self.plan.micro_batch_rows(self.config.global_batch, self.accum)
        predicted = plan_memory(
            self.plan,
            self.setup.model_config,
            rows,
            self.precision.compute,
            self.config.optimizer_state,
        )
        self.memory = {"step": row["step"], "per_rank": ranks, "predicted": predicted}
        return row

    def _traced(self, step: int) -> contextlib.AbstractContextManager:
        """Record this step's pipeline timeline to `trace` if it is `step`."""
        if self.trace is None or self.step != step:
            return contextlib.nullcontext()
        runner = self.parallel.executor
        assert isinstance(runner, PipelineRunner), "a trace records a pipeline's schedule"
        return trace_to_file(runner, self.trace, self.optimizer)

    def save(self) -> Path:
        """Checkpoint the current step under `<out>/checkpoints/` (collective)."""
        assert self.out is not None
        meta = {
            **run_identity(self.setup),
            **run_layout(self.setup),
            "world_size": self.plan.world_size,
            "train": self.config.to_dict(),
            "interlace": __version__,
        }
        return save_checkpoint(
            self.out / "checkpoints",
            self.step,
            self.model,
            self.optimizer,
            meta,
            self.config.keep_checkpoints,
            self.parallel.storage,
        )

    def _save_if_finite(self) -> None:
        """`save()`, unless a weight is no longer finite on some rank: then the run stops
        (collective)."""
        if not all_finite(self.model.parameters(), self.device):
            raise NonFiniteError(
                f"step {self.step}: a weight is no longer finite, so no checkpoint was written; "
                "lower --lr, then continue from the last finished checkpoint with --resume"
            )
        self.save()

    def _whole_run(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every step's metrics, including those before a resume (from metrics.jsonl)."""
        if self.out and self.is_main:
            return read_metrics(self.out / METRICS)
        return history

    def _finish(
        self, history: list[dict[str, Any]], seconds: float, profile: dict[str, Any]
    ) -> dict[str, Any]:
        model_config = self.setup.model_config
        report = {
            "title": f"{self.config.model} · {self.plan} · {self.setup.corpus}",
            "plan": self.plan.to_dict(),
            "plan_str": str(self.plan),
            "model": {
                **model_config.to_dict(),
                "params": model_config.num_params(),
                **({} if self.setup.hf_config is None else {"hf": self.config.model}),
            },
            "train": self.config.to_dict(),
            "world_size": self.plan.world_size,
            "device": str(self.device),
            "precision": self.setup.precision,
            "compiled": self.setup.compile,
            "model_flops_per_token": self.flops_per_token,
            "peak_tflops": self.peak_tflops,
            "torch": torch.__version__,
            "interlace": __version__,
            "corpus": self.setup.corpus,
            "train_tokens": self.setup.data.split,
            "val_tokens": self.setup.data.num_tokens - self.setup.data.split,
            "wall_time_s": seconds,
            "parallel": self.parallel.report,
            "memory": self.memory,
            **profile,
            **summarize(self._whole_run(history)),
        }
        if self.out and self.is_main:
            report["notes"] = write_report(self.out, report)
        return report


@contextlib.contextmanager
def _output_errors(trainer: Trainer) -> Iterator[None]:
    """An OSError inside (a full disk, a folder gone read-only) as one OutputError line."""
    try:
        yield
    except OSError as exc:
        where = f": '{exc.filename}'" if exc.filename else ""
        kept = trainer.out is not None and holds_checkpoint(trainer.out)
        then = (
            "its last finished checkpoint is kept: fix the cause and continue with --resume"
            if kept
            else "no checkpoint was finished yet: fix the cause and start again with --overwrite"
        )
        raise OutputError(
            f"the run stopped at step {trainer.step}: {exc.strerror or exc}{where}; {then}"
        ) from exc
