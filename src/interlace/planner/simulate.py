"""Simulate one training step of a plan as per-rank timelines (`interlace.timeline.Span`s).

The durations are the cost model's own terms (`step.step_terms`), so the simulation and
`cost.estimate` never disagree about how long anything takes; they differ only in how the
pieces are put together. The simulator replays the pipeline schedule op by op:

- each pipeline stage runs its forwards (F) and backwards (B) of every micro-batch (and, with
  `interleaved`, of each of its v chunks) in the schedule's order: GPipe all F then all B;
  1F1B and shifted p − s − 1 warm-up forwards, then one forward and one backward in turn;
  interleaved Megatron's order over groups of p micro-batches, chunk by chunk;
- an op starts when its stage is free and its input has arrived: the previous stage's F (or
  the next stage's B) plus one boundary transfer (`pp.send_recv`, on the sender's comm lane,
  not blocking its compute);
- a checkpointed stage recomputes its forward right before each B; under `shifted` the
  recomputation does not wait for the incoming gradient, so it fills the bubble;
- tp, cp and ep collectives extend the F and B spans by their exposed time (a "comm" span
  after the compute span); the part hidden under compute is drawn on the comm lane beside it;
- the dp gradient all-reduce (dp_cp under cp) follows the last backward, its hidden part (DDP
  buckets) drawn under the backward; the expert gradient all-reduce (`ep_dp`) follows it, then
  the optimizer step.

Every stage is given the slowest stage's durations, as the cost model assumes. Under that
assumption GPipe, 1F1B and interleaved (m a multiple of p) reproduce `estimate`'s
(m + (p − 1)/v) · T_mb exactly when transfers are free. The step times differ where the
models differ: the estimate charges all 2(v·m + p − 1) transfers serially (an upper bound)
while the simulation puts only those on the critical path, and under `shifted` the simulation
fills the bubble with whatever recomputation fits rather than exactly min(m, p − 1) of them.
One rank per pipeline stage is drawn (global rank s · dp · tp); the others of a stage are
identical.
"""

from __future__ import annotations

from dataclasses import dataclass

from interlace.errors import PlanError
from interlace.models.config import GPTConfig
from interlace.plan import Plan
from interlace.planner.hardware import Hardware
from interlace.planner.step import StepTerms, step_terms
from interlace.timeline import Span

Op = tuple[str, int, int]
"""("F" or "B", micro-batch, chunk)."""


@dataclass(frozen=True)
class Simulation:
    """A simulated step: its spans (one rank per stage), its length and the estimate's."""

    plan: Plan
    spans: list[Span]
    step_seconds: float
    estimate_seconds: float


def schedule_order(schedule: str, pp: int, stage: int, m: int, v: int = 1) -> list[Op]:
    """The order in which pipeline rank `stage` of `pp` runs its ops for `m` micro-batches
    (`v` chunks per rank under interleaved; v = 1 otherwise)."""
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule in ("1f1b", "shifted"):
        forwards = [("F", i, 0) for i in range(m)]
        backwards = [("B", i, 0) for i in range(m)]
        warmup = min(m, pp - stage - 1)
    elif schedule == "interleaved":
        group = pp if m % pp == 0 else m
        total = m * v

        def op(kind: str, k: int) -> Op:
            chunk = (k // group) % v
            mb = (k // (group * v)) * group + k % group
            return (kind, mb, chunk if kind == "F" else v - 1 - chunk)

        forwards = [op("F", k) for k in range(total)]
        backwards = [op("B", k) for k in range(total)]
        warmup = min(total, 2 * (pp - stage - 1) + (v - 1) * group)
    else:
        raise PlanError(f"schedule={schedule!r} is not one of gpipe, 1f1b, interleaved, shifted")
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [f, b]
    return order + backwards[len(forwards) - warmup :]


def simulate(
    plan: Plan,
    config: GPTConfig,
    hardware: Hardware,
    global_batch: int,
    seq_len: int | None = None,
    dtype: str = "bf16",
    expert_skew: float = 0.0,
    optimizer_state: str = "fp32",
) -> Simulation:
    """Simulate one step of `config` under `plan` on `hardware` (arguments as
    `cost.estimate`); PlanError as `step_terms` raises it."""
    terms = step_terms(
        plan, config, hardware, global_batch, seq_len, dtype, expert_skew, optimizer_state
    )
    breakdown, _ = terms.breakdown()
    spans = _pipeline_spans(terms)
    ends = {}
    for span in spans:
        ends[span.rank] = max(ends.get(span.rank, 0.0), span.end)
    for rank, end in list(ends.items()):
        ends[rank] = _gradient_spans(terms, rank, end, spans)
    return Simulation(plan, spans, max(ends.values()), sum(breakdown.values()))


def _pipeline_spans(t: StepTerms) -> list[Span]:
    plan, pp, v, m = t.plan, t.plan.pp, t.virtual_stages, t.micro_batches
    exposed = sum(t.comm.values())
    hidden = sum(t.comm_hidden.values())
    share = t.comm_forward_share
    durations = {  # (compute, exposed comm, hidden comm) of one chunk's op
        "F": (t.forward / v, exposed * share / v, hidden * share / v),
        "B": (t.backward / v, exposed * (1 - share) / v, hidden * (1 - share) / v),
    }
    recompute = t.recompute / v
    n_virtual = pp * v
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) → end
    orders = [schedule_order(plan.schedule, pp, s, m, v) for s in range(pp)]
    position, free = [0] * pp, [0.0] * pp
    spans: list[Span] = []
    rank_of = [s * plan.dp_size * plan.tp for s in range(pp)]
    while any(position[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if position[s] == len(orders[s]):
                continue
            kind, mb, chunk = orders[s][position[s]]
            vs = chunk * pp + s
            ready = _input_ready(kind, mb, vs, n_virtual, done, t.send_recv_one)
            if ready is None:
                continue
            rank, start = rank_of[s], free[s]
            if kind == "B" and recompute:
                if plan.schedule != "shifted" or pp == 1:
                    start = max(start, ready)
                spans.append(_span(rank, f"R{mb}.{chunk}", "recompute", start, recompute))
                start += recompute
            start = max(start, ready)
            compute, comm, comm_hidden = durations[kind]
            category = "forward" if kind == "F" else "backward"
            spans.append(_span(rank, f"{kind}{mb}.{chunk}", category, start, compute))
            if comm_hidden:
                spans.append(
                    _span(rank, f"{kind}{mb} tp/cp/ep (hidden)", "comm", start, comm_hidden, "comm")
                )
            end = start + compute
            if comm:
                spans.append(_span(rank, f"{kind}{mb} tp/cp/ep", "comm", end, comm, "comm"))
                end += comm
            done[(kind, mb, vs)] = end
            sends = (kind == "F" and vs < n_virtual - 1) or (kind == "B" and vs > 0)
            if sends and t.send_recv_one:
                spans.append(_span(rank, f"send {kind}{mb}", "p2p", end, t.send_recv_one, "comm"))
            free[s] = end
            position[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"simulated schedule {plan.schedule} deadlocked at {position}")
    return spans


def _input_ready(
    kind: str,
    mb: int,
    vs: int,
    n_virtual: int,
    done: dict[tuple[str, int, int], float],
    transfer: float,
) -> float | None:
    """When the input of op (kind, mb) on virtual stage `vs` is available; None if not yet."""
    if kind == "F":
        if vs == 0:
            return 0.0
        end = done.get(("F", mb, vs - 1))
        return None if end is None else end + transfer
    if vs == n_virtual - 1:
        return done.get(("F", mb, vs))
    end = done.get(("B", mb, vs + 1))
    return None if end is None else end + transfer


def _gradient_spans(t: StepTerms, rank: int, end: float, spans: list[Span]) -> float:
    """Append the data-parallel collectives of `rank` (hidden ones ending at its last backward
    at `end`, exposed ones after it), then its optimizer step; returns the rank's step end."""
    for name, seconds in t.data_hidden.items():
        if seconds:
            start = max(0.0, end - seconds)
            spans.append(_span(rank, f"{name} (hidden)", "comm", start, seconds, "comm"))
    for name, seconds in t.data.items():
        if seconds:
            spans.append(_span(rank, name, "comm", end, seconds, "comm"))
            end += seconds
    if t.optimizer:
        spans.append(_span(rank, "optimizer", "optimizer", end, t.optimizer))
        end += t.optimizer
    return end


def _span(
    rank: int, name: str, category: str, start: float, duration: float, lane: str = "compute"
) -> Span:
    return Span(rank, name, category, start, duration, lane)


__all__ = ["Simulation", "schedule_order", "simulate"]
