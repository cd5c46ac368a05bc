"""The rules of context parallelism that a Plan checks before anything starts (no torch here, so
that `interlace.plan` can import them): its modes, the sequence split, the models it can split
and the combinations it does not run yet."""

from __future__ import annotations

from typing import Any

from interlace.errors import PlanError, check_plan_choice

CP_MODES = ("ring", "alltoall")
"""How context-parallel ranks attend: key/value blocks around a ring, or heads ↔ sequence."""


def mesh_dims(plan: Any) -> tuple[tuple[str, int], ...]:
    """Context parallelism's mesh dimension of `plan` (a Plan): ("cp", N), between the data
    and the tensor dimensions; none without it."""
    return (("cp", plan.cp),) if plan.context_parallel else ()


def check_values(plan: Any) -> None:
    """PlanError naming the fix for a bad context-parallel option of `plan`: the mode's name,
    and a mode other than the default only with cp > 1."""
    check_plan_choice("cp_mode", plan.cp_mode, CP_MODES)
    if plan.cp_mode != "ring" and not plan.context_parallel:
        raise PlanError(f"cp_mode={plan.cp_mode} applies to context parallelism; use cp > 1")


def check_divisible(seq_len: int, cp: int) -> None:
    """Refuse a sequence length that 2·cp zig-zag chunks cannot split evenly."""
    if seq_len % (2 * cp):
        raise PlanError(
            f"seq_len={seq_len} cannot be split into 2·cp = {2 * cp} equal chunks (cp={cp}); "
            f"use a sequence length divisible by {2 * cp}"
        )


def pending_with(plan: Any, tp3d: str) -> list[tuple[bool, str, str]]:
    """`plan`'s rows of the table of combinations not implemented yet (active, what, fix);
    `tp3d` names its 3D grid ("" without one)."""
    if not plan.context_parallel:
        return []
    cp = f"cp={plan.cp}"
    return [
        (bool(tp3d), f"{cp} with {tp3d}", "1D tensor parallelism (tp=N)"),
        (
            plan.expert_parallel,
            f"{cp} with expert parallelism (ep={plan.ep}, moe_balance={plan.moe_balance})",
            "ep=1 and moe_balance=none, or cp=1",
        ),
    ]


def check_model(plan: Any, spec: Any) -> None:
    """PlanError unless `plan`'s cp can split model `spec` (GPTConfig-like): 2·cp equal chunks,
    no attention dropout (neither mode has any), cp dividing a rank's heads under `alltoall`,
    no experts (their capacity would count one rank's share of the tokens); nothing without
    context parallelism."""
    if not plan.context_parallel:
        return
    check_divisible(spec.seq_len, plan.cp)
    if getattr(spec, "dropout", 0.0):
        raise PlanError(
            f"cp={plan.cp} with dropout={spec.dropout}: ring attention has no attention "
            "dropout; use a model with dropout=0, or cp=1"
        )
    heads = spec.n_heads // plan.tp
    if plan.cp_mode == "alltoall" and heads % plan.cp:
        raise PlanError(
            f"cp_mode=alltoall splits a rank's {heads} attention heads (n_heads="
            f"{spec.n_heads} / tp={plan.tp}) over cp={plan.cp}; use cp dividing {heads}, "
            "or cp_mode=ring"
        )
    kv_heads = getattr(spec, "n_kv_heads", None) or spec.n_heads
    local_kv = max(1, kv_heads // plan.tp)  # fewer kv heads than tp ranks: one each
    if plan.cp_mode == "alltoall" and local_kv % plan.cp:
        raise PlanError(
            f"cp_mode=alltoall splits a rank's {local_kv} key/value heads (n_kv_heads="
            f"{kv_heads} over tp={plan.tp}) over cp={plan.cp}; use cp dividing {local_kv}, "
            "or cp_mode=ring"
        )
    if spec.n_experts:
        raise PlanError(
            f"cp={plan.cp} with a Mixture-of-Experts model is not implemented yet (each "
            "rank's expert capacity would count its share of the tokens); use cp=1"
        )
