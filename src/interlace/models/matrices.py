"""Which parameters are matrices: the one rule that weight decay (`interlace.optim`) and the
pipeline partition's FLOP count (`interlace.parallel.pipeline.partition`) share."""

from torch import nn


def matrices(module: nn.Module) -> list[nn.Parameter]:
    """`module`'s own parameters that are matrices: [out, in] weights and embedding tables, or
    [E, out, in] stacked over E experts. Not the vectors beside them (biases, norms): [out], or
    [E, out] in a module that holds stacked matrices (two dimensions, one vector per expert)."""
    own = list(module.parameters(recurse=False))
    rank = 3 if any(p.dim() >= 3 for p in own) else 2
    return [p for p in own if p.dim() >= rank]
