"""`split_vocab`: the token embedding and the LM head split by vocabulary rows over one group,
for 1D tensor parallelism (over `tp`) and 3D (over the x·y ranks of the grid, `tp_xy`)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from interlace.comm import Group
from interlace.errors import PlanError
from interlace.parallel.detect import Vocab
from interlace.parallel.tensor.layers import VocabParallelEmbedding, VocabParallelHead


def split_vocab(
    model: nn.Module,
    vocab: Vocab,
    group: Group,
    piece: Callable[[nn.Parameter], nn.Parameter],
    sequence_parallel: bool,
    gather_logits: bool,
) -> str:
    """Replace `vocab`'s embedding [V, d] and LM head in `model` with their vocabulary-parallel
    forms over `group`, rank r holding rows [r·V/p, (r+1)·V/p); return the report line.
    `piece(param)` cuts this rank's rows [V/p, ...] as a Parameter carrying its split (the
    dimension's own spec, for checkpoints and the gradient norm); a tied head keeps sharing
    the embedding's piece. The head gives logits [..., V/p] for
    `vocab_parallel_cross_entropy`, or [..., V] with `gather_logits`."""
    embedding = model.get_submodule(vocab.embedding)
    if embedding.max_norm is not None or embedding.sparse or embedding.scale_grad_by_freq:
        raise PlanError(
            f"{vocab.embedding}: vocab-parallel embedding does not support max_norm, sparse "
            "or scale_grad_by_freq; build the embedding without them"
        )
    weight = piece(embedding.weight)
    new_embedding = VocabParallelEmbedding(weight, vocab.vocab, group, embedding.padding_idx)
    _set_module(model, vocab.embedding, new_embedding)
    if vocab.head is None:
        return f"{vocab.embedding}: vocab-parallel embedding; no LM head found"
    head = model.get_submodule(vocab.head)
    head_weight = weight if vocab.tied else piece(head.weight)
    head_bias = None if head.bias is None else piece(head.bias)
    new_head = VocabParallelHead(head_weight, head_bias, group, gather_logits, sequence_parallel)
    _set_module(model, vocab.head, new_head)
    if gather_logits:
        output = "logits all-gathered to [..., V]"
    else:
        output = "this rank's logits [..., V/p], scored by vocab_parallel_cross_entropy"
    tied = " (tied)" if vocab.tied else ""
    return f"{vocab.embedding}, {vocab.head}{tied}: vocab-parallel over {group.name}; {output}"


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
