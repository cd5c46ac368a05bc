"""Token ids split into a training part and a held-out validation part, cut into windows.

With N tokens, sequence length T and validation fraction f, the last max(⌈f·N⌉, T+1) tokens
are held out and the rest train. Each part is cut into non-overlapping windows of T+1 tokens
with stride T (neighbouring windows share one boundary token: the last target of one is the
first input of the next); a window w gives input w[:-1] and target w[1:]. No window crosses
the split, so no validation token is ever a training input or target.
"""

import hashlib
import math
from functools import cached_property

import torch

from interlace.data.tokenizer import Tokenizer
from interlace.errors import DataError

SYNTHETIC = "synthetic"
"""The `data` value that trains on `TokenData.synthetic` tokens at the preset's vocabulary."""


class TokenData:
    """Train and validation windows of a 1-D token tensor.

    `train_windows` is a LongTensor view [n_train, T+1] and `val_windows` one of [n_val, T+1];
    both are views into `tokens`. `split` is the index of the first held-out token.
    Raises `DataError` for tokens that are not 1-D integers, a bad `seq_len` or `val_fraction`,
    or a corpus too short for one window on each side of the split (naming a `seq_len` that fits).
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, val_fraction: float = 0.05) -> None:
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise DataError(
                f"token ids must be a 1-D integer tensor, got dtype {tokens.dtype} "
                f"and shape {tuple(tokens.shape)}"
            )
        if seq_len < 1:
            raise DataError(f"seq_len={seq_len} must be at least 1")
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"val_fraction={val_fraction} must lie strictly between 0 and 1")
        self.split = split_point(tokens.numel(), seq_len, val_fraction)
        self.tokens = tokens.to(torch.long).cpu()
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        self.train_windows = _windows(self.tokens[: self.split], seq_len)
        self.val_windows = _windows(self.tokens[self.split :], seq_len)

    @classmethod
    def from_text(
        cls, text: str, tokenizer: Tokenizer, seq_len: int, val_fraction: float = 0.05
    ) -> "TokenData":
        """Tokenize `text` and split it as the constructor does."""
        return cls(torch.tensor(tokenizer.encode(text), dtype=torch.long), seq_len, val_fraction)

    @classmethod
    def synthetic(cls, vocab_size: int, seq_len: int, windows: int, seed: int) -> "TokenData":
        """`windows` windows of T = `seq_len` tokens drawn uniformly from [0, vocab_size) with
        `seed` (plus held-out ones, split as the constructor does): data for measuring speed
        at any vocabulary, with nothing to learn."""
        n = math.ceil(windows * seq_len / 0.95) + 2 * (seq_len + 1)
        generator = torch.Generator().manual_seed(seed)
        return cls(torch.randint(vocab_size, (n,), generator=generator), seq_len)

    @property
    def num_tokens(self) -> int:
        """Tokens on both sides of the split."""
        return self.tokens.numel()

    @cached_property
    def fingerprint(self) -> str:
        """A short hash of the token ids, seq_len and split: detects a changed corpus on resume."""
        digest = hashlib.sha256(self.tokens.numpy().tobytes())
        digest.update(f"{self.seq_len}:{self.split}".encode())
        return digest.hexdigest()[:16]


def split_point(n: int, seq_len: int, val_fraction: float) -> int:
    """Return the index of the first held-out token of `n`: the last max(⌈f·n⌉, T+1) tokens are
    held out. Raises `DataError` where either side would hold less than one window of T+1."""
    held_out = max(math.ceil(val_fraction * n), seq_len + 1)
    if n - held_out < seq_len + 1:
        fits = min(n - 1 - math.ceil(val_fraction * n), n // 2 - 1)
        hint = f"seq_len <= {fits} would fit" if fits >= 1 else "use a longer corpus"
        raise DataError(
            f"corpus has {n} tokens: too few for seq_len={seq_len} with val_fraction="
            f"{val_fraction} ({held_out} held out, {n - held_out} left to train, each side "
            f"needs at least {seq_len + 1}); {hint}"
        )
    return n - held_out


def _windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    return tokens.unfold(0, seq_len + 1, seq_len)
