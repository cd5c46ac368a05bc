"""Experiment trackers: every metrics row of a run goes, from rank 0, through one `RunLogger`
interface (`loggers.py`) to `metrics.jsonl` and, where the run asks for them, to TensorBoard
event files (`tensorboard_logger.py`) and a Weights & Biases run (`wandb_logger.py`), both
from the optional extra `interlace[track]`; `check.py` refuses a tracker whose package is
missing before anything starts."""
