"""`interlace plan`: check a plan against a model and world size and describe it (the mesh, the
state per rank, whether any device holds it, the pipeline's stages), or hand a priced question
(`--search`, `--hardware`, calibration) to the planner's command line."""

from __future__ import annotations

import argparse

from interlace.config_file import apply_settings, given_options, read_config
from interlace.errors import ConfigError
from interlace.models.config import GPTConfig
from interlace.models.presets import PRESETS, get_preset
from interlace.plan import Plan
from interlace.train_config import TrainConfig


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """The `plan` options, the planner's own (`--search`, `--hardware`, ...) included."""
    p.add_argument("--model", default=TrainConfig.model, metavar="PRESET", help="model preset")
    p.add_argument("--plan", default=None, help="plan to check (default: dp=<nproc>)")
    p.add_argument("--nproc", type=int, default=1, help="world size to check the plan against")
    p.add_argument("--list", action="store_true", help="list the model presets and exit")
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="take --model, --plan, --nproc, --seq, --global-batch and --optimizer-state from a "
        "train settings file (model, plan, nproc, seq_len, global_batch, optimizer_state); "
        "options given here win",
    )
    p.add_argument(
        "--show-stages",
        action="store_true",
        help="with pp > 1: the pipeline split, each stage's layers, cost and memory",
    )
    p.add_argument(
        "--micro-batch-rows",
        type=int,
        default=1,
        help="sequences per pipeline micro-batch, for the activation memory of --show-stages",
    )
    from interlace.planner.cli import add_planner_args

    add_planner_args(p)


_PLAN_SETTINGS = {
    "model": "model",
    "plan": "plan",
    "nproc": "nproc",
    "seq_len": "seq",
    "global_batch": "global_batch",
    "optimizer_state": "optimizer_state",
}
"""The `interlace plan` options (values) a train settings file gives (keys)."""


def run_plan(args: argparse.Namespace, argv: list[str]) -> int:
    from interlace.mesh import mesh_dims
    from interlace.planner.bytes import state_bytes_per_param

    if args.config is not None:
        settings = read_config(args.config)
        picked = {dest: settings[key] for key, dest in _PLAN_SETTINGS.items() if key in settings}
        apply_settings(args, picked, given_options(add_plan_args, argv))
    if args.list:
        for name, cfg in PRESETS.items():
            kind = f"MoE {cfg.n_experts} experts top-{cfg.top_k}" if cfg.is_moe else "dense"
            if cfg.position_encoding == "rotary":
                kind += ", Llama shape"
            heads = f"{cfg.n_heads}/{cfg.kv_heads}kv" if cfg.kv_heads != cfg.n_heads else ""
            print(
                f"{name:18s} {cfg.num_params() / 1e6:12,.1f} M params  {cfg.n_layers:3d} layers"
                f"  d={cfg.d_model:<6d} heads={heads or cfg.n_heads:<7} {kind}"
            )
        return 0
    local_only = args.calibrate_model or args.calibrate or args.recalibrate or args.bandwidth
    if args.search or args.hardware is not None or local_only:  # priced: refused off local
        from interlace.planner.cli import run_planner

        return run_planner(args)
    model = get_preset(args.model)
    plan = Plan.parse_for(args.plan or "", args.nproc).validate(args.nproc, model)
    names, sizes = mesh_dims(plan)
    params = model.num_params()
    shard = plan.pp * plan.tp_size * plan.dp_shard
    print(f"plan        {plan}")
    print(
        f"mesh        {' x '.join(f'{n}={s}' for n, s in zip(names, sizes, strict=True))} "
        "(outermost first)"
    )
    print(f"model       {args.model}: {params:,} parameters")
    state = state_bytes_per_param(args.optimizer_state) * params / shard
    print(
        f"memory/rank {state / 2**30:.2f} GiB for fp32 weights + grads + "
        f"{args.optimizer_state} AdamW moments (activations not included)"
    )
    _say_if_no_device_holds(state)
    if args.show_stages:
        _show_stages(model, plan, args.micro_batch_rows)
    return 0


def _say_if_no_device_holds(state_bytes: float) -> None:
    """One line when a rank's weights, gradients and optimizer state alone exceed the memory of
    every device the hardware presets know."""
    from interlace.planner.hardware import PRESETS as HARDWARE

    largest = max(HARDWARE.values(), key=lambda hardware: hardware.memory_bytes)
    if state_bytes > largest.memory_bytes:
        print(
            f"fits        no: more than one device of any hardware preset holds (at most "
            f"{largest.memory_bytes / 2**30:.0f} GiB, {largest.name}); split the model over "
            "more ranks (dp_shard, tp, pp) or let `interlace plan --search` choose"
        )


def _show_stages(model_config: GPTConfig, plan: Plan, rows: int) -> None:
    """Print the partitioner's split of `model_config` (built on the meta device) for `plan`."""
    from interlace.models.gpt import build_model
    from interlace.parallel.pipeline.layout import pipeline_layout

    if not plan.pipelined:
        raise ConfigError(
            "--show-stages needs a plan with pp > 1, e.g. --plan pp=4,micro_batches=8"
        )
    layout = pipeline_layout(build_model(model_config, device="meta"), plan)
    print(layout.describe(micro_batch_tokens=rows * model_config.seq_len))
