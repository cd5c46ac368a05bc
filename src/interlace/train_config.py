"""TrainConfig: everything about a training run that is not a parallel choice (those live in
the Plan): model preset, data, batch sizes, optimizer, schedule, evaluation, checkpoints."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

from interlace.compile import COMPILE_CHOICES
from interlace.config_args import option
from interlace.data.tokenizer import check_tokenizer
from interlace.errors import ConfigError
from interlace.finite import check_finite_fields
from interlace.memory import MEASURED_STEP
from interlace.planner.bytes import OPTIMIZER_STATES
from interlace.precision import FLOAT8_RECIPES, FP8, PRECISIONS, REDUCE_DTYPES
from interlace.profiling import profile_window
from interlace.tracking.check import check_trackers

NONFINITE_POLICIES = ("skip", "stop")


@dataclass(frozen=True)
class TrainConfig:
    """A training run's settings. Each field's help says what it means; `interlace train` offers
    every field as an option (`global_batch` → `--global-batch`) with that help."""

    model: str = option(
        "demo",
        "model preset, a .json file of GPTConfig fields (see `interlace plan --list`), or "
        "hf:PATH, a Hugging Face causal LM folder (config.json, safetensors weights optional)",
        metavar="PRESET",
        aliases=("--preset",),
    )
    data: str | None = option(
        None,
        "text file or folder of .txt/.md/.rst files; None: the Python documentation shipped "
        "with Python (pydoc_data.topics); synthetic: uniform random tokens at the preset's "
        "vocabulary size (for speed measurements; the tokenizer is not used)",
        metavar="PATH",
    )
    tokenizer: str = option(
        "byte",
        "byte: UTF-8 bytes (256 ids); bpe: a BPE trained on the data; or the path of a Hugging "
        "Face tokenizer.json or of a folder holding one (bpe and files need interlace[hf]); a "
        "prepared shard folder as data brings its own",
        metavar="NAME|PATH",
    )
    steps: int = option(400, "optimizer steps of the whole run (when resuming: the new total)")
    global_batch: int = option(32, "sequences per optimizer step over all ranks")
    micro_batch: int | None = option(
        None,
        "sequences per rank per forward pass; each step accumulates the gradients of "
        "global batch / (dp x micro batch) passes; None: global batch / dp, no accumulation",
    )
    seq_len: int | None = option(None, "tokens per sequence; None: the preset's")
    precision: str = option(
        "auto",
        "the dtype the forward computes in, by autocast over fp32 weights and optimizer states "
        "(fp16 adds a gradient scaler); auto: bf16 on CUDA, fp32 on the CPU; fp8: bf16 with the "
        "blocks' linear layers in float8, on a CUDA GPU of compute capability 8.9 or newer",
        choices=("auto", *PRECISIONS, FP8),
    )
    fp8_recipe: str = option(
        "tensorwise",
        "how precision=fp8 scales each float8 operand: tensorwise (one scale per tensor) or "
        "rowwise (one per row of the product, more accurate, slower)",
        choices=FLOAT8_RECIPES,
    )
    grad_reduce_dtype: str = option(
        "fp32",
        "dtype the data-parallel gradient all-reduce sends: fp32, or bf16 for half the bytes "
        "(the average rounded to bf16; not with grad_compression)",
        choices=REDUCE_DTYPES,
    )
    compile: str = option(
        "auto",
        "torch.compile each transformer block; auto: on for CUDA where the plan allows (not "
        "with tp_subbatches > 1 or tp3d; under ep > 1 around the expert layers), off on the CPU",
        choices=COMPILE_CHOICES,
    )
    peak_tflops: float | None = option(
        None,
        "the device's dense peak TFLOP/s in the run's precision, for MFU; None: looked up for "
        "known GPUs (H100, H200, A100, ...), MFU left out elsewhere",
        metavar="TFLOPS",
    )
    lr: float = option(2e-3, "peak learning rate")
    min_lr_ratio: float = option(
        0.1, "final learning rate as a fraction of the peak (cosine decay)"
    )
    warmup_steps: int = option(20, "steps of linear learning-rate warmup from 0")
    weight_decay: float = option(0.1, "AdamW decoupled weight decay (matrices and embeddings only)")
    optimizer_state: str = option(
        "fp32",
        "dtype of AdamW's two moments: fp32, or bf16 for half their bytes (4 per parameter "
        "instead of 8), stored with stochastic rounding; weights stay fp32",
        choices=OPTIMIZER_STATES,
    )
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0 = off)")
    on_nonfinite: str = option(
        "skip",
        "a step whose loss or gradient norm is NaN or infinite changes no weight or optimizer "
        "state; skip: go on with the next batch (up to max_nonfinite_skips such steps in a "
        "row), stop: stop the run (exit code 4)",
        choices=NONFINITE_POLICIES,
    )
    max_nonfinite_skips: int = option(
        3, "with on_nonfinite=skip: non-finite steps in a row to skip before stopping the run"
    )
    eval_every: int = option(50, "held-out evaluation every N steps and at the end (0 = never)")
    eval_batches: int = option(4, "held-out batches (of global batch sequences) per evaluation")
    ckpt_every: int = option(
        0, "save a checkpoint in out/checkpoints/ every N steps (0 = only at the end)"
    )
    keep_checkpoints: int = option(2, "newest checkpoints to keep; older ones are deleted")
    seed: int = option(0, "seed of the initial weights and of the data order")
    out: str | None = option(
        "runs/latest",
        "run folder: metrics.jsonl, report.json, loss.png, checkpoints/ (None: no files)",
        metavar="DIR",
    )
    progress: bool = option(True, "show a progress bar")
    tensorboard: bool = option(
        False,
        "write every step's metrics as TensorBoard scalars into out/tensorboard/ (needs "
        "interlace[track])",
    )
    wandb: str | None = option(
        None,
        "log every step's metrics and the resolved settings to a Weights & Biases run in this "
        "project, its files in out/wandb/ (WANDB_MODE=offline: no account needed, `wandb sync` "
        "uploads it later; needs interlace[track]); None: off",
        metavar="PROJECT",
    )
    wandb_run_name: str | None = option(
        None, "with wandb: the W&B run's name; None: one W&B makes up", metavar="NAME"
    )
    measure_memory: bool = option(
        True,
        "measure each rank's memory on the run's third step (parameters, gradients, optimizer "
        "states, activations) beside the planner's estimate; on the CPU that step runs slower "
        "and is left out of the throughput means",
    )
    profile_steps: int = option(
        0,
        "record this many steps with torch.profiler into out/profile/: per rank a Chrome trace "
        "(rank<r>.json.gz, for Perfetto) and the operators that took the most time "
        "(rank<r>.txt); they follow the first step and the memory-measured one, with one step "
        "for the profiler to settle, and all of them are left out of the throughput means "
        "(0 = off)",
    )
    split_points: tuple[str, ...] = option(
        (),
        "with pp > 1: the modules that begin stages 1, 2, ..., e.g. blocks.3,blocks.6, instead "
        "of the partitioner's split",
        metavar="NAMES",
    )
    layers_per_stage: tuple[int, ...] = option(
        (),
        "with pp > 1: the layer count of every stage, e.g. 3,3,2, instead of the partitioner's "
        "split",
        metavar="COUNTS",
    )

    def validate(self) -> TrainConfig:
        """Raise ConfigError for values that cannot work (NaN and infinity included); returns
        self."""
        check_finite_fields(self, ConfigError)
        positive = ("steps", "global_batch", "eval_batches", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("micro_batch", "seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value} must be >= 1 (or unset for the default)")
        for name in (
            "max_nonfinite_skips",
            "warmup_steps",
            "eval_every",
            "ckpt_every",
            "seed",
            "weight_decay",
            "grad_clip",
            "profile_steps",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if self.profile_steps:
            if self.out is None:
                raise ConfigError("profile_steps needs a run folder (out) to write the profile to")
            settle_after = MEASURED_STEP if self.measure_memory else 0
            needed = profile_window(0, settle_after, self.profile_steps, sys.maxsize).stop
            if self.steps < needed:
                raise ConfigError(
                    f"profile_steps={self.profile_steps} needs steps >= {needed} (the first step "
                    f"{'and the memory-measured third ' if self.measure_memory else ''}come "
                    "before the profile, and one step lets the profiler settle); raise steps or "
                    "lower profile_steps"
                )
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"peak_tflops={self.peak_tflops} must be > 0 (or unset)")
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr} must be > 0, e.g. 1e-3")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        check_tokenizer(self.tokenizer)
        check_trackers(self)
        if self.split_points and self.layers_per_stage:
            raise ConfigError("give split_points or layers_per_stage, not both")
        if self.fp8_recipe != FLOAT8_RECIPES[0] and self.precision != FP8:
            raise ConfigError(
                f"fp8_recipe={self.fp8_recipe} applies to precision=fp8, and this run's precision "
                f"is {self.precision}: add --precision fp8 or drop --fp8-recipe"
            )
        return self

    def accumulation(self, dp: int) -> int:
        """Micro-batches per rank per optimizer step for `dp` data-parallel ranks."""
        per_rank, rest = divmod(self.global_batch, dp)
        if rest:
            raise ConfigError(
                f"global_batch={self.global_batch} is not divisible by dp={dp}; "
                f"use a multiple of {dp}, e.g. {dp * max(1, per_rank)}"
            )
        micro = self.micro_batch or per_rank
        if per_rank % micro:
            raise ConfigError(
                f"micro_batch={micro} does not divide the {per_rank} sequences each of the {dp} "
                f"data-parallel ranks gets (global_batch={self.global_batch}); use a divisor "
                f"of {per_rank}"
            )
        return per_rank // micro

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field."""
        return dataclasses.asdict(self)
