"""`interlace data prepare` of Parquet files and `datasets` `save_to_disk` folders: the same shards
as the same texts as JSON Lines, whatever the worker count, read a batch at a time; a missing
column, a null text or a missing pyarrow refused before any work, leaving nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from interlace.cli import main
from interlace.data import ShardIndex, prepare_shards
from interlace.data import columns as columns_module
from interlace.data import prepare as prepare_module
from interlace.data.corpus import data_files, load_corpus
from interlace.data.shards import ShardTokens
from interlace.errors import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TEXTS = [f"Row {i}: " + "Grüße, words and more words. " * (i % 7) for i in range(60)]
TEXTS[25] = "   "  # a blank text is no document


def write_jsonl(file: Path, texts: list[str]) -> Path:
    file.write_text("".join(json.dumps({"body": text}) + "\n" for text in texts))
    return file


def write_parquet(file: Path, texts: list, row_group_size: int = 16) -> Path:
    table = pa.table({"id": list(range(len(texts))), "body": texts})
    pq.write_table(table, file, row_group_size=row_group_size)
    return file


def write_datasets_folder(folder: Path, parts: list[list], batch_rows: int = 8) -> Path:
    """A folder as `Dataset.save_to_disk` writes it: one Arrow IPC stream file per part, of
    record batches of `batch_rows` rows, listed in state.json, and dataset_info.json."""
    folder.mkdir(parents=True)
    value = {"dtype": "string", "_type": "Value"}
    features = {"id": {**value, "dtype": "int64"}, "body": value}
    names = [f"data-{i:05d}-of-{len(parts):05d}.arrow" for i in range(len(parts))]
    for name, texts in zip(names, parts, strict=True):
        table = pa.table({"id": list(range(len(texts))), "body": texts})
        table = table.replace_schema_metadata({"huggingface": json.dumps({"info": features})})
        with (
            pa.OSFile(str(folder / name), "wb") as sink,
            pa.ipc.new_stream(sink, table.schema) as stream,
        ):
            stream.write_table(table, max_chunksize=batch_rows)
    info = {"citation": "", "description": "", "features": features, "homepage": ""}
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2))
    state = {
        "_data_files": [{"filename": name} for name in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    return folder


def read_all(folder: Path) -> np.ndarray:
    index = ShardIndex.read(folder)
    return ShardTokens(folder, index).read(0, index.num_tokens)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_shards_equal_those_of_the_same_texts_as_json_lines(tmp_path, monkeypatch, workers):
    monkeypatch.setattr(prepare_module, "UNIT_BYTES", 400)
    monkeypatch.setattr(columns_module, "BATCH_ROWS", 7)
    jsonl = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    prepare_shards([jsonl, jsonl], "byte", tmp_path / "ref", text_field="body", progress=False)
    parquet = write_parquet(tmp_path / "in.parquet", TEXTS)
    saved = write_datasets_folder(tmp_path / "saved", [TEXTS[:33], TEXTS[33:]])
    files = [*data_files(parquet), *data_files(saved)]
    units = list(prepare_module.work_units(files, "body"))
    assert len(units) > 10 and sum(u.size for u in units) == sum(f.stat().st_size for f in files)
    out = tmp_path / "out"
    index = prepare_shards(
        [parquet, saved], "byte", out, workers=workers, text_field="body", progress=False
    )
    np.testing.assert_array_equal(read_all(out), read_all(tmp_path / "ref"))
    assert index.documents == 2 * (len(TEXTS) - 1)


def test_folders_list_their_parquet_files_and_the_arrow_files_their_state_lists(tmp_path):
    (tmp_path / "mixed" / "b").mkdir(parents=True)
    (tmp_path / "mixed" / "a.txt").write_text("a text file\n")
    pq.write_table(pa.table({"text": ["row one", "row two"]}), tmp_path / "mixed/b/c.parquet")
    assert [f.name for f in data_files(tmp_path / "mixed")] == ["a.txt", "c.parquet"]
    assert load_corpus(tmp_path / "mixed") == "a text file\n\nrow one\n\nrow two"
    saved = write_datasets_folder(tmp_path / "saved", [TEXTS[:2], TEXTS[2:4], TEXTS[4:6]])
    assert [f.name[:10] for f in data_files(saved)] == ["data-00000", "data-00001", "data-00002"]
    texts = [t for f in data_files(saved) for t in columns_module.column_texts(f, "body")]
    assert texts == TEXTS[:6]
    (saved / "data-00001-of-00003.arrow").unlink()
    with pytest.raises(DataError, match=r"state.json' lists Arrow files that are not there"):
        data_files(saved)


def test_a_datasets_dict_folder_names_its_splits(tmp_path):
    write_datasets_folder(tmp_path / "dict" / "train", [TEXTS[:3]])
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(DataError, match=r"DatasetDict: pass one of '.*dict/train'"):
        data_files(tmp_path / "dict")


def test_a_missing_column_is_refused_before_any_work_and_leaves_nothing(tmp_path, capsys):
    good = write_parquet(tmp_path / "a.parquet", TEXTS)
    bad = tmp_path / "b.parquet"
    pq.write_table(pa.table({"content": ["x"]}), bad)
    out = tmp_path / "out"
    args = ["data", "prepare", str(good), str(bad), "--tokenizer", "byte", "--out", str(out)]
    assert main([*args, "--text-column", "body", "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert f"'{bad}' has no column 'body' (its columns: 'content')" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet", "b.parquet"]
    with pytest.raises(DataError, match=r"column 'id' holds int64, not text"):
        prepare_shards([good], "byte", out, text_field="id")


def test_a_null_text_or_an_unreadable_file_is_named_and_leaves_nothing(tmp_path):
    file = write_parquet(tmp_path / "in.parquet", [*TEXTS[:40], None, "after"])
    with pytest.raises(DataError, match=r"in.parquet: row 40: column 'body' is null, not text"):
        prepare_shards([file], "byte", tmp_path / "out", text_field="body", progress=False)
    (tmp_path / "in.parquet").write_text("not parquet at all")
    with pytest.raises(DataError, match=r"cannot read '.*in.parquet' with pyarrow"):
        prepare_shards([file], "byte", tmp_path / "out", text_field="body", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]


def test_without_pyarrow_the_one_line_names_the_extra(tmp_path, monkeypatch, capsys):
    file = write_parquet(tmp_path / "in.parquet", TEXTS)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    out = tmp_path / "out"
    assert main(["data", "prepare", str(file), "--tokenizer", "byte", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "pip install 'interlace[data]'" in error
    assert not out.exists()


def test_files_are_read_a_batch_at_a_time(tmp_path, monkeypatch):
    """Batches of BATCH_ROWS rows (an Arrow stream's as written), taken only as units need them,
    and pyarrow's memory stays far below the column's size."""
    monkeypatch.setattr(columns_module, "BATCH_ROWS", 32)
    texts = [f"{i} " + "long row text " * 300 for i in range(1200)]  # about 5 MB
    file = write_parquet(tmp_path / "big.parquet", texts, row_group_size=128)
    batches = columns_module.column_batches(file, "body")
    assert iter(batches) is batches
    peak, sizes = 0, []
    for batch, _ in batches:
        sizes.append(len(batch))
        peak = max(peak, pa.total_allocated_bytes())
    assert sizes == [32] * 37 + [16]
    assert peak < sum(map(len, texts)) / 3  # the whole column would be more
    saved = write_datasets_folder(tmp_path / "saved", [TEXTS], batch_rows=8)
    arrow = data_files(saved)[0]
    assert [len(b) for b, _ in columns_module.column_batches(arrow, "body")] == [8] * 7 + [4]

    taken = []
    real = prepare_module.column_batches

    def counted(*args):
        for item in real(*args):
            taken.append(len(item[0]))
            yield item

    monkeypatch.setattr(prepare_module, "column_batches", counted)
    monkeypatch.setattr(prepare_module, "UNIT_BYTES", 20_000)
    first = next(prepare_module.work_units([file], "body"))
    assert len(first.texts) == 5 and taken == [32]
