"""Documents from a text column: Parquet files and Hugging Face `datasets` folders.

A Parquet file (`*.parquet`, as FineWeb-style corpora ship) is read `BATCH_ROWS` rows of the one
column at a time (`ParquetFile.iter_batches`). A folder written by `datasets`' `save_to_disk`
holds `state.json`, `dataset_info.json` and Arrow IPC stream files (`data-00000-of-00001.arrow`,
...), which are read record batch by record batch as `datasets` wrote them, without the
`datasets` package. Either way memory stays bounded by one batch, whatever the file's size.
pyarrow reads them: the optional extra `interlace[data]`.
"""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from interlace.errors import DataError

PARQUET_SUFFIX = ".parquet"
ARROW_SUFFIX = ".arrow"
STATE_FILE = "state.json"
"""The file of a `save_to_disk` folder that lists its Arrow files, in order."""
DATASET_DICT_FILE = "dataset_dict.json"
BATCH_ROWS = 1024
"""Rows of a Parquet file read at a time."""


def is_column_file(file: Path) -> bool:
    """Whether `file` is read as a table with a text column (`*.parquet`, `*.arrow`)."""
    return file.suffix.lower() in (PARQUET_SUFFIX, ARROW_SUFFIX)


def is_datasets_folder(folder: Path) -> bool:
    """Whether `folder` is one written by `datasets`' `save_to_disk`: a `state.json` beside
    `*.arrow` files."""
    return (folder / STATE_FILE).is_file() and any(folder.glob(f"*{ARROW_SUFFIX}"))


def datasets_files(folder: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` folder, in the order its `state.json` lists them.
    Raises `DataError` for a `state.json` that does not list them or a listed file missing."""
    state = folder / STATE_FILE
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(
            f"'{state}' does not list the folder's Arrow files under \"_data_files\" ({exc!r}); "
            "pass a folder written by `datasets`' save_to_disk"
        ) from None
    files = [folder / name for name in names]
    missing = [file.name for file in files if not file.is_file()]
    if missing or not files:
        raise DataError(f"'{state}' lists Arrow files that are not there: {missing or 'none'}")
    return files


def dataset_dict_hint(folder: Path) -> str:
    """For a `save_to_disk` folder of several splits (a `DatasetDict`), a sentence naming the
    folders to pass instead; else ""."""
    try:
        splits = json.loads((folder / DATASET_DICT_FILE).read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    folders = ", ".join(f"'{folder / split}'" for split in splits)
    return f"; it holds the splits of a datasets DatasetDict: pass one of {folders}"


def check_column(file: Path, column: str) -> None:
    """Read the schema of `file` only and raise `DataError` if it lacks a text `column` (naming
    the columns it has), cannot be read, or pyarrow is not installed."""
    with _reading(file) as pa:
        if file.suffix.lower() == PARQUET_SUFFIX:
            schema = pa.parquet.read_schema(file)
        else:
            with pa.OSFile(str(file)) as source:
                schema = pa.ipc.open_stream(source).schema
        _check_field(schema, file, column)


def column_texts(file: Path, column: str) -> Iterator[str]:
    """The texts of `column` of a Parquet or Arrow stream file, in row order, read a batch at a
    time (`column_batches`)."""
    for texts, _ in column_batches(file, column):
        yield from texts


def column_batches(file: Path, column: str) -> Iterator[tuple[list[str], int]]:
    """The texts of `column` of `file` a batch at a time (`BATCH_ROWS` rows of a Parquet file,
    an Arrow stream's record batches as written), each with the bytes of the file read so far
    (for a Parquet file, its share of the rows). Raises `DataError` for a missing or non-text
    column, a null text (naming its row, from 0), or a file pyarrow cannot read."""
    row = 0
    with _reading(file) as pa:
        for array, position in _arrays(pa, file, column):
            texts = array.to_pylist()
            if array.null_count:
                where = f"{file}: row {row + texts.index(None)}"
                raise DataError(f"{where}: column {column!r} is null, not text")
            row += len(texts)
            yield texts, position


def _arrays(pa: ModuleType, file: Path, column: str) -> Iterator[tuple[Any, int]]:
    """(the column of one batch of `file`, the file's bytes read so far), batch by batch."""
    if file.suffix.lower() == PARQUET_SUFFIX:
        with pa.parquet.ParquetFile(file) as parquet:
            _check_field(parquet.schema_arrow, file, column)
            rows, size, done = parquet.metadata.num_rows, file.stat().st_size, 0
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=[column]):
                done += batch.num_rows
                yield batch.column(0), size * done // rows
        return
    with pa.OSFile(str(file)) as source:
        stream = pa.ipc.open_stream(source)
        _check_field(stream.schema, file, column)
        index = stream.schema.get_field_index(column)
        for batch in stream:
            yield batch.column(index), source.tell()


def _check_field(schema: Any, file: Path, column: str) -> None:
    import pyarrow as pa

    if column not in schema.names:
        raise DataError(
            f"'{file}' has no column {column!r} (its columns: "
            f"{', '.join(map(repr, schema.names)) or 'none'}); `data prepare --text-column` "
            "reads another column"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"'{file}': column {column!r} holds {kind}, not text")


@contextmanager
def _reading(file: Path) -> Iterator[ModuleType]:
    """pyarrow, for reading `file`; its errors inside the block are raised as `DataError`s
    naming the file. Raises `DataError` where pyarrow is not installed."""
    try:
        import pyarrow as pa
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(
            f"reading '{file}' needs pyarrow, which is not installed: pip install 'interlace[data]'"
        ) from None
    try:
        yield pa
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"cannot read '{file}' with pyarrow: {exc}") from None
