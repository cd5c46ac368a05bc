"""The S2 Reducer as a DDP comm hook: `ddp.register_comm_hook(SketchState(group), sketch_hook)`.

Per bucket g [d] (the flat gradient DDP hands the hook), `sketch_allreduce`:
  1. all-reduces the union bitmap of the non-zeros (blocking: its size decides the sketch width),
  2. when the sketch pays (bitmap + 4·r·c < 4·d bytes, c = ceil(width_factor · nnz(union))),
     encodes the union's entries into an r × c count sketch and all-reduces it asynchronously;
     otherwise all-reduces g densely,
  3. decodes on the union (zero elsewhere) and divides by the world size, in a `then` callback:
     by peeling (default; exact with high probability at width_factor 0.8) or by the median of
     the rows (the paper's count-sketch estimator; lossy), see `interlace.compress.sketch`.
The hook returns that Future, like torch's default hook; the blocking union collective is the
only step the backward pass waits on (on CUDA the union's `nonzero` also syncs the host). All
collectives go through `interlace.comm` (metered).

State. `SketchState` keeps per-bucket statistics (`stats`, keyed by `bucket.index()`) and, with
`error_feedback=True`, each bucket's residual g − (local decoded contribution), added to the next
step's gradient. DDP puts every parameter in one bucket for the first iteration and rebuilds its
buckets afterwards (torch 2.13 without `find_unused_parameters`), so nothing assumes a bucket's
size: an entry whose parameter shapes change is started afresh (its residual is dropped once).
A bucket found dense is sent dense without the bitmap probe for `recheck_every` calls; the
decision depends only on the union, so every rank takes the same path.

Hashes are re-drawn for every (bucket, call) from `seed` (numpy SeedSequence), so collisions do
not repeat on the same coordinates step after step; every rank must pass the same `seed`.

torch ships PowerSGD and fp16/bf16 hooks but no sparse-gradient sketch, hence this module.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from interlace import comm
from interlace.compress import sketch
from interlace.errors import ConfigError


@dataclass
class Reduction:
    """One bucket's reduction in flight.

    `future` yields the mean over ranks [d]; `path` is "sketch", "dense", "topk" or "empty";
    `bytes_sent` the payload bytes this rank handed to collectives; `union_nnz` / `local_nnz`
    the non-zeros of the union / of this rank's gradient, `exact_nnz` the union entries the
    sketch decodes exactly (each -1 when not counted); `columns` the sketch width; `residual`
    [d] what this rank's contribution lost (None when nothing was).
    """

    future: torch.futures.Future[torch.Tensor]
    path: str
    bytes_sent: int
    union_nnz: int = -1
    local_nnz: int = -1
    exact_nnz: int = -1
    columns: int = 0
    residual: torch.Tensor | None = None


def dense_mean(flat: torch.Tensor, group: comm.Group) -> Reduction:
    """Mean of `flat` [d] over `group` by one async all-reduce (divides `flat` in place)."""
    flat.div_(group.size)
    work = comm.all_reduce(flat, group, async_op=True)
    assert work is not None
    return Reduction(work.get_future().then(lambda fut: fut.value()[0]), "dense", flat.nbytes)


def _done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


def sketch_allreduce(
    flat: torch.Tensor,
    group: comm.Group,
    rows: int = 3,
    width_factor: float | None = None,
    seed: int = 0,
    union: str = "auto",
    decode: str = "peel",
    residual: bool = False,
) -> Reduction:
    """Mean over `group` of the flat gradient [d] by bitmap union + count-sketch all-reduce.

    Falls back to a dense all-reduce, which divides `flat` in place, when the sketch would not
    move fewer bytes. With `residual=True` the result carries g − (decode of this rank's own
    sketch) [d] on the entries the decode does not recover exactly. Blocks on the union
    collective; the sketch all-reduce runs asynchronously.
    """
    if decode not in sketch.DECODE_METHODS:
        raise ConfigError(f"decode={decode!r} is unknown; use one of {sketch.DECODE_METHODS}")
    numel = flat.numel()
    if numel >= sketch.PRIME:
        raise ConfigError(
            f"a bucket of {numel} elements is too large for the sketch hashes (limit "
            f"{sketch.PRIME - 1}); use a smaller DDP bucket_cap_mb"
        )
    method = sketch.resolve_union_method(union, group, flat.device)
    bitmap_bytes = sketch.union_bytes(method, numel)
    mask = flat != 0
    positions = sketch.union_positions(mask, group, method)
    nnz, local_nnz = positions.numel(), int(mask.sum())
    if nnz == 0:
        return Reduction(_done(torch.zeros_like(flat)), "empty", bitmap_bytes, 0, 0)
    value_dtype = torch.promote_types(flat.dtype, torch.float32)  # sums in fp32 at least
    value_bytes = torch.finfo(value_dtype).bits // 8
    if width_factor is None:
        width_factor = sketch.DEFAULT_WIDTH[decode]
    cols = sketch.sketch_columns(nnz, width_factor)
    if not sketch.sketch_pays(flat.nbytes, rows, cols, value_bytes, bitmap_bytes):
        dense = dense_mean(flat, group)
        dense.bytes_sent += bitmap_bytes
        dense.union_nnz, dense.local_nnz = nnz, local_nnz
        return dense
    hashes = sketch.CountSketch.from_seed(seed, rows, cols, flat.device)
    columns, signs = hashes.columns(positions), hashes.signs(positions, value_dtype)
    values = flat[positions].to(value_dtype)
    table = sketch.encode(values, columns, signs, cols)
    decoder = sketch.Decoder(decode, columns, signs, cols)
    inexact = (~decoder.exact).nonzero().squeeze(1)
    lost = None
    if residual and inexact.numel():  # exactly decoded entries lose nothing but rounding
        lost = torch.zeros_like(flat)
        lost[positions[inexact]] = (values - decoder(table))[inexact].to(flat.dtype)
    work = comm.all_reduce(table, group, async_op=True)
    assert work is not None
    ranks = group.size  # the callback holds no reference to the process group

    def unpack(fut: torch.futures.Future) -> torch.Tensor:
        out = torch.zeros_like(flat)
        out[positions] = (decoder(fut.value()[0]) / ranks).to(flat.dtype)
        return out

    future = work.get_future().then(unpack)
    sent = bitmap_bytes + table.nbytes
    exact = nnz - inexact.numel()
    return Reduction(future, "sketch", sent, nnz, local_nnz, exact, cols, lost)


@dataclass
class BucketStats:
    """What one DDP bucket has sent so far (cumulative bytes) and its last call's shape.

    `union_density` / `local_density` are nnz/numel of the union / of this rank's gradient and
    `exact_fraction` the share of union entries decoded exactly, at the last call that counted
    them (NaN before one); `dense_bytes` what the dense all-reduce would have handed to
    collectives over the same calls; before call `dense_until` the bucket is sent dense
    without a bitmap probe.
    """

    index: int
    numel: int
    params: int
    calls: int = 0
    path: str = ""
    columns: int = 0
    union_density: float = math.nan
    local_density: float = math.nan
    exact_fraction: float = math.nan
    bytes_sent: int = 0
    dense_bytes: int = 0
    dense_until: int = 0


class CompressionState:
    """Per-bucket bookkeeping shared by the compressing hooks: stats, residuals, rebuilds.

    `stats` {bucket index: BucketStats} of the current buckets; `rebuilds` counts buckets whose
    parameters changed (DDP's bucket rebuild); `bucket_counts` the number of buckets of each
    iteration so far; `bytes_sent` / `dense_bytes` totals over every call since creation.
    """

    def __init__(self, group: comm.Group, error_feedback: bool = False) -> None:
        self.group = group
        self.error_feedback = error_feedback
        self.stats: dict[int, BucketStats] = {}
        self.rebuilds = 0
        self.bucket_counts: list[int] = []
        self.bytes_sent = 0
        self.dense_bytes = 0
        self._residuals: dict[int, torch.Tensor] = {}
        self._signatures: dict[int, tuple] = {}

    def entry(self, bucket: dist.GradBucket) -> BucketStats:
        """This bucket's stats, started afresh when its parameters changed (bucket rebuild)."""
        index = bucket.index()
        params = bucket.parameters()
        signature = tuple(tuple(p.shape) for p in params)
        if self._signatures.get(index) != signature:
            self.rebuilds += index in self._signatures
            self._signatures[index] = signature
            self.stats[index] = BucketStats(index, bucket.buffer().numel(), len(params))
            self._residuals.pop(index, None)
        if bucket.is_last():
            for stale in [i for i in self.stats if i > index]:
                del self.stats[stale], self._signatures[stale]
                self._residuals.pop(stale, None)
            self.bucket_counts.append(index + 1)
        return self.stats[index]

    def gradient(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """The bucket's gradient [d] plus its stored residual under error feedback."""
        residual = self._residuals.get(index)
        return flat if residual is None else flat + residual

    def record(self, entry: BucketStats, flat: torch.Tensor, reduction: Reduction) -> None:
        """Count one call of `entry`'s bucket and keep its residual under error feedback."""
        entry.calls += 1
        entry.path = reduction.path
        entry.columns = reduction.columns
        numel = max(1, flat.numel())
        if reduction.union_nnz >= 0:
            entry.union_density = reduction.union_nnz / numel
        if reduction.local_nnz >= 0:
            entry.local_density = reduction.local_nnz / numel
        if reduction.exact_nnz >= 0:
            entry.exact_fraction = reduction.exact_nnz / max(1, reduction.union_nnz)
        entry.bytes_sent += reduction.bytes_sent
        entry.dense_bytes += flat.nbytes
        self.bytes_sent += reduction.bytes_sent
        self.dense_bytes += flat.nbytes
        if not self.error_feedback:
            return
        if reduction.residual is None:
            self._residuals.pop(entry.index, None)
        else:
            self._residuals[entry.index] = reduction.residual

    def summary(self) -> dict[str, float]:
        """Current bucket count, total bytes sent and dense bytes, their ratio, rebuilds."""
        dense = self.dense_bytes
        return {
            "buckets": len(self.stats),
            "bytes_sent": self.bytes_sent,
            "dense_bytes": dense,
            "ratio": self.bytes_sent / dense if dense else math.nan,
            "rebuilds": self.rebuilds,
        }


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


class SketchState(CompressionState):
    """Options and per-bucket state of `sketch_hook`.

    rows r (default 3) and width_factor (c = ceil(width_factor · nnz(union)); None takes
    `sketch.DEFAULT_WIDTH[decode]`). `decode="peel"` (default) recovers every union entry exactly
    with high probability, so the sketch is lossless at 4·3·0.8 ≈ 10 bytes per union entry;
    `decode="median"` is the paper's count-sketch estimator, lossy at any width (see
    `interlace.compress.sketch`). `union` is the bitmap-union method; a bucket the sketch cannot
    shrink is sent dense and re-probed after `recheck_every` calls (0: every call).
    """

    def __init__(
        self,
        group: comm.Group,
        rows: int = 3,
        width_factor: float | None = None,
        seed: int = 0,
        error_feedback: bool = False,
        union: str = "auto",
        decode: str = "peel",
        recheck_every: int = 50,
    ) -> None:
        _check(isinstance(rows, int) and rows >= 1, f"rows={rows!r} must be an integer >= 1; use 3")
        _check(union in sketch.UNION_METHODS, f"union={union!r}; use one of {sketch.UNION_METHODS}")
        _check(
            decode in sketch.DECODE_METHODS,
            f"decode={decode!r}; use one of {sketch.DECODE_METHODS}",
        )
        if width_factor is None:
            width_factor = sketch.DEFAULT_WIDTH[decode]
        _check(width_factor > 0, f"width_factor={width_factor} must be > 0; use e.g. 0.8")
        _check(recheck_every >= 0, f"recheck_every={recheck_every} must be >= 0; use e.g. 50")
        super().__init__(group, error_feedback)
        self.rows = rows
        self.width_factor = width_factor
        self.seed = seed
        self.union = union
        self.decode = decode
        self.recheck_every = recheck_every

    def seed_for(self, index: int, call: int) -> int:
        """The hash seed of call `call` of bucket `index` (the same on every rank)."""
        return int(np.random.SeedSequence([self.seed, index, call]).generate_state(1)[0])


def sketch_hook(state: SketchState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean over `state.group` by the S2 Reducer (see module doc)."""
    flat = bucket.buffer()
    entry = state.entry(bucket)
    grad = state.gradient(entry.index, flat)
    if entry.calls < entry.dense_until:
        reduction = dense_mean(grad, state.group)
    else:
        reduction = sketch_allreduce(
            grad,
            state.group,
            state.rows,
            state.width_factor,
            state.seed_for(entry.index, entry.calls),
            state.union,
            state.decode,
            residual=state.error_feedback,
        )
        if reduction.path == "dense":
            entry.dense_until = entry.calls + 1 + state.recheck_every
    state.record(entry, flat, reduction)
    return reduction.future.then(write_into(flat))


def write_into(flat: torch.Tensor) -> Callable[[torch.futures.Future], torch.Tensor]:
    """Callback writing a Future's tensor into the bucket buffer `flat` and returning it."""

    def copy(fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()
        return flat if value is flat else flat.copy_(value)

    return copy
