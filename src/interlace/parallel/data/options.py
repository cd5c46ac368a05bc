"""The plan rules of data parallelism without torch: its mesh dimension and its options'
checks (the bucket size, FSDP2's resharding, gradient compression)."""

from __future__ import annotations

from typing import Any

from interlace.errors import PlanError, check_plan_choice

GRAD_COMPRESSIONS = ("none", "sketch", "powersgd", "topk")
"""The data-parallel gradient all-reduce's compressing comm hooks (`interlace.compress`)."""


def mesh_dims(plan: Any) -> tuple[tuple[str, int], ...]:
    """Data parallelism's mesh dimension of `plan` (a Plan): ("dp", dp · dp_shard), every
    data-parallel rank; `interlace.mesh` splits it for sharding, and expert parallelism carves
    its groups from it."""
    return (("dp", plan.dp_size),)


def check_values(plan: Any) -> None:
    """PlanError naming the fix for a bad data-parallel option of `plan`: the bucket size,
    `reshard_after_forward` (sharded data parallelism's), `grad_compression` (a DDP comm hook:
    dp > 1, unsharded, overlapped, no pipeline)."""
    if plan.overlap.dp_bucket_mb <= 0:
        raise PlanError(f"dp_bucket_mb={plan.overlap.dp_bucket_mb} must be > 0, e.g. 25")
    if not isinstance(plan.reshard_after_forward, bool):
        raise PlanError(
            f"reshard_after_forward={plan.reshard_after_forward!r} must be true or false, "
            "e.g. reshard_after_forward=false"
        )
    if not plan.reshard_after_forward and not plan.sharded_data_parallel:
        raise PlanError(
            "reshard_after_forward=false applies to sharded data parallelism; use it with "
            "dp_shard=2 or more, or drop it"
        )
    compression = plan.grad_compression
    check_plan_choice("grad_compression", compression, GRAD_COMPRESSIONS)
    if compression == "none":
        return
    if plan.dp_size == 1:
        raise PlanError(
            f"grad_compression={compression} compresses the data-parallel "
            "gradient all-reduce and needs dp > 1"
        )
    if plan.sharded_data_parallel:
        raise PlanError(
            f"grad_compression={compression} is a DDP comm hook; sharded data "
            f"parallelism (dp_shard={plan.dp_shard}) reduce-scatters its gradients instead: "
            "use grad_compression=none, or dp_shard=1"
        )
    if not plan.overlap.dp_overlap:
        raise PlanError(
            f"grad_compression={compression} is a DDP comm hook and needs "
            "dp_overlap=true; drop dp_overlap=false"
        )
    if plan.pp > 1:
        raise PlanError(
            f"grad_compression={compression} compresses DDP's all-reduce, which a "
            "pipeline does not use; use grad_compression=none with pp > 1"
        )


def check_model(plan: Any, spec: Any) -> None:
    """Data parallelism splits no model: nothing to check."""
