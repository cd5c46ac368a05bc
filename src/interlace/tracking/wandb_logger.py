"""A Weights & Biases run of a run's metrics (needs the `wandb` package)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from interlace.tracking.scalars import scalars


class WandbLogger:
    """Starts a W&B run in `project` named `name` (None: W&B picks one) recording `config`, its
    local files under `<folder>/wandb/`, and logs each metrics row's `scalars` at its step.
    `WANDB_MODE=offline` keeps it on disk, without an account (`wandb sync` uploads it)."""

    def __init__(self, project: str, name: str | None, config: dict[str, Any], folder: Path):
        import wandb

        self.run = wandb.init(project=project, name=name, config=config, dir=str(folder))

    def log(self, row: dict[str, Any]) -> None:
        """Log every number of `row` at `row["step"]`."""
        self.run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        """Finish the W&B run."""
        self.run.finish()
