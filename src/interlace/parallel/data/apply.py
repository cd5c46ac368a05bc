"""`apply_data_parallel`: the last step of `parallelize`, averaging gradients over "dp".

With `plan.overlap.dp_overlap` (the default) and a model whose backward can carry the reduction,
the module is wrapped in torch's `DistributedDataParallel` with the plan's comm hook (metered
dense all-reduce, or the `grad_compression` hook). Otherwise (`dp_overlap=false`, a pipeline,
whose schedules run several backward passes per step, or 3D tensor parallelism, whose Z
reduce-scatters of weight gradients finish after backward) the weights are broadcast from the
group's first rank once and `sync_gradients` all-reduces every gradient as one flat buffer after
the step's last backward: the no-overlap baseline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from interlace import comm
from interlace.comm import Group
from interlace.compress import make_comm_hook
from interlace.errors import ConfigError
from interlace.plan import Plan
from interlace.precision import DTYPES, REDUCE_DTYPES

SINGLE_BUCKET_MB = 1e6
"""DDP bucket size (MiB) that holds any model whole: torch's PowerSGD hook hangs on gloo with
more than one bucket (torch 2.13)."""


class DataParallel:
    """The module a data-parallel rank runs, and the reduction of its gradients.

    `module`: the DDP wrapper (or the module itself without overlap); `no_sync()`: the context
    for micro-batches before the last; `sync_gradients()`: the reduction after the last
    (nothing under DDP); `compression`: the compressing hook's state (with `summary()`) or None.
    """

    def __init__(
        self,
        module: nn.Module,
        plan: Plan,
        group: Group,
        skip: Iterable[str],
        reduce_dtype: str = "fp32",
    ) -> None:
        check_reduce_dtype(plan, reduce_dtype)
        self.wire_dtype = DTYPES[reduce_dtype]
        self.group = group
        self.skip = set(skip)
        self.compression = None
        self.local = module
        self.ddp: DistributedDataParallel | None = None
        if group.size == 1:
            self.module = module
            return
        if not plan.dp_overlapped:
            for name, param in module.named_parameters():
                if name not in self.skip:
                    comm.broadcast(param.data, 0, group)
            self.module = module
            return
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, sorted(self.skip)
        )
        kind = plan.grad_compression
        state, hook = make_comm_hook("dense" if kind == "none" else kind, group)
        bucket_mb = SINGLE_BUCKET_MB if kind == "powersgd" else plan.overlap.dp_bucket_mb
        self.ddp = DistributedDataParallel(
            module, process_group=group.pg, bucket_cap_mb=bucket_mb, device_ids=None
        )
        if reduce_dtype != "fp32":
            hook = comm.ddp_hook_in(self.wire_dtype, hook)
        self.ddp.register_comm_hook(state, hook)
        self.compression = state if hasattr(state, "summary") else None
        self.module = self.ddp

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip DDP's reduction in this backward (gradients accumulate locally)."""
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    def sync_gradients(self) -> None:
        """Average the gradients over the group as one flat all-reduce (parameters named in
        `skip` excepted); nothing when DDP reduced them during backward."""
        if self.ddp is not None or self.group.size == 1:
            return
        grads = [
            p.grad
            for name, p in self.local.named_parameters()
            if p.grad is not None and name not in self.skip
        ]
        comm.all_reduce_flat_(grads, self.group, self.group.size, self.wire_dtype)


def apply_data_parallel(
    module: nn.Module,
    plan: Plan,
    group: Group,
    skip: Iterable[str] = (),
    reduce_dtype: str = "fp32",
) -> DataParallel:
    """Average `module`'s gradients over `group` ("dp"), except the parameters named in `skip`
    (experts, reduced over their own replicas), sending them as `reduce_dtype` ("fp32", or
    "bf16": half the bytes, the average rounded to bf16). See the module docstring for the
    two ways."""
    return DataParallel(module, plan, group, skip, reduce_dtype)


def check_reduce_dtype(plan: Plan, reduce_dtype: str) -> None:
    """ConfigError for an unknown `reduce_dtype`, or bf16 with a compressing hook (each
    compression chooses its own wire format)."""
    if reduce_dtype not in REDUCE_DTYPES:
        raise ConfigError(
            f"grad_reduce_dtype={reduce_dtype!r} is not one of {', '.join(REDUCE_DTYPES)}"
        )
    if reduce_dtype != "fp32" and plan.grad_compression != "none":
        raise ConfigError(
            f"grad_reduce_dtype={reduce_dtype} applies to the dense all-reduce; "
            f"grad_compression={plan.grad_compression} sends its own format: use one of them"
        )
