"""The run's tokenizer as a Hugging Face tokenizer file, where it has one.

A "bpe" run's tokenizer was trained on its corpus and cached (`data.tokenizer.bpe_cache_file`):
that `tokenizers` JSON is copied as `tokenizer.json`, beside a `tokenizer_config.json` naming
the fast tokenizer class that reads it. The byte tokenizer (UTF-8 bytes as ids) and synthetic
data have no such file; nothing is written and the returned line says so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from interlace.data.corpus import load_corpus
from interlace.data.tokenizer import bpe_cache_file
from interlace.data.tokens import SYNTHETIC
from interlace.errors import DataError


def write_tokenizer(train: dict[str, Any], vocab_size: int, folder: Path) -> str:
    """Write the tokenizer of the run whose TrainConfig is `train` (a dict) into `folder`, if
    it has a Hugging Face one of `vocab_size` ids; returns one line telling what was done."""
    if train.get("data") == SYNTHETIC:
        return "tokenizer: none (the run trained on synthetic token ids)"
    if train.get("tokenizer") != "bpe":
        return (
            "tokenizer: none written: the byte tokenizer has no Hugging Face tokenizer file; "
            "token ids are the text's UTF-8 bytes (0-255)"
        )
    try:
        cached = bpe_cache_file(load_corpus(train.get("data")))
    except DataError as exc:
        return f"tokenizer: skipped: the run's corpus cannot be read to find its BPE ({exc})"
    if not cached.is_file():
        return f"tokenizer: skipped: the run's BPE is no longer cached at '{cached}'"
    vocab = json.loads(cached.read_text())["model"]["vocab"]
    if len(vocab) != vocab_size:
        return (
            f"tokenizer: skipped: the cached BPE '{cached}' has {len(vocab)} ids, the model "
            f"{vocab_size}"
        )
    shutil.copyfile(cached, folder / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return f"tokenizer: tokenizer.json, the run's BPE of {vocab_size} ids"
