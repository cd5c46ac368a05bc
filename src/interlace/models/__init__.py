"""Reference models: a GPT-2 style decoder, dense or Mixture-of-Experts, and named presets."""

from interlace.models.config import GPTConfig
from interlace.models.gpt import GPT, build_model
from interlace.models.presets import PRESETS, get_preset

__all__ = ["GPT", "PRESETS", "GPTConfig", "build_model", "get_preset"]
