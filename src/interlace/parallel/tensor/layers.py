"""The modules of 1D tensor parallelism: `RowParallelLinear`, `VocabParallelEmbedding`,
`VocabParallelHead`, the vocab-parallel cross-entropy, and the hook that routes a block's input
into the tensor parallel region (`enter_block`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from interlace.comm import Group
from interlace.errors import PlanError
from interlace.matmul import PLAIN, Matmul
from interlace.parallel.tensor.comm import (
    copy_to_tp,
    gather_last_dim,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter_sequence,
    vocab_parallel_cross_entropy_per_token,
)
from interlace.parallel.tensor.reduction import (
    replayed_reduce_scatter,
    scheduled_reduce,
    yielding_reduce,
)

# ----------------------------------------------------------------------------- modules


def enter_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """`copy_to_tp` as the layers run it: its backward all-reduce hands the turn to another
    sub-batch while it flies (`reduction.yielding_reduce`). Any shape."""
    return copy_to_tp(x, group, yielding_reduce)


def leave_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """`reduce_from_tp` as the layers run it: yielding to other sub-batches, and replayed in a
    recomputed forward (`reduction.scheduled_reduce`). Any shape."""
    return reduce_from_tp(x, group, scheduled_reduce)


class RowParallelLinear(nn.Module):
    """y = Σ_r x_r·W_rᵀ + b: this rank's input features x_r [..., in/p] → full [..., out].

    `weight` is this rank's piece, [out, in/p] (`conv1d=False`, nn.Linear layout) or
    [in/p, out] (HF Conv1D layout, kept so parameter shapes read like the original's); `bias`
    [out] is replicated and added after the sum. With `sequence_parallel` the sum is
    reduce-scattered along the sequence: output [B, T/p, out].
    """

    matmul: Matmul = PLAIN
    """Computes the products (`interlace.matmul`); a converter may set another."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: Group,
        conv1d: bool,
        sequence_parallel: bool,
    ):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.group = group
        self.conv1d = conv1d
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = weight.shape[::-1] if not conv1d else weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in/p] → [..., out] (sequence parallel: [B, T, in/p] → [B, T/p, out])."""
        partial = self.matmul.linear(x, self.weight.t() if self.conv1d else self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(partial, self.group, replayed_reduce_scatter)
        else:
            y = leave_tp(partial, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (this rank), out_features={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """Token ids [...] → embeddings [..., d], this rank holding rows [vocab_start, vocab_end).

    Ids outside the range look up zeros; the ranks' partial results are all-reduced.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        vocab: int,
        group: Group,
        padding_idx: int | None = None,
    ):
        super().__init__()
        self.weight = weight
        self.group = group
        self.num_embeddings = vocab
        self.embedding_dim = weight.shape[1]
        self.vocab_start = group.rank * weight.shape[0]
        self.vocab_end = self.vocab_start + weight.shape[0]
        local_pad = None if padding_idx is None else padding_idx - self.vocab_start
        self.padding_idx = padding_idx
        self._local_padding_idx = (
            local_pad if local_pad is not None and 0 <= local_pad < weight.shape[0] else None
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[...] int ids → [..., embedding_dim]."""
        local = ids - self.vocab_start
        miss = (local < 0) | (local >= self.weight.shape[0])
        local = local.masked_fill(miss, 0)
        out = F.embedding(local, self.weight, self._local_padding_idx)
        return leave_tp(out.masked_fill(miss.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self) -> str:
        rows = f"rows [{self.vocab_start}, {self.vocab_end})"
        return f"{self.num_embeddings}, {self.embedding_dim}, {rows} on this rank"


class VocabParallelHead(nn.Module):
    """LM head x [..., d] → logits for this rank's vocabulary rows [..., V/p], or all of them
    [..., V] with `gather_output`. `weight` [V/p, d] may be the embedding's own Parameter."""

    matmul: Matmul = PLAIN
    """Computes the products (`interlace.matmul`); a converter may set another."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: Group,
        gather_output: bool,
        sequence_parallel: bool,
    ):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.group = group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0] * (group.size if gather_output else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] → [..., V/p] (or [..., V] when gathering)."""
        if not self.sequence_parallel:  # sequence parallel: the final norm's gather did it
            x = enter_tp(x, self.group)
        logits = self.matmul.linear(x, self.weight, self.bias)
        return gather_last_dim(logits, self.group) if self.gather_output else logits


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    group: Group,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over the targets that are not `ignore_index`, from this rank's
    vocabulary slice `local_logits` [..., V/p] (rank r holds ids [r·V/p, (r+1)·V/p)) and global
    ids `targets` [...]. Equals F.cross_entropy on the gathered logits; never gathers them."""
    n_local = local_logits.shape[-1]
    flat_targets = targets.reshape(-1)
    losses = vocab_parallel_cross_entropy_per_token(
        local_logits.reshape(-1, n_local).float(),
        flat_targets,
        group,
        group.rank * n_local,
        ignore_index,
    )
    return losses.sum() / (flat_targets != ignore_index).sum()


# ----------------------------------------------------------------------------- validation


# ----------------------------------------------------------------------------- application


def replace_hidden(
    args: tuple, kwargs: dict, d: int, fn: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[tuple, dict]:
    """Apply `fn` to a module call's hidden states: the first positional tensor, else the first
    floating-point keyword tensor of width d."""
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape[-1] == d:
            return args, {**kwargs, key: fn(value)}
    raise PlanError("tensor parallel block called without a hidden-state tensor argument")


def enter_block(module: nn.Module, d: int, group: Group, sp: bool) -> None:
    """Route a block's input into the tensor parallel region (all-gather of the sequence under
    sequence parallel, else identity whose gradient is all-reduced)."""
    enter = gather_sequence if sp else enter_tp

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return replace_hidden(args, kwargs, d, lambda x: enter(x, group))

    module.register_forward_pre_hook(hook, with_kwargs=True)


def leave_block(module: nn.Module, group: Group, sp: bool) -> None:
    """Sum a block's partial output over the tensor parallel region on its way out (its first
    element if a tuple): a reduce-scatter of the sequence under sequence parallel, else an
    all-reduce (`leave_tp`) whose gradient is the identity."""
    leave = reduce_scatter_sequence if sp else leave_tp

    def hook(mod: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (leave(output[0], group), *output[1:])
        return leave(output, group)

    module.register_forward_hook(hook)
