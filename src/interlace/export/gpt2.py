"""The built-in GPT as Hugging Face GPT-2 (`GPT2LMHeadModel`): its config.json and its weights.

Both are pre-LayerNorm decoders with learned positions, a GELU feed-forward and a head tied to
the token embedding; only names and layouts differ:

    wte, wpe, ln_f                    → transformer.wte, transformer.wpe, transformer.ln_f
    blocks.i.ln_1, blocks.i.ln_2      → transformer.h.i.ln_1, transformer.h.i.ln_2
    blocks.i.attn.q_proj|k_proj|v_proj → transformer.h.i.attn.c_attn   (q|k|v along the output)
    blocks.i.attn.out_proj            → transformer.h.i.attn.c_proj
    blocks.i.mlp.up, blocks.i.mlp.down → transformer.h.i.mlp.c_fc, transformer.h.i.mlp.c_proj
    lm_head (untied only)             → lm_head

GPT-2's projections are Conv1D, whose weight is [in, out]; a Linear's is [out, in]: every
projection weight is transposed. What GPT-2's config cannot express is refused
(`check_expressible`), never approximated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from interlace.errors import ExportError
from interlace.export.shape import FAMILIES, check_shape
from interlace.models.config import GPTConfig
from interlace.models.gpt import GPT

_ACTIVATIONS = {"tanh": "gelu_pytorch_tanh", "none": "gelu"}
"""GPT-2's `activation_function` computing exactly `nn.GELU(approximate=key)`."""

_PROJECTIONS = (
    ("attn.out_proj", "attn.c_proj"),
    ("mlp.up", "mlp.c_fc"),
    ("mlp.down", "mlp.c_proj"),
)
"""(built-in GPT Linear, GPT-2 Conv1D) of every block besides q|k|v."""


def check_expressible(config: GPTConfig) -> None:
    """Raise ExportError naming the first way the built-in GPT of `config` differs from every
    model GPT-2's config describes."""
    if config.is_moe:
        raise ExportError(
            f"the model has Mixture-of-Experts layers (n_experts={config.n_experts} in layers "
            f"{list(config.moe_layers)}); GPT-2 has a dense feed-forward in every block: export "
            "to hf supports dense models (n_experts=0)"
        )
    check_shape(config, FAMILIES.index("GPT-2"))
    if config.kv_heads != config.n_heads:
        raise ExportError(
            f"the model has n_kv_heads={config.kv_heads} for n_heads={config.n_heads}; GPT-2 "
            "has one key/value head per query head: export grouped-query attention in the "
            "Llama shape (rotary, rmsnorm, swiglu)"
        )
    if not config.bias:
        raise ExportError(
            "the model has no biases (bias=false); GPT-2 has a bias in every projection and "
            "LayerNorm: export to hf supports bias=true"
        )


def hf_config(model: GPT) -> dict[str, Any]:
    """The config.json of the GPT-2 equal to `model` (on any device, `meta` too; its config
    passed `check_expressible`): sizes, vocabulary = embedding rows, n_positions = seq_len, the
    GELU flavour and LayerNorm epsilon of its modules. No special tokens: the run's tokenizers
    have none."""
    config = model.config
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.wte.num_embeddings,
        "n_positions": model.wpe.num_embeddings,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.ffn_dim,
        "activation_function": _activation(model.blocks[0].mlp.act),
        "layer_norm_epsilon": model.ln_f.eps,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "initializer_range": config.init_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
    }


def _activation(act: nn.Module) -> str:
    approximate = getattr(act, "approximate", None)
    if not isinstance(act, nn.GELU) or approximate not in _ACTIVATIONS:
        raise ExportError(f"the model's feed-forward activation {act} has no GPT-2 equivalent")
    return _ACTIVATIONS[approximate]


def hf_state(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT-2's state dict from the built-in GPT's full `state` ({parameter name: tensor}, a
    tied head under `wte.weight` only): Linear weights [out, in] become Conv1D's [in, out],
    q|k|v one c_attn ([d, 3d] weight, [3d] bias). Every tensor contiguous, as safetensors
    requires (the tensors of `state` must not share memory: they do not, as read)."""
    out = {
        "transformer.wte.weight": state["wte.weight"],
        "transformer.wpe.weight": state["wpe.weight"],
        "transformer.ln_f.weight": state["ln_f.weight"],
        "transformer.ln_f.bias": state["ln_f.bias"],
    }
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            out[f"{theirs}{norm}.weight"] = state[f"{ours}{norm}.weight"]
            out[f"{theirs}{norm}.bias"] = state[f"{ours}{norm}.bias"]
        qkv = [f"{ours}attn.{p}_proj" for p in "qkv"]
        out[f"{theirs}attn.c_attn.weight"] = torch.cat([state[f"{n}.weight"] for n in qkv]).T
        out[f"{theirs}attn.c_attn.bias"] = torch.cat([state[f"{n}.bias"] for n in qkv])
        for mine, conv in _PROJECTIONS:
            out[f"{theirs}{conv}.weight"] = state[f"{ours}{mine}.weight"].T
            out[f"{theirs}{conv}.bias"] = state[f"{ours}{mine}.bias"]
    return {name: tensor.contiguous() for name, tensor in out.items()}
