"""`cp`: what context parallelism buys and costs, cp = 1, 2, 4 (the divisors of the ranks up to
4) side by side.

- **Activations.** `sequences` sequences of `seq_len` tokens per cp group (`dp = ranks / cp`)
  trained
  through the Trainer; the activations per rank it measures at its measured step (the heaviest
  rank), against cp = 1's.
- **Longest sequence under a cap.** The memory cap is cp = 1's measured step peak (everything
  a step allocates at once, state included) at `seq_len`; for each cp the sequence doubles from
  `seq_len` while the measured step peak stays within the cap, then the gap to the first length
  that did not fit is halved twice: the longest that fitted, to a quarter of the last step.
- **Ring transfer hidden.** Ring attention alone (forward and backward) on each rank's share of
  a sequence of `tokens_per_rank` · cp tokens, timed three ways: as it runs (transfers under
  the blocks' math), its math alone (the same pairs, every transfer replaced by a local copy)
  and its transfers alone (the same passes, no math). Hidden share = (math + transfers − as
  run) / transfers, clipped to [0, 1].
- **Zig-zag balance.** The causal attention work (visible query-key pairs) of each rank's
  share, largest over smallest.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from interlace import comm
from interlace.bench.base import Benchmark, RankContext
from interlace.bench.cp_report import headline, key_numbers, plot, table
from interlace.bench.memory_report import heaviest_rank
from interlace.bench.timing import median, sample, slowest
from interlace.errors import ConfigError
from interlace.mesh import build_mesh
from interlace.models.presets import get_preset
from interlace.parallel.context import ring as ring_module
from interlace.parallel.context.ring import ring_attention
from interlace.parallel.context.zigzag import zigzag_positions
from interlace.plan import Plan
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig


def degrees(ranks: int) -> list[int]:
    """The cp degrees compared on `ranks` ranks: 1, 2 and 4 where they divide it."""
    return [cp for cp in (1, 2, 4) if ranks % cp == 0]


def _config(options: dict[str, Any], seq_len: int, groups: int) -> TrainConfig:
    return TrainConfig(
        model=options["model"],
        seq_len=seq_len,
        global_batch=groups * options["sequences"],
        steps=3,  # warm-up, DDP's bucket rebuild, the measured step
        measure_memory=True,
        out=None,
        progress=False,
        eval_every=0,
        warmup_steps=1,
    )


def _measured(ctx: RankContext, cp: int, seq_len: int) -> dict[str, Any]:
    """`sequences` sequences per cp group at `seq_len` trained 3 steps; the heaviest rank's
    measured memory (collective)."""
    ranks = ctx.group.size
    plan = Plan(dp=ranks // cp, cp=cp)
    setup = prepare_run(_config(ctx.options, seq_len, ranks // cp), plan, ranks)
    trainer = Trainer(setup, build_mesh(plan))
    trainer.fit()
    return heaviest_rank_with_peak(trainer.memory)


def heaviest_rank_with_peak(memory: dict[str, Any]) -> dict[str, Any]:
    """The heaviest rank's parts (`memory_report.heaviest_rank`) and the largest step peak."""
    return {
        **heaviest_rank(memory),
        "step_peak": max(rank["step_peak"] for rank in memory["per_rank"]),
    }


def _longest(ctx: RankContext, cp: int, cap: float, start: dict[str, Any]) -> dict[str, Any]:
    """The longest sequence whose measured step peak at `cp` stays within `cap` bytes: doubling
    from `seq_len` (whose run is `start`), then two halvings of the gap to the first length
    that did not fit (lengths multiples of 8, at most `max_seq_len`); every length tried."""
    tried = [{"seq_len": ctx.options["seq_len"], "step_peak": start["step_peak"]}]

    def fits(length: int) -> bool:
        if all(t["seq_len"] != length for t in tried):
            tried.append({"seq_len": length, **_peak(ctx, cp, length)})
        return next(t for t in tried if t["seq_len"] == length)["step_peak"] <= cap

    good, bad = ctx.options["seq_len"], None
    if not fits(good):
        return {"longest": 0, "tried": tried}
    while bad is None and 2 * good <= ctx.options["max_seq_len"]:
        good, bad = (2 * good, None) if fits(2 * good) else (good, 2 * good)
    for _ in range(2 if bad is not None else 0):
        middle = (good + bad) // 2 // 8 * 8
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return {"longest": good, "tried": sorted(tried, key=lambda t: t["seq_len"])}


def _peak(ctx: RankContext, cp: int, seq_len: int) -> dict[str, int]:
    return {"step_peak": _measured(ctx, cp, seq_len)["step_peak"]}


def _qkv(ctx: RankContext, cp: int) -> tuple[torch.Tensor, ...]:
    """q, k, v [1, heads, tokens_per_rank, head_dim] of this rank, and a gradient for the out."""
    o = ctx.options
    shape = (1, o["heads"], o["tokens_per_rank"], o["head_dim"])
    generator = torch.Generator().manual_seed(ctx.group.rank)
    q, k, v, grad = (torch.randn(shape, generator=generator) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def _ring_times(ctx: RankContext, cp: int) -> dict[str, float]:
    """Seconds per forward and backward of ring attention at `cp`: as run, math alone,
    transfers alone (slowest rank, median of samples; collective)."""
    plan = Plan(dp=ctx.group.size // cp, cp=cp)
    group = build_mesh(plan).group("cp")
    q, k, v, grad = _qkv(ctx, cp)

    def attention() -> None:
        ring_attention(q, k, v, group).backward(grad)

    def transfers() -> None:
        block = torch.stack([k.detach(), v.detach()])
        for _ in range(2 * (cp - 1)):  # forward's passes and backward's
            _, works = comm.ring_pass(block, group, 1)
            for work in works:
                work.wait()
        for _ in range(cp):  # the gradients' passes home
            _, works = comm.ring_pass(block, group, 2)
            for work in works:
                work.wait()

    def local(tensor: torch.Tensor, group: comm.Group, tag: int = 0, meter=None):
        return tensor.clone(), []

    as_run = median(sample(attention, ctx.group))
    transfer = median(sample(transfers, ctx.group))
    real_pass = ring_module.comm.ring_pass
    ring_module.comm.ring_pass = local
    try:
        math = median(sample(attention, ctx.group))
    finally:
        ring_module.comm.ring_pass = real_pass
    hidden = (math + transfer - as_run) / transfer if transfer > 0 else 1.0
    return {
        "as_run_s": as_run,
        "math_s": math,
        "transfer_s": transfer,
        "hidden": min(1.0, max(0.0, hidden)),
    }


def work_balance(seq_len: int, cp: int) -> float:
    """Largest over smallest causal attention work (query-key pairs seen) of the cp ranks'
    zig-zag shares of a `seq_len`-token sequence."""
    work = [float((zigzag_positions(seq_len, cp, r) + 1).sum()) for r in range(cp)]
    return max(work) / min(work)


def run_rank(ctx: RankContext) -> dict[str, Any]:
    """Every measurement for every cp degree (collective)."""
    options, ranks = ctx.options, ctx.group.size
    cps = degrees(ranks)
    if len(cps) < 2:
        raise ConfigError("bench cp compares cp = 1, 2, 4: use --ranks 2 or 4")
    start = time.perf_counter()
    base = {cp: _measured(ctx, cp, options["seq_len"]) for cp in cps}
    cap = base[1]["step_peak"]
    longest = {cp: _longest(ctx, cp, cap, base[cp]) for cp in cps}
    ring = {cp: _ring_times(ctx, cp) for cp in cps if cp > 1}
    return {
        "ranks": ranks,
        "seq_len": options["seq_len"],
        "cap_bytes": cap,
        "degrees": {
            str(cp): {
                "memory": base[cp],
                "longest": longest[cp],
                "ring": ring.get(cp),
                "work_balance": work_balance(options["seq_len"], cp),
            }
            for cp in cps
        },
        "seconds": slowest(time.perf_counter() - start, ctx.group),
    }


def check(options: dict[str, Any]) -> None:
    """A known dense model without dropout; sequence lengths that 2·4 chunks split."""
    model = get_preset(options["model"])
    if model.n_experts or model.dropout:
        raise ConfigError(f"model={options['model']}: bench cp needs a dense model, dropout 0")
    for key in ("seq_len", "max_seq_len", "tokens_per_rank"):
        if options[key] < 8 or options[key] % 8:
            raise ConfigError(f"{key}={options[key]} must be a positive multiple of 8")
    if options["max_seq_len"] < options["seq_len"]:
        raise ConfigError(
            f"max_seq_len={options['max_seq_len']} must be at least seq_len={options['seq_len']}"
        )
    if min(options["heads"], options["head_dim"], options["sequences"]) < 1:
        raise ConfigError(
            f"heads={options['heads']}, head_dim={options['head_dim']}, sequences="
            f"{options['sequences']}: use >= 1"
        )
    dataclasses.replace(model, seq_len=options["max_seq_len"]).validate()


BENCHMARK = Benchmark(
    name="cp",
    summary="context parallelism: activations, longest sequence under a cap, ring hidden",
    describe=(
        "Context parallelism at cp = 1, 2, 4 (the divisors of the ranks up to 4; the other "
        "ranks data-parallel). Activations per rank: `sequences` sequences of `seq_len` tokens "
        "per cp group trained through the Trainer, its own measurement of the third step (the "
        "heaviest rank); the limit is 1/cp of cp = 1's. Longest sequence: the cap is cp = 1's "
        "measured step peak at `seq_len`; for each cp the sequence doubles while the measured "
        "step peak stays within it, then the gap to the first length that did not fit is "
        "halved twice; the limit is cp times cp = 1's (less what grows with the length beside "
        "the activations: the position table and its optimizer state). Ring transfer hidden: ring "
        "attention (forward and backward) on `tokens_per_rank` tokens per rank, as run, its "
        "math alone (transfers replaced by local copies) and its transfers alone; hidden share "
        "= (math + transfers - as run) / transfers, 1 when every transfer is under the math. "
        "Zig-zag balance: the largest over the smallest rank's causal attention work."
    ),
    table=table,
    plot=plot,
    run_rank=run_rank,
    check=check,
    headline=headline,
    key_numbers=key_numbers,
    default_ranks=4,
    options={
        "model": "tiny",
        "seq_len": 2048,
        "max_seq_len": 16384,
        "sequences": 4,
        "tokens_per_rank": 4096,
        "heads": 4,
        "head_dim": 16,
    },
    option_help={
        "model": "dense preset trained (no dropout)",
        "seq_len": "tokens per sequence of the activation runs and the search's start "
        "(a multiple of 8)",
        "max_seq_len": "longest sequence the search tries (a multiple of 8)",
        "sequences": "sequences per cp group per step",
        "tokens_per_rank": "tokens per rank of the ring-attention timing (a multiple of 8)",
        "heads": "attention heads of the ring-attention timing",
        "head_dim": "width of a head in the ring-attention timing",
    },
)
