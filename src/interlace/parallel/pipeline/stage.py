"""Pipeline stage modules of the built-in GPT, and the tied embedding shared by the two ends.

    first stage:  idx [b, T] → wte(idx) + wpe(positions) → drop → its blocks → h [b, T, d]
                  (positions 0..T−1, or the global positions of a context-parallel rank's share)
    middle stage: h [b, T, d] → its blocks → h [b, T, d]
    last stage:   h [b, T, d] → its blocks → ln_f → lm_head → logits [b, T, V]

A stage *references* the full model's modules (no copy), under the same attribute names, so
its parameters keep their original names: `blocks` is an `nn.ModuleDict` keyed by the global
layer index ("blocks.5.attn.q_proj.weight" on whichever rank runs layer 5). `local_module`
gathers a rank's stages (several with interleaving) into one module with those names, for the
optimizer and for checkpoints.

**Tied embeddings.** The GPT's LM head uses the token embedding's weight W [V, d]; its gradient
is the sum of the lookup's and the head's parts. With the embedding on the first rank and the
head on the last, the last rank holds a *copy* of W as `lm_head.weight` (the name a serial
model's state dict gives it too). After backward, the two copies' gradients are summed by one
all-reduce over a 2-rank group {first, last} (`TiedEmbedding.sync_grads`), so both hold the
serial model's gradient of W. They start equal (one copies the other), receive equal
gradients, and go through the same optimizer update with the same hyperparameters and state,
so they stay equal; gradient clipping must count W once (`PipelineRunner.clip_grad_norm_`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from interlace import comm
from interlace.comm import Group
from interlace.mesh import Mesh
from interlace.models.gpt import GPT, embed
from interlace.parallel.grad_sums import SUMMED_OVER, sum_gradient_over
from interlace.parallel.pipeline.aux_loss import StageAuxLoss
from interlace.recompute import checkpointed
from interlace.tensors import local_tensor

TIED_GROUP_NAME = "pp_ends"
"""Comm-meter name of the {first, last} pipeline rank group that sums the tied embedding."""


class GPTStage(nn.Module):
    """Layers [start, stop) of a GPT, plus its embeddings if `first` and its head if `last`.

    forward: idx [b, T] (first) or hidden [b, T, d] → hidden [b, T, d], or logits [b, T, V]
    (last). Layers whose global index is in `checkpointed` run under activation checkpointing
    (non-reentrant; `recompute_mode` "full", or "selective": the matmul and attention outputs
    kept, see `interlace.recompute`); under tensor parallelism their recomputation reuses the
    forward's all-reduced outputs instead of reducing again (`replay.ReductionReplay`).
    `head_copy` makes the last stage's LM head an own Parameter copied from the tied embedding
    (see the module docstring); otherwise the model's `lm_head` is used. `aux`: the MoE blocks'
    load-balancing losses (`aux_loss.StageAuxLoss`): carried into backward after each MoE
    block, recorded once per forward.
    """

    forward_scopes: tuple[Callable[[], contextlib.AbstractContextManager], ...] = ()
    """Contexts the forward runs inside (set by `PipelineRunner`)."""

    def __init__(
        self,
        model: GPT,
        layers: range,
        *,
        first: bool,
        last: bool,
        checkpointed: frozenset[int] = frozenset(),
        recompute_mode: str = "full",
        head_copy: bool = False,
    ) -> None:
        super().__init__()
        self.is_first, self.is_last = first, last
        self.checkpointed, self.recompute_mode = checkpointed, recompute_mode
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
            self.positions = model.positions  # a rank's share's under context parallelism
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.ln_f = model.ln_f
            self.lm_head = copy_head(model.lm_head) if head_copy else model.lm_head
        self.aux = StageAuxLoss.of_blocks(self.blocks.values(), model.aux_loss_coef)

    def forward(
        self, x: torch.Tensor, start: int = 0, stop: int | None = None, checkpoint: bool = True
    ) -> torch.Tensor:
        """See the class docstring for the shapes; `run_span` for the arguments."""
        return run_span(self, x, start, stop, checkpoint)

    def run_piece(
        self, piece: Callable[[torch.Tensor], torch.Tensor], recomputed: bool, x: torch.Tensor
    ) -> torch.Tensor:
        """`piece(x)`, under torch's checkpoint in `recompute_mode` when `recomputed` (its
        replay reusing the forward's tensor parallel reductions)."""
        return checkpointed(piece, self.recompute_mode, x) if recomputed else piece(x)

    def pieces(self) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], bool]]:
        """The stage's computation in order, as (function, checkpointed) pairs: the embedding
        (first stage), each block, the head (last stage). The checkpointed blocks come first."""
        out: list[tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = []
        if self.is_first:
            out.append((self._embed, False))
        out += [
            (self._block(block), int(i) in self.checkpointed) for i, block in self.blocks.items()
        ]
        if self.is_last:
            out.append((self._head, False))
        return out

    def _block(self, block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The block, followed by its aux loss's carry if it is an MoE block."""
        if block.mlp not in self.aux.layers:
            return block
        return lambda x: self.aux.carry(block(x), block.mlp)

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        return embed(self, idx, self.positions(idx.shape[1], idx.device))

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def run_span(
    stage: nn.Module, x: torch.Tensor, start: int, stop: int | None, checkpoint: bool
) -> torch.Tensor:
    """Run `stage`'s pieces [start, stop) (all by default) on x, each as `run_piece` runs it
    (`checkpoint` False: the checkpointed ones plainly too, for an executor that replays them
    itself); at the stage's end (`stop` None) record its aux losses. Called as the stage's
    forward, so that hooks on the stage module (FSDP2's) run for every part. All of it runs
    inside the stage's `forward_scopes` (under 1D tensor parallelism the deferral scope, in
    which a sub-batched layer may leave its last all-reduce to the next; none is left on
    return)."""
    with contextlib.ExitStack() as scopes:
        for scope in stage.forward_scopes:
            scopes.enter_context(scope())
        for piece, recomputed in stage.pieces()[start:stop]:
            x = stage.run_piece(piece, recomputed and checkpoint, x)
    if stop is None:
        stage.aux.record()
    return x


def copy_head(head: nn.Module) -> nn.Module:
    """The LM head with its weight as a new Parameter of the same values (and the same
    attributes: under a split, its shard spec), its gradient summed over the same group as the
    original's where a split sums it (`grad_sums`): the last stage's copy of the tied embedding.
    Whatever split replaced the head (a vocabulary-parallel one) is kept: the module is copied
    as it is, its parameters alone replaced."""
    weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    for name, value in vars(head.weight).items():
        setattr(weight, name, value)
    groups = vars(weight).pop(SUMMED_OVER, ())
    for group in groups:  # a head replicated over tp3d's z, each z rank fed its rows
        sum_gradient_over(weight, group)
    clone = copy.copy(head)
    clone._parameters = dict(head._parameters)
    clone.weight = weight
    return clone


def local_module(stages: Sequence[GPTStage]) -> nn.Module:
    """One module holding every parameter of this rank's `stages` under the GPT's original
    names (wte, wpe, blocks.<i>, ln_f, lm_head): what the optimizer and checkpoints see."""
    holder = nn.Module()
    blocks: dict[str, nn.Module] = {}
    for stage in stages:
        for name in ("wte", "wpe", "drop", "ln_f", "lm_head"):
            if hasattr(stage, name):
                holder.add_module(name, getattr(stage, name))
        blocks.update(stage.blocks.items())
    holder.blocks = nn.ModuleDict(dict(sorted(blocks.items(), key=lambda kv: int(kv[0]))))
    return holder


class TiedEmbedding:
    """The embedding weight W held by the first pipeline rank and its copy on the last.

    `param` is this rank's copy (None on ranks holding neither end). Built collectively: every
    rank of the world must construct it, in the same order, since it creates one 2-rank
    process group {first, last} per pipeline.
    """

    def __init__(self, mesh: Mesh, param: nn.Parameter | None) -> None:
        self.param = param
        self.group = _ends_group(mesh)

    def sync_grads(self) -> None:
        """Sum the two copies' gradients (in place, through the comm meter): afterwards both
        hold the serial model's gradient of W. A no-op on ranks holding neither end."""
        if self.param is None or self.group is None:
            return
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        comm.all_reduce(local_tensor(self.param.grad), self.group)  # sharded: piece by piece


def _ends_group(mesh: Mesh) -> Group | None:
    """The {first, last} ranks of this rank's pipeline, as a comm Group (None in between).

    With pp = 2 that is the whole "pp" group. Otherwise one new group per pipeline, created by
    every rank in the same order (torch's `new_group` is collective over the world)."""
    pp = mesh.group("pp")
    if pp.size == 2:
        return Group(TIED_GROUP_NAME, pp.pg, 2, pp.rank)
    ranks = mesh.device_mesh.mesh.reshape(pp.size, -1)  # column j = the ranks of pipeline j
    me = dist.get_rank()
    mine: Group | None = None
    for column in ranks.t().tolist():
        ends = [column[0], column[-1]]
        pg = dist.new_group(ends)
        if me in ends:
            mine = Group(TIED_GROUP_NAME, pg, 2, ends.index(me))
    return mine
