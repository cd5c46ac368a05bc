"""`interlace bench precision`: what low precision costs in quality, as loss curves of a
converged run, not a smoke run.

One model from the same seed on the same data (the built-in corpus) for `steps` optimizer
steps in each mode: bf16 (the reference), bf16 with AdamW's moments in bf16
(`--optimizer-state bf16`, rounded stochastically), and fp8 under each recipe (`--precision
fp8 --fp8-recipe tensorwise|rowwise`). Each mode's final loss is the mean of its last `tail`
steps' losses (one step's loss is noisy), compared with bf16's.

On a GPU with float8 tensor cores the fp8 modes run as `--precision fp8` runs. Elsewhere (the
CPU) torch emulates the float8 products (`torch._scaled_mm`): the same numerics, not the
speed; the result records which (`fp8_emulated`), and the CLI itself still refuses fp8 there.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from interlace.bench.base import Benchmark
from interlace.errors import ConfigError
from interlace.mesh import default_device
from interlace.plan import Plan
from interlace.precision import FP8, fp8_refusal
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

MODES = {
    "bf16": ("bf16", "fp32", "tensorwise"),
    "bf16_optimizer_state": ("bf16", "bf16", "tensorwise"),
    "fp8_tensorwise": (FP8, "fp32", "tensorwise"),
    "fp8_rowwise": (FP8, "fp32", "rowwise"),
}
"""mode: (precision, optimizer state, fp8 recipe)."""


def train_losses(options: dict[str, Any], mode: str) -> list[float]:
    """Every step's loss of `options`' model trained in `mode` (MODES) on one process."""
    precision, state, recipe = MODES[mode]
    config = TrainConfig(
        model=options["model"],
        steps=options["steps"],
        global_batch=options["batch"],
        lr=options["lr"],
        warmup_steps=options["steps"] // 10,
        eval_every=0,
        out=None,
        progress=False,
        precision="bf16",
        optimizer_state=state,
    )
    setup = prepare_run(config, Plan(), 1)
    # fp8 set after the checks, which refuse it where torch only emulates it (module docstring)
    setup.precision = precision
    setup.config = dataclasses.replace(config, fp8_recipe=recipe)
    trainer = Trainer(setup)
    return [trainer.train_step()["loss"] for _ in range(options["steps"])]


def run_local(options: dict[str, Any]) -> dict[str, Any]:
    """Each mode's losses and final loss, and each final against bf16's."""
    modes = {}
    for mode in MODES:
        losses = train_losses(options, mode)
        modes[mode] = {"losses": losses, "final": statistics.fmean(losses[-options["tail"] :])}
    reference = modes["bf16"]["final"]
    for row in modes.values():
        row["vs_bf16"] = row["final"] / reference - 1
    device = default_device()
    return {
        "device": str(device),
        "fp8_emulated": fp8_refusal(device) is not None,
        "modes": modes,
    }


def check(options: dict[str, Any]) -> None:
    """ConfigError for a run too short to average its tail over."""
    if options["steps"] < 2 * options["tail"] or options["tail"] < 1:
        raise ConfigError(
            f"steps={options['steps']} must be at least twice tail={options['tail']} (>= 1)"
        )


def table(doc: dict[str, Any]) -> str:
    """One row per mode: final loss, its difference from bf16's."""
    result = doc["result"]
    emulated = " (fp8 emulated by torch on this device)" if result["fp8_emulated"] else ""
    lines = [f"{'mode':22s} {'final loss':>10s} {'vs bf16':>8s}{emulated}"]
    for mode, row in result["modes"].items():
        lines.append(f"{mode:22s} {row['final']:10.4f} {row['vs_bf16']:+8.2%}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Every mode's loss curve on one axis."""
    from interlace.plotting import new_figure, save_figure

    result = doc["result"]
    fig, ax = new_figure()
    for mode, row in result["modes"].items():
        ax.plot(range(1, len(row["losses"]) + 1), row["losses"], label=mode, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend()
    emulated = ", fp8 emulated" if result["fp8_emulated"] else ""
    ax.set_title(f"loss by precision on {result['device']}{emulated}", fontsize=9)
    save_figure(fig, path)


def headline(doc: dict[str, Any]) -> str:
    """Each low-precision mode's final loss against bf16's."""
    modes = doc["result"]["modes"]
    steps = len(modes["bf16"]["losses"])
    parts = [f"{mode} {row['vs_bf16']:+.2%}" for mode, row in modes.items() if mode != "bf16"]
    return f"final loss after {steps} steps against bf16's: " + ", ".join(parts)


def key_numbers(result: dict[str, Any]) -> dict[str, float]:
    """Each mode's final loss."""
    return {f"{mode} final loss": row["final"] for mode, row in result["modes"].items()}


BENCHMARK = Benchmark(
    name="precision",
    summary="loss curves of bf16, bf16 optimizer state and fp8 (both recipes), same seed",
    describe=(
        "One model trained from the same seed on the built-in corpus for `steps` steps in "
        "bf16, in bf16 with AdamW's moments in bf16 (stochastic rounding), and in fp8 with "
        "tensorwise and rowwise scaling; each mode's final loss (the mean of the last `tail` "
        "steps) against bf16's, and the curves in one plot. On a device without float8 "
        "matmuls (the CPU) torch emulates the float8 products: the numerics, not the speed."
    ),
    table=table,
    plot=plot,
    run_local=run_local,
    check=check,
    headline=headline,
    key_numbers=key_numbers,
    options={"model": "gpt2-124m", "steps": 300, "batch": 16, "lr": 6e-4, "tail": 20},
    option_help={
        "model": "model preset",
        "steps": "optimizer steps per mode",
        "batch": "sequences per step",
        "lr": "peak learning rate",
        "tail": "final steps whose losses make the final loss",
    },
    cpu_options={"model": "tiny", "batch": 8, "lr": 2e-3},
)
