"""The rule that scales a documented `interlace` command down to a test on a 2-core CPU
(docs/testing.md, "Documented commands"): step counts shrink by one factor per run, presets
larger than the small ones run as the small one of their kind, a train command without --out
gets a folder of its own, and only the quick `interlace bench` commands run."""

from __future__ import annotations

import math
import re

from interlace.cli import build_parser
from interlace.models.presets import PRESETS
from interlace.train_config import TrainConfig

MAX_STEPS = 4
"""The most steps a scaled run trains."""

DEFAULT_STEPS = TrainConfig().steps
"""The steps of a train command that names none."""

GLOBAL_BATCH = 8
"""The sequences per step of a scaled run that names none (the default is 32)."""

SMALL = ("demo", "moe-tiny")
"""The presets that larger ones run as: dense, then Mixture-of-Experts."""

QUICK_BENCH = ("list", "report")
"""`interlace bench` commands that run in seconds; a benchmark runs only with `--set quick=true`."""

_STEP_DIR = re.compile(r"step-(\d+)")
_TOML_STEPS = re.compile(r"^(steps|ckpt_every)(\s*=\s*)(\d+)", re.MULTILINE)


def step_factor(step_counts: list[int]) -> int:
    """The factor that divides every step count of a run: the smallest that brings the largest
    of `step_counts` to MAX_STEPS or fewer."""
    return max(1, math.ceil(max(step_counts, default=0) / MAX_STEPS))


def scaled(steps: int, factor: int) -> int:
    """A step count divided by `factor`, rounded up (so never 0)."""
    return math.ceil(steps / factor)


def train_steps(argv: list[str]) -> int | None:
    """The steps a train command (words after `interlace`) names: --steps, or the default when
    no --config or --resume supplies them; None when one does."""
    args = _train_args(argv)
    if _given(argv, "--steps"):
        return args.steps
    return DEFAULT_STEPS if args.config is None and args.resume is None else None


def toml_steps(text: str) -> list[int]:
    """The step counts (`steps`, `ckpt_every`) a TOML settings file names."""
    return [int(match[3]) for match in _TOML_STEPS.finditer(text)]


def scale_toml(text: str, factor: int) -> str:
    """A TOML settings file with its step counts divided by `factor`."""
    return _TOML_STEPS.sub(lambda m: f"{m[1]}{m[2]}{scaled(int(m[3]), factor)}", text)


def why_not_run(argv: list[str]) -> str | None:
    """Why the rule cannot run an `interlace` command (words after `interlace`); None if it can."""
    if argv[:1] != ["bench"] or argv[1:2] == ["--help"]:
        return None
    if argv[1] in QUICK_BENCH or "quick=true" in argv:
        return None
    return f"`interlace bench {argv[1]}` runs for minutes; mark its block parse-only"


def scale(argv: list[str], factor: int, line: int) -> list[str]:
    """An `interlace` command (words after `interlace`) as the test runs it: a train command
    with its step counts (--steps, --ckpt-every, step-N of a checkpoint path) divided by
    `factor` (unless it profiles: --profile-steps), GLOBAL_BATCH sequences a step unless it
    names them (or reads them from --config or --resume), a preset larger than SMALL's of its
    kind replaced by it, and --out runs/line-N (N: its `line` in the doc) when it names neither
    --out nor --resume; others unchanged."""
    if argv[:1] != ["train"]:
        return argv
    if _given(argv, "--profile-steps"):
        factor = 1  # a profile needs the steps before it (TrainConfig.validate)
    args = _train_args(argv)
    words = [_STEP_DIR.sub(lambda m: f"step-{scaled(int(m[1]), factor):08d}", w) for w in argv]
    steps = train_steps(argv)
    words = _without(words, "--steps", "--ckpt-every", "--model", "--preset")
    if steps is not None:
        words += ["--steps", str(scaled(steps, factor))]
    if not _given(argv, "--global-batch") and args.config is None and args.resume is None:
        words += ["--global-batch", str(GLOBAL_BATCH)]
    if _given(argv, "--ckpt-every"):
        words += ["--ckpt-every", str(scaled(args.ckpt_every, factor))]
    if _given(argv, "--model", "--preset"):
        words += ["--model", small_preset(args.model)]
    if not _given(argv, "--out") and args.resume is None:
        words += ["--out", f"runs/line-{line}"]
    return words


def small_preset(model: str) -> str:
    """`model`, or the SMALL preset of its kind when it is a larger preset."""
    if model not in PRESETS:
        return model
    small = SMALL[PRESETS[model].is_moe]
    return small if PRESETS[model].num_params() > PRESETS[small].num_params() else model


def _train_args(argv: list[str]):
    """The parsed options of a train command (words after `interlace`)."""
    return build_parser(only="train").parse_args(argv)


def _given(argv: list[str], *names: str) -> bool:
    """True when the command names one of the options `names` (`--x v` or `--x=v`)."""
    return any(word.split("=")[0] in names for word in argv)


def _without(words: list[str], *names: str) -> list[str]:
    """`words` without the options `names` and their values."""
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in names:
            skip = True
        elif word.split("=")[0] not in names:
            kept.append(word)
    return kept
