"""Count-sketch math of the S2 Reducer: bitmaps, their union across ranks, encode and decode.

A flat gradient g [d] is summed over p ranks in two collectives (S2 Reducer, arXiv 2110.02140):

1. **Union of supports.** b = (g ≠ 0) on each rank; B = OR over ranks. `union_positions` offers
   three ways, all bit-exact: `"bor"` packs b into ceil(d/8) bytes and all-reduces with bitwise
   OR (gloo supports `ReduceOp.BOR` on uint8; NCCL has no BOR), `"gather"` all-gathers the packed
   bytes and ORs them locally (p·d/8 bytes received; no BOR needed), `"max"` all-reduces b as
   uint8 [d] with MAX (8× the bytes of the packed forms, but no packing). `"auto"` takes `"bor"`
   on gloo, else `"gather"` below 16 ranks and `"max"` from 16 up (where ring MAX moves fewer
   bytes than the gather). Packing costs CPU time: where bandwidth is not the limit (loopback)
   `"max"` is the fastest, so measure on the target network before choosing.
2. **Count sketch of the union's entries.** r rows × c columns; row j hashes position i to the
   column h_j(i) = ((a_j·i + b_j) mod P) mod c and the sign s_j(i) = 2·(((a'_j·i + b'_j) mod P)
   mod 2) − 1, with P = 2³¹ − 1 and coefficients drawn from a seed every rank shares (Carter–Wegman
   2-universal hashing, computed in int64: a·i < 2⁶²). S[j, h_j(i)] += s_j(i)·g[i] for i ∈ B only,
   so entries collide only with other union entries. Sketches are linear: the SUM all-reduce of
   the per-rank tables is the sketch of Σ_ranks g.
3. **Decode on B only**, zero elsewhere (`Decoder`). `"median"`: ĝ[i] = median_j
   s_j(i)·S[j, h_j(i)] (the count-sketch estimator). `"peel"`: because B is known, a cell that
   holds exactly one union entry gives that entry exactly; peel such entries, subtract them from
   every row and repeat (as in invertible Bloom lookup tables); entries left in a cycle fall back
   to the median of the peeled table. With r = 3 peeling recovers every entry with high
   probability once r·c ≥ 1.23·nnz(B), i.e. c ≳ 0.41·nnz(B). Which entries come out exact depends
   on the columns only, so it is known before any value is sent.

Count-sketch bound used by the tests: with 2-universal h and pairwise independent signs, the
error of one row at i has E[X²] ≤ ‖g_{−i}‖²/c, so by Chebyshev P(|X| > ε‖g‖₂) ≤ 1/(c·ε²); for
ε = sqrt(e/c) a row fails with probability ≤ 1/e and the median of r independent rows fails only
if at least ⌈r/2⌉ rows fail: δ(r) = Σ_{k ≥ ⌈r/2⌉} C(r,k)·e^{−k}·(1 − 1/e)^{r−k} (0.26 for r = 5).

All functions are vectorised torch ops on the input's device (CPU or CUDA alike); torch has no
count sketch, hence this module.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from interlace import comm

PRIME = 2**31 - 1
"""The Mersenne prime P of the hash family; positions must be < P (buckets of < 2³¹ elements)."""

UNION_METHODS = ("auto", "bor", "gather", "max")
_GATHER_MAX_RANKS = 16


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask [d] into uint8 [ceil(d/8)], bit k of byte m holding mask[8m + k]."""
    bits = F.pad(mask.to(torch.uint8), (0, (-mask.numel()) % 8)).view(-1, 8)
    packed = bits[:, 0].clone()
    for k in range(1, 8):  # eight strided passes: faster than a reduction over the short dim
        packed |= bits[:, k] << k
    return packed


def packed_positions(packed: torch.Tensor) -> torch.Tensor:
    """Positions of the set bits of `pack_bits` output: uint8 [m] → sorted int64 [n].

    Expands only the non-zero bytes, so a sparse bitmap costs O(m + n), not O(8m).
    """
    full = packed.nonzero().squeeze(1)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = ((packed[full].unsqueeze(1) >> shifts) & 1).view(-1).bool()
    return (full.unsqueeze(1) * 8 + shifts.long()).view(-1)[bits]


def resolve_union_method(method: str, group: comm.Group, device: torch.device) -> str:
    """The concrete union method for `method` ("auto" picks by backend and group size)."""
    if method not in UNION_METHODS:
        raise ValueError(f"union method {method!r} is unknown; use one of {UNION_METHODS}")
    if method != "auto":
        return method
    if device.type == "cpu" and "gloo" in str(dist.get_backend(group.pg)):
        return "bor"
    return "gather" if group.size < _GATHER_MAX_RANKS else "max"


def union_bytes(method: str, numel: int) -> int:
    """Payload bytes one rank hands to the union collective of `method` for a [numel] mask."""
    return numel if method == "max" else math.ceil(numel / 8)


def union_positions(mask: torch.Tensor, group: comm.Group, method: str = "auto") -> torch.Tensor:
    """Sorted positions int64 [n] where the bool mask [d] is set on at least one rank of `group`.

    Blocking: n decides the size of what follows.
    """
    method = resolve_union_method(method, group, mask.device)
    if method == "max":
        flags = mask.to(torch.uint8)
        comm.all_reduce(flags, group, op=dist.ReduceOp.MAX)
        return flags.nonzero().squeeze(1)
    packed = pack_bits(mask)
    if method == "bor":
        comm.all_reduce(packed, group, op=dist.ReduceOp.BOR)
        return packed_positions(packed)
    gathered = packed.new_empty(group.size * packed.numel())
    comm.all_gather(gathered, packed, group)
    return packed_positions(functools.reduce(torch.bitwise_or, gathered.view(group.size, -1)))


def sketch_columns(nnz: int, width_factor: float) -> int:
    """Columns c = max(1, ceil(width_factor · nnz)) of a sketch for `nnz` union entries."""
    return max(1, math.ceil(width_factor * nnz))


def sketch_pays(
    dense_bytes: int, rows: int, cols: int, value_bytes: int, bitmap_bytes: int
) -> bool:
    """True when the bitmap plus r·c sketch values are fewer bytes than the dense bucket."""
    return bitmap_bytes + rows * cols * value_bytes < dense_bytes


@dataclass(frozen=True)
class CountSketch:
    """The shared hashes of an r × c count sketch.

    `coeffs` int64 [4, r] holds (a_j, b_j) of the column hashes and (a'_j, b'_j) of the sign
    hashes; every rank builds the same one with `from_seed`.
    """

    coeffs: torch.Tensor
    cols: int

    @classmethod
    def from_seed(
        cls, seed: int, rows: int, cols: int, device: torch.device | str = "cpu"
    ) -> CountSketch:
        """Draw the 4·r coefficients from a CPU generator seeded with `seed` (same on every
        rank and device), then move them to `device`."""
        gen = torch.Generator().manual_seed(seed)
        slopes = torch.randint(1, PRIME, (2, rows), generator=gen, dtype=torch.int64)
        offsets = torch.randint(0, PRIME, (2, rows), generator=gen, dtype=torch.int64)
        coeffs = torch.stack([slopes[0], offsets[0], slopes[1], offsets[1]])
        return cls(coeffs.to(device), cols)

    @property
    def rows(self) -> int:
        """Number of rows r."""
        return self.coeffs.shape[1]

    def columns(self, positions: torch.Tensor) -> torch.Tensor:
        """Column h_j(i) of each position: int64 [n] → int64 [r, n]."""
        a, b = self.coeffs[0].unsqueeze(1), self.coeffs[1].unsqueeze(1)
        return (a * positions + b) % PRIME % self.cols

    def signs(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Sign s_j(i) ∈ {−1, +1} of each position: int64 [n] → `dtype` [r, n]."""
        a, b = self.coeffs[2].unsqueeze(1), self.coeffs[3].unsqueeze(1)
        return ((a * positions + b) % PRIME % 2).to(dtype) * 2 - 1


def encode(
    values: torch.Tensor, columns: torch.Tensor, signs: torch.Tensor, cols: int
) -> torch.Tensor:
    """Sketch table S [r, cols] with S[j, columns[j, i]] += signs[j, i] · values[i].

    values [n], columns int64 [r, n], signs [r, n] (values' dtype).
    """
    table = values.new_zeros(columns.shape[0], cols)
    return table.scatter_add_(1, columns, signs * values)


def _median_rows(estimates: torch.Tensor) -> torch.Tensor:
    """Median over dim 0 of [r, n] (mean of the middle two when r is even) → [n]."""
    ordered = estimates.sort(dim=0).values
    r = ordered.shape[0]
    if r % 2:
        return ordered[r // 2]
    return (ordered[r // 2 - 1] + ordered[r // 2]) / 2


def decode_median(table: torch.Tensor, columns: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Count-sketch estimate median_j s_j(i)·S[j, h_j(i)]: table [r, c] → values [n]."""
    return _median_rows(signs * table.gather(1, columns))


def sole_rows(columns: torch.Tensor, cols: int) -> torch.Tensor:
    """For each position, the number of rows where no other position shares its column.

    columns int64 [r, n] → int64 [n]. A position alone in a majority of rows is decoded exactly by
    `decode_median` (up to the rounding of the sum).
    """
    load = torch.zeros(columns.shape[0], cols, dtype=torch.int64, device=columns.device)
    load.scatter_add_(1, columns, torch.ones_like(columns))
    return (load.gather(1, columns) == 1).sum(dim=0)


@dataclass(frozen=True)
class PeelSchedule:
    """The order in which peeling resolves the union entries; it depends on the columns only.

    `rounds` holds per round (entries int64 [m], the row isolating each int64 [m]); `left` int64
    [k] the entries no cell ever isolates (a cycle), which the median estimates.
    """

    rounds: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    left: torch.Tensor


def peel_schedule(columns: torch.Tensor, cols: int, max_rounds: int = 64) -> PeelSchedule:
    """Plan the peeling of entries with columns int64 [r, n] in an r × `cols` sketch.

    Each round takes every open entry that sits alone in some cell and closes it; one
    device-to-host sync per round (the stop test).
    """
    load = torch.zeros(columns.shape[0], cols, dtype=torch.int64, device=columns.device)
    load.scatter_add_(1, columns, torch.ones_like(columns))
    open_ = torch.ones(columns.shape[1], dtype=torch.bool, device=columns.device)
    rounds = []
    for _ in range(max_rounds):
        alone = (load.gather(1, columns) == 1) & open_
        found = alone.any(dim=0).nonzero().squeeze(1)
        if found.numel() == 0:
            break
        rounds.append((found, alone[:, found].int().argmax(dim=0)))
        open_[found] = False
        load.scatter_add_(1, columns[:, found], -torch.ones_like(columns[:, found]))
    return PeelSchedule(tuple(rounds), open_.nonzero().squeeze(1))


def decode_peel(
    table: torch.Tensor, columns: torch.Tensor, signs: torch.Tensor, schedule: PeelSchedule
) -> torch.Tensor:
    """Decode by replaying `schedule`: an isolated entry reads its cell exactly and is subtracted
    from every row; entries left over get the median of the peeled table.

    table [r, c], columns int64 [r, n], signs [r, n] → values [n].
    """
    table = table.clone()
    values = table.new_zeros(columns.shape[1])
    for found, row in schedule.rounds:
        pick = torch.arange(found.numel(), device=table.device)
        cols, sgn = columns[:, found], signs[:, found]
        found_values = sgn[row, pick] * table[row, cols[row, pick]]
        values[found] = found_values
        table.scatter_add_(1, cols, -sgn * found_values)
    left = schedule.left
    if left.numel():
        values[left] = decode_median(table, columns[:, left], signs[:, left])
    return values


DECODE_METHODS = ("median", "peel")

DEFAULT_WIDTH = {"median": 4.0, "peel": 0.8}
"""Default width_factor per decode method at r = 3 (measured on Gaussian values, n = 2000):
peeling is exact from ≈ 0.5 and fails on under 1 % of draws at 0.8 for n ≥ 1000; the median's
relative error ‖ĝ − g‖/‖g‖ is ≈ 0.5 at 1.0, 0.3 at 2.0 and 0.19 at 4.0."""


class Decoder:
    """Decoding of one sketch layout by `method` ("median" or "peel").

    `exact` bool [n] marks the union entries recovered exactly (up to the rounding of the sum),
    known from the columns alone: for the median, entries alone in a majority of rows; for
    peeling, every entry the schedule isolates. `decoder(table)` → values [n].
    """

    def __init__(self, method: str, columns: torch.Tensor, signs: torch.Tensor, cols: int):
        if method not in DECODE_METHODS:
            raise ValueError(f"decode method {method!r} is unknown; use one of {DECODE_METHODS}")
        self.columns, self.signs = columns, signs
        self.schedule: PeelSchedule | None = None
        if method == "median":
            self.exact = sole_rows(columns, cols) > columns.shape[0] // 2
        else:
            self.schedule = peel_schedule(columns, cols)
            self.exact = torch.ones(columns.shape[1], dtype=torch.bool, device=columns.device)
            self.exact[self.schedule.left] = False

    def __call__(self, table: torch.Tensor) -> torch.Tensor:
        """Values [n] of the entries from the sketch table [r, c]."""
        if self.schedule is None:
            return decode_median(table, self.columns, self.signs)
        return decode_peel(table, self.columns, self.signs, self.schedule)
