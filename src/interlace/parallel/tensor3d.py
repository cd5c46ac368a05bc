"""3D tensor parallelism (AxoNN-style): every linear layer of a block split over an x·y·z grid.

Ranks form a grid of groups "tp_x", "tp_y", "tp_z" (x fastest). The layout, per rank (X, Y, Z
its indices):

- **Tokens** are split over Z: the built-in GPT's batch [B, T] becomes rows
  [Z·B/z, (Z+1)·B/z) on entry; its loss is the mean over Z of the slices' mean losses.
- **Residual stream** between blocks: [B/z, T, d/x], hidden features [X·d/x, (X+1)·d/x),
  replicated over Y. The first block splits the embedding output over X (backward all-gather);
  the last block's output is all-gathered over X (backward slice) for the final norm and head.
- **Normal layer** (q, k, v; up and gate), W [out, in]: `in` split over X, `out` over Y, the
  [out/y, in/x] block cut over Z by rows → `Linear3D` weight [out/(y·z), in/x]. Its output
  [.., out/y] (this rank's heads or ffn features) is replicated over X.
- **Transposed layer** (out projection; down): X and Y swapped: `in` over Y, `out` over X,
  weight [out/(x·z), in/y]; its output [.., d/x] is the residual layout again: no re-layout.
- **Collectives** per linear layer (`tensor3d_comm.linear3d`): forward all-gather of W over Z and
  all-reduce of O over its `in` group; backward all-gather over Z, async all-reduce of dX over its
  `out` group (hidden behind the dW matmul) and async reduce-scatter of dW over Z. With tokens per
  rank T and b bytes per element, a normal layer H → K·H puts on the wire
  X: 2(x−1)/x·T·(K·H/y)·b, Y: 2(y−1)/y·T·(H/x)·b, Z: 3(z−1)/z·(K·H²/(x·y))·b
  (`layer_wire_bytes`); a transposed one swaps X and Y.
- **LayerNorms** inside blocks (`LayerNorm3D`) hold their [d/x] slice and all-reduce the row
  statistics Σx, Σx² [.., 2] over X (forward and backward): 2·2(x−1)/x·T·2·b per norm per step
  beyond the formula. The final norm, embeddings and LM head stay replicated (full [.., d] after
  the gather); their cost is the gather above and V·d replicated weights per rank.
- **Biases** of a normal layer [out/y] are replicated over X and Z, of a transposed one [out/x]
  over Y and Z. Every parameter except the 3D weights sees only its Z slice of the tokens: its
  gradient is all-reduced over Z by a hook. Data parallelism then all-reduces every gradient
  over "dp" (the 3D weights were already reduce-scattered over Z).

`Shard3D` records which grid axes split a parameter, for checkpoint keys, the gradient norm and
tests. Only the built-in dense GPT is supported; other models are refused with a PlanError.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from interlace import comm
from interlace.comm import Group
from interlace.errors import PlanError
from interlace.mesh import Mesh
from interlace.parallel.detect import Structure
from interlace.parallel.tensor3d_comm import (
    gather_last,
    linear3d,
    mean_over,
    split_last_dim,
    sum_over,
)
from interlace.parallel.tp_comm import all_reduce_grad_hook

AXES = ("x", "y", "z")


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
    again over `flat` (contiguous pieces of the row-major block). None: not cut that way."""

    rows: str | None = None
    cols: str | None = None
    flat: str | None = None

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
    piece = full
    for dim, axis in ((0, spec.rows), (1, spec.cols), (0, spec.flat)):
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
            coords = ".".join(f"{a}{grid.axis(a).rank}" for a in spec.axes)
            keys[name] = f"{name}.tp3d.{coords}"
    return keys


# ----------------------------------------------------------------------------- modules


class Linear3D(nn.Module):
    """A 3D-parallel linear layer: x [..., in/|in_group|] → [..., out/|out_group|] (+ bias).

    `weight` [out/(|out_group|·z), in/|in_group|] is this rank's Z piece of its block; `bias`
    [out/|out_group|] (replicated over the in group and Z) is added after the sum.
    """

    def __init__(self, layer: nn.Module, grid: Grid, transposed: bool):
        super().__init__()
        in_axis, out_axis = ("y", "x") if transposed else ("x", "y")
        self.in_group, self.out_group, self.z = grid.axis(in_axis), grid.axis(out_axis), grid.z
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.transposed = transposed
        self.weight = _shard(layer.weight, Shard3D(rows=out_axis, cols=in_axis, flat="z"), grid)
        self.bias = None
        if layer.bias is not None:
            self.bias = _shard(layer.bias, Shard3D(rows=out_axis), grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in/|in_group|] → [..., out/|out_group|]."""
        y = linear3d(x, self.weight, self.in_group, self.out_group, self.z)
        return y if self.bias is None else y + self.bias

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


# ----------------------------------------------------------------------------- validation


def check_tensor3d(model: nn.Module, structure: Structure, tp3d: tuple[int, int, int]) -> None:
    """Raise PlanError, before anything is modified, if `model` cannot be split on the grid
    (x, y, z): the model kind, its norms, and every width that the grid must divide."""
    from interlace.models.gpt import GPT

    x, y, z = tp3d
    where = f"tp3d={x}x{y}x{z}"
    if not isinstance(model, GPT):
        raise PlanError(
            f"{where} supports the built-in GPT (interlace.models) only so far, not "
            f"{type(model).__name__}; use tp=N (1D tensor parallelism) for this model"
        )
    if structure.experts:
        raise PlanError(
            f"{where} does not split Mixture-of-Experts layers {structure.experts}; use a "
            "dense model or tp=N"
        )
    d = structure.d_model
    sizes = [("the model", "d_model", d, x), ("the model", "d_model / x", d // x, z)]
    for a in structure.attentions:
        sizes += [(a.name, "n_heads", a.n_heads, y), (a.name, "d_model / y", d // y, z)]
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
        if a.fused or a.n_kv_heads != a.n_heads:
            raise PlanError(
                f"{a.name}: {where} needs separate q, k, v layers with as many kv heads as "
                "heads; use tp=N for this model"
            )


# ----------------------------------------------------------------------------- application


def apply_tensor3d(model: nn.Module, structure: Structure, grid: Grid) -> list[str]:
    """Split `model` (the built-in GPT; call `check_tensor3d` first) in place over `grid`;
    return the report lines. See the module docstring for the layout."""
    x, y, z = grid.x.size, grid.y.size, grid.z.size
    lines = [f"3D tensor parallel over x={x}, y={y}, z={z} ranks"]
    for a in structure.attentions:
        block = model.get_submodule(a.name)
        for name in a.producers:
            setattr(block, name, Linear3D(getattr(block, name), grid, transposed=False))
        setattr(block, a.out, Linear3D(getattr(block, a.out), grid, transposed=True))
        lines.append(
            f"{a.name}: {', '.join(a.producers)} normal ({a.n_heads // y} of {a.n_heads} heads "
            f"per y rank); {a.out} transposed"
        )
    for f in structure.feed_forwards:
        block = model.get_submodule(f.name)
        for name in f.producers:
            setattr(block, name, Linear3D(getattr(block, name), grid, transposed=False))
        setattr(block, f.down, Linear3D(getattr(block, f.down), grid, transposed=True))
        lines.append(f"{f.name}: {', '.join(f.producers)} normal; {f.down} transposed")
    layers = model.get_submodule(structure.layers)  # type: ignore[arg-type]
    lines.append(_shard_norms(layers, structure, grid))
    layers[0].register_forward_pre_hook(
        lambda mod, args: (split_last_dim(args[0], grid.x), *args[1:])
    )
    layers[-1].register_forward_hook(lambda mod, args, out: gather_last(out, grid.x))
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
    return lines


def _shard_norms(layers: nn.Module, structure: Structure, grid: Grid) -> str:
    """Replace every LayerNorm of the layer list by its LayerNorm3D; refuse other parameterised
    modules outside the attention and feed-forward blocks."""
    split = [a.name for a in structure.attentions] + [f.name for f in structure.feed_forwards]
    count = 0
    for name, module in list(layers.named_modules()):
        full = f"{structure.layers}.{name}"
        if any(full == s or full.startswith(s + ".") for s in split):
            continue
        if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1:
            parent, _, leaf = name.rpartition(".")
            setattr(layers.get_submodule(parent), leaf, LayerNorm3D(module, grid))
            count += 1
        elif list(module.parameters(recurse=False)):
            raise PlanError(
                f"{full}: {type(module).__name__} holds parameters outside attention and "
                "feed-forward blocks that tp3d cannot split; use tp=N for this model"
            )
    return f"{structure.layers}: {count} LayerNorms split over x (statistics all-reduced)"


def _split_tokens(model: nn.Module, z: Group) -> None:
    """The GPT's `forward(idx, targets)` on this rank's rows of the batch; loss averaged over Z."""

    def take_rows(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def rows(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if t.shape[0] % z.size:
                raise PlanError(
                    f"batch of {t.shape[0]} rows is not divisible by tp3d's z={z.size}; use a "
                    f"batch that is a multiple of {z.size}"
                )
            n = t.shape[0] // z.size
            return t.narrow(0, z.rank * n, n)

        return tuple(rows(a) for a in args), {k: rows(v) for k, v in kwargs.items()}

    def average_loss(module: nn.Module, args: tuple, output: Any) -> Any:
        logits, loss = output
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
    params = [p for p in parameters if p.grad is not None]
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), device=device)
    for param in params:
        spec = shard3d_spec(param)
        held = math.prod(grid.axis(a).size for a in AXES if spec is None or a not in spec.axes)
        total += param.grad.detach().float().pow(2).sum() / held
    for group in (grid.x, grid.y, grid.z):
        if group.size > 1:
            comm.all_reduce(total, group)
    return total.sqrt()


def clip_grad_norm3d_(
    parameters: Iterable[torch.Tensor], max_norm: float, grid: Grid
) -> torch.Tensor:
    """Scale gradients in place so `grad_norm3d` is at most `max_norm`; returns the norm."""
    params = [p for p in parameters if p.grad is not None]
    norm = grad_norm3d(params, grid)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(scale.to(p.grad.device, p.grad.dtype))
    return norm
