"""The data pipeline: corpus loading, tokenizers, the held-out split and the batch streams."""

import json
import math
import re
import sys

import pytest
import torch

from interlace.data import (
    BUILTIN_CORPUS,
    BPETokenizer,
    ByteTokenizer,
    TokenData,
    TrainBatches,
    describe_corpus,
    eval_batches,
    get_tokenizer,
    load_corpus,
)
from interlace.errors import CheckpointError, DataError

SEQ_LEN = 8


@pytest.fixture
def data() -> TokenData:
    """Tokens 0..N-1, so every token equals its position and window i starts with i·SEQ_LEN."""
    return TokenData(torch.arange(4003), SEQ_LEN)


# --- corpus ---------------------------------------------------------------------------------


def test_builtin_corpus_is_real_text_and_deterministic():
    text = load_corpus(None)
    assert len(text.encode("utf-8")) > 400_000
    assert 'The "for" statement is used to iterate' in text
    assert text == load_corpus(None)
    assert describe_corpus(None) == BUILTIN_CORPUS


def test_directory_loads_text_files_sorted_and_joined_by_a_blank_line(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "z.txt").write_text("zeta\n")
    (tmp_path / "a" / "b" / "1.txt").write_text("one")
    (tmp_path / "a" / "2.md").write_text("two\n\n")
    (tmp_path / "c.rst").write_text("see")
    (tmp_path / "skip.py").write_text("print('not text')")
    assert load_corpus(tmp_path) == "two\n\none\n\nsee\n\nzeta"
    assert load_corpus(str(tmp_path / "a" / "b")) == "one"
    assert describe_corpus(tmp_path) == str(tmp_path)


def test_a_file_path_loads_whatever_its_suffix(tmp_path):
    file = tmp_path / "notes.log"
    file.write_text("naïve café\n")
    assert load_corpus(file) == "naïve café"


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=f"data path '{re.escape(str(missing))}' does not exist"):
        load_corpus(missing)


def test_directory_without_data_files_is_named(tmp_path):
    (tmp_path / "code.py").write_text("x = 1")
    with pytest.raises(DataError, match=rf"'{re.escape(str(tmp_path))}' holds no data files"):
        load_corpus(tmp_path)


def test_json_lines_give_a_document_per_line_joined_like_files(tmp_path):
    (tmp_path / "a.txt").write_text("alpha\n")
    lines = [{"text": "one\n", "id": 1}, {"text": "two"}, {"text": "three", "meta": {}}]
    (tmp_path / "b.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n\n")
    assert load_corpus(tmp_path) == "alpha\n\none\n\ntwo\n\nthree"
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"b.jsonl:2: no field 'text' .*its fields: 'body'"):
        load_corpus(tmp_path)


def test_blank_text_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.md").write_text("\n  \n")
    with pytest.raises(DataError, match="holds no text"):
        load_corpus(tmp_path)


def test_undecodable_file_is_named(tmp_path):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt' is not UTF-8 text"):
        load_corpus(tmp_path)


@pytest.mark.parametrize(
    ("content", "share"),
    [
        (bytes(4096), "100%"),  # a file of NUL bytes
        ("plain words\n".encode("utf-16-le"), "50%"),  # UTF-16 without its byte-order mark
        (b"ab\x01\x02\x03\x04" * 100, "67%"),
    ],
    ids=["nul", "utf16", "control"],
)
def test_text_of_mostly_control_characters_is_refused_as_data(tmp_path, content, share):
    (tmp_path / "fine.txt").write_text("ordinary prose\twith a tab\r\n\f")
    (tmp_path / "zeros.txt").write_bytes(content)
    with pytest.raises(DataError, match=rf"zeros\.txt' is not text: {share} of its characters"):
        load_corpus(tmp_path)


def test_text_with_a_few_control_characters_is_accepted(tmp_path):
    # 10 of 100 characters are control characters, at the limit; whitespace does not count
    text = "\x00" * 10 + "x" * 80 + "\t\n\r\f\v" * 2
    (tmp_path / "mostly.txt").write_text(text)
    assert load_corpus(tmp_path) == text.rstrip("\n")


# --- tokenizers -----------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 🎉\n\ttabs"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert all(0 <= i < tok.vocab_size == 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode(tok.encode("🎉")[:2]) == "\ufffd"  # a cut character decodes, replaced


def test_byte_tokenizer_refuses_ids_outside_its_vocabulary():
    with pytest.raises(DataError, match="token id 300"):
        ByteTokenizer().decode([104, 300])


def test_unknown_tokenizer_lists_valid_names():
    assert isinstance(get_tokenizer("byte", "any"), ByteTokenizer)
    with pytest.raises(DataError, match=r"tokenizer 'wordpiece' is neither a name \(byte, bpe\)"):
        get_tokenizer("wordpiece", "any")


def test_bpe_without_tokenizers_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(DataError, match=re.escape("interlace[hf]")):
        get_tokenizer("bpe", "some text")


def test_bpe_round_trips_and_is_cached(tmp_path):
    pytest.importorskip("tokenizers")
    text = load_corpus(None)[:60_000]
    tok = get_tokenizer("bpe", text, vocab_size=512, cache_dir=tmp_path)
    assert isinstance(tok, BPETokenizer)
    assert tok.vocab_size == 512
    ids = tok.encode(text)
    assert max(ids) < tok.vocab_size
    assert len(ids) < len(text.encode("utf-8")) / 2  # merges learned: fewer tokens than bytes
    assert tok.decode(ids) == text
    unicode = "héllo wörld — 日本語 🎉\n\n  spaces\r\n"
    assert tok.decode(torch.tensor(tok.encode(unicode))) == unicode

    (cached,) = tmp_path.iterdir()
    before = cached.stat()
    again = BPETokenizer.train(text, vocab_size=512, cache_dir=tmp_path)
    after = cached.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # loaded
    assert again.encode(unicode) == tok.encode(unicode)

    cached.write_text("not json")  # a corrupt cache entry is retrained and replaced
    assert BPETokenizer.train(text, vocab_size=512, cache_dir=tmp_path).encode(text) == ids


def test_bpe_vocab_below_the_byte_alphabet_is_refused(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(DataError, match="vocab_size=100"):
        BPETokenizer.train("text", vocab_size=100, cache_dir=tmp_path)


# --- held-out split -------------------------------------------------------------------------


def test_split_holds_out_the_tail_and_windows_never_cross_it():
    d = TokenData(torch.arange(1000), SEQ_LEN, val_fraction=0.1)
    assert d.split == 900
    assert d.train_windows.shape == ((900 - 1) // SEQ_LEN, SEQ_LEN + 1)
    assert d.val_windows.shape == ((100 - 1) // SEQ_LEN, SEQ_LEN + 1)
    train, val = set(d.train_windows.flatten().tolist()), set(d.val_windows.flatten().tolist())
    assert not train & val
    assert max(train) < d.split <= min(val)
    # stride seq_len: the last token of one window is the first of the next
    assert torch.equal(d.train_windows[1:, 0], d.train_windows[:-1, -1])


def test_validation_keeps_at_least_one_window():
    d = TokenData(torch.arange(100), 20, val_fraction=0.01)
    assert len(d.val_windows) == 1
    assert d.split == 100 - 21


def test_from_text_tokenizes():
    text = "abc" * 100
    d = TokenData.from_text(text, ByteTokenizer(), 4)
    assert torch.equal(d.tokens, torch.tensor(list(text.encode())))


def test_too_short_corpus_names_a_seq_len_that_fits():
    tokens = torch.arange(30)
    with pytest.raises(DataError, match=r"30 tokens.*seq_len=20") as err:
        TokenData(tokens, 20)
    fits = int(re.search(r"seq_len <= (\d+) would fit", str(err.value)).group(1))
    assert len(TokenData(tokens, fits).train_windows) >= 1
    with pytest.raises(DataError):
        TokenData(tokens, fits + 1)


@pytest.mark.parametrize(
    ("tokens", "seq_len", "fraction", "named"),
    [
        (torch.arange(100).view(10, 10), 4, 0.05, "shape"),
        (torch.rand(100), 4, 0.05, "float"),
        (torch.arange(100), 0, 0.05, "seq_len=0"),
        (torch.arange(100), 4, 0.0, "val_fraction=0.0"),
        (torch.arange(100), 4, 1.0, "val_fraction=1.0"),
    ],
)
def test_bad_token_data_arguments(tokens, seq_len, fraction, named):
    with pytest.raises(DataError, match=named):
        TokenData(tokens, seq_len, fraction)


# --- training batches -----------------------------------------------------------------------


def test_batches_are_shifted_windows(data):
    x, y = TrainBatches(data, 16, seed=0).global_batch(3)
    assert x.shape == y.shape == (16, SEQ_LEN)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(y, x + 1)  # tokens are positions: the target is the next token


def test_same_seed_same_batches_different_seed_different(data):
    a, b, c = (
        TrainBatches(data, 16, seed=3),
        TrainBatches(data, 16, seed=3),
        TrainBatches(data, 16, 4),
    )
    for step in (0, 5, 100):
        assert torch.equal(a.global_batch(step)[0], b.global_batch(step)[0])
        assert not torch.equal(a.global_batch(step)[0], c.global_batch(step)[0])


def test_every_train_window_appears_once_per_epoch(data):
    stream = TrainBatches(data, 24, seed=1)
    n = stream.num_windows
    steps = math.ceil(2 * n / 24)
    order = torch.cat([stream.window_indices(s) for s in range(steps)])
    epoch0, epoch1 = order[:n], order[n : 2 * n]
    assert torch.equal(epoch0.sort().values, torch.arange(n))
    assert torch.equal(epoch1.sort().values, torch.arange(n))
    assert not torch.equal(epoch0, epoch1)
    for s in range(steps):  # the batches hold exactly those windows
        assert torch.equal(stream.global_batch(s)[0][:, 0], stream.window_indices(s) * SEQ_LEN)
    last_of_epoch0 = (n - 1) // 24
    assert stream.epoch_of(last_of_epoch0) == 0
    assert stream.epoch_of(last_of_epoch0 + 1) == 1


def test_resume_at_any_step_gives_the_uninterrupted_batches(data):
    run = TrainBatches(data, 24, seed=7)
    steps = range(2 * run.num_windows // 24 + 2)  # crosses two epoch boundaries
    uninterrupted = [run.micro_batches(s, dp_rank=1, dp_size=2, accum=3) for s in steps]
    for step in (len(steps) - 1, run.num_windows // 24, 0, 31):  # out of order, fresh object
        resumed = TrainBatches(data, 24, seed=7)
        start = resumed.load_state_dict(run.state_dict(step))
        assert start == step
        got = resumed.micro_batches(start, dp_rank=1, dp_size=2, accum=3)
        for (x, y), (x0, y0) in zip(got, uninterrupted[step], strict=True):
            assert torch.equal(x, x0)
            assert torch.equal(y, y0)


@pytest.mark.parametrize(("dp_size", "accum"), [(1, 1), (2, 1), (2, 3), (3, 2), (4, 6), (24, 1)])
def test_dp_slices_and_micro_batches_concatenate_to_the_global_batch(data, dp_size, accum):
    stream = TrainBatches(data, 24, seed=2)
    step = stream.num_windows // 24  # straddles the first epoch boundary
    parts = [mb for r in range(dp_size) for mb in stream.micro_batches(step, r, dp_size, accum)]
    assert len(parts) == dp_size * accum
    assert {x.shape[0] for x, _ in parts} == {24 // (dp_size * accum)}
    x, y = stream.global_batch(step)
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_indivisible_global_batch_names_the_numbers_and_valid_choices(data):
    stream = TrainBatches(data, 24)
    with pytest.raises(DataError, match=r"global_batch_size=24 .* dp_size\*accum=5\*1=5"):
        stream.micro_batches(0, 0, 5, 1)
    with pytest.raises(
        DataError, match=re.escape("accum that divides 12 (one of [1, 2, 3, 4, 6, 12])")
    ):
        stream.micro_batches(0, 0, 2, 5)


def test_bad_rank_step_and_batch_size_are_refused(data):
    stream = TrainBatches(data, 24)
    with pytest.raises(DataError, match="dp_rank=2"):
        stream.micro_batches(0, 2, 2, 1)
    with pytest.raises(DataError, match="step=-1"):
        stream.global_batch(-1)
    with pytest.raises(
        DataError, match=rf"holds {stream.num_windows} windows.*global_batch_size=5000"
    ):
        TrainBatches(data, 5000)


def test_mismatched_checkpoint_state_is_refused(data):
    saved = TrainBatches(data, 24, seed=1).state_dict(10)
    with pytest.raises(CheckpointError, match="seed 1 in the checkpoint vs 2 now"):
        TrainBatches(data, 24, seed=2).load_state_dict(saved)
    other = TokenData(torch.arange(4003).flip(0), SEQ_LEN)
    with pytest.raises(CheckpointError, match="fingerprint"):
        TrainBatches(other, 24, seed=1).load_state_dict(saved)
    with pytest.raises(CheckpointError, match="lacks seed"):
        TrainBatches(data, 24, seed=1).load_state_dict(
            {k: v for k, v in saved.items() if k != "seed"}
        )


# --- evaluation batches ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dp_size", "max_batches"), [(1, None), (2, None), (3, None), (3, 5), (4, 2)]
)
def test_eval_shards_are_equal_ordered_and_average_to_the_serial_mean(data, dp_size, max_batches):
    n_val = len(data.val_windows)
    count = n_val if max_batches is None else min(n_val, 4 * max_batches)
    shard = count // dp_size
    ranks = [eval_batches(data, 4, max_batches, r, dp_size) for r in range(dp_size)]
    sizes = [sum(x.shape[0] for x, _ in batches) for batches in ranks]
    assert sizes == [shard] * dp_size
    assert all(x.shape[0] <= 4 for batches in ranks for x, _ in batches)
    x_all = torch.cat([x for batches in ranks for x, _ in batches])
    assert torch.equal(x_all, data.val_windows[: dp_size * shard, :-1])

    def loss(x: torch.Tensor) -> torch.Tensor:  # any per-window number stands in for a loss
        return x.double().mean(dim=1)

    per_rank = [torch.cat([loss(x) for x, _ in batches]).mean() for batches in ranks]
    assert torch.stack(per_rank).mean().item() == pytest.approx(loss(x_all).mean().item())


def test_eval_with_more_ranks_than_windows_is_refused(data):
    with pytest.raises(DataError, match=rf"{len(data.val_windows)} windows.*dp_size=64"):
        eval_batches(data, 4, None, 0, 64)
