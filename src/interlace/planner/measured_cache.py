"""One JSON file of measurements keyed by what they depend on (a machine's fingerprint, a
model, a dtype, ...): `cached_entry` reads one, or measures and writes it. The planner's
caches beside the machine's calibration (`model-efficiency.json`, `rate-surfaces.json`) use it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from interlace.run_folder import write_atomic


def cached_entry(
    path: Path, key: str, measure: Callable[[], Any], kind: type, recalibrate: bool = False
) -> Any:
    """The entry `key` of the JSON object in `path` when it is a `kind` (float, dict) and not
    `recalibrate`; else `measure()`'s value (JSON-able), written into the file atomically
    beside the other entries, and returned. A missing or unreadable file counts as empty."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if not recalibrate and isinstance(cache.get(key), kind):
        return cache[key]
    cache[key] = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(cache, indent=1))
    return cache[key]
