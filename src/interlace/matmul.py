"""The one entry point through which split layers multiply: a `Matmul` value.

Every layer interlace builds or converts — the 1D row-parallel linear, the 3D linear's autograd
function, the fused experts, the grouped experts, and (under float8) every nn.Linear of the
blocks — calls the products of a `Matmul` instead of torch's functions. A number format is then
one object handed to the layers (`interlace.float8.Float8Matmul`), not a branch in each.

`PLAIN` multiplies with torch's own functions, in the dtype autocast gives: what every layer
does unless converted. The products are named by their role in a linear layer y = x·Wᵀ, so a
hand-written backward (the 3D linear's) asks for the same products a format may replace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Matmul:
    """The products of a linear layer, computed by torch's functions (subclasses change the
    number format). Stateless: one value may serve every layer of a model."""

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [..., in] · weight [out, in]ᵀ + bias [out] → [..., out], differentiable."""
        return F.linear(x, weight, bias)

    def output(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The forward product inside a hand-written autograd function: x [..., in] · weight
        [out, in]ᵀ → [..., out]."""
        return torch.matmul(x, weight.t())

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The gradient of the input: grad [..., out] · weight [out, in] → [..., in]."""
        return torch.matmul(grad, weight)

    def weight_grad(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The gradient of the weight, summed over every row: grad [..., out]ᵀ · x [..., in] →
        [out, in]."""
        return grad.flatten(0, -2).t().matmul(x.flatten(0, -2))

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Rows of x [M, in] in groups ending at `offs` [E] (int32), group e times weight[e]ᵀ
        (weight [E, out, in]) → [M, out], differentiable; rows past offs[-1] are left unset."""
        return F.grouped_mm(x, weight.mT, offs=offs)

    def batched(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [E, rows, in] · weight[e]ᵀ (weight [E, out, in]) → [E, rows, out],
        differentiable."""
        return torch.bmm(x, weight.mT)


PLAIN = Matmul()
"""torch's own products: the `matmul` of every layer that was not converted."""
