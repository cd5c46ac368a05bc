"""Named model configurations: tiny ones for tests and CPU runs, paper-scale ones for planning.

Paper-scale presets reproduce published shapes (GPT-2, Megatron-LM, GPT-NeoX, GPT-3) or, where
a paper gives only a size, a standard shape of that size; `num_params()` of each is within a
few percent of the size in its name. They are meant to be built on the `meta` device.
"""

import json
from dataclasses import replace
from pathlib import Path

from interlace.errors import ConfigError
from interlace.models import hf
from interlace.models.config import GPTConfig

_TINY = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4)
_DEMO = GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_layers=4, n_heads=4)
_GPT2_124M = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12)
_LLAMA = dict(
    norm="rmsnorm",
    feed_forward="swiglu",
    position_encoding="rotary",
    bias=False,
    tie_embeddings=False,
)
_LLAMA3_8B = GPTConfig(
    vocab_size=128256,
    seq_len=8192,
    d_model=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    d_ff=14336,
    rope_theta=500000.0,
    **_LLAMA,
)

PRESETS: dict[str, GPTConfig] = {
    # Dense.
    "tiny": _TINY,
    "demo": _DEMO,
    # Byte-level, sized so a data-parallel step is balanced between compute and a 1 Gbit/s
    # gradient all-reduce on a CPU: the `ddp` benchmark's default.
    "bench-25m": GPTConfig(vocab_size=256, seq_len=128, d_model=512, n_layers=8, n_heads=8),
    "gpt2-124m": _GPT2_124M,
    "gpt2-350m": replace(_GPT2_124M, d_model=1024, n_layers=24, n_heads=16),
    "gpt2-1.5b": replace(_GPT2_124M, d_model=1600, n_layers=48, n_heads=25),
    # Megatron-LM (Shoeybi et al. 2019) table 1 shapes, vocabulary padded to 51200.
    "megatron-2.5b": GPTConfig(
        vocab_size=51200, seq_len=1024, d_model=1920, n_layers=54, n_heads=20
    ),
    "megatron-8.3b": GPTConfig(
        vocab_size=51200, seq_len=1024, d_model=3072, n_layers=72, n_heads=32
    ),
    # GPT-NeoX-20B shape (with a tied LM head).
    "gpt-20b": GPTConfig(vocab_size=50432, seq_len=2048, d_model=6144, n_layers=44, n_heads=64),
    # AxoNN's 80B GPT: 12·L·d² ≈ 80.5B for L=64, d=10240, plus 0.5B embeddings.
    "axonn-80b": GPTConfig(vocab_size=51200, seq_len=2048, d_model=10240, n_layers=64, n_heads=80),
    "gpt3-175b": GPTConfig(vocab_size=50257, seq_len=2048, d_model=12288, n_layers=96, n_heads=96),
    # Llama-shaped (RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases,
    # an untied head): a tiny one for tests and Llama 3 8B / 70B's shapes (Dubey et al. 2024,
    # table 3; rope base 500000, vocabulary 128256) at an 8192-token context; "llama3-8b-cut"
    # keeps 8 of the 8B's 32 layers, which fits one 80 GB GPU with fp32 AdamW state.
    "llama-tiny": replace(_TINY, **_LLAMA, n_kv_heads=2, d_ff=176),
    "llama3-8b": _LLAMA3_8B,
    "llama3-8b-cut": replace(_LLAMA3_8B, n_layers=8),
    "llama3-70b": replace(_LLAMA3_8B, d_model=8192, n_layers=80, n_heads=64, d_ff=28672),
    # Mixture-of-Experts.
    "moe-tiny": replace(_TINY, n_experts=4, top_k=2, moe_every=2),
    "moe-demo": replace(_DEMO, n_experts=8, top_k=1, moe_every=2),
    # Pro-Prophet's MoE-GPT: 12 layers, hidden 1024, 16 experts, every FFN an MoE layer.
    "moe-gpt-12l": GPTConfig(
        vocab_size=50257,
        seq_len=1024,
        d_model=1024,
        n_layers=12,
        n_heads=16,
        n_experts=16,
        top_k=1,
        moe_every=1,
    ),
    # Switch-Base-128 decoder: GPT-2 base width, 128 experts on every other FFN.
    "switch-base-like": GPTConfig(
        vocab_size=32128,
        seq_len=512,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_experts=128,
        top_k=1,
        moe_every=2,
    ),
}


def get_preset(name: str) -> GPTConfig:
    """The GPTConfig registered as `name`, read from `name` if it is a `.json` file of
    GPTConfig fields, or the shape of the Hugging Face model `name` = "hf:PATH" (`hf.shape_of`,
    what the planner prices); ConfigError naming the valid presets otherwise."""
    folder = hf.hf_folder(name)
    if folder is not None:
        return hf.shape_of(hf.load_config(folder), None)
    if name.endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"model config file '{name}' does not exist")
        try:
            return GPTConfig.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model config file '{name}' is not valid JSON: {exc}") from None
    if name not in PRESETS:
        raise ConfigError(
            f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)} "
            "(or a .json file of GPTConfig fields, or hf:PATH)"
        )
    return PRESETS[name]
