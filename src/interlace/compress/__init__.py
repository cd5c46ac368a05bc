"""Gradient compression for data parallelism, as DDP communication hooks.

    state, hook = make_comm_hook("sketch", group, rows=3, width_factor=2.0)
    ddp.register_comm_hook(state, hook)

Kinds: "sketch" (the S2 Reducer: bitmap union + count-sketch all-reduce, `hook.py` and
`sketch.py`), "topk" (top-k with all-gather, `topk.py`), "dense" (the metered default
all-reduce, `interlace.comm.ddp_allreduce_hook`) and "powersgd" (torch's PowerSGD hook; it is
not metered, and on gloo in torch 2.13 it hangs with more than one DDP bucket — give DDP a
`bucket_cap_mb` larger than the model).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from interlace import comm
from interlace.compress.hook import (
    BucketStats,
    CompressionState,
    Reduction,
    SketchState,
    sketch_allreduce,
    sketch_hook,
)
from interlace.compress.topk import TopKState, topk_allgather, topk_hook
from interlace.errors import ConfigError

HOOK_KINDS = ("dense", "sketch", "topk", "powersgd")


POWERSGD_DEFAULTS = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2}
"""interlace's PowerSGD settings where the caller gives none: torch's own defaults (rank 1, plain
all-reduce for the first 1000 iterations) would not compress a short run at all."""


def make_comm_hook(kind: str, group: comm.Group, **options: Any) -> tuple[Any, Callable]:
    """(state, hook) to pass to `ddp.register_comm_hook` for gradient compression `kind`.

    `options` go to the kind's state: SketchState (rows, width_factor, seed, error_feedback,
    union, decode, recheck_every), TopKState (fraction, error_feedback), torch's PowerSGDState
    (matrix_approximation_rank, start_powerSGD_iter, ...); "dense" takes none.
    """
    if kind == "dense":
        _check_options(kind, options, ())
        return group, comm.ddp_allreduce_hook
    if kind == "sketch":
        _check_options(kind, options, _option_names(SketchState))
        return SketchState(group, **options), sketch_hook
    if kind == "topk":
        _check_options(kind, options, _option_names(TopKState))
        return TopKState(group, **options), topk_hook
    if kind == "powersgd":
        _check_options(kind, options, _option_names(powersgd.PowerSGDState))
        options = {**POWERSGD_DEFAULTS, **options}
        return powersgd.PowerSGDState(group.pg, **options), powersgd.powerSGD_hook
    raise ConfigError(f"grad compression {kind!r} is unknown; use one of {', '.join(HOOK_KINDS)}")


def _option_names(state_class: type) -> tuple[str, ...]:
    params = list(inspect.signature(state_class.__init__).parameters)
    return tuple(params[2:])  # drop self and the group / process group


def _check_options(kind: str, options: dict[str, Any], valid: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"option(s) {unknown} are not valid for grad compression {kind!r}; "
            f"valid: {', '.join(valid) or 'none'}"
        )


__all__ = [
    "HOOK_KINDS",
    "BucketStats",
    "CompressionState",
    "Reduction",
    "SketchState",
    "TopKState",
    "make_comm_hook",
    "sketch_allreduce",
    "sketch_hook",
    "topk_allgather",
    "topk_hook",
]
