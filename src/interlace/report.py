"""The run report: per-step metrics as JSONL, a summary `report.json`, a `loss.png` and, for
expert parallel runs, the expert load heat-map `moe_load.png`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from interlace.moe.load_map import load_map, plot_load_map
from interlace.plotting import new_figure, save_figure
from interlace.run_folder import append_line, replaced_atomically, write_atomic

METRICS = "metrics.jsonl"
REPORT = "report.json"
LOSS_PLOT = "loss.png"
LOAD_PLOT = "moe_load.png"


class MetricsLog:
    """Appends one JSON object per line to `<out>/metrics.jsonl` (rank 0 only writes): the
    run's own logger (`interlace.tracking.loggers.RunLogger`)."""

    def __init__(self, out: Path, resume_step: int | None) -> None:
        self.file = Path(out) / METRICS
        if resume_step is None:
            write_atomic(self.file, "")
        else:  # drop lines from beyond the checkpoint, which the resumed run will redo
            kept = [row for row in read_metrics(self.file) if row.get("step", 0) <= resume_step]
            write_atomic(self.file, "".join(json.dumps(row) + "\n" for row in kept))

    def log(self, row: dict[str, Any]) -> None:
        """Append `row` as one line of strict JSON (`strict_json`); a crash or a full disk loses
        at most that line."""
        append_line(self.file, json.dumps(strict_json(row), allow_nan=False))

    def close(self) -> None:
        """Nothing to release: every line is written whole as it comes."""


JSON_SCALARS = (str, int, float, bool, type(None))
"""The Python types JSON writes as they are (a subclass such as numpy.float64 included; a
numpy.int64 or numpy.bool_ is not one of them)."""


def strict_json(record: dict[str, Any], what: str = "metrics row") -> dict[str, Any]:
    """`record` with every NaN or infinite float, at any depth, replaced by None, and when there
    was one a `nonfinite` entry naming each by its dotted key path, e.g. {"loss": "nan"}:
    JSON has no NaN or Infinity, and `json.dumps` would write them as bare words. A value of
    any other type than JSON's (`JSON_SCALARS`, dicts with string keys, lists, tuples) raises
    a TypeError naming its field of `what` and its type: every producer hands plain Python
    values, and one that does not is a bug to fix where the field is made."""
    flagged: dict[str, str] = {}

    def clean(value: Any, path: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            flagged[path] = str(value)
            return None
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, str):
                    raise _not_json(what, path, key, "a key")
            return {k: clean(v, f"{path}.{k}" if path else k) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v, f"{path}.{i}") for i, v in enumerate(value)]
        if not isinstance(value, JSON_SCALARS):
            raise _not_json(what, path, value, "a value")
        return value

    cleaned = clean(record, "")
    return {**cleaned, "nonfinite": flagged} if flagged else cleaned


def _not_json(what: str, path: str, value: Any, role: str) -> TypeError:
    module = type(value).__module__
    kind = (
        type(value).__qualname__ if module == "builtins" else f"{module}.{type(value).__qualname__}"
    )
    valid = (
        "str (write the key with str() where the field is made)"
        if role == "a key"
        else "str, int, float, bool, None, lists and dicts of them (convert it with int(), "
        "float() or .tolist() where the field is made)"
    )
    return TypeError(
        f"{what} field {path or '(top level)'!r} holds {role} of type {kind} ({value!r}), "
        f"which JSON cannot hold; valid: {valid}"
    )


def read_metrics(file: Path) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl file (empty list if it does not exist)."""
    file = Path(file)
    if not file.exists():
        return []
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Summary numbers of a run from its metric rows: first/final loss, last eval loss, steps
    skipped for a non-finite loss or gradient norm, mean step time, tokens/s, model TFLOP/s
    per device and MFU (the first step excluded as warm-up, and the step whose memory was
    measured; MFU None where the device's peak is unknown), peak device memory, mean comm
    bytes per group, the mean expert load per MoE layer and rank (`moe_load`, None without
    expert parallelism), and the bytes gradient compression sent over a dense all-reduce's
    (`compression_ratio`, None without compression)."""
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    steady = [r for r in train[1:] if not r.get("memory_measured") and not r.get("profiled")]
    steady = steady or train
    groups = sorted({g for r in steady for g in r.get("comm_bytes", {})})
    return {
        "steps": train[-1]["step"] if train else 0,
        "first_loss": train[0]["loss"] if train else None,
        "final_loss": train[-1]["loss"] if train else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "skipped_steps": sum(1 for r in train if r.get("skipped")),
        "mean_step_time_s": _mean([r["step_time_s"] for r in steady]),
        "mean_tokens_per_s": _mean([r["tokens_per_s"] for r in steady]),
        "mean_model_tflops": _mean([r["model_tflops"] for r in steady if "model_tflops" in r]),
        "mean_mfu": _mean([r["mfu"] for r in steady if "mfu" in r]),
        "peak_memory_gib": max(
            (r["peak_memory_gib"] for r in steady if "peak_memory_gib" in r), default=None
        ),
        "alloc_retries": max(
            (r["alloc_retries"] for r in train if "alloc_retries" in r), default=None
        ),
        "comm_bytes_per_step": {
            g: _mean([r.get("comm_bytes", {}).get(g, 0) for r in steady]) for g in groups
        },
        "moe_load": load_map(train),
        "compression_ratio": next(
            (r["compression_ratio"] for r in reversed(train) if "compression_ratio" in r), None
        ),
    }


def write_report(out: Path, report: dict[str, Any]) -> list[str]:
    """Write `report.json`, `loss.png` and (when `report` has a `moe_load`) `moe_load.png`
    into `out`, naming the heat-map in `moe_load.plot`; returns notes about anything skipped
    or not paying."""
    out = Path(out)
    notes = []
    ratio = report.get("compression_ratio")
    if ratio is not None and ratio >= 1:
        notes.append(
            f"gradient compression sent {ratio:.2f}x the bytes of a dense all-reduce: no "
            "gradient bucket was sparse enough to pay (a tied embedding's gradient is dense; "
            "see docs/compression.md)"
        )
    rows = read_metrics(out / METRICS)
    load = report.get("moe_load")
    title = report.get("title", "training loss")
    try:
        with replaced_atomically(out / LOSS_PLOT) as tmp:
            plot_loss(rows, tmp, title=title)
        if load:
            with replaced_atomically(out / LOAD_PLOT) as tmp:
                plot_load_map(load, tmp, title=title)
            report = {**report, "moe_load": {**load, "plot": LOAD_PLOT}}
    except ImportError:
        notes.append("plots skipped: matplotlib is not installed (pip install 'interlace[bench]')")
    report = strict_json({**report, "notes": notes}, "report.json")
    write_atomic(out / REPORT, json.dumps(report, indent=1, sort_keys=True, allow_nan=False))
    return notes


def plot_loss(rows: list[dict[str, Any]], file: Path, title: str) -> None:
    """Train loss per step and eval loss points, to a PNG. Raises ImportError without
    matplotlib."""
    fig, ax = new_figure(figsize=(7, 4))
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_loss"] for r in evals],
            "o-",
            label="held-out",
            ms=4,
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, file, dpi=110)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
