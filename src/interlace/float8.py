"""float8 linear layers (`precision=fp8`): the blocks' matmuls on float8 tensor cores.

`convert_to_float8` hands every linear layer of the blocks a `Float8Matmul` (the layers' one
matmul seam, `interlace.matmul`): plain nn.Linear (the built-in GPT's, a Hugging Face model's,
and 1D tensor parallelism's column-parallel layers) becomes a `Float8Linear` in place, and
interlace's own split layers (row-parallel, 3D) take the value as their `matmul`. The
embedding, the LM head, the norms, the routers and the experts stay in the compute dtype (bf16),
as torchtitan and Megatron-Core keep them; the experts' grouped matmul has no float8 kernel that
runs on every device torch supports, so it keeps bf16 (`Matmul.grouped` is where one plugs in).

Each of a linear layer's three products — the forward x·Wᵀ, the input gradient g·W and the
weight gradient gᵀ·x — casts its two operands to float8 with scales computed from their
current values (dynamic scaling: no amax history to keep or checkpoint) and multiplies them with
`torch._scaled_mm`, which accumulates in fp32 and writes the compute dtype:

    tensorwise  one scale per operand, from the amax of the whole tensor; forward operands in
                e4m3, the output gradient in e5m2 (its wider range), as torchao's default;
    rowwise     one scale per row of the left operand and per column of the right (the amax
                along the contraction), every operand in e4m3 (what the rowwise kernel takes):
                one outlier spoils only its own row, at some cost in speed.

A scale maps an operand's largest magnitude to the format's largest finite value, so nothing
saturates and small values keep what precision the format has. Products whose dimensions are
not multiples of 16 (what the float8 kernels need) run in the compute dtype instead.

Written here rather than taken from torchao: its float8 training ships per torch release (no
wheel matches every torch this project supports), and what it would add to these three scaled
products is its own module swap and tensor subclass; torch's `_scaled_mm` is the kernel either
way. FSDP2 gathers the weights in bf16 and each rank casts them (no float8 all-gather).
"""

from __future__ import annotations

import torch
from torch import nn

from interlace.matmul import Matmul
from interlace.precision import FLOAT8_RECIPES, compute_dtype
from interlace.tensors import is_under

ALIGNMENT = 16
"""Every dimension of a float8 product must be a multiple of this (the kernels' tile)."""

_FORWARD = torch.float8_e4m3fn
_GRADIENT = {"tensorwise": torch.float8_e5m2, "rowwise": torch.float8_e4m3fn}


def to_float8(
    t: torch.Tensor, dtype: torch.dtype, dim: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """t [M, K] → (its float8 `dtype` copy, the fp32 scale that multiplies it back): one scale
    for the whole tensor (`dim` None, a 0-d tensor) or one per slice along `dim` (the amax
    taken over `dim`, kept as a size-1 dimension)."""
    magnitude = t.detach().abs()
    amax = magnitude.amax() if dim is None else magnitude.amax(dim=dim, keepdim=True)
    largest = torch.finfo(dtype).max
    scale = amax.float().clamp(min=torch.finfo(torch.float32).tiny) / largest
    return (t.float() / scale).clamp(-largest, largest).to(dtype), scale


def scaled_product(
    a: torch.Tensor,
    b: torch.Tensor,
    a_dtype: torch.dtype,
    b_dtype: torch.dtype,
    recipe: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a [M, K] · b [K, N] → [M, N] in `out_dtype`, both operands cast to float8 (`a_dtype`,
    `b_dtype`) and scaled by `recipe` (module docstring); in `out_dtype` directly when a
    dimension is not a multiple of ALIGNMENT."""
    if any(n % ALIGNMENT for n in (*a.shape, b.shape[1])):
        return torch.matmul(a.to(out_dtype), b.to(out_dtype))
    rowwise = recipe == "rowwise"
    qa, scale_a = to_float8(a, a_dtype, -1 if rowwise else None)  # scales [M, 1]
    qb, scale_b = to_float8(b, b_dtype, 0 if rowwise else None)  # scales [1, N]
    # the kernel reads the left operand row-major and the right one column-major (a cast keeps
    # its input's strides: a transposed view stays transposed)
    qa, qb = qa.contiguous(), qb.t().contiguous().t()
    return torch._scaled_mm(qa, qb, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


class Float8Matmul(Matmul):
    """A linear layer's products in float8 under `recipe` ("tensorwise" or "rowwise"); the
    grouped and batched products (the experts) stay in the compute dtype."""

    def __init__(self, recipe: str):
        if recipe not in FLOAT8_RECIPES:
            raise ValueError(f"fp8 recipe {recipe!r} is not one of {', '.join(FLOAT8_RECIPES)}")
        self.recipe = recipe
        self.gradient_dtype = _GRADIENT[recipe]

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [..., in] · weight [out, in]ᵀ + bias [out] → [..., out] in the compute dtype;
        backward through `input_grad` and `weight_grad`."""
        y = _Float8Linear.apply(x, weight, self)
        return y if bias is None else y + bias.to(y.dtype)

    def output(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., in] · weight [out, in]ᵀ → [..., out], both in e4m3."""
        rows = x.flatten(0, -2)
        y = scaled_product(rows, weight.t(), _FORWARD, _FORWARD, self.recipe, compute_dtype(x))
        return y.view(*x.shape[:-1], weight.shape[0])

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """grad [..., out] · weight [out, in] → [..., in], the gradient in its float8 dtype."""
        rows = grad.flatten(0, -2)
        dtype = self.gradient_dtype
        y = scaled_product(rows, weight, dtype, _FORWARD, self.recipe, grad.dtype)
        return y.view(*grad.shape[:-1], weight.shape[1])

    def weight_grad(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """grad [..., out]ᵀ · x [..., in] → [out, in], summed over every row."""
        rows = grad.flatten(0, -2).t().contiguous()
        dtype = self.gradient_dtype
        return scaled_product(rows, x.flatten(0, -2), dtype, _FORWARD, self.recipe, grad.dtype)

    def __repr__(self) -> str:
        return f"Float8Matmul({self.recipe})"


class _Float8Linear(torch.autograd.Function):
    """x · Wᵀ with each of its three products computed by a `Float8Matmul`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, matmul: Float8Matmul):
        ctx.save_for_backward(x, weight)
        ctx.matmul = matmul
        return matmul.output(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.matmul.input_grad(grad, weight).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = ctx.matmul.weight_grad(grad, x).to(weight.dtype)
        return grad_x, grad_w, None


class Float8Linear(nn.Linear):
    """nn.Linear whose forward multiplies through its `matmul` (a `Float8Matmul` set by
    `convert_to_float8`); same parameters, same state dict."""

    matmul: Matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] → [..., out]."""
        return self.matmul.linear(x, self.weight, self.bias)


def convert_to_float8(model: nn.Module, recipe: str, within: str, skip: list[str]) -> list[str]:
    """Give every linear layer of `model` under the module named `within` (the layer list)
    float8 products under `recipe`, in place: exact nn.Linear instances become `Float8Linear`,
    split layers with a `matmul` attribute take a `Float8Matmul`. Modules under a name of
    `skip` (the Mixture-of-Experts layers: routers and experts) are left as they are. Returns
    the report line."""
    matmul = Float8Matmul(recipe)
    converted = 0
    for name, module in model.named_modules():
        if not is_under(name, within) or is_under(name, *skip):
            continue
        if type(module) is nn.Linear:
            module.__class__ = Float8Linear
        elif not isinstance(getattr(type(module), "matmul", None), Matmul):
            continue
        module.matmul = matmul
        converted += 1
    return [
        f"precision: fp8 ({recipe}) products in {converted} linear layers under {within}; "
        "embedding, head, norms, routers and experts in bf16"
    ]
