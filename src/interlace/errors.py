"""Errors interlace raises for bad user input.

Every error names the offending value, says why it is wrong and what would be valid. The CLI
prints any `InterlaceError` as one line on stderr and exits with code 2.
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
