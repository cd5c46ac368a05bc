"""Zig-zag placement of a sequence over the cp ranks of context parallelism.

A sequence of T tokens is cut into 2·cp chunks of T / (2·cp); rank r holds chunks r and
2·cp − 1 − r, in that order. Under causal attention chunk c attends to c + 1 chunks, so each
rank's pair attends to (r + 1) + (2·cp − r) = 2·cp + 1 chunks: the same work on every rank,
where cp contiguous pieces would give the last rank 2·cp − 1 times the first one's.
"""

from __future__ import annotations

import torch

from interlace.parallel.context.options import check_divisible


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2·cp) rank `rank` holds: (rank, 2·cp − 1 − rank)."""
    return rank, 2 * cp - 1 - rank


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [seq_len / cp] of the tokens rank `rank` holds, in its local order."""
    check_divisible(seq_len, cp)
    chunk = seq_len // (2 * cp)
    return torch.cat(
        [torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in zigzag_chunks(cp, rank)]
    )


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s zig-zag share of `x` along `dim`: [..., T, ...] → [..., T / cp, ...]."""
    check_divisible(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for c in zigzag_chunks(cp, rank)], dim=dim)
