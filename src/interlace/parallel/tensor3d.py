"""3D tensor parallelism (AxoNN-style): every linear layer of a block split over an x·y·z grid.

Ranks form a grid of groups "tp_x", "tp_y", "tp_z" (x fastest). The layout, per rank (X, Y, Z
its indices):

- **Tokens** are split over Z: every batch-major input of the model's forward (≥ 2-D, as many
  rows as the first tensor: ids, targets or HF `labels`, attention mask) becomes rows
  [Z·B/z, (Z+1)·B/z) on entry; the loss (the built-in GPT's (logits, loss), or a Hugging Face
  ModelOutput's `loss` from its own `labels` loss) is the mean over Z of the slices' mean
  losses: the serial mean when every slice counts as many tokens (no uneven padding).
- **Residual stream** between blocks: [B/z, T, d/x], hidden features [X·d/x, (X+1)·d/x),
  replicated over Y. The first block splits the embedding output over X (backward all-gather);
  the final norm's input is all-gathered over X (backward slice) for the final norm and head.
  Both hooks are placed by structure (`detect`: the layer list and the final norm).
- **Normal layer** (q, k, v; up and gate), W [out, in]: `in` split over X, `out` over Y, the
  [out/y, in/x] block cut over Z by rows → `Linear3D` weight [out/(y·z), in/x]. Its output
  [.., out/y] (this rank's heads or ffn features) is replicated over X. HF's `Conv1D` (stored
  [in, out]) is held transposed, in this [out, in] layout. A fused q|k|v (GPT-2's `c_attn`) is
  split per part: the Y block is [q_Y; k_Y; v_Y]. With grouped-query attention, k and v split
  their kv heads over Y; with fewer kv heads than y, each is held by y/h_kv consecutive Y ranks
  and its block gradient summed over them before the Z reduce-scatter. Rotary embeddings act
  per head, so local heads need nothing; head-count attributes follow (as in 1D).
- **Transposed layer** (out projection; down): X and Y swapped: `in` over Y, `out` over X,
  weight [out/(x·z), in/y]; its output [.., d/x] is the residual layout again: no re-layout.
- **Collectives** per linear layer (`tensor3d_comm.linear3d`): forward all-gather of W over Z and
  all-reduce of O over its `in` group; backward all-gather over Z, async all-reduce of dX over its
  `out` group (hidden behind the dW matmul) and async reduce-scatter of dW over Z. With tokens per
  rank T and b bytes per element, a normal layer H → K·H puts on the wire
  X: 2(x−1)/x·T·(K·H/y)·b, Y: 2(y−1)/y·T·(H/x)·b, Z: 3(z−1)/z·(K·H²/(x·y))·b
  (`layer_wire_bytes`); a transposed one swaps X and Y. With z > 1 each Z all-gather is issued
  one layer ahead, asynchronously, while the layer before computes (`tensor3d_prefetch`; on
  unless `apply_tensor3d(..., prefetch=False)`, the plan's `tp3d_prefetch`): same bytes.
- **LayerNorms** inside blocks (`LayerNorm3D`) hold their [d/x] slice and all-reduce the row
  statistics Σx, Σx² [.., 2] over X (forward and backward): 2·2(x−1)/x·T·2·b per norm per step
  beyond the formula. RMS norms (`RMSNorm3D`: recognised by a [d] weight, an `eps` attribute
  and their output on a probe) all-reduce Σx² [.., 1] the same way. The final norm, embeddings
  and LM head stay replicated (full [.., d] after the gather); their cost is the gather above
  and V·d replicated weights per rank.
- **Biases** of a normal layer [out/y] are replicated over X and Z, of a transposed one [out/x]
  over Y and Z. Every parameter except the 3D weights sees only its Z slice of the tokens: its
  gradient is all-reduced over Z by a hook. Data parallelism then all-reduces every gradient
  over "dp" (the 3D weights were already reduce-scattered over Z).

`Shard3D` records which grid axes split a parameter, for checkpoint keys, the gradient norm and
tests. Dense decoders found by structure are supported (the built-in GPT, HF GPT-2 and Llama);
Mixture-of-Experts layers, and parameterised modules in the layers that are neither blocks nor
norms, are refused with a PlanError.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from interlace.comm import Group
from interlace.errors import PlanError
from interlace.mesh import Mesh
from interlace.parallel.detect import Attention, Structure, linear_shape
from interlace.parallel.grad_norm import clip_to_norm_, split_grad_norm
from interlace.parallel.tensor import (
    ShardSpec,
    heads_held,
    replace_hidden,
    replica_sum_hook,
    set_local_heads,
    shard_of,
)
from interlace.parallel.tensor3d_comm import (
    gather_last,
    linear3d,
    mean_over,
    split_last_dim,
    sum_over,
)
from interlace.parallel.tensor3d_prefetch import WeightPrefetcher, attach_prefetcher
from interlace.parallel.tp_comm import all_reduce_grad_hook

AXES = ("x", "y", "z")
EPS_ATTRS = ("eps", "variance_epsilon")
"""Norm attributes holding epsilon (by convention, not by model)."""


@dataclass(frozen=True)
class Grid:
    """The three groups of a 3D tensor parallel grid."""

    x: Group
    y: Group
    z: Group

    @classmethod
    def from_mesh(cls, mesh: Mesh) -> Grid:
        """The grid of the mesh's "tp_x", "tp_y", "tp_z" dimensions."""
        return cls(mesh.group("tp_x"), mesh.group("tp_y"), mesh.group("tp_z"))

    def axis(self, name: str) -> Group:
        """The group of axis "x", "y" or "z"."""
        return getattr(self, name)


@dataclass(frozen=True)
class Shard3D:
    """How a parameter is cut over the grid: dim 0 over `rows`, dim 1 over `cols`, then dim 0
    again over `flat` (contiguous pieces of the row-major block). None: not cut that way.

    The rows cut is `ShardSpec(0, segments, replicas)`'s over the `rows` group: `segments` equal
    parts (3 for a fused q|k|v) each cut, `replicas` consecutive ranks holding the same piece
    (kv heads fewer than the group). `conv1d`: the serial tensor is stored [in, out] (HF's
    Conv1D) and the piece is cut from its transpose."""

    rows: str | None = None
    cols: str | None = None
    flat: str | None = None
    segments: int = 1
    replicas: int = 1
    conv1d: bool = False

    @property
    def axes(self) -> tuple[str, ...]:
        """The grid axes whose ranks hold different pieces."""
        return tuple(a for a in (self.rows, self.cols, self.flat) if a is not None)


_SPEC_ATTR = "_interlace_tp3d_shard"


def shard3d_spec(param: torch.Tensor) -> Shard3D | None:
    """The Shard3D of a parameter split by 3D tensor parallelism, None for a replicated one."""
    return getattr(param, _SPEC_ATTR, None)


def shard3d_of(full: torch.Tensor, spec: Shard3D, grid: Grid) -> torch.Tensor:
    """This rank's piece of the full (serial) tensor under `spec`, as a new tensor."""
    piece = full.t() if spec.conv1d else full
    if spec.rows is not None:
        rows = grid.axis(spec.rows)
        piece = shard_of(piece, ShardSpec(0, spec.segments, spec.replicas), rows.rank, rows.size)
    for dim, axis in ((1, spec.cols), (0, spec.flat)):
        if axis is not None:
            group = grid.axis(axis)
            piece = piece.chunk(group.size, dim)[group.rank]
    return piece.clone(memory_format=torch.contiguous_format)


def _shard(param: nn.Parameter, spec: Shard3D, grid: Grid) -> nn.Parameter:
    new = nn.Parameter(shard3d_of(param.detach(), spec, grid), requires_grad=param.requires_grad)
    setattr(new, _SPEC_ATTR, spec)
    return new


def shard3d_keys(model: nn.Module, grid: Grid) -> dict[str, str]:
    """{parameter name: checkpoint key unique to this rank's piece}, e.g. `blocks.0.mlp.up.weight`
    → `blocks.0.mlp.up.weight.tp3d.y1.z0.x1`; ranks holding the same piece share its key."""
    keys = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if (spec := shard3d_spec(param)) is not None:
            coords = ".".join(f"{a}{_piece_index(spec, a, grid)}" for a in spec.axes)
            keys[name] = f"{name}.tp3d.{coords}"
    return keys


def _piece_index(spec: Shard3D, axis: str, grid: Grid) -> int:
    """Which piece along `axis` this rank holds (replicated kv rows: one index per replica set)."""
    rank = grid.axis(axis).rank
    return rank // spec.replicas if axis == spec.rows else rank


# ----------------------------------------------------------------------------- modules


class Linear3D(nn.Module):
    """A 3D-parallel linear layer: x [..., in/|in_group|] → [..., out/|out_group|] (+ bias).

    `weight` [out/(|out_group|·z), in/|in_group|] is this rank's Z piece of its block; `bias`
    [out/|out_group|] (replicated over the in group and Z) is added after the sum. `layer` is an
    nn.Linear or HF Conv1D; `segments` and `replicas` cut the output features as in `Shard3D`
    (fused q|k|v; kv heads held by `replicas` ranks, their gradients summed over them).
    `prefetcher` (set by `apply_tensor3d` when z > 1) serves its Z all-gathers one layer ahead.
    """

    def __init__(
        self,
        layer: nn.Module,
        grid: Grid,
        transposed: bool,
        segments: int = 1,
        replicas: int = 1,
    ):
        super().__init__()
        in_axis, out_axis = ("y", "x") if transposed else ("x", "y")
        self.in_group, self.out_group, self.z = grid.axis(in_axis), grid.axis(out_axis), grid.z
        self.in_features, self.out_features, layout = linear_shape(layer)  # type: ignore[misc]
        self.transposed = transposed
        rows = Shard3D(rows=out_axis, segments=segments, replicas=replicas)
        block = dataclasses.replace(rows, cols=in_axis, flat="z", conv1d=layout == "conv1d")
        self.weight = _shard(layer.weight, block, grid)
        self.bias = None if layer.bias is None else _shard(layer.bias, rows, grid)
        self.block_grad_hook = None
        self.prefetcher: WeightPrefetcher | None = None
        if replicas > 1:
            self.block_grad_hook = replica_sum_hook(ShardSpec(0, replicas=replicas), self.out_group)
            if self.bias is not None and self.bias.requires_grad:
                self.bias.register_hook(self.block_grad_hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in/|in_group|] → [..., out/|out_group|]."""
        gather = None if self.prefetcher is None else self.gather_block
        y = linear3d(
            x, self.weight, self.in_group, self.out_group, self.z, self.block_grad_hook, gather
        )
        return y if self.bias is None else y + self.bias

    def gather_block(self) -> torch.Tensor:
        """The whole weight block [out/|out_group|, in/|in_group|], from the prefetcher."""
        assert self.prefetcher is not None
        return self.prefetcher.gather(self)

    def extra_repr(self) -> str:
        kind = "transposed" if self.transposed else "normal"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class LayerNorm3D(nn.Module):
    """LayerNorm over a hidden split over X: x [..., d/x] → [..., d/x]; the row statistics
    Σx and Σx² are summed over X. Holds this rank's [d/x] slice of weight and bias."""

    def __init__(self, norm: nn.LayerNorm, grid: Grid):
        super().__init__()
        self.x = grid.x
        self.width = norm.normalized_shape[0]
        self.eps = norm.eps
        self.weight = _shard(norm.weight, Shard3D(rows="x"), grid)
        self.bias = None if norm.bias is None else _shard(norm.bias, Shard3D(rows="x"), grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d/x] → [..., d/x]."""
        stats = sum_over(torch.stack([x.sum(-1), x.pow(2).sum(-1)], -1), self.x) / self.width
        mean, square = stats.unbind(-1)
        inv = torch.rsqrt(square - mean.pow(2) + self.eps).unsqueeze(-1)
        y = (x - mean.unsqueeze(-1)) * inv * self.weight
        return y if self.bias is None else y + self.bias


class RMSNorm3D(nn.Module):
    """RMS norm over a hidden split over X: x [..., d/x] → x / sqrt(mean(x²) + eps) · weight,
    mean(x²) from Σx² summed over X. Holds this rank's [d/x] slice of the weight."""

    def __init__(self, norm: nn.Module, eps: float, grid: Grid):
        super().__init__()
        self.x = grid.x
        self.width = norm.weight.shape[0]
        self.eps = eps
        self.weight = _shard(norm.weight, Shard3D(rows="x"), grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d/x] → [..., d/x]."""
        square = sum_over(x.pow(2).sum(-1, keepdim=True), self.x) / self.width
        return x * torch.rsqrt(square + self.eps) * self.weight


def rms_norm_eps(module: nn.Module, d: int) -> float | None:
    """eps if `module` is an RMS norm over [d] (one [d] `weight`, a float eps attribute, and on a
    random probe [2, d] it returns x / sqrt(mean(x²) + eps) · weight), None otherwise."""
    params = dict(module.named_parameters(recurse=False))
    eps = next((getattr(module, a) for a in EPS_ATTRS if hasattr(module, a)), None)
    weight = params.get("weight")
    if list(params) != ["weight"] or weight.shape != (d,) or not isinstance(eps, float):
        return None
    probe = torch.randn(2, d, generator=torch.Generator().manual_seed(0)).to(weight)
    with torch.no_grad():
        expected = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + eps) * weight
        matches = torch.allclose(module(probe), expected, rtol=1e-4, atol=1e-5)
    return eps if matches else None


# ----------------------------------------------------------------------------- validation


def check_tensor3d(model: nn.Module, structure: Structure, tp3d: tuple[int, int, int]) -> None:
    """Raise PlanError, before anything is modified, if `model` cannot be split on the grid
    (x, y, z): experts, a missing layer list or final norm, norms it cannot split, and every
    width or head count that the grid must divide."""
    x, y, z = tp3d
    where = f"tp3d={x}x{y}x{z}"
    if structure.experts:
        raise PlanError(
            f"{where} does not split Mixture-of-Experts layers {structure.experts}; use a "
            "dense model or tp=N"
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
    d = structure.d_model
    sizes = [("the model", "d_model", d, x), ("the model", "d_model / x", d // x, z)]
    for a in structure.attentions:
        kv_local = a.n_kv_heads // y if a.n_kv_heads % y == 0 else 1
        sizes += [
            (a.name, "n_heads", a.n_heads, y),
            (a.name, "query width / y", a.n_heads * a.head_dim // y, z),
            (a.name, "kv width per y rank", kv_local * a.head_dim, z),
        ]
    for f in structure.feed_forwards:
        sizes += [(f.name, "ffn_dim", f.ffn_dim, y), (f.name, "ffn_dim / y", f.ffn_dim // y, z)]
    for part, what, value, k in sizes:
        if value % k:
            fits = [n for n in range(1, value + 1) if value % n == 0][:8]
            raise PlanError(
                f"{part}: {what}={value} is not divisible by {k} as {where} needs; "
                f"use a grid whose factor there is in {fits}"
            )
    for a in structure.attentions:
        if a.n_kv_heads % y and y % a.n_kv_heads:
            raise PlanError(
                f"{a.name}: n_kv_heads={a.n_kv_heads} is not divisible by {where}'s y={y}, nor "
                f"y by it; use y dividing or divided by {a.n_kv_heads}"
            )
    _block_norms(model, structure)


# ----------------------------------------------------------------------------- application


def apply_tensor3d(
    model: nn.Module, structure: Structure, grid: Grid, prefetch: bool = True
) -> list[str]:
    """Split `model` (call `check_tensor3d` first) in place over `grid`; return the report
    lines. See the module docstring for the layout; `prefetch` (z > 1): all-gather each 3D
    weight over Z one layer ahead (`tensor3d_prefetch`)."""
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
    _split_residual(model, structure, grid.x)
    lines.append(
        f"{structure.layers}: residual stream split over x (hidden d/{x}), tokens over z; "
        f"{structure.vocab.embedding}, {structure.final_norm} and the LM head replicated"  # type: ignore[union-attr]
    )
    if z > 1:
        _split_tokens(model, grid.z)
        synced = 0
        for param in model.parameters():
            spec = shard3d_spec(param)
            if param.requires_grad and (spec is None or "z" not in spec.axes):
                param.register_hook(all_reduce_grad_hook(grid.z))
                synced += 1
        lines.append(f"batch split over z; gradients of {synced} parameters all-reduced over z")
        if prefetch:
            linears = [m for m in model.modules() if isinstance(m, Linear3D)]
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


def _split_residual(model: nn.Module, structure: Structure, x: Group) -> None:
    """The first layer takes its X slice [..., d/x] of the hidden states; the final norm
    all-gathers them back to [..., d]."""
    d = structure.d_model
    first = model.get_submodule(structure.layers)[0]  # type: ignore[arg-type, index]
    norm = model.get_submodule(structure.final_norm)  # type: ignore[arg-type]

    def split(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return replace_hidden(args, kwargs, d, lambda h: split_last_dim(h, x))

    def gather(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return replace_hidden(args, kwargs, d // x.size, lambda h: gather_last(h, x))

    first.register_forward_pre_hook(split, with_kwargs=True)
    norm.register_forward_pre_hook(gather, with_kwargs=True)


def _split_tokens(model: nn.Module, z: Group) -> None:
    """The model's forward on this rank's rows of every batch-major input; loss averaged over
    Z: the built-in GPT's (logits, loss), or the `loss` of a Hugging Face ModelOutput."""

    def take_rows(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if not tensors:
            return args, kwargs
        batch = tensors[0].shape[0]
        if batch % z.size:
            raise PlanError(
                f"batch of {batch} rows is not divisible by tp3d's z={z.size}; use a batch "
                f"that is a multiple of {z.size}"
            )
        n = batch // z.size

        def rows(t: Any) -> Any:
            batch_major = isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == batch
            return t.narrow(0, z.rank * n, n) if batch_major else t

        return tuple(rows(a) for a in args), {k: rows(v) for k, v in kwargs.items()}

    def average_loss(module: nn.Module, args: tuple, output: Any) -> Any:
        if hasattr(output, "loss"):  # Hugging Face ModelOutput: HF's own loss from `labels`
            if output.loss is not None:
                output.loss = mean_over(output.loss, z)
            return output
        logits, loss = output
        if loss is not None and loss.dim() != 0:
            raise PlanError(
                f"tp3d z={z.size} averages the loss of a (logits, loss) or ModelOutput result; "
                f"{type(module).__name__} returned another tuple (use return_dict=True)"
            )
        return logits, None if loss is None else mean_over(loss, z)

    model.register_forward_pre_hook(take_rows, with_kwargs=True)
    model.register_forward_hook(average_loss)


# ----------------------------------------------------------------------------- bytes and norm


def layer_wire_bytes(
    n_in: int, n_out: int, tokens: int, tp3d: tuple[int, int, int], transposed: bool, b: int = 4
) -> dict[str, float]:
    """AxoNN's wire bytes per rank of one linear layer n_in → n_out per training step (forward
    and backward), with `tokens` per rank: {"tp_x", "tp_y", "tp_z": bytes}. A normal layer
    all-reduces its output [tokens, n_out/y] over X and its input gradient [tokens, n_in/x]
    over Y; a transposed one the other way round; Z moves 3(z−1)/z of the block each step."""
    x, y, z = tp3d
    out_axis, in_axis = ("x", "y") if transposed else ("y", "x")
    size = {"x": x, "y": y, "z": z}
    p_in, p_out = size[in_axis], size[out_axis]
    return {
        f"tp_{in_axis}": 2 * (p_in - 1) / p_in * tokens * n_out / p_out * b,
        f"tp_{out_axis}": 2 * (p_out - 1) / p_out * tokens * n_in / p_in * b,
        "tp_z": 3 * (z - 1) / z * n_in * n_out / (x * y) * b,
    }


def grad_norm3d(parameters: Iterable[torch.Tensor], grid: Grid) -> torch.Tensor:
    """Global L2 norm of the gradients of a 3D-parallel model: each piece's square counted once
    (divided by the ranks holding it), summed over X, Y and Z. Collective over the grid."""

    def holders(param: torch.Tensor) -> int:
        spec = shard3d_spec(param)
        held = math.prod(grid.axis(a).size for a in AXES if spec is None or a not in spec.axes)
        return held * (1 if spec is None else spec.replicas)

    return split_grad_norm(parameters, holders, [grid.x, grid.y, grid.z])


def clip_grad_norm3d_(
    parameters: Iterable[torch.Tensor], max_norm: float, grid: Grid
) -> torch.Tensor:
    """Scale gradients in place so `grad_norm3d` is at most `max_norm`; returns the norm."""
    params = [p for p in parameters if p.grad is not None]
    norm = grad_norm3d(params, grid)
    clip_to_norm_(params, norm, max_norm)
    return norm
