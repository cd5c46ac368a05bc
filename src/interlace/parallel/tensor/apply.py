"""`apply_tensor_parallel`: split a model found by structure over the 1D tensor parallel group, in
place — attention and feed-forward blocks column → row, fused-expert MoE blocks along each
expert's width, vocab-parallel embedding and head, and optionally sequence parallel activations
between blocks. `check_divisible` refuses a degree the model's sizes cannot take, before any
change."""

from __future__ import annotations

import functools

from torch import nn

from interlace.comm import Group
from interlace.divisors import check_divides
from interlace.errors import PlanError
from interlace.parallel.detect import Attention, ExpertBlock, FeedForward, Structure, linear_shape
from interlace.parallel.grad_sums import sum_gradient_over
from interlace.parallel.heads import heads_held, set_local_heads
from interlace.parallel.tensor.comm import gather_sequence, scatter_sequence
from interlace.parallel.tensor.layers import RowParallelLinear, enter_block, replace_hidden
from interlace.parallel.tensor.moe import shard_expert_block
from interlace.parallel.tensor.options import kv_degrees, kv_heads_split
from interlace.parallel.tensor.shard import ShardSpec, shard_column, shard_parameter, shard_spec
from interlace.parallel.tensor.vocab import split_vocab


def check_divisible(structure: Structure, tp: int) -> None:
    """Raise PlanError naming the first size that `tp` ranks cannot split: model width, vocab,
    each attention's heads and kv heads (kv heads may also divide tp: then replicated), each
    feed-forward width."""
    if tp == 1:
        return
    sizes = [("the model's d_model", structure.d_model)]
    if structure.vocab is not None:
        sizes.append((f"{structure.vocab.embedding}: vocab_size", structure.vocab.vocab))
    sizes += [(f"{a.name}: n_heads", a.n_heads) for a in structure.attentions]
    sizes += [(f"{f.name}: ffn_dim", f.ffn_dim) for f in structure.feed_forwards]
    check_divides(tp, "tensor parallel degree", sizes)
    for a in structure.attentions:  # a fused q|k|v cannot hold a kv head on several ranks
        if a.n_kv_heads % tp and (not kv_heads_split(a.n_kv_heads, tp) or a.fused):
            raise PlanError(
                f"{a.name}: n_kv_heads={a.n_kv_heads} is not divisible by the tensor parallel "
                f"degree tp={tp}, nor tp by it; use tp in {kv_degrees(a.n_heads, a.n_kv_heads)}"
            )


def apply_tensor_parallel(
    model: nn.Module,
    structure: Structure,
    group: Group,
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    expert_parallel: bool = False,
) -> list[str]:
    """Split `model` in place over `group` as `structure` (from `find_structure`) describes;
    return the report lines. Call `check_divisible` first (nothing is modified when it raises).

    The LM head gives this rank's vocabulary slice of the logits [..., V/p], to be scored by
    `vocab_parallel_cross_entropy`; `gather_logits` all-gathers them to [..., V] instead (one
    all-gather of B·T·V/p elements per rank), for code that needs the full distribution (a
    Hugging Face model's own `labels` loss, `generate`). `expert_parallel`: expert parallelism
    splits the other MoE layers next (`expert.tp_tokens`), so they may take sequence shards,
    and leaves fused-expert blocks' experts whole."""
    if sequence_parallel:
        _check_sequence_parallel(structure, expert_parallel)
    modules = dict(model.named_modules())
    mode = ", sequence parallel" if sequence_parallel else ""
    lines = [f"tensor parallel over {group.size} ranks{mode}"]
    for a in structure.attentions:
        lines.append(_shard_attention(modules[a.name], a, group, sequence_parallel))
        enter_block(modules[a.name], structure.d_model, group, sequence_parallel)
    for f in structure.feed_forwards:
        lines.append(_shard_feed_forward(modules[f.name], f, group, sequence_parallel))
        enter_block(modules[f.name], structure.d_model, group, sequence_parallel)
    for b in structure.expert_blocks:
        if expert_parallel:  # experts whole: expert parallelism splits them next
            line = _keep_experts_whole(modules, b, structure.d_model, group, sequence_parallel)
            lines.append(line)
        else:
            lines.append(shard_expert_block(modules[b.name], b, group, sequence_parallel))
    if structure.vocab is not None:
        split = functools.partial(shard_parameter, spec=ShardSpec(0), group=group)
        lines.append(
            split_vocab(model, structure.vocab, group, split, sequence_parallel, gather_logits)
        )
    if sequence_parallel:
        lines.append(_shard_sequence(model, structure, group))
    return lines + structure.notes


def _check_sequence_parallel(structure: Structure, expert_parallel: bool) -> None:
    missing = [
        (structure.layers is None, "a layer list (nn.ModuleList) holding the attention blocks"),
        (structure.final_norm is None, "a final norm after the layer list"),
        (structure.vocab is None or structure.vocab.head is None, "a vocab-parallel LM head"),
    ]
    for absent, what in missing:
        if absent:
            raise PlanError(f"sequence_parallel=True needs {what}; none was found")
    split = {b.name for b in structure.expert_blocks}
    whole = [name for name in structure.experts if name not in split]
    if whole and not expert_parallel:
        raise PlanError(
            f"sequence_parallel=True cannot shard the replicated Mixture-of-Experts layers "
            f"{whole} (routing capacity and load balance need every token); "
            "use sequence_parallel=False, or ep > 1"
        )


def _keep_experts_whole(
    modules: dict[str, nn.Module], block: ExpertBlock, d: int, group: Group, sp: bool
) -> str:
    """Under ep × tp, leave `block`'s fused experts whole for expert parallelism. Without
    sequence parallelism (`sp`) its tp ranks then share the block's tokens
    (`expert.tp_tokens`); its router and shared gate stay replicated, computing on the full
    input alike on every rank (no gradient sum); a shared expert is split as a dense
    feed-forward, with its own entry and row-parallel exit. With it the block runs whole on
    each rank's sequence shard: router, shared expert and gate replicated, their gradients
    summed over tp by the sequence pass (`_shard_sequence`), the experts dispatching each
    rank's own tokens."""
    line = f"{block.name}: experts kept whole for expert parallelism; router replicated"
    if sp:
        return f"{line}; the block runs whole on each rank's sequence shard"
    if block.shared is None:
        return line
    shared = modules[block.shared.name]
    split = _shard_feed_forward(shared, block.shared, group, False)
    enter_block(shared, d, group, False)
    return f"{line}; shared expert {split}"


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


def _shard_feed_forward(module: nn.Module, f: FeedForward, group: Group, sp: bool) -> str:
    for name in f.producers:
        shard_column(getattr(module, name), 1, 1, group)
    setattr(module, f.down, _row_parallel(getattr(module, f.down), group, sp))
    return (
        f"{f.name}: {', '.join(f.producers)} column-parallel ({f.ffn_dim // group.size} of "
        f"{f.ffn_dim} features per rank); {f.down} row-parallel"
    )


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
                sum_gradient_over(param, group)
                synced.append(f"{prefix}.{name}")
    return (
        f"sequence parallel: activations from {structure.layers}.0 to {structure.final_norm} "
        f"are sequence shards; gradients of {len(synced)} replicated parameters there are "
        "all-reduced"
    )
