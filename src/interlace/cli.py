"""The `interlace` command line: `train`, `data`, `plan`, `export`, `svm` and `bench` (each
with `--help`).

Bad input is reported as one line on stderr with exit code 2, before anything is written or any
rank is started.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from interlace import __version__
from interlace.config_args import add_dataclass_args, dataclass_from_args
from interlace.config_file import (
    CONFIG_FILE,
    apply_settings,
    describe_changes,
    given_options,
    read_config,
    resolved_settings,
    write_config,
)
from interlace.earlier_run import clear_earlier_run, refuse_earlier_run
from interlace.errors import ConfigError, InterlaceError, NonFiniteError, OutputError, RunStopped
from interlace.plan import Plan
from interlace.plan_command import add_plan_args, run_plan
from interlace.train_config import TrainConfig

if TYPE_CHECKING:
    from interlace.train import RunSetup


def _add_train_args(p: argparse.ArgumentParser) -> None:
    """The `train` options: every TrainConfig field, then the run's own (ranks, plan, resume)."""
    add_dataclass_args(p, TrainConfig)
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="read the run's settings from a TOML file: TrainConfig fields, plan, nproc, "
        "max_restarts (a run folder's config.toml repeats that run); options given here win",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks to start on this machine (ignored under torchrun)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="when a rank fails, restart every rank up to N times, each restart continuing "
        "from the newest valid checkpoint in --out (ignored under torchrun, which has its own)",
    )
    p.add_argument(
        "--plan",
        default=None,
        help="parallel plan, e.g. 'dp=4' or 'ep=4,moe_balance=prophet'; dp not given fills "
        "the ranks (default: dp=<nproc>)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="CKPT",
        help="continue from CKPT (a checkpoint or run folder; default: the newest "
        "checkpoint in --out); auto: the newest checkpoint in --out if it holds one, else "
        "start afresh there (what every restart does)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run's files in --out instead of refusing",
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="OUT.json",
        help="record the second step's pipeline timeline on every rank (pp > 1): a Chrome "
        "trace for Perfetto at OUT.json and OUT.png beside it",
    )


def _check_trace(args: argparse.Namespace, plan: Plan) -> None:
    """ConfigError for a --trace path or plan that cannot be traced (before any work)."""
    if args.trace is not None:
        from interlace.parallel.pipeline.trace import check_trace_path

        check_trace_path(args.trace, plan.pp)


def _checkpoint_to_resume(args: argparse.Namespace, setup: RunSetup) -> Path | None:
    """The verified checkpoint `--resume` names (None without --resume); CheckpointError if it
    is corrupt or from another run, ConfigError if it leaves nothing to train."""
    from interlace.checkpoint import resolve_checkpoint, verify_checkpoint
    from interlace.train import run_identity

    if args.resume is None:
        return None
    checkpoint = resolve_checkpoint(Path(args.resume or args.out))
    done = verify_checkpoint(checkpoint, run_identity(setup))["step"]
    if done >= args.steps:
        raise ConfigError(
            f"checkpoint '{checkpoint}' is already at step {done}, so --steps={args.steps} "
            f"leaves nothing to train; pass --steps greater than {done}"
        )
    return checkpoint


def _check_out_dir(args: argparse.Namespace, setup: RunSetup) -> None:
    """ConfigError if --out is not a folder that can take this run: not writable, too little
    free space for one checkpoint, or holding an earlier run without --resume/--overwrite."""
    from interlace.run_folder import check_writable, checkpoint_bytes

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out '{out}' exists and is not a folder")
    check_writable(out, checkpoint_bytes(setup.model_config.num_params()))
    if args.resume is None and not args.overwrite:
        refuse_earlier_run(out)


def _clear_out_dir(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.overwrite and args.resume is None:
        clear_earlier_run(out)


def _resolve_auto_resume(args: argparse.Namespace) -> None:
    """`--resume auto`, which every restart of a launched job implies: continue from the newest
    checkpoint in --out when it holds one (`resolve_checkpoint` falls back from a bad newest
    one), else start afresh there, replacing the files of an attempt that saved none."""
    from interlace.launch import restart_count

    if restart_count() > 0:
        args.resume = "auto"
    if args.resume != "auto":
        return
    from interlace.run_folder import holds_checkpoint

    saved = holds_checkpoint(Path(args.out))
    args.resume, args.overwrite = ("", False) if saved else (None, True)


def _layer_settings(args: argparse.Namespace, argv: list[str]) -> dict | None:
    """Fill `args` from the settings beneath the options `argv` gives: the --config file, then,
    when resuming, the run's own config.toml in --out (its `out` aside); resolves --resume auto.
    Returns the run's saved settings (None unless resuming from some)."""
    keep = given_options(_add_train_args, argv)
    if args.config is not None:
        settings = read_config(args.config)
        apply_settings(args, settings, keep)
        keep |= settings.keys()
    _resolve_auto_resume(args)
    saved_file = Path(args.out) / CONFIG_FILE
    if args.resume is None or not saved_file.is_file():
        return None
    saved = read_config(saved_file)
    apply_settings(args, saved, keep | {"out"})
    return saved


def _record_settings(args: argparse.Namespace, setup: RunSetup, saved: dict | None) -> None:
    """Keep the run's resolved settings as config.toml in --out, first saying what changed
    against the `saved` ones of a resumed run (by the one process, or rank 0)."""
    settings = resolved_settings(setup.config, setup.plan, args.max_restarts)
    file = Path(args.out) / CONFIG_FILE
    if saved is not None:
        print(f"interlace: {describe_changes(saved, settings, file)}", file=sys.stderr)
    write_config(file, settings)


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    from interlace.launch import in_launched_rank, launch_local, quiet_when_a_peer_is_lost

    saved = _layer_settings(args, argv)
    if in_launched_rank():
        with quiet_when_a_peer_is_lost():
            return _train_rank(args, saved)
    if args.nproc < 1:
        raise ConfigError(f"--nproc={args.nproc} must be >= 1")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts={args.max_restarts} must be >= 0 (0: no restart)")
    config = dataclass_from_args(TrainConfig, args).validate()
    if args.plan == "auto":
        argv = _choose_plan(args, argv, config)
    plan = Plan.parse_for(args.plan or "", args.nproc)
    from interlace.train import Trainer, prepare_run

    setup = prepare_run(config, plan, args.nproc)
    _check_trace(args, plan)
    _check_out_dir(args, setup)
    checkpoint = _checkpoint_to_resume(args, setup)
    _clear_out_dir(args)
    if args.nproc > 1 or args.max_restarts:
        launch_local(args.nproc, ["interlace.train", *argv], args.max_restarts)
        return 0
    _record_settings(args, setup, saved)
    trainer = Trainer(setup)
    if checkpoint is not None:
        trainer.resume(checkpoint)
    _print_summary(trainer.fit(earlier_run="keep"), args.out)
    return 0


def _choose_plan(args: argparse.Namespace, argv: list[str], config: TrainConfig) -> list[str]:
    """`--plan auto`: print the planner's choice for this machine and --nproc, set it as
    args.plan and return `argv` with it in place of "auto", or added last where "auto" came
    from a --config file (for the launched ranks)."""
    from interlace.planner.auto import choose_plan, describe_choice

    chosen, ranked = choose_plan(config, args.nproc)
    print(describe_choice(chosen, ranked))
    args.plan = str(chosen.plan)
    ranks_argv = [
        f"--plan={args.plan}"
        if a == "--plan=auto"
        else args.plan
        if a == "auto" and i and argv[i - 1] == "--plan"
        else a
        for i, a in enumerate(argv)
    ]
    return ranks_argv if ranks_argv != argv else [*argv, f"--plan={args.plan}"]


def _train_rank(args: argparse.Namespace, saved: dict | None) -> int:
    """One rank under torchrun or `interlace train --nproc N`; `saved`: the settings of the
    resumed run (`_layer_settings`)."""
    import torch.distributed as dist

    from interlace.launch import die_with_launcher, init_from_env
    from interlace.mesh import build_mesh
    from interlace.train import Trainer, prepare_run

    die_with_launcher()
    device = init_from_env()
    try:
        plan = Plan.parse_for(args.plan or "", dist.get_world_size())
        setup = prepare_run(dataclass_from_args(TrainConfig, args), plan, dist.get_world_size())
        checkpoint = _checkpoint_to_resume(args, setup)
        if dist.get_rank() == 0:
            _report_restart(checkpoint)
            _check_out_dir(args, setup)
            _clear_out_dir(args)
        dist.barrier()  # every rank has read the settings that rank 0 now replaces
        if dist.get_rank() == 0:
            _record_settings(args, setup, saved)
        trainer = Trainer(setup, build_mesh(plan, device), trace=args.trace)
        if checkpoint is not None:
            trainer.resume(checkpoint)
        report = trainer.fit(earlier_run="keep")  # checked and cleared above
        if dist.get_rank() == 0:
            _print_summary(report, args.out)
    finally:
        dist.destroy_process_group()
    return 0


def _report_restart(checkpoint: Path | None) -> None:
    """On a restart of a launched job, one stderr line saying where it continues."""
    from interlace.launch import restart_count

    if restart_count():
        where = f"continuing from '{checkpoint}'" if checkpoint else "no checkpoint, from step 0"
        print(f"interlace: restart {restart_count()}: {where}", file=sys.stderr)


def _print_summary(report: dict, out: str) -> None:
    eval_loss = report.get("final_eval_loss")
    tail = f", held-out {_loss(eval_loss)}" if eval_loss is not None else ""
    skipped = report.get("skipped_steps")
    tail += f", {skipped} steps skipped (non-finite)" if skipped else ""
    print(
        f"done: {report['steps']} steps, loss {_loss(report['first_loss'])} -> "
        f"{_loss(report['final_loss'])}{tail}, {report['mean_tokens_per_s']:.0f} tokens/s; "
        f"report in {out}/"
    )
    if report.get("memory"):
        from interlace.memory import describe_memory

        print(describe_memory(report["memory"]))
    if report.get("profile_device_time"):
        from interlace.device_time import DeviceTime, describe

        print(f"profile of rank 0 (every rank's in {out}/profile/):")
        print(describe(DeviceTime(**report["profile_device_time"])))
    for note in report.get("notes", []):
        print(f"note: {note}")


def _loss(value: float | None) -> str:
    """A loss for the summary line: 3 decimals; `nan` for a non-finite one (null in JSON)."""
    return "nan" if value is None or not math.isfinite(value) else f"{value:.3f}"


def _add_data_args(p: argparse.ArgumentParser) -> None:
    from interlace.data.commands import add_data_args

    add_data_args(p)


def _data(args: argparse.Namespace, argv: list[str]) -> int:
    from interlace.data.commands import run_data

    return run_data(args)


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "name",
        help="benchmark to run; 'list' lists them, 'report' writes "
        "BENCHMARKS.md from the JSON in --out",
    )
    p.add_argument("--page", default="BENCHMARKS.md", help="page that 'report' writes")
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="ranks in the emulated cluster (default: the benchmark's, usually 2)",
    )
    p.add_argument(
        "--bandwidth",
        default="1gbit",
        help="shaped rate of every rank's link, e.g. 1gbit, 200mbit; 'loopback' for no shaping",
    )
    p.add_argument(
        "--out",
        default="benchmarks/results",
        metavar="DIR",
        help="folder for <name>.json and <name>.png",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one of the benchmark's options, typed like its default, e.g. --set "
        "steps=5; repeatable. `interlace bench list` shows each option's default and meaning",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds before giving up")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run it N times; the JSON keeps every run and their spread",
    )
    p.add_argument(
        "--cpu-per-rank",
        type=float,
        default=None,
        help="cap each rank at this many cores' time (cgroups, root), so ranks sharing a CPU "
        "do not lend each other idle time, as separate accelerators cannot; default: no cap",
    )


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    """`interlace bench`: list, report or run one benchmark; a run that fails exits with 1."""
    from interlace.bench import REGISTRY, get_benchmark
    from interlace.bench.runner import BenchFailed, run_benchmark

    if args.name == "report":
        from interlace.bench.markdown import write_page

        write_page(Path(args.out), Path(args.page))
        print(f"wrote {args.page} from {args.out}/*.json")
        return 0
    if args.name == "list":
        for name in REGISTRY:
            bench = get_benchmark(name)
            print(f"{name:12s} {bench.summary}")
            print("\n".join(bench.option_lines()) or "  no options")
        return 0
    try:
        run_benchmark(
            args.name,
            args.ranks,
            args.bandwidth,
            Path(args.out),
            args.set,
            command="interlace bench " + shlex.join(argv),
            timeout_s=args.timeout,
            repeat=args.repeat,
            cpu_per_rank=args.cpu_per_rank,
        )
    except BenchFailed as exc:
        return _failed(exc)
    return 0


def _add_svm_args(p: argparse.ArgumentParser) -> None:
    try:
        from interlace.svm.cli import add_svm_args
    except ModuleNotFoundError:  # without the svm extra the other commands still work
        p.add_argument("args", nargs="*", help="needs the svm extra: pip install 'interlace[svm]'")
        return
    add_svm_args(p)


def _svm(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        from interlace.svm.cli import run_svm
    except ModuleNotFoundError as missing:
        raise ConfigError(str(missing)) from None
    return run_svm(args)


def _add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN_DIR", help="the run folder (train's --out)")
    p.add_argument("out", metavar="OUT", help="the folder to write")
    p.add_argument(
        "--to",
        choices=["hf"],
        required=True,
        help="format: hf, a Hugging Face folder (model.safetensors, config.json): the built-in "
        "GPT as GPT-2, a hf:PATH model as itself",
    )
    p.add_argument(
        "--checkpoint",
        type=int,
        default=None,
        metavar="N",
        help="the step whose checkpoint to export (none: the newest valid one)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")


def _export(args: argparse.Namespace, argv: list[str]) -> int:
    """`interlace export`: one checkpoint of a run written in another format."""
    from interlace.export.hf_folder import export_hf

    for line in export_hf(Path(args.run), Path(args.out), args.checkpoint, args.overwrite):
        print(line)
    return 0


_COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "train": ("train a model (the main job)", _add_train_args, _train),
    "data": ("tokenize text into token shards, or verify them", _add_data_args, _data),
    "plan": (
        "check a plan against a model and world size, and describe it",
        add_plan_args,
        run_plan,
    ),
    "export": (
        "write a run's checkpoint as a Hugging Face model folder",
        _add_export_args,
        _export,
    ),
    "svm": ("fit a sparse linear SVM with a nonconvex penalty", _add_svm_args, _svm),
    "bench": (
        "measure side by side on an emulated, bandwidth-shaped cluster",
        _add_bench_args,
        _bench,
    ),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser: `interlace <command> [options]`. With `only`, the options of that
    command alone are declared (the others keep their name and help), so a command does not
    import what another's options need (scikit-learn for `svm`, each bench's settings)."""
    parser = argparse.ArgumentParser(
        prog="interlace",
        description="Hybrid-parallel training of dense and Mixture-of-Experts transformers.",
    )
    parser.add_argument("--version", action="version", version=f"interlace {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, _) in _COMMANDS.items():
        command = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        if only in (None, name):
            add_args(command)
    return parser


def _failed(error: Exception, exit_code: int = 1) -> int:
    """Report a run that started and failed (a rank's error or a timeout); returns `exit_code`."""
    print(f"interlace: {error}", file=sys.stderr)
    return exit_code


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `interlace` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run_command(argv)
    except KeyboardInterrupt:  # the ranks of `--nproc N` leave the one line to their launcher
        from interlace.launch import rank_of_local_launch

        if not rank_of_local_launch():
            print("interlace: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader (e.g. `| head`) left; stop quietly
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (no flush error at exit)
        return 0


def _run_command(argv: list[str]) -> int:
    """Parse `argv` and run its command; an error it reports becomes one line and its code."""
    named = next((word for word in argv if not word.startswith("-")), None)
    args = build_parser(named if named in _COMMANDS else None).parse_args(argv)
    from interlace.launch import LaunchFailed

    try:
        return _COMMANDS[args.command][2](args, argv[argv.index(args.command) + 1 :])
    except InterlaceError as exc:
        print(f"interlace: error: {exc}", file=sys.stderr)
        return 2
    except RunStopped as exc:  # 3: the run's files, 4: non-finite values
        print(f"interlace: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except LaunchFailed as exc:
        if exc.exit_code in (OutputError.exit_code, NonFiniteError.exit_code):
            return exc.exit_code  # the rank printed its one line
        return _failed(exc, exc.exit_code)


if __name__ == "__main__":
    sys.exit(main())
