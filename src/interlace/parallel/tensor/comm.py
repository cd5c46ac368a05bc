"""The communication of 1D (Megatron-style) tensor parallelism, as autograd functions.

A tensor parallel group of p ranks splits every block into a column-parallel half (each rank
computes its own slice of the hidden features from the full input) and a row-parallel half
(each rank computes a partial sum of the full output). Four conjugate pairs move activations
between the replicated region and the tensor parallel region:

    copy_to_tp              forward identity           backward all-reduce       ("f")
    reduce_from_tp          forward all-reduce         backward identity         ("g")
    gather_sequence         forward all-gather (T)     backward reduce-scatter (T)
    gather_sequence_whole   forward all-gather (T)     backward slice (T)
    reduce_scatter_sequence forward reduce-scatter (T) backward all-gather (T)
    scatter_sequence        forward slice (T)          backward all-gather (T)
    gather_last_dim         forward all-gather (last)  backward slice (last)

and `vocab_parallel_cross_entropy_per_token` computes the cross-entropy of logits whose vocabulary
is split over the group without gathering them: the row maximum and the sums
Σ_v exp(l_v − max) and l_target − max are all-reduced (one MAX of [N] and one SUM of [2, N]).

`copy_to_tp` and `reduce_from_tp` take the function that computes the sum (`all_reduced` by
default): the layers pass `reduction.scheduled_reduce`, which lets overlapped sub-batches take
turns during the all-reduce and recomputation replay the forward's result (`reduction.py`);
the functions here know nothing of either.

Sequence-sharded activations are [B, T/p, ...] (rank r holds tokens [r·T/p, (r+1)·T/p)), the
layout of interlace's models; Megatron keeps [T, B, ...] instead. Every collective goes through
`interlace.comm` so the meter counts it: that is why these are written here rather than taken
from DTensor's redistribution, whose collectives the meter cannot see.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from interlace import comm
from interlace.comm import Group, Reduce
from interlace.errors import PlanError


def all_reduced(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Σ over `group` of x (any shape), as a new tensor: one metered all-reduce."""
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group)
    return out


def _check_sequence(length: int, group: Group) -> int:
    if length % group.size:
        raise PlanError(
            f"sequence length T={length} is not divisible by the {group.size} ranks of "
            f"'{group.name}' that split it; with sequence_parallel=True use T in multiples of "
            f"{group.size}"
        )
    return length // group.size


def _gather_dim1(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[B, n, ...] on every rank → [B, p·n, ...] in rank order."""
    p, shard = group.size, x.contiguous()
    out = torch.empty((p * shard.shape[0], *shard.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, shard, group)
    out = out.view(p, *shard.shape).transpose(0, 1)
    return out.reshape(shard.shape[0], p * shard.shape[1], *shard.shape[2:])


def reduce_scatter_dim1(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[B, T, ...] partial sums → this rank's [B, T/p, ...] of the sum."""
    p, (b, length) = group.size, x.shape[:2]
    n = _check_sequence(length, group)
    chunks = x.reshape(b, p, n, *x.shape[2:]).transpose(0, 1).contiguous()
    out = torch.empty((b, n, *x.shape[2:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, chunks.view(p * b, n, *x.shape[2:]), group)
    return out


def _slice_dim1(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = _check_sequence(x.shape[1], group)
    return x.narrow(1, group.rank * n, n).contiguous()


class _CopyToTP(torch.autograd.Function):
    """f: forward identity, backward all-reduce (by `reduce`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, reduce: Reduce) -> torch.Tensor:
        ctx.group, ctx.reduce = group, reduce
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.reduce(grad, ctx.group), None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce (by `reduce`), backward identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, reduce: Reduce) -> torch.Tensor:
        return reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along T; backward reduce-scatters the gradient, or (`whole`) slices it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, whole: bool) -> torch.Tensor:
        ctx.group, ctx.whole = group, whole
        return _gather_dim1(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _slice_dim1 if ctx.whole else reduce_scatter_dim1
        return back(grad, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, reduce: Reduce) -> torch.Tensor:
        ctx.group = group
        return reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_dim1(grad, ctx.group), None, None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _slice_dim1(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_dim1(grad, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        p, shard = group.size, x.contiguous()
        out = torch.empty((p * shard.numel(),), dtype=x.dtype, device=x.device)
        comm.all_gather(out, shard.view(-1), group)
        out = out.view(p, *shard.shape).movedim(0, -2)
        return out.reshape(*shard.shape[:-1], p * shard.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = grad.shape[-1] // ctx.group.size
        return grad.narrow(-1, ctx.group.rank * n, n).contiguous(), None


def copy_to_tp(x: torch.Tensor, group: Group, reduce: Reduce = all_reduced) -> torch.Tensor:
    """f, entering the tensor parallel region: y = x; ∂L/∂x = Σ_r ∂L_r/∂y (all-reduced over
    `group` by `reduce`: each rank's column-parallel layers see only their slice of the
    features, so each holds a partial input gradient). Any shape."""
    return _CopyToTP.apply(x, group, reduce)


def reduce_from_tp(x: torch.Tensor, group: Group, reduce: Reduce = all_reduced) -> torch.Tensor:
    """g, leaving the tensor parallel region: y = Σ_r x_r (the ranks' partial sums, all-reduced
    over `group` by `reduce`); ∂L/∂x_r = ∂L/∂y, as is. Any shape."""
    return _ReduceFromTP.apply(x, group, reduce)


def gather_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sequence shards [B, T/p, ...] → full [B, T, ...]; backward reduce-scatters the gradient
    (the full-sequence consumers are tensor parallel, so their input gradients are partial)."""
    return _GatherSequence.apply(x, group, False)


def gather_sequence_whole(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sequence shards [B, T/p, ...] → full [B, T, ...] for a consumer whose input gradient is
    already whole on every rank (a replicated one); backward keeps this rank's shard."""
    return _GatherSequence.apply(x, group, True)


def reduce_scatter_sequence(
    x: torch.Tensor, group: Group, reduce: Reduce | None = None
) -> torch.Tensor:
    """Partial sums [B, T, ...] → this rank's sequence shard [B, T/p, ...] of their sum
    (by `reduce`, default `reduce_scatter_dim1`); backward all-gathers the gradient."""
    return _ReduceScatterSequence.apply(x, group, reduce or reduce_scatter_dim1)


def scatter_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Replicated [B, T, ...] → this rank's shard [B, T/p, ...]; backward all-gathers."""
    return _ScatterSequence.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Shards [..., n] → [..., p·n] in rank order; backward keeps this rank's slice (the
    consumer is replicated, so every rank already holds the full gradient)."""
    return _GatherLastDim.apply(x, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-sharded logits; see the module docstring."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: Group,
        vocab_start: int,
        ignore_index: int,
    ) -> torch.Tensor:
        n_local = logits.shape[-1]
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        exp = (logits - row_max.unsqueeze(-1)).exp_()
        local = targets - vocab_start
        hit = (local >= 0) & (local < n_local)
        local = torch.where(hit, local, torch.zeros_like(local))
        target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) - row_max
        stats = torch.stack([exp.sum(-1), torch.where(hit, target_logit, 0.0)])
        comm.all_reduce(stats, group)
        sum_exp, target_logit = stats
        valid = targets != ignore_index
        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, hit & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, hit, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy_per_token(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    group: Group,
    vocab_start: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy of each row of `local_logits` [N, V/p] (this rank's vocabulary slice
    starting at `vocab_start`) against global ids `targets` [N] → losses [N] (0 where the
    target is `ignore_index`). Two all-reduces of [N] and [2, N] floats; logits never gathered."""
    return _VocabParallelCrossEntropy.apply(local_logits, targets, group, vocab_start, ignore_index)
