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
from dataclasses import replace

from interlace.errors import ConfigError
from interlace.models.config import GPTConfig
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.cost import PlanCost, estimate
from interlace.planner.hardware import GIB, PRESETS, get_hardware
from interlace.planner.search import check_plan, explain, pad_vocab, search

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
        help=f"cluster to price plans on: {', '.join(PRESETS)} (default with --search: "
        f"{DEFAULT_HARDWARE})",
    )
    p.add_argument("--gpus", type=int, default=None, help="devices to plan for (default: --nproc)")
    p.add_argument("--global-batch", type=int, default=512, help="sequences per optimizer step")
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
    p.add_argument("--dtype", default="bf16", help="compute dtype: bf16, fp16, tf32, fp32")


def run_planner(args: argparse.Namespace) -> int:
    """Rank plans (`--search`) or price `--plan`; print a table (or JSON). Returns 0."""
    hardware = get_hardware(args.hardware or DEFAULT_HARDWARE)
    model = resolve_model(args.model, args.seq)
    spec = pad_vocab(model, args.vocab_multiple)
    if args.top < 1:
        raise ConfigError(f"--top {args.top} must be at least 1")
    if args.search:
        n = args.gpus or args.nproc
        costs = search(
            spec,
            hardware,
            n,
            args.global_batch,
            args.seq,
            dtype=args.dtype,
            runnable_only=args.runnable_only,
        )[: args.top]
    elif args.plan:
        plan = Plan.parse(args.plan)
        n = args.gpus or plan.world_size
        if args.seq and args.seq != spec.seq_len:
            spec = replace(spec, seq_len=args.seq)
        check_plan(plan, n, spec, args.runnable_only)
        costs = [estimate(plan, spec, hardware, args.global_batch, dtype=args.dtype)]
    else:
        raise ConfigError("give --search to rank plans, or --plan to price one plan")
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
    return 0


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
