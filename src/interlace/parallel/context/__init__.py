"""Context parallelism: each sequence split over the cp ranks of a group, zig-zag (`zigzag`), with
causal attention computed exactly by a ring of key/value blocks (`ring`)."""

from interlace.parallel.context.ring import ring_attention
from interlace.parallel.context.zigzag import shard_sequence, unshard_sequence, zigzag_positions

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "zigzag_positions"]
