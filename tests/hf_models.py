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
    heads, `ffn` (128) intermediate width); the Mixture-of-Experts kinds "mixtral" (Llama's
    attention; every layer's MLP a sparse block of `experts` (4) SwiGLU experts of width
    `ffn` (96), top-`top_k` (2) routed, no router jitter) and "qwen2_moe" (the same, plus a
    sigmoid-gated shared expert of width `shared_ffn` (128); q, k, v with biases). Keep
    `vocab` apart from every ffn width: the structure detector finds the LM head by its
    shape."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_embd=d, n_layer=layers, n_head=4, vocab_size=vocab, n_positions=positions,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    common = dict(
        hidden_size=d, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=sizes.get("kv_heads", 2), vocab_size=vocab,
        max_position_embeddings=positions, attention_dropout=0.0,
    )  # fmt: skip
    experts = dict(num_experts_per_tok=sizes.get("top_k", 2), output_router_logits=False)
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            **common, **experts, intermediate_size=sizes.get("ffn", 96),
            num_local_experts=sizes.get("experts", 4), router_jitter_noise=0.0,
        )  # fmt: skip
        return transformers.MixtralForCausalLM(config)
    if kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **common, **experts, moe_intermediate_size=sizes.get("ffn", 96),
            num_experts=sizes.get("experts", 4), decoder_sparse_step=1, mlp_only_layers=[],
            shared_expert_intermediate_size=sizes.get("shared_ffn", 128),
        )  # fmt: skip
        return transformers.Qwen2MoeForCausalLM(config)
    config = transformers.LlamaConfig(**common, intermediate_size=sizes.get("ffn", 128))
    return transformers.LlamaForCausalLM(config)


def saved_tiny_model(
    kind: str,
    folder,
    vocab: int = 320,
    max_shard_size: int | str = "50GB",
    dtype: torch.dtype = torch.float32,
    **sizes,
) -> str:
    """`hf:folder` of a tiny `kind` model (d 32, 2 layers, 32 positions) saved there with its
    weights moved off their initialisation, so a model built from the config alone (with a
    run's seed) would differ. `vocab` (320) exceeds the byte tokenizer's 256 ids; a
    `max_shard_size` below the model's bytes saves several files and their index; `dtype`: the
    files' (the model is saved converted to it); `sizes` as `tiny_hf_model`'s."""
    model = tiny_hf_model(kind, 32, 2, vocab, positions=32, **sizes)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.to(dtype).save_pretrained(folder, max_shard_size=max_shard_size)
    return f"hf:{folder}"
