"""One interface for every destination of a run's metrics rows, and their fan-out."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from interlace.report import MetricsLog
from interlace.tracking.tensorboard_logger import TensorBoardLogger
from interlace.tracking.wandb_logger import WandbLogger

if TYPE_CHECKING:
    from interlace.train_config import TrainConfig

TENSORBOARD_FOLDER = "tensorboard"
"""The run folder's subfolder of TensorBoard event files."""


class RunLogger(Protocol):
    """A destination of metrics rows: `log` takes each step's row, `close` ends the run."""

    def log(self, row: dict[str, Any]) -> None:
        """Record one step's metrics row."""
        ...

    def close(self) -> None:
        """Flush and release what the logger holds."""
        ...


class RunLoggers:
    """Hands each row to every logger in `loggers`, in order; as a context manager, closes
    them all on leaving (an error included). Without loggers it records nothing (a rank other
    than 0, a run without a folder)."""

    def __init__(self, loggers: Sequence[RunLogger] = ()) -> None:
        self.loggers = list(loggers)

    def log(self, row: dict[str, Any]) -> None:
        """Record `row` with every logger."""
        for logger in self.loggers:
            logger.log(row)

    def close(self) -> None:
        """Close every logger."""
        for logger in self.loggers:
            logger.close()

    def __enter__(self) -> RunLoggers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_loggers(
    config: TrainConfig, out: Path, resume_step: int | None, settings: dict[str, Any]
) -> RunLoggers:
    """The loggers of rank 0 of a run writing into `out`, resumed from `resume_step` (None: a
    new run): `metrics.jsonl` always; event files under `<out>/tensorboard/` with
    `config.tensorboard`; a W&B run in project `config.wandb`, named `config.wandb_run_name`,
    recording the run's resolved `settings`, where `config.wandb` is set."""
    loggers: list[RunLogger] = [MetricsLog(out, resume_step)]
    if config.tensorboard:
        loggers.append(TensorBoardLogger(out / TENSORBOARD_FOLDER, resume_step))
    if config.wandb:
        loggers.append(WandbLogger(config.wandb, config.wandb_run_name, settings, out))
    return RunLoggers(loggers)
