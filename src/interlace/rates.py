"""Link rates written the way `tc` writes them: "1gbit", "500mbit", "100kbit"."""

from __future__ import annotations

import re

from interlace.errors import ConfigError

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(text: str) -> float:
    """'1gbit' / '500mbit' / '100kbit' → bits per second. ConfigError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(kbit|mbit|gbit)\s*", text.lower())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(
            f"bandwidth '{text}' is not a rate like 1gbit, 500mbit or 100kbit (or 'loopback')"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]
