"""Shard folders read on demand (`interlace.data.shards`): the same windows, split, batches and
resume as `TokenData` over the same tokens, damaged folders refused, and memory that does not
grow with the corpus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from interlace.data import ShardData, ShardIndex, TokenData, TrainBatches, eval_batches
from interlace.data.shards import INDEX_FILE, ShardWriter, token_dtype, verify_shards
from interlace.errors import DataError

VOCAB = 1000
VAL_FRACTION = 0.05


def write_folder(
    folder: Path, tokens: np.ndarray, shard_tokens: int, dtype: str = "uint16"
) -> ShardIndex:
    """A shard folder holding `tokens`, cut into shards of `shard_tokens`, as prepare writes."""
    folder.mkdir(parents=True)
    writer = ShardWriter(folder, dtype, shard_tokens)
    writer.write(tokens)
    index = ShardIndex(
        dtype=dtype,
        vocab_size=VOCAB,
        tokenizer={"name": "byte"},
        end_of_document=None,
        documents=1,
        val_fraction=VAL_FRACTION,
        shards=tuple(writer.close()),
    )
    (folder / INDEX_FILE).write_text(index.to_json())
    return index


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(VOCAB, (5003,), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def folder(tmp_path: Path, tokens: torch.Tensor) -> Path:
    """The `tokens` in shards of 777 ids, so many windows cross a shard boundary."""
    write_folder(tmp_path / "shards", tokens.numpy().astype(np.uint16), shard_tokens=777)
    return tmp_path / "shards"


@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_windows_and_split_equal_those_of_token_data(folder, tokens, seq_len):
    streamed, memory = ShardData(folder, seq_len), TokenData(tokens, seq_len, VAL_FRACTION)
    assert len(ShardIndex.read(folder).shards) == 7
    assert (streamed.split, streamed.num_tokens) == (memory.split, memory.num_tokens)
    for mine, theirs in [
        (streamed.train_windows, memory.train_windows),
        (streamed.val_windows, memory.val_windows),
    ]:
        assert len(mine) == len(theirs)
        every = torch.arange(len(theirs)).flip(0)
        assert torch.equal(mine.index_select(0, every), theirs.index_select(0, every))
        assert torch.equal(mine[2:5], theirs[2:5])
        assert torch.equal(mine[:], theirs)


@pytest.mark.parametrize(("dp_size", "accum"), [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_batches_equal_those_of_token_data_on_every_rank(folder, tokens, dp_size, accum):
    streamed = TrainBatches(ShardData(folder, 16), global_batch_size=24, seed=5)
    memory = TrainBatches(TokenData(tokens, 16, VAL_FRACTION), global_batch_size=24, seed=5)
    for step in (0, 1, 13, 40):  # 296 windows: step 13 spans two epochs
        for rank in range(dp_size):
            mine = streamed.micro_batches(step, rank, dp_size, accum)
            theirs = memory.micro_batches(step, rank, dp_size, accum)
            assert len(mine) == len(theirs) == accum
            for (x, y), (x_ref, y_ref) in zip(mine, theirs, strict=True):
                assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    shard_eval = eval_batches(streamed.data, 8, 2, dp_rank=1, dp_size=2)
    memory_eval = eval_batches(memory.data, 8, 2, dp_rank=1, dp_size=2)
    for (x, y), (x_ref, y_ref) in zip(shard_eval, memory_eval, strict=True):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_resume_mid_epoch_continues_the_same_batches(folder):
    uninterrupted = TrainBatches(ShardData(folder, 16), 24, seed=1)
    state = uninterrupted.state_dict(7)
    resumed = TrainBatches(ShardData(folder, 16), 24, seed=1)
    step = resumed.load_state_dict(state)
    assert step == 7
    for later in range(step, step + 10):
        mine, theirs = resumed.micro_batches(later, 1, 2), uninterrupted.micro_batches(later, 1, 2)
        for (x, y), (x_ref, y_ref) in zip(mine, theirs, strict=True):
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_fingerprint_follows_the_shard_hashes_seq_len_and_split(folder, tmp_path, tokens):
    fingerprint = ShardData(folder, 16).fingerprint
    assert ShardData(folder, 16).fingerprint == fingerprint
    assert ShardData(folder, 17).fingerprint != fingerprint
    changed = tokens.numpy().astype(np.uint16)
    changed[0] += 1
    write_folder(tmp_path / "changed", changed, shard_tokens=777)
    assert ShardData(tmp_path / "changed", 16).fingerprint != fingerprint


def test_token_dtype_is_the_narrowest_that_holds_the_vocabulary():
    assert [token_dtype(v) for v in (256, 65536, 65537, 2**32)] == ["uint16"] * 2 + ["uint32"] * 2
    with pytest.raises(DataError, match=r"vocabulary of 4,294,967,297 ids exceeds uint32"):
        token_dtype(2**32 + 1)


def test_uint32_shards_read_back_ids_above_uint16(tmp_path):
    ids = np.arange(70_000, 70_000 + 300, dtype=np.uint32)
    write_folder(tmp_path / "wide", ids, shard_tokens=100, dtype="uint32")
    assert (tmp_path / "wide" / "shard-00000.bin").stat().st_size == 400
    data = ShardData(tmp_path / "wide", 9)
    assert data.train_windows[0:1].tolist() == [list(range(70_000, 70_010))]


def test_truncated_shard_is_refused_naming_it_and_its_sizes(folder):
    shard = folder / "shard-00003.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    message = (
        f"shard '{shard}' holds 1,552 bytes, but the index says 777 uint16 tokens (1,554 bytes)"
    )
    with pytest.raises(DataError, match=f"^{re.escape(message)}: the folder is damaged") as raised:
        ShardData(folder, 16)
    assert "\n" not in str(raised.value)


def test_missing_shard_is_refused(folder):
    (folder / "shard-00006.bin").unlink()
    with pytest.raises(DataError, match=r"shard-00006.bin' is missing, but the index says 341 "):
        ShardData(folder, 16)


def test_changed_bytes_of_the_right_size_fail_verification(folder):
    shard = folder / "shard-00002.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 1
    shard.write_bytes(bytes(raw))
    ShardData(folder, 16)  # sizes only: training start stays cheap
    with pytest.raises(DataError, match=f"shard '{shard}' does not match the sha256 in the index"):
        verify_shards(folder)


def test_intact_folder_verifies(folder):
    assert verify_shards(folder).num_tokens == 5003


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 2}, "has format version 2, but this interlace reads version 1"),
        ({"format": "npy"}, "is not an interlace-token-shards index"),
        ({"dtype": "int8"}, "has dtype 'int8'; valid: uint16, uint32"),
        ({"shards": None}, "lacks or garbles the field"),
    ],
)
def test_index_of_another_format_version_or_dtype_is_refused(folder, change, message):
    index = folder / INDEX_FILE
    index.write_text(json.dumps({**json.loads(index.read_text()), **change}))
    with pytest.raises(DataError, match=message):
        ShardData(folder, 16)


def test_too_short_corpus_names_a_seq_len_that_fits(folder):
    with pytest.raises(DataError, match="corpus has 5003 tokens: too few for seq_len=4000"):
        ShardData(folder, 4000)


def vm_rss_bytes() -> int:
    """This process's resident memory now, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_streaming_a_large_corpus_keeps_memory_flat(tmp_path):
    corpus_tokens = 50_000_000  # 100 MB of uint16
    ids = np.random.default_rng(0).integers(0, VOCAB, corpus_tokens, dtype=np.uint16)
    write_folder(tmp_path / "big", ids, shard_tokens=corpus_tokens // 3)
    del ids
    before = vm_rss_bytes()
    batches = TrainBatches(ShardData(tmp_path / "big", 1024), 32, seed=0)  # 46,386 windows
    peak = before
    for step in range(400):  # 12,800 windows, 13 M tokens (26 MB)
        x, _ = batches.micro_batches(step)[0]
        assert x.shape == (32, 1024)
        peak = max(peak, vm_rss_bytes())
    growth = peak - before
    assert growth < 16 * 2**20, f"resident memory grew {growth / 2**20:.1f} MiB"
