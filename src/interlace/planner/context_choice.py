"""Why a plan splits its sequences: what context parallelism saves in memory (`explain_context`)
and why a search's fastest plan uses it (`context_choice`): the memory its layout would need
with whole sequences, and whether any plan without cp fits (and how much slower the fastest
such plan is)."""

from __future__ import annotations

from interlace.planner.cost import PlanCost
from interlace.planner.hardware import GIB


def explain_context(cost: PlanCost) -> str:
    """One line on a context parallel plan's memory (`cost.context`): the tokens a device keeps
    of each sequence, GiB per device, and GiB the same layout would need with whole
    sequences (cp = 1) against the device's memory."""
    return f"Context parallelism {_mode(cost)}: {_memory(cost)}"


def context_choice(ranked: list[PlanCost]) -> str | None:
    """Why the fastest of a search's `ranked` plans (those that fit, fastest first) splits its
    sequences: its memory against the same layout's with whole sequences, then that no plan
    without context parallelism fits, or the fastest one that does and its step seconds;
    None when the fastest plan has cp = 1."""
    best = ranked[0]
    if not best.plan.context_parallel:
        return None
    without = next((c for c in ranked if not c.plan.context_parallel), None)
    if without is None:
        other = "No plan without context parallelism fits in memory."
    else:
        other = (
            f"The fastest plan without context parallelism that fits, {without.plan}, takes "
            f"{without.step_seconds:.3g} s per step ({without.step_seconds / best.step_seconds:.2f}"
            "x as long)."
        )
    return f"Why {_mode(best)}: {_memory(best)} {other}"


def _mode(cost: PlanCost) -> str:
    return f"cp={cost.plan.cp} ({cost.plan.cp_mode})"


def _memory(cost: PlanCost) -> str:
    whole = cost.context["memory_without_cp"]
    verdict = "within" if whole <= cost.memory_limit_bytes else "over"
    return (
        f"a device keeps {cost.context['tokens_per_sequence']:.0f} of each sequence's "
        f"{cost.seq_len} tokens, {cost.memory_bytes_per_device / GIB:.3g} GiB per device; with "
        f"whole sequences (cp=1) this layout needs {whole / GIB:.3g} GiB, {verdict} the "
        f"device's {cost.memory_limit_bytes / GIB:.3g} GiB."
    )
