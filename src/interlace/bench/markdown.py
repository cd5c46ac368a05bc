"""BENCHMARKS.md, generated from the benchmarks' JSON so that no figure is typed by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

from interlace.bench import REGISTRY, get_benchmark
from interlace.bench.base import Benchmark
from interlace.bench.runner import spread

INTRO = """# Benchmarks

Every figure below is read from the JSON a benchmark wrote (`benchmarks/results/<name>.json`,
beside its PNG) by `interlace bench report`; rerun the command shown in a section, then
`interlace bench report`, to refresh it.

The network is emulated: each rank runs in its own Linux network namespace, joined to a bridge
by a veth link whose two directions are shaped with `tc tbf` to the stated rate. Only bandwidth
is emulated (`netem` is not available), so links have the microsecond latency of veth rather
than a real network's. A result marked "loopback (not bandwidth-shaped)" ran without namespaces
and says nothing about a bandwidth-bound cluster.
"""


def render(results: Path, page: Path) -> str:
    """The page's Markdown for the JSON files in `results`; image links relative to `page`."""
    sections = [INTRO]
    for name in REGISTRY:
        bench = get_benchmark(name)
        sections.append(f"## {name}\n\n{bench.describe}\n")
        files = [results / f"{name}.json", *sorted(results.glob(f"*/{name}.json"))]
        files = [file for file in files if file.exists()]
        if not files:
            sections.append("_Not measured yet._\n")
        for file in files:
            sections.append(_section(json.loads(file.read_text()), bench, file, page))
    return "\n".join(sections)


def _cap(env: dict) -> str:
    """ ", each rank capped at C cores" when the run had a CPU budget per rank."""
    cores = env.get("cpu_per_rank")
    return f", each rank capped at {cores:g} cores" if cores else ""


def _section(doc: dict, bench: Benchmark, file: Path, page: Path) -> str:
    """One measurement: command, environment, headline, the run's note if it has one, table,
    spread and picture."""
    env = doc["environment"]
    parts = [
        f"Command:\n\n```\n{doc['command']}\n```\n\n"
        f"Measured {env['started']} on {env['network']}, {env['ranks']} rank(s), "
        f"{env['cpus']} CPU cores{_cap(env)}, torch {env['torch']}, interlace "
        f"{env['interlace']}.\n"
    ]
    if bench.headline is not None:
        parts.append(f"**Result:** {bench.headline(doc)}.\n")
    if doc.get("note"):  # what a reader must know of this run, added to its JSON afterwards
        parts.append(f"**Note:** {doc['note']}\n")
    parts.append(f"```\n{bench.table(doc)}\n```\n")
    spreads = spread(doc.get("repeats", []), bench)  # from the raw runs, not a stored figure
    if spreads:
        worst_key, worst = max(spreads.items(), key=lambda kv: kv[1])
        parts.append(
            f"Reproducibility: {len(doc['repeats'])} runs; the largest spread "
            f"(max − min) / median of the key figures is {worst:.1%} ({worst_key}).\n"
        )
    png = Path(os.path.relpath(file.with_suffix(".png"), page.parent)).as_posix()
    parts.append(f"![{doc['benchmark']}]({png})\n")
    return "\n".join(parts)


def write_page(results: Path, page: Path) -> None:
    """Render and write `page` (atomically)."""
    tmp = page.with_suffix(".tmp")
    tmp.write_text(render(results, page))
    os.replace(tmp, page)
