"""The data pipeline: corpus → tokenizer → train/validation windows → sharded batches.

```python
text = load_corpus(None)                           # built-in corpus, or a file / directory
tok = get_tokenizer("byte", text)                  # or "bpe" (needs interlace[hf])
data = TokenData.from_text(text, tok, seq_len=256) # last 5% held out for validation
train = TrainBatches(data, global_batch_size=64, seed=0)
for x, y in train.micro_batches(step, dp_rank, dp_size, accum):  # each [64/(dp·accum), 256]
    ...
val = eval_batches(data, batch_size=16, max_batches=8, dp_rank=r, dp_size=dp)
```
A folder written by `prepare_shards` (`interlace data prepare`) is read as `ShardData(folder,
seq_len)`, which TrainBatches and eval_batches take in place of a TokenData.
Everything is on the CPU; the trainer moves batches to its device.
"""

from interlace.data.batches import Batch, TrainBatches, eval_batches, to_device
from interlace.data.corpus import BUILTIN_CORPUS, TEXT_SUFFIXES, describe_corpus, load_corpus
from interlace.data.prepare import prepare_shards
from interlace.data.shards import ShardData, ShardIndex, is_shard_folder, verify_shards
from interlace.data.tokenizer import (
    TOKENIZER_NAMES,
    BPETokenizer,
    ByteTokenizer,
    FileTokenizer,
    Tokenizer,
    default_cache_dir,
    get_tokenizer,
)
from interlace.data.tokens import TokenData

__all__ = [
    "BUILTIN_CORPUS",
    "TEXT_SUFFIXES",
    "TOKENIZER_NAMES",
    "BPETokenizer",
    "Batch",
    "ByteTokenizer",
    "FileTokenizer",
    "ShardData",
    "ShardIndex",
    "TokenData",
    "Tokenizer",
    "TrainBatches",
    "default_cache_dir",
    "describe_corpus",
    "eval_batches",
    "get_tokenizer",
    "is_shard_folder",
    "load_corpus",
    "prepare_shards",
    "to_device",
    "verify_shards",
]
