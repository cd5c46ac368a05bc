"""Running documented blocks as tests (docs/testing.md, "Documented commands"): which other
commands a doc may use, how blocks group into runs, and a run in a fresh folder, each
`interlace` command scaled (doc_scaling) and required to exit 0."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from doc_blocks import ROOT, SHELL, Block, Command, commands
from doc_scaling import scale, scale_toml, step_factor, toml_steps, train_steps

RUN_AS_IS = ("python", "mkdir")
"""Other commands a runnable block may use; they run unchanged (`python`: this interpreter)."""

NOT_RUN = ("make", "pip", "tensorboard", "wandb", ".venv/bin/pytest")
"""Other commands any block may use, never run: the project's own targets (`make test` is this
suite, `make demo` a full run), installing, a server that runs until stopped, uploading."""

SEEDS = ("docs", "tests/data", "benchmarks/results", "examples")
"""Repository folders the docs name by relative path; a run's folder starts with copies."""

COMMAND_TIMEOUT_S = 300


def chains(blocks: list[Block]) -> list[list[Block]]:
    """The runs the blocks make: each runnable block or settings file (`Block.file_name`) with
    the `continues` blocks after it in its doc, if one of them has something to run."""
    found: list[list[Block]] = []
    for block in blocks:
        if block.mark and block.mark.kind == "continues":
            if found and found[-1][0].doc == block.doc:
                found[-1].append(block)
        elif block.runs or block.file_name:
            found.append([block])
    return [chain for chain in found if any(_runs_something(block) for block in chain)]


def _runs_something(block: Block) -> bool:
    """True for a runnable block with a command or example the test runs."""
    if not block.runs:
        return False
    return block.lang == "python" or any(c.argv[0] not in NOT_RUN for c in commands(block))


def run_chain(chain: list[Block], folder: Path) -> None:
    """Run the blocks of `chain` in order in `folder`; AssertionError naming the first command
    or example that fails."""
    for seed in SEEDS:
        shutil.copytree(ROOT / seed, folder / seed)
    factor = step_factor(_step_counts(chain))
    for block in chain:
        if block.file_name:
            (folder / block.file_name).write_text(scale_toml(block.text, factor))
        elif block.lang == "python":
            _run(block.name, [sys.executable, "-"], folder, stdin=block.text)
        elif block.lang in SHELL:
            for command in commands(block):
                argv = _argv(command, factor)
                if argv:
                    where = f"{block.doc}:{command.line}"
                    _run(where, argv, folder, command.env, command.stdin)


def _step_counts(chain: list[Block]) -> list[int]:
    """Every step count of the chain's train commands and settings files."""
    counts: list[int | None] = []
    for block in chain:
        if block.file_name:
            counts += toml_steps(block.text)
        elif block.lang in SHELL:
            train = [c.argv[1:] for c in commands(block) if c.argv[:2] == ["interlace", "train"]]
            counts += [train_steps(argv) for argv in train]
    return [count for count in counts if count is not None]


def _argv(command: Command, factor: int) -> list[str] | None:
    """What the test runs for a documented command; None for one it does not run."""
    word = command.argv[0]
    if word == "interlace":
        scaled = scale(command.argv[1:], factor, command.line)
        return [sys.executable, "-m", "interlace.cli", *scaled]
    if word == "python":
        return [sys.executable, *command.argv[1:]]
    if word in RUN_AS_IS:
        return command.argv
    assert word in NOT_RUN, f"line {command.line}: `{word}` is not a command a doc may run"
    return None


def _run(
    where: str,
    argv: list[str],
    folder: Path,
    env: dict[str, str] | None = None,
    stdin: str | None = None,
) -> None:
    """Run `argv` in `folder`; AssertionError with its output's tail unless it exits 0."""
    done = subprocess.run(
        argv,
        cwd=folder,
        env={**os.environ, **(env or {})},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
    assert done.returncode == 0, f"{where}: exit {done.returncode}: {argv[1:]}\n{tail}"
