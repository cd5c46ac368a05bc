"""The plan rules of 1D tensor parallelism without torch: its mesh dimension, its options'
checks (sequence parallelism, overlapped sub-batches) and what the model must divide."""

from __future__ import annotations

from typing import Any

from interlace.divisors import check_divides, divisors
from interlace.errors import PlanError


def mesh_dims(plan: Any) -> tuple[tuple[str, int], ...]:
    """1D tensor parallelism's mesh dimension of `plan` (a Plan): ("tp", N), the innermost, so
    that consecutive ranks (one node) share a group; none under a 3D grid, which takes its place
    (`tensor3d.options.mesh_dims`)."""
    return (("tp", plan.tp),) if plan.tp3d is None else ()


def check_values(plan: Any) -> None:
    """PlanError naming the fix for a bad option of 1D tensor parallelism in `plan`:
    `tp_subbatches` (overlapped all-reduces, 1D tp > 1 or a 3D grid, without sequence
    parallelism), `tp_block_boundary` (with sub-batches), `sequence_parallel` (tp > 1; a 3D
    grid's own rule is `tensor3d.options.check_values`)."""
    overlap = plan.overlap
    if overlap.tp_subbatches < 1:
        raise PlanError(f"tp_subbatches={overlap.tp_subbatches} must be >= 1 (1 = off)")
    if not isinstance(overlap.tp_block_boundary, bool):
        raise PlanError(
            f"tp_block_boundary={overlap.tp_block_boundary!r} must be true or false, "
            "e.g. tp_block_boundary=false"
        )
    if not overlap.tp_block_boundary and overlap.tp_subbatches < 2:
        raise PlanError(
            "tp_block_boundary=false applies to overlapped tensor parallelism; use it with "
            "tp_subbatches=2 or more, or drop it"
        )
    if overlap.tp_subbatches > 1 and (plan.tp_size == 1 or plan.sequence_parallel):
        raise PlanError(
            f"tp_subbatches={overlap.tp_subbatches} overlaps tensor parallel all-reduces: it "
            "needs tp > 1 (or a tp3d grid of more than one rank) and no sequence_parallel"
        )
    if plan.tp3d is not None:
        return
    if plan.sequence_parallel and plan.tp == 1:
        raise PlanError("sequence_parallel=true needs 1D tensor parallelism (tp > 1)")


def defers_block_boundary(plan: Any) -> bool:
    """Whether each sub-batched layer's last forward all-reduce of `plan` (a Plan) runs under
    the next layer's first compute: `tp_block_boundary`, except under FSDP2 (`dp_shard > 1`),
    which reshards a layer's weights when its forward returns, while the parked reduction's
    thread still has the layer's bias add and residual to run on them."""
    return plan.overlap.tp_block_boundary and not plan.sharded_data_parallel


def check_model(plan: Any, spec: Any) -> None:
    """PlanError unless tp divides model `spec` (GPTConfig-like)'s heads, width, feed-forward
    and vocabulary, and the sequence under sequence parallelism; sub-batches need a layer
    without an MoE layer (those run whole: sub-batches would change their routing)."""
    tp = plan.tp  # 1 under tp3d, whose grid tensor3d checks
    check_divides(
        tp,
        "tensor parallel degree",
        [
            ("n_heads", spec.n_heads),
            ("d_model", spec.d_model),
            ("ffn_dim", spec.ffn_dim),
            ("vocab_size", spec.vocab_size),
        ],
    )
    kv_heads = getattr(spec, "kv_heads", spec.n_heads)
    if not kv_heads_split(kv_heads, tp):
        raise PlanError(
            f"n_kv_heads={kv_heads} is not divisible by the tensor parallel degree tp={tp}, "
            f"nor tp by it; use tp in {kv_degrees(spec.n_heads, kv_heads)}"
        )
    if plan.sequence_parallel and spec.seq_len % tp:
        raise PlanError(
            f"seq_len={spec.seq_len} is not divisible by tp={tp}, as sequence_parallel "
            f"needs; use a seq_len that is a multiple of {tp}"
        )
    if plan.overlap.tp_subbatches > 1 and spec.n_experts and not _dense_layers(spec):
        raise PlanError(
            f"tp_subbatches={plan.overlap.tp_subbatches} sub-batches the layers without a "
            "Mixture-of-Experts layer (an MoE layer routes the whole batch), and every layer "
            "of this model has one; use tp_subbatches=1"
        )


def _dense_layers(spec: Any) -> int:
    """Layers of model `spec` (GPTConfig-like) without an MoE feed-forward."""
    return spec.n_layers - len(getattr(spec, "moe_layers", range(spec.n_layers)))


def kv_heads_split(kv_heads: int, tp: int) -> bool:
    """Whether `tp` ranks can hold `kv_heads` key/value heads: each its share (tp divides
    them) or each one head held by tp / kv_heads ranks (they divide tp)."""
    return kv_heads % tp == 0 or tp % kv_heads == 0


def kv_degrees(n_heads: int, kv_heads: int) -> list[int]:
    """The tensor degrees dividing `n_heads` that can hold `kv_heads` (`kv_heads_split`)."""
    return [k for k in divisors(n_heads) if kv_heads_split(kv_heads, k)]
