"""The numbers of a metrics row under the names the trackers show them by."""

from __future__ import annotations

from typing import Any


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of the metrics row `row` by tracker name: `eval_<x>` as `eval/<x>`, every
    other field as `train/<field>`, and the entries of a nested dict or of a list of dicts
    below their field's name joined by '/' (`train/comm_bytes/dp`,
    `train/moe/0/balance_degree`). Left out: `step` (the x-axis), flags (`skipped`,
    `profiled`), text and lists of numbers (per-rank and per-expert counts, which
    `moe_load.png` shows)."""
    found: dict[str, float] = {}

    def add(value: Any, name: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                add(item, f"{name}/{key}")
        elif isinstance(value, list) and all(isinstance(item, dict) for item in value):
            for index, item in enumerate(value):
                add(item, f"{name}/{index}")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found[name] = float(value)

    for key, value in row.items():
        if key != "step":
            add(value, f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}")
    return found
