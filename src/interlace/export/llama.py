"""The built-in GPT in Llama's shape as Hugging Face Llama (`LlamaForCausalLM`): its
config.json and its weights.

Both are pre-RMSNorm decoders with rotary positions (the same channel pairing, i with
i + head_dim/2), grouped-query attention and a SwiGLU feed-forward; only names differ, and
every weight keeps its layout ([out, in] Linears on both sides):

    wte, ln_f, lm_head                → model.embed_tokens, model.norm, lm_head
    blocks.i.ln_1, blocks.i.ln_2      → model.layers.i.input_layernorm, .post_attention_layernorm
    blocks.i.attn.{q,k,v}_proj        → model.layers.i.self_attn.{q,k,v}_proj
    blocks.i.attn.out_proj            → model.layers.i.self_attn.o_proj
    blocks.i.mlp.{gate,up,down}       → model.layers.i.mlp.{gate,up,down}_proj
"""

from __future__ import annotations

from typing import Any

import torch

from interlace.export.shape import FAMILIES, check_shape
from interlace.models.config import GPTConfig
from interlace.models.gpt import GPT

BLOCK_NAMES = {
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.out_proj": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}
"""Each block module's Llama name."""

_TOP_NAMES = {
    "wte.weight": "model.embed_tokens.weight",
    "ln_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def llama_name(name: str) -> str:
    """The Llama name of the built-in GPT's parameter `name` ("blocks.0.mlp.gate.weight" →
    "model.layers.0.mlp.gate_proj.weight")."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, layer, rest = name.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    return f"model.layers.{layer}.{BLOCK_NAMES[module]}.{leaf}"


def check_expressible(config: GPTConfig) -> None:
    """Raise ExportError naming the first way the built-in GPT of `config` (rotary) differs
    from every model Llama's config describes."""
    check_shape(config, FAMILIES.index("Llama"))


def hf_config(model: GPT) -> dict[str, Any]:
    """The config.json of the Llama equal to `model` (on any device, `meta` too; its config
    passed `check_expressible`). No special tokens: the run's tokenizers have none."""
    config = model.config
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.wte.num_embeddings,
        "max_position_embeddings": config.seq_len,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": model.ln_f.eps,
        "rope_theta": config.rope_theta,
        "attention_bias": config.bias,
        "mlp_bias": config.bias,
        "attention_dropout": config.dropout,
        "initializer_range": config.init_std,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
    }


def hf_state(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Llama's state dict from the built-in GPT's full `state` ({parameter name: tensor}, a
    tied head under `wte.weight` only): the same tensors under Llama's names, contiguous."""
    return {llama_name(name): tensor.contiguous() for name, tensor in state.items()}
