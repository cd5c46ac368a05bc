"""The check, before anything starts, that the trackers a run asks for can work."""

from __future__ import annotations

import importlib.util
from typing import Any

from interlace.errors import ConfigError

TRACKERS = ("tensorboard", "wandb")
"""The TrainConfig fields that turn a tracker on, each named after the package it needs."""

EXTRA = "pip install 'interlace[track]'"


def check_trackers(config: Any) -> None:
    """Raise ConfigError (one line) for a tracker `config` (a TrainConfig) turns on without a
    run folder (out) or without its package installed."""
    for name in TRACKERS:
        if not getattr(config, name):
            continue
        if config.out is None:
            raise ConfigError(f"{name} needs a run folder (out) to write into")
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"{name} needs the {name} package: {EXTRA}")
