"""Enumerate the plans for N devices, keep the valid ones that fit in memory, rank by step time.

Candidates (AxoNN-style enumeration of powers of two, priced by `interlace.planner.cost`):

    tp · pp · dp · dp_shard = N, tp, pp and dp_shard powers of two (pp ≤ layers; dp_shard = 1
    replicated, > 1 sharded, HSDP with dp > 1), ep a power of two dividing dp · dp_shard and
    n_experts (MoE models; with tp > 1, experts whole, etp = 1, or split over tp, etp = tp);
    recompute none, selective or full; with pp > 1: micro_batches a
    power of two (or the whole per-rank batch) dividing global_batch / dp, schedule gpipe,
    1f1b, interleaved (2 or 4 virtual stages per rank) or shifted (shifted only with full
    recompute); with tp > 1:
    tp_subbatches 1 or 2 (overlapped tensor parallelism); 3D tensor
    parallelism tp3d = (x, y, z) × pp × dp (powers of two, the batch split over dp, a rank's
    micro-batches and then z; with pp > 1 the pipeline options above; grids with y > 1 with
    and without sequence parallelism over y; grids with z = 1 without it also with
    tp_subbatches 2; MoE models with ep > 1),
    priced by `interlace.planner.cost3d`; and, for dense models, context parallelism
    cp × tp × dp (cp > 1 any divisor of N / tp, both cp modes, recompute none or full: what the
    runtime composes cp with), priced by `interlace.planner.cost_context`.

Each candidate passes the Plan's own checks (values, world size, divisibility by the model's
heads/widths/vocabulary, what the pipeline schedule can run). Combinations the runtime does
not run yet (`plan_pending`) are priced anyway by default; `runnable_only=True` keeps to what
`Plan.validate` accepts today. Context
parallel plans always pass `Plan.validate` itself: the cost model prices cp only as the runtime
composes it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import replace

from interlace.divisors import divisors
from interlace.errors import PlanError
from interlace.models.config import GPTConfig
from interlace.parallel.context.options import CP_MODES
from interlace.plan import Overlap, Plan
from interlace.planner.context_choice import explain_context
from interlace.planner.cost import PlanCost, estimate
from interlace.planner.cost_moe import check_expert_skew
from interlace.planner.hardware import GIB, LOCAL, Hardware

SEARCH_SCHEDULES = ("gpipe", "1f1b", "interleaved", "shifted")
"""Pipeline schedules the search tries."""
SEARCH_VIRTUAL_STAGES = (2, 4)
"""Stages per rank the search tries with the interleaved schedule (more: a smaller bubble for
more point-to-point transfers and more layers needed)."""
SEARCH_RECOMPUTE = ("none", "selective", "full")
"""Recompute modes the search tries (with pp > 1 the shifted schedule only with full)."""
SEARCH_CONTEXT_RECOMPUTE = ("none", "full")
"""Recompute modes the search tries with context parallelism (selective runs, but its replayed
ring is not priced yet)."""
NOT_IMPLEMENTED = "not implemented yet"
"""The phrase by which `Plan.validate` marks a valid but not yet runnable plan."""


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, … up to `limit` inclusive."""
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def power_of_two_divisors(n: int, limit: int) -> list[int]:
    """The powers of two up to `limit` that divide `n` (n >= 1), ascending."""
    return [d for d in divisors(n) if d <= limit and d & (d - 1) == 0]


def check_plan(plan: Plan, n_devices: int, spec: GPTConfig, runnable_only: bool = False) -> None:
    """Raise PlanError if `plan` is not a valid plan of `spec` on `n_devices`. With
    `runnable_only`, and for every context parallel plan, this is `Plan.validate`; otherwise
    plans the runtime cannot run yet but the Plan can describe (the rows of
    `plan_pending.pending_rows`, e.g. tp3d with sequence parallelism) pass."""
    try:
        plan.validate(n_devices, spec)
        return
    except PlanError as exc:
        if runnable_only or plan.context_parallel or NOT_IMPLEMENTED not in str(exc):
            raise
    # `validate` stops at its "not implemented" check: run the checks that follow it.
    if plan.world_size != n_devices:
        raise PlanError(f"plan '{plan}' needs {plan.world_size} ranks, not {n_devices}")
    plan.check_model(spec)


def candidate_plans(n_devices: int, spec: GPTConfig, global_batch: int) -> Iterator[Plan]:
    """Every plan of the search space (see the module docstring) whose batch splits evenly;
    not yet checked against the model."""
    for tp in _tensor_degrees(n_devices, spec):
        for pp in powers_of_two(min(n_devices // tp, spec.n_layers)):
            if n_devices % (tp * pp):
                continue
            dp = n_devices // (tp * pp)
            if global_batch % dp:
                continue
            per_dp = global_batch // dp
            eps = power_of_two_divisors(spec.n_experts, dp) if spec.n_experts else [1]
            for ep, shard in itertools.product(eps, power_of_two_divisors(dp, dp)):
                for etp, pipeline in itertools.product(
                    (1, tp) if ep > 1 and tp > 1 else (1,), _pipeline_options(pp, per_dp)
                ):
                    for subbatches in (1, 2) if tp > 1 else (1,):
                        rows = per_dp // pipeline["micro_batches"]
                        if rows % subbatches:
                            continue
                        yield Plan(
                            dp=dp // shard,
                            dp_shard=shard,
                            pp=pp,
                            tp=tp,
                            ep=ep,
                            etp=etp,
                            overlap=Overlap(tp_subbatches=subbatches),
                            **pipeline,
                        )
    yield from _tp3d_plans(n_devices, spec, global_batch)
    yield from _context_plans(n_devices, spec, global_batch)


def _tensor_degrees(n_devices: int, spec: GPTConfig) -> Iterator[int]:
    """The 1D tensor parallel degrees to try: powers of two up to `n_devices` dividing the
    model's heads, width, ffn width and vocabulary (`Plan.validate` would refuse the others:
    skip the slow refusal)."""
    widths = (spec.n_heads, spec.d_model, spec.ffn_dim, spec.vocab_size)
    return (tp for tp in powers_of_two(n_devices) if not any(w % tp for w in widths))


def _context_plans(n_devices: int, spec: GPTConfig, global_batch: int) -> Iterator[Plan]:
    """Context parallel plans (cp × 1D tp × replicated dp, what the runtime composes cp with),
    for dense models: every cp > 1 dividing the devices left by tp, each cp_mode, recompute
    none or full. `check_plan` refuses what the model cannot split (seq_len into 2·cp chunks,
    its heads over cp for the all-to-all)."""
    if spec.is_moe:
        return
    for tp in _tensor_degrees(n_devices, spec):
        for cp in divisors(n_devices // tp)[1:]:
            dp = n_devices // (tp * cp)
            if global_batch % dp:
                continue
            for mode, recompute in itertools.product(CP_MODES, SEARCH_CONTEXT_RECOMPUTE):
                yield Plan(dp=dp, tp=tp, cp=cp, cp_mode=mode, recompute=recompute)


def _tp3d_plans(n_devices: int, spec: GPTConfig, global_batch: int) -> Iterator[Plan]:
    """3D tensor parallel plans (tp3d × pp × dp, what the runtime runs): every grid x·y·z ≥ 2
    of powers of two dividing the devices, alone (its data parallel ranks replicated or, FSDP2,
    sharded) or in pipelines of every power-of-two depth
    up to the layers (with the pipeline options of 1D plans); the batch split over dp, then a
    rank's micro-batches, then z; grids with y > 1 with and without the sequence split over y.
    A Mixture-of-Experts model takes every power-of-two ep > 1 dividing dp (experts whole on
    their owners)."""
    for x in powers_of_two(n_devices):
        for y in powers_of_two(n_devices // x):
            for z in powers_of_two(n_devices // (x * y)):
                size = x * y * z
                if size < 2 or n_devices % size:
                    continue
                for pp in powers_of_two(min(n_devices // size, spec.n_layers)):
                    dp = n_devices // (size * pp)
                    if n_devices % (size * pp) or global_batch % dp:
                        continue
                    per_dp = global_batch // dp
                    eps = [1]
                    if spec.is_moe:
                        eps = [e for e in power_of_two_divisors(spec.n_experts, dp) if e > 1]
                    sequence = (False, True) if y > 1 else (False,)
                    for ep, sp in itertools.product(eps, sequence):
                        yield from _grid_plans(dp, pp, (x, y, z), ep, per_dp, sp)


def _grid_plans(
    dp: int, pp: int, grid: tuple[int, int, int], ep: int, per_dp: int, sp: bool
) -> Iterator[Plan]:
    """The plans of one 3D grid with `dp` data-parallel ranks, `pp` stages and `ep`, a data
    rank's `per_dp` rows, the sequence split over y if `sp` (see `_tp3d_plans`)."""
    z = grid[2]
    if pp == 1:
        if per_dp % z:
            return
        for subbatches in _grid_subbatches(grid, sp, per_dp):
            overlap = Overlap(tp_subbatches=subbatches)
            yield Plan(dp=dp, tp3d=grid, ep=ep, sequence_parallel=sp, overlap=overlap)
        if dp > 1:  # the pieces sharded over dp (FSDP2)
            yield Plan(dp_shard=dp, tp3d=grid, ep=ep, sequence_parallel=sp)
        return
    for pipeline in _pipeline_options(pp, per_dp):
        rows = per_dp // pipeline["micro_batches"]
        if rows % z:
            continue
        for subbatches in _grid_subbatches(grid, sp, rows):
            overlap = Overlap(tp_subbatches=subbatches)
            yield Plan(
                dp=dp, pp=pp, tp3d=grid, ep=ep, sequence_parallel=sp, overlap=overlap, **pipeline
            )


def _grid_subbatches(grid: tuple[int, int, int], sp: bool, rows: int) -> tuple[int, ...]:
    """`tp_subbatches` to try on a 3D grid: 1, and 2 (overlapped x and y all-reduces) where
    the sequence is not split over y and a rank's rows of a micro-batch (`rows` / z) halve."""
    return (1, 2) if not sp and rows // grid[2] % 2 == 0 else (1,)


def _pipeline_options(pp: int, per_dp: int) -> Iterator[dict]:
    if pp == 1:
        for recompute in SEARCH_RECOMPUTE:
            yield {"micro_batches": 1, "recompute": recompute}
        return
    counts = sorted({*power_of_two_divisors(per_dp, per_dp), per_dp})
    for m in counts:
        for schedule in SEARCH_SCHEDULES:
            stage_counts = SEARCH_VIRTUAL_STAGES if schedule == "interleaved" else (0,)
            for recompute, v in itertools.product(SEARCH_RECOMPUTE, stage_counts):
                if schedule == "shifted" and recompute != "full":
                    continue  # without full's early replay its order is 1F1B's
                yield {
                    "micro_batches": m,
                    "schedule": schedule,
                    "recompute": recompute,
                    "virtual_stages": 0 if v == 2 else v,
                }


def pad_vocab(spec: GPTConfig, multiple: int) -> GPTConfig:
    """`spec` with its vocabulary rounded up to a multiple of `multiple` (the usual padding that
    lets tensor parallelism split the embedding, e.g. 50257 → 50304 for 128); unchanged when
    it already is one or `multiple` ≤ 1."""
    if multiple <= 1 or spec.vocab_size % multiple == 0:
        return spec
    return replace(spec, vocab_size=-(-spec.vocab_size // multiple) * multiple)


MEMORY_FRACTION = 0.9
"""The share of a device's memory a searched plan may fill (the rest: allocator slack)."""


def search(
    spec: GPTConfig,
    hardware: Hardware,
    n_devices: int,
    global_batch: int,
    seq_len: int | None = None,
    *,
    dtype: str = "bf16",
    runnable_only: bool = False,
    memory_fraction: float = MEMORY_FRACTION,
    vocab_multiple: int = 1,
    expert_skew: float = 0.0,
    optimizer_state: str = "fp32",
) -> list[PlanCost]:
    """Valid plans of `spec` on `n_devices` of `hardware` that fit in `memory_fraction` of
    device memory, fastest first. `vocab_multiple` > 1 prices the model with its vocabulary
    padded (`pad_vocab`) so that tp can split it; `expert_skew` is the experts' Zipf
    popularity exponent, `optimizer_state` the dtype of AdamW's moments (`cost.estimate`).
    PlanError naming the fix when none is valid or none fits."""
    check_expert_skew(expert_skew)
    spec = pad_vocab(spec, vocab_multiple)
    if not isinstance(n_devices, int) or n_devices < 1:
        raise PlanError(f"number of devices {n_devices!r} must be a positive integer, e.g. 8")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global batch {global_batch!r} must be a positive integer, e.g. 512")
    if seq_len is not None and seq_len != spec.seq_len:
        spec = replace(spec, seq_len=seq_len)
    limit = hardware.memory_bytes * memory_fraction
    valid: list[PlanCost] = []
    fitting: list[PlanCost] = []
    for plan in candidate_plans(n_devices, spec, global_batch):
        try:
            check_plan(plan, n_devices, spec, runnable_only)
        except PlanError:
            continue
        cost = estimate(
            plan,
            spec,
            hardware,
            global_batch,
            dtype=dtype,
            expert_skew=expert_skew,
            optimizer_state=optimizer_state,
        )
        valid.append(cost)
        if cost.memory_bytes_per_device <= limit:
            fitting.append(cost)
    if not valid:
        raise PlanError(
            f"no valid plan for {n_devices} devices with global batch {global_batch}: the batch "
            f"must be divisible by dp (a power of two dividing {n_devices}) and tp must divide "
            f"n_heads={spec.n_heads}; use a global batch that is a multiple of {n_devices}"
            + ("" if not runnable_only else ", or drop runnable_only")
        )
    if not fitting:
        least = min(valid, key=lambda c: c.memory_bytes_per_device)
        raise PlanError(
            f"no plan fits in memory: the smallest needs "
            f"{least.memory_bytes_per_device / GIB:.1f} GiB per device ({least.plan}) but "
            f"{hardware.name} offers {limit / GIB:.1f} GiB ({memory_fraction:.0%} of "
            f"{hardware.memory_bytes / GIB:.0f} GiB); use more devices, a smaller model or a "
            "smaller global batch"
        )
    fitting.sort(key=lambda c: (c.step_seconds, c.memory_bytes_per_device))
    return fitting


def explain(cost: PlanCost, terms: int = 3) -> str:
    """Why this plan costs what it costs: its dominant terms with their share of the step,
    what was hidden under compute, and its memory against the device's."""
    step = cost.step_seconds
    ranked = sorted(cost.breakdown.items(), key=lambda kv: -kv[1])
    parts = [f"{name} {seconds / step:.0%}" for name, seconds in ranked[:terms] if seconds > 0]
    # `local` hardware's peak is this machine's measured matmul rate, not a data sheet's
    of_peak = "of the measured matmul rate" if cost.hardware == LOCAL else "MFU"
    lines = [
        f"{cost.plan}: {step:.3g} s per step, {cost.tflops_per_device:.3g} TFLOP/s per device "
        f"({cost.mfu:.0%} {of_peak}); dominated by {', '.join(parts)}."
    ]
    comm = {k: v for k, v in cost.breakdown.items() if "." in k and k != "pp.bubble"}
    if comm:
        name, seconds = max(comm.items(), key=lambda kv: kv[1])
        lines.append(f"Largest exposed communication: {name} ({seconds:.3g} s).")
    if cost.breakdown.get("pp.bubble"):
        p, m, v = cost.plan.pp, cost.plan.micro_batches, cost.plan.stages_per_rank
        stages = f"{p} ranks of {v} stages each" if v > 1 else f"{p} stages"
        lines.append(
            f"Pipeline bubble: {stages}, {m} micro-batches, schedule {cost.plan.schedule}."
        )
    if cost.moe:
        lines.append(explain_moe(cost))
    if cost.context:
        lines.append(explain_context(cost))
    for name, seconds in sorted(cost.hidden.items()):
        if seconds > 0:
            lines.append(f"{name}: {seconds:.3g} s hidden under computation.")
    lines.append(explain_rates(cost))
    mem = cost.memory
    lines.append(
        f"Memory {cost.memory_bytes_per_device / GIB:.1f} of {cost.memory_limit_bytes / GIB:.0f}"
        f" GiB per device: {mem.get('params_grads_optimizer', 0) / GIB:.1f} GiB parameters, "
        f"gradients and optimizer state, {mem.get('activations', 0) / GIB:.1f} GiB activations "
        f"({mem.get('micro_batches_in_flight', 1):g} micro-batches in flight)."
    )
    return "\n".join(lines)


def explain_rates(cost: PlanCost) -> str:
    """One line on the figures `cost` was priced with, each with where it came from."""
    r = cost.rates
    compute, links, memory = r["compute"], r["links"], r["memory"]["bandwidth"]
    optimizer = "not priced" if math.isinf(memory) else f"{memory / 1e9:.4g} GB/s"
    shapes = ""
    if compute["shapes"]:
        shapes = f", matmul shapes {compute['shape_factor']:.1%} of it ({compute['shapes']})"
    return (
        f"Rates: compute {compute['flops'] / 1e12:.4g} TFLOP/s ({compute['of_peak']:.1%} of the "
        f"{compute['dtype']} peak; {compute['source']}{shapes}); links "
        f"{links['intra_bandwidth'] / 1e9:.4g} GB/s, {links['intra_latency'] * 1e6:.3g} µs in a "
        "node and "
        f"{links['inter_bandwidth'] / 1e9:.4g} GB/s, {links['inter_latency'] * 1e6:.3g} µs "
        f"between nodes ({links['source']}); overlap {r['overlap']['efficiency']:.0%} "
        f"({r['overlap']['source']}); optimizer memory {optimizer} ({r['memory']['source']})."
    )


def explain_moe(cost: PlanCost) -> str:
    """One line on the expert-parallel terms of `cost` (`cost.moe`): the load the skew gives
    the hottest device under the plan's moe_balance, and what `ep.all_to_all` is made of."""
    moe = cost.moe
    return (
        f"MoE (expert skew {moe['expert_skew']:g}, moe_balance={cost.plan.moe_balance}): the "
        f"hottest device computes {moe['hottest_device_load']:.2f}x the balanced load "
        f"({moe['imbalance_compute']:+.3g} s of expert compute), "
        f"{moe['replicated_experts']:g} experts replicated per layer; ep.all_to_all is "
        f"dispatch/combine {moe['dispatch_combine']:.3g} s, Trans {moe['trans']:.3g} s and Agg "
        f"{moe['agg']:.3g} s exposed."
    )
