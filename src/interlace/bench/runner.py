"""Run one benchmark on the emulated cluster and write `<out>/<name>.json` and `<name>.png`.

The JSON holds the command, the environment (network, link rate, ranks, versions), the options,
the result of rank 0 and every rank's raw result.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from interlace import __version__
from interlace.bench import get_benchmark
from interlace.bench.base import Benchmark
from interlace.bench.cluster import Cluster
from interlace.bench.cpu_quota import CpuQuota
from interlace.errors import ConfigError
from interlace.mesh import default_device
from interlace.rates import parse_rate
from interlace.report import strict_json


class BenchFailed(RuntimeError):
    """A rank of the benchmark failed or timed out; the message holds its stderr tail."""


def parse_options(bench: Benchmark, pairs: list[str]) -> dict[str, Any]:
    """Apply `key=value` overrides to the benchmark's default options on this machine
    (`Benchmark.defaults`, each override typed like its default); ConfigError for unknown keys
    or bad values."""
    defaults = bench.defaults()
    options = dict(defaults)
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in options:
            raise ConfigError(
                f"option '{pair}' is not key=value with a key of '{bench.name}': "
                f"{', '.join(f'{k}={v}' for k, v in defaults.items()) or 'none'} "
                "(`interlace bench list` says what each means)"
            )
        default = options[key]
        try:
            options[key] = (
                raw.lower() in ("1", "true", "yes")
                if isinstance(default, bool)
                else type(default)(raw)
                if default is not None
                else raw
            )
        except ValueError:
            raise ConfigError(f"option {key}={raw!r} is not a {type(default).__name__}") from None
    return options


def announce(bench: Benchmark, options: dict[str, Any], ranks: int, bandwidth: str) -> str:
    """The line printed before a benchmark starts: what it will run and where (its `preview`,
    else its options and the emulated cluster's ranks and links, or this process's device)."""
    if bench.preview is not None:
        where = bench.preview(options)
    else:
        where = " ".join(f"{k}={v}" for k, v in options.items()) or "no options"
        if bench.distributed:
            link = "on loopback" if bandwidth == "loopback" else f"linked at {bandwidth}"
            where += f" on {ranks} CPU rank(s) (gloo) {link}"
        else:
            where += f" locally on {default_device()}"
    return f"bench {bench.name}: {where}"


def spread(results: list[dict[str, Any]], bench: Benchmark) -> dict[str, float]:
    """(max − min) / median of each key number over repeated results."""
    if bench.key_numbers is None or len(results) < 2:
        return {}
    values = [bench.key_numbers(r) for r in results]
    return {
        key: (max(v[key] for v in values) - min(v[key] for v in values))
        / statistics.median(v[key] for v in values)
        for key in values[0]
    }


def run_benchmark(
    name: str,
    ranks: int | None,
    bandwidth: str,
    out: Path,
    option_pairs: list[str],
    command: str,
    timeout_s: float = 3600,
    repeat: int = 1,
    cpu_per_rank: float | None = None,
) -> dict[str, Any]:
    """Run benchmark `name` `repeat` times on `ranks` ranks linked at `bandwidth` ('1gbit',
    ... or 'loopback'); write JSON + PNG into `out`, print the table; return the JSON document.
    `command` is recorded as the command line that made the figures. The document's `result`
    is the first run's; `repeats` holds every run's and `spread` their relative spread.
    `cpu_per_rank`: each rank capped at that many cores' time (`bench.cpu_quota`)."""
    bench = get_benchmark(name)
    options = parse_options(bench, option_pairs)
    if bench.check is not None:
        bench.check(options)
    ranks = ranks or bench.default_ranks
    if bench.distributed and not 1 <= ranks <= 8:
        raise ConfigError(f"--ranks {ranks} must be between 1 and 8 (2-4 fit this machine)")
    if repeat < 1:
        raise ConfigError(f"--repeat {repeat} must be >= 1")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ConfigError(f"--timeout {timeout_s} must be a finite number of seconds > 0, e.g. 600")
    if cpu_per_rank is not None and not (math.isfinite(cpu_per_rank) and cpu_per_rank > 0):
        raise ConfigError(
            f"--cpu-per-rank {cpu_per_rank} must be a finite number of cores > 0, e.g. 0.5"
        )
    if cpu_per_rank is not None and not bench.distributed:
        raise ConfigError(f"--cpu-per-rank applies to multi-rank benchmarks, not '{name}'")
    rate = None if bandwidth == "loopback" else parse_rate(bandwidth)
    line = announce(bench, options, ranks, bandwidth)
    print(line if repeat == 1 else f"{line}; {repeat} times", flush=True)
    started = time.time()
    environment: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "interlace": __version__,
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    runs: list[list[dict[str, Any]]] = []
    with _terminate_as_interrupt():
        if bench.distributed:
            with (
                Cluster(ranks, rate) as cluster,
                CpuQuota(ranks, cpu_per_rank)
                if cpu_per_rank
                else contextlib.nullcontext() as quota,
            ):
                environment.update(
                    network=cluster.network,
                    ranks=ranks,
                    link_rate_gbps=rate / 1e9 if cluster.shaped else None,
                    fallback_reason=cluster.fallback_reason,
                    cpu_per_rank=cpu_per_rank,
                )
                if cluster.fallback_reason and rate is not None:
                    print(
                        f"interlace bench: no shaped network ({cluster.fallback_reason}); "
                        "measuring on loopback",
                        file=sys.stderr,
                    )
                shaped_rate = rate if cluster.shaped else None
                runs = [
                    _launch(cluster, bench, options, timeout_s, shaped_rate, quota)
                    for _ in range(repeat)
                ]
        else:
            environment.update(network="single process", ranks=1)
            runs = [[bench.run_local(options)] for _ in range(repeat)]
    environment["seconds"] = time.time() - started
    results = [per_rank[0] for per_rank in runs]
    document = {
        "benchmark": name,
        "command": command,
        "environment": environment,
        "options": options,
        "result": results[0],
        "per_rank": runs[0] if bench.distributed else [],
        "repeats": results,
        "spread": spread(results, bench),
    }
    print(f"{name} on {environment['network']}, {environment['ranks']} rank(s)")
    print(bench.table(document))
    if document["spread"]:
        worst = max(document["spread"].items(), key=lambda kv: kv[1])
        print(f"spread over {repeat} runs: largest {worst[1]:.1%} ({worst[0]})")
    _write(document, bench, out)  # after the table: a field JSON cannot hold loses no figures
    print(f"wrote {out / f'{name}.json'} and {out / f'{name}.png'}")
    return document


def _write(document: dict[str, Any], bench: Benchmark, out: Path) -> None:
    """JSON (strict: `report.strict_json`) and PNG, each written to a temporary name and renamed
    when complete."""
    out.mkdir(parents=True, exist_ok=True)
    name = document["benchmark"]
    tmp_json, tmp_png = out / f".{name}.json.tmp", out / f".{name}.tmp.png"
    tmp_json.write_text(
        json.dumps(strict_json(document, f"benchmark {name}"), indent=1, allow_nan=False)
    )
    bench.plot(document, tmp_png)
    os.replace(tmp_json, out / f"{name}.json")
    os.replace(tmp_png, out / f"{name}.png")


def _launch(
    cluster: Cluster,
    bench: Benchmark,
    options: dict[str, Any],
    timeout_s: float,
    rate_bps: float | None,
    quota: CpuQuota | None = None,
) -> list[dict[str, Any]]:
    port = 29531 if cluster.shaped else _free_port()
    threads = max(1, (os.cpu_count() or 1) // cluster.ranks)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory(prefix="interlace-bench-") as tmp:
        procs = []
        for rank in range(cluster.ranks):
            argv = [
                sys.executable,
                "-m",
                "interlace.bench.worker",
                bench.name,
                "--rank",
                str(rank),
                "--world",
                str(cluster.ranks),
                "--master",
                cluster.master_addr,
                "--port",
                str(port),
                "--ifname",
                cluster.ifname,
                "--options",
                json.dumps(options),
                "--result",
                f"{tmp}/rank{rank}.json",
            ]
            if rate_bps is not None:
                argv += ["--rate-bps", str(rate_bps)]
            stderr = open(f"{tmp}/rank{rank}.err", "w")  # noqa: SIM115 (closed below)
            proc = subprocess.Popen(
                cluster.rank_command(rank, argv),
                env=env,
                stderr=stderr,
                stdout=subprocess.DEVNULL,
            )
            procs.append((proc, stderr))
            if quota is not None:  # `ip netns exec` execs the worker: the same process
                quota.attach(rank, proc.pid)
        try:
            _wait(procs, tmp, timeout_s)
        finally:
            for proc, stderr in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                stderr.close()
        return [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(cluster.ranks)]


def _wait(procs: list, tmp: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [proc.poll() for proc, _ in procs]
        failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            time.sleep(0.5)
            tail = Path(f"{tmp}/rank{failed[0]}.err").read_text()[-3000:]
            raise BenchFailed(f"rank {failed[0]} failed (exit code {codes[failed[0]]}):\n{tail}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            raise BenchFailed(f"benchmark still running after {timeout_s:.0f} s")
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _terminate_as_interrupt:
    """Turn SIGTERM into KeyboardInterrupt so the cluster is torn down on `kill` too."""

    def __enter__(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._raise)

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    @staticmethod
    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
