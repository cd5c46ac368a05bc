"""The fenced code blocks of README.md and docs/*.md, each with its doc-test mark, and the shell
commands of a block, read as a shell would: `\\` continuations joined, a quoted string or a
heredoc spanning lines kept whole, comments dropped, `&&` and `;` splitting commands, and in a
`console` block only the `$ ` lines (the rest is output). The rules are in docs/testing.md,
"Documented commands"."""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

SHELL = ("bash", "sh", "console")
"""Languages whose blocks hold commands."""

MARKS = ("skip", "parse-only", "continues")
"""`<!-- doc-test: KIND (reason) -->` on the line above a fence: `parse-only`, the block is
checked (commands parsed, Python compiled) but not run; `skip`, not even checked; `continues`,
it runs after the blocks above it in the same folder (it uses what they wrote)."""

_FENCE = re.compile(r"^\s*```(\S*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*doc-test:\s*(\S+)\s*\((.+)\)\s*-->\s*$")
_HEREDOC = re.compile(r"<<-?\s*'?\"?(\w+)'?\"?")
_ENV = re.compile(r"^[A-Za-z_]\w*=")
_FILE = re.compile(r"^#\s*([\w./-]+\.toml)\s*$")


@dataclass(frozen=True)
class Mark:
    """A block's doc-test mark: `kind` (one of MARKS, or what the doc misspelled) and why."""

    kind: str
    reason: str


@dataclass(frozen=True)
class Block:
    """One fenced code block: its doc (relative to the repository), the fence's line number,
    language, text and mark."""

    doc: str
    line: int
    lang: str
    text: str
    mark: Mark | None

    @property
    def name(self) -> str:
        """`doc:line`, the block's name in test ids and messages."""
        return f"{self.doc}:{self.line}"

    @property
    def runs(self) -> bool:
        """True for a shell or Python block the slow tests run: unmarked, or `continues`."""
        runnable = self.lang in (*SHELL, "python")
        return runnable and (self.mark is None or self.mark.kind == "continues")

    @property
    def file_name(self) -> str | None:
        """The file a settings block stands for, named by its first line (`# run.toml`)."""
        found = _FILE.match(self.text.partition("\n")[0])
        return found[1] if found and self.lang == "toml" else None


@dataclass(frozen=True)
class Command:
    """One shell command of a block: its line in the doc, leading `NAME=value` settings, its
    words, and the text a heredoc feeds it (None without one)."""

    line: int
    env: dict[str, str]
    argv: list[str]
    stdin: str | None = None


def read_blocks(doc: Path) -> list[Block]:
    """Every fenced code block of `doc`, in order."""
    lines = doc.read_text().splitlines()
    blocks, start = [], None
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if fence is None:
            continue
        if start is None:
            start, lang = number, fence.group(1)
            continue
        mark = _MARK.match(lines[start - 2]) if start > 1 else None
        blocks.append(
            Block(
                doc=str(doc.relative_to(ROOT)),
                line=start,
                lang=lang,
                text=textwrap.dedent("\n".join(lines[start : number - 1]) + "\n"),
                mark=Mark(*mark.groups()) if mark else None,
            )
        )
        start = None
    return blocks


def all_blocks() -> list[Block]:
    """The blocks of every documentation file."""
    return [block for doc in DOCS for block in read_blocks(doc)]


def commands(block: Block) -> list[Command]:
    """The shell commands of a SHELL block, in order."""
    lines = block.text.splitlines()
    found, i = [], 0
    while i < len(lines):
        first, text = i, lines[i].strip()
        i += 1
        if block.lang == "console":
            if not text.startswith("$ "):
                continue
            text = text[2:]
        if not text or text.startswith("#"):
            continue
        while text.endswith("\\") or _open_quote(text):
            if text.endswith("\\"):
                text = text[:-1] + " " + lines[i].strip()
            else:
                text += "\n" + lines[i]
            i += 1
        stdin = None
        heredoc = _HEREDOC.search(text)
        if heredoc:
            end = lines.index(heredoc.group(1), i)
            stdin = "\n".join(lines[i:end]) + "\n"
            text, i = text[: heredoc.start()], end + 1
        found += [_command(block.line + first + 1, words, stdin) for words in _split(text)]
    return found


def _open_quote(text: str) -> bool:
    """True when `text` ends inside a quoted string."""
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return True
    return False


def _split(text: str) -> list[list[str]]:
    """The words of each simple command of `text`, split at `&&` and `;`."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&")
    lexer.whitespace_split = True
    parts: list[list[str]] = [[]]
    for word in lexer:
        if word in ("&&", ";"):
            parts.append([])
        else:
            parts[-1].append(word)
    return [part for part in parts if part]


def _command(line: int, words: list[str], stdin: str | None) -> Command:
    """A Command from its words, the leading `NAME=value` ones taken as its settings."""
    env = {}
    while words and _ENV.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return Command(line, env, words, stdin)
