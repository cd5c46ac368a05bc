"""Megatron-Core's tensor parallel linears as a peer in the `tp` benchmark (optional extra).

The built-in GPT gets Megatron-Core's `ColumnParallelLinear` in place of q/k/v/up and
`RowParallelLinear` in place of out_proj/down, holding the same shards of the same weights as
interlace's TP, so the peer computes the same loss. As in Megatron, each column-parallel linear
all-reduces its own input gradient (q, k and v: three per attention), and the embedding and LM
head stay replicated (Megatron's vocab-parallel ones need its own model classes). Megatron's
sequence parallelism and its gradient-accumulation fusion need CUDA and are off.

Megatron-Core 0.16 is the last release importable on Python 3.11 without triton; it is
installed only by the `peers` extra (`pip install 'interlace[peers]'`), never for the tests.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import torch
from torch import nn

COLUMN = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.up")
"""The built-in GPT's column-parallel linears inside each block."""
ROW = ("attn.out_proj", "mlp.down")
"""Its row-parallel linears."""


def unavailable() -> str | None:
    """Why the peer cannot run here (megatron-core not importable), or None."""
    if importlib.util.find_spec("megatron") is None:
        return "Megatron-Core not run: not installed (pip install 'interlace[peers]')"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no Transformer Engine / Apex on CPU: fallbacks
            from megatron.core import tensor_parallel  # noqa: F401
    except Exception as exc:  # any import failure of the optional peer is a skip reason
        return f"Megatron-Core not run: import failed ({type(exc).__name__}: {exc})"
    return None


class _OutputOnly(nn.Module):
    """A Megatron linear returning its output alone (they return (output, bias))."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in(/p)] → [..., out(/p)]."""
        return self.linear(x)[0]


def megatron_tp(model: nn.Module, ranks: int) -> nn.Module:
    """`model` (the built-in GPT, same weights on every rank) with its block linears replaced by
    Megatron-Core's, tensor parallel over all `ranks` of the default group; call after
    `torch.distributed` is initialised. Initialises Megatron's model-parallel state."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.model_parallel_config import ModelParallelConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=ranks)
    rank = parallel_state.get_tensor_model_parallel_rank()
    config = ModelParallelConfig(
        tensor_model_parallel_size=ranks,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=torch.float32,
    )
    for block in model.blocks:
        for name in COLUMN + ROW:
            parent_name, attr = name.split(".")
            parent = getattr(block, parent_name)
            old: nn.Linear = getattr(parent, attr)
            column = name in COLUMN
            kind = (
                tensor_parallel.ColumnParallelLinear
                if column
                else tensor_parallel.RowParallelLinear
            )
            extra: dict[str, Any] = (
                {"gather_output": False} if column else {"input_is_parallel": True}
            )
            new = kind(
                old.in_features,
                old.out_features,
                config=config,
                init_method=nn.init.zeros_,
                bias=old.bias is not None,
                skip_bias_add=False,
                **extra,
            )
            dim = 0 if column else 1
            with torch.no_grad():
                new.weight.copy_(old.weight.chunk(ranks, dim)[rank])
                if old.bias is not None:
                    new.bias.copy_(old.bias.chunk(ranks)[rank] if column else old.bias)
            setattr(parent, attr, _OutputOnly(new))
    return model
