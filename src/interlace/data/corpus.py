"""Training text: the built-in corpus or the user's files, read into one string.

The built-in corpus is the Python documentation shipped inside every CPython install
(`pydoc_data.topics`, ~465 KB of English prose and code), so a run needs no download.

A data file is one document (`*.txt`, `*.md`, `*.rst`, or any file named directly), or, as JSON
Lines (`*.jsonl`: one JSON object per line, as Hugging Face datasets and most pretraining dumps
are exported), one document per line, its text under a field ("text" unless told). A Parquet
file, or a folder written by `datasets`' `save_to_disk`, holds one document per row, its text in
that column (`columns.py`).
"""

import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from interlace.data.columns import (
    PARQUET_SUFFIX,
    column_texts,
    dataset_dict_hint,
    datasets_files,
    is_column_file,
    is_datasets_folder,
)
from interlace.errors import DataError

BUILTIN_CORPUS = "builtin:pydoc_data.topics"
TEXT_SUFFIXES = (".txt", ".md", ".rst")
JSONL_SUFFIX = ".jsonl"
TEXT_FIELD = "text"
"""The JSON Lines field a document's text is read from by default."""
_SEPARATOR = "\n\n"
CONTROL_LIMIT = 0.1
"""Largest share of control characters (NUL and the other C0/C1 codes but tab, newline, carriage
return, form feed and vertical tab) a data file may hold: prose and code hold almost none,
binary files and UTF-16 text read as UTF-8 (every other byte NUL) hold far more."""
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f]")


def load_corpus(path: str | os.PathLike[str] | None = None) -> str:
    """Return the training text: the built-in corpus for `None`, else a file or a directory.

    Every document of the data files (`data_files`, `documents`) without trailing newlines,
    joined by one blank line. Raises `DataError` for a missing path, a directory without data
    files, a file that is not UTF-8 or is more than `CONTROL_LIMIT` control characters, a JSON
    Lines file with a bad line, or text that is empty.
    """
    if path is None:
        return _builtin_text()
    root = Path(path)
    text = _SEPARATOR.join(doc.rstrip("\n") for f in data_files(root) for doc in documents(f))
    if not text.strip():
        raise DataError(f"data path '{root}' holds no text (only empty or blank files)")
    return text


def data_files(path: str | os.PathLike[str]) -> list[Path]:
    """Return the files `path` stands for: itself if a file, the Arrow files of a folder written
    by `datasets`' `save_to_disk` (`columns.datasets_files`), else every `*.txt`, `*.md`,
    `*.rst`, `*.jsonl` and `*.parquet` file below the folder, in sorted relative-path order.
    Raises `DataError` for a missing path or a folder without data files."""
    root = Path(path)
    if not root.exists():
        raise DataError(f"data path '{root}' does not exist")
    if not root.is_dir():
        return [root]
    if is_datasets_folder(root):
        return datasets_files(root)
    suffixes = (*TEXT_SUFFIXES, JSONL_SUFFIX, PARQUET_SUFFIX)
    files = sorted(
        (f for f in root.rglob("*") if f.is_file() and f.suffix.lower() in suffixes),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    if not files:
        raise DataError(
            f"data directory '{root}' holds no data files "
            f"({', '.join('*' + s for s in suffixes)}){dataset_dict_hint(root)}"
        )
    return files


def is_jsonl(file: Path) -> bool:
    """Whether `file` is read as JSON Lines (its suffix is `.jsonl`)."""
    return file.suffix.lower() == JSONL_SUFFIX


def documents(file: Path, text_field: str = TEXT_FIELD) -> Iterator[str]:
    """The documents of one data file, read as they are needed: a JSON Lines file's texts
    (`jsonl_text`, blank lines skipped), a Parquet or Arrow file's texts in the column
    `text_field` (`column_texts`), else the whole file (`read_text_file`)."""
    if is_jsonl(file):
        yield from jsonl_texts(jsonl_lines(file), text_field, file)
    elif is_column_file(file):
        yield from column_texts(file, text_field)
    else:
        yield read_text_file(file)


def jsonl_texts(lines: Iterable[tuple[int, str]], text_field: str, file: Path) -> Iterator[str]:
    """The texts (`jsonl_text`) of numbered JSON Lines `lines` of `file`, blank lines skipped."""
    for number, line in lines:
        if line.strip():
            yield jsonl_text(line, text_field, f"{file}:{number}")


def jsonl_lines(file: Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, line) of a JSON Lines file, read as they are needed. Raises
    DataError for a file that cannot be read or is not UTF-8."""
    try:
        with file.open(encoding="utf-8") as lines:
            yield from enumerate(lines, start=1)
    except UnicodeDecodeError as exc:
        raise DataError(f"data file '{file}' is not UTF-8 text ({exc.reason})") from exc
    except OSError as exc:
        raise DataError(f"cannot read data file '{file}': {exc.strerror}") from exc


def jsonl_text(line: str, text_field: str, where: str) -> str:
    """The text under `text_field` of one JSON Lines line; `where` (file:line) names it in the
    DataError raised for a line that is not a JSON object holding a string there."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not a JSON object ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict) or text_field not in record:
        fields = ", ".join(map(repr, record)) if isinstance(record, dict) else "none"
        raise DataError(
            f"{where}: no field {text_field!r} holding the document's text (its fields: "
            f"{fields}); `data prepare --text-field` reads another field"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, not text")
    return text


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
