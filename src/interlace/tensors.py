"""What any module needs of a tensor that may be a DTensor (a parameter sharded by FSDP2)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `tensor` (a DTensor's local shard, same storage), or `tensor`."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
