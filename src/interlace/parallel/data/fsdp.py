"""Sharded data parallelism (`dp_shard > 1`) on torch's FSDP2 (`fully_shard`): each block of the
model's layer list, then the model itself, has its parameters, gradients and optimizer states
split along their first dimension over `dp_shard` (HSDP: replicated over `dp_replicate` as
well, the mesh `Mesh.data_mesh`).

FSDP2 all-gathers a block's parameters before its forward (and, with `reshard_after_forward`,
again before its backward, having freed them in between), prefetching the next block's gather
under the current block's compute, and reduce-scatters its gradients during backward (then
all-reduces them over `dp_replicate`): each rank keeps 1/dp_shard of the model's state. Under
bf16 or fp16 its `MixedPrecisionPolicy` gathers the parameters in the compute dtype and
reduces gradients in `grad_reduce_dtype` (fp32 by default) onto fp32 master shards.

Micro-batches before a step's last accumulate unreduced gradients and keep the gathered
parameters (`no_sync`): one reduce-scatter per step, no gathers between micro-batches.

Each sharded parameter is a new `nn.Parameter` holding a DTensor; the Python attributes earlier
steps attached to the old one (tensor-parallel shard specs) are carried over. A 1D tensor
parallel model shards its local pieces (2D: tensor parallel inside, FSDP outside).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from interlace.comm import Group
from interlace.parallel.grad_norm import NormShare
from interlace.precision import DTYPES


class ShardedDataParallel:
    """The model FSDP2 shards, with the data-parallel interface `Parallelized` uses (as
    `DataParallel`): `module`, `no_sync()`, `sync_gradients()` (nothing: FSDP2 reduces during
    backward), `compression` (None)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.compression = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within: backward accumulates full, unreduced gradients and keeps the gathered
        parameters (a step's micro-batches before its last)."""
        self.module.set_requires_gradient_sync(False)
        self.module.set_reshard_after_backward(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
            self.module.set_reshard_after_backward(True)

    def sync_gradients(self) -> None:
        """Nothing: the gradients were reduce-scattered during the last backward."""


def apply_fully_shard(
    model: nn.Module,
    layers: str,
    mesh: DeviceMesh,
    precision: str,
    reduce_dtype: str,
    reshard_after_forward: bool,
) -> ShardedDataParallel:
    """Shard every block of `model`'s layer list `layers`, then the rest of `model`, over `mesh`
    (1D: dp_shard; 2D: dp_replicate × dp_shard), gathering parameters in `precision`'s dtype
    and reducing gradients in `reduce_dtype` ("fp32" or "bf16"). In place."""
    attributes = {
        name: dict(vars(param)) for name, param in model.named_parameters() if vars(param)
    }
    policy = MixedPrecisionPolicy(
        param_dtype=None if precision == "fp32" else DTYPES[precision],
        reduce_dtype=DTYPES[reduce_dtype],
    )
    for block in model.get_submodule(layers):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # the root's parameters (embeddings, final norm, head) are used first and last: kept
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for name, param in model.named_parameters():
        for key, value in attributes.get(name, {}).items():
            setattr(param, key, value)
    return ShardedDataParallel(model)


def sharded_norm_share(group: Group) -> NormShare:
    """Sharded data parallelism's share of the gradient norm: every gradient is split over
    `group` ("dp_shard"), each rank holding its own piece."""
    return NormShare(group, lambda param: 1)
