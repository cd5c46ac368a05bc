"""Deterministic, resumable, data-parallel-sharded batches of token windows.

Training samples form one endless stream: epoch e is a random permutation `perm_e` of the n
training windows, drawn from a `torch.Generator` seeded with `seed·1_000_003 + e`, and the
sample with global index g is window `perm_{g // n}[g % n]`. Optimizer step s uses the global
indices [s·G, (s+1)·G). The stream is a pure function of (seed, step), so resuming at step s
yields exactly the batches of an uninterrupted run, and the data state to checkpoint is the
step alone. Data-parallel rank r of R takes the contiguous slice [r·G/R, (r+1)·G/R) of the
global batch and cuts it into `accum` equal micro-batches, so the concatenation over ranks and
micro-batches is the serial global batch.

Written by hand because `torch.utils.data.DistributedSampler` interleaves ranks
(`indices[rank::R]`), pads uneven epochs with repeats, and can resume only at an epoch start;
here a global batch may span two epochs and any step can be produced directly.
"""

import torch

from interlace.data.shards import ShardData
from interlace.data.tokens import TokenData
from interlace.divisors import divisors
from interlace.errors import CheckpointError, DataError

Batch = tuple[torch.Tensor, torch.Tensor]
_EPOCH_STRIDE = 1_000_003
_CACHED_EPOCHS = 2


class TrainBatches:
    """The training stream of `data.train_windows`: global batches of `global_batch_size` windows.
    `data` is a `TokenData` (windows in memory) or a `ShardData` (windows read from disk).

    Every batch is an (input, target) pair of LongTensors [rows, T] on the CPU, T = data.seq_len.
    Raises `DataError` if the train split holds fewer than `global_batch_size` windows.
    """

    def __init__(self, data: TokenData | ShardData, global_batch_size: int, seed: int = 0) -> None:
        n = len(data.train_windows)
        if global_batch_size < 1:
            raise DataError(f"global_batch_size={global_batch_size} must be at least 1")
        if seed < 0:
            raise DataError(f"seed={seed} must be a non-negative integer")
        if n < global_batch_size:
            raise DataError(
                f"the train split holds {n} windows of {data.seq_len + 1} tokens "
                f"({data.split} tokens), fewer than global_batch_size={global_batch_size}: "
                f"use global_batch_size <= {n}, a shorter seq_len or a longer corpus"
            )
        self.data = data
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.num_windows = n
        self._perms: dict[int, torch.Tensor] = {}

    def epoch_of(self, step: int) -> int:
        """Return the epoch of the first sample of `step` (a step may end in the next epoch)."""
        return _check_step(step) * self.global_batch_size // self.num_windows

    def window_indices(self, step: int) -> torch.Tensor:
        """Return the train-window indices of the global batch of `step`: LongTensor [G]."""
        start = _check_step(step) * self.global_batch_size
        return self._indices(start, start + self.global_batch_size)

    def global_batch(self, step: int) -> Batch:
        """Return the whole global batch of `step` as (x, y), each LongTensor [G, T]."""
        return _split_xy(self.data.train_windows.index_select(0, self.window_indices(step)))

    def micro_batches(
        self, step: int, dp_rank: int = 0, dp_size: int = 1, accum: int = 1
    ) -> list[Batch]:
        """Return rank `dp_rank`'s `accum` micro-batches of `step`, each (x, y) of [G/(R·A), T].

        Raises `DataError` if the global batch size is not divisible by dp_size·accum.
        """
        _check_rank(dp_rank, dp_size)
        if accum < 1:
            raise DataError(f"accum={accum} must be at least 1")
        g = self.global_batch_size
        if g % (dp_size * accum):
            raise DataError(
                f"global_batch_size={g} is not divisible by dp_size*accum={dp_size}*{accum}="
                f"{dp_size * accum}: {_divisibility_hint(g, dp_size, accum)}"
            )
        per_rank = g // dp_size
        start = _check_step(step) * g + dp_rank * per_rank
        windows = self.data.train_windows.index_select(0, self._indices(start, start + per_rank))
        return [_split_xy(chunk) for chunk in windows.split(per_rank // accum)]

    def state_dict(self, step: int) -> dict[str, int | str]:
        """Return the data state of a run about to take `step`: the step plus what must match."""
        return {
            "step": _check_step(step),
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.data.seq_len,
            "num_windows": self.num_windows,
            "fingerprint": self.data.fingerprint,
        }

    def load_state_dict(self, state: dict[str, int | str]) -> int:
        """Check a saved data state against this stream and return the step to resume at.

        Raises `CheckpointError` naming every field (seed, batch size, seq_len, corpus) that
        differs, since resuming with any of them changed would not continue the same run.
        """
        current = self.state_dict(0)
        missing = sorted(set(current) - set(state))
        if missing:
            raise CheckpointError(f"checkpoint data state lacks {', '.join(missing)}")
        diffs = [
            f"{key} {state[key]!r} in the checkpoint vs {value!r} now"
            for key, value in current.items()
            if key != "step" and state[key] != value
        ]
        if diffs:
            raise CheckpointError(
                "checkpoint data state does not match this run: "
                + "; ".join(diffs)
                + " (restore the original settings and corpus, or start a fresh run)"
            )
        return int(state["step"])

    def _indices(self, start: int, stop: int) -> torch.Tensor:
        """Window indices of global samples [start, stop): slices of each epoch's permutation
        (no indexing, which costs the step's host time)."""
        pieces = []
        while start < stop:
            epoch, offset = divmod(start, self.num_windows)
            take = min(stop - start, self.num_windows - offset)
            pieces.append(self._permutation(epoch)[offset : offset + take])
            start += take
        return torch.cat(pieces)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) >= _CACHED_EPOCHS:
                del self._perms[min(self._perms)]
            gen = torch.Generator().manual_seed((self.seed * _EPOCH_STRIDE + epoch) % 2**63)
            self._perms[epoch] = torch.randperm(self.num_windows, generator=gen)
        return self._perms[epoch]


def eval_batches(
    data: TokenData | ShardData,
    batch_size: int,
    max_batches: int | None = None,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> list[Batch]:
    """Return rank `dp_rank`'s validation batches, in order: (x, y) pairs of [≤ batch_size, T].

    The evaluated windows are the first min(n_val, max_batches·batch_size) validation windows
    (the serial run's `max_batches` batches), truncated to a multiple of dp_size so every rank
    gets an equal contiguous shard; the dropped remainder (< dp_size windows) is what makes the
    mean over ranks of per-rank mean losses equal the mean over all evaluated windows. Each
    shard is cut into batches of `batch_size`; the last may be smaller, so weight per-batch
    means by rows. Raises `DataError` if there are fewer validation windows than ranks.
    """
    _check_rank(dp_rank, dp_size)
    if batch_size < 1:
        raise DataError(f"eval batch_size={batch_size} must be at least 1")
    if max_batches is not None and max_batches < 1:
        raise DataError(f"eval max_batches={max_batches} must be at least 1 (or None for all)")
    n_val = len(data.val_windows)
    count = n_val if max_batches is None else min(n_val, max_batches * batch_size)
    shard = count // dp_size
    if shard == 0:
        raise DataError(
            f"the validation split holds {n_val} windows, fewer than dp_size={dp_size}: "
            f"raise val_fraction or lower seq_len"
        )
    windows = data.val_windows[dp_rank * shard : (dp_rank + 1) * shard]
    return [_split_xy(chunk) for chunk in windows.split(batch_size)]


def to_device(batch: Batch, device: torch.device) -> Batch:
    """(x, y) [b, T] on `device`; to CUDA from pinned host memory without blocking the host, so
    the copy overlaps the work already queued."""
    if device.type != "cuda":
        return batch[0].to(device), batch[1].to(device)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in batch)  # type: ignore[return-value]


def _split_xy(windows: torch.Tensor) -> Batch:
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _check_step(step: int) -> int:
    if step < 0:
        raise DataError(f"step={step} must be non-negative")
    return step


def _check_rank(dp_rank: int, dp_size: int) -> None:
    if dp_size < 1:
        raise DataError(f"dp_size={dp_size} must be at least 1")
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank={dp_rank} is outside [0, {dp_size}) for dp_size={dp_size}")


def _divisibility_hint(global_batch_size: int, dp_size: int, accum: int) -> str:
    if global_batch_size % dp_size:
        sizes = divisors(global_batch_size)
        return (
            f"use a global_batch_size that is a multiple of {dp_size * accum}, "
            f"or a dp_size that divides {global_batch_size} (one of {sizes})"
        )
    per_rank = global_batch_size // dp_size
    return (
        f"use a global_batch_size that is a multiple of {dp_size * accum}, "
        f"or with dp_size={dp_size} an accum that divides {per_rank} (one of {divisors(per_rank)})"
    )
