"""Finite numbers: the one check that a settings dataclass holds no NaN or infinity.

`float("nan")` passes every range check written as `x < 0` or `x <= 0` (each comparison with
NaN is false), and an infinite learning rate, clip norm or bucket size passes them too, so
every settings class runs this check before its ranges.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from interlace.errors import InterlaceError


def check_finite_fields(settings: Any, error: type[InterlaceError]) -> None:
    """Raise `error` naming the first float field of the dataclass instance `settings` that is
    NaN or ±inf, e.g. "lr=nan is not a finite number; give one such as lr=0.002 (the
    default)"."""
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            default = field.default
            hint = (
                f"give one such as {field.name}={default} (the default)"
                if isinstance(default, int | float)
                else "give a finite number or leave it unset"
            )
            raise error(f"{field.name}={value} is not a finite number; {hint}")
