"""DeepSpeed-MoE as a peer in the `moe` benchmark (optional `peers` extra).

`deepspeed.moe.layer.MoE` (GShard-style: capacity-padded [E, C, d] dispatch buffers, one
all_to_all each way, `drop_tokens` on or off) runs in the same blocks, on the same tokens and
the same forced routing as interlace's strategies. Its gate is DeepSpeed's own `TopKGate`; only
its input is widened: each token gets E extra features holding a code of its workload choices
(20 at the first expert, 10 at the second), and the gate's weight reads those features alone,
so DeepSpeed's own top-1 / top-2 gating (second expert without sampling), capacity and drops
pick exactly the workload's experts. DeepSpeed needs its accelerator set to the CPU
(`DS_ACCELERATOR=cpu`) and JIT-compiles a small communication op on first use (cached under
`TORCH_EXTENSIONS_DIR`). Its collectives bypass interlace's comm meter; their bytes are
computed from the buffers DeepSpeed sends (E·C rows of d per rank per all_to_all).
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from interlace.models.mlp import MLP

FIRST, SECOND = 20.0, 10.0
"""Gate logits of a token's first and second forced expert (every other expert gets 0)."""


def unavailable() -> str | None:
    """Why the peer cannot run here (deepspeed not importable), or None."""
    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed-MoE not run: deepspeed not installed (pip install 'interlace[peers]')"
    _prepare_environment()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import deepspeed.moe.layer  # noqa: F401
    except Exception as exc:  # any import failure of the optional peer is a skip reason
        return f"DeepSpeed-MoE not run: import failed ({type(exc).__name__}: {exc})"
    return None


def _prepare_environment() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cache = Path.home() / ".cache" / "interlace" / "torch_extensions"
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache))


class ForcedGate(nn.Module):
    """DeepSpeed's gate fed [x, code]: its weight [E, d + E] is zero on x and the identity on
    the code, so its logits are the code of `choices` [N, k] (set before each forward)."""

    def __init__(self, gate: nn.Module, d_model: int, experts: int):
        super().__init__()
        self.gate = gate
        self.experts = experts
        weight = torch.zeros(experts, d_model + experts)
        weight[:, d_model:] = torch.eye(experts)
        gate.wg = nn.Linear(d_model + experts, experts, bias=False)
        gate.wg.weight = nn.Parameter(weight, requires_grad=False)
        self.choices: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, *args, **kwargs):
        """DeepSpeed's gate output for tokens x [N, d] routed to `choices`."""
        assert self.choices is not None, "set choices before the forward"
        code = torch.zeros(x.shape[0], self.experts, dtype=x.dtype, device=x.device)
        code.scatter_(1, self.choices[:, :1], FIRST)
        if self.choices.shape[1] > 1:
            code.scatter_(1, self.choices[:, 1:2], SECOND)
        return self.gate(torch.cat([x, code], dim=1), *args, **kwargs)


class DeepSpeedMoE(nn.Module):
    """A DeepSpeed-MoE layer [.., d] → [.., d] with forced routing (`router.choices`)."""

    def __init__(
        self,
        d_model: int,
        ffn: int,
        experts: int,
        k: int,
        capacity_factor: float,
        drop_tokens: bool,
        ep_size: int,
    ):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from deepspeed.moe.layer import MoE

        self.experts, self.k = experts, k
        self.capacity_factor, self.drop_tokens = capacity_factor, drop_tokens
        self.layer = MoE(
            hidden_size=d_model,
            expert=MLP(d_model, ffn),
            num_experts=experts,
            ep_size=ep_size,
            k=k,
            capacity_factor=capacity_factor,
            eval_capacity_factor=capacity_factor,
            min_capacity=0,
            drop_tokens=drop_tokens,
            top2_2nd_expert_sampling=False,
        )
        self.layer.set_deepspeed_parallelism()
        moe = self.layer.deepspeed_moe
        self.router = ForcedGate(moe.gate, d_model, experts)
        moe.gate = self.router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, d] → [B, N, d] (DeepSpeed's aux loss is left out, as for the other modes
        of the benchmark's squared-output loss)."""
        out, _, _ = self.layer(x)
        return out

    def capacity(self, tokens: int) -> int | None:
        """DeepSpeed's per-rank expert capacity for `tokens` tokens (None without drops)."""
        if not self.drop_tokens:
            return None
        return math.ceil(tokens / self.experts * self.capacity_factor * self.k)


def init_deepspeed() -> None:
    """Hand the running process group to deepspeed.comm (call on every rank)."""
    _prepare_environment()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
