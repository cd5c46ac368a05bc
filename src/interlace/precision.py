"""Mixed precision: the dtype a run computes in, by `torch.autocast` over fp32 master weights.

Parameters, gradients and optimizer states stay fp32 in every precision; under bf16 or fp16 the
forward of every module runs inside `torch.autocast`, so matmuls (and what torch's autocast
tables list with them) compute in the low dtype and everything that flows between ranks in the
forward — tensor-parallel reductions, pipeline activations, expert tokens — carries that dtype.
The loss and softmax statistics stay fp32 (autocast's fp32 list; `interlace.loss` upcasts the
logits). fp16 also scales the loss against underflow (`grad_scaler`); bf16 has fp32's range and
needs no scaler. (AdamW's moments are the one exception, bf16 under `optimizer_state=bf16`:
`optim_lowbit`.) fp8 computes in bf16 with the blocks' linear layers multiplying in float8
(`interlace.float8`), on GPUs with float8 tensor cores only (`fp8_refusal` elsewhere).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from interlace.errors import ConfigError

PRECISIONS = ("bf16", "fp16", "fp32")
"""The precisions a run can compute in; `auto` picks bf16 on CUDA and fp32 on the CPU."""

REDUCE_DTYPES = ("fp32", "bf16")
"""The dtypes the data-parallel gradient all-reduce can send (`grad_reduce_dtype`)."""

FP8 = "fp8"
"""bf16 with float8 linear layers: a `precision` a run may name on a CUDA GPU with float8
tensor cores (`FP8_CAPABILITY`), refused before launch elsewhere (`resolve_precision`)."""

FLOAT8_RECIPES = ("tensorwise", "rowwise")
"""How fp8 scales each float8 operand of a matmul (`interlace.float8`)."""

FP8_CAPABILITY = (8, 9)
"""The CUDA compute capability from which a GPU multiplies float8 matrices (Ada, Hopper)."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    """A run's number formats, one value for every step that needs them.

    compute: the dtype the forward runs in by autocast ("bf16", "fp16", "fp32");
    float8: the scaling recipe when the blocks' linear layers multiply in float8, None when
        they do not (`interlace.float8`);
    reduce: the dtype data-parallel gradient reductions send ("fp32", "bf16").
    """

    compute: str = "fp32"
    float8: str | None = None
    reduce: str = "fp32"

    @classmethod
    def of(
        cls, name: str, float8_recipe: str = FLOAT8_RECIPES[0], reduce: str = "fp32"
    ) -> Precision:
        """A resolved precision `name` (`resolve_precision`: one of PRECISIONS or fp8) as a
        value: fp8 computes in bf16 with `float8_recipe` for the linear layers."""
        if name == FP8:
            return cls("bf16", float8_recipe, reduce)
        return cls(name, None, reduce)


FP32 = Precision()
"""fp32 everywhere: what a model computes in unless told otherwise."""


def resolve_precision(precision: str, device: torch.device) -> str:
    """`precision` ("auto" or one of PRECISIONS) for a run on `device`: auto → bf16 on CUDA,
    fp32 elsewhere. Raises ConfigError for an unknown name, and for fp8 on a device without
    float8 matmuls (`fp8_refusal`)."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if precision == FP8:
        refusal = fp8_refusal(device)
        if refusal is not None:
            raise ConfigError(refusal)
        return FP8
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is not one of auto, {', '.join(PRECISIONS)}")
    return precision


def fp8_refusal(device: torch.device) -> str | None:
    """Why a run on `device` cannot train in fp8, in one line (None where it can): the device
    is not a CUDA GPU, or one older than `FP8_CAPABILITY`."""
    need = (
        "precision=fp8 needs a CUDA GPU with float8 matmuls (compute capability "
        f"{'.'.join(map(str, FP8_CAPABILITY))} or newer: Ada, Hopper)"
    )
    if device.type != "cuda":
        return f"{need}; this run's device is the {device.type.upper()}; use bf16 or fp32"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"{need}; this {name} has {'.'.join(map(str, capability))}; use bf16"
    return None


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The context a forward runs in: torch.autocast to `precision`'s dtype on `device_type`
    ("cuda", "cpu"), or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[precision])


def autocast_in_force(device_type: str) -> contextlib.AbstractContextManager:
    """The autocast state in force now on `device_type`, as a context to enter later: a custom
    autograd Function saves it in forward and runs its backward under it (what
    `torch.amp.custom_bwd` does, for one device type fixed where the Function is defined)."""
    return torch.autocast(
        device_type,
        dtype=torch.get_autocast_dtype(device_type),
        enabled=torch.is_autocast_enabled(device_type),
    )


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a matmul with `tensor` computes in now: autocast's on its device when enabled
    (and `tensor` is floating point), else its own."""
    device_type = tensor.device.type
    if tensor.is_floating_point() and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return tensor.dtype


def forward_in_precision(module: nn.Module, precision: str, device_type: str) -> None:
    """Make every call of `module` run its forward under `autocast(precision, device_type)`
    (nothing for fp32). Its parameters keep their dtype; what callers of the module see —
    DDP, a pipeline schedule — is unchanged."""
    if precision == "fp32":
        return
    module.forward = functools.partial(_autocast_call, module.forward, precision, device_type)


def grad_scaler(precision: str, device_type: str) -> torch.amp.GradScaler | None:
    """fp16's dynamic loss scaler on `device_type` (None otherwise). With several processes it
    is torch's ShardedGradScaler over every rank: a rank whose gradient piece overflowed makes
    every rank skip the step, whatever the split (torch's plain GradScaler decides per rank)."""
    if precision != "fp16":
        return None
    if dist.is_initialized() and dist.get_world_size() > 1:
        return ShardedGradScaler(device_type, process_group=dist.group.WORLD)
    return torch.amp.GradScaler(device_type)


def scaled_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """`scaler.step(optimizer)`, then `scaler.update()`. torch's ShardedGradScaler hands a
    fused optimizer its overflow flag as a [1] tensor, which the fused step cannot subtract
    from its 0-d step counts ("output with shape [] doesn't match the broadcast shape [1]");
    a pre-hook held for this one step gives the step the flag's 0-d view."""
    hook = optimizer.register_step_pre_hook(_scalar_found_inf)
    try:
        scaler.step(optimizer)
    finally:
        hook.remove()
    scaler.update()


def reads_amp_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` reads the two 0-d tensors torch's GradScaler hands a step,
    inside its kernel: it divides every gradient by `optimizer.grad_scale` and leaves weights,
    moments and step counts as they were where `optimizer.found_inf` is 1. True for torch's
    fused optimizers (Adam, AdamW, SGD, Adagrad) with every group still fused
    (`load_state_dict` takes the groups' settings from the state it loads)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False) and all(
        group.get("fused") for group in optimizer.param_groups
    )


def _scalar_found_inf(optimizer: torch.optim.Optimizer, *_: object) -> None:
    found_inf = vars(optimizer).get("found_inf")
    if found_inf is not None and found_inf.dim():
        optimizer.found_inf = found_inf.reshape(())


def _autocast_call(forward: Callable, precision: str, device_type: str, *args, **kwargs):
    with autocast(precision, device_type):
        return forward(*args, **kwargs)
