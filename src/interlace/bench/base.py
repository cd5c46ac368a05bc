"""What a benchmark is: a function run on every rank, a table, a plot and a page section."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from interlace.comm import Group
from interlace.errors import ConfigError
from interlace.mesh import default_device
from interlace.models.config import GPTConfig


@dataclass(frozen=True)
class RankContext:
    """What a benchmark's rank function gets: its world group, the link rate (bits/s, None on
    loopback), the interface gloo uses, and the benchmark's options."""

    group: Group
    rate_bps: float | None
    ifname: str
    options: dict[str, Any]

    def tx_bytes(self) -> int:
        """Bytes this rank's interface has sent so far (kernel counter, headers included)."""
        return int(Path(f"/sys/class/net/{self.ifname}/statistics/tx_bytes").read_text())


def gpt_config(options: dict[str, Any]) -> GPTConfig:
    """The dense GPT that a benchmark's `vocab`, `seq_len`, `d_model`, `layers` and `heads`
    options describe."""
    return GPTConfig(
        vocab_size=options["vocab"],
        seq_len=options["seq_len"],
        d_model=options["d_model"],
        n_layers=options["layers"],
        n_heads=options["heads"],
    )


GPT_OPTION_HELP = {
    "vocab": "vocabulary size, tokens",
    "seq_len": "tokens per sequence",
    "d_model": "model width",
    "layers": "transformer blocks",
    "heads": "attention heads (they divide d_model)",
}
"""What the options `gpt_config` reads mean, for `Benchmark.option_help`."""


def check_names(options: dict[str, Any], key: str, valid: Iterable[str]) -> None:
    """ConfigError if the comma-separated option `key` names something not in `valid`."""
    valid = tuple(valid)
    unknown = set(options[key].split(",")) - set(valid)
    if unknown:
        raise ConfigError(f"{key} {sorted(unknown)} unknown; choose from {','.join(valid)}")


def mode_step_times(result: dict[str, Any]) -> dict[str, float]:
    """Key numbers of a result shaped {"modes": {name: {"step_median_s": ...}}}: each mode's
    median step time."""
    return {f"{name} step_s": m["step_median_s"] for name, m in result["modes"].items()}


def plot_modes_against_limits(
    result: dict[str, Any], path: Path, *, ylabel: str, title: str
) -> None:
    """Bars: compute alone, communication alone, each mode's median step, their serial sum and
    the ideal max(compute, communication), from a result with compute_s, comm_s and modes."""
    from interlace.plotting import new_figure, save_figure

    modes = result["modes"]
    labels = ["compute alone", "comm alone", *modes, "serial sum", "ideal max"]
    values = [
        result["compute_s"],
        result["comm_s"],
        *(m["step_median_s"] for m in modes.values()),
        result["compute_s"] + result["comm_s"],
        max(result["compute_s"], result["comm_s"]),
    ]
    colors = [f"C{i}" for i in range(2 + len(modes))] + ["0.6", "0.8"]
    fig, ax = new_figure(figsize=(7 + 0.5 * max(0, len(modes) - 2), 4))
    ax.bar(labels, values, color=colors)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    save_figure(fig, path, dpi=110)


@dataclass(frozen=True)
class Benchmark:
    """One `interlace bench <name>`.

    run_rank: runs on every rank of the cluster (distributed=True) and returns a JSON-able dict;
        rank 0's dict becomes the result, every rank's is kept as raw data.
    run_local: for single-process benchmarks (distributed=False): options → result dict.
    table: result → text table printed after the run.
    plot: (result, png path) → None.
    check: options → None, raising ConfigError for a bad option before any rank starts.
    key_numbers: result (rank 0's dict) → the figures whose spread over repeated runs tells
        whether the benchmark is reproducible.
    headline: result → the one-line claim the benchmark exists to test, for BENCHMARKS.md.
    describe: what it measures and what the physical limit is (BENCHMARKS.md's prose).
    options: the defaults that `--set key=value` overrides; option_help: each one's meaning
        (what it is, its unit), one short phrase per option, shown by `interlace bench list`.
    cpu_options: defaults that replace `options`' where this process computes on the CPU (no
        CUDA, or INTERLACE_DEVICE=cpu), for a benchmark whose GPU shapes a CPU cannot run.
    preview: options → what the run will do, on what device and about how long, for the line
        printed before it starts (default: the options and the ranks).
    """

    name: str
    summary: str
    describe: str
    table: Callable[[dict[str, Any]], str]
    plot: Callable[[dict[str, Any], Path], None]
    run_rank: Callable[[RankContext], dict[str, Any]] | None = None
    run_local: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    check: Callable[[dict[str, Any]], None] | None = None
    headline: Callable[[dict[str, Any]], str] | None = None
    key_numbers: Callable[[dict[str, Any]], dict[str, float]] | None = None
    default_ranks: int = 2
    options: dict[str, Any] = field(default_factory=dict)
    option_help: dict[str, str] = field(default_factory=dict)
    cpu_options: dict[str, Any] = field(default_factory=dict)
    preview: Callable[[dict[str, Any]], str] | None = None

    def defaults(self) -> dict[str, Any]:
        """The default options on this machine: `options`, with `cpu_options` over them where
        this process computes on the CPU (`mesh.default_device`)."""
        on_cpu = default_device().type == "cpu"
        return {**self.options, **(self.cpu_options if on_cpu else {})}

    def option_lines(self) -> list[str]:
        """One line per option for `interlace bench list`: `  name=default  meaning`, and the
        default on a CPU where it differs."""
        return [
            f"  {key}={value}  {self.option_help.get(key, '')}"
            + (f"; on a CPU: {self.cpu_options[key]}" if key in self.cpu_options else "")
            for key, value in self.options.items()
        ]

    @property
    def distributed(self) -> bool:
        """True when it runs on the emulated cluster's ranks."""
        return self.run_rank is not None
