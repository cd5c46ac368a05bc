"""Every command and Python example in README.md and docs/*.md is a test (docs/testing.md,
"Documented commands"). Each block is checked here in seconds: its mark is well-formed, every
`interlace` command parses (options, plan, benchmark settings), every other command is one a
doc may use, and Python compiles. The slow tests run every runnable block, scaled, in a fresh
folder."""

from __future__ import annotations

import contextlib
import doctest
import io
import re
import shlex

import pytest

from doc_blocks import DOCS, MARKS, ROOT, SHELL, Block, all_blocks, commands
from doc_runs import NOT_RUN, RUN_AS_IS, chains, run_chain
from doc_scaling import QUICK_BENCH, scale, small_preset, step_factor, train_steps, why_not_run
from interlace.bench import get_benchmark
from interlace.bench.runner import parse_options
from interlace.cli import build_parser
from interlace.plan import Plan

BLOCKS = all_blocks()


def _python_source(block: Block) -> str:
    """A Python block's code; for a doctest (`>>>` lines), the code of its examples."""
    if block.text.lstrip().startswith(">>>"):
        return "".join(e.source for e in doctest.DocTestParser().get_examples(block.text))
    return block.text


def _check_interlace(argv: list[str], launched: bool = True) -> None:
    """AssertionError unless `interlace <argv>` parses: its options, its --plan (checked
    against --nproc for a train command that launches its ranks, `launched`, and takes no
    settings from --config or --resume), and a benchmark's name and --set settings."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit as exit:
        assert exit.code == 0, stderr.getvalue().strip().splitlines()[-1]
        return
    if getattr(args, "plan", None) not in (None, "auto"):
        plan = Plan.parse_for(args.plan, args.nproc)
        settled = args.command == "train" and args.config is None and args.resume is None
        if launched and settled:
            plan.validate(args.nproc)
    if args.command == "bench" and args.name not in QUICK_BENCH:
        bench = get_benchmark(args.name)
        options = parse_options(bench, args.set)
        if bench.check is not None:
            bench.check(options)


def _check_command(block: Block, argv: list[str]) -> None:
    """AssertionError unless the command `argv` of `block` is one the block may hold."""
    word = argv[0]
    if word == "interlace":
        _check_interlace(argv[1:])
        assert not block.runs or why_not_run(argv[1:]) is None, why_not_run(argv[1:])
    elif word == "torchrun":
        assert not block.runs, "torchrun starts ranks on several nodes: mark the block"
        _check_interlace(["train", *argv[argv.index("interlace.train") + 1 :]], launched=False)
    else:
        assert word in RUN_AS_IS or word in NOT_RUN, f"`{word}` is unknown: mark the block"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_block_is_checked_or_marked(block: Block) -> None:
    if block.mark is not None:
        assert block.mark.kind in MARKS, f"mark '{block.mark.kind}': one of {MARKS}"
        if block.mark.kind == "skip":
            return
    if block.lang == "python":
        compile(_python_source(block), block.name, "exec")
    elif block.lang in SHELL:
        for command in commands(block):
            try:
                _check_command(block, command.argv)
            except Exception as error:
                raise AssertionError(f"{block.doc}:{command.line}: {error}") from error
    else:
        first = block.text.lstrip().partition("\n")[0]
        assert block.lang or not first.startswith(("interlace ", "$ ")), (
            "an unlabeled block of commands: label it bash or console (text for a synopsis)"
        )


def test_marks_sit_above_blocks() -> None:
    fences = {(block.doc, block.line) for block in BLOCKS}
    for doc in DOCS:
        name = str(doc.relative_to(ROOT))
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if re.match(r"\s*<!--\s*doc-test", line):
                assert (name, number + 1) in fences, f"{name}:{number}: no code block below"


def test_continued_blocks_follow_a_run() -> None:
    continued = {block for chain in chains(BLOCKS) for block in chain}
    for block in BLOCKS:
        if block.mark and block.mark.kind == "continues":
            assert block in continued, f"{block.name}: no runnable block above to continue"


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("chain", chains(BLOCKS), ids=lambda chain: chain[0].name)
def test_documented_block_runs(chain: list[Block], tmp_path) -> None:
    run_chain(chain, tmp_path)


def test_scaling_keeps_what_a_resume_needs() -> None:
    first = shlex.split("train --steps 100 --ckpt-every 25 --out runs/a")
    then = shlex.split("train --steps 200 --out runs/b --resume runs/a/checkpoints/step-00000075")
    factor = step_factor([train_steps(first), train_steps(then)])
    first_scaled = "train --out runs/a --steps 2 --global-batch 8 --ckpt-every 1"
    assert " ".join(scale(first, factor, 1)) == first_scaled
    resumed = "train --out runs/b --resume runs/a/checkpoints/step-00000002 --steps 4"
    assert " ".join(scale(then, factor, 2)) == resumed
    alone = shlex.split("train --nproc 2")
    alone_scaled = "train --nproc 2 --steps 4 --global-batch 8 --out runs/line-7"
    assert " ".join(scale(alone, step_factor([train_steps(alone)]), 7)) == alone_scaled


def test_scaling_keeps_presets_of_their_kind() -> None:
    kept = {"gpt2-124m": "demo", "moe-gpt-12l": "moe-tiny", "tiny": "tiny", "my.json": "my.json"}
    assert {model: small_preset(model) for model in kept} == kept
