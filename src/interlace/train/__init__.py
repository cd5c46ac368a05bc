"""Training: `trainer.py` (`prepare_run`, `RunSetup`, `Trainer`, the run's identity); `python -m
interlace.train` runs `__main__.py`, one rank of `interlace train`."""

from interlace.train.trainer import RunSetup, Trainer, prepare_run, run_identity

__all__ = ["RunSetup", "Trainer", "prepare_run", "run_identity"]
