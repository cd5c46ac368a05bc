"""The run's tokenizer as a Hugging Face tokenizer file, where it has one.

The file is the one the run's token ids came from: the tokenizer a shard folder was prepared
with (its copy in the folder), the `tokenizer.json` given as `--tokenizer`, or, for "bpe", the
tokenizer trained on the corpus and cached (`data.tokenizer.bpe_cache_file`). It is copied as
`tokenizer.json`, beside a `tokenizer_config.json` naming the fast tokenizer class that reads
it. The byte tokenizer (UTF-8 bytes as ids) and synthetic data have no such file; nothing is
written and the returned line says so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from interlace.data.corpus import load_corpus
from interlace.data.shards import is_shard_folder
from interlace.data.tokenizer import (
    TOKENIZER_FILE,
    TOKENIZER_NAMES,
    bpe_cache_file,
    get_tokenizer,
    tokenizer_file,
)
from interlace.data.tokens import SYNTHETIC
from interlace.errors import DataError


def write_tokenizer(train: dict[str, Any], vocab_size: int, folder: Path) -> str:
    """Write the tokenizer of the run whose TrainConfig is `train` (a dict) into `folder`, if
    it has a Hugging Face one of `vocab_size` ids; returns one line telling what was done."""
    if train.get("data") == SYNTHETIC:
        return "tokenizer: none (the run trained on synthetic token ids)"
    data, name = train.get("data"), train.get("tokenizer")
    if is_shard_folder(data):
        cached = Path(data) / TOKENIZER_FILE
        if not cached.is_file():
            return f"tokenizer: none written: the shard folder '{data}' holds no tokenizer file"
    elif name not in TOKENIZER_NAMES and (given := tokenizer_file(name)) is not None:
        cached = given
    elif name != "bpe":
        return (
            "tokenizer: none written: the byte tokenizer has no Hugging Face tokenizer file; "
            "token ids are the text's UTF-8 bytes (0-255)"
        )
    else:
        try:
            cached = bpe_cache_file(load_corpus(data))
        except DataError as exc:
            return f"tokenizer: skipped: the run's corpus cannot be read to find its BPE ({exc})"
    if not cached.is_file():
        return f"tokenizer: skipped: the run's tokenizer is no longer at '{cached}'"
    ids = get_tokenizer(str(cached), "").vocab_size
    if ids > vocab_size:
        return f"tokenizer: skipped: '{cached}' has {ids} ids, the model's embedding {vocab_size}"
    shutil.copyfile(cached, folder / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return f"tokenizer: tokenizer.json, the run's, of {ids} ids"
