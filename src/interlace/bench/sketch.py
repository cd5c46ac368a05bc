"""`sketch`: gradient compression for sparse gradients — dense all-reduce vs torch's PowerSGD vs
top-k all-gather vs interlace's count-sketch + bitmap all-reduce, on workloads whose gradients
are really sparse (an embedding-heavy click model, a large-vocabulary GPT with untied head).

Per mode and workload, the same seeds and batches: bytes that left each rank's interface per
step (the kernel's counter, so torch's unmetered PowerSGD is measured like the rest), the slowest
rank's step time, samples per second, the loss curve. Encode and decode times are measured on
one rank's real gradient. PowerSGD runs with one DDP bucket: with more it hangs on gloo in
torch 2.13.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from interlace import comm
from interlace.bench.base import Benchmark, RankContext, check_names
from interlace.bench.compress_workloads import Workload, click_workload, gpt_workload
from interlace.bench.timing import median, slowest
from interlace.compress import make_comm_hook, sketch
from interlace.errors import ConfigError
from interlace.parallel.data.apply import SINGLE_BUCKET_MB
from interlace.plotting import new_figure, save_figure

MODES = ("dense", "powersgd", "topk", "sketch")
WORKLOADS = {"click": click_workload, "gpt": gpt_workload}
_METER = comm.CommMeter()


def _mode_options(mode: str, options: dict[str, Any]) -> dict[str, Any]:
    if mode == "topk":
        return {"fraction": options["topk_fraction"]}
    if mode == "powersgd":
        return {"matrix_approximation_rank": options["powersgd_rank"]}
    return {}


def _mean_over_ranks(value: torch.Tensor, group: comm.Group) -> float:
    value = value.detach().clone()
    comm.all_reduce(value, group, meter=_METER)
    return float(value) / group.size


def _train(ctx: RankContext, workload: str, mode: str) -> dict[str, Any]:
    group, options = ctx.group, ctx.options
    work: Workload = WORKLOADS[workload](rank=group.rank, seed=options["seed"])
    bucket_mb = SINGLE_BUCKET_MB if mode == "powersgd" else options["bucket_mb"]
    ddp = DistributedDataParallel(work.model, process_group=group.pg, bucket_cap_mb=bucket_mb)
    state, hook = make_comm_hook(mode, group, **_mode_options(mode, options))
    ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=options["lr"])
    losses, step_s, tx = [], [], []
    for step in range(options["warmup"] + options["steps"]):
        batch = next(work.batches)
        dist.barrier(group=group.pg)
        sent, start = ctx.tx_bytes(), time.perf_counter()
        loss = work.loss(ddp, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed, sent = time.perf_counter() - start, ctx.tx_bytes() - sent
        losses.append(_mean_over_ranks(loss, group))
        if step >= options["warmup"]:
            step_s.append(slowest(elapsed, group))
            tx.append(sent)
    rows = len(batch[0])
    result = {
        "losses": losses,
        "step_s": step_s,
        "tx_bytes": tx,
        "step_median_s": median(step_s),
        "tx_median_bytes": median(tx),
        "samples_per_s": rows * group.size / median(step_s),
    }
    if hasattr(state, "summary"):
        result["hook_summary"] = state.summary()
    return result


def _codec_times(workload: str, options: dict[str, Any]) -> dict[str, float]:
    """Encode (bitmap + hashes + sketch) and decode (peel schedule + peel) seconds on this
    rank's flat gradient after one backward."""
    work = WORKLOADS[workload](seed=options["seed"])
    loss = work.loss(work.model, next(work.batches))
    loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for p in work.model.parameters()])
    start = time.perf_counter()
    sketch.pack_bits(flat != 0)
    positions = (flat != 0).nonzero().squeeze(1)
    cols = sketch.sketch_columns(positions.numel(), sketch.DEFAULT_WIDTH["peel"])
    hashes = sketch.CountSketch.from_seed(0, 3, cols, flat.device)
    columns, signs = hashes.columns(positions), hashes.signs(positions, flat.dtype)
    table = sketch.encode(flat[positions], columns, signs, cols)
    encode_s = time.perf_counter() - start
    start = time.perf_counter()
    sketch.Decoder("peel", columns, signs, cols)(table)
    return {
        "encode_s": encode_s,
        "decode_s": time.perf_counter() - start,
        "numel": flat.numel(),
        "nnz": positions.numel(),
    }


def run_rank(ctx: RankContext) -> dict[str, Any]:
    """Every mode on every workload, then the codec timings."""
    out: dict[str, Any] = {}
    for workload in ctx.options["workloads"].split(","):
        modes = {mode: _train(ctx, workload, mode) for mode in ctx.options["modes"].split(",")}
        out[workload] = {"modes": modes, "codec": _codec_times(workload, ctx.options)}
    return {"workloads": out}


def _final_loss(mode: dict[str, Any]) -> float:
    tail = mode["losses"][-5:]
    return sum(tail) / len(tail)


def table(doc: dict[str, Any]) -> str:
    """Per workload: one row per mode."""
    lines = []
    for name, w in doc["result"]["workloads"].items():
        dense = w["modes"].get("dense")
        codec = w["codec"]
        lines.append(
            f"{name}: {codec['numel'] / 1e6:.2f} M gradient entries, "
            f"{codec['nnz'] / codec['numel']:.2%} non-zero on one rank; sketch encode "
            f"{codec['encode_s'] * 1e3:.1f} ms, decode {codec['decode_s'] * 1e3:.1f} ms"
        )
        lines.append(
            f"  {'mode':9s} {'MB/step':>8s} {'vs dense':>9s} {'step s':>7s} "
            f"{'speedup':>8s} {'samples/s':>10s} {'final loss':>10s} {'vs dense':>9s}"
        )
        for mode, m in w["modes"].items():
            rel_bytes = m["tx_median_bytes"] / dense["tx_median_bytes"] if dense else float("nan")
            speed = dense["step_median_s"] / m["step_median_s"] if dense else float("nan")
            loss_rel = _final_loss(m) / _final_loss(dense) - 1 if dense else float("nan")
            lines.append(
                f"  {mode:9s} {m['tx_median_bytes'] / 1e6:8.2f} {rel_bytes:9.1%} "
                f"{m['step_median_s']:7.3f} {speed:7.2f}x {m['samples_per_s']:10.0f} "
                f"{_final_loss(m):10.4f} {loss_rel:+9.2%}"
            )
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Loss curves and bytes/step time bars per workload."""
    workloads = doc["result"]["workloads"]
    fig, axes = new_figure(len(workloads), 2, figsize=(10, 3.4 * len(workloads)))
    for row, (name, w) in enumerate(workloads.items()):
        curves, bars = axes[row]
        for mode, m in w["modes"].items():
            curves.plot(m["losses"], label=mode, lw=1)
        curves.set_title(f"{name}: training loss (mean over ranks)", fontsize=9)
        curves.set_xlabel("step")
        curves.legend(fontsize=8)
        modes = list(w["modes"])
        bars.bar(
            [i - 0.2 for i in range(len(modes))],
            [w["modes"][m]["tx_median_bytes"] / 1e6 for m in modes],
            0.4,
            label="MB sent per step",
        )
        twin = bars.twinx()
        twin.bar(
            [i + 0.2 for i in range(len(modes))],
            [w["modes"][m]["step_median_s"] for m in modes],
            0.4,
            color="C1",
            label="step s",
        )
        bars.set_xticks(range(len(modes)), modes)
        bars.set_ylabel("MB per step per rank")
        twin.set_ylabel("seconds per step")
        bars.set_title(f"{name}: bytes (left bars) and step time (right bars)", fontsize=9)
    fig.suptitle(
        f"gradient compression, {doc['environment']['ranks']} ranks, "
        f"{doc['environment']['network']}",
        fontsize=9,
    )
    save_figure(fig, path, dpi=100)


def check(options: dict[str, Any]) -> None:
    """Known workloads and modes, positive counts."""
    check_names(options, "workloads", WORKLOADS)
    check_names(options, "modes", MODES)
    if options["steps"] < 1 or options["warmup"] < 0 or not 0 < options["topk_fraction"] <= 1:
        raise ConfigError("steps >= 1, warmup >= 0 and 0 < topk_fraction <= 1 are required")


def headline(doc: dict[str, Any]) -> str:
    """Sketch vs dense: bytes saved and step speedup per workload, and loss difference."""
    parts = []
    for name, w in doc["result"]["workloads"].items():
        modes = w["modes"]
        if "sketch" not in modes or "dense" not in modes:
            continue
        s, d = modes["sketch"], modes["dense"]
        saved = 1 - s["tx_median_bytes"] / d["tx_median_bytes"]
        speed = d["step_median_s"] / s["step_median_s"]
        loss = _final_loss(s) / _final_loss(d) - 1
        text = (
            f"{name}: sketch sends {saved:.0%} fewer bytes than dense (target 85%), "
            f"{speed:.2f}x its step speed (target 2x), final loss {loss:+.2%}"
        )
        if "powersgd" in modes:
            text += (
                f", {modes['powersgd']['step_median_s'] / s['step_median_s']:.2f}x "
                "PowerSGD's step speed"
            )
        parts.append(text)
    return "; ".join(parts)


def key_numbers(result: dict[str, Any]) -> dict[str, float]:
    """Step time of every mode on every workload."""
    return {
        f"{w} {m} step_s": v["step_median_s"]
        for w, data in result["workloads"].items()
        for m, v in data["modes"].items()
    }


BENCHMARK = Benchmark(
    name="sketch",
    summary="sparse-gradient compression: dense vs PowerSGD vs top-k vs count-sketch",
    describe=(
        "Data-parallel training of two workloads with sparse gradients (a click model with four "
        "embedding tables of 370 k rows in all, and a 32 k-vocabulary GPT with an untied head), "
        "each with dense all-reduce, torch's PowerSGD hook (one bucket), top-k all-gather and "
        "interlace's count-sketch + bitmap all-reduce, same seeds and batches. The physical "
        "limit of a step is its compute time plus the compressed bytes over the link; the "
        "bytes are what left each rank's network interface."
    ),
    table=table,
    plot=plot,
    run_rank=run_rank,
    check=check,
    headline=headline,
    key_numbers=key_numbers,
    options={
        "workloads": "click,gpt",
        "modes": ",".join(MODES),
        "steps": 20,
        "warmup": 3,
        "lr": 1e-3,
        "bucket_mb": 4.0,
        "topk_fraction": 0.01,
        "powersgd_rank": 4,
        "seed": 0,
    },
    option_help={
        "workloads": "workloads, comma-separated: click (embedding-heavy), gpt (large vocabulary)",
        "modes": "gradient exchanges compared, comma-separated",
        "steps": "timed training steps per workload and mode",
        "warmup": "untimed steps before them",
        "lr": "Adam learning rate",
        "bucket_mb": "DDP bucket size, MB (PowerSGD runs with one bucket)",
        "topk_fraction": "share of the gradient's entries top-k sends, in (0, 1]",
        "powersgd_rank": "PowerSGD's matrix approximation rank",
        "seed": "seed of the workloads' weights and batches",
    },
)
