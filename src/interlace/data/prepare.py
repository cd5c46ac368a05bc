"""Tokenize data files into a shard folder (`interlace data prepare`; the format in `shards.py`).

A text file is one document, a JSON Lines file one document per line, a Parquet or Arrow file
(`columns.py`) one document per row (`corpus.documents`). This process cuts the input into work
units (a text file; `UNIT_BYTES` of a JSON Lines file's lines or of a column's texts, read a
batch at a time) and worker processes tokenize them, at most two units per worker in flight, so
a file of any size is streamed with bounded memory. The ids are written in input
order, the tokenizer's end-of-document id after each document where it has one, into shards of
at most `shard_tokens` ids. Everything is written into a hidden folder beside `out`, renamed to
`out` only once complete, so an error leaves nothing half-written.
"""

import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.pool import Pool
from pathlib import Path
from typing import TypeVar

import numpy as np
from tqdm import tqdm

from interlace.data.columns import check_column, column_batches, is_column_file
from interlace.data.corpus import (
    TEXT_FIELD,
    data_files,
    is_jsonl,
    jsonl_lines,
    jsonl_texts,
    read_text_file,
)
from interlace.data.shards import (
    INDEX_FILE,
    Shard,
    ShardIndex,
    ShardWriter,
    file_sha256,
    numpy_dtype,
    token_dtype,
)
from interlace.data.tokenizer import (
    TOKENIZER_FILE,
    FileTokenizer,
    Tokenizer,
    check_tokenizer,
    get_tokenizer,
)
from interlace.errors import DataError

SHARD_TOKENS = 1 << 28
"""Most token ids per shard file by default (512 MiB of uint16)."""
UNIT_BYTES = 4 << 20
"""Bytes of JSON Lines lines, or characters of a column's texts, one work unit holds (its last
line or text may pass it)."""

_worker_tokenizer: Tokenizer | None = None
_worker_dtype: str = ""
_worker_text_field: str = TEXT_FIELD
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class WorkUnit:
    """What one worker tokenizes: a text file whole (`lines` and `texts` None), a run of a JSON
    Lines file's lines, the first of them line `first_line` (1-based), or a run of a column's
    `texts`; `size`: the input bytes it stands for (the progress bar's unit)."""

    file: Path
    size: int
    lines: tuple[str, ...] | None = None
    first_line: int = 1
    texts: tuple[str, ...] | None = None


def prepare_shards(
    inputs: Sequence[str | os.PathLike[str]],
    tokenizer: str,
    out: str | os.PathLike[str],
    *,
    val_fraction: float = 0.05,
    workers: int = 1,
    shard_tokens: int = SHARD_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
    text_field: str = TEXT_FIELD,
) -> ShardIndex:
    """Tokenize the documents of `inputs` (data files, or folders read as `load_corpus` reads
    them; the texts of a JSON Lines file under the field `text_field`, of a Parquet or Arrow
    file in the column `text_field`) with `tokenizer` ("byte" or a
    tokenizer.json path) on `workers` processes into the shard folder `out`, and return its
    index. The last `val_fraction` of the tokens is held out.

    Raises `DataError` before any work for a bad argument, an unusable tokenizer, a non-empty
    `out` without `overwrite`, a missing input, or a Parquet or Arrow file without the text
    column (or pyarrow to read it); and, leaving nothing written, for a JSON Lines line or a
    row without its text or inputs that hold no text.
    """
    out = Path(out)
    _check_arguments(tokenizer, out, val_fraction, workers, shard_tokens, overwrite)
    if not text_field:
        raise DataError("--text-field must name a field, e.g. text")
    files = [file for path in inputs for file in data_files(path)]
    if not files:
        raise DataError("no inputs: give one or more text files or folders")
    for file in files:
        if is_column_file(file):
            check_column(file, text_field)
    loaded = get_tokenizer(tokenizer, "")
    dtype = token_dtype(loaded.vocab_size)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        partial.mkdir(parents=True)
        shards, documents = _write_shards(
            files, (tokenizer, dtype, text_field), partial, workers, shard_tokens, progress
        )
        if not shards:
            raise DataError(
                f"the inputs ({', '.join(map(os.fspath, inputs))}) hold no text (only empty or "
                "blank files)"
            )
        index = ShardIndex(
            dtype=dtype,
            vocab_size=loaded.vocab_size,
            tokenizer=_describe_tokenizer(loaded, partial),
            end_of_document=loaded.end_of_document,
            documents=documents,
            val_fraction=val_fraction,
            shards=tuple(shards),
        )
        (partial / INDEX_FILE).write_text(index.to_json())
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return index


def _check_arguments(
    tokenizer: str,
    out: Path,
    val_fraction: float,
    workers: int,
    shard_tokens: int,
    overwrite: bool,
) -> None:
    if tokenizer == "bpe":
        raise DataError(
            "tokenizer 'bpe' is trained on each run's text, so shards cannot be prepared with "
            "it: pass 'byte' or a tokenizer.json (e.g. one saved with the tokenizers library)"
        )
    check_tokenizer(tokenizer)
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction={val_fraction} must lie strictly between 0 and 1")
    if workers < 1:
        raise DataError(f"--workers={workers} must be at least 1")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens={shard_tokens} must be at least 1")
    if out.exists() and not out.is_dir():
        raise DataError(f"--out '{out}' exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DataError(f"--out '{out}' is not empty: pass --overwrite to replace it")


def _write_shards(
    files: list[Path],
    worker_setup: tuple[str, str, str],
    folder: Path,
    workers: int,
    shard_tokens: int,
    progress: bool,
) -> tuple[list[Shard], int]:
    """Tokenize `files` on `workers` processes set up with `worker_setup` (tokenizer, dtype,
    text field) and write their ids, in order, into shards in `folder`; return the shards and
    the number of documents that held text."""
    writer = ShardWriter(folder, worker_setup[1], shard_tokens)
    documents = 0
    total = sum(file.stat().st_size for file in files)
    bar = tqdm(total=total, desc="tokenize", unit="B", unit_scale=True, disable=not progress)
    if workers == 1:
        _start_worker(*worker_setup)
        encoded = map(_encode_unit, work_units(files, worker_setup[2]))
    else:  # spawned, not forked: a forked copy of a process with running threads can deadlock
        streamed = any(is_jsonl(file) or is_column_file(file) for file in files)
        context = multiprocessing.get_context("spawn")
        pool = context.Pool(
            workers if streamed else min(workers, len(files)), _start_worker, worker_setup
        )
        units = work_units(files, worker_setup[2])
        encoded = ordered_map(pool, _encode_unit, units, ahead=2 * workers)
    try:
        for ids, count, size in encoded:
            if ids.size:
                writer.write(ids)
            documents += count
            bar.update(size)
    finally:
        bar.close()
        if workers > 1:
            pool.terminate()
    return writer.close(), documents


def work_units(files: Iterable[Path], column: str = TEXT_FIELD) -> Iterator[WorkUnit]:
    """`files` cut into work units, in order, read as they are needed: a text file whole; a
    JSON Lines file in runs of lines of about `UNIT_BYTES`; a Parquet or Arrow file in runs of
    its `column`'s texts of about `UNIT_BYTES` characters."""
    for file in files:
        if is_jsonl(file):
            yield from _jsonl_units(file)
        elif is_column_file(file):
            yield from _column_units(file, column)
        else:
            yield WorkUnit(file, file.stat().st_size)


def _jsonl_units(file: Path) -> Iterator[WorkUnit]:
    lines: list[str] = []
    first, size = 1, 0
    for number, line in jsonl_lines(file):
        lines.append(line)
        size += len(line.encode())
        if size >= UNIT_BYTES:
            yield WorkUnit(file, size, tuple(lines), first)
            lines, first, size = [], number + 1, 0
    if lines:
        yield WorkUnit(file, size, tuple(lines), first)


def _column_units(file: Path, column: str) -> Iterator[WorkUnit]:
    """Each unit's size is the file's bytes read since the previous unit, so the units of a
    file add up to its size."""
    texts: list[str] = []
    chars = counted = 0
    for batch, position in column_batches(file, column):
        for text in batch:
            texts.append(text)
            chars += len(text)
            if chars >= UNIT_BYTES:
                yield WorkUnit(file, position - counted, texts=tuple(texts))
                texts, chars, counted = [], 0, position
    size = file.stat().st_size
    if texts or counted < size:
        yield WorkUnit(file, size - counted, texts=tuple(texts))


def ordered_map(pool: Pool, fn: Callable[[T], R], items: Iterable[T], ahead: int) -> Iterator[R]:
    """fn over `items` on `pool`, results in order, with at most `ahead` items taken from
    `items` and not yet yielded (`Pool.imap` would read every item up front)."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _start_worker(tokenizer: str, dtype: str, text_field: str) -> None:
    global _worker_tokenizer, _worker_dtype, _worker_text_field
    _worker_tokenizer = get_tokenizer(tokenizer, "")
    _worker_dtype = dtype
    _worker_text_field = text_field


def _encode_unit(unit: WorkUnit) -> tuple[np.ndarray, int, int]:
    """(the ids of the unit's documents, each followed by the end-of-document id, the number
    of documents that held text, the unit's size); blank documents are skipped."""
    assert _worker_tokenizer is not None
    if unit.texts is not None:
        texts = list(unit.texts)
    elif unit.lines is None:
        texts = [read_text_file(unit.file)]
    else:
        numbered = enumerate(unit.lines, start=unit.first_line)
        texts = list(jsonl_texts(numbered, _worker_text_field, unit.file))
    ids: list[int] = []
    count = 0
    for text in texts:
        if text.strip():
            ids += _worker_tokenizer.encode(text)
            if _worker_tokenizer.end_of_document is not None:
                ids.append(_worker_tokenizer.end_of_document)
            count += 1
    return np.asarray(ids, dtype=numpy_dtype(_worker_dtype)), count, unit.size


def _describe_tokenizer(tokenizer: Tokenizer, folder: Path) -> dict[str, str]:
    """The index's tokenizer entry; a tokenizer file is copied into `folder` beside the shards."""
    if not isinstance(tokenizer, FileTokenizer):
        return {"name": tokenizer.name}
    shutil.copyfile(tokenizer.file, folder / TOKENIZER_FILE)
    return {"name": tokenizer.name, "file": TOKENIZER_FILE, "sha256": file_sha256(tokenizer.file)}
