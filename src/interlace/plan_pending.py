"""The table of plan combinations that are valid but not implemented yet, in one place: each
row is (active for this plan, what, the fix to name). `Plan.validate` raises the first active
row's "<what> is not implemented yet; use <fix>", and `parallelize` relies on it. The rows of
context parallelism come from its own rules (`parallel/context/options.py`). No torch here."""

from __future__ import annotations

from typing import Any

from interlace.parallel.context import options as context_options


def fmt_tp3d(dims: tuple[int, ...]) -> str:
    """A 3D grid (x, y, z) as the plan writes it: "XxYxZ"."""
    return "x".join(str(d) for d in dims)


def pending_rows(plan: Any) -> list[tuple[bool, str, str]]:
    """Every row of the table for `plan` (a Plan): (active, what, fix)."""
    tp3d = f"tp3d={fmt_tp3d(plan.tp3d)}" if plan.tp3d is not None else ""
    return context_options.pending_with(plan, tp3d)
