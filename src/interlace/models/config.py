"""GPTConfig: the shape of a built-in GPT, dense or Mixture-of-Experts.

One frozen dataclass describes every reference model. `validate()` rejects bad values with a
message naming the value, the reason and a valid alternative; `num_params()` counts parameters
analytically (tied embeddings once) and matches the built model exactly, so planners can size
models that are never built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from interlace.divisors import divisors
from interlace.errors import ConfigError
from interlace.finite import check_finite_fields


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT-2 style decoder; `n_experts > 0` turns some FFNs into MoE layers.

    Layer i has an MoE FFN iff `n_experts > 0` and `i % moe_every == moe_every - 1`:
    `moe_every=1` makes every FFN MoE, `moe_every=2` the odd-indexed layers 1, 3, 5, ...

    Four fields make a Llama-shaped decoder of the same skeleton: `norm="rmsnorm"`,
    `feed_forward="swiglu"` (gate, up and down matrices of ffn_dim), `position_encoding=
    "rotary"` (no position table; `rope_theta` its base) and `n_kv_heads` < n_heads
    (grouped-query attention: each key/value head serves n_heads / n_kv_heads query heads).
    """

    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int | None = None
    dropout: float = 0.0
    bias: bool = True
    init_std: float = 0.02
    n_experts: int = 0
    top_k: int = 1
    moe_every: int = 2
    capacity_factor: float = 1.25
    dropless: bool = False
    aux_loss_coef: float = 0.01
    tie_embeddings: bool = True
    n_kv_heads: int | None = None
    norm: str = "layernorm"
    feed_forward: str = "gelu"
    position_encoding: str = "learned"
    rope_theta: float = 10000.0

    @property
    def ffn_dim(self) -> int:
        """Hidden width of each FFN (and of each expert): `d_ff`, or 4·d_model when unset."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def is_moe(self) -> bool:
        """True when the model has Mixture-of-Experts layers."""
        return self.n_experts > 0

    @property
    def head_dim(self) -> int:
        """Width of one attention head: d_model / n_heads."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `n_kv_heads`, or n_heads when unset (multi-head attention)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose FFN is an MoE layer (empty for a dense model)."""
        if not self.is_moe:
            return ()
        return tuple(i for i in range(self.n_layers) if i % self.moe_every == self.moe_every - 1)

    def validate(self) -> None:
        """Raise ConfigError naming the first bad value, why it is bad and what would be valid."""
        check_finite_fields(self, ConfigError)
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            _require_positive_int(name, getattr(self, name))
        if self.d_ff is not None:
            _require_positive_int("d_ff", self.d_ff)
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; use "
                f"d_model={_nearest_multiple(self.d_model, self.n_heads)} or "
                f"n_heads={_nearest_divisor(self.d_model, self.n_heads)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout} must be in [0, 1); use e.g. dropout=0.1")
        if not self.init_std > 0:
            raise ConfigError(f"init_std={self.init_std} must be > 0; use e.g. init_std=0.02")
        self._validate_llama_shape()
        self._validate_moe()

    def _validate_llama_shape(self) -> None:
        for name, valid in CHOICES.items():
            if getattr(self, name) not in valid:
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} is not known; use one of {', '.join(valid)}"
                )
        if self.n_kv_heads is not None:
            _require_positive_int("n_kv_heads", self.n_kv_heads)
            if self.n_heads % self.n_kv_heads:
                raise ConfigError(
                    f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                    f"use n_kv_heads in {divisors(self.n_heads)}"
                )
        if self.position_encoding == "rotary":
            if self.head_dim % 2:
                raise ConfigError(
                    f"rotary positions need an even head width; d_model / n_heads = "
                    f"{self.head_dim}; use n_heads giving an even d_model / n_heads"
                )
            if not self.rope_theta > 1:
                raise ConfigError(f"rope_theta={self.rope_theta} must be > 1; use e.g. 10000")
        if self.feed_forward == "swiglu" and self.n_experts:
            raise ConfigError(
                f"feed_forward='swiglu' with n_experts={self.n_experts}: the experts are GELU "
                "feed-forwards; use feed_forward='gelu' for a Mixture-of-Experts model"
            )

    def _validate_moe(self) -> None:
        if not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ConfigError(
                f"n_experts={self.n_experts!r} must be an integer >= 0 (0 = dense); "
                "use e.g. n_experts=8"
            )
        if self.top_k not in (1, 2):
            raise ConfigError(
                f"top_k={self.top_k!r} is not supported; use top_k=1 (Switch) or 2 (GShard)"
            )
        if not self.is_moe:
            return
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"top_k={self.top_k} exceeds n_experts={self.n_experts}; "
                f"use top_k=1 or n_experts>={self.top_k}"
            )
        _require_positive_int("moe_every", self.moe_every)
        if self.moe_every > self.n_layers:
            raise ConfigError(
                f"moe_every={self.moe_every} with n_layers={self.n_layers} gives no MoE layer; "
                f"use moe_every<={self.n_layers}"
            )
        if not self.dropless and not self.capacity_factor > 0:
            raise ConfigError(
                f"capacity_factor={self.capacity_factor} must be > 0; use e.g. "
                "capacity_factor=1.25, or dropless=True for no capacity limit"
            )
        if not self.aux_loss_coef >= 0:
            raise ConfigError(
                f"aux_loss_coef={self.aux_loss_coef} must be >= 0; use e.g. aux_loss_coef=0.01"
            )

    def num_params(self) -> int:
        """Number of distinct parameters of the built model (a tied LM head counted once)."""
        d, f = self.d_model, self.ffn_dim
        kv = self.kv_heads * self.head_dim
        has_bias = int(self.bias)
        layer_norm = d * (1 + has_bias * (self.norm == "layernorm"))
        attention = 2 * d * d + 2 * d * kv + (2 * d + 2 * kv) * has_bias
        gated = self.feed_forward == "swiglu"
        mlp = (3 if gated else 2) * d * f + ((2 if gated else 1) * f + d) * has_bias
        moe = d * self.n_experts + self.n_experts * mlp
        n_moe = len(self.moe_layers)
        blocks = self.n_layers * (2 * layer_norm + attention) + n_moe * moe
        blocks += (self.n_layers - n_moe) * mlp
        positions = self.seq_len if self.position_encoding == "learned" else 0
        embeddings = (self.vocab_size * (1 if self.tie_embeddings else 2) + positions) * d
        return embeddings + blocks + layer_norm

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields, suitable for `json.dumps`; the Llama-shape fields only
        where they differ from GPT-2's (so a GPT-2-shaped config reads as it did before they
        existed, and its checkpoints still resume)."""
        data = dataclasses.asdict(self)
        for name in LLAMA_SHAPE_FIELDS:
            if data[name] == _DEFAULTS[name]:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GPTConfig:
        """Build and validate a config from `to_dict()` output; unknown or missing keys raise."""
        fields = dataclasses.fields(cls)
        known = {f.name for f in fields}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown GPTConfig field(s) {unknown}; "
                f"valid fields are: {', '.join(sorted(known))}"
            )
        required = {f.name for f in fields if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ConfigError(f"GPTConfig is missing required field(s) {missing}")
        config = cls(**data)
        config.validate()
        return config


CHOICES: dict[str, tuple[str, ...]] = {
    "norm": ("layernorm", "rmsnorm"),
    "feed_forward": ("gelu", "swiglu"),
    "position_encoding": ("learned", "rotary"),
}
"""The valid values of GPTConfig's string fields: GPT-2's first, Llama's second."""


LLAMA_SHAPE_FIELDS = ("n_kv_heads", "norm", "feed_forward", "position_encoding", "rope_theta")
"""The fields that make a Llama-shaped decoder; `to_dict` leaves them out at their defaults."""

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPTConfig)}


def _require_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer; use e.g. {name}=64")


def _nearest_multiple(value: int, step: int) -> int:
    """The multiple of `step` nearest to `value` (at least `step`)."""
    return max(step, round(value / step) * step)


def _nearest_divisor(value: int, target: int) -> int:
    """The divisor of `value` nearest to `target` (the smaller one on a tie)."""
    fits = divisors(value)
    return min(fits, key=lambda k: (abs(k - target), k))
