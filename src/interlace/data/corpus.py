"""Training text: the built-in corpus or the user's files, read into one string.

The built-in corpus is the Python documentation shipped inside every CPython install
(`pydoc_data.topics`, ~465 KB of English prose and code), so a run needs no download.
"""

import os
import re
from pathlib import Path

from interlace.errors import DataError

BUILTIN_CORPUS = "builtin:pydoc_data.topics"
TEXT_SUFFIXES = (".txt", ".md", ".rst")
_SEPARATOR = "\n\n"
CONTROL_LIMIT = 0.1
"""Largest share of control characters (NUL and the other C0/C1 codes but tab, newline, carriage
return, form feed and vertical tab) a data file may hold: prose and code hold almost none,
binary files and UTF-16 text read as UTF-8 (every other byte NUL) hold far more."""
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f]")


def load_corpus(path: str | os.PathLike[str] | None = None) -> str:
    """Return the training text: the built-in corpus for `None`, else a file or a directory.

    A directory contributes every `*.txt`, `*.md` and `*.rst` file below it (recursively), in
    sorted relative-path order, each without trailing newlines and joined by one blank line.
    Raises `DataError` for a missing path, a directory without text files, a file that is not
    UTF-8 or is more than `CONTROL_LIMIT` control characters, or text that is empty.
    """
    if path is None:
        return _builtin_text()
    root = Path(path)
    text = _SEPARATOR.join(read_text_file(f).rstrip("\n") for f in text_files(root))
    if not text.strip():
        raise DataError(f"data path '{root}' holds no text (only empty or blank files)")
    return text


def text_files(path: str | os.PathLike[str]) -> list[Path]:
    """Return the files `path` stands for: itself if a file, else every `*.txt`, `*.md` and
    `*.rst` file below the folder, in sorted relative-path order. Raises `DataError` for a
    missing path or a folder without text files."""
    root = Path(path)
    if not root.exists():
        raise DataError(f"data path '{root}' does not exist")
    if not root.is_dir():
        return [root]
    files = sorted(
        (f for f in root.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    if not files:
        raise DataError(
            f"data directory '{root}' holds no text files "
            f"({', '.join('*' + s for s in TEXT_SUFFIXES)})"
        )
    return files


def describe_corpus(path: str | os.PathLike[str] | None = None) -> str:
    """Return a short name of the corpus for reports: `BUILTIN_CORPUS` or the path as given."""
    return BUILTIN_CORPUS if path is None else os.fspath(path)


def _builtin_text() -> str:
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:
        raise DataError(
            "the built-in corpus needs the standard library's pydoc_data package, which this "
            "Python install lacks: pass a data path instead"
        ) from exc
    return _SEPARATOR.join(topics[key].rstrip("\n") for key in sorted(topics))


def read_text_file(file: Path) -> str:
    """Return the text of one data file. Raises `DataError` for a file that cannot be read, is
    not UTF-8 or is more than `CONTROL_LIMIT` control characters."""
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read data file '{file}': {exc.strerror}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"data file '{file}' is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from exc
    control = len(_CONTROL.findall(text))
    if control > CONTROL_LIMIT * len(text):
        raise DataError(
            f"data file '{file}' is not text: {control / len(text):.0%} of its characters are "
            f"NUL or other control characters (at most {CONTROL_LIMIT:.0%} are accepted); pass "
            "a UTF-8 text file (UTF-16 text must be converted to UTF-8 first)"
        )
    return text
