"""One module per parallel dimension; `interlace.parallelize` applies them in a fixed order.

Each dimension's module documents itself. Re-exported here: the tensor parallel API —
`detect` (attention, feed-forward, Mixture-of-Experts, embedding and LM head found by module
structure, no per-model name tables) and `tensor` (1D tensor parallelism: column → row per
block, vocab-parallel embedding, head and cross-entropy, optional sequence parallel; its
communication lives beside it in `tp_comm`).
"""

from interlace.parallel.detect import Structure, find_structure
from interlace.parallel.grad_norm import clip_grad_norm_, grad_norm
from interlace.parallel.tensor import (
    ShardSpec,
    apply_tensor_parallel,
    check_divisible,
    gather_full,
    shard_of,
    shard_spec,
    sharded_parameter_names,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ShardSpec",
    "Structure",
    "apply_tensor_parallel",
    "check_divisible",
    "clip_grad_norm_",
    "find_structure",
    "gather_full",
    "grad_norm",
    "shard_of",
    "shard_spec",
    "sharded_parameter_names",
    "vocab_parallel_cross_entropy",
]
