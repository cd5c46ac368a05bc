"""Tokenizers: text ↔ token ids.

`ByteTokenizer` (the default) maps text to its UTF-8 bytes, vocabulary 256, and needs nothing.
`BPETokenizer` is a byte-level BPE trained on the corpus itself with Hugging Face `tokenizers`
(the `interlace[hf]` extra); training takes well under a second on the built-in corpus and the
result is cached on disk, keyed by a hash of the text and the vocabulary size.
`FileTokenizer` is any Hugging Face `tokenizer.json` (a path to the file or to a folder holding
one), at whatever vocabulary size it has.
"""

import contextlib
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch

from interlace.errors import DataError

if TYPE_CHECKING:
    import tokenizers

TOKENIZER_NAMES = ("byte", "bpe")
BYTE_VOCAB = 256
BPE_VOCAB = 4096
"""The vocabulary size a "bpe" tokenizer is trained to unless told otherwise."""
TOKENIZER_FILE = "tokenizer.json"
END_OF_DOCUMENT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
"""Special tokens that mark the end of a document, looked up in this order in a tokenizer file."""


class Tokenizer(Protocol):
    """What the data pipeline and the trainer need of a tokenizer."""

    name: str
    vocab_size: int
    end_of_document: int | None
    """The id that separates documents in prepared shards, or None to join them as they are."""

    def encode(self, text: str) -> list[int]:
        """Return the token ids of `text`."""
        ...

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Return the text of 1-D token ids."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: `encode` gives one id in [0, 256) per byte, `decode` inverts it.

    Decoding uses errors="replace", so a sequence cut inside a multi-byte character (or sampled
    by a model) still decodes, with U+FFFD for the broken bytes.
    """

    name = "byte"
    vocab_size = BYTE_VOCAB
    end_of_document = None

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of `text` as ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Return the text of 1-D byte ids; raises `DataError` for an id outside [0, 256)."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = [i for i in values if not 0 <= i < BYTE_VOCAB]
        if bad:
            raise DataError(f"token id {bad[0]} is outside the byte vocabulary [0, {BYTE_VOCAB})")
        return bytes(values).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer`: `encode` adds no special tokens (no BOS or CLS a
    post-processor would add), `decode` skips none."""

    def __init__(self, tokenizer: "tokenizers.Tokenizer", name: str) -> None:
        self._tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size()
        self.name = name
        self.end_of_document = next(
            (i for t in END_OF_DOCUMENT_TOKENS if (i := tokenizer.token_to_id(t)) is not None),
            None,
        )

    def encode(self, text: str) -> list[int]:
        """Return the ids of `text`."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Return the text of 1-D ids."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self._tokenizer.decode(values, skip_special_tokens=False)


class FileTokenizer(HFTokenizer):
    """The tokenizer saved in a `tokenizer.json` (`path` names the file or a folder holding
    one); its name is the file's path. Raises `DataError` for a path without one or a file
    `tokenizers` cannot load."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        file = tokenizer_file(path)
        if file is None:
            raise DataError(_tokenizer_hint(path))
        tk = _import_tokenizers()
        try:
            tokenizer = tk.Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            raise DataError(f"tokenizer file '{file}' cannot be loaded: {exc}") from exc
        super().__init__(tokenizer, str(file))
        self.file = file


class BPETokenizer(HFTokenizer):
    """Byte-level BPE (GPT-2 style pre-tokenization, no special tokens) from `tokenizers`.

    Every string round-trips exactly: `decode(encode(s)) == s`. Build one with `train`.
    """

    def __init__(self, tokenizer: "tokenizers.Tokenizer") -> None:
        super().__init__(tokenizer, f"bpe-{tokenizer.get_vocab_size()}")

    @classmethod
    def train(
        cls,
        text: str,
        vocab_size: int = BPE_VOCAB,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> "BPETokenizer":
        """Train on `text` (or load the cached result of an identical earlier training, kept in
        `bpe_cache_file`). The vocabulary may come out smaller than `vocab_size` on a short
        text. Raises `DataError` if `tokenizers` is missing or `vocab_size` < 256.
        """
        tk = _import_tokenizers()
        if vocab_size < BYTE_VOCAB:
            raise DataError(
                f"bpe vocab_size={vocab_size} is below the {BYTE_VOCAB} byte symbols: "
                f"use at least {BYTE_VOCAB} (e.g. 4096)"
            )
        cached = bpe_cache_file(text, vocab_size, cache_dir)
        if cached.is_file():
            with contextlib.suppress(Exception):  # a corrupt entry is trained again, overwritten
                return cls(tk.Tokenizer.from_file(str(cached)))
        tokenizer = train_byte_level_bpe(text.splitlines(keepends=True), vocab_size)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        tokenizer.save(str(partial))
        os.replace(partial, cached)
        return cls(tokenizer)


def train_byte_level_bpe(
    texts: Sequence[str], vocab_size: int, special_tokens: Sequence[str] = ()
) -> "tokenizers.Tokenizer":
    """A byte-level BPE (every byte a symbol, so any string round-trips) of at most
    `vocab_size` ids trained on `texts`, with `special_tokens` first."""
    tk = _import_tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(special_tokens),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def default_cache_dir() -> Path:
    """Folder for cached tokenizers: `$INTERLACE_CACHE/tokenizers`, default `~/.cache/interlace`."""
    base = os.environ.get("INTERLACE_CACHE") or Path.home() / ".cache" / "interlace"
    return Path(base) / "tokenizers"


def bpe_cache_file(
    text: str, vocab_size: int = BPE_VOCAB, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Where the BPE trained on `text` to `vocab_size` is cached (a `tokenizers` JSON file):
    `<cache_dir>/bpe-<vocab_size>-<sha256(text)[:16]>.json`, `cache_dir` defaulting to
    `default_cache_dir()`."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return folder / f"bpe-{vocab_size}-{digest}.json"


def get_tokenizer(
    name: str,
    text: str,
    *,
    vocab_size: int = BPE_VOCAB,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """Return the tokenizer `name`: "byte", "bpe" (trained on `text`) or the path of a
    `tokenizer.json` or of a folder holding one.

    `vocab_size` and `cache_dir` apply to "bpe" only. Raises `DataError` for anything else.
    """
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe":
        return BPETokenizer.train(text, vocab_size=vocab_size, cache_dir=cache_dir)
    return FileTokenizer(name)


def tokenizer_file(path: str | os.PathLike[str]) -> Path | None:
    """Return the `tokenizer.json` that `path` names (the file, or a folder holding one), or None
    where there is none."""
    candidate = Path(path)
    if candidate.is_dir():
        candidate = candidate / TOKENIZER_FILE
    return candidate if candidate.is_file() else None


def check_tokenizer(name: str) -> None:
    """Raise `DataError` unless `name` is "byte", "bpe" or names an existing tokenizer file."""
    if name not in TOKENIZER_NAMES and tokenizer_file(name) is None:
        raise DataError(_tokenizer_hint(name))


def _tokenizer_hint(name: str | os.PathLike[str]) -> str:
    return (
        f"tokenizer '{os.fspath(name)}' is neither a name ({', '.join(TOKENIZER_NAMES)}) nor a "
        f"{TOKENIZER_FILE} file or a folder holding one"
    )


def _import_tokenizers() -> ModuleType:
    try:
        import tokenizers
    except ImportError as exc:
        raise DataError(
            "the bpe and file tokenizers need the `tokenizers` package: pip install "
            "'interlace[hf]' (or use tokenizer 'byte')"
        ) from exc
    return tokenizers
