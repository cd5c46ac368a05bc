"""The modules of 3D tensor parallelism: `Linear3D` (normal or transposed), `LayerNorm3D` and
`RMSNorm3D` on [.., d/x] slices, and the wire bytes of one 3D linear (`layer_wire_bytes`)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from interlace.comm import Group
from interlace.matmul import PLAIN, Matmul
from interlace.parallel.detect import linear_shape
from interlace.parallel.grad_sums import sum_gradient_among
from interlace.parallel.tensor.comm import reduce_scatter_sequence
from interlace.parallel.tensor.shard import ShardSpec, replica_slots
from interlace.parallel.tensor3d.comm import ALONE, gather_weight, linear3d, summed
from interlace.parallel.tensor3d.prefetch import WeightPrefetcher
from interlace.parallel.tensor3d.shard import Grid, Shard3D, shard3d_parameter
from interlace.parallel.tensor3d.shared import SharedBlock

EPS_ATTRS = ("eps", "variance_epsilon")
"""Norm attributes holding epsilon (by convention, not by model)."""


# ----------------------------------------------------------------------------- modules


class Linear3D(nn.Module):
    """A 3D-parallel linear layer: x [..., in/|in_group|] → [..., out/|out_group|] (+ bias).

    `weight` [out/(|out_group|·z), in/|in_group|] is this rank's Z piece of its block; `bias`
    [out/|out_group|] (replicated over the in group and Z) is added after the sum. `layer` is an
    nn.Linear or HF Conv1D; `segments` and `replicas` cut the output features as in `Shard3D`
    (fused q|k|v; kv heads held by `replicas` ranks, their gradients summed over them).
    `prefetcher` (set by `apply_tensor3d` when z > 1) serves its Z all-gathers one layer ahead.
    """

    matmul: Matmul = PLAIN
    """Computes the products (`interlace.matmul`); a converter may set another."""
    z_grad_in_backward: bool = False
    """The weight's Z-reduced gradient handed to autograd inside the backward, as FSDP2 needs
    (`apply_tensor3d` sets it under sharded data parallelism); else added when it ends."""
    sequence: Group | None = None
    """The Y group when the residual stream is split along the sequence over Y (sequence
    parallelism, set by `apply_tensor3d`): a normal layer, fed the sequence its block's entry
    all-gathered, leaves its input gradient's sum over Y to that entry's reduce-scatter; a
    transposed layer reduce-scatters its output along the sequence over Y, [..., T/y, out/x],
    instead of all-reducing it (backward: all-gather)."""
    shared: SharedBlock | None = None
    """The block its layer's sub-batches share while they run (`tp_subbatches`, z > 1; set
    by `parallel.tensor.overlap` from `shared_block`)."""

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
        self.weight = shard3d_parameter(layer.weight, block, grid)
        self.bias = None if layer.bias is None else shard3d_parameter(layer.bias, rows, grid)
        self.block_grad_hook = None
        self.prefetcher: WeightPrefetcher | None = None
        if replicas > 1:
            slots = replica_slots(ShardSpec(0, replicas=replicas), self.out_group)
            self.block_grad_hook = slots.sum
            if self.bias is not None and self.bias.requires_grad:
                sum_gradient_among(self.bias, slots)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in/|in_group|] → [..., out/|out_group|] ([B, T/y, out/x] from a transposed
        layer under `sequence`)."""
        in_group, out_group = self.in_group, self.out_group
        if self.sequence is not None:  # Y's sum done by the sequence's collectives
            in_group, out_group = (ALONE, out_group) if self.transposed else (in_group, ALONE)
        shared = self.shared
        if shared is not None:  # the block and its Z collectives are the SharedBlock's
            y = linear3d(x, shared.leaf, in_group, out_group, ALONE, None, shared.get, self.matmul)
        else:
            y = linear3d(
                x,
                self.weight,
                in_group,
                out_group,
                self.z,
                self.block_grad_hook,
                None if self.prefetcher is None else self.gather_block,
                self.matmul,
                self.z_grad_in_backward,
            )
        if self.sequence is not None and self.transposed:
            y = reduce_scatter_sequence(y, self.sequence)
        return y if self.bias is None else y + self.bias

    def shared_block(self) -> SharedBlock | None:
        """With z > 1, a `SharedBlock` of this layer's weight for one sub-batched call of its
        layer (`parallel.tensor.overlap`): one Z gather per half of the pass and one
        reduce-scatter of the summed gradient, whatever the number of sub-batches; None with
        z = 1."""
        return SharedBlock(self) if self.z.size > 1 else None

    def gather_block(self) -> torch.Tensor:
        """The whole weight block [out/|out_group|, in/|in_group|]: from the prefetcher if
        there is one, else all-gathered over Z now."""
        if self.prefetcher is None:
            return gather_weight(self.weight, self.z)
        return self.prefetcher.gather(self)

    def extra_repr(self) -> str:
        kind = "transposed" if self.transposed else "normal"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class _SplitNorm(torch.autograd.Function):
    """A LayerNorm (`centered`) or RMS norm of rows whose features are split over `group`:
    x [..., n] (n = width / p) → x̂ · w (+ b), x̂ = (x − mean) · inv or x · inv, from the row
    sums Σx, Σx² all-reduced over the group ([..., 2], or Σx² alone). Written by hand because
    torch's norms need the whole row; it saves what torch's own LayerNorm saves, the input and
    the row statistics, where the same formula in autograd ops keeps three [..., n] tensors.
    Backward, with g = dy · w: dx = inv · (g − Σg/width − x̂ · Σ(g·x̂)/width) (RMS: no Σg
    term), its two row sums all-reduced over the group; dw = Σ_rows dy · x̂, db = Σ_rows dy."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, width, eps, centered):
        sums = [x.sum(-1), x.pow(2).sum(-1)] if centered else [x.pow(2).sum(-1)]
        stats = summed(torch.stack(sums, -1), group) / width
        mean = stats[..., 0] if centered else None
        square = stats[..., -1] - (0.0 if mean is None else mean.pow(2))
        inv = torch.rsqrt(square + eps).unsqueeze(-1)
        normed = (x if mean is None else x - mean.unsqueeze(-1)) * inv
        ctx.save_for_backward(x, weight, mean, inv)
        ctx.group, ctx.width, ctx.has_bias = group, width, bias is not None
        y = normed * weight
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, inv = ctx.saved_tensors
        normed = (x if mean is None else x - mean.unsqueeze(-1)) * inv
        g = dy * weight
        sums = [g.sum(-1)] if mean is not None else []
        stats = summed(torch.stack([*sums, (g * normed).sum(-1)], -1), ctx.group) / ctx.width
        dx = g - normed * stats[..., -1:]
        if mean is not None:
            dx = dx - stats[..., :1]
        rows = dy.reshape(-1, dy.shape[-1])
        dw = (rows * normed.reshape(rows.shape)).sum(0).to(weight.dtype)
        db = rows.sum(0).to(weight.dtype) if ctx.has_bias else None
        return (dx * inv).to(x.dtype), dw, db, None, None, None, None


class LayerNorm3D(nn.Module):
    """LayerNorm over a hidden split over X: x [..., d/x] → [..., d/x]; the row statistics
    Σx and Σx² are summed over X (`_SplitNorm`). Holds this rank's [d/x] slice of weight and
    bias."""

    def __init__(self, norm: nn.LayerNorm, grid: Grid):
        super().__init__()
        self.x = grid.x
        self.width = norm.normalized_shape[0]
        self.eps = norm.eps
        self.weight = shard3d_parameter(norm.weight, Shard3D(rows="x"), grid)
        self.bias = (
            None if norm.bias is None else shard3d_parameter(norm.bias, Shard3D(rows="x"), grid)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d/x] → [..., d/x]."""
        return _SplitNorm.apply(x, self.weight, self.bias, self.x, self.width, self.eps, True)


class RMSNorm3D(nn.Module):
    """RMS norm over a hidden split over X: x [..., d/x] → x / sqrt(mean(x²) + eps) · weight,
    mean(x²) from Σx² summed over X (`_SplitNorm`). Holds this rank's [d/x] slice of the
    weight."""

    def __init__(self, norm: nn.Module, eps: float, grid: Grid):
        super().__init__()
        self.x = grid.x
        self.width = norm.weight.shape[0]
        self.eps = eps
        self.weight = shard3d_parameter(norm.weight, Shard3D(rows="x"), grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d/x] → [..., d/x]."""
        return _SplitNorm.apply(x, self.weight, None, self.x, self.width, self.eps, False)


def rms_norm_eps(module: nn.Module, d: int) -> float | None:
    """eps if `module` is an RMS norm over [d] (one [d] `weight`, a float eps attribute, and on a
    random probe [2, d] it returns x / sqrt(mean(x²) + eps) · weight), None otherwise. A module
    on the meta device (a model built for its shapes) is probed on the CPU with a random weight
    in its place (`functional_call`): its own weight has no values; one holding buffers, which
    have none either, is none."""
    params = dict(module.named_parameters(recurse=False))
    eps = next((getattr(module, a) for a in EPS_ATTRS if hasattr(module, a)), None)
    weight = params.get("weight")
    if list(params) != ["weight"] or weight.shape != (d,) or not isinstance(eps, float):
        return None
    if weight.is_meta:
        if list(module.buffers()):
            return None
        weight = torch.randn(d, generator=torch.Generator().manual_seed(1)).to(weight.dtype)
    probe = torch.randn(2, d, generator=torch.Generator().manual_seed(0)).to(weight)
    with torch.no_grad():
        expected = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + eps) * weight
        output = torch.func.functional_call(module, {"weight": weight}, (probe,))
        matches = torch.allclose(output, expected, rtol=1e-4, atol=1e-5)
    return eps if matches else None


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
