"""Training: `setup.py` (`prepare_run`, `RunSetup`, the run's identity), `trainer.py`
(`Trainer`); `python -m interlace.train` runs `__main__.py`, one rank of `interlace train`."""

from interlace.train.setup import RunSetup, prepare_run, run_identity
from interlace.train.trainer import Trainer

__all__ = ["RunSetup", "Trainer", "prepare_run", "run_identity"]
