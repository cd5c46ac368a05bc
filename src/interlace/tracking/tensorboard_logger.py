"""TensorBoard event files of a run's metrics (needs the `tensorboard` package)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from interlace.tracking.scalars import scalars


class TensorBoardLogger:
    """Writes each metrics row's `scalars` at its step to event files in `folder`. On a resume
    from `resume_step`, TensorBoard hides the earlier events from beyond that step, which the
    resumed run redoes."""

    def __init__(self, folder: Path, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge_step = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(str(folder), purge_step=purge_step)

    def log(self, row: dict[str, Any]) -> None:
        """Add every number of `row` as a scalar at `row["step"]`."""
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, row["step"])

    def close(self) -> None:
        """Flush the event file and close it."""
        self.writer.close()
