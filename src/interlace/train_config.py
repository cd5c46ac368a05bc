"""TrainConfig: everything about a training run that is not a parallel choice (those live in
the Plan): model preset, data, batch sizes, optimizer, schedule, evaluation, checkpoints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from interlace.errors import ConfigError


@dataclass(frozen=True)
class TrainConfig:
    """A training run's settings.

    global_batch: sequences per optimizer step over all data-parallel ranks.
    micro_batch: sequences per rank per forward pass (None = global_batch / dp, no
        accumulation); gradient accumulation = global_batch / (dp · micro_batch).
    seq_len: tokens per sequence (None = the preset's).
    ckpt_every: save a checkpoint every N steps (0 = only at the end); checkpoints go to
        `out/checkpoints/`.
    split_points / layers_per_stage (pp > 1): override the partitioner's split — the module
        names that begin stages 1, 2, … ("blocks.4"), or the layer count of every stage.
    """

    model: str = "demo"
    data: str | None = None
    tokenizer: str = "byte"
    steps: int = 400
    global_batch: int = 32
    micro_batch: int | None = None
    seq_len: int | None = None
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    ckpt_every: int = 0
    keep_checkpoints: int = 2
    seed: int = 0
    out: str | None = "runs/latest"
    progress: bool = True
    split_points: tuple[str, ...] = ()
    layers_per_stage: tuple[int, ...] = ()

    def validate(self) -> TrainConfig:
        """Raise ConfigError for values that cannot work; returns self."""
        positive = ("steps", "global_batch", "eval_batches", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("micro_batch", "seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value} must be >= 1 (or unset for the default)")
        for name in (
            "warmup_steps",
            "eval_every",
            "ckpt_every",
            "seed",
            "weight_decay",
            "grad_clip",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr} must be > 0, e.g. 1e-3")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        if self.split_points and self.layers_per_stage:
            raise ConfigError("give split_points or layers_per_stage, not both")
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
