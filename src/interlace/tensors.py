"""What any module needs of a tensor that may be a DTensor (a parameter sharded by FSDP2), and
of a module's tensors: each stored one once, all of them made real after a meta-device build."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def is_under(name: str, *prefixes: str) -> bool:
    """Whether the module or parameter name `name` is one of `prefixes` or lies inside one
    ("a.b" is under "a"; "ab" is not)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


Runs = list[list[tuple[int, int]]]
"""Per dimension of a full tensor, the [start, stop) index runs a piece holds, in order."""


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `tensor` (a DTensor's local shard, same storage), or `tensor`."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def materialise(module: nn.Module, device: torch.device) -> None:
    """Every tensor of `module`, built on the meta device, allocated uninitialised on `device`
    (a DTensor: its local shard), in place. A parameter stays the same object, so tied
    parameters stay tied, and keeps its attributes and gradient hooks (torch's `to_empty`
    swaps each parameter's contents; FSDP2 re-pads its shards itself)."""
    kept = [(p, dict(vars(p)), p._backward_hooks) for p in module.parameters()]
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    for param, attributes, hooks in kept:
        vars(param).update(attributes)
        if hooks is not None:
            param._backward_hooks = hooks  # registers them on the new contents


def state_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of `module`'s parameters and persistent buffers, each tensor once: a tied
    one under its first name in the state dict."""
    seen: set[int] = set()
    tensors = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append((name, tensor))
    return tensors
