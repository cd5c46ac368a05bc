"""The built-in GPT's two shapes as the export families see them: GPT-2's (learned positions,
LayerNorm, GELU) and Llama's (rotary, RMSNorm, SwiGLU), in the order of `GPTConfig`'s
`CHOICES`. One rule that both families' `check_expressible` apply."""

from __future__ import annotations

from interlace.errors import ExportError
from interlace.models.config import CHOICES, GPTConfig

FAMILIES = ("GPT-2", "Llama")
"""The family of each shape, by its index in `CHOICES`' values."""


def check_shape(config: GPTConfig, family: int) -> None:
    """Raise ExportError naming the first of `norm` and `feed_forward` of `config` (whose
    positions are `family`'s) that is not family `family`'s (0: GPT-2, 1: Llama)."""
    positions = CHOICES["position_encoding"][family]
    for name in ("norm", "feed_forward"):
        value, wanted = getattr(config, name), CHOICES[name][family]
        if value != wanted:
            raise ExportError(
                f"the model has {positions} positions but {name}={value!r}; "
                f"{FAMILIES[family]} has {name}={wanted!r}: export to hf supports the GPT-2 "
                "shape (learned positions, layernorm, gelu) or the Llama shape (rotary, "
                "rmsnorm, swiglu)"
            )
