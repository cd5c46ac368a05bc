"""Token shards on disk: flat files of token ids, a JSON index, and windows read on demand.

A prepared folder (`interlace data prepare`, `prepare.py`) holds `index.json` and the shards
`shard-00000.bin`, `shard-00001.bin`, ...: each the little-endian uint16 (vocabulary ≤ 65536)
or uint32 ids of consecutive tokens, with no header, so the shards end to end are the corpus's
token sequence. The index records the format version, the dtype, the vocabulary size, the
tokenizer, every shard's file name, token count and sha256, and the held-out fraction.

`ShardData` splits and windows that sequence exactly as `TokenData` splits and windows a tensor,
but reads each window from the files when asked (`os.pread`), so memory does not grow with the
corpus.
"""

import dataclasses
import hashlib
import json
import math
import os
from bisect import bisect_right
from pathlib import Path

import numpy as np
import torch

from interlace.data.tokens import split_point
from interlace.errors import DataError

INDEX_FILE = "index.json"
FORMAT_NAME = "interlace-token-shards"
FORMAT_VERSION = 1
TOKEN_DTYPES = ("uint16", "uint32")
_HASH_CHUNK = 1 << 24


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard file: its name in the folder, its token count and the sha256 of its bytes."""

    file: str
    tokens: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    """What `index.json` says of a prepared folder (the format name and version aside).

    `tokenizer` holds `name` (what `--tokenizer` was given) and, for a tokenizer file, `file`
    (its copy in the folder) and `sha256`; `end_of_document` is the id between documents or
    None; `val_fraction` is the share of tokens held out at the end.
    """

    dtype: str
    vocab_size: int
    tokenizer: dict[str, str]
    end_of_document: int | None
    documents: int
    val_fraction: float
    shards: tuple[Shard, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens in all shards together."""
        return sum(shard.tokens for shard in self.shards)

    def to_json(self) -> str:
        """The index as `index.json` text, with the format, total and split written out."""
        fields = dataclasses.asdict(self)
        held_out = math.ceil(self.val_fraction * self.num_tokens)
        split = {"val_fraction": self.val_fraction, "first_val_token": self.num_tokens - held_out}
        fields.update(tokens=self.num_tokens, split=split)
        del fields["val_fraction"]
        return json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, **fields}, indent=1)

    @classmethod
    def read(cls, folder: str | os.PathLike[str]) -> "ShardIndex":
        """Read `folder/index.json`. Raises `DataError` for a missing or malformed index, another
        format or version, or a dtype other than uint16/uint32."""
        path = Path(folder) / INDEX_FILE
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"shard index '{path}' cannot be read: {exc}") from exc
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise DataError(f"'{path}' is not an {FORMAT_NAME} index (no format '{FORMAT_NAME}')")
        if raw.get("version") != FORMAT_VERSION:
            raise DataError(
                f"shard index '{path}' has format version {raw.get('version')!r}, but this "
                f"interlace reads version {FORMAT_VERSION}: prepare the data again"
            )
        try:
            index = cls(
                dtype=raw["dtype"],
                vocab_size=int(raw["vocab_size"]),
                tokenizer=dict(raw["tokenizer"]),
                end_of_document=raw["end_of_document"],
                documents=int(raw["documents"]),
                val_fraction=float(raw["split"]["val_fraction"]),
                shards=tuple(
                    Shard(s["file"], int(s["tokens"]), s["sha256"]) for s in raw["shards"]
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"shard index '{path}' lacks or garbles the field {exc}") from exc
        if index.dtype not in TOKEN_DTYPES:
            raise DataError(
                f"shard index '{path}' has dtype {index.dtype!r}; valid: {', '.join(TOKEN_DTYPES)}"
            )
        return index


def token_dtype(vocab_size: int) -> str:
    """Return the narrowest shard dtype for ids in [0, vocab_size): uint16 or uint32. Raises
    `DataError` for a vocabulary larger than uint32 holds."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise DataError(
        f"tokenizer vocabulary of {vocab_size:,} ids exceeds uint32 ({1 << 32:,} ids), the widest "
        "shard dtype: use a tokenizer with a smaller vocabulary"
    )


def numpy_dtype(name: str) -> np.dtype:
    """The little-endian numpy dtype of a shard dtype name ("uint16" or "uint32")."""
    return np.dtype(name).newbyteorder("<")


def is_shard_folder(path: str | os.PathLike[str] | None) -> bool:
    """Whether `path` is a folder holding a shard index (else it is text or None)."""
    return path is not None and (Path(path) / INDEX_FILE).is_file()


def check_shard_sizes(folder: str | os.PathLike[str], index: ShardIndex) -> None:
    """Raise `DataError` for a shard that is missing or whose byte size is not its token count
    times the dtype's size (a truncated or changed file)."""
    itemsize = numpy_dtype(index.dtype).itemsize
    for shard in index.shards:
        path = Path(folder) / shard.file
        expected = shard.tokens * itemsize
        size = path.stat().st_size if path.is_file() else None
        if size != expected:
            found = "is missing" if size is None else f"holds {size:,} bytes"
            raise DataError(
                f"shard '{path}' {found}, but the index says {shard.tokens:,} {index.dtype} "
                f"tokens ({expected:,} bytes): the folder is damaged; prepare the data again"
            )


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Return the hex sha256 of a file's bytes, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_shards(folder: str | os.PathLike[str]) -> ShardIndex:
    """Check every shard's size and sha256 against the index and return the index. Raises
    `DataError` naming the first shard that differs."""
    index = ShardIndex.read(folder)
    check_shard_sizes(folder, index)
    for shard in index.shards:
        path = Path(folder) / shard.file
        if file_sha256(path) != shard.sha256:
            raise DataError(
                f"shard '{path}' does not match the sha256 in the index (its size does): the "
                "folder is damaged; prepare the data again"
            )
    return index


class ShardWriter:
    """Appends ids to `shard-NNNNN.bin` files in `folder`, starting a new one every
    `shard_tokens` ids, and hashes each as it goes."""

    def __init__(self, folder: Path, dtype: str, shard_tokens: int) -> None:
        self.folder = folder
        self.dtype = numpy_dtype(dtype)
        self.shard_tokens = shard_tokens
        self.shards: list[Shard] = []
        self._file = None
        self._digest = None
        self._count = 0

    def write(self, ids: np.ndarray) -> None:
        """Append 1-D ids of the shard dtype."""
        while ids.size:
            if self._file is None:
                self._open()
            take = min(ids.size, self.shard_tokens - self._count)
            raw = ids[:take].astype(self.dtype).tobytes()
            self._file.write(raw)
            self._digest.update(raw)
            self._count += take
            ids = ids[take:]
            if self._count == self.shard_tokens:
                self._finish()

    def close(self) -> list[Shard]:
        """Finish the last shard and return every shard written."""
        if self._file is not None:
            self._finish()
        return self.shards

    def _open(self) -> None:
        name = f"shard-{len(self.shards):05d}.bin"
        self._file = open(self.folder / name, "wb")  # noqa: SIM115
        self._digest = hashlib.sha256()
        self._count = 0

    def _finish(self) -> None:
        self._file.close()
        name = Path(self._file.name).name
        self.shards.append(Shard(name, self._count, self._digest.hexdigest()))
        self._file = None


class ShardTokens:
    """The token sequence of a prepared folder, read from its shards on demand."""

    def __init__(self, folder: str | os.PathLike[str], index: ShardIndex) -> None:
        self.dtype = numpy_dtype(index.dtype)
        self._files = [open(Path(folder) / shard.file, "rb") for shard in index.shards]  # noqa: SIM115
        self._starts = [0]
        for shard in index.shards:
            self._starts.append(self._starts[-1] + shard.tokens)

    def __len__(self) -> int:
        return self._starts[-1]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Return tokens [start, stop) as a fresh array of the shard dtype (across shards)."""
        out = np.empty(stop - start, self.dtype)
        position = start
        shard = bisect_right(self._starts, start) - 1
        while position < stop:
            take = min(stop, self._starts[shard + 1]) - position
            offset = (position - self._starts[shard]) * self.dtype.itemsize
            raw = os.pread(self._files[shard].fileno(), take * self.dtype.itemsize, offset)
            if len(raw) != take * self.dtype.itemsize:
                raise DataError(f"shard '{self._files[shard].name}' shrank while training")
            out[position - start : position - start + take] = np.frombuffer(raw, self.dtype)
            position += take
            shard += 1
        return out


class ShardWindows:
    """Windows of T+1 tokens with stride T over tokens [start, stop) of a `ShardTokens`, as
    `TokenData`'s window views are over a tensor: window i is tokens start+i·T ... start+i·T+T.

    Offers what the batches take of a window tensor: `len()`, `index_select(0, indices)` and
    slices, each giving a fresh LongTensor [k, T+1].
    """

    def __init__(self, tokens: ShardTokens, start: int, stop: int, seq_len: int) -> None:
        self.tokens = tokens
        self.start = start
        self.seq_len = seq_len
        self.count = (stop - start - 1) // seq_len

    def __len__(self) -> int:
        return self.count

    def index_select(self, dim: int, indices: torch.Tensor) -> torch.Tensor:
        """Return windows `indices` (dim must be 0): LongTensor [len(indices), T+1]."""
        if dim != 0:
            raise ValueError(f"windows are selected along dim 0, not {dim}")
        rows = np.empty((len(indices), self.seq_len + 1), np.int64)
        for row, window in enumerate(indices.tolist()):
            first = self.start + window * self.seq_len
            rows[row] = self.tokens.read(first, first + self.seq_len + 1)
        return torch.from_numpy(rows)

    def __getitem__(self, part: slice) -> torch.Tensor:
        """Return the windows of a step-1 slice: LongTensor [k, T+1], one read."""
        first, last, step = part.indices(self.count)
        if step != 1:
            raise ValueError(f"windows are sliced with step 1, not {step}")
        if last <= first:
            return torch.empty((0, self.seq_len + 1), dtype=torch.long)
        start = self.start + first * self.seq_len
        tokens = self.tokens.read(start, self.start + last * self.seq_len + 1)
        return torch.from_numpy(tokens.astype(np.int64)).unfold(0, self.seq_len + 1, self.seq_len)


class ShardData:
    """The train and validation windows of a prepared folder, read on demand: the interface of
    `TokenData` (`train_windows`, `val_windows`, `seq_len`, `split`, `num_tokens`,
    `fingerprint`) at constant memory.

    The split is `TokenData`'s rule with the index's `val_fraction`. `fingerprint` hashes the
    shards' sha256 from the index, T and the split. Raises `DataError` for a bad index, a
    missing or wrongly sized shard, or too few tokens for `seq_len`.
    """

    def __init__(self, folder: str | os.PathLike[str], seq_len: int) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len={seq_len} must be at least 1")
        self.index = ShardIndex.read(folder)
        check_shard_sizes(folder, self.index)
        tokens = ShardTokens(folder, self.index)
        self.seq_len = seq_len
        self.vocab_size = self.index.vocab_size
        self.num_tokens = len(tokens)
        self.split = split_point(self.num_tokens, seq_len, self.index.val_fraction)
        self.train_windows = ShardWindows(tokens, 0, self.split, seq_len)
        self.val_windows = ShardWindows(tokens, self.split, self.num_tokens, seq_len)
        digest = hashlib.sha256(json.dumps([s.sha256 for s in self.index.shards]).encode())
        digest.update(f"{seq_len}:{self.split}".encode())
        self.fingerprint = digest.hexdigest()[:16]
