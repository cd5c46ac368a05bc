"""`interlace bench mfu`: on one device, the Trainer against a plain PyTorch loop over the same
model — fp32, bf16 autocast, bf16 autocast + torch.compile — per model shape, as tokens/s and
MFU; a MoE preset also beside its dense equivalent (the same active FLOPs per token).

The plain loop is what a user would write in thirty lines: the model, fused AdamW on CUDA,
cross-entropy of its logits, `torch.autocast` and `torch.compile(model)` where the mode says.
Both sides draw uniform random tokens at the model's own vocabulary (padded to a multiple of
128, as GPT-2's 50257 usually is). The first `warmup` steps (compilation) are not timed; each
timed step ends with a device synchronisation.
"""

from __future__ import annotations

import functools
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from interlace.bench.base import Benchmark
from interlace.bench.mfu_estimate import preview
from interlace.bench.mfu_runs import (
    DENSE_SUFFIX,
    LOOP_FP8,
    LOOPS,
    TRAINER_ACCUMULATING,
    TRAINER_FP8,
    batches,
    fp8_peer_missing,
    micro_batches,
    mode_precision,
    modes,
    shapes,
)
from interlace.errors import ConfigError
from interlace.mesh import default_device
from interlace.models.config import GPTConfig
from interlace.models.gpt import build_model
from interlace.models.presets import PRESETS
from interlace.optim import build_optimizer
from interlace.plan import Plan
from interlace.precision import FP8, fp8_refusal
from interlace.throughput import (
    allocator_retries,
    device_peak_tflops,
    model_flops_per_token,
    peak_memory_gib,
    synchronize,
)
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig


def time_loop(
    config: GPTConfig,
    precision: str,
    compiled: bool,
    batch: int,
    options: dict[str, Any],
    float8: bool = False,
) -> float:
    """Tokens/s of the plain loop over `batch` sequences on this process's device: median over
    the timed steps. `float8`: the blocks' linear layers converted by torchao's float8 training
    first (the fp8 peer; tensorwise, its default)."""
    device = default_device()
    torch.manual_seed(0)
    model = build_model(config, device=device)
    if float8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=in_blocks)
    optimizer = build_optimizer(model, 1e-4, 0.1)
    run = torch.compile(model) if compiled else model
    x = torch.randint(config.vocab_size, (batch, config.seq_len), device=device)
    y = torch.randint(config.vocab_size, (batch, config.seq_len), device=device)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    times = []
    for step in range(options["warmup"] + options["steps"]):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=precision == "bf16"):
            logits = run(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if step >= options["warmup"]:
            times.append(time.perf_counter() - start)
    return batch * config.seq_len / statistics.median(times)


def in_blocks(module: torch.nn.Module, name: str) -> bool:
    """Whether torchao converts linear layer `module` at `name`: those of the blocks, as
    interlace's fp8 converts (the embedding and LM head stay bf16), whose sizes the float8
    kernels take (multiples of 16)."""
    sizes = (module.in_features, module.out_features)
    return name.startswith("blocks.") and all(size % 16 == 0 for size in sizes)


def time_trainer(
    config: GPTConfig,
    batch: int,
    options: dict[str, Any],
    folder: Path,
    micro_batches: int = 1,
    precision: str = "auto",
) -> float:
    """Tokens/s of interlace's Trainer (compile at its default for the device, `precision`
    as `--precision`) on the same shape, each step `micro_batches` forward-backward passes of
    `batch` sequences: median over the timed steps."""
    path = folder / "model.json"
    path.write_text(json.dumps(config.to_dict()))
    steps = options["warmup"] + options["steps"]
    run = TrainConfig(
        model=str(path),
        data="synthetic",
        steps=steps,
        global_batch=batch * micro_batches,
        micro_batch=batch,
        eval_every=0,
        out=None,
        progress=False,
        precision=precision,
    )
    trainer = Trainer(prepare_run(run, Plan(), 1))
    rows = [trainer.train_step() for _ in range(steps)]
    return statistics.median(r["tokens_per_s"] for r in rows[options["warmup"] :])


def run_local(options: dict[str, Any]) -> dict[str, Any]:
    """Every mode on every model (and the MoE model's dense equivalent) on this device."""
    device = default_device()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, batch in batches(options).items():
            pairs = shapes(name, options)
            for label, cfg in pairs:
                flops = model_flops_per_token(cfg)
                for mode in modes(options, moe=len(pairs) > 1):
                    if mode in LOOPS:
                        float8 = mode == LOOP_FP8
                        run = functools.partial(
                            time_loop, cfg, *LOOPS[mode], batch, options, float8=float8
                        )
                    else:
                        precision = FP8 if mode == TRAINER_FP8 else "auto"
                        run = functools.partial(
                            time_trainer,
                            cfg,
                            batch,
                            options,
                            Path(tmp),
                            micro_batches(mode),
                            precision,
                        )
                    measured = _afresh(device, run)
                    peak = device_peak_tflops(device, mode_precision(device, mode))
                    tflops = flops * measured["tokens_per_s"] / 1e12
                    rows.append(
                        {
                            "model": label,
                            "mode": mode,
                            "batch": batch,
                            **measured,
                            "model_tflops": tflops,
                            "mfu": tflops / peak if peak else None,
                        }
                    )
    result = {"device": str(device), "device_name": _device_name(device), "rows": rows}
    missing = fp8_peer_missing() if options["fp8"] else None
    return {**result, "fp8_peer_missing": missing} if missing else result


def _afresh(device: torch.device, run: Callable[[], float]) -> dict[str, Any]:
    """{"tokens_per_s": run()}, run as in a fresh process: torch.compile's caches cleared (else a
    block compiled for one model is compiled again for the next with symbolic sizes, torch's
    automatic dynamic shapes, and runs slower), the last measurement's memory collected and, on
    CUDA, handed back to the driver (the caching allocator keeps freed blocks, which a larger
    model after a smaller one may find too fragmented); with `peak_memory_gib` and the
    allocator's retries during the run (`alloc_retries`) beside it."""
    torch.compiler.reset()
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.init()  # the allocator keeps no statistics to reset before CUDA starts
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    before = allocator_retries(device)
    row: dict[str, Any] = {"tokens_per_s": run()}
    if cuda:
        row["peak_memory_gib"] = peak_memory_gib(device)
        row["alloc_retries"] = allocator_retries(device) - before
    return row


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def check(options: dict[str, Any]) -> None:
    """Known presets, positive sizes."""
    unknown = set(options["models"].split(",")) - set(PRESETS)
    if unknown:
        raise ConfigError(f"models {sorted(unknown)} unknown; choose from {', '.join(PRESETS)}")
    batches(options)
    if options["steps"] < 1:
        raise ConfigError(f"steps={options['steps']} must be >= 1")
    if options["warmup"] < 0:
        raise ConfigError(f"warmup={options['warmup']} must be >= 0")
    if options["moe_micro_batches"] < 1:
        raise ConfigError(
            f"moe_micro_batches={options['moe_micro_batches']} must be >= 1 (1: no extra rows)"
        )
    refusal = fp8_refusal(default_device()) if options["fp8"] else None
    if refusal is not None:
        raise ConfigError(f"fp8=true: {refusal.removeprefix('precision=fp8 ')}; set fp8=false")


def table(doc: dict[str, Any]) -> str:
    """One row per model and mode: tokens/s, model TFLOP/s, MFU, the ratio to the loop's
    bf16 + compile (or bf16) row, and on CUDA peak memory and allocator retries ('-' where the
    JSON predates them)."""
    rows = doc["result"]["rows"]
    lines = [f"device: {doc['result']['device_name']}"]
    lines.append(
        f"{'model':34s} {'mode':25s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} "
        f"{'vs loop':>7s} {'GiB':>6s} {'retries':>7s}"
    )
    for row in rows:
        best = _best_loop(rows, row["model"], row["mode"])
        mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
        memory = row.get("peak_memory_gib")
        lines.append(
            f"{row['model']:34s} {row['mode']:25s} {row['tokens_per_s']:10.0f} "
            f"{row['model_tflops']:8.2f} {mfu:>6s} {row['tokens_per_s'] / best:6.2f}x "
            f"{'-' if memory is None else f'{memory:.1f}':>6s} {row.get('alloc_retries', '-'):>7}"
        )
    return "\n".join(lines)


def _best_loop(rows: list[dict[str, Any]], model: str, mode: str = "trainer") -> float:
    """Tokens/s of the loop `model`'s `mode` is set against: the torchao float8 loop for the
    float8 modes where it ran, else the fastest bf16 loop."""
    peer_modes = [LOOP_FP8] if mode in (TRAINER_FP8, LOOP_FP8) else []
    peers = [r for r in rows if r["model"] == model and r["mode"] in peer_modes]
    bf16 = [
        r for r in rows if r["model"] == model and r["mode"] in ("loop_bf16", "loop_bf16_compile")
    ]
    return max(r["tokens_per_s"] for r in (peers or bf16))


def plot(doc: dict[str, Any], path: Path) -> None:
    """Grouped bars of tokens/s per model, one bar per mode."""
    from interlace.plotting import new_figure, save_figure

    rows = doc["result"]["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = new_figure(figsize=(max(7, 2 * len(models)), 4))
    width = 0.8 / len(modes)
    measured = {(r["model"], r["mode"]): r["tokens_per_s"] for r in rows}
    for j, mode in enumerate(modes):
        values = [measured.get((m, mode), 0.0) for m in models]
        ax.bar([i + j * width for i in range(len(models))], values, width, label=mode)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models, fontsize=7)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"one {doc['result']['device_name']}", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path, dpi=110)


def headline(doc: dict[str, Any]) -> str:
    """The Trainer's tokens/s against the plain loop's best, per model; a MoE model's Trainer
    against its dense equivalent's, per step and with micro-batches accumulated."""
    rows = doc["result"]["rows"]
    trainer = {(r["model"], r["mode"]): r for r in rows if r["mode"].startswith("trainer")}
    parts = []
    for (model, mode), row in trainer.items():
        if mode != "trainer":
            continue
        ratio = row["tokens_per_s"] / _best_loop(rows, model)
        mfu = "" if row["mfu"] is None else f", MFU {row['mfu']:.1%}"
        versus = {  # each Trainer mode against the same mode of the dense equivalent
            m: trainer[(model, m)]["tokens_per_s"] / dense["tokens_per_s"]
            for (name, m), dense in trainer.items()
            if name == f"{model} {DENSE_SUFFIX}" and (model, m) in trainer
        }
        against = f", {versus.pop('trainer'):.2f}x its dense equivalent" if versus else ""
        against += "".join(
            f" ({r:.2f}x at {m.removeprefix(TRAINER_ACCUMULATING)} micro-batches of "
            f"{row['batch']} sequences a step)"
            for m, r in versus.items()
        )
        fp8 = trainer.get((model, TRAINER_FP8))
        if fp8 is not None:
            peer = "torchao fp8 loop" if any(r["mode"] == LOOP_FP8 for r in rows) else "loop"
            against += (
                f"; fp8 {fp8['tokens_per_s'] / row['tokens_per_s']:.2f}x the bf16 Trainer, "
                f"{fp8['tokens_per_s'] / _best_loop(rows, model, TRAINER_FP8):.2f}x the {peer}"
            )
        parts.append(f"{model}: Trainer {ratio:.2f}x the plain loop{mfu}{against}")
    missing = doc["result"].get("fp8_peer_missing")
    return "; ".join(parts) + (f" ({missing})" if missing else "")


def key_numbers(result: dict[str, Any]) -> dict[str, float]:
    """Tokens/s of every model and mode."""
    return {f"{r['model']} {r['mode']} tok/s": r["tokens_per_s"] for r in result["rows"]}


BENCHMARK = Benchmark(
    name="mfu",
    summary="the Trainer against a plain fp32 / bf16 / bf16 + compile loop on one device",
    describe=(
        "On one device (CUDA, or the CPU as a smoke run), interlace's Trainer and a plain "
        "PyTorch loop over the same module (fp32; bf16 autocast; bf16 autocast + "
        "torch.compile) for each model shape at its own vocabulary (padded to a multiple of "
        "128), on uniform random tokens; a MoE preset also beside its dense equivalent. "
        "With `fp8` (a GPU with float8 matmuls) the Trainer also runs at `--precision fp8` "
        "(tensorwise), its MFU against the bf16 peak as torchtitan reports it, beside its peer: "
        "the plain bf16 + compile loop with torchao's float8 training on the blocks' linear "
        "layers (`loop_fp8_torchao`, where torchao is installed), which the fp8 rows' 'vs loop' "
        "compares against. "
        "Each model runs at its own batch (`batch`, one count per model: by default 16 "
        "sequences for gpt2-124m and the MoE preset, 8 for gpt2-1.5b). "
        "A MoE preset and its dense equivalent also run through the Trainer at "
        "`moe_micro_batches` micro-batches of that batch per optimizer step: the per-step "
        "update of every expert's weights, memory-bound, then weighs less. "
        "Tokens/s is the median over timed steps after warm-up; MFU is model FLOPs "
        "(6N + 12LTd per token) over the device's dense peak in the mode's precision (fp32: "
        "the peak without TF32, which the loop leaves off). Without CUDA the defaults are a "
        "smoke run of a few minutes: demo and moe-demo at 4 sequences, 1 warm-up + 3 timed "
        "steps, no torch.compile."
    ),
    table=table,
    plot=plot,
    run_local=run_local,
    check=check,
    headline=headline,
    key_numbers=key_numbers,
    options={
        "models": "gpt2-124m,gpt2-1.5b,moe-gpt-12l",
        "batch": "16,8,16",
        "seq_len": 0,
        "steps": 10,
        "warmup": 3,
        "compile": True,
        "moe_micro_batches": 4,
        "fp8": True,
    },
    option_help={
        "models": "model presets, comma-separated",
        "batch": "sequences per step: one count, or one per model in order",
        "seq_len": "tokens per sequence (0: each preset's own)",
        "steps": "timed steps per measurement (tokens/s is their median)",
        "warmup": "untimed steps before them (compilation, allocator warm-up)",
        "compile": "also time the loop under bf16 autocast + torch.compile",
        "moe_micro_batches": "MoE shapes also through the Trainer at this many micro-batches a "
        "step (1: not)",
        "fp8": "also the Trainer at --precision fp8 (a GPU with float8 matmuls)",
    },
    cpu_options={
        "models": "demo,moe-demo",
        "batch": "4",
        "steps": 3,
        "warmup": 1,
        "compile": False,
        "moe_micro_batches": 2,
        "fp8": False,
    },
    preview=preview,
)
