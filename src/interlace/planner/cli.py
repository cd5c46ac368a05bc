"""The planner's part of `interlace plan`: rank plans for a model on a cluster, or price one.

    interlace plan --model axonn-80b --hardware perlmutter --gpus 1024 --global-batch 2048 --search
    interlace plan --model layers=60,hidden=10240,heads=80,vocab=51200 --gpus 64 --search --top 3
    interlace plan --model gpt3-175b --hardware dgx-a100 --plan dp=16,pp=8,tp=8,micro_batches=96 \
        --global-batch 1536 --explain

`--model` is a preset name, a `.json` file of GPTConfig fields, or a spec string
(`parse_model_spec`). `add_planner_args` adds the options to the existing `plan` parser;
`run_planner` does the work and returns the exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from interlace.errors import ConfigError
from interlace.mesh import default_device
from interlace.models.config import GPTConfig
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.bytes import OPTIMIZER_STATES
from interlace.planner.calibrate import local_hardware
from interlace.planner.context_choice import context_choice
from interlace.planner.cost import PlanCost, estimate
from interlace.planner.cost_moe import check_expert_skew
from interlace.planner.hardware import GIB, LOCAL, PRESETS, Hardware, get_hardware
from interlace.planner.model_calibration import (
    cached_model_flops,
    surface_factor,
    with_model_efficiency,
)
from interlace.planner.search import check_plan, explain, pad_vocab, search
from interlace.planner.simulate import simulate
from interlace.planner.surface_measure import cached_surface, with_surface
from interlace.precision import FP8, Precision, resolve_precision
from interlace.rates import parse_rate
from interlace.timeline import plot_timeline, write_chrome_trace

SPEC_KEYS = {
    "layers": "n_layers",
    "hidden": "d_model",
    "heads": "n_heads",
    "vocab": "vocab_size",
    "seq": "seq_len",
    "ffn": "d_ff",
    "experts": "n_experts",
    "top_k": "top_k",
    "moe_every": "moe_every",
}
"""Spec-string keys and the GPTConfig fields they set."""
REQUIRED_SPEC_KEYS = ("layers", "hidden", "heads", "vocab")
DEFAULT_SEQ = 2048
"""Sequence length of a spec-string model that gives no `seq`."""
DEFAULT_GLOBAL_BATCH = 512
"""Sequences per step without --global-batch, at the model's own sequence length."""


def parse_model_spec(text: str, seq_len: int | None = None) -> GPTConfig:
    """'layers=60,hidden=10240,heads=80,vocab=51200[,experts=16,top_k=2,seq=2048,ffn=...,
    moe_every=...]' → a validated GPTConfig (MoE layers on every `moe_every`-th FFN, default
    1 for a spec with experts). `seq_len` fills in a missing `seq` (else 2048). ConfigError
    naming the bad item otherwise."""
    values: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if "=" not in item:
            raise ConfigError(f"model spec item {item!r} is not key=value, e.g. 'layers=24'")
        key, raw = (s.strip() for s in item.split("=", 1))
        if key not in SPEC_KEYS:
            raise ConfigError(f"unknown model spec key {key!r}; valid keys: {', '.join(SPEC_KEYS)}")
        if key in values:
            raise ConfigError(f"model spec key {key!r} is given twice")
        try:
            values[key] = int(raw)
        except ValueError:
            raise ConfigError(
                f"model spec {key}={raw!r} is not an integer; e.g. {key}=16"
            ) from None
    missing = [k for k in REQUIRED_SPEC_KEYS if k not in values]
    if missing:
        raise ConfigError(
            f"model spec {text!r} lacks {', '.join(missing)}; e.g. "
            "layers=60,hidden=10240,heads=80,vocab=51200"
        )
    fields = {SPEC_KEYS[k]: v for k, v in values.items()}
    fields.setdefault("seq_len", seq_len or DEFAULT_SEQ)
    if fields.get("n_experts"):
        fields.setdefault("moe_every", 1)
    config = GPTConfig(**fields)
    config.validate()
    return config


def default_global_batch(model_seq_len: int, seq_len: int | None) -> int:
    """Sequences per step without --global-batch: `DEFAULT_GLOBAL_BATCH` of the model's
    `model_seq_len` tokens, or as many tokens per step in sequences of `seq_len` (at least one
    sequence): 4 for a model of 1024 tokens at 131072."""
    tokens = DEFAULT_GLOBAL_BATCH * model_seq_len
    return max(1, tokens // (seq_len or model_seq_len))


def resolve_model(text: str, seq_len: int | None = None) -> GPTConfig:
    """A preset name, a .json file of GPTConfig fields, or a spec string (`parse_model_spec`)."""
    if "=" in text:
        return parse_model_spec(text, seq_len)
    return get_preset(text)


DEFAULT_HARDWARE = "dgx-a100"


def add_planner_args(p: argparse.ArgumentParser) -> None:
    """Add the planner's options to the `interlace plan` parser (which already has --model,
    --plan, --nproc, --list, --show-stages, --micro-batch-rows)."""
    p.add_argument(
        "--hardware",
        default=None,
        help=f"cluster to price plans on: {', '.join(PRESETS)}, or {LOCAL} (this machine, "
        f"measured once and cached) (default with --search: {DEFAULT_HARDWARE})",
    )
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help=f"with --hardware {LOCAL}: measure this machine again instead of using the cache",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help=f"with --hardware {LOCAL}: price each matmul by its shape and attention by its "
        "sequence length and head width, at rates measured on a grid of shapes on this "
        "machine's device (a few seconds once per dtype and ranks; cached)",
    )
    p.add_argument(
        "--calibrate-model",
        action="store_true",
        help=f"with --hardware {LOCAL}: price the model's compute at the efficiency its own "
        "training step reaches on this machine's device (measured once, at one device's "
        "share of --global-batch, compiled on CUDA as a run is; cached)",
    )
    p.add_argument(
        "--bandwidth",
        default=None,
        help=f"with --hardware {LOCAL}: price links at this rate instead of the measured "
        "loopback (e.g. 1gbit, the emulated cluster's rate)",
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="OUT.json",
        help="simulate one step of the best (or given) plan: Chrome trace here, and a PNG "
        "beside it",
    )
    p.add_argument("--gpus", type=int, default=None, help="devices to plan for (default: --nproc)")
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help=f"sequences per optimizer step; unset: {DEFAULT_GLOBAL_BATCH} at the model's "
        "sequence length, or as many tokens per step at another --seq",
    )
    p.add_argument(
        "--seq", type=int, default=None, help="tokens per sequence (default: the model's)"
    )
    p.add_argument("--top", type=int, default=5, help="how many ranked plans to print")
    p.add_argument(
        "--explain", action="store_true", help="say why each printed plan costs what it does"
    )
    p.add_argument("--json", action="store_true", help="print the estimates as JSON")
    p.add_argument(
        "--search",
        action="store_true",
        help="search every plan for --gpus devices and print the fastest (else price --plan)",
    )
    p.add_argument(
        "--runnable-only",
        action="store_true",
        help="search only plans the runtime runs today (Plan.validate accepts)",
    )
    p.add_argument(
        "--vocab-multiple",
        type=int,
        default=128,
        help="price the model with its vocabulary padded to this multiple (1 = as is)",
    )
    p.add_argument(
        "--expert-skew",
        type=float,
        default=0.0,
        metavar="S",
        help="Mixture-of-Experts models: expert popularity is Zipf with exponent S (0 = "
        "balanced, the default; e.g. 1.2); prices each plan's moe_balance under that load",
    )
    p.add_argument(
        "--dtype",
        "--precision",
        dest="dtype",
        default=None,
        help="compute dtype: bf16, fp16, tf32, fp32, or fp8 (priced as bf16) (default: "
        f"training's, bf16; on {LOCAL} without CUDA fp32)",
    )
    p.add_argument(
        "--optimizer-state",
        choices=OPTIMIZER_STATES,
        default="fp32",
        help="dtype of AdamW's two moments, as `interlace train --optimizer-state`: fp32 (16 "
        "bytes per parameter with weight and gradient) or bf16 (12)",
    )


def run_planner(args: argparse.Namespace) -> int:
    """Rank plans (`--search`) or price `--plan`; print a table (or JSON) and, when the fastest
    plan found splits its sequences, why (`context_choice`); with `--trace` also write the
    simulated step of the first plan. Returns 0."""
    model = resolve_model(args.model, args.seq)
    spec = pad_vocab(model, args.vocab_multiple)
    if args.global_batch is None:
        args.global_batch = default_global_batch(model.seq_len, args.seq)
    if args.top < 1:
        raise ConfigError(f"--top {args.top} must be at least 1")
    check_expert_skew(args.expert_skew)
    if args.expert_skew and not model.n_experts:
        raise ConfigError(
            f"--expert-skew {args.expert_skew} describes expert popularity, but {args.model} "
            "has no experts; drop it or give a Mixture-of-Experts model (e.g. experts=16)"
        )
    if not args.search and not args.plan:
        raise ConfigError("give --search to rank plans, or --plan to price one plan")
    plan = None if args.search else Plan.parse(args.plan)
    n = args.gpus or (args.nproc if plan is None else plan.world_size)
    hardware = resolve_hardware(args, n)
    args.dtype = args.dtype or default_dtype(hardware)
    if args.dtype == FP8:
        args.dtype = Precision.of(FP8).compute
        print(
            f"interlace: fp8 priced as {args.dtype}, its other dtype: the planner has no float8 "
            "matmul rates yet (an upper bound on the step)",
            file=sys.stderr,
        )
    if args.calibrate:
        hardware = with_surface(hardware, cached_surface(args.dtype, n, args.recalibrate))
    if args.calibrate_model:
        measured = replace(spec, seq_len=args.seq) if args.seq else spec
        hardware = calibrated_for_model(hardware, measured, args, n)
    if plan is None:
        ranked = search(
            spec,
            hardware,
            n,
            args.global_batch,
            args.seq,
            runnable_only=args.runnable_only,
            **_pricing(args),
        )
        costs = ranked[: args.top]
        why = context_choice(ranked)
    else:
        if args.seq and args.seq != spec.seq_len:
            spec = replace(spec, seq_len=args.seq)
        check_plan(plan, n, spec, args.runnable_only)
        costs = [estimate(plan, spec, hardware, args.global_batch, **_pricing(args))]
        why = None
    if args.trace:
        _write_trace(costs[0], spec, hardware, args)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "vocab_size": spec.vocab_size,
                    "hardware": hardware.name,
                    "gpus": n,
                    "plans": [c.to_dict() for c in costs],
                },
                indent=2,
            )
        )
        return 0
    print(
        f"model {args.model}: {spec.num_params() / 1e9:.2f} B parameters; {n} × "
        f"{hardware.name}; global batch {args.global_batch} × {costs[0].seq_len} tokens"
    )
    if spec.vocab_size != model.vocab_size:
        print(
            f"vocabulary padded {model.vocab_size} → {spec.vocab_size} so tensor parallelism "
            "can split it (--vocab-multiple 1 to keep it)"
        )
    print(format_table(costs))
    for rank, cost in enumerate(costs, 1):
        print(f"#{rank} {format_breakdown(cost)}")
        if not cost.fits:
            print("   does not fit in device memory")
        if args.explain:
            print("   " + explain(cost).replace("\n", "\n   "))
    if why:
        print(why)
    return 0


def default_dtype(hardware: Hardware) -> str:
    """The dtype plans are priced in without --dtype: what a run trains in by default
    (`precision.resolve_precision("auto", …)`): on `local`, bf16 where runs compute on CUDA
    and fp32 on the CPU; bf16 on the presets (GPU clusters)."""
    if hardware.name == LOCAL:
        return resolve_precision("auto", default_device())
    return "bf16"


def resolve_hardware(args: argparse.Namespace, n: int) -> Hardware:
    """`--hardware` (default dgx-a100) for `n` devices; `local` is this machine calibrated for
    `n` ranks, its links at `--bandwidth` when given. ConfigError for options that need local."""
    name = args.hardware or DEFAULT_HARDWARE
    if name != LOCAL:
        if args.recalibrate or args.bandwidth or args.calibrate_model or args.calibrate:
            raise ConfigError(
                f"--recalibrate, --bandwidth, --calibrate and --calibrate-model apply to "
                f"--hardware {LOCAL} only, not {name!r}"
            )
        return get_hardware(name)
    rate = parse_rate(args.bandwidth) / 8 if args.bandwidth else None
    return local_hardware(n, bandwidth=rate, recalibrate=args.recalibrate)


def calibrated_for_model(
    hardware: Hardware, spec: GPTConfig, args: argparse.Namespace, n: int
) -> Hardware:
    """`--calibrate-model`: the local `hardware` with `spec`'s compute in `args.dtype` at the
    efficiency the model's own step reaches on this device at one device's share of the global
    batch (`model_calibration`; said on stderr, so --json stays parseable)."""
    rows = max(1, args.global_batch // n)
    achieved = cached_model_flops(spec, rows, args.dtype, args.recalibrate)
    calibrated = with_model_efficiency(
        hardware, args.dtype, achieved, surface_factor(spec, hardware, rows, args.dtype)
    )
    print(
        f"{args.model}: its {args.dtype} training step reaches {achieved / 1e12:.3g} TFLOP/s "
        f"at {rows} sequences, {calibrated.efficiency(None, args.dtype):.1%} of this "
        "machine's matmul rate (--calibrate-model)",
        file=sys.stderr,
    )
    return calibrated


def _pricing(args: argparse.Namespace) -> dict[str, Any]:
    """The options every priced plan takes from the command line: precision, expert skew and
    optimizer state."""
    return {
        "dtype": args.dtype,
        "expert_skew": args.expert_skew,
        "optimizer_state": args.optimizer_state,
    }


def _write_trace(cost: PlanCost, spec: GPTConfig, hardware: Hardware, args: argparse.Namespace):
    """Simulate `cost`'s plan and write the Chrome trace to --trace and a PNG beside it."""
    sim = simulate(cost.plan, spec, hardware, args.global_batch, **_pricing(args))
    path = Path(args.trace)
    write_chrome_trace(sim.spans, path)
    png = plot_timeline(sim.spans, path.with_suffix(".png"), title=f"{cost.plan} (simulated)")
    print(
        f"simulated step {sim.step_seconds:.4g} s (estimate {cost.step_seconds:.4g} s); "
        f"trace {path}, {png}"
    )


def format_table(costs: list[PlanCost]) -> str:
    """One row per plan: rank, step seconds, TFLOP/s per device, MFU, GiB per device, plan."""
    rows = [("#", "step s", "TFLOP/s/dev", "MFU", "mem GiB", "plan")]
    for rank, c in enumerate(costs, 1):
        rows.append(
            (
                str(rank),
                f"{c.step_seconds:.3g}",
                f"{c.tflops_per_device:.1f}",
                f"{c.mfu:.1%}",
                f"{c.memory_bytes_per_device / GIB:.1f}",
                str(c.plan),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def format_breakdown(cost: PlanCost) -> str:
    """'compute 9.62 s, pp.bubble 1.19 s, …' largest first (zero terms left out)."""
    terms = sorted(cost.breakdown.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {seconds:.3g} s" for name, seconds in terms if seconds > 0)
