"""`interlace data prepare`: text and JSON Lines files tokenized into shards that decode back to
each document, the dtype by vocabulary, refusals before any work, nothing half-written, a
tokenizer.json as `--tokenizer`, JSON Lines streamed in bounded work units, and `interlace
train --data DIR` end to end."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import re
from pathlib import Path

import numpy as np
import pytest
import tokenizers as tk

from interlace.cli import main
from interlace.data import FileTokenizer, ShardIndex, prepare_shards
from interlace.data import prepare as prepare_module
from interlace.data.shards import ShardTokens, file_sha256
from interlace.data.tokenizer import train_byte_level_bpe
from interlace.errors import DataError
from interlace.plan import Plan
from interlace.train import prepare_run
from interlace.train_config import TrainConfig

END = "<|endoftext|>"
VOCAB = 300
DOCUMENTS = {
    "a.txt": "The first document, in plain English.\n",
    "b/c.md": "# Zweites Dokument\n\nÜber Äpfel und Öl — mit Umlauten.\n",
    "b/d.rst": "Third\n=====\n\n" + "words repeat and repeat, " * 60,
    "e.py": "print('not a text suffix, so not read')\n",
}


def write_documents(folder: Path) -> Path:
    for name, text in DOCUMENTS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def save_bpe(folder: Path, special: list[str]) -> Path:
    """A byte-level BPE of VOCAB ids trained on DOCUMENTS, saved as folder/tokenizer.json."""
    tokenizer = train_byte_level_bpe(list(DOCUMENTS.values()) * 3, VOCAB, special)
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_bpe(tmp_path_factory.mktemp("tok") / "bpe", [END])


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    return write_documents(tmp_path / "texts")


def read_all(folder: Path) -> np.ndarray:
    index = ShardIndex.read(folder)
    return ShardTokens(folder, index).read(0, index.num_tokens)


def test_shards_decode_to_each_document_and_the_index_describes_them(
    tmp_path, texts, tokenizer_file
):
    out = tmp_path / "shards"
    index = prepare_shards([texts], str(tokenizer_file), out, workers=2, shard_tokens=50)
    tokenizer = FileTokenizer(tokenizer_file)
    assert tokenizer.end_of_document == 0
    ids = read_all(out).tolist()
    pieces = " ".join(map(str, ids)).split(" 0")
    documents = [tokenizer.decode([int(i) for i in p.split()]) for p in pieces if p.strip()]
    assert documents == [DOCUMENTS[n] for n in ("a.txt", "b/c.md", "b/d.rst")]
    assert ids.count(0) == 3 and ids[-1] == 0
    assert (index.dtype, index.vocab_size, index.documents) == ("uint16", VOCAB, 3)
    assert index.tokenizer["sha256"] == file_sha256(tokenizer_file)
    assert (out / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    assert len(index.shards) == -(-len(ids) // 50) > 2
    for shard in index.shards:
        assert file_sha256(out / shard.file) == shard.sha256
        assert (out / shard.file).stat().st_size == 2 * shard.tokens
    raw = json.loads((out / "index.json").read_text())
    held_out = -(-len(ids) * 5 // 100)
    assert raw["split"] == {"val_fraction": 0.05, "first_val_token": len(ids) - held_out}
    assert (raw["format"], raw["version"], raw["tokens"]) == ("interlace-token-shards", 1, len(ids))


def test_byte_shards_join_documents_as_they_are_without_a_separator(tmp_path, texts):
    single = texts / "a.txt"
    index = prepare_shards([single, texts / "b"], "byte", tmp_path / "out", progress=False)
    expected = "".join(DOCUMENTS[n] for n in ("a.txt", "b/c.md", "b/d.rst")).encode()
    assert bytes(read_all(tmp_path / "out").tolist()) == expected
    assert (index.end_of_document, index.tokenizer) == (None, {"name": "byte"})


def test_a_vocabulary_above_uint16_writes_uint32_shards(tmp_path):
    words = {f"w{i}": i for i in range(70_000)}
    tokenizer = tk.Tokenizer(tk.models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    (tmp_path / "wide").mkdir()
    tokenizer.save(str(tmp_path / "wide" / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("w5 w69999 w65536 w3")
    index = prepare_shards([tmp_path / "doc.txt"], str(tmp_path / "wide"), tmp_path / "out")
    assert (index.dtype, index.vocab_size) == ("uint32", 70_000)
    assert read_all(tmp_path / "out").tolist() == [5, 69_999, 65_536, 3]
    assert (tmp_path / "out" / index.shards[0].file).stat().st_size == 16


def test_a_vocabulary_beyond_uint32_is_refused_before_any_work(tmp_path, texts, monkeypatch):
    class Huge:
        vocab_size = 2**32 + 5

    monkeypatch.setattr("interlace.data.prepare.get_tokenizer", lambda name, text: Huge())
    with pytest.raises(DataError, match="vocabulary of 4,294,967,301 ids exceeds uint32"):
        prepare_shards([texts], "byte", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts"]


def test_blank_inputs_are_refused_and_leave_nothing(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "blank.txt").write_text("  \n\n")
    with pytest.raises(DataError, match=r"the inputs \(.*in\) hold no text"):
        prepare_shards([tmp_path / "in"], "byte", tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_bad_file_midway_leaves_nothing_half_written(tmp_path, texts):
    (texts / "b" / "broken.txt").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(DataError, match=r"broken.txt' is not UTF-8 text"):
        prepare_shards([texts], "byte", tmp_path / "out", workers=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts"]


@pytest.mark.parametrize(
    ("tokenizer", "options", "message"),
    [
        ("bpe", {}, "tokenizer 'bpe' is trained on each run's text"),
        ("nowhere.json", {}, "tokenizer 'nowhere.json' is neither a name (byte, bpe) nor a"),
        ("byte", {"val_fraction": 1.0}, "--val-fraction=1.0 must lie strictly between 0 and 1"),
        ("byte", {"workers": 0}, "--workers=0 must be at least 1"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(tmp_path, texts, tokenizer, options, message):
    with pytest.raises(DataError, match=f"^{re.escape(message)}"):
        prepare_shards([texts], tokenizer, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_a_non_empty_out_is_kept_unless_overwrite(tmp_path, texts):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match=f"--out '{out}' is not empty: pass --overwrite"):
        prepare_shards([texts], "byte", out)
    assert (out / "keep.txt").read_text() == "mine"
    prepare_shards([texts], "byte", out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "shard-00000.bin"]


def test_a_tokenizer_file_sets_the_vocabulary_of_a_text_run(texts, tokenizer_file):
    folder = str(tokenizer_file.parent)
    config = TrainConfig(model="tiny", data=str(texts), tokenizer=folder, seq_len=16)
    setup = prepare_run(dataclasses.replace(config, global_batch=4), Plan(), 1)
    assert setup.model_config.vocab_size == VOCAB
    corpus = "\n\n".join(DOCUMENTS[n].rstrip("\n") for n in ("a.txt", "b/c.md", "b/d.rst"))
    assert setup.data.num_tokens == len(FileTokenizer(tokenizer_file).encode(corpus))


def test_prepare_then_train_through_the_command_line(tmp_path, texts, tokenizer_file, capsys):
    shards, run = tmp_path / "shards", tmp_path / "run"
    prepare = ["data", "prepare", str(texts), "--tokenizer", str(tokenizer_file)]
    assert main([*prepare, "--out", str(shards), "--workers", "2", "--no-progress"]) == 0
    assert f"in 1 uint16 shards (vocabulary {VOCAB}) in {shards}/" in capsys.readouterr().out
    assert main(["data", "verify", str(shards)]) == 0
    train = ["train", "--data", str(shards), "--model", "tiny", "--steps", "3", "--seq-len", "16"]
    train += ["--global-batch", "4", "--eval-batches", "1", "--no-progress", "--out", str(run)]
    assert main(train) == 0
    report = json.loads((run / "report.json").read_text())
    index = ShardIndex.read(shards)
    assert report["model"]["vocab_size"] == VOCAB
    assert report["train_tokens"] + report["val_tokens"] == index.num_tokens
    assert report["corpus"] == str(shards)
    (shards / "shard-00000.bin").write_bytes(b"\0\0")
    capsys.readouterr()
    assert main(["data", "verify", str(shards)]) == 2
    assert "shard-00000.bin' holds 2 bytes, but the index says" in capsys.readouterr().err
    assert main([*train, "--overwrite"]) == 2
    assert "holds 2 bytes" in capsys.readouterr().err


def _write_jsonl(file: Path, texts: list[str], field: str = "text") -> Path:
    file.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)))
    return file


JSONL_TEXTS = [f"Line document {i}: " + "words and more words " * (i % 5) for i in range(40)]


@pytest.mark.parametrize("workers", [1, 2])
def test_json_lines_are_a_document_each_whatever_the_work_units(
    tmp_path, tokenizer_file, monkeypatch, workers
):
    texts = [*JSONL_TEXTS[:20], "   ", *JSONL_TEXTS[20:]]  # a blank text is no document
    _write_jsonl(tmp_path / "in.jsonl", texts, field="body")
    with (tmp_path / "in.jsonl").open("a") as f:
        f.write("\n")  # a blank line is no document either
    monkeypatch.setattr(prepare_module, "UNIT_BYTES", 300)  # about 6 lines a unit
    assert len(list(prepare_module.work_units([tmp_path / "in.jsonl"]))) > 5
    out = tmp_path / "shards"
    index = prepare_shards(
        [tmp_path / "in.jsonl"], str(tokenizer_file), out, workers=workers, text_field="body"
    )
    tokenizer = FileTokenizer(tokenizer_file)
    ids = read_all(out).tolist()
    pieces = " ".join(map(str, ids)).split(" 0")
    documents = [tokenizer.decode([int(i) for i in p.split()]) for p in pieces if p.strip()]
    assert documents == JSONL_TEXTS and index.documents == len(JSONL_TEXTS)


def test_a_bad_json_line_is_named_and_leaves_nothing(tmp_path):
    file = _write_jsonl(tmp_path / "in.jsonl", JSONL_TEXTS[:3])
    with file.open("a") as f:
        f.write('{"text": "cut off\n')
    with pytest.raises(DataError, match=r"in.jsonl:4: not a JSON object"):
        prepare_shards([file], "byte", tmp_path / "out", progress=False)
    _write_jsonl(file, ["fine", 7])  # type: ignore[list-item]
    with pytest.raises(DataError, match=r"in.jsonl:2: field 'text' is int, not text"):
        prepare_shards([file], "byte", tmp_path / "out", workers=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_work_units_are_read_no_further_ahead_than_the_workers_need():
    """`ordered_map` takes at most `ahead` items beyond what it has yielded: a JSON Lines file
    of any size is held a few units at a time."""
    taken = []

    def items():
        for i in range(50):
            taken.append(i)
            yield i

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = prepare_module.ordered_map(pool, abs, items(), ahead=4)
        seen = []
        for value in results:
            seen.append(value)
            assert len(taken) <= len(seen) + 4
    assert seen == list(range(50))
