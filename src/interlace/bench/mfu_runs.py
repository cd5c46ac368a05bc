"""What `interlace bench mfu` runs: the model shapes (each preset at a padded vocabulary, a MoE
preset beside its dense equivalent), the batch per model, and the modes measured on each with
their precision; shared by the benchmark and its up-front estimate (`mfu_estimate`)."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch

from interlace.errors import ConfigError
from interlace.models.config import GPTConfig
from interlace.models.presets import get_preset

LOOP_MODES = {"loop_fp32": ("fp32", False), "loop_bf16": ("bf16", False)}
LOOP_COMPILED = {"loop_bf16_compile": ("bf16", True)}
LOOP_FP8 = "loop_fp8_torchao"
"""The fp8 peer: the plain bf16 + compile loop with torchao's float8 training on the blocks'
linear layers (tensorwise), where torchao is installed."""
LOOPS = {**LOOP_MODES, **LOOP_COMPILED, LOOP_FP8: ("bf16", True)}
"""(precision, compiled) of every plain-loop mode."""
TRAINER_ACCUMULATING = "trainer_micro_batches_"
TRAINER_FP8 = "trainer_fp8"
"""The Trainer at `--precision fp8` (tensorwise), its MFU against the bf16 peak as peers report."""
DENSE_SUFFIX = "(dense equivalent)"


def shape(name: str, options: dict[str, Any]) -> GPTConfig:
    """Preset `name` at its vocabulary padded to a multiple of 128 (and `seq_len` if set)."""
    config = get_preset(name)
    vocab = -(-config.vocab_size // 128) * 128
    return dataclasses.replace(
        config, vocab_size=vocab, seq_len=options["seq_len"] or config.seq_len
    )


def dense_equivalent(config: GPTConfig) -> GPTConfig:
    """`config` with a dense FFN in place of every MoE layer: for a top-1 preset the same active
    FLOPs per token, the router's aside (top-k presets compute k experts per token)."""
    return dataclasses.replace(config, n_experts=0)


def batches(options: dict[str, Any]) -> dict[str, int]:
    """{model: sequences per step} from the `batch` option: one count for every model, or one
    per model in `models`' order ("16,8,16"). ConfigError for a count below 1, not a whole
    number, or a list of another length."""
    models = options["models"].split(",")
    counts = str(options["batch"]).split(",")
    if len(counts) not in (1, len(models)):
        raise ConfigError(
            f"batch={options['batch']} gives {len(counts)} counts for {len(models)} models; "
            "give one count, or one per model"
        )
    try:
        sizes = [int(c) for c in counts]
    except ValueError:
        raise ConfigError(f"batch={options['batch']} must be whole numbers") from None
    if min(sizes) < 1:
        raise ConfigError(f"batch={options['batch']} must be >= 1")
    return dict(zip(models, sizes * len(models) if len(sizes) == 1 else sizes, strict=True))


def shapes(name: str, options: dict[str, Any]) -> list[tuple[str, GPTConfig]]:
    """(label, config) of model `name` and, for a MoE preset, of its dense equivalent."""
    config = shape(name, options)
    if not config.n_experts:
        return [(name, config)]
    return [(name, config), (f"{name} {DENSE_SUFFIX}", dense_equivalent(config))]


def modes(options: dict[str, Any], moe: bool) -> list[str]:
    """The modes measured on each shape, in order: the Trainer; with `fp8` the Trainer in
    float8; for a MoE model and its dense equivalent the Trainer at `moe_micro_batches`
    micro-batches a step (from 2); each loop, with `fp8` the torchao float8 loop where torchao
    is installed (`fp8_peer_missing`)."""
    k = options["moe_micro_batches"]
    accumulating = [f"{TRAINER_ACCUMULATING}{k}"] if moe and k > 1 else []
    loops = [*LOOP_MODES, *(LOOP_COMPILED if options["compile"] else {})]
    fp8 = [TRAINER_FP8] if options["fp8"] else []
    fp8_loop = [LOOP_FP8] if options["fp8"] and fp8_peer_missing() is None else []
    return ["trainer", *fp8, *accumulating, *loops, *fp8_loop]


def fp8_peer_missing() -> str | None:
    """Why the torchao float8 loop cannot run here (None: it can)."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao), so the fp8 peer loop is left out"
    return None


def micro_batches(mode: str) -> int:
    """Forward-backward passes per optimizer step in `mode`."""
    return (
        int(mode.removeprefix(TRAINER_ACCUMULATING)) if mode.startswith(TRAINER_ACCUMULATING) else 1
    )


def mode_precision(device: torch.device, mode: str) -> str:
    """The precision `mode` computes in on `device`: the Trainer's default for the device
    (bf16 on CUDA, fp32 elsewhere), a loop's own."""
    if mode == TRAINER_FP8:
        return "bf16"
    if mode.startswith("trainer"):
        return "bf16" if device.type == "cuda" else "fp32"
    return LOOPS[mode][0]
