"""`interlace bench`: side-by-side measurements on an emulated, bandwidth-shaped cluster.

Each benchmark lives in its own module defining `BENCHMARK` (an `interlace.bench.base.Benchmark`);
the registry below maps names to modules so that listing them imports nothing heavy. A later
module joins by adding one line here.
"""

from __future__ import annotations

import importlib

from interlace.bench.base import Benchmark
from interlace.errors import ConfigError

REGISTRY: dict[str, str] = {
    "collectives": "interlace.bench.collectives",
    "overlap": "interlace.bench.overlap",
    "ddp": "interlace.bench.ddp",
    "sketch": "interlace.bench.sketch",
    "svm": "interlace.bench.svm",
    "tp": "interlace.bench.tp",
    "tp3d": "interlace.bench.tp3d",
    "moe": "interlace.bench.moe",
    "planner": "interlace.bench.planner",
    "published": "interlace.bench.published",
    "pipeline": "interlace.bench.pipeline",
    "scale": "interlace.bench.scale",
    "seeds": "interlace.bench.seeds",
    "mfu": "interlace.bench.mfu",
    "memory": "interlace.bench.memory",
    "restart": "interlace.bench.restart",
    "cp": "interlace.bench.cp",
    "precision": "interlace.bench.precision",
}


def get_benchmark(name: str) -> Benchmark:
    """The benchmark registered as `name`; ConfigError listing the valid names otherwise."""
    if name not in REGISTRY:
        raise ConfigError(f"unknown benchmark '{name}'; choose one of: {', '.join(REGISTRY)}")
    return importlib.import_module(REGISTRY[name]).BENCHMARK


__all__ = ["REGISTRY", "Benchmark", "get_benchmark"]
