"""Expert parallelism inside 1D tensor parallelism (ep × tp): every token is dispatched once.

Expert groups are carved out of the dp groups (`groups.py`), so the ranks of an expert group
share a tp index, and the p ranks of a tp group hold the same experts (the same ep index) in p
expert groups of their own. Without sequence parallelism those p ranks hold the same N tokens
at an MoE layer: rank r routes and dispatches only its chunk, the r-th of p consecutive
near-equal chunks of the rows (⌈N/p⌉ or ⌊N/p⌋ rows; whole sequences when p divides the batch
rows), and the tp group all-gathers the combined rows:

    split_tokens    forward: this rank's chunk        backward: all-gather of the chunks
    gather_tokens   forward: all-gather of the chunks backward: this rank's chunk

(the layer's input is replicated, so its gradient is every chunk's gathered; its output feeds
replicated computation, so every rank already holds the whole output gradient). With sequence
parallelism the tokens are already split over tp and each rank dispatches its own.

A rank's routing therefore sees its token set alone, as a data parallel rank does:

- capacity counts that set (ceil(capacity_factor · N_set · k / E), `ExpertParallelMoE`);
- the aux loss is the mean over the tp group of each set's own (`TokenShare.aux_loss`: equal on
  every tp rank, so is the loss; backward 1/p to each set's), as data parallelism averages it;
- router gradients come from this rank's set only: summed over tp by a hook (registered by
  `apply.share_tokens_over_tp`;
  under sequence parallelism the sequence pass of `tensor.apply` hooks the router already);
- an expert's gradient comes from the sets its tp rank dispatched: summed over the ranks
  holding the same experts, ep_dp and tp, then divided by dp (`grads.reduce_expert_gradients`).

Without sequence parallelism the chunks of the dp·tp ranks, in rank order, are the rows a plan
with dp·tp data parallel ranks gives each (when p divides the batch rows): the run equals that
plan's, capacity and aux loss included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from interlace.comm import Group
from interlace.parallel.expert.comm import gathered_rows
from interlace.parallel.tensor.comm import reduce_from_tp


def _lengths(n: int, group: Group) -> list[int]:
    """Rows of n per rank, in rank order: ⌈n/p⌉ for the first n mod p ranks, ⌊n/p⌋ after."""
    size, longer = divmod(n, group.size)
    return [size + (r < longer) for r in range(group.size)]


def _chunk(n: int, group: Group) -> tuple[int, int]:
    """(start, length) of this rank's rows of n."""
    lengths = _lengths(n, group)
    return sum(lengths[: group.rank]), lengths[group.rank]


def _gather_rows(chunk: torch.Tensor, group: Group, n: int) -> torch.Tensor:
    """Every rank's chunk [n_r, d] → the n rows [n, d] in rank order (one all-gather of the
    chunks padded to ⌈n/p⌉ rows)."""
    return gathered_rows(chunk, group, _lengths(n, group))


class _SplitTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.n = group, tokens.shape[0]
        start, length = _chunk(tokens.shape[0], group)
        return tokens.narrow(0, start, length)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_rows(grad.contiguous(), ctx.group, ctx.n), None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, chunk: torch.Tensor, group: Group, n: int) -> torch.Tensor:
        ctx.group = group
        return _gather_rows(chunk.contiguous(), group, n)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, length = _chunk(grad.shape[0], ctx.group)
        return grad.narrow(0, start, length), None, None


def split_tokens(tokens: torch.Tensor, group: Group) -> torch.Tensor:
    """Replicated tokens [N, d] → this rank's chunk [n_r, d]; backward all-gathers."""
    return _SplitTokens.apply(tokens, group)


def gather_tokens(chunk: torch.Tensor, group: Group, n: int) -> torch.Tensor:
    """Every rank's chunk [n_r, d] of n rows → [n, d]; backward keeps this rank's chunk."""
    return _GatherTokens.apply(chunk, group, n)


@dataclass(frozen=True)
class TokenShare:
    """An expert-parallel layer's tokens over its tensor parallel `group`: `replicated` (no
    sequence parallelism; each rank dispatches its chunk) or already split; `rows`: groups
    whose ranks route other tokens (tp3d's z slices, whose cross-entropy is averaged over
    them, `tensor3d.step`; under tp3d's sequence parallelism its y ranks, which hold other
    parts of the sequences), over which the aux loss is averaged too."""

    group: Group
    replicated: bool
    rows: tuple[Group, ...] = ()

    def enter(self, tokens: torch.Tensor) -> torch.Tensor:
        """The layer's tokens [N, d] → those this rank routes and dispatches [n_r, d]; without
        sequence parallelism N must be at least p (every rank routes a token set)."""
        if not self.replicated:
            return tokens
        if tokens.shape[0] < self.group.size:
            raise ValueError(
                f"ep × tp splits an MoE layer's {tokens.shape[0]} tokens over tp="
                f"{self.group.size} ranks; give it at least {self.group.size} tokens"
            )
        return split_tokens(tokens, self.group)

    def leave(self, out: torch.Tensor, n: int) -> torch.Tensor:
        """This rank's combined rows [n_r, d] → the layer's output [n, d]."""
        return gather_tokens(out, self.group, n) if self.replicated else out

    def aux_loss(self, aux: torch.Tensor) -> torch.Tensor:
        """This rank's aux loss (0-d) → the mean over the group and `rows` (backward: 1/p
        each)."""
        for group in (self.group, *self.rows):
            aux = reduce_from_tp(aux / group.size, group)
        return aux
