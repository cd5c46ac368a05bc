"""`tp`: a forward + backward step of the built-in GPT under 1D tensor parallelism over all ranks:
interlace's plain TP, interlace's overlapped TP (`tp_subbatches`), and torch's DTensor TP.

Per step (the slowest rank's time): step time of each mode; compute time, the same per-rank
work with no communication (the plain TP model split for p ranks but reducing over a one-rank
group); communication time, the collectives one plain TP step issues (recorded by a meter)
replayed alone; hidden fraction (compute + comm − step) / min(compute, comm). Bytes: what the
comm meter counted (interlace's modes) and what left the network interface (all modes).

DTensor TP is torch's `parallelize_module` with ColwiseParallel on q/k/v/up and
RowwiseParallel on out_proj/down (the attention reshapes with view(B, T, -1, head_dim), so
sharded q/k/v need no head-count patch); its embedding and LM head stay replicated, and each
of q, k, v all-reduces its own input gradient. Megatron-Core's ColumnParallelLinear /
RowParallelLinear run as a peer when the `peers` extra is installed (`tp_megatron.py`); without
it the mode is skipped with the reason printed and recorded.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from interlace import comm
from interlace.bench.base import (
    GPT_OPTION_HELP,
    Benchmark,
    RankContext,
    gpt_config,
    mode_step_times,
    plot_modes_against_limits,
)
from interlace.bench.timing import median, sample, slowest
from interlace.bench.tp_megatron import megatron_tp, unavailable
from interlace.comm import Group
from interlace.errors import ConfigError
from interlace.loss import CrossEntropy, cross_entropy
from interlace.models.gpt import build_model
from interlace.parallel.detect import find_structure
from interlace.parallel.tensor.apply import apply_tensor_parallel, check_divisible
from interlace.parallel.tensor.layers import vocab_parallel_cross_entropy
from interlace.parallel.tensor.overlap import apply_tp_overlap
from interlace.planner.calibrate import hidden_fraction

_METER = comm.CommMeter()


class _RecordingMeter(comm.CommMeter):
    """A meter that also keeps every call's (op, payload bytes), in order."""

    def reset(self) -> None:
        super().reset()
        self.calls: list[tuple[str, int]] = []

    def record(self, op: str, group: Group, payload: int, seconds: float | None = None) -> None:
        super().record(op, group, payload, seconds)
        self.calls.append((op, payload))


def _model(options: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    return build_model(gpt_config(options))


def _interlace_tp(
    options: dict[str, Any], group: Group, subbatches: int, block_boundary: bool = True
) -> nn.Module:
    model = _model(options)
    structure = find_structure(model)
    check_divisible(structure, group.size)
    apply_tensor_parallel(model, structure, group)
    apply_tp_overlap(model, structure, subbatches, block_boundary=block_boundary)
    return model


def _dtensor_tp(options: dict[str, Any], ranks: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _model(options)
    mesh = init_device_mesh("cpu", (ranks,))
    layout: dict[str, Any] = {}
    for i in range(options["layers"]):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.up"):
            layout[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.out_proj", "mlp.down"):
            layout[f"blocks.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, layout)


def _batch(options: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(
        0, options["vocab"], (options["batch"], options["seq_len"] + 1), generator=g
    )
    return tokens[:, :-1], tokens[:, 1:]


def _stepper(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    losses: list[float],
    scores: CrossEntropy = cross_entropy,
):
    """One training step's forward and backward of `model` on `batch` = (x, y), its logits
    scored by `scores` (interlace's split head: the vocabulary-parallel cross-entropy)."""
    x, y = batch

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss = scores(model(x), y)
        loss.backward()
        losses.append(loss.item())

    return step


def _split_vocab_loss(group: Group) -> CrossEntropy:
    """The loss of interlace's 1D tensor-parallel GPT, whose head gives this rank's vocabulary."""
    return lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, group)


def _measure(
    ctx: RankContext,
    model: nn.Module,
    batch,
    metered: bool,
    scores: CrossEntropy = cross_entropy,
) -> dict[str, Any]:
    group, steps = ctx.group, ctx.options["steps"]
    losses: list[float] = []
    step = _stepper(model, batch, losses, scores)
    step_s = sample(step, group, min_samples=steps, min_seconds=0)
    forward_s = sample(lambda: model(batch[0]), group, min_samples=steps, min_seconds=0)
    dist.barrier(group=group.pg)
    comm.meter.reset()
    sent = ctx.tx_bytes()
    step()
    tx = slowest(float(ctx.tx_bytes() - sent), group)
    out: dict[str, Any] = {
        "step_s": step_s,
        "step_median_s": median(step_s),
        "forward_median_s": median(forward_s),
        "tx_bytes": tx,
        "loss": losses[-1],
    }
    if metered:
        reduced = comm.meter.snapshot().get("tp", {}).get("all_reduce", {})
        out["meter_all_reduce_calls"] = reduced.get("calls", 0)
        out["meter_all_reduce_bytes"] = reduced.get("bytes", 0)
    return out


def _replay(calls: list[tuple[str, int]], group: Group) -> None:
    buffers = [(op, torch.zeros(nbytes // 4)) for op, nbytes in calls]

    def run() -> None:
        for op, buffer in buffers:
            if op == "all_reduce":
                comm.all_reduce(buffer, group, meter=_METER)
            else:  # only all_reduce occurs in plain (non sequence parallel) TP of the GPT
                raise RuntimeError(f"unexpected collective {op} in a plain TP step")

    return run


def run_rank(ctx: RankContext) -> dict[str, Any]:
    """Compute alone, communication alone, then the step of each mode."""
    group, options = ctx.group, ctx.options
    p, k = group.size, options["subbatches"]
    tp = Group("tp", group.pg, p, group.rank)
    batch = _batch(options)
    # compute alone: the same shards, reductions over a one-rank group (a local copy)
    solo_pg, _ = dist.new_subgroups(group_size=1)
    solo = Group("tp", solo_pg, p, group.rank)
    compute: dict[str, float] = {}
    for name, sub in (("plain", 1), ("overlapped", k)):
        local = _interlace_tp(options, solo, sub)
        step = _stepper(local, batch, [], _split_vocab_loss(solo))
        compute[name] = median(sample(step, group, min_samples=options["steps"], min_seconds=0))
        forward = sample(lambda m=local: m(batch[0]), group, min_samples=options["steps"])
        compute[f"{name}_forward"] = median(forward)
        del local
    # communication alone: the collectives of one plain TP step, replayed back to back
    plain = _interlace_tp(options, tp, 1)
    recorder, saved = _RecordingMeter(), comm.meter
    comm.meter = recorder
    try:
        _stepper(plain, batch, [], _split_vocab_loss(tp))()
    finally:
        comm.meter = saved
    replay = _replay(recorder.calls, tp)
    comm_s = median(sample(replay, group, min_samples=options["steps"], min_seconds=0))
    modes = {"plain_tp": _measure(ctx, plain, batch, True, _split_vocab_loss(tp))}
    del plain
    for boundary, suffix in ((True, ""), (False, "_in_block")):
        overlapped = _interlace_tp(options, tp, k, block_boundary=boundary)
        modes[f"overlapped_tp_k{k}{suffix}"] = _measure(
            ctx, overlapped, batch, True, _split_vocab_loss(tp)
        )
        del overlapped
    modes["dtensor_tp"] = _measure(ctx, _dtensor_tp(options, p), batch, metered=False)
    skipped = {}
    reason = unavailable()
    if reason is None:
        peer = megatron_tp(_model(options), p)
        modes["megatron_core_tp"] = _measure(ctx, peer, batch, metered=False)
    else:
        print(f"tp bench: {reason}", flush=True)
        skipped["megatron_core"] = reason
    for name, mode in modes.items():
        own = compute["overlapped"] if name.startswith("overlapped") else compute["plain"]
        mode["hidden_fraction"] = hidden_fraction(own, comm_s, mode["step_median_s"])
        mode["hidden_fraction_vs_plain_compute"] = hidden_fraction(
            compute["plain"], comm_s, mode["step_median_s"]
        )
    return {
        "params": sum(t.numel() for t in _model(options).parameters()),
        "compute_s": compute["plain"],
        "compute_subbatched_s": compute["overlapped"],
        "compute_forward_s": compute["plain_forward"],
        "compute_subbatched_forward_s": compute["overlapped_forward"],
        "comm_s": comm_s,
        "comm_calls": len(recorder.calls),
        "comm_bytes": sum(n for _, n in recorder.calls),
        "modes": modes,
        "peers_skipped": skipped,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def table(doc: dict[str, Any]) -> str:
    """One row per mode, after the compute / communication reference line."""
    r = doc["result"]
    lines = [
        f"GPT {r['params'] / 1e6:.1f} M params; per-rank compute alone {r['compute_s']:.3f} s "
        f"(in sub-batches {r['compute_subbatched_s']:.3f} s; forward "
        f"{r['compute_forward_s']:.3f} s), TP collectives alone "
        f"{r['comm_s']:.3f} s ({r['comm_calls']} all-reduces, {r['comm_bytes'] / 1e6:.1f} MB)",
        f"{'mode':26s} {'step s':>7s} {'fwd s':>6s} {'hidden':>7s} {'meter MB':>9s} {'calls':>6s} "
        f"{'iface tx MB':>11s} {'loss':>8s}",
    ]
    for name, m in r["modes"].items():
        meter_mb = m.get("meter_all_reduce_bytes")
        lines.append(
            f"{name:26s} {m['step_median_s']:7.3f} {m['forward_median_s']:6.3f} "
            f"{m['hidden_fraction']:7.2f} "
            f"{'-' if meter_mb is None else f'{meter_mb / 1e6:.1f}':>9s} "
            f"{m.get('meter_all_reduce_calls', '-')!s:>6s} {m['tx_bytes'] / 1e6:11.1f} "
            f"{m['loss']:8.4f}"
        )
    lines += r["peers_skipped"].values()
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Step time per mode against compute alone, communication alone, their sum and max."""
    env = doc["environment"]
    plot_modes_against_limits(
        doc["result"],
        path,
        ylabel="seconds per forward + backward",
        title=f"1D TP step, {env['ranks']} ranks, {env['network']}",
    )


def check(options: dict[str, Any]) -> None:
    """Positive sizes, heads dividing d_model, at least 2 sub-batches that fit the batch."""
    sizes = ("vocab", "seq_len", "d_model", "layers", "heads", "batch", "steps")
    if any(options[s] < 1 for s in sizes):
        raise ConfigError(f"{', '.join(sizes)} must all be >= 1")
    if options["d_model"] % options["heads"]:
        raise ConfigError(f"heads={options['heads']} must divide d_model={options['d_model']}")
    if not 2 <= options["subbatches"] <= options["batch"]:
        raise ConfigError(
            f"subbatches={options['subbatches']} must be between 2 and batch={options['batch']}"
        )


def headline(doc: dict[str, Any]) -> str:
    """Overlapped vs plain TP step and hidden fraction, with DTensor TP beside them."""
    modes = doc["result"]["modes"]
    plain, dtensor = modes["plain_tp"], modes["dtensor_tp"]
    name = next(n for n in modes if n.startswith("overlapped"))
    over = modes[name]
    megatron = modes.get("megatron_core_tp")
    peer = "" if megatron is None else f", Megatron-Core TP {megatron['step_median_s']:.3f} s"
    return (
        f"{name} step {over['step_median_s']:.3f} s vs plain TP {plain['step_median_s']:.3f} s "
        f"({plain['step_median_s'] / over['step_median_s']:.2f}x), DTensor TP "
        f"{dtensor['step_median_s']:.3f} s{peer}; hidden communication "
        f"{over['hidden_fraction']:.2f} vs {plain['hidden_fraction']:.2f} (plain)"
    )


BENCHMARK = Benchmark(
    name="tp",
    summary="1D tensor parallel GPT step: plain vs sub-batch overlapped vs DTensor TP",
    describe=(
        "A forward + backward of the built-in GPT split by 1D tensor parallelism over all "
        "ranks: interlace's plain TP (one blocking all-reduce per attention and MLP each way), "
        "interlace's overlapped TP (each layer in `subbatches` interleaved sub-batches whose "
        "all-reduces take turns, forward and backward, each layer's last forward all-reduce under "
        "the next layer's first compute; `_in_block`: without that block-boundary step), "
        "torch's DTensor TP (parallelize_module, "
        "Colwise q/k/v/up, Rowwise out_proj/down) and, with the `peers` extra, Megatron-Core's "
        "Column/RowParallelLinear in the same places. The limit of a step is max(compute, "
        "comm); no overlap gives their sum."
    ),
    table=table,
    plot=plot,
    run_rank=run_rank,
    check=check,
    headline=headline,
    key_numbers=mode_step_times,
    options={
        "vocab": 256,
        "seq_len": 128,
        "d_model": 128,
        "layers": 4,
        "heads": 4,
        "batch": 48,
        "subbatches": 2,
        "steps": 3,
    },
    option_help={
        **GPT_OPTION_HELP,
        "batch": "sequences per step (the same on every rank)",
        "subbatches": "sub-batches each layer interleaves in overlapped TP (2 to batch)",
        "steps": "timed samples per mode (their median is kept)",
    },
)
