"""Sharded data parallelism (`dp_shard > 1`) on torch's FSDP2 (`fully_shard`): each block of the
model's layer list, then the model itself, has its parameters, gradients and optimizer states
split along their first dimension over `dp_shard` (HSDP: replicated over `dp_replicate` as
well, the mesh `Mesh.data_mesh`).

FSDP2 all-gathers a block's parameters before its forward (and, with `reshard_after_forward`,
again before its backward, having freed them in between), prefetching the next block's gather
under the current block's compute (on the CPU, where FSDP2's own prefetch is a CUDA stream's,
as asynchronous gathers issued a block ahead), and reduce-scatters its gradients during
backward (then all-reduces them over `dp_replicate`; on gloo through a ring of sends, the
blocks' on a background thread where FSDP2 only views the result: `ring.py`):
each rank keeps 1/dp_shard of the model's state. Under bf16 or fp16 its `MixedPrecisionPolicy`
gathers the parameters in the compute dtype and reduces gradients in `grad_reduce_dtype` (fp32
by default) onto fp32 master shards.

Micro-batches before a step's last accumulate unreduced gradients and keep the gathered
parameters (`no_sync`): one reduce-scatter per step, no gathers between micro-batches. Under a
pipeline each of this rank's stages is a root of its own, and its micro-batches' backward
passes each reduce-scatter into the sharded gradients (FSDP2 accumulates them).

Each sharded parameter is a new `nn.Parameter` holding a DTensor; the Python attributes earlier
steps attached to the old one (tensor-parallel shard specs) are carried over. A 1D tensor
parallel model shards its local pieces (2D: tensor parallel inside, FSDP outside). Expert
parallel experts are sharded over the ranks holding them instead (`expert/shard.py`), or left
whole where they cannot be (`ignored`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from interlace.comm import Group
from interlace.parallel.data.ring import RingReduceScatter
from interlace.parallel.grad_norm import NormShare
from interlace.parallel.grad_sums import sum_replaced_gradients
from interlace.plan import Plan
from interlace.precision import DTYPES


class ShardedDataParallel:
    """The model FSDP2 shards, with the data-parallel interface `Parallelized` uses (as
    `DataParallel`): `module`, `no_sync()`, `sync_gradients()` (FSDP2 reduces during
    backward; the gradients a split sums over its own group are summed after it),
    `compression` (None). `roots`: the modules sharded last (the model, or each pipeline stage
    of this rank)."""

    def __init__(self, module: nn.Module, roots: Sequence[nn.Module]) -> None:
        self.module = module
        self.roots = list(roots)
        self.compression = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within: backward accumulates full, unreduced gradients and keeps the gathered
        parameters (a step's micro-batches before its last)."""
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(True)

    def _set_sync(self, sync: bool) -> None:
        for root in self.roots:
            root.set_requires_gradient_sync(sync)
            root.set_reshard_after_backward(sync)

    def sync_gradients(self) -> None:
        """The gradients were reduce-scattered during the last backward; those a split sums
        over a group of its own (`grad_sums`) are summed there now, shard by shard."""
        sum_replaced_gradients(self.module.parameters())


def apply_fully_shard(
    model: nn.Module,
    roots: Sequence[nn.Module],
    blocks: Sequence[nn.Module],
    mesh: DeviceMesh,
    precision: str,
    reduce_dtype: str,
    reshard_after_forward: bool,
    ignored: set[nn.Parameter],
    ring: dist.ProcessGroup | None = None,
) -> ShardedDataParallel:
    """Shard each of the `blocks` inside `roots`, then each of the `roots` (`model` itself, or
    this rank's pipeline stages, parts of `model`) over `mesh` (1D: dp_shard; 2D: dp_replicate
    × dp_shard), gathering parameters in `precision`'s dtype and reducing gradients in
    `reduce_dtype` ("fp32" or "bf16"); the `ignored` parameters (experts replicated over their
    ep_dp group, placed by expert parallelism) stay as they are; experts sharded on their own
    beforehand (`expert/shard.py`) are left to their module. On the CPU the gradients travel by
    a ring of sends; with `ring` (a group of the same ranks, `overlaps_reduce_scatter`) each
    block's on a background thread while backward goes on. In place."""
    policy = precision_policy(precision, reduce_dtype)
    with attributes_kept(model):
        for root in roots:
            mine = {id(m) for m in root.modules()}
            held = [block for block in blocks if id(block) in mine]
            for block in held:
                fully_shard(
                    block,
                    mesh=mesh,
                    mp_policy=policy,
                    reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored,
                )
            if mesh.device_type == "cpu":
                _prefetch_without_streams(held)
        for root in roots:  # embeddings, final norm and head are used first and last: kept
            fully_shard(
                root,
                mesh=mesh,
                mp_policy=policy,
                reshard_after_forward=False,
                ignored_params=ignored,
            )
    if mesh.device_type == "cpu":  # gloo: a reduce-scatter half the bytes of its own
        background = RingReduceScatter(ring)  # one thread and queue for every block
        for module in [*blocks, *roots]:
            if isinstance(module, FSDPModule):  # the roots' come last: nothing to overlap
                module.set_custom_reduce_scatter(
                    RingReduceScatter() if module in roots else background
                )
    return ShardedDataParallel(model, roots)


@contextlib.contextmanager
def attributes_kept(model: nn.Module) -> Iterator[None]:
    """Set the Python attributes of `model`'s parameters (a tensor split's `ShardSpec`, the
    groups `grad_sums` sums over) again, by name, on the parameters that replace them inside
    the block (FSDP2's `fully_shard` makes new ones without them)."""
    attributes = {
        name: dict(vars(param)) for name, param in model.named_parameters() if vars(param)
    }
    yield
    for name, param in model.named_parameters():
        for key, value in attributes.get(name, {}).items():
            setattr(param, key, value)


def precision_policy(precision: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters gathered in `precision`'s dtype ("bf16", "fp16"; "fp32": as
    held), gradients reduced in `reduce_dtype`'s ("fp32" or "bf16")."""
    return MixedPrecisionPolicy(
        param_dtype=None if precision == "fp32" else DTYPES[precision],
        reduce_dtype=DTYPES[reduce_dtype],
    )


def overlaps_reduce_scatter(plan: Plan, device: torch.device, reduce_dtype: str) -> bool:
    """Whether the blocks' reduce-scatters run in the background (`ring.py`): on the CPU, where
    FSDP2 only views their output inside backward: gradients reduced in fp32 (no cast after),
    no replicas to all-reduce over (dp = 1) and no pipeline (whose micro-batches accumulate
    into the reduced gradients)."""
    return device.type == "cpu" and reduce_dtype == "fp32" and plan.dp == 1 and not plan.pipelined


def _prefetch_without_streams(blocks: Sequence[nn.Module]) -> None:
    """Prefetch where FSDP2's implicit prefetch (gathers on a second CUDA stream) does nothing,
    on the CPU: every gather of the sharded `blocks` asynchronous (gloo transfers on its own
    threads while the rank computes), the next block's gathered as a block's forward starts;
    in backward FSDP2 then prefetches the block before asynchronously itself."""
    for block, following in itertools.pairwise(blocks):
        block.set_modules_to_forward_prefetch([following])
    for block in blocks:
        block._set_unshard_async_op(True)


def sharded_norm_share(
    group: Group, replicas: int, experts: Sequence[nn.Parameter], expert_holders: int
) -> NormShare:
    """Sharded data parallelism's share of the gradient norm over `group`, every data-parallel
    rank ("dp"): a sharded piece is held by the `replicas` (dp) ranks of its replica group, a
    piece of one of the `experts` (expert parallel parameters, as sharded) by `expert_holders`
    ranks: 1 where the experts are sharded over the ranks holding them, dp · dp_shard / ep where
    each of those holds it whole. It stands for expert parallelism's share, whose group lies
    inside this one."""
    held = {id(param) for param in experts}
    return NormShare(group, lambda param: expert_holders if id(param) in held else replicas)
