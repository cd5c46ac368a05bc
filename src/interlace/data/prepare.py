"""Tokenize text files into a shard folder (`interlace data prepare`; the format in `shards.py`).

Every text file is one document. Worker processes tokenize the documents; this process writes
their ids in input order, the tokenizer's end-of-document id after each where it has one, into
shards of at most `shard_tokens` ids. Everything is written into a hidden folder beside `out`,
renamed to `out` only once complete, so an error leaves nothing half-written.
"""

import multiprocessing
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from interlace.data.corpus import read_text_file, text_files
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

_worker_tokenizer: Tokenizer | None = None
_worker_dtype: str = ""


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
) -> ShardIndex:
    """Tokenize the text files of `inputs` (files, or folders read as `load_corpus` reads them)
    with `tokenizer` ("byte" or a tokenizer.json path) on `workers` processes into the shard
    folder `out`, and return its index. The last `val_fraction` of the tokens is held out.

    Raises `DataError` before any work for a bad argument, an unusable tokenizer, a non-empty
    `out` without `overwrite`, or a missing input; and for inputs that hold no text.
    """
    out = Path(out)
    _check_arguments(tokenizer, out, val_fraction, workers, shard_tokens, overwrite)
    files = [file for path in inputs for file in text_files(path)]
    if not files:
        raise DataError("no inputs: give one or more text files or folders")
    loaded = get_tokenizer(tokenizer, "")
    dtype = token_dtype(loaded.vocab_size)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        partial.mkdir(parents=True)
        shards, documents = _write_shards(
            files, tokenizer, dtype, partial, workers, shard_tokens, progress
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
    tokenizer: str,
    dtype: str,
    folder: Path,
    workers: int,
    shard_tokens: int,
    progress: bool,
) -> tuple[list[Shard], int]:
    """Tokenize `files` on `workers` processes (no more than there are files) and write their
    ids, in order, into shards in `folder`; return the shards and the number of documents that
    held text."""
    writer = ShardWriter(folder, dtype, shard_tokens)
    documents = 0
    encoded = _encoded(files, tokenizer, dtype, workers)
    for ids in tqdm(encoded, total=len(files), desc="tokenize", unit="file", disable=not progress):
        if ids.size:
            writer.write(ids)
            documents += 1
    return writer.close(), documents


def _encoded(files: list[Path], tokenizer: str, dtype: str, workers: int) -> Iterator[np.ndarray]:
    """The ids of each file in order: tokenized here for one worker, else in spawned processes
    (not forked: a forked copy of a process with running threads can deadlock)."""
    if workers == 1:
        _start_worker(tokenizer, dtype)
        yield from map(_encode_document, files)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(min(workers, len(files)), _start_worker, (tokenizer, dtype)) as pool:
        yield from pool.imap(_encode_document, files)


def _start_worker(tokenizer: str, dtype: str) -> None:
    global _worker_tokenizer, _worker_dtype
    _worker_tokenizer = get_tokenizer(tokenizer, "")
    _worker_dtype = dtype


def _encode_document(file: Path) -> np.ndarray:
    """The ids of one file and its end-of-document id (none for a blank file)."""
    assert _worker_tokenizer is not None
    text = read_text_file(file)
    if not text.strip():
        return np.empty(0, numpy_dtype(_worker_dtype))
    ids = _worker_tokenizer.encode(text)
    if _worker_tokenizer.end_of_document is not None:
        ids.append(_worker_tokenizer.end_of_document)
    return np.asarray(ids, dtype=numpy_dtype(_worker_dtype))


def _describe_tokenizer(tokenizer: Tokenizer, folder: Path) -> dict[str, str]:
    """The index's tokenizer entry; a tokenizer file is copied into `folder` beside the shards."""
    if not isinstance(tokenizer, FileTokenizer):
        return {"name": tokenizer.name}
    shutil.copyfile(tokenizer.file, folder / TOKENIZER_FILE)
    return {"name": tokenizer.name, "file": TOKENIZER_FILE, "sha256": file_sha256(tokenizer.file)}
