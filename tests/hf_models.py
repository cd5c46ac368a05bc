"""Shared by the tests that build Hugging Face models from configs (offline, optional extra)."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import transformers

    transformers.logging.set_verbosity_error()
except ImportError:  # the hf extra is optional
    transformers = None

needs_hf = pytest.mark.skipif(transformers is None, reason="needs the hf extra (transformers)")


def tiny_hf_model(kind: str, d: int, layers: int, vocab: int, positions: int, **sizes):
    """A seeded tiny Hugging Face causal LM built from a config (no download), dropout off:
    kind "gpt2" (4 heads, tied head) or "llama" (4 heads; `kv_heads` (2) grouped-query kv
    heads, `ffn` (128) intermediate width). Keep `vocab` apart from every ffn width: the
    structure detector finds the LM head by its shape."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_embd=d, n_layer=layers, n_head=4, vocab_size=vocab, n_positions=positions,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        hidden_size=d, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=sizes.get("kv_heads", 2), intermediate_size=sizes.get("ffn", 128),
        vocab_size=vocab, max_position_embeddings=positions,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)
