"""BENCHMARKS.md, generated from the benchmarks' JSON so that no figure is typed by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

from interlace.bench import REGISTRY, get_benchmark

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
        file = results / f"{name}.json"
        if not file.exists():
            sections.append("_Not measured yet._\n")
            continue
        doc = json.loads(file.read_text())
        env = doc["environment"]
        sections.append(
            f"Command:\n\n```\n{doc['command']}\n```\n\n"
            f"Measured {env['started']} on {env['network']}, {env['ranks']} rank(s), "
            f"{env['cpus']} CPU cores, torch {env['torch']}, interlace {env['interlace']}.\n"
        )
        if bench.headline is not None:
            sections.append(f"**Result:** {bench.headline(doc)}.\n")
        sections.append(f"```\n{bench.table(doc)}\n```\n")
        if doc.get("spread"):
            worst_key, worst = max(doc["spread"].items(), key=lambda kv: kv[1])
            sections.append(
                f"Reproducibility: {len(doc['repeats'])} runs; the largest spread "
                f"(max − min) / median of the key figures is {worst:.1%} "
                f"({worst_key}).\n"
            )
        png = Path(os.path.relpath(results / f"{name}.png", page.parent)).as_posix()
        sections.append(f"![{name}]({png})\n")
    return "\n".join(sections)


def write_page(results: Path, page: Path) -> None:
    """Render and write `page` (atomically)."""
    tmp = page.with_suffix(".tmp")
    tmp.write_text(render(results, page))
    os.replace(tmp, page)
