"""A Hugging Face causal language model as a run's model: `--model hf:PATH`.

PATH is a local folder holding the model's `config.json` and, optionally, its weights as
safetensors (one file or shards with their index). The model is built by `transformers`
(`AutoModelForCausalLM`) and split by `parallelize` by its structure, as the built-in GPT is,
in one of two ways:

- a folder with weights, in a run on several ranks: built from the config on the meta device
  (`build_from_config`), split there, then each rank allocates only the tensors it keeps and
  reads only their pieces from the files (`interlace.parallel.pieces`, reading through
  `models/hf_weights.py`), so a rank never holds more than its share;
- any other (no weights: initialised from the config with the run's seed, identically on every
  rank; files transformers converts otherwise than by renaming and fusing experts; one
  process): built whole on every rank (`build`), then split, as the built-in GPT always is.

Two adaptations and no more: the model's forward returns its logits [B, T, V] (a forward hook
unwraps Hugging Face's output object), which is what the Trainer's loss reads, and the key/value
cache is off (training never decodes). Parameter names stay the model's own, so checkpoints and
exports speak Hugging Face's names.

The planner, the memory estimate and the FLOP count see the model through `shape_of`: the
built-in GPT of the same width, depth, heads, vocabulary and parameters per layer (Llama's
family in its Llama shape).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from interlace.errors import ConfigError
from interlace.models.config import GPTConfig

HF_PREFIX = "hf:"
"""How `--model` names a Hugging Face model folder: hf:PATH."""

DEFAULT_SEQ_LEN = 1024
"""Tokens per sequence when neither --seq-len nor a shorter model context says otherwise."""


def hf_folder(model: str) -> Path | None:
    """The folder of `model` = "hf:PATH", None for any other model name."""
    return Path(model[len(HF_PREFIX) :]).expanduser() if model.startswith(HF_PREFIX) else None


def load_config(folder: Path) -> Any:
    """The `transformers` config of the causal LM in `folder`. Raises ConfigError for a folder
    without config.json, without the hf extra, or whose architecture is no causal LM."""
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"model hf:{folder}: no config.json there; give a folder saved by "
            "save_pretrained (config.json, weights optional)"
        )
    transformers = _import_transformers()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never look online
    config = transformers.AutoConfig.from_pretrained(folder)
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(
            f"model hf:{folder}: model_type {config.model_type!r} has no causal LM in "
            "transformers; interlace trains causal language models"
        )
    return config


def has_weights(folder: Path) -> bool:
    """Whether `folder` holds safetensors weights (one file or an indexed set of shards)."""
    return any(folder.glob("*.safetensors"))


def shape_of(config: Any, seq_len: int | None) -> GPTConfig:
    """The built-in GPT the planner, memory estimate and FLOP count take for `config`'s model:
    its width, depth, query and key/value heads, vocabulary and context (`seq_len`, else the
    model's context up to DEFAULT_SEQ_LEN), its experts; every family but GPT-2 in the
    built-in GPT's Llama shape (gated feed-forward, RMSNorm, rotary positions), except that
    experts stay GELU ones of the width giving the same parameters (three matrices, two)."""
    context = _first(config, "max_position_embeddings", "n_positions") or DEFAULT_SEQ_LEN
    d_model = _first(config, "hidden_size", "n_embd")
    ffn = _first(config, "moe_intermediate_size", "intermediate_size", "n_inner") or 4 * d_model
    gated = config.model_type != "gpt2"
    experts = _first(config, "num_local_experts", "num_experts") or 0
    llama = {"norm": "rmsnorm", "position_encoding": "rotary"}
    if not experts:
        llama["feed_forward"] = "swiglu"
    return GPTConfig(
        vocab_size=config.vocab_size,
        seq_len=seq_len or min(context, DEFAULT_SEQ_LEN),
        d_model=d_model,
        n_layers=_first(config, "num_hidden_layers", "n_layer"),
        n_heads=_first(config, "num_attention_heads", "n_head"),
        n_kv_heads=_first(config, "num_key_value_heads"),
        d_ff=ffn * 3 // 2 if gated and experts else ffn,
        bias=config.model_type == "gpt2",
        n_experts=experts,
        top_k=min(_first(config, "num_experts_per_tok") or 1, 2) if experts else 1,
        moe_every=1,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        **(llama if gated else {}),
    )


def build(folder: Path, config: Any, device: torch.device) -> nn.Module:
    """The model of `folder` on `device` in fp32, returning logits: its weights where the
    folder has them, else initialised from `config` (seed the RNG first for equal ranks)."""
    if not has_weights(folder):
        return build_from_config(config).to(device)
    config.use_cache = False
    auto = _import_transformers().AutoModelForCausalLM
    return _for_training(auto.from_pretrained(folder, config=config)).to(device)


def build_from_config(config: Any) -> nn.Module:
    """`config`'s model, initialised by its own rule from the RNG (on the default device: a
    `with torch.device("meta")` builds shapes only), in fp32, returning logits."""
    config.use_cache = False
    return _for_training(_import_transformers().AutoModelForCausalLM.from_config(config))


def _for_training(model: nn.Module) -> nn.Module:
    """`model` in fp32, its forward returning the logits alone."""
    model.register_forward_hook(_logits_only)
    return model.float()


def identity(config: Any) -> dict[str, Any]:
    """What a checkpoint records of the model `config` describes: its config as JSON reads it
    back (keys as strings), without where it was loaded from and which transformers wrote it."""
    fields = json.loads(config.to_json_string(use_diff=False))
    for volatile in ("_name_or_path", "transformers_version", "use_cache", "dtype", "torch_dtype"):
        fields.pop(volatile, None)
    return {"hf": fields}


def config_from_identity(fields: dict[str, Any]) -> Any:
    """The transformers config a checkpoint's `identity` recorded (its "hf" fields)."""
    fields = dict(fields)
    return _import_transformers().AutoConfig.for_model(fields.pop("model_type"), **fields)


def _logits_only(module: nn.Module, args: tuple, output: Any) -> torch.Tensor:
    return output.logits


def _first(config: Any, *names: str) -> Any:
    """The value of the first of `names` that `config` has (not None), else None."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            "hf: models need the transformers package: pip install 'interlace[hf]'"
        ) from exc
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # the run draws its own
    return transformers
