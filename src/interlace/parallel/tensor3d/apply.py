"""`apply_tensor3d`: split a dense decoder found by structure over the 3D grid, in place;
`check_tensor3d` refuses a model or grid that cannot be split, before any change."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from interlace.comm import Group
from interlace.errors import PlanError
from interlace.parallel.detect import Attention, Structure
from interlace.parallel.grad_sums import sum_gradient_over
from interlace.parallel.heads import heads_held, set_local_heads
from interlace.parallel.tensor.comm import gather_sequence_whole, scatter_sequence
from interlace.parallel.tensor.layers import enter_block, replace_hidden
from interlace.parallel.tensor.vocab import split_vocab
from interlace.parallel.tensor3d.comm import (
    gather_last,
    split_last_dim,
)
from interlace.parallel.tensor3d.layers import LayerNorm3D, Linear3D, RMSNorm3D, rms_norm_eps
from interlace.parallel.tensor3d.options import check_grid
from interlace.parallel.tensor3d.prefetch import attach_prefetcher
from interlace.parallel.tensor3d.shard import VOCAB_ROWS, Grid, shard3d_parameter, shard3d_spec


def check_tensor3d(
    model: nn.Module,
    structure: Structure,
    tp3d: tuple[int, int, int],
    expert_parallel: bool = False,
) -> None:
    """Raise PlanError, before anything is modified, if `model` cannot be split on the grid
    (x, y, z): experts without `expert_parallel` (which keeps them whole, `keep_whole`), a
    missing layer list or final norm, norms it cannot split, and every width or head count
    that the grid must divide."""
    x, y, z = tp3d
    where = f"tp3d={x}x{y}x{z}"
    if structure.experts and not expert_parallel:
        raise PlanError(
            f"{where} does not split Mixture-of-Experts layers {structure.experts}; use ep > 1 "
            "(experts whole on their owners), a dense model, or tp=N"
        )
    for absent, what in (
        (structure.layers is None, "a layer list (nn.ModuleList) holding the attention blocks"),
        (structure.final_norm is None, "a final norm after the layer list"),
    ):
        if absent:
            raise PlanError(
                f"{where} needs {what} to split the residual stream over x; none was found in "
                f"{type(model).__name__}; use tp=N for this model"
            )
    check_grid(
        tp3d,
        structure.d_model,
        [(a.name, a.n_heads, a.head_dim, a.n_kv_heads) for a in structure.attentions],
        [(f.name, f.ffn_dim) for f in structure.feed_forwards],
        None if structure.vocab is None else (structure.vocab.embedding, structure.vocab.vocab),
    )
    _block_norms(model, structure)


def apply_tensor3d(
    model: nn.Module,
    structure: Structure,
    grid: Grid,
    vocab_group: Group,
    prefetch: bool = True,
    sharded: bool = False,
    gather_logits: bool = False,
    sequence_parallel: bool = False,
) -> list[str]:
    """Split `model` (call `check_tensor3d` first) in place over `grid`; return the report
    lines. Attention and feed-forward linears become `Linear3D`s, the block norms and the
    residual stream are split over x, the tokens over z; the embedding and LM head by
    vocabulary rows over `vocab_group`, the grid's x·y ranks (`tp_xy`, rank y_i·x + x_i,
    pieces `VOCAB_ROWS`), replicated over z: the head gives logits [..., V/(x·y)] for
    `vocab_parallel_cross_entropy` over it ([..., V] with `gather_logits`). `prefetch`
    (z > 1): all-gather each 3D weight over Z one layer ahead (`tensor3d_prefetch`);
    `sharded`: FSDP2 will shard the pieces (`Linear3D.z_grad_in_backward`);
    `sequence_parallel`: the residual stream between the blocks is also split along the
    sequence over y, [B/z, T/y, d/x] (`_split_sequence`)."""
    x, y, z = grid.x.size, grid.y.size, grid.z.size
    lines = [f"3D tensor parallel over x={x}, y={y}, z={z} ranks"]
    for a in structure.attentions:
        lines.append(_split_attention(model.get_submodule(a.name), a, grid))
    for f in structure.feed_forwards:
        block = model.get_submodule(f.name)
        for name in f.producers:
            setattr(block, name, Linear3D(getattr(block, name), grid, transposed=False))
        setattr(block, f.down, Linear3D(getattr(block, f.down), grid, transposed=True))
        lines.append(f"{f.name}: {', '.join(f.producers)} normal; {f.down} transposed")
    norms = _block_norms(model, structure)
    for name, eps in norms:
        norm = model.get_submodule(name)
        new = LayerNorm3D(norm, grid) if eps is None else RMSNorm3D(norm, eps, grid)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
    lines.append(f"{structure.layers}: {len(norms)} norms split over x (statistics all-reduced)")
    _split_residual(model, structure, grid.x, grid.y if sequence_parallel else None)
    if sequence_parallel:
        lines.append(_split_sequence(model, structure, grid))
    split_vocab_rows = structure.vocab is not None and vocab_group.size > 1
    lines.append(
        f"{structure.layers}: residual stream split over x (hidden d/{x}), tokens over z; "
        f"{structure.final_norm}{'' if split_vocab_rows else ', embedding and LM head'} "
        "replicated"
    )
    if split_vocab_rows:
        if vocab_group.rank != grid.y.rank * x + grid.x.rank:
            raise RuntimeError(f"{vocab_group.name} ranks are not in the grid's y·x order")
        piece = functools.partial(shard3d_parameter, spec=VOCAB_ROWS, grid=grid)
        lines.append(split_vocab(model, structure.vocab, vocab_group, piece, False, gather_logits))
    if z > 1:
        synced = _sum_unsplit_over(model, "z", grid.z)
        lines.append(
            f"batch rows split over z (the loop feeds this rank's rows, `z_rows`); gradients "
            f"of {synced} parameters all-reduced over z"
        )
        linears = [m for m in model.modules() if isinstance(m, Linear3D)]
        for linear in linears:
            linear.z_grad_in_backward = sharded
        if prefetch:
            attach_prefetcher(model, linears, grid.z)
            lines.append(f"{len(linears)} weights all-gathered over z one layer ahead (prefetch)")
    return lines


def _split_attention(block: nn.Module, a: Attention, grid: Grid) -> str:
    """Make `block`'s q, k, v (or fused q|k|v) normal and its out projection transposed 3D
    layers; its head-count attributes become this Y rank's."""
    y = grid.y.size
    replicas = 1 if a.n_kv_heads % y == 0 else y // a.n_kv_heads
    q, *kv_layers = a.producers  # fused: q is q|k|v, split per part
    segments = 3 if a.fused else 1
    setattr(block, q, Linear3D(getattr(block, q), grid, transposed=False, segments=segments))
    for name in kv_layers:
        layer = Linear3D(getattr(block, name), grid, transposed=False, replicas=replicas)
        setattr(block, name, layer)
    setattr(block, a.out, Linear3D(getattr(block, a.out), grid, transposed=True))
    heads, kv_heads = a.n_heads // y, a.n_kv_heads * replicas // y
    set_local_heads(block, a, heads, kv_heads)
    held = heads_held(a, heads, kv_heads, replicas, "y ranks")
    return f"{a.name}: {', '.join(a.producers)} normal ({held} per y rank); {a.out} transposed"


def _block_norms(model: nn.Module, structure: Structure) -> list[tuple[str, float | None]]:
    """(name, eps) of every norm in the layer list outside the attention and feed-forward
    blocks: eps None for an nn.LayerNorm, the RMS norm's eps otherwise. PlanError for any other
    parameterised module there."""
    split = [a.name for a in structure.attentions] + [f.name for f in structure.feed_forwards]
    split += structure.experts  # whole under expert parallelism
    layers = model.get_submodule(structure.layers)  # type: ignore[arg-type]
    norms: list[tuple[str, float | None]] = []
    for name, module in layers.named_modules():
        full = f"{structure.layers}.{name}"
        if any(full == s or full.startswith(s + ".") for s in split):
            continue
        if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1:
            norms.append((full, None))
        elif (eps := rms_norm_eps(module, structure.d_model)) is not None:
            norms.append((full, eps))
        elif list(module.parameters(recurse=False)):
            raise PlanError(
                f"{full}: {type(module).__name__} holds parameters outside attention and "
                "feed-forward blocks and is neither a LayerNorm nor an RMS norm, so tp3d cannot "
                "split it; use tp=N for this model"
            )
    return norms


def _split_residual(
    model: nn.Module, structure: Structure, x: Group, sequence: Group | None
) -> None:
    """The first layer takes its X slice [..., d/x] of the hidden states [B, T, d] (and its
    `sequence` shard [B, T/y, d/x] under sequence parallelism); the final norm all-gathers them
    back to [B, T, d]. The gathers' backward keeps this rank's part: the final norm and the
    vocabulary-parallel head hand every rank the whole gradient."""
    d = structure.d_model
    first = model.get_submodule(structure.layers)[0]  # type: ignore[arg-type, index]
    norm = model.get_submodule(structure.final_norm)  # type: ignore[arg-type]

    def cut(h: torch.Tensor) -> torch.Tensor:
        h = split_last_dim(h, x)
        return h if sequence is None else scatter_sequence(h, sequence)

    def whole(h: torch.Tensor) -> torch.Tensor:
        h = gather_last(h, x)
        return h if sequence is None else gather_sequence_whole(h, sequence)

    def split(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return replace_hidden(args, kwargs, d, cut)

    def gather(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return replace_hidden(args, kwargs, d // x.size, whole)

    first.register_forward_pre_hook(split, with_kwargs=True)
    norm.register_forward_pre_hook(gather, with_kwargs=True)


def _sum_unsplit_over(module: nn.Module, axis: str, group: Group) -> int:
    """Sum over `group` (a hook) the gradient of each trainable parameter of `module` that the
    grid's `axis` does not split (each of its ranks saw other tokens); returns their count."""
    synced = 0
    for param in module.parameters():
        spec = shard3d_spec(param)
        if param.requires_grad and (spec is None or axis not in spec.axes):
            sum_gradient_over(param, group)
            synced += 1
    return synced


def _split_sequence(model: nn.Module, structure: Structure, grid: Grid) -> str:
    """Sequence parallelism over y: each attention and feed-forward block all-gathers its
    input's sequence over y on entry (backward: reduce-scatter, the sum over y its normal
    layers leave out) and its transposed layer reduce-scatters the output (`Linear3D.sequence`);
    the parameters of the layers replicated over y (norms, transposed biases) see only this
    rank's tokens, so their gradients are all-reduced over y."""
    width = structure.d_model // grid.x.size
    for name in [a.name for a in structure.attentions] + [f.name for f in structure.feed_forwards]:
        block = model.get_submodule(name)
        enter_block(block, width, grid.y, True)
        for linear in block.modules():
            if isinstance(linear, Linear3D):
                linear.sequence = grid.y
    layers = model.get_submodule(structure.layers)  # type: ignore[arg-type]
    synced = _sum_unsplit_over(layers, "y", grid.y)
    return (
        f"sequence parallel over y={grid.y.size}: residual stream [B/z, T/{grid.y.size}, "
        f"d/{grid.x.size}] between blocks; gradients of {synced} parameters all-reduced over y"
    )


def keep_whole(module: nn.Module, d: int, x: Group) -> None:
    """Let `module` (a layer the grid leaves whole: an expert-parallel MoE layer, or a block
    with fused experts) take the full hidden states: its input [..., d/x] all-gathered over x
    (backward: this rank's slice), its output [..., d] (a tuple's first item: HF blocks also
    return their router logits) cut to this rank's slice [..., d/x] (backward: all-gathered
    over x)."""

    def gather(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return replace_hidden(args, kwargs, d // x.size, lambda h: gather_last(h, x))

    def split(mod: nn.Module, args: tuple, out: Any) -> Any:
        if isinstance(out, tuple):
            return (split_last_dim(out[0], x), *out[1:])
        return split_last_dim(out, x)

    module.register_forward_pre_hook(gather, with_kwargs=True)
    module.register_forward_hook(split)


def z_rows(x: torch.Tensor, z: Group) -> torch.Tensor:
    """This rank's rows of a batch-major x [B, ...]: [z.rank·B/z, (z.rank+1)·B/z), [B/z, ...]."""
    batch = x.shape[0]
    if batch % z.size:
        raise PlanError(
            f"batch of {batch} rows is not divisible by tp3d's z={z.size}; use a batch that is "
            f"a multiple of {z.size}"
        )
    n = batch // z.size
    return x.narrow(0, z.rank * n, n)
