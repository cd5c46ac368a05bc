"""A GPT-2 style decoder, dense or Mixture-of-Experts, readable top to bottom.

    idx [B, T] → wte(idx) + wpe(0..T-1) → n_layers × Block → ln_f → lm_head → logits [B, T, V]
    Block: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))    (pre-LayerNorm)

The same skeleton is Llama-shaped when its config says so: RMSNorm for LayerNorm, a SwiGLU
feed-forward (`gate`, `up`, `down`), rotary positions inside attention in place of `wpe`, and
fewer key/value heads than query heads (grouped-query attention).

The structure is what parallel code looks for: attention holds separate `q_proj`, `k_proj`,
`v_proj` (column-parallel) and `out_proj` (row-parallel) Linears and reshapes heads with
`view(B, T, -1, head_dim)`, so column-sharded q/k/v work unchanged; the FFN is an `MLP` with
`up` and `down`, or an `interlace.moe.MoELayer` whose experts are that same feed-forward,
stacked (`up_weight` [E, F, d], `down_weight` [E, d, F], their biases). The LM head
shares its weight with the token embedding.
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from interlace.errors import ConfigError
from interlace.models.config import GPTConfig
from interlace.models.mlp import MLP, SwiGLUMLP
from interlace.models.presets import get_preset
from interlace.models.rotary import rotate
from interlace.moe.experts import GroupedExperts
from interlace.moe.layer import MoELayer


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal attention of q [B, H, T, hd] to k, v [B, Hk, T, hd] → [B, H, T, hd] (SDPA;
    Hk < H: grouped-query, each key/value head serving H / Hk consecutive query heads)."""
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa
    )


def positions_in_order(length: int, device: torch.device) -> torch.Tensor:
    """The positions [length] of a sequence's tokens held in order: 0 .. length − 1."""
    return torch.arange(length, device=device)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, [B, T, d_model] → [B, T, d_model].

    `attend` (default `causal_attention`) is the attention seam: context parallelism puts its
    ring attention there, for this module only. With `rope_theta` set, queries and keys are
    rotated at `positions(T, device)` (default `positions_in_order`; context parallelism sets
    it to a rank's share's global positions, as it does the model's)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        bias: bool = True,
        dropout: float = 0.0,
        n_kv_heads: int | None = None,
        rope_theta: float | None = None,
    ):
        super().__init__()
        self.head_dim = d_model // n_heads
        kv_width = (n_kv_heads or n_heads) * self.head_dim
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, kv_width, bias=bias)
        self.v_proj = nn.Linear(d_model, kv_width, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.attn_dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)
        self.attend = causal_attention
        self.rope_theta = rope_theta
        if rope_theta is not None:
            self.positions = positions_in_order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d_model] → [B, T, d_model]; the head counts follow from the q/k/v widths."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)
        if self.rope_theta is not None:
            positions = self.positions(T, x.device)
            q, k = rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        dropout_p = self.attn_dropout if self.training else 0.0
        y = self.attend(q, k, v, dropout_p)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.out_proj(y))


def make_norm(config: GPTConfig) -> nn.Module:
    """The config's norm over d_model: LayerNorm (with a bias if `config.bias`) or RMSNorm."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=1e-5)
    return nn.LayerNorm(config.d_model, bias=config.bias)


class Block(nn.Module):
    """Pre-norm transformer block, [B, T, d_model] → [B, T, d_model]."""

    def __init__(self, config: GPTConfig, moe: bool):
        super().__init__()
        d = config.d_model
        rotary = config.position_encoding == "rotary"
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(
            d,
            config.n_heads,
            config.bias,
            config.dropout,
            config.n_kv_heads,
            config.rope_theta if rotary else None,
        )
        self.ln_2 = make_norm(config)
        if moe:
            self.mlp = MoELayer(
                d,
                config.ffn_dim,
                config.n_experts,
                config.top_k,
                config.capacity_factor,
                config.dropless,
                config.bias,
                config.dropout,
            )
        else:
            feed_forward = SwiGLUMLP if config.feed_forward == "swiglu" else MLP
            self.mlp = feed_forward(d, config.ffn_dim, config.bias, config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d_model] → [B, T, d_model]."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 language model; `forward(idx)` → logits [B, T, V]. The loss is the training loop's
    (`interlace.loss.causal_lm_loss(logits, targets, model)`).

    `aux_loss` holds the last forward's summed MoE load-balancing loss (0 for a dense model):
    every block FFN that sets an `aux_loss` attribute in its forward contributes to it, and the
    loss adds `config.aux_loss_coef` times it.

    `positions(length, device)` (default `positions_in_order`) gives the positions of the tokens
    `forward` is handed: context parallelism, which hands each rank its zig-zag share of every
    sequence, sets it to that share's global positions. A rotary model has no `wpe` (None):
    its attention modules rotate by the same positions.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        learned = config.position_encoding == "learned"
        self.wpe = nn.Embedding(config.seq_len, config.d_model) if learned else None
        self.drop = nn.Dropout(config.dropout)
        moe_layers = set(config.moe_layers)
        self.blocks = nn.ModuleList(Block(config, i in moe_layers) for i in range(config.n_layers))
        self.ln_f = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.aux_loss = torch.zeros(())
        self.positions = positions_in_order
        self.init_weights()

    def init_weights(self) -> None:
        """Tie lm_head to wte (if `tie_embeddings`) and apply GPT-2 init: N(0, init_std)
        weights, zero biases, unit norm scales, residual projections (out_proj, down)
        N(0, init_std / sqrt(2·n_layers)).

        Call it after `to_empty(device=...)` to materialise a model built on the meta device.
        """
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm | nn.RMSNorm):
                module.reset_parameters()
        for name, module in self.named_modules():
            if isinstance(module, GroupedExperts):
                module.init_gpt2_(std, residual_std)
            elif name.endswith(("out_proj", "down")):
                nn.init.normal_(module.weight, mean=0.0, std=residual_std)

    @property
    def aux_loss_coef(self) -> float:
        """Weight of `aux_loss` in the training loss."""
        return self.config.aux_loss_coef

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids idx [B, T] (T <= seq_len) → logits [B, T, vocab_size]; sets `aux_loss`."""
        length = idx.shape[1]
        if length > self.config.seq_len:
            raise ConfigError(
                f"input has T={length} tokens but the model's seq_len={self.config.seq_len}; "
                f"crop the input to at most {self.config.seq_len} tokens or build the model "
                f"with seq_len>={length}"
            )
        x = embed(self, idx, self.positions(length, idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))

        aux_losses = [b.mlp.aux_loss for b in self.blocks if hasattr(b.mlp, "aux_loss")]
        self.aux_loss = sum(aux_losses, torch.zeros((), device=logits.device))
        return logits


def embed(holder: nn.Module, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Token ids idx [B, T] at `positions` [T] → the first block's input [B, T, d_model], by
    `holder`'s `wte`, `wpe` (None: rotary positions, applied in attention) and `drop` (the
    model, or a pipeline's first stage holding them)."""
    x = holder.wte(idx)
    if holder.wpe is not None:
        x = x + holder.wpe(positions)
    return holder.drop(x)


def build_model(config: GPTConfig | str, device: torch.device | str | None = None) -> GPT:
    """Validate a config (or preset name) and build its GPT on `device`.

    `device="meta"` allocates no memory: parameters get shapes only, so paper-scale models
    can be inspected and partitioned, then materialised with `to_empty(device=...)`.
    """
    if isinstance(config, str):
        config = get_preset(config)
    config.validate()
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return GPT(config)
