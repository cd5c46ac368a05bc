"""1D tensor parallelism (Megatron-style): column → row inside every block, vocab-parallel ends.

With p ranks in the tensor parallel group and rank r:

- **Column-parallel** (q, k, v; up and gate): W = [W_1; …; W_p] split along the output features,
  y_r = x·W_rᵀ + b_r. Rank r keeps heads [r·h/p, (r+1)·h/p) (GPT-2's fused q|k|v is split per
  part: [q_r | k_r | v_r]). With grouped-query attention and fewer kv heads than ranks, each kv
  head is held by p/h_kv consecutive ranks and its gradient summed among them. The layer is
  the same module, narrower: sharded in place; head-count attributes follow (`num_heads`,
  `split_size`, `num_key_value_groups`, ...).
- **Row-parallel** (out projection; down): W = [W_1, …, W_p] split along the input features,
  y = Σ_r x_r·W_rᵀ + b: `RowParallelLinear` all-reduces the partial sums, then adds b once.
- Entering a block, the input passes `copy_to_tp` (its gradient all-reduced): one all-reduce per
  block forward (row output) and one backward (block input).
- **Vocab-parallel embedding**: rank r holds rows [r·V/p, (r+1)·V/p); other ids look up zeros;
  the sum over ranks is all-reduced. The LM head holds the same rows (tied weights stay one
  Parameter) and gives this rank's logits [..., V/p].
- **Loss**: the built-in GPT keeps its logits sharded — `model(idx, targets)` returns
  (local logits [B, T, V/p], full mean cross-entropy) through `vocab_parallel_cross_entropy`,
  which all-reduces only row maxima and two sums. Every other model (Hugging Face included) gets
  its head output all-gathered to full logits [..., V], so its own loss (HF's `loss_function`),
  `generate` and metrics work unchanged, at one all-gather of B·T·V/p elements per rank.
- **Sequence parallel** (`sequence_parallel=True`): between blocks the residual stream is split
  along the sequence, [B, T/p, d], and LayerNorms run on shards. A block's entry all-gathers the
  sequence (backward reduce-scatter) and its row-parallel exit reduce-scatters (backward
  all-gather): the same bytes as the all-reduce, activations p times smaller. The first layer
  takes its shard of the embedding output; the final norm all-gathers before the head.
  Replicated parameters inside the sharded region (norms, row biases) see only their tokens, so
  their gradients are all-reduced over the group by a hook.

Written by hand rather than with DTensor's `parallelize_module`: every collective must pass the
comm meter (`interlace.comm`), HF's `Conv1D` stores [in, out] and GPT-2 fuses q|k|v (neither is
expressible with `ColwiseParallel`), GQA with fewer kv heads than ranks needs replication, and the
sharded cross-entropy must never gather logits.

Overlapping these all-reduces with compute (`tp_subbatches`) is `tensor_overlap.py`'s work.
Mixture-of-Experts blocks with fused experts (HF Mixtral, Qwen2-MoE) are split, every expert
along its width, by `tensor_moe.py`; other MoE layers stay replicated.

All ranks of the group must hold the same full model before `apply_tensor_parallel` (build
it with the same seed); ranks must also share dropout seeds for the replicated regions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from interlace import comm
from interlace.comm import Group
from interlace.errors import PlanError
from interlace.parallel.detect import (
    HEAD_COUNT_ATTRS,
    Attention,
    FeedForward,
    Structure,
    linear_shape,
)
from interlace.parallel.tp_comm import (
    all_reduce_grad_hook,
    copy_to_tp,
    gather_last_dim,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter_sequence,
    scatter_sequence,
    vocab_parallel_cross_entropy_per_token,
)

KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
"""Attention attributes holding the kv head count."""
WIDTH_ATTRS = ("split_size", "embed_dim", "hidden_size")
"""Attention attributes holding the query width (divided only when equal to it)."""
GROUP_ATTRS = ("num_key_value_groups",)
"""Attention attributes holding query heads per kv head."""

# ----------------------------------------------------------------------------- shard specs


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is split over the tensor parallel group.

    Along `dim`, the full tensor is `segments` equal parts (3 for fused q|k|v) and each part is
    cut into p/`replicas` contiguous pieces; rank r holds piece r // replicas of every part
    (replicas > 1: a grouped-query kv head shared by consecutive ranks).
    """

    dim: int
    segments: int = 1
    replicas: int = 1


_SPEC_ATTR = "_interlace_tp_shard"


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The ShardSpec of a tensor-parallel parameter, None for a replicated one."""
    return getattr(param, _SPEC_ATTR, None)


def copy_shard_spec(source: torch.Tensor, target: torch.Tensor) -> None:
    """Mark `target` as sharded like `source` (nothing if `source` is replicated)."""
    spec = shard_spec(source)
    if spec is not None:
        setattr(target, _SPEC_ATTR, spec)


def sharded_parameter_names(model: nn.Module) -> dict[str, ShardSpec]:
    """{parameter name: ShardSpec} of every sharded parameter of `model`, tied aliases included
    (both `wte.weight` and `lm_head.weight`: a state dict holds both)."""
    named = model.named_parameters(remove_duplicate=False)
    return {n: s for n, p in named if (s := shard_spec(p)) is not None}


def shard_of(full: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s piece (of `size` ranks) of the full tensor, as a new contiguous tensor."""
    parts = size // spec.replicas
    pieces = full.unflatten(spec.dim, (spec.segments, parts, -1))
    piece = pieces.select(spec.dim + 1, rank // spec.replicas)
    return piece.flatten(spec.dim, spec.dim + 1).clone(memory_format=torch.contiguous_format)


def assemble(pieces: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Inverse of `shard_of`: the full tensor from one piece per part (ranks 0, replicas, …)."""
    views = [p.unflatten(spec.dim, (spec.segments, -1)) for p in pieces]
    return torch.stack(views, spec.dim + 1).flatten(spec.dim, spec.dim + 2)


def gather_full(shard: torch.Tensor, spec: ShardSpec, group: Group) -> torch.Tensor:
    """All-gather a parameter's pieces over `group` and return the full (serial) tensor."""
    out = torch.empty((group.size * shard.numel(),), dtype=shard.dtype, device=shard.device)
    comm.all_gather(out, shard.detach().contiguous().view(-1), group)
    pieces = list(out.view(group.size, *shard.shape)[:: spec.replicas])
    return assemble(pieces, spec)


def shard_parameter(param: nn.Parameter, spec: ShardSpec, group: Group) -> nn.Parameter:
    """This rank's piece of `param` (see `shard_of`) as a new Parameter carrying `spec`; a
    piece shared by several ranks (replicas > 1) gets its gradient summed among them."""
    piece = shard_of(param.detach(), spec, group.rank, group.size)
    new = nn.Parameter(piece, requires_grad=param.requires_grad)
    setattr(new, _SPEC_ATTR, spec)
    if spec.replicas > 1 and new.requires_grad:
        new.register_hook(replica_sum_hook(spec, group))
    return new


def replica_sum_hook(spec: ShardSpec, group: Group) -> Callable[[torch.Tensor], torch.Tensor]:
    """Sum a replicated piece's gradient over the ranks holding it (one all-reduce of
    [parts, *piece] over the group, each rank writing its own slot)."""
    parts, slot = group.size // spec.replicas, group.rank // spec.replicas

    def hook(grad: torch.Tensor) -> torch.Tensor:
        slots = grad.new_zeros((parts, *grad.shape))
        slots[slot] = grad
        comm.all_reduce(slots, group)
        return slots[slot]

    return hook


# ----------------------------------------------------------------------------- modules


class RowParallelLinear(nn.Module):
    """y = Σ_r x_r·W_rᵀ + b: this rank's input features x_r [..., in/p] → full [..., out].

    `weight` is this rank's piece, [out, in/p] (`conv1d=False`, nn.Linear layout) or
    [in/p, out] (HF Conv1D layout, kept so parameter shapes read like the original's); `bias`
    [out] is replicated and added after the sum. With `sequence_parallel` the sum is
    reduce-scattered along the sequence: output [B, T/p, out].
    """

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
        partial = F.linear(x, self.weight.t() if self.conv1d else self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(partial, self.group)
        else:
            y = reduce_from_tp(partial, self.group)
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
        return reduce_from_tp(out.masked_fill(miss.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self) -> str:
        rows = f"rows [{self.vocab_start}, {self.vocab_end})"
        return f"{self.num_embeddings}, {self.embedding_dim}, {rows} on this rank"


class VocabParallelHead(nn.Module):
    """LM head x [..., d] → logits for this rank's vocabulary rows [..., V/p], or all of them
    [..., V] with `gather_output`. `weight` [V/p, d] may be the embedding's own Parameter."""

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
            x = copy_to_tp(x, self.group)
        logits = F.linear(x, self.weight, self.bias)
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


def check_divisible(structure: Structure, tp: int) -> None:
    """Raise PlanError naming the first size that `tp` ranks cannot split: model width, vocab,
    each attention's heads and kv heads (kv heads may also divide tp: then replicated), each
    feed-forward width."""
    if tp == 1:
        return
    checks: list[tuple[str, str, int]] = [("the model", "d_model", structure.d_model)]
    if structure.vocab is not None:
        checks.append((structure.vocab.embedding, "vocab_size", structure.vocab.vocab))
    checks += [(a.name, "n_heads", a.n_heads) for a in structure.attentions]
    checks += [(f.name, "ffn_dim", f.ffn_dim) for f in structure.feed_forwards]
    for where, what, value in checks:
        if value % tp:
            fits = [k for k in range(1, value + 1) if value % k == 0][:8]
            raise PlanError(
                f"{where}: {what}={value} is not divisible by the tensor parallel degree "
                f"tp={tp}; use tp in {fits}"
            )
    for a in structure.attentions:
        if a.n_kv_heads % tp and (tp % a.n_kv_heads or a.fused):
            raise PlanError(
                f"{a.name}: n_kv_heads={a.n_kv_heads} is not divisible by the tensor parallel "
                f"degree tp={tp}, nor tp by it; use tp in {_fitting_kv(a)}"
            )


def _fitting_kv(a: Attention) -> list[int]:
    return [
        k
        for k in range(1, a.n_heads + 1)
        if a.n_heads % k == 0 and (a.n_kv_heads % k == 0 or k % a.n_kv_heads == 0)
    ]


# ----------------------------------------------------------------------------- application


def apply_tensor_parallel(
    model: nn.Module,
    structure: Structure,
    group: Group,
    sequence_parallel: bool = False,
) -> list[str]:
    """Split `model` in place over `group` as `structure` (from `find_structure`) describes;
    return the report lines. Call `check_divisible` first (nothing is modified when it raises)."""
    if sequence_parallel:
        _check_sequence_parallel(structure)
    modules = dict(model.named_modules())
    mode = ", sequence parallel" if sequence_parallel else ""
    lines = [f"tensor parallel over {group.size} ranks{mode}"]
    for a in structure.attentions:
        lines.append(_shard_attention(modules[a.name], a, group, sequence_parallel))
        enter_block(modules[a.name], structure.d_model, group, sequence_parallel)
    for f in structure.feed_forwards:
        lines.append(_shard_feed_forward(modules[f.name], f, group, sequence_parallel))
        enter_block(modules[f.name], structure.d_model, group, sequence_parallel)
    from interlace.parallel.tensor_moe import shard_expert_block  # it builds on this module

    for b in structure.expert_blocks:
        lines.append(shard_expert_block(modules[b.name], b, group, sequence_parallel))
    lines.append(_shard_vocab(model, structure, group, sequence_parallel))
    if sequence_parallel:
        lines.append(_shard_sequence(model, structure, group))
    return lines + structure.notes


def _check_sequence_parallel(structure: Structure) -> None:
    missing = [
        (structure.layers is None, "a layer list (nn.ModuleList) holding the attention blocks"),
        (structure.final_norm is None, "a final norm after the layer list"),
        (structure.vocab is None or structure.vocab.head is None, "a vocab-parallel LM head"),
    ]
    for absent, what in missing:
        if absent:
            raise PlanError(f"sequence_parallel=True needs {what}; none was found")
    split = {b.name for b in structure.expert_blocks}
    if whole := [name for name in structure.experts if name not in split]:
        raise PlanError(
            f"sequence_parallel=True cannot shard the replicated Mixture-of-Experts layers "
            f"{whole} (routing capacity and load balance need every token); "
            "use sequence_parallel=False"
        )


def shard_column(layer: nn.Module, segments: int, replicas: int, group: Group) -> None:
    """Shard `layer` in place along its output features (see ShardSpec)."""
    _, n_out, layout = linear_shape(layer)  # type: ignore[misc]
    dim = 0 if layout == "linear" else 1
    layer.weight = shard_parameter(layer.weight, ShardSpec(dim, segments, replicas), group)
    if layer.bias is not None:
        layer.bias = shard_parameter(layer.bias, ShardSpec(0, segments, replicas), group)
    local = n_out * replicas // group.size
    if layout == "linear":
        layer.out_features = local
    else:
        layer.nf = local


def _row_parallel(layer: nn.Module, group: Group, sequence_parallel: bool) -> RowParallelLinear:
    _, _, layout = linear_shape(layer)  # type: ignore[misc]
    conv1d = layout == "conv1d"
    weight = shard_parameter(layer.weight, ShardSpec(0 if conv1d else 1), group)
    return RowParallelLinear(weight, layer.bias, group, conv1d, sequence_parallel)


def _shard_attention(module: nn.Module, a: Attention, group: Group, sp: bool) -> str:
    p = group.size
    kv_replicas = 1 if a.n_kv_heads % p == 0 else p // a.n_kv_heads
    if a.fused:
        shard_column(getattr(module, a.producers[0]), 3, 1, group)
    else:
        q, k, v = a.producers
        shard_column(getattr(module, q), 1, 1, group)
        shard_column(getattr(module, k), 1, kv_replicas, group)
        shard_column(getattr(module, v), 1, kv_replicas, group)
    setattr(module, a.out, _row_parallel(getattr(module, a.out), group, sp))
    heads, kv_heads = a.n_heads // p, a.n_kv_heads * kv_replicas // p
    set_local_heads(module, a, heads, kv_heads)
    held = heads_held(a, heads, kv_heads, kv_replicas, "ranks")
    return (
        f"{a.name}: {', '.join(a.producers)} column-parallel ({held} per rank); "
        f"{a.out} row-parallel"
    )


def heads_held(a: Attention, heads: int, kv_heads: int, replicas: int, ranks: str) -> str:
    """Report words for the heads one rank holds: "2 of 4 heads, 1 of 2 kv heads (each on 2
    ranks)"; `ranks` names the ranks sharing a kv head."""
    kv = ""
    if a.n_kv_heads != a.n_heads:
        kv = f", {kv_heads} of {a.n_kv_heads} kv heads"
        kv += f" (each on {replicas} {ranks})" if replicas > 1 else ""
    return f"{heads} of {a.n_heads} heads{kv}"


def set_local_heads(module: nn.Module, a: Attention, heads: int, kv_heads: int) -> None:
    """Set the head-count and width attributes of attention `module` that hold `a`'s full
    values to this rank's `heads` query and `kv_heads` kv heads (by attribute convention)."""
    _update_attrs(module, HEAD_COUNT_ATTRS, a.n_heads, heads)
    _update_attrs(module, KV_HEAD_ATTRS, a.n_kv_heads, kv_heads)
    _update_attrs(module, WIDTH_ATTRS, a.n_heads * a.head_dim, heads * a.head_dim)
    _update_attrs(module, GROUP_ATTRS, a.n_heads // a.n_kv_heads, heads // kv_heads)


def _update_attrs(module: nn.Module, names: Iterable[str], full: int, local: int) -> None:
    for name in names:
        if getattr(module, name, None) == full and not isinstance(getattr(module, name), bool):
            setattr(module, name, local)


def _shard_feed_forward(module: nn.Module, f: FeedForward, group: Group, sp: bool) -> str:
    for name in f.producers:
        shard_column(getattr(module, name), 1, 1, group)
    setattr(module, f.down, _row_parallel(getattr(module, f.down), group, sp))
    return (
        f"{f.name}: {', '.join(f.producers)} column-parallel ({f.ffn_dim // group.size} of "
        f"{f.ffn_dim} features per rank); {f.down} row-parallel"
    )


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _shard_vocab(model: nn.Module, structure: Structure, group: Group, sp: bool) -> str:
    vocab = structure.vocab
    assert vocab is not None
    embedding = model.get_submodule(vocab.embedding)
    if embedding.max_norm is not None or embedding.sparse or embedding.scale_grad_by_freq:
        raise PlanError(
            f"{vocab.embedding}: vocab-parallel embedding does not support max_norm, sparse "
            "or scale_grad_by_freq; build the embedding without them"
        )
    weight = shard_parameter(embedding.weight, ShardSpec(0), group)
    new_embedding = VocabParallelEmbedding(weight, vocab.vocab, group, embedding.padding_idx)
    _set_module(model, vocab.embedding, new_embedding)
    if vocab.head is None:
        return f"{vocab.embedding}: vocab-parallel embedding; no LM head found"
    head = model.get_submodule(vocab.head)
    head_weight = weight if vocab.tied else shard_parameter(head.weight, ShardSpec(0), group)
    head_bias = head.bias
    if head_bias is not None:
        head_bias = shard_parameter(head_bias, ShardSpec(0), group)
    local_logits = _has_builtin_loss(model)
    _set_module(
        model,
        vocab.head,
        VocabParallelHead(head_weight, head_bias, group, not local_logits, sp),
    )
    if local_logits:
        _install_vocab_parallel_loss(model, group)
        output = "local logits [..., V/p], loss by vocab_parallel_cross_entropy"
    else:
        output = "logits all-gathered to [..., V]"
    tied = " (tied)" if vocab.tied else ""
    return f"{vocab.embedding}, {vocab.head}{tied}: vocab-parallel; {output}"


def _has_builtin_loss(model: nn.Module) -> bool:
    from interlace.models.gpt import GPT

    return isinstance(model, GPT)


def _install_vocab_parallel_loss(model: nn.Module, group: Group) -> None:
    """Make the built-in GPT's `forward(idx, targets)` compute its loss from sharded logits:
    the targets are withheld from the forward (which then returns (logits, None)) and the loss
    is cross-entropy + aux_loss_coef · aux_loss, as in `GPT.forward`."""
    pending: list[torch.Tensor | None] = []

    def take_targets(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        targets = kwargs.pop("targets", None)
        if len(args) > 1:
            args, targets = args[:1], args[1]
        pending.append(targets)
        return args, kwargs

    def add_loss(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        targets = pending.pop()
        logits, _ = output
        if targets is None:
            return output
        loss = vocab_parallel_cross_entropy(logits, targets, group)
        return logits, loss + module.config.aux_loss_coef * module.aux_loss

    model.register_forward_pre_hook(take_targets, with_kwargs=True)
    model.register_forward_hook(add_loss, with_kwargs=True)


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
    enter = gather_sequence if sp else copy_to_tp

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return replace_hidden(args, kwargs, d, lambda x: enter(x, group))

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _shard_sequence(model: nn.Module, structure: Structure, group: Group) -> str:
    layers = model.get_submodule(structure.layers)  # type: ignore[arg-type]
    first = layers[0]
    d = structure.d_model

    def scatter(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return replace_hidden(args, kwargs, d, lambda x: scatter_sequence(x, group))

    first.register_forward_pre_hook(scatter, with_kwargs=True)
    norm = model.get_submodule(structure.final_norm)  # type: ignore[arg-type]
    norm.register_forward_hook(lambda mod, args, out: gather_sequence(out, group))
    synced = []
    for prefix, module in ((structure.layers, layers), (structure.final_norm, norm)):
        for name, param in module.named_parameters():
            if shard_spec(param) is None and param.requires_grad:
                param.register_hook(all_reduce_grad_hook(group))
                synced.append(f"{prefix}.{name}")
    return (
        f"sequence parallel: activations from {structure.layers}.0 to {structure.final_norm} "
        f"are sequence shards; gradients of {len(synced)} replicated parameters there are "
        "all-reduced"
    )
