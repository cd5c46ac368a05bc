"""One rule for a run folder that already holds a run, for the CLI and for `Trainer.fit`: refused
unless the run resumes or the caller asks to overwrite it, and the refusal offers only the ways
that work (no `--resume` where no checkpoint was finished)."""

from __future__ import annotations

import shutil
from pathlib import Path

from interlace.config_file import CONFIG_FILE
from interlace.errors import ConfigError
from interlace.report import LOAD_PLOT, LOSS_PLOT, METRICS, REPORT
from interlace.run_folder import holds_checkpoint
from interlace.tracking.loggers import TENSORBOARD_FOLDER

RUN_FILES = (METRICS, REPORT, LOSS_PLOT, LOAD_PLOT, TENSORBOARD_FOLDER, CONFIG_FILE, "checkpoints")
"""What a run writes into its folder, and what overwriting it removes (W&B's offline runs are
kept: they may not be synced yet)."""

EARLIER_RUN_CHOICES = ("refuse", "overwrite", "keep")
"""What `Trainer.fit` does with an earlier run in its folder."""


def refuse_earlier_run(out: Path) -> None:
    """ConfigError naming the files of an earlier run in `out`, and what to pass instead."""
    earlier = [name for name in RUN_FILES if (Path(out) / name).exists()]
    if not earlier:
        return
    ways = "--resume to continue it, " if holds_checkpoint(out) else ""
    stopped = "" if ways else " that stopped before its first checkpoint"
    raise ConfigError(
        f"--out '{out}' already holds a run{stopped} ({', '.join(earlier)}); pass "
        f"{ways}--overwrite to replace it (in Python: Trainer.fit(earlier_run='overwrite')), "
        "or another --out"
    )


def clear_earlier_run(out: Path) -> None:
    """Remove the files of an earlier run from `out` (creating `out` if missing)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
