"""Errors interlace raises for bad user input.

Every error names the offending value, says why it is wrong and what would be valid. The CLI
prints any `InterlaceError` as one line on stderr and exits with code 2.

A run that started and then had to stop raises a `RunStopped` instead, whose `exit_code` the
CLI exits with: 3 when writing or reading the run's files failed (`OutputError`), 4 when the
training values stopped being finite (`NonFiniteError`).
"""


class InterlaceError(ValueError):
    """Base class of every user-facing error: bad plan, config, data or checkpoint."""


class PlanError(InterlaceError):
    """A Plan that cannot run on the given world size or model."""


class ConfigError(InterlaceError):
    """A model or training configuration that is invalid (unknown preset, bad shapes, ...)."""


class DataError(InterlaceError):
    """Training data that is missing, empty or too short for the requested sequence length."""


class CheckpointError(InterlaceError):
    """A checkpoint that is missing, corrupt or does not match the current run."""


class ExportError(InterlaceError):
    """A checkpoint that cannot be exported as asked: a model or a split the target format or
    the reader cannot express exactly, or an output folder in the way."""


def check_plan_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """PlanError unless `value` of plan option `name` is one of `choices`."""
    if value not in choices:
        raise PlanError(f"{name}={value!r} is not one of {', '.join(choices)}")


class RunStopped(RuntimeError):
    """A run that started and stopped before its last step; `exit_code` is the CLI's."""

    exit_code = 1


class OutputError(RunStopped):
    """Reading or writing the run's files failed during the run (a full disk, a lost mount)."""

    exit_code = 3


class NonFiniteError(RunStopped):
    """The loss or the gradient norm stopped being finite and the run's policy says stop."""

    exit_code = 4
