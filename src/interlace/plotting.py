"""Headless matplotlib figures for reports and benchmarks (matplotlib is an optional extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def new_figure(rows: int = 1, cols: int = 1, figsize: tuple[float, float] = (7, 4)) -> Any:
    """(fig, axes) on the non-interactive Agg backend; axes is one Axes for 1×1, else an
    array [rows, cols]. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=figsize, squeeze=rows * cols == 1)


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Lay out, write `path` as PNG and free the figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi, format="png")
    plt.close(fig)
