"""`collectives`: achieved bus bandwidth of each collective vs the shaped link rate.

Sizes follow nccl-tests: all_reduce, reduce_scatter and broadcast move a tensor of S bytes,
all_gather produces S bytes, all_to_all exchanges S bytes per rank. Bus bandwidth =
S / time × factor, the factor making it comparable to one link's rate whatever the op and rank
count: all_reduce 2(n−1)/n, all_gather / reduce_scatter / all_to_all (n−1)/n, broadcast 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from interlace import comm
from interlace.bench.base import Benchmark, RankContext, check_names
from interlace.bench.timing import median, sample
from interlace.errors import ConfigError
from interlace.plotting import new_figure, save_figure

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
_METER = comm.CommMeter()


def bus_factor(op: str, n: int) -> float:
    """Multiplier from algorithm bandwidth (S / time) to bus bandwidth for `op` on n ranks."""
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def _call(op: str, size: int, group: comm.Group):
    n, elements = group.size, max(group.size, size // 4 // group.size * group.size)
    full = torch.ones(elements)
    shard = torch.ones(elements // n)
    out = torch.empty(elements)
    calls = {
        "all_reduce": lambda: comm.all_reduce(full, group, meter=_METER),
        "all_gather": lambda: comm.all_gather(out, shard, group, meter=_METER),
        "reduce_scatter": lambda: comm.reduce_scatter(shard, full, group, meter=_METER),
        "all_to_all": lambda: comm.all_to_all(out, full, group, meter=_METER),
        "broadcast": lambda: comm.broadcast(full, 0, group, meter=_METER),
    }
    return calls[op], elements * 4


def run_rank(ctx: RankContext) -> dict[str, Any]:
    """Every op at sizes min_size·4^k up to max_size; per size the median of the samples."""
    rows = []
    size = ctx.options["min_size"]
    sizes = []
    while size <= ctx.options["max_size"]:
        sizes.append(size)
        size *= 4
    for op in ctx.options["ops"].split(","):
        for size in sizes:
            call, nbytes = _call(op, size, ctx.group)
            samples = sample(call, ctx.group, min_seconds=ctx.options["min_seconds"])
            seconds = median(samples)
            busbw = nbytes / seconds * bus_factor(op, ctx.group.size) * 8 / 1e9
            rows.append(
                {
                    "op": op,
                    "bytes": nbytes,
                    "seconds": seconds,
                    "samples": samples,
                    "algbw_gbps": nbytes / seconds * 8 / 1e9,
                    "busbw_gbps": busbw,
                    "link_fraction": busbw * 1e9 / ctx.rate_bps if ctx.rate_bps else None,
                }
            )
    return {"rows": rows}


def table(doc: dict[str, Any]) -> str:
    """Op, size, median time, bus bandwidth and fraction of the link per row."""
    lines = [f"{'op':15s} {'size':>10s} {'time ms':>10s} {'busbw Gbit/s':>13s} {'of link':>8s}"]
    for row in doc["result"]["rows"]:
        frac = f"{row['link_fraction']:.0%}" if row["link_fraction"] is not None else "-"
        lines.append(
            f"{row['op']:15s} {_size(row['bytes']):>10s} {row['seconds'] * 1e3:10.2f} "
            f"{row['busbw_gbps']:13.3f} {frac:>8s}"
        )
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Bus bandwidth vs size per op, with the link rate as the physical limit."""
    fig, ax = new_figure(figsize=(7, 4.2))
    rows = doc["result"]["rows"]
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        ax.plot([r["bytes"] for r in mine], [r["busbw_gbps"] for r in mine], "o-", ms=3, label=op)
    rate = doc["environment"].get("link_rate_gbps")
    if rate:
        ax.axhline(rate, color="k", ls="--", lw=1, label=f"link rate {rate:g} Gbit/s")
    ax.set_xscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (Gbit/s)")
    ax.set_title(
        f"collectives, {doc['environment']['ranks']} ranks, {doc['environment']['network']}",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def check(options: dict[str, Any]) -> None:
    """Known ops, positive sizes."""
    check_names(options, "ops", OPS)
    if not 0 < options["min_size"] <= options["max_size"]:
        raise ConfigError(
            f"need 0 < min_size <= max_size, got {options['min_size']} and {options['max_size']}"
        )


def headline(doc: dict[str, Any]) -> str:
    """Largest all_reduce's share of the link (target >= 85%)."""
    rows = [r for r in doc["result"]["rows"] if r["op"] == "all_reduce"]
    if not rows or rows[-1]["link_fraction"] is None:
        return "no shaped all_reduce measured"
    top = rows[-1]
    verdict = "meets" if top["link_fraction"] >= 0.85 else "misses"
    return (
        f"all_reduce of {_size(top['bytes'])} reaches {top['link_fraction']:.0%} of the "
        f"link rate ({top['busbw_gbps']:.3f} Gbit/s bus bandwidth): {verdict} the 85% target"
    )


def key_numbers(result: dict[str, Any]) -> dict[str, float]:
    """Bus bandwidth of each op at the largest size."""
    return {
        f"{r['op']} busbw": r["busbw_gbps"]
        for r in result["rows"]
        if r["bytes"] == max(x["bytes"] for x in result["rows"] if x["op"] == r["op"])
    }


BENCHMARK = Benchmark(
    name="collectives",
    summary="bus bandwidth of all_reduce, all_gather, reduce_scatter, all_to_all, broadcast",
    describe=(
        "Each collective over message sizes from 1 KB to 256 MB, timed as the slowest rank's "
        "median. Bus bandwidth (nccl-tests convention) is comparable with one link's rate for "
        "every op; the physical limit is the shaped link rate (less TCP/IP header overhead, "
        "about 3% at MTU 1500). Small messages are latency-bound, large ones bandwidth-bound; "
        "messages below the token bucket (1 ms of traffic) pass faster than the rate. gloo "
        "runs reduce_scatter_tensor as a full all-reduce, so by the nccl-tests convention its "
        "bus bandwidth tops out near half the link; its broadcast is a flat tree from the root, "
        "whose single link carries every copy, so it falls as ranks are added."
    ),
    table=table,
    plot=plot,
    run_rank=run_rank,
    check=check,
    headline=headline,
    key_numbers=key_numbers,
    options={"min_size": 1024, "max_size": 256 * 2**20, "ops": ",".join(OPS), "min_seconds": 0.5},
    option_help={
        "min_size": "smallest message, bytes (sizes grow 4x from it)",
        "max_size": "largest message, bytes",
        "ops": "collectives measured, comma-separated",
        "min_seconds": "least seconds of samples per op and size (their median is kept)",
    },
)
